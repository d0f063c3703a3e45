"""The clipping norm with expert parameters on 2 gloo ranks (ep 2): DeepSpeed's by default,
the true global norm as the explicit ``grad_norm="global"`` option.

Each rank holds the same dense gradient ``d`` and its own expert gradient ``e_r``.
DeepSpeed 0.19.8's fp32 stage-0 ``clip_grad_norm_`` averages the ranks' own norms:
``mean_r sqrt(|d|^2 + |e_r|^2)``; the true norm is ``sqrt(|d|^2 + sum_r |e_r|^2)``, which
is also DeepSpeed's sharded (ZeRO >= 1, DeepSpeed's ZeRO optimizer; here the true norm of
the shards) and with 16-bit parameters at stage 0 under ``FusedAdam``. With 16-bit
parameters at stage 0 under any other optimizer DeepSpeed clips by ``|d|`` alone, yet a
non-finite expert gradient still counts as an overflow on every rank (these rules are
matched against DeepSpeed runs in ``test_moe_bf16_deepspeed_norm.py``). Hand-computed
values, exact up to fp32 rounding (rtol 1e-6).
"""

from __future__ import annotations

import math

import pytest
import torch

from shardspeed.testing import run_distributed


def _norms() -> dict[str, float]:
    from shardspeed import comm
    from shardspeed.moe.layer import MoE
    from shardspeed.parallel.moe.groups import topology_for
    from shardspeed.runtime.expert_layout import expert_norm_groups
    from shardspeed.zero.grad_norm import GradNorm, NormTerm

    rank = comm.get_rank()
    MoE(4, torch.nn.Linear(4, 4), num_experts=2, ep_size=2)  # builds the ep_size_2 groups
    dense = torch.tensor([3.0, 4.0])  # |d| = 5, the same on both ranks
    expert = torch.tensor([12.0, 0.0, 0.0]) if rank == 0 else torch.tensor([0.0, 0.0, 0.0, 1.0])
    grads = [dense, expert]
    term = [(1, 0, expert.numel())]
    out = {}
    for mode in ("deepspeed", "global"):
        groups = expert_norm_groups("ep_size_2", False, mode)
        out[mode] = GradNorm([], torch.device("cpu"), [NormTerm(term, groups)])(grads)
    for name, fused in (("fused", True), ("unfused", False)):  # DeepSpeed bf16/fp16 stage 0
        groups = expert_norm_groups("ep_size_2", False, low_precision=True, fused_adam=fused)
        out[name] = GradNorm([], torch.device("cpu"), [NormTerm(term, groups)])(grads)
    # sharded: each rank holds half of the dense gradient (summed over the data axis)
    world = topology_for(2).group("data")
    half = [dense[rank : rank + 1], expert]
    groups = expert_norm_groups("ep_size_2", True)
    out["sharded"] = GradNorm([world], torch.device("cpu"), [NormTerm(term, groups)])(half)
    bad = [dense, expert * (float("inf") if rank == 1 else 1.0)]
    groups = expert_norm_groups("ep_size_2", False)
    out["overflow"] = GradNorm([], torch.device("cpu"), [NormTerm(term, groups)])(bad)
    groups = expert_norm_groups("ep_size_2", False, low_precision=True)
    out["unfused_overflow"] = GradNorm([], torch.device("cpu"), [NormTerm(term, groups)])(bad)
    with pytest.raises(ValueError, match="grad_norm='true'.*'deepspeed'"):
        expert_norm_groups("ep_size_2", False, "true")
    return out


def test_expert_grad_norm_deepspeed_default_and_global_option() -> None:
    deepspeed = (math.sqrt(25 + 144) + math.sqrt(25 + 1)) / 2
    true = math.sqrt(25 + 144 + 1)
    for out in run_distributed(_norms, 2):
        assert out["deepspeed"] == pytest.approx(deepspeed, rel=1e-6)
        assert out["global"] == pytest.approx(true, rel=1e-6)
        assert out["sharded"] == pytest.approx(true, rel=1e-6)
        assert out["fused"] == pytest.approx(true, rel=1e-6)
        assert out["unfused"] == pytest.approx(5.0, rel=1e-6)  # the dense gradient alone
        assert not math.isfinite(out["overflow"])  # every rank sees rank 1's overflow
        assert not math.isfinite(out["unfused_overflow"])  # experts still checked


def test_uses_fused_adam_follows_deepspeed_optimizer_choice() -> None:
    from shardspeed.config.optimizer import OptimizerConfig
    from shardspeed.ops.adam import FusedAdam
    from shardspeed.runtime.expert_layout import uses_fused_adam

    params = [torch.nn.Parameter(torch.zeros(2))]
    adam = OptimizerConfig(type="AdamW", params={"lr": 0.1})
    torch_adam = OptimizerConfig(type="Adam", params={"lr": 0.1, "torch_adam": True})
    lamb = OptimizerConfig(type="Lamb", params={"lr": 0.1})
    assert uses_fused_adam(torch.optim.AdamW(params), adam)  # built from the config
    assert not uses_fused_adam(torch.optim.Adam(params), torch_adam)
    assert not uses_fused_adam(torch.optim.Adam(params), lamb)
    assert not uses_fused_adam(torch.optim.Adam(params), None)  # a client torch optimizer
    assert uses_fused_adam(FusedAdam(params), None)  # a client FusedAdam
