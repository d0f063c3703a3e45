"""NVMe offload building blocks: async file I/O, the buffer pool, the swap directory
(errors a user can act on) and the optimizer / parameter swappers, in one process."""

from __future__ import annotations

import errno
import os
import shutil
from pathlib import Path

import pytest
import torch

from shardspeed.zero.offload import OffloadPolicy
from shardspeed.zero.offload.buffer_pool import BufferPool, PoolExhausted
from shardspeed.zero.offload.file_io import AsyncFileIO, _parts
from shardspeed.zero.offload.optimizer_swapper import OptimizerSwapper
from shardspeed.zero.offload.param_swapper import ParamSwapper
from shardspeed.zero.offload.policy import OPTIMIZER_KEY, PARAM_KEY, SwapSettings
from shardspeed.zero.offload.swap_dir import SwapDir


def _settings(path: Path, key: str = OPTIMIZER_KEY, **kw: object) -> SwapSettings:
    base = {"buffer_count": 4, "buffer_size": None, "pin_memory": False}
    base.update(kw)
    return SwapSettings(key=key, nvme_path=str(path), block_size=4096, threads=2, **base)


def _io(swap_dir: SwapDir, threads: int = 2) -> AsyncFileIO:
    return AsyncFileIO(threads, 4096, swap_dir.no_space_error)


# -- file I/O -------------------------------------------------------------------------------
def test_parts_cover_the_bytes_in_block_multiples() -> None:
    assert _parts(0, 2, 4096) == []
    assert _parts(10_000, 2, 4096) == [(0, 8192), (8192, 10_000)]
    assert _parts(100, 4, 4096) == [(0, 100)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_async_writes_and_reads_round_trip(tmp_path: Path, dtype: torch.dtype) -> None:
    swap = SwapDir(str(tmp_path), OPTIMIZER_KEY, rank=0, needed_bytes=0)
    io = _io(swap, threads=3)
    tensors = [torch.randn(n).to(dtype) for n in (1, 1000, 12_345)]  # several blocks/threads
    writes = [io.write(t, swap.file(f"{i}.swp")) for i, t in enumerate(tensors)]  # all in flight
    for w in writes:
        w.wait()
    outs = [torch.empty_like(t) for t in tensors]
    reads = [io.read(swap.file(f"{i}.swp"), o) for i, o in enumerate(outs)]
    for r in reads:
        r.wait()
    for t, o in zip(tensors, outs):
        assert torch.equal(t, o)
    io.close()
    swap.close()
    assert not swap.path.exists()


def test_swap_dirs_of_two_engines_do_not_collide_and_are_removed(tmp_path: Path) -> None:
    a = SwapDir(str(tmp_path), OPTIMIZER_KEY, rank=0, needed_bytes=0)
    b = SwapDir(str(tmp_path), OPTIMIZER_KEY, rank=0, needed_bytes=0)
    assert a.path != b.path and a.path.parent == b.path.parent == tmp_path
    assert "rank0" in a.path.name
    a.close()
    assert not a.path.exists() and b.path.exists()
    b.close()
    assert os.listdir(tmp_path) == []


# -- errors a user can act on -------------------------------------------------------------
def test_missing_nvme_path_names_key_value_and_fix(tmp_path: Path) -> None:
    missing = tmp_path / "no_such_dir"
    with pytest.raises(ValueError) as err:
        SwapDir(str(missing), PARAM_KEY, rank=0, needed_bytes=1)
    msg = str(err.value)
    assert "zero_optimization.offload_param.nvme_path does not exist" in msg
    assert str(missing) in msg and "mkdir -p" in msg


def test_unwritable_nvme_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "access", lambda *a, **k: False)  # root ignores chmod
    with pytest.raises(ValueError, match=r"offload_optimizer.nvme_path is not writable"):
        SwapDir(str(tmp_path), OPTIMIZER_KEY, rank=0, needed_bytes=1)


def test_not_enough_space_is_checked_up_front(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=1 << 20))
    with pytest.raises(ValueError) as err:
        SwapDir(str(tmp_path), OPTIMIZER_KEY, rank=0, needed_bytes=1 << 30)
    msg = str(err.value)
    assert "not enough free space under zero_optimization.offload_optimizer.nvme_path" in msg
    assert "1.000 GiB needed" in msg and "0.001 GiB free" in msg and '"device": "cpu"' in msg
    assert os.listdir(tmp_path) == []  # nothing created


def _no_space(*args: object, **kwargs: object) -> int:
    raise OSError(errno.ENOSPC, "No space left on device")


def test_disk_full_during_a_write_raises_the_same_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    swap = SwapDir(str(tmp_path), OPTIMIZER_KEY, rank=0, needed_bytes=0)
    io = _io(swap)
    monkeypatch.setattr(os, "pwrite", _no_space)
    handle = io.write(torch.ones(1000), swap.file("x.swp"))
    with pytest.raises(ValueError, match="not enough free space under .*offload_optimizer"):
        handle.wait()
    monkeypatch.setattr(os, "posix_fallocate", _no_space)  # preallocation hits it first
    with pytest.raises(ValueError, match="not enough free space"):
        io.reserve(swap.file("y.swp"), 4000)
    io.close()
    swap.close()


# -- the buffer pool ----------------------------------------------------------------------------
def test_buffer_pool_is_bounded_and_recycles_after_writes(tmp_path: Path) -> None:
    swap = SwapDir(str(tmp_path), OPTIMIZER_KEY, rank=0, needed_bytes=0)
    io = _io(swap)
    pool = BufferPool(2, 4096, pin_memory=False)
    a, b = pool.acquire(), pool.acquire()
    assert a != b and pool.num_held == 2 and pool.try_acquire(1) is None
    with pytest.raises(PoolExhausted):
        pool.acquire()
    view = pool.view(a, 1024, torch.float32)
    view.fill_(3.0)
    pool.release(a, after=io.write(view, swap.file("a.swp")))  # free once the write finished
    c = pool.acquire()  # waits for that write, then reuses its buffer
    assert c == a and pool.num_held == 2
    pool.release(b)
    pool.release(c)
    assert pool.num_free == 2 and pool.try_acquire(2) is not None
    with pytest.raises(AssertionError):
        pool.view(a, 1025, torch.float32)  # larger than a buffer
    out = torch.empty(1024)
    io.read(swap.file("a.swp"), out).wait()
    assert torch.equal(out, torch.full((1024,), 3.0))
    io.close()
    swap.close()


# -- the optimizer swapper ------------------------------------------------------------------------
def _swapper(tmp_path: Path, buffer_count: int) -> tuple[OptimizerSwapper, SwapDir, AsyncFileIO]:
    swap = SwapDir(str(tmp_path), OPTIMIZER_KEY, rank=0, needed_bytes=0)
    io = _io(swap)
    return OptimizerSwapper(_settings(tmp_path, buffer_count=buffer_count), swap, io), swap, io


@pytest.mark.parametrize("buffer_count", [3, 6])  # one master at a time / read-ahead overlap
def test_swapped_adam_matches_in_memory_adam(tmp_path: Path, buffer_count: int) -> None:
    torch.manual_seed(0)
    sizes = [700, 33, 1500]
    init = [torch.randn(n) for n in sizes]
    ref = [t.clone() for t in init]
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, fused=True)
    swapper, swap, io = _swapper(tmp_path, buffer_count)
    masters = [t.clone() for t in init]
    for m in masters:
        swapper.register(m)
    assert all(m.numel() == 0 for m in masters)  # swapped out
    opt = torch.optim.AdamW(masters, lr=1e-2, fused=True)
    written: list[torch.Tensor] = [torch.empty(0)] * 3

    def write_back(i: int) -> None:
        written[i] = masters[i].detach().clone()

    swapper.attach(opt, masters, [lambda i=i: write_back(i) for i in range(3)])
    for step in range(3):
        grads = [torch.randn(n, generator=torch.Generator().manual_seed(step * 10 + i))
                 for i, n in enumerate(sizes)]  # fmt: skip
        for r, g in zip(ref, grads):
            r.grad = g.clone()
        ref_opt.step()
        swapper.step(grads)
        assert swapper.pool.num_held == 0 and swapper.pool.count == buffer_count
        for w, r in zip(written, ref):
            assert torch.equal(w, r)
    assert all(m.numel() == 0 for m in masters)
    assert all(s["exp_avg"].numel() == 0 for s in opt.state.values())  # state swapped too
    with swapper.resident(write=False):
        for m, r in zip(masters, ref):
            assert torch.equal(m, r)
            assert torch.equal(opt.state[m]["exp_avg_sq"], ref_opt.state[r]["exp_avg_sq"])
    assert swapper.storage_bytes()["nvme"] == 3 * 4 * sum(sizes)
    swapper.close()
    io.close()
    swap.close()


def test_buffer_count_too_small_for_the_optimizer_state(tmp_path: Path) -> None:
    swapper, swap, io = _swapper(tmp_path, buffer_count=2)
    master = torch.randn(100)
    swapper.register(master)
    opt = torch.optim.AdamW([master], lr=1e-2)
    swapper.attach(opt, [master], [lambda: None])
    with pytest.raises(ValueError) as err:
        swapper.step([torch.randn(100)])  # Adam's two state tensors + the master: 3 buffers
    msg = str(err.value)
    assert "zero_optimization.offload_optimizer.buffer_count is too small" in msg
    assert "(got 2)" in msg and '"buffer_count": 6' in msg
    io.close()
    swap.close()


def test_resident_write_and_overwrite_master(tmp_path: Path) -> None:
    swapper, swap, io = _swapper(tmp_path, buffer_count=2)
    master = torch.zeros(10)
    swapper.register(master)
    opt = torch.optim.SGD([master], lr=1.0)
    swapper.attach(opt, [master], [lambda: None])
    with swapper.resident(write=True):
        master.fill_(2.0)
    with swapper.resident(write=False):
        assert torch.equal(master, torch.full((10,), 2.0))
        master.fill_(5.0)  # dropped: not written
    swapper.overwrite_master(master, torch.arange(10, dtype=torch.bfloat16))
    swapper.step([torch.ones(10)])
    with swapper.resident(write=False):
        assert torch.equal(master, torch.arange(10.0) - 1.0)
    io.close()
    swap.close()


# -- the parameter swapper ---------------------------------------------------------------------
def _param_swapper(tmp_path: Path, **kw: object) -> tuple[ParamSwapper, SwapDir, AsyncFileIO]:
    swap = SwapDir(str(tmp_path), PARAM_KEY, rank=0, needed_bytes=0)
    io = _io(swap)
    settings = _settings(tmp_path, key=PARAM_KEY, **{"buffer_count": 3, "buffer_size": 64, **kw})
    return ParamSwapper(settings, swap, io), swap, io


def test_param_buffer_size_smaller_than_a_shard(tmp_path: Path) -> None:
    swapper, swap, io = _param_swapper(tmp_path, buffer_size=64)
    with pytest.raises(ValueError) as err:
        swapper.register(torch.zeros(65))
    msg = str(err.value)
    assert "zero_optimization.offload_param.buffer_size is smaller than a parameter shard" in msg
    assert "(got 64)" in msg and '"buffer_size": 65' in msg
    io.close()
    swap.close()


def test_param_loads_read_ahead_in_the_recorded_order(tmp_path: Path) -> None:
    swapper, swap, io = _param_swapper(tmp_path)
    shards = [torch.full((50,), float(i), dtype=torch.bfloat16) for i in range(5)]
    ids = [swapper.register(s) for s in shards]
    device = torch.device("cpu")
    for _ in range(3):  # forward order, then backward order, every step
        for i in ids + ids[::-1]:
            out = swapper.load(i, device)
            assert torch.equal(out, shards[i])
            assert swapper.pool.num_held <= swapper.pool.count
    assert swapper.prefetch_hits > 0
    # a store drops a prefetched stale copy: the next load sees the new values
    swapper.load(ids[0], device)  # recorded successor ids[1] is now being read ahead
    swapper.store(ids[1], torch.full((50,), 9.0))
    assert torch.equal(swapper.load(ids[1], device), torch.full((50,), 9.0, dtype=torch.bfloat16))
    assert swapper.storage_bytes() == {"swap_buffers": 3 * 50 * 2, "nvme": 5 * 50 * 2}
    swapper.close()
    io.close()
    swap.close()


def test_policy_reads_nvme_settings_and_aio() -> None:
    from shardspeed.config import load_config

    cfg = load_config(
        {
            "train_micro_batch_size_per_gpu": 1,
            "aio": {"block_size": 65536, "thread_count": 3},
            "zero_optimization": {
                "stage": 3,
                "offload_optimizer": {"device": "nvme", "nvme_path": "/x", "buffer_count": 8},
                "offload_param": {"device": "cpu", "pin_memory": False},
            },
        }
    )
    policy = OffloadPolicy.from_zero_config(cfg.zero_optimization, cfg.aio)
    assert policy.optimizer and policy.param
    assert (policy.optimizer_device, policy.param_device) == ("nvme", "cpu")
    assert policy.optimizer_swap is not None and policy.param_swap is None
    assert policy.optimizer_swap.buffer_count == 8 and policy.optimizer_swap.threads == 3
    assert policy.optimizer_swap.block_size == 65536 and policy.param_pin_memory is False
