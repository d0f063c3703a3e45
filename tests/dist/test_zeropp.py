"""ZeRO++ (qwZ, hpZ, qgZ) on gloo ranks against exact ZeRO-3.

* the quantized collectives stay within their element-wise error bounds
  (:func:`~shardspeed.zero.zeropp.quantize.error_bound`, qgZ's
  :func:`~shardspeed.zero.zeropp.grads.reduction_error_bound`), on 4 ranks posing as 2
  hosts x 2 (``SHARDSPEED_HOST_ID``) and on one host; qgZ buckets launched back to back
  (stage 2 chained at the next launch) equal one-at-a-time reductions bitwise;
* hpZ alone is exact (it only changes where the backward gather reads) and its backward
  gathers run over the node group only;
* qgZ's first reduced gradient is within the bound the received scales give;
* losses with each piece stay within the first-order bound that the quantization error
  bounds give (``zeropp_common.first_order_tolerance``), 5 steps here, 50 in the slow tier;
* comm bytes per step with all three on are at most 0.3x plain ZeRO-3's (comms logger).
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch
from zeropp_common import first_order_tolerance, report_table, run_many, zeropp_spec

from shardspeed.testing import run_distributed

ALL = dict(zero_quantized_weights=True, zero_hpz_partition_size=2, zero_quantized_gradients=True)
TWO_HOSTS = ["a", "a", "b", "b"]


def _collectives(seed: int) -> dict[str, Any]:
    """qgZ reductions and qwZ / hpZ gathers of random data against their bounds."""
    import torch.distributed as dist

    from shardspeed import comm
    from shardspeed.zero.zeropp import weights as weights_mod
    from shardspeed.zero.zeropp.grads import (
        QuantizedReduction,
        error_bound_from,
        reduction_error_bound,
    )
    from shardspeed.zero.zeropp.groups import build_groups
    from shardspeed.zero.zeropp.quantize import error_bound
    from shardspeed.zero.zeropp.weights import HpzGroup, WeightGathers, compute_gathers

    rank, world = comm.get_rank(), comm.get_world_size()
    shard = 300  # not a multiple of the block

    def data(r: int, scale: float = 1.0) -> torch.Tensor:
        g = torch.Generator().manual_seed(seed + r)
        x = torch.randn(world, shard, generator=g) * scale  # (W, S): rank r's bucket
        x[:, :50] *= 100.0  # blocks of very different magnitude
        return x

    rows = [data(r) for r in range(world)]
    exact = sum(rows)[rank]  # (S,)
    ratios = {}
    for hosts in (TWO_HOSTS, ["a"] * world, ["a", "b", "c", "d"]):
        os.environ["SHARDSPEED_HOST_ID"] = hosts[rank]
        groups = build_groups(None, 2, hierarchical=True)
        for bits in (4, 8):
            reduction = QuantizedReduction(
                world_size=world, intra=groups.intra, intra_size=groups.intra_size,
                inter=groups.inter, inter_size=groups.inter_size, bits=bits,
            )  # fmt: skip
            mine = (rank * shard, (rank + 1) * shard)
            summed = reduction.reduce(rows[rank].reshape(-1).clone(), mine)
            bound = reduction_error_bound(rows, groups.intra_size, groups.inter_size, bits, 256)[
                rank
            ]
            err = (summed - exact).abs()
            assert bool((err <= bound * 1.0001 + 1e-5).all()), float((err - bound).max())
            stages = torch.tensor(reduction.max_stage_bounds, dtype=torch.float64)
            comm.all_reduce(stages, op=dist.ReduceOp.MAX)
            runtime_bound = error_bound_from(stages.tolist(), groups.inter_size)
            assert float(err.max()) <= runtime_bound * 1.0001 + 1e-5
            ratios[(hosts[-1], bits)] = (float((err / bound).max()), groups.inter_size)
            # overlapped: three buckets launched back to back (each launch starts the
            # previous one's stage 2), waited in launch order = one at a time, bitwise
            buckets = [rows[rank].reshape(-1) * (k + 1) for k in range(3)]
            launched = [reduction.launch(b.clone(), mine) for b in buckets]
            for b, one in zip(buckets, launched):
                one.work.wait()
                assert torch.equal(one.out, reduction.reduce(b.clone(), mine))
    os.environ.pop("SHARDSPEED_HOST_ID")
    # qwZ: a quantized gather, then (hpZ) the same weights from the secondary copy
    hpz = build_groups(None, 2, hierarchical=False)
    gathers = WeightGathers(
        world=world, dp_group=None, quantized=True,
        hpz=HpzGroup(hpz.hpz, hpz.hpz_size, hpz.hpz_rank), dtype=torch.float32,
        device=torch.device("cpu"),
    )  # fmt: skip
    shards = torch.stack([data(r, 0.02)[0] for r in range(world)])  # (W, S)
    exact = gathers.finish(gathers.start(lambda: shards[rank].clone(), world * shard))
    assert torch.equal(exact, shards.reshape(-1))  # not a compute gather: plain fp
    with compute_gathers():
        primary = gathers.finish(gathers.start(lambda: shards[rank].clone(), world * shard))
    wbound = error_bound(shards, 8, 256).reshape(-1)
    werr = (primary - shards.reshape(-1)).abs()
    assert bool((werr <= wbound * 1.0001 + 1e-9).all())
    assert gathers.max_error_bound >= float(werr.max())
    real_in_backward = weights_mod.in_backward
    weights_mod.in_backward = lambda: True  # a backward gather (pooled worker: restored)
    try:
        with compute_gathers():
            secondary = gathers.finish(gathers.start(lambda: shards[rank].clone(), world * shard))
    finally:
        weights_mod.in_backward = real_in_backward
    assert gathers.num_secondary_gathers == 1 and torch.equal(secondary, primary)
    # DeepSpeed's entry point, with its dict of node groups and with groups found from hosts
    from shardspeed.runtime.comm.coalesced_collectives import all_to_all_quant_reduce

    node_groups = {f"local_{i}": comm.new_group([2 * i, 2 * i + 1]) for i in range(2)}
    node_groups.update({f"global_{i}": comm.new_group([i, i + 2]) for i in range(2)})
    os.environ["SHARDSPEED_HOST_ID"] = TWO_HOSTS[rank]
    for groups in (node_groups, None):
        for numel in (1000, 7):
            chunk = -(-numel // world)
            inputs = [
                torch.randn(numel, generator=torch.Generator().manual_seed(r)) for r in range(world)
            ]
            (got,) = all_to_all_quant_reduce([inputs[rank]], groups)
            padded = [
                torch.nn.functional.pad(x, (0, world * chunk - numel)).view(world, chunk)
                for x in inputs
            ]
            lo, hi = rank * chunk, min((rank + 1) * chunk, numel)
            exact = (sum(inputs) / world)[lo:hi]
            bound = (reduction_error_bound(padded, 2, 2, 4, 256)[rank] / world)[: hi - lo]
            assert got.shape == exact.shape
            assert bool(((got - exact).abs() <= bound * 1.0001 + 1e-6).all())
    os.environ.pop("SHARDSPEED_HOST_ID")
    return {"ratios": ratios, "hpz_ranks": hpz.hpz_ranks}


def test_quantized_collectives_stay_within_their_error_bounds() -> None:
    for rank, got in enumerate(run_distributed(_collectives, 4, 11)):
        ratios = got["ratios"]
        # hierarchical 2 x 2 / one node / one rank per node
        assert [ratios[(h, 4)][1] for h in "bad"] == [2, 1, 4]
        assert all(0.05 < r <= 1.0001 for r, _ in ratios.values()), ratios  # bounds are tight-ish
        assert got["hpz_ranks"] == ((0, 1) if rank < 2 else (2, 3))


def _check_against_plain(results: list[dict[str, Any]], names: list[str], lr: float) -> None:
    plain = results[0]
    for name, got in zip(names, results):
        assert got["exact_reads"], name  # GatheredParameters is never quantized
        if name in ("plain", "hpz"):  # hpZ changes where the backward gather reads: exact
            assert got["losses"] == plain["losses"], name
            for key, value in plain["final"].items():
                assert torch.equal(got["final"][key], value), (name, key)
            continue
        tol = first_order_tolerance(plain, got, lr)
        for t, (a, b) in enumerate(zip(got["losses"], plain["losses"])):
            assert abs(a - b) <= tol[t], (name, t, a, b, tol[t])
        if name == "qgz":  # same weights at step 0: the reduced gradient within its bound
            err = (got["first_grads"] - plain["first_grads"]).abs().max()
            assert float(err) <= got["eps"][0] * 1.0001, (float(err), got["eps"][0])


SPECS = {"plain": {}, "hpz": dict(zero_hpz_partition_size=2), "qwz": dict(zero_quantized_weights=True),
         "qgz": dict(zero_quantized_gradients=True), "all": ALL}  # fmt: skip


def _run(world: int, steps: int, names: list[str]) -> list[list[dict[str, Any]]]:
    specs = [zeropp_spec(world, steps, **SPECS[n]) for n in names]
    return run_distributed(
        run_many, world, specs, TWO_HOSTS[:world] if world == 4 else ["a", "a"], timeout=600
    )


def test_zeropp_on_2_ranks_matches_zero3_and_cuts_bytes() -> None:
    names = list(SPECS)
    results = _run(2, 4, names)[0]
    _check_against_plain(results, names, lr=0.05)
    ratio = results[-1]["bytes_per_step"] / results[0]["bytes_per_step"]
    assert ratio <= 0.3, ratio  # measured 0.21


def test_zeropp_on_two_hosts_keeps_hpz_backward_gathers_in_the_node() -> None:
    names = ["plain", "hpz", "all"]
    per_rank = _run(4, 3, names)
    for rank, results in enumerate(per_rank):
        _check_against_plain(results, names, lr=0.05)
        node = (0, 1) if rank < 2 else (2, 3)
        for name, got in zip(names, results):
            backward = {g for g, in_bwd in got["gathers"] if in_bwd}
            if name == "plain":
                assert backward == {(0, 1, 2, 3)}
            else:  # every backward gather crossed only the node group
                assert backward == {node} and got["secondary_gathers"] > 0, (name, got["gathers"])
        ratio = results[-1]["bytes_per_step"] / results[0]["bytes_per_step"]
        assert ratio <= 0.3, ratio  # measured 0.23


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_zeropp_losses_over_50_steps_within_the_quantization_bound(world: int) -> None:
    """``pytest -s -m slow`` prints the table of docs/zeropp.md."""
    names = list(SPECS)
    results = _run(world, 50, names)[0]
    print(f"\n{world} ranks\n{report_table(names, results, lr=0.05)}")
    _check_against_plain(results, names, lr=0.05)
    ratio = results[-1]["bytes_per_step"] / results[0]["bytes_per_step"]
    assert ratio <= 0.3, ratio


def _with_offload(nvme_dir: str) -> list[list[dict[str, Any]]]:
    offloads = [
        {"offload_param": {"device": "cpu"}, "offload_optimizer": {"device": "cpu"}},
        {"offload_param": {"device": "nvme", "nvme_path": nvme_dir}},
    ]
    out = []
    for offload in offloads:
        specs = [zeropp_spec(4, 4, **offload), zeropp_spec(4, 4, **offload, **ALL)]
        out.append(run_many(specs, TWO_HOSTS))
    return out


@pytest.mark.slow
def test_zeropp_composes_with_cpu_and_nvme_parameter_offload(tmp_path: Any) -> None:
    per_rank = run_distributed(_with_offload, 4, str(tmp_path), timeout=600)
    for results in per_rank:
        for pair in results:
            _check_against_plain(pair, ["plain", "all"], lr=0.05)
            assert pair[1]["secondary_gathers"] > 0
            assert pair[1]["bytes_per_step"] <= 0.3 * pair[0]["bytes_per_step"]


def _tensor_parallel() -> list[dict[str, Any]]:
    specs = []
    for name in ("plain", "hpz", "all"):
        spec = zeropp_spec(4, 4, **SPECS[name])
        spec.extra["tensor_parallel"] = {"autotp_size": 2}  # data groups [0 2] and [1 3]
        specs.append(spec)
    return run_many(specs, TWO_HOSTS)


@pytest.mark.slow
def test_zeropp_composes_with_tensor_parallelism() -> None:
    pytest.importorskip("transformers")
    for results in run_distributed(_tensor_parallel, 4, timeout=600):
        # each data group spans both hosts here: hpZ groups are the data groups
        _check_against_plain(results, ["plain", "hpz", "all"], lr=0.05)
        # the weight gathers shrink as without tensor parallelism (the tensor axis's own
        # activation all-reduces are not ZeRO's and stay: no ratio on the total here)
        gathered = [r["by_op"]["all_gather_into_tensor"] for r in results]
        assert gathered[2] <= 0.3 * gathered[0], gathered
