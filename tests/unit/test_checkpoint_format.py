"""Checkpoint format helpers: tag resolution (incomplete saves), sizes, client state, errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardspeed.checkpoint import get_fp32_state_dict_from_checkpoint
from shardspeed.checkpoint.consolidate import parse_size
from shardspeed.checkpoint.engine_api import _check_tag
from shardspeed.checkpoint.format import (
    MANIFEST,
    build_index,
    join_client_state,
    overlapping,
    resolve_tag,
    split_client_state,
)


def _tag(root: Path, name: str, complete: bool = True) -> None:
    (root / name).mkdir(parents=True)
    if complete:
        (root / name / MANIFEST).write_text("{}")


def test_resolve_tag_skips_incomplete_and_tmp_dirs(tmp_path: Path) -> None:
    assert resolve_tag(tmp_path / "missing", None) is None
    _tag(tmp_path, "global_step2")
    _tag(tmp_path, "global_step4.tmp-abc")  # a save killed before the rename
    (tmp_path / "global_step4.tmp-abc" / MANIFEST).write_text("{}")
    _tag(tmp_path, "global_step6", complete=False)  # no manifest: never loaded
    assert resolve_tag(tmp_path, None) == "global_step2"
    (tmp_path / "latest").write_text("global_step6")  # latest names an incomplete tag
    assert resolve_tag(tmp_path, None) == "global_step2"
    (tmp_path / "latest").write_text("global_step2\n")
    assert resolve_tag(tmp_path, None) == "global_step2"
    with pytest.raises(ValueError, match="global_step6.*incomplete.*global_step2"):
        resolve_tag(tmp_path, "global_step6")


def test_overlap_maps_saved_pieces_onto_a_new_fragment() -> None:
    pieces = [["r0", "k0", 0, 10], ["r1", "k1", 10, 20], ["r2", "k2", 20, 30]]
    assert overlapping(pieces, 5, 25) == [
        ("r0", "k0", 5, 10, 0),
        ("r1", "k1", 0, 10, 5),
        ("r2", "k2", 0, 5, 15),
    ]
    assert overlapping(pieces, 30, 40) == []


def test_build_index_sorts_pieces_and_skips_client_tensors() -> None:
    metas = [
        {
            "file": f"rank{r}.safetensors",
            "tensors": [
                {"key": f"w|master|{s}", "name": "w", "kind": "master", "shape": [4, 5],
                 "start": s, "end": s + 10, "dtype": "float32"},
                {"key": "c", "name": "c", "kind": "client", "shape": [1], "start": 0, "end": 1,
                 "dtype": "int64"},
            ],
        }
        for r, s in ((1, 10), (0, 0))
    ]  # fmt: skip
    index = build_index(metas)
    assert list(index) == ["w"]
    assert [p[2] for p in index["w"]["kinds"]["master"]] == [0, 10]


def test_client_state_round_trip_and_errors() -> None:
    state = {"epoch": 3, "nested": {"t": torch.ones(2), "xs": [1, torch.zeros(1)]}}
    as_json, tensors = split_client_state(state)
    assert as_json["nested"]["t"] == {"__tensor__": "__client__|nested.t"}
    back = join_client_state(as_json, tensors)
    assert back["epoch"] == 3 and torch.equal(back["nested"]["xs"][1], torch.zeros(1))
    with pytest.raises(ValueError, match="client_state value at obj.*JSON"):
        split_client_state({"obj": object()})
    with pytest.raises(ValueError, match="string keys"):
        split_client_state({1: 2})


def test_sizes_tags_and_empty_checkpoints(tmp_path: Path) -> None:
    assert parse_size("5GB") == 5 * 10**9
    assert parse_size("1MiB") == 2**20
    assert parse_size("8KB") == 8000 and parse_size(123) == 123
    with pytest.raises(ValueError, match="max_shard_size='lots'"):
        parse_size("lots")
    with pytest.raises(ValueError, match="not a plain directory name"):
        _check_tag("a/b")
    with pytest.raises(ValueError, match="holds no finished checkpoint"):
        get_fp32_state_dict_from_checkpoint(tmp_path)
