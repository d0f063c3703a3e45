"""Hostile universal checkpoints: a tag or parameter name that leaves the folder, a pickle
that names a code global, a truncated state file. Each is a clear error naming the file or
name, and nothing runs (the universal loader unpickles through the import's allow-list)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch

from shardspeed.checkpoint.universal_checkpoint import (
    import_universal_checkpoint,
    resolve_universal_tag,
)

GOLDEN = Path(__file__).resolve().parents[1] / "goldens" / "deepspeed_layout" / "universal"


class _Payload:
    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


@pytest.fixture
def universal(tmp_path: Path) -> Path:
    folder = tmp_path / "universal"
    shutil.copytree(GOLDEN, folder)
    return folder


def test_the_untouched_golden_imports(universal: Path, tmp_path: Path) -> None:
    tag = resolve_universal_tag(universal, None)
    assert (import_universal_checkpoint(universal / tag, tmp_path / "out", "t")).is_dir()


def test_a_tag_outside_the_folder_is_refused(universal: Path) -> None:
    (universal / "latest_universal").write_text("../../etc")
    with pytest.raises(ValueError, match="not a relative path inside"):
        resolve_universal_tag(universal, None)


def test_a_parameter_name_outside_the_folder_is_refused(universal: Path, tmp_path: Path) -> None:
    tag_dir = universal / resolve_universal_tag(universal, None)
    states = tag_dir / "mp_rank_00_model_states.pt"
    model = torch.load(states, weights_only=False)
    model["param_shapes"] = [{"../../../../etc": [2]}]
    torch.save(model, states)
    with pytest.raises(ValueError, match="not a relative path inside"):
        import_universal_checkpoint(tag_dir, tmp_path / "out", "t")


def test_a_code_global_is_refused_and_never_runs(universal: Path, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    tag_dir = universal / resolve_universal_tag(universal, None)
    torch.save({"param": _Payload(f"touch {marker}")}, tag_dir / "zero" / "0.weight" / "fp32.pt")
    with pytest.raises(Exception, match="refusing to unpickle") as info:
        import_universal_checkpoint(tag_dir, tmp_path / "out", "t")
    assert "system" in str(info.value)
    assert not marker.exists()


def test_a_truncated_state_file_names_itself(universal: Path, tmp_path: Path) -> None:
    tag_dir = universal / resolve_universal_tag(universal, None)
    path = tag_dir / "zero" / "0.weight" / "exp_avg.pt"
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(Exception, match="exp_avg.pt") as info:
        import_universal_checkpoint(tag_dir, tmp_path / "out", "t")
    assert "truncated or corrupted" in str(info.value)
