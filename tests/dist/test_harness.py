"""The multi-process harness: results, failures, timeouts, pool reuse."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.distributed as dist

from shardspeed import comm
from shardspeed.testing import (
    DistributedTestError,
    DistributedTestTimeout,
    distributed_test,
    reset_hooks,
    run_distributed,
    shutdown_pools,
)
from shardspeed.testing.pool import get_pool

# ----------------------------------------------------------------- rank bodies


def _identity(tag: str, scale: int = 1) -> dict:
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    return {
        "rank": dist.get_rank(),
        "world": dist.get_world_size(),
        "env_rank": int(os.environ["RANK"]),
        "env_world": int(os.environ["WORLD_SIZE"]),
        "sum": t.item() * scale,
        "tag": tag,
        "threads": torch.get_num_threads(),
    }


def _raise_on_rank1() -> int:
    if dist.get_rank() == 1:
        raise ValueError("boom from rank one")
    dist.barrier()  # rank 0 blocks on the failed peer: must be torn down, not hang
    return 0


def _sleep_on_rank1(seconds: float) -> int:
    if dist.get_rank() == 1:
        time.sleep(seconds)
    elif seconds > 0:  # rank 0 blocks in a tagged collective its peer never joins
        with comm.set_current_tag("bucket 7"):
            comm.all_reduce(torch.ones(5))
    return dist.get_rank()


def _exit_on_rank0() -> None:
    if dist.get_rank() == 0:
        print("about to vanish", flush=True)
        os._exit(7)
    dist.barrier()


def _failing_assert() -> None:
    value = dist.get_rank() + 2
    assert value == 3


def _pid() -> int:
    return os.getpid()


_STATE: list[int] = []


def _mutate_state() -> int:
    _STATE.append(1)
    return len(_STATE)


# ----------------------------------------------------------------- tests


@pytest.mark.parametrize("world_size", [1, 2, 4])
def test_results_ordered_by_rank(world_size: int) -> None:
    results = run_distributed(_identity, world_size, "x", scale=2)
    expected_sum = 2.0 * world_size * (world_size + 1) / 2
    assert [r["rank"] for r in results] == list(range(world_size))
    for rank, r in enumerate(results):
        assert r["world"] == r["env_world"] == world_size
        assert r["env_rank"] == rank
        assert r["sum"] == expected_sum
        assert r["tag"] == "x"
        assert r["threads"] == 1


def test_exception_on_one_rank_reports_traceback_and_recovers() -> None:
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_raise_on_rank1, 2, timeout=30)
    text = str(info.value)
    assert "===== rank 1 =====" in text
    assert "ValueError: boom from rank one" in text
    assert "_raise_on_rank1" in text  # the remote traceback names the failing frame
    assert "_worker.py" not in text.split("===== rank 1 =====")[1].split("_raise_on_rank1")[0]
    assert 1 in info.value.failures and 0 not in info.value.failures
    # the pool was torn down and respawns cleanly
    assert [r["rank"] for r in run_distributed(_identity, 2, "again")] == [0, 1]


def test_assertions_are_rewritten_in_workers() -> None:
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_failing_assert, 2)
    assert "assert 2 == 3" in str(info.value)  # rank 0's values, as pytest would show them
    assert sorted(info.value.failures) == [0]


def test_timeout_names_hung_ranks_with_stacks_and_recent_ops() -> None:
    start = time.monotonic()
    with pytest.raises(DistributedTestTimeout) as info:
        run_distributed(_sleep_on_rank1, 2, 60.0, timeout=2.0)
    assert time.monotonic() - start < 15
    text = str(info.value)
    assert "ranks [0, 1] of 2 had not finished fn" in text
    assert "_sleep_on_rank1" in text  # the main-thread stacks
    assert "'op': 'all_reduce'" in text and "'tag': 'bucket 7'" in text  # rank 0's last op
    assert run_distributed(_sleep_on_rank1, 2, 0.0) == [0, 1]  # a fresh pool works


def test_timeout_message_separates_returned_ranks() -> None:
    from shardspeed.testing.pool import _format_timeout

    text = _format_timeout([1], [0], 2.0, {0: "stack0", 1: "stack1"}, 2)
    assert "ranks [1] of 2 had not finished fn" in text
    assert "ranks [0] had returned and were waiting" in text
    assert "===== rank 0 (returned, waiting) =====\nstack0" in text


def test_worker_death_is_reported_with_output() -> None:
    with pytest.raises(DistributedTestError) as info:
        run_distributed(_exit_on_rank0, 2, timeout=30)
    text = str(info.value)
    assert "rank 0 process exited unexpectedly (exit code 7)" in text
    assert "about to vanish" in text


def test_pool_is_reused_and_warm_calls_are_fast() -> None:
    shutdown_pools()
    start = time.perf_counter()
    first_pids = run_distributed(_pid, 2)
    cold = time.perf_counter() - start
    warm_times = []
    for _ in range(3):
        start = time.perf_counter()
        pids = run_distributed(_pid, 2)
        warm_times.append(time.perf_counter() - start)
        assert pids == first_pids
    warm = min(warm_times)
    assert warm < cold
    assert warm < 2.0, f"warm call overhead {warm:.3f}s"


def test_reset_hooks_run_between_calls() -> None:
    # the hook is registered inside the worker; without it the second call would see 2
    assert run_distributed(_register_and_mutate, 1) == [1]
    assert run_distributed(_register_and_mutate, 1) == [1]
    assert _STATE == [] and _STATE.clear not in reset_hooks  # parent untouched


def _register_and_mutate() -> int:
    from shardspeed.testing import register_reset_hook

    register_reset_hook(_STATE.clear)
    torch.set_default_dtype(torch.float64)  # must not leak into the next call either
    return _mutate_state()


def _default_dtype() -> str:
    return str(torch.get_default_dtype())


def test_torch_state_is_reset_between_calls() -> None:
    run_distributed(_register_and_mutate, 1)
    assert run_distributed(_default_dtype, 1) == ["torch.float32"]


def test_unpicklable_fn_is_rejected_early() -> None:
    with pytest.raises(ValueError, match="module-level function"):
        run_distributed(lambda: 1, 2)
    with pytest.raises(ValueError, match="world_size"):
        run_distributed(_pid, 0)


@distributed_test(world_size=2)
def test_decorator_runs_body_on_every_rank(tmp_path) -> None:
    rank = dist.get_rank()
    (tmp_path / f"r{rank}").write_text("ok")
    dist.barrier()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r0", "r1"]


@pytest.mark.parametrize("value", [3, 5])
@distributed_test(world_size=2)
def test_decorator_with_parametrize(value: int) -> None:
    t = torch.tensor([float(value)])
    dist.all_reduce(t)
    assert t.item() == 2 * value


@distributed_test(world_size=2)
def test_skip_inside_ranks_skips_the_test() -> None:
    pytest.skip("skipped from inside the ranks")


def _skip_on_rank0() -> None:
    if dist.get_rank() == 0:
        pytest.skip("only rank 0 skips")


def test_skip_on_one_rank_does_not_wait_for_the_timeout() -> None:
    start = time.monotonic()
    with pytest.raises(pytest.skip.Exception, match="only rank 0 skips"):
        run_distributed(_skip_on_rank0, 2, timeout=60)
    assert time.monotonic() - start < 10


def test_world_size_marker_is_applied() -> None:
    marks = [m for m in test_decorator_with_parametrize.pytestmark if m.name == "world_size"]
    assert marks and marks[0].args == (2,)
    assert get_pool(2).world_size == 2


# ----------------------------------------------------------------- parity helper (single process)
def test_assert_close_rel_names_the_worst_element() -> None:
    from shardspeed.testing.parity import assert_close_rel

    assert_close_rel(torch.tensor([1.0, 2.0]), [1.0, 2.0 + 1e-7], rtol=1e-6)
    assert_close_rel([float("nan")], [float("nan")], equal_nan=True)
    actual = torch.tensor([[1.0, 2.0], [3.0, 4.5]], dtype=torch.bfloat16)
    with pytest.raises(AssertionError) as info:
        assert_close_rel(
            actual, torch.tensor([[1.0, 2.01], [3.0, 4.0]]), rtol=1e-2, msg="step 3 loss"
        )
    text = str(info.value)
    assert text.startswith("step 3 loss: 1 of 4 elements differ")
    assert "worst at index (1, 1): actual=4.5 expected=4.0" in text
    assert "rel_err=1.250e-01" in text
    with pytest.raises(AssertionError, match="shape mismatch"):
        assert_close_rel(torch.zeros(3), torch.zeros(4))
    with pytest.raises(AssertionError, match="worst at index \\(0,\\)"):
        assert_close_rel([float("nan"), 1.0], [0.0, 1.0])
