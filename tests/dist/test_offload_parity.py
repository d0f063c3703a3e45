"""ZeRO-Offload / ZeRO-Infinity match the one-process reference (world 2).

Same model, data, reference and tolerances as ``test_zero_parity.py`` /
``test_zero3_parity.py`` (fp32 AdamW: 1e-5 relative; bf16 with SGD + momentum:
rtol = 2 * eps, atol = lr * steps * eps). Offload only moves where state lives and
where the optimizer runs, so the same tolerances hold:

* stages 1 and 2 with ``offload_optimizer: cpu`` x {fp32, bf16} x GAS {1, 3};
* stage 3 with ``offload_param: cpu`` (alone, and with ``offload_optimizer: cpu``);
* stage 3 with NVMe: optimizer + parameters swapped (fp32 AdamW, GAS 3, clipping),
  optimizer only (bf16, SGD + momentum), parameters only (fp32, masters on the device).

Each run also checks that the offloaded state really is elsewhere: separate host tensors
(not views of the device buffers, even though the device is the CPU here), swap files
while training and none after ``engine.destroy()``.
"""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import torch
from parity_common import ParitySpec, make_model, train_steps
from test_zero_parity import check_against_reference

from shardspeed.testing import run_distributed

WORLD = 2


def offload_spec(stage: int, precision: str, gas: int, **zero: object) -> ParitySpec:
    spec = ParitySpec(stage=stage, precision=precision, gas=gas, world=WORLD)
    if precision != "fp32":
        spec.optimizer, spec.lr = "SGD", 0.1
    if gas == 3:
        spec.clip = 0.05  # active: the global norm is well above this
        spec.bucket_size = 3000  # several buckets at stages 1/2
    zc: dict = {"stage": stage, "reduce_bucket_size": spec.bucket_size, **zero}
    if stage == 3:
        zc["stage3_param_persistence_threshold"] = 0
    spec.extra["zero_optimization"] = zc
    return spec


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _check_placement(engine, spec: ParitySpec) -> None:
    """The offloaded state is held apart from the device buffers (or in swap files)."""
    zc = spec.extra["zero_optimization"]
    opt = zc.get("offload_optimizer", {}).get("device", "none")
    param = zc.get("offload_param", {}).get("device", "none")
    if spec.stage < 3:
        for group in engine.flat_groups:
            device = _storage(group.flat_param)
            assert group.host_grads and len(group.host_grads) == len(group.masters)
            assert all(_storage(m) != device and m.device.type == "cpu" for m in group.masters)
        return
    flats = [f for g in engine.flat_groups for f in g.flats]
    for flat in flats:
        shard, master = flat.residency.resident, flat.masters[0]
        if opt != "none":
            assert master is not shard and flat.host_grads
        if param == "cpu":  # a host copy; each gather copies it to a new device tensor
            assert shard is not None and _storage(shard) != _storage(flat.shard_grads[0])
            src = flat.residency.storage.gather_source()
            assert _storage(src) != _storage(shard) and torch.equal(src, shard)
        if param == "nvme":
            assert shard is None and all(p.ds_tensor.numel() == 0 for p in flat.params)
        if opt == "nvme":
            assert master.numel() == 0  # swapped out between steps


def offload_run(spec: ParitySpec) -> tuple[list[float], dict[str, torch.Tensor], dict]:
    import shardspeed
    from shardspeed.zero import GatheredParameters

    engine, _, _, _ = shardspeed.initialize(model=make_model(spec), config=spec.config())
    _check_placement(engine, spec)
    losses = train_steps(engine, spec, range(spec.steps))
    _check_placement(engine, spec)
    info = {"memory": engine.memory_breakdown()}
    swapper = engine.offload.param_swapper
    if swapper is not None:
        info["reads"], info["prefetch_hits"] = swapper.reads_issued, swapper.prefetch_hits
    params = list(engine.module.parameters())
    with GatheredParameters(params):
        final = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    return losses, final, info


def _run_all(specs: list[ParitySpec]) -> list:
    return [offload_run(s) for s in specs]


def _check(specs: list[ParitySpec], per_rank: list) -> list[dict]:
    check_against_reference(specs, [[r[:2] for r in results] for results in per_rank])
    return [results[i][2] for results in per_rank for i in range(len(specs))]


def test_stage_1_2_cpu_optimizer_offload_parity() -> None:
    cpu = {"offload_optimizer": {"device": "cpu"}}
    specs = [
        offload_spec(stage, precision, gas, **cpu)
        for stage, precision, gas in itertools.product((1, 2), ("fp32", "bf16"), (1, 3))
    ]
    infos = _check(specs, run_distributed(_run_all, WORLD, specs, timeout=300))
    for info in infos:  # fp32 masters, their host gradients and the optimizer state
        mem = info["memory"]
        assert mem["master_params"] > 0 and mem["optimizer_state"] > 0, mem
        assert mem["host"] == 2 * mem["master_params"] + mem["optimizer_state"], mem
        assert mem["device"] == mem["total"] - mem["host"] and mem["nvme"] == 0


def test_stage3_cpu_param_offload_parity() -> None:
    param = {"offload_param": {"device": "cpu"}}
    both = {**param, "offload_optimizer": {"device": "cpu"}}
    specs = [offload_spec(3, "fp32", 1, **param), offload_spec(3, "bf16", 3, **both)]
    infos = _check(specs, run_distributed(_run_all, WORLD, specs, timeout=300))
    for info in infos:
        mem = info["memory"]
        assert mem["host"] > 0 and mem["device"] < mem["total"], mem


def _nvme(path: Path, **extra: object) -> dict:
    return {"device": "nvme", "nvme_path": str(path), **extra}


def test_stage3_nvme_offload_parity(tmp_path: Path) -> None:
    both = offload_spec(
        3,
        "fp32",
        3,
        offload_optimizer=_nvme(tmp_path, buffer_count=6),  # 2 masters of 3 tensors: overlap
        offload_param=_nvme(tmp_path, buffer_count=3, buffer_size=4096),
    )
    opt_only = offload_spec(3, "bf16", 1, offload_optimizer=_nvme(tmp_path))
    param_only = offload_spec(3, "fp32", 1, offload_param=_nvme(tmp_path, buffer_size=4096))
    specs = [both, opt_only, param_only]
    results = run_distributed(_run_all, WORLD, specs, timeout=300)
    infos = _check(specs, results)
    for i, info in enumerate(infos):
        mem = info["memory"]
        assert mem["nvme"] > 0 and mem["swap_buffers"] > 0, mem
        if i % len(specs) != 1:  # parameter swapping read ahead along the recorded order
            assert info["prefetch_hits"] > 0 and info["prefetch_hits"] <= info["reads"], info
    assert os.listdir(tmp_path) == []  # destroy() removed every swap directory
