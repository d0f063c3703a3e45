"""Collective-sequence fingerprints, divergence search, settings and failure reports (no ranks)."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch

from shardspeed.comm.backend import resolve_timeout
from shardspeed.comm.errors import (
    CollectiveError,
    CollectiveTimeoutError,
    collective_failure,
)
from shardspeed.comm.sequence import (
    SequenceRecorder,
    first_divergence,
    format_divergence,
    format_ranks,
    group_shape,
    key_hash,
)
from shardspeed.comm.sequence_check import CheckSettings
from shardspeed.config import ConfigError, load_config

F32 = torch.float32


def _recorder(ops: list[tuple[str, tuple[int, ...], int, str | None]]) -> SequenceRecorder:
    rec = SequenceRecorder()
    rec.start(history=64)
    for op, ranks, numel, tag in ops:
        rec.record_ranks(op, ranks, numel, F32, tag)
    return rec


def test_group_shape_is_translation_invariant_and_tells_axes_apart() -> None:
    assert group_shape([2, 3]) == group_shape([0, 1]) == (0, 1)  # tensor groups of dp peers
    assert group_shape([4, 6]) == group_shape([0, 2])  # data groups of two pipe stages
    assert group_shape([0, 1]) != group_shape([0, 2])  # tensor axis vs data axis
    assert group_shape([5, 1, 4, 0]) == (0, 1, 4, 5)


def test_key_hash_is_deterministic_and_p2p_is_direction_free() -> None:
    # a literal: the same in every process (Python's str hash is salted per process)
    assert key_hash("all_reduce", (0, 1), 8, "float32", "x") == 810712332563237550
    assert key_hash("send", (0, 1), 4, "float32", None) == key_hash(
        "recv", (0, 1), 4, "float32", None
    )
    assert key_hash("all_reduce", (0, 1), 8, "float32", "a") != key_hash(
        "all_reduce", (0, 1), 8, "float32", "b"
    )


def test_fingerprint_agrees_on_equal_sequences_and_is_order_sensitive() -> None:
    a = [("all_reduce", (0, 1), 8, "m1"), ("broadcast", (0, 1), 4, "m2")]
    b = [("all_reduce", (2, 3), 8, "m1"), ("broadcast", (2, 3), 4, "m2")]  # translated group
    assert _recorder(a).fingerprint == _recorder(b).fingerprint
    assert _recorder(a).fingerprint != _recorder(a[::-1]).fingerprint
    other_numel = [("all_reduce", (0, 1), 9, "m1"), a[1]]
    assert _recorder(a).fingerprint != _recorder(other_numel).fingerprint


def test_note_op_feeds_the_recorder_unless_paused() -> None:
    from shardspeed.comm.logger import note_op, reset_state, set_current_tag
    from shardspeed.comm.sequence import SEQUENCE

    try:
        note_op("all_reduce", None, 3, F32, False)  # not recording yet
        SEQUENCE.start(history=8)
        with set_current_tag("block.0"):
            note_op("all_reduce", None, 3, F32, False)
        with SEQUENCE.paused():
            note_op("all_reduce", None, 1, F32, False)  # e.g. the check's own all-reduce
        # a background thread (e.g. an async checkpoint commit on its own group): not recorded
        worker = threading.Thread(target=note_op, args=("barrier", None, 0, None, False))
        worker.start()
        worker.join()
        (record,) = SEQUENCE.snapshot(0).records
        assert (record.index, record.numel, record.tag) == (0, 3, "block.0")
        assert record.dtype == "float32"
    finally:
        reset_state()
    assert not SEQUENCE.enabled and SEQUENCE.count == 0


def test_bounded_history() -> None:
    rec = SequenceRecorder()
    rec.start(history=4)
    for i in range(10):
        rec.record_ranks("all_reduce", (0, 1), i, F32, None)
    snap = rec.snapshot(0)
    assert snap.count == 10 and [r.index for r in snap.records] == [6, 7, 8, 9]
    assert snap.at(5) is None and snap.at(9).numel == 9
    with pytest.raises(ValueError, match="history must be >= 1"):
        rec.start(history=0)


def _snapshots(per_rank: list[list[tuple[str, tuple[int, ...], int, str | None]]], history=64):
    out = []
    for rank, ops in enumerate(per_rank):
        rec = SequenceRecorder()
        rec.start(history=history)
        for op, ranks, numel, tag in ops:
            rec.record_ranks(op, ranks, numel, F32, tag)
        out.append(rec.snapshot(rank))
    return out


def test_first_divergence_names_the_differing_collective_on_each_rank() -> None:
    common = [
        ("all_reduce", (0, 1), 100, f"zero2.reduce_grads group 0 bucket {i}") for i in range(3)
    ]
    rank0 = [*common, ("all_reduce", (0, 1), 8, "moe.expert_a"), ("all_reduce", (0, 1), 5, "x")]
    rank1 = [*common, ("all_reduce", (0, 1), 8, "moe.expert_b"), ("all_reduce", (0, 1), 5, "x")]
    div = first_divergence(_snapshots([rank0, rank1]))
    assert div is not None and div.index == 3 and div.exact
    text = format_divergence(div)
    assert "first divergent collective: #3" in text
    assert "-> #3 all_reduce numel=8 dtype=float32 group=[0, 1] module/phase='moe.expert_a'" in text
    assert "module/phase='moe.expert_b'" in text
    assert "#2 all_reduce numel=100" in text  # context before the divergence
    assert first_divergence(_snapshots([rank0, rank0])) is None


def test_first_divergence_with_an_extra_collective_on_one_rank() -> None:
    base = [("all_reduce", (0, 1), 4, "a"), ("broadcast", (0, 1), 4, "b")]
    extra = [base[0], ("all_reduce", (1,), 8, "rank1_only"), base[1]]
    div = first_divergence(_snapshots([base, extra]))
    assert div is not None and div.index == 1
    text = format_divergence(div)
    assert "-> #1 broadcast" in text and "-> #1 all_reduce numel=8" in text
    assert "group=[1]" in text
    shorter = first_divergence(_snapshots([base[:1], base]))
    assert "no collective #1: this rank issued 1 in total" in format_divergence(shorter)


def test_dropped_history_makes_the_divergence_inexact() -> None:
    ops0 = [("all_reduce", (0, 1), 1, "a")] * 10
    ops1 = [("all_reduce", (0, 1), 2, "a")] + ops0[1:]  # differs at #0, history keeps 4
    div = first_divergence(_snapshots([ops0, ops1], history=4))
    assert div is not None and not div.exact and div.index == 6
    assert "at or before #6" in format_divergence(div)
    assert "raise collective_check.history" in format_divergence(div)


def test_format_ranks() -> None:
    assert format_ranks([0, 1]) == "[0, 1]"
    assert format_ranks(list(range(8))) == "[0-7]"
    assert format_ranks(list(range(0, 40, 2))).endswith("... (20 ranks)]")


# ----------------------------------------------------------------------- settings
def test_check_settings_from_config_and_environment() -> None:
    cfg = load_config({"train_batch_size": 2, "collective_check": {"enabled": True, "interval": 7}})
    s = CheckSettings.resolve(cfg.collective_check, {})
    assert (s.enabled, s.interval, s.history) == (True, 7, 4096)
    assert not CheckSettings.resolve(
        load_config({"train_batch_size": 2}).collective_check, {}
    ).enabled
    env = CheckSettings.resolve(None, {"SHARDSPEED_COLLECTIVE_CHECK": "3"})
    assert (env.enabled, env.interval) == (True, 3)
    assert not CheckSettings.resolve(
        cfg.collective_check, {"SHARDSPEED_COLLECTIVE_CHECK": "0"}
    ).enabled
    with pytest.raises(ValueError, match="SHARDSPEED_COLLECTIVE_CHECK='often'"):
        CheckSettings.resolve(None, {"SHARDSPEED_COLLECTIVE_CHECK": "often"})


def test_collective_check_config_errors_name_the_key() -> None:
    with pytest.raises(ConfigError, match="collective_check.interval"):
        load_config({"train_batch_size": 2, "collective_check": {"interval": 0}})
    with pytest.raises(ConfigError, match="did you mean 'interval'"):
        load_config({"train_batch_size": 2, "collective_check": {"intervall": 5}})


def test_resolve_timeout_precedence() -> None:
    assert (
        resolve_timeout(timedelta(seconds=5), {"SHARDSPEED_COMM_TIMEOUT": "9"}).total_seconds() == 5
    )
    assert resolve_timeout(None, {"SHARDSPEED_COMM_TIMEOUT": "2.5"}).total_seconds() == 2.5
    assert resolve_timeout(None, {"DEEPSPEED_TIMEOUT": "2"}) == timedelta(minutes=2)
    assert resolve_timeout(None, {}) == timedelta(minutes=30)
    with pytest.raises(ValueError, match="SHARDSPEED_COMM_TIMEOUT='-1'"):
        resolve_timeout(None, {"SHARDSPEED_COMM_TIMEOUT": "-1"})
    with pytest.raises(ValueError, match="must be a datetime.timedelta"):
        resolve_timeout(30, {})  # type: ignore[arg-type]


# ----------------------------------------------------------------------- failure reports
def _entry(seq: int, op: str = "all_reduce", tag: str | None = "zero2.reduce_grads bucket 0"):
    return (seq, op, None, 4, F32, tag, True)


def test_timeout_report_names_rank_collective_tag_and_recent_ops() -> None:
    recent = [_entry(i, tag=f"t{i}") for i in range(5)] + [_entry(5)]
    exc = RuntimeError("[gloo/unbound_buffer.cc:78] Timed out waiting 2000ms for recv operation")
    err = collective_failure(recent[-1], exc, recent, waited=True)
    assert isinstance(err, CollectiveTimeoutError) and isinstance(err, RuntimeError)
    text = str(err)
    assert text.startswith("rank 0 (of 1): wait() on all_reduce timed out after")
    assert "(2 s)" in text  # parsed from the backend message
    assert "collective: #5 all_reduce async numel=4 dtype=float32" in text
    assert "module/phase: zero2.reduce_grads bucket 0" in text
    assert "-> #5 all_reduce" in text and "#0 all_reduce" in text and "t4" in text
    assert "SHARDSPEED_COMM_TIMEOUT" in text and "backend error: [gloo" in text


def test_failure_classification() -> None:
    entry = _entry(0)
    closed = RuntimeError("Connection closed by peer [127.0.0.1]:123")
    assert type(collective_failure(entry, closed, [entry], waited=False)) is CollectiveError
    after = RuntimeError("Application timeout caused pair closure")
    assert type(collective_failure(entry, after, [entry], waited=False)) is CollectiveError
    shape = RuntimeError("output tensor must have the same size as input * world_size")
    assert collective_failure(entry, shape, [entry], waited=False) is None  # not ours
    nested = CollectiveTimeoutError("already reported")
    assert collective_failure(entry, nested, [entry], waited=False) is None
