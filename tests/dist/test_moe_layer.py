"""Expert-parallel MoE on 2 and 4 gloo ranks against a single-process reference.

Every rank builds the same ``MoE`` (same seed: same gate), gives each of its local experts
the weights of its *global* expert id, and runs its own tokens with its own forward seed
(so RTS and top-2 sampling draw what the reference draws). The loss on rank r is
``(out_r * w_r).sum() + l_aux_r``. The reference holds all experts in one process, routes
each rank's tokens with the same gate and seed, and computes every token's output
directly (``sum_routes weight * expert(token)``, fp32 sum then cast, as the layer
combines), then back-propagates the sum of all ranks' losses. Compared per rank: output,
``l_aux``, ``exp_counts``, input gradient; and the gate gradient summed over the world and
each expert's gradient summed over its ``expert_data`` replicas (what the engine reduces).

Grid: world 2 x ep {1, 2} and world 4 x ep {1, 2, 4}, k {1, 2}, drop / no-drop, fp32; and
bf16 on world 4. Tolerances: fp32 rtol 1e-5, atol 1e-6 (``tests/dist/parity_common.py``'s
fp32 runs); bf16 rtol = 2 eps (one rounding each side) and atol = 2 eps * max |reference|
per tensor (gradients are sums rounded to bf16 once in the reference and per replica here).
"""

from __future__ import annotations

from itertools import product
from typing import Any

import pytest
import torch
import torch.distributed as dist

from shardspeed.testing import run_distributed

HIDDEN, FFN, EXPERTS, BATCH, SEQ = 8, 16, 4, 2, 8  # 16 tokens per rank
GATE_SEED, FORWARD_SEED = 7, 1000
BF16_EPS = torch.finfo(torch.bfloat16).eps
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}

Config = tuple[int, int, bool, str]  # ep, k, drop_tokens, dtype


def _configs(world: int, dtypes: tuple[str, ...]) -> list[Config]:
    eps = [ep for ep in (1, 2, 4) if ep <= world]
    return list(product(eps, (1, 2), (True, False), dtypes))


def _expert() -> torch.nn.Module:
    return torch.nn.Sequential(
        torch.nn.Linear(HIDDEN, FFN), torch.nn.GELU(), torch.nn.Linear(FFN, HIDDEN)
    )


def _set_expert_weights(module: torch.nn.Module, expert_id: int) -> None:
    g = torch.Generator().manual_seed(500 + expert_id)
    with torch.no_grad():
        for p in module.parameters():
            p.copy_(0.5 * torch.randn(p.shape, generator=g))


def _build(ep: int, k: int, drop: bool) -> Any:
    from shardspeed.moe.layer import MoE

    torch.manual_seed(GATE_SEED)
    moe = MoE(
        HIDDEN, _expert(), num_experts=EXPERTS, ep_size=ep, k=k, capacity_factor=0.5,
        min_capacity=1, drop_tokens=drop,
    )  # fmt: skip
    return moe


def _rank_data(rank: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(BATCH, SEQ, HIDDEN, generator=g).to(dtype)
    w = torch.randn(BATCH, SEQ, HIDDEN, generator=g)
    return x, w


def _distributed(configs: list[Config]) -> dict[Config, dict[str, Any]]:
    from shardspeed.parallel.moe.groups import expert_data_group_of, topology_for

    rank = dist.get_rank()
    results = {}
    for ep, k, drop, dtype_name in configs:
        dtype = DTYPES[dtype_name]
        moe = _build(ep, k, drop)
        topology = topology_for(ep)
        local = moe.deepspeed_moe.experts.deepspeed_experts
        first = topology.rank_in("expert") * len(local)
        for i, module in enumerate(local):
            _set_expert_weights(module, first + i)
        moe.to(dtype)
        x, w = _rank_data(rank, dtype)
        x.requires_grad_()
        torch.manual_seed(FORWARD_SEED + rank)
        out, l_aux, counts = moe(x)
        ((out.float() * w).sum() + l_aux).backward()
        gate_grad = moe.deepspeed_moe.gate.wg.weight.grad.float()
        dist.all_reduce(gate_grad)  # dense: over the world (data axis)
        expert_grads = {}
        for i, module in enumerate(local):
            grads = []
            for p in module.parameters():
                g = p.grad.float()
                dist.all_reduce(g, group=expert_data_group_of(p))  # expert: expert_data axis
                grads.append(g)
            expert_grads[first + i] = grads
        results[(ep, k, drop, dtype_name)] = {
            "out": out.detach(), "l_aux": l_aux.detach(), "exp_counts": counts,
            "x_grad": x.grad, "gate_grad": gate_grad, "expert_grads": expert_grads,
            "expert_ranks": dist.get_process_group_ranks(topology.group("expert")),
            "expert_data_ranks": dist.get_process_group_ranks(topology.group("expert_data")),
            "group_name": local[0][0].weight.group_name,
        }  # fmt: skip
    return results


def _reference(world: int, config: Config) -> dict[str, Any]:
    """All experts in one process; each rank's tokens routed and combined directly."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference_run(world, config)
    finally:
        torch.set_num_threads(threads)


def _reference_run(world: int, config: Config) -> dict[str, Any]:
    ep, k, drop, dtype_name = config
    dtype = DTYPES[dtype_name]
    gate = _build(1, k, drop).deepspeed_moe.gate.to(dtype)  # same seed: same weights
    experts = [_expert() for _ in range(EXPERTS)]
    for expert_id, module in enumerate(experts):
        _set_expert_weights(module, expert_id)
        module.to(dtype)
    per_rank, total = [], 0.0
    for rank in range(world):
        x, w = _rank_data(rank, dtype)
        x.requires_grad_()
        tokens = x.reshape(-1, HIDDEN)
        torch.manual_seed(FORWARD_SEED + rank)
        routing = gate.route(tokens)
        out = torch.zeros(tokens.shape, dtype=torch.float32)
        for route in range(k):
            ids, weights = routing.expert_ids[route], routing.weights[route]
            term = torch.zeros(tokens.shape, dtype=torch.float32)
            for expert_id, module in enumerate(experts):
                rows = (ids == expert_id).nonzero().flatten()
                if rows.numel():
                    y = module(tokens[rows]) * weights[rows, None]  # fp32 product
                    term = term.index_put((rows,), y)
            out = out + term
        out = out.to(dtype).reshape(x.shape)
        total = total + (out.float() * w).sum() + routing.l_aux
        per_rank.append({"x": x, "out": out.detach(), "l_aux": routing.l_aux.detach(),
                         "exp_counts": routing.exp_counts, "dropped": int((~routing.kept).sum())})  # fmt: skip
    total.backward()
    for item in per_rank:
        item["x_grad"] = item.pop("x").grad
    return {
        "ranks": per_rank,
        "gate_grad": gate.wg.weight.grad.float(),
        "expert_grads": [[p.grad.float() for p in m.parameters()] for m in experts],
    }


def _close(actual: torch.Tensor, expected: torch.Tensor, dtype_name: str, msg: str) -> None:
    if dtype_name == "fp32":
        tol = {"rtol": 1e-5, "atol": 1e-6}
    else:
        scale = float(expected.float().abs().max())
        tol = {"rtol": 2 * BF16_EPS, "atol": 2 * BF16_EPS * max(scale, 1e-6)}
    torch.testing.assert_close(actual.float(), expected.float(), **tol, msg=msg)


def _check(world: int, results: list[dict[Config, dict[str, Any]]], configs: list[Config]) -> None:
    for config in configs:
        ep, k, drop, dtype_name = config
        ref = _reference(world, config)
        if drop:
            assert sum(r["dropped"] for r in ref["ranks"]) > 0, f"{config}: nothing dropped"
        for rank in range(world):
            got, want = results[rank][config], ref["ranks"][rank]
            where = f"world {world} ep {ep} k {k} drop {drop} {dtype_name} rank {rank}"
            assert got["group_name"] == f"ep_size_{ep}"
            group0 = rank - rank % ep
            assert got["expert_ranks"] == list(range(group0, group0 + ep)), where
            assert got["expert_data_ranks"] == list(range(rank % ep, world, ep)), where
            assert len(got["expert_grads"]) == EXPERTS // ep, where  # local experts only
            assert torch.equal(got["exp_counts"], want["exp_counts"]), where
            for key in ("out", "l_aux", "x_grad"):
                _close(got[key], want[key], dtype_name, f"{where}: {key}")
            _close(got["gate_grad"], ref["gate_grad"], dtype_name, f"{where}: gate grad")
            for expert_id, grads in got["expert_grads"].items():
                for i, (g, r) in enumerate(zip(grads, ref["expert_grads"][expert_id])):
                    _close(g, r, dtype_name, f"{where}: expert {expert_id} param {i} grad")


@pytest.mark.parametrize("world", [2, 4])
def test_moe_layer_matches_single_process_reference(world: int) -> None:
    configs = _configs(world, ("fp32", "bf16") if world == 4 else ("fp32",))
    results = run_distributed(_distributed, world, configs, timeout=120)
    _check(world, results, configs)
