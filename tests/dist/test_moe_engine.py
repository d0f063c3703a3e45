"""An MoE model trained through ``shardspeed.initialize`` with expert parallelism, against
a single-process reference that holds every expert.

Model: ``dense -> MoE(ep) -> head``; loss ``mse + 0.01 * l_aux`` per micro-batch. Routing
is deterministic (``use_rts=False``, no second-expert sampling, no noise) and each rank's
gate sees only its own tokens (capacity from the local token count; with ``drop`` tokens
over capacity are dropped, without it none are), so the reference reproduces every rank's
routing by running each rank's micro-batch through an ``ep_size=1`` copy holding all
experts. The engine must then reduce dense gradients over the data axis and expert
gradients over ``expert_data`` (divided by the whole data-parallel size), shard experts
over ``expert_data`` at ZeRO >= 1, and clip with DeepSpeed's norm (clipping is on): at
ZeRO >= 1 the true global norm (each expert counted once), at stage 0 in fp32 the mean
over ranks of each rank's own norm (dense gradients and its local experts), as DeepSpeed's
fp32 ``clip_grad_norm_`` does, and at stage 0 in bf16 the norm of the dense gradients
alone, as DeepSpeed's ``FP16_UnfusedOptimizer`` does for this (non-fused) SGD (expert
gradients only take part in its overflow check; ``test_moe_bf16_deepspeed_norm.py``).

The reference applies the engine's precision policy without sharding: each rank's
micro-batch forward/backward in the parameter dtype, gradients summed in fp32 and divided
by the world size, clipping, the optimizer on fp32 masters, masters cast back. At ZeRO 0
in bf16 it first steps the optimizer once with zero gradients, as the engine does by
default after DeepSpeed (config ``initial_zero_grad_step``; with this SGD, momentum and no
weight decay, that step changes nothing but the optimizer state's existence).

Compared: every rank's loss every step; every step's reduced gradient (``safe_get_full_grad``
before ``step()``) of every local expert parameter and of the gate against the reference's
gradient of that global expert; and at the end the dense parameters and this rank's local
experts against the reference's global experts.

Optimizer: SGD + momentum (updates linear in the gradients). With ep > 1 an expert's
gradient is one matmul over its whole expert group's tokens here and a sum of per-rank
gradients in the reference, so the same terms are summed in another order; Adam would
turn that rounding on near-zero gradient elements (|g| ~ its eps) into visible update
differences that say nothing about sharding (as ``test_zero_parity.py`` notes).

Tolerances: fp32 rtol 1e-5, atol 1e-6 (the other fp32 parity tests) on losses, every
step's gradients and the final parameters. bf16 as ``test_zero_parity.py``'s 16-bit runs
(the engine rounds reduced gradients to bf16 where the reference sums in fp32): rtol
2 eps, atol lr * steps * eps on losses and parameters; the first step's gradients (same
starting parameters) per element within 2 eps (|reference| + mean over ranks of |g_r| +
max |reference|) (see ``_check_bf16_grad``); later bf16 steps start from parameters whose bf16 casts may
differ by one ulp, so their gradients are covered by the loss and parameter checks.

Grid (``_ALL``): ep {1, 2, 4} x k {1, 2} x drop / no-drop x ZeRO {0, 2, 3} x fp32 / bf16
(ep 4 on 4 ranks, ep 1/2 on 2 ranks) behind ``slow``; by default ZeRO 0-3 x ep {1, 2} x
k {1, 2} dropping in fp32 on 2 ranks, three no-drop / bf16 cases on 2 ranks and three
4-rank cases.
"""

from __future__ import annotations

import copy
from itertools import product
from typing import Any

import pytest
import torch
import torch.nn as nn

from shardspeed.testing import assert_close_rel, run_distributed

HIDDEN, FFN, EXPERTS, TOKENS, STEPS = 8, 16, 4, 12, 4
BF16_EPS = torch.finfo(torch.bfloat16).eps
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
LR = 0.1
EXPERT_PREFIX = "moe.deepspeed_moe.experts.deepspeed_experts."
GATE = "moe.deepspeed_moe.gate.wg.weight"

Case = tuple[int, int, bool, int, str]  # ep, k, drop_tokens, ZeRO stage, dtype


class _Net(nn.Module):
    def __init__(self, ep: int, k: int, drop: bool = True) -> None:
        from shardspeed.moe.layer import MoE

        super().__init__()
        expert = nn.Sequential(nn.Linear(HIDDEN, FFN), nn.GELU(), nn.Linear(FFN, HIDDEN))
        self.dense = nn.Linear(HIDDEN, HIDDEN)
        self.moe = MoE(
            HIDDEN, expert, num_experts=EXPERTS, ep_size=ep, k=k, capacity_factor=1.0,
            min_capacity=1, use_rts=False, top2_2nd_expert_sampling=False, drop_tokens=drop,
        )  # fmt: skip
        self.head = nn.Linear(HIDDEN, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = x.to(self.dense.weight.dtype)
        h, l_aux, _ = self.moe(torch.tanh(self.dense(x)))
        return (self.head(h).squeeze(-1).float() - y).pow(2).mean() + 0.01 * l_aux.float()


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(TOKENS, HIDDEN, generator=g), torch.randn(TOKENS, generator=g)


def _optimizer(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def _config(case: Case) -> dict[str, Any]:
    _, _, _, stage, dtype = case
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_clipping": 0.5,
        "optimizer": {"type": "SGD", "params": {"lr": LR, "momentum": 0.9}},
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
    }
    if dtype == "bf16":
        config["bf16"] = {"enabled": True}
    return config


def _clip(grads: dict[str, torch.Tensor], world: int, ep: int, stage: int, dtype: str) -> None:
    """Clip at 0.5 with DeepSpeed's norm: the true global norm at ZeRO >= 1; at stage 0 in
    bf16 the norm of the dense gradients alone (``FP16_UnfusedOptimizer``); at stage 0 in
    fp32 the mean over data ranks of each rank's norm over what it holds (dense + its
    experts)."""
    sq = {n: float(g.pow(2).sum()) for n, g in grads.items()}
    dense = sum(v for n, v in sq.items() if not n.startswith(EXPERT_PREFIX))
    per_expert = [0.0] * EXPERTS
    for n, v in sq.items():
        if n.startswith(EXPERT_PREFIX):
            per_expert[int(n[len(EXPERT_PREFIX) :].split(".", 1)[0])] += v
    if stage == 0 and dtype != "fp32":
        norm = dense**0.5
    elif stage >= 1 or ep == 1:
        norm = (dense + sum(per_expert)) ** 0.5
    else:
        local = EXPERTS // ep
        norms = [  # world rank r holds the experts of expert-parallel rank r % ep
            (dense + sum(per_expert[(r % ep) * local : (r % ep + 1) * local])) ** 0.5
            for r in range(world)
        ]
        norm = sum(norms) / world
    coef = 0.5 / (norm + 1e-6)
    if coef < 1.0:
        for g in grads.values():
            g.mul_(coef)


def _reference(world: int, case: Case) -> dict[str, Any]:
    ep, k, drop, stage, dtype = case
    torch.manual_seed(0)
    model = _Net(1, k, drop)
    with torch.no_grad():  # distinct experts, so a mix-up of expert ids shows
        for i, e in enumerate(model.moe.deepspeed_moe.experts.deepspeed_experts):
            for p in e.parameters():
                p.add_(0.1 * (i + 1))
    initial = copy.deepcopy(model.state_dict())
    model.to(DTYPES[dtype])
    names = [n for n, _ in model.named_parameters()]
    params = list(model.parameters())
    masters = [p.detach().float().clone() for p in params]
    opt = _optimizer(masters)
    if stage == 0 and dtype != "fp32":  # DeepSpeed's initial zero-gradient step
        for m in masters:
            m.grad = torch.zeros_like(m)
        opt.step()
        for m in masters:
            m.grad = None
    losses, grads, bounds = [], [], []
    for step in range(STEPS):
        per_rank, summed = [], [torch.zeros_like(m) for m in masters]
        magnitude = [torch.zeros_like(m) for m in masters]  # sum over ranks of |g_r|
        for r in range(world):
            loss = model(*_batch(step, r))
            loss.backward()
            for s, a, p in zip(summed, magnitude, params):
                if p.grad is not None:  # None: an expert no token reached (no-drop)
                    s.add_(p.grad.float())
                    a.add_(p.grad.float().abs())
                p.grad = None
            per_rank.append(float(loss))
        step_grads = {n: s / world for n, s in zip(names, summed)}
        grads.append({n: g.clone() for n, g in step_grads.items()})
        bounds.append({n: a / world for n, a in zip(names, magnitude)})
        _clip(step_grads, world, ep, stage, dtype)
        for m, n in zip(masters, names):
            m.grad = step_grads[n]
        opt.step()
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)
        losses.append(per_rank)
    final = {n: m.clone() for n, m in zip(names, masters)}
    return {
        "losses": losses, "grads": grads, "bounds": bounds, "initial": initial, "final": final,
    }  # fmt: skip


def _local_state(full: dict[str, torch.Tensor], ep_rank: int, local: int) -> dict[str, Any]:
    """The reference state as seen by expert-parallel rank ``ep_rank`` (its local experts)."""
    out = {}
    for name, value in full.items():
        if name.startswith(EXPERT_PREFIX):
            idx, rest = name[len(EXPERT_PREFIX) :].split(".", 1)
            i = int(idx) - ep_rank * local
            if 0 <= i < local:
                out[f"{EXPERT_PREFIX}{i}.{rest}"] = value
        else:
            out[name] = value
    return out


def _train(world: int, cases: list[Case]) -> dict[Case, Any]:
    import shardspeed
    from shardspeed import comm
    from shardspeed.parallel.moe.groups import topology_for
    from shardspeed.utils import safe_get_full_grad
    from shardspeed.zero import GatheredParameters

    rank = comm.get_rank()
    out = {}
    for case in cases:
        ep, k, drop = case[:3]
        ref = _reference(world, case)
        ep_rank = topology_for(ep).rank_in("expert")
        local = EXPERTS // ep
        model = _Net(ep, k, drop)
        model.load_state_dict(_local_state(ref["initial"], ep_rank, local))
        engine, _, _, _ = shardspeed.initialize(model=model, config=_config(case))
        watched = [(n, p) for n, p in model.named_parameters() if n.startswith(EXPERT_PREFIX)]
        watched.append((GATE, dict(model.named_parameters())[GATE]))
        losses, grads = [], []
        for step in range(STEPS):
            loss = engine(*_batch(step, rank))
            engine.backward(loss)
            grads.append({n: safe_get_full_grad(p).clone() for n, p in watched})
            engine.step()
            losses.append(float(loss))
        with GatheredParameters(list(model.parameters())):
            final = {n: p.detach().float().clone() for n, p in model.named_parameters()}
        expected = _local_state(ref["final"], ep_rank, local)
        out[case] = {
            "losses": losses,
            "ref_losses": [r[rank] for r in ref["losses"]],
            "grads": grads,
            "ref_grads": [_local_state(g, ep_rank, local) for g in ref["grads"]],
            "bounds": [_local_state(g, ep_rank, local) for g in ref["bounds"]],
            "final": final,
            "expected": {n: expected[n] for n in final},
        }
        engine.destroy()
    return out


def _check(results: list[dict[Case, Any]]) -> None:
    for per_rank in results:
        for case, r in per_rank.items():
            dtype = case[4]
            if dtype == "fp32":
                tol = {"rtol": 1e-5, "atol": 1e-6}
            else:
                tol = {"rtol": 2 * BF16_EPS, "atol": LR * STEPS * BF16_EPS}
            assert_close_rel(r["losses"], r["ref_losses"], **tol, msg=f"{case} losses")
            for step, (mine, ref) in enumerate(zip(r["grads"], r["ref_grads"])):
                for name, value in mine.items():
                    where = f"{case} step {step} {name}"
                    if dtype == "fp32":
                        assert_close_rel(value, ref[name], **tol, msg=where)
                    elif step == 0:  # later bf16 steps start from drifted parameters
                        _check_bf16_grad(value, ref[name], r["bounds"][step][name], where)
            for name, value in r["final"].items():
                assert_close_rel(value, r["expected"][name], **tol, msg=f"{case} {name}")


def _check_bf16_grad(
    actual: torch.Tensor, expected: torch.Tensor, magnitude: torch.Tensor, where: str
) -> None:
    """bf16 gradients: the engine rounds a sum of the ranks' contributions to bf16 once
    (one backward over the expert's tokens, one bf16 reduction), the reference rounds each
    rank's contribution and sums in fp32 (each rounding at most eps/2 of what it rounds:
    ``2 eps (|expected| + mean_r |g_r|)``, ``magnitude`` = the ranks' mean absolute
    contribution); and the expert's bf16 kernels run on its whole expert group's tokens at
    once here, on one rank's at a time there, so per-token terms may round differently:
    ``2 eps * max |expected|`` per tensor, ``test_moe_layer.py``'s bf16 rule. Checked on the
    first step, where both start from the same bf16 parameters."""
    scale = float(expected.abs().max())
    bound = 2 * BF16_EPS * (expected.abs() + magnitude + scale)
    excess = (actual.float() - expected).abs() - bound
    worst = int(excess.flatten().argmax())
    assert float(excess.flatten()[worst]) <= 0, (
        f"{where}: element {worst} actual {float(actual.flatten()[worst])} expected "
        f"{float(expected.flatten()[worst])} beyond 2 eps (|expected| + mean |g_r| + max |expected|)"
    )


_ALL = {
    world: [
        (ep, k, drop, stage, dtype)
        for ep, k, drop, stage, dtype in product(
            (1, 2, 4), (1, 2), (True, False), (0, 2, 3), ("fp32", "bf16")
        )
        if (ep == 4) == (world == 4)
    ]
    for world in (2, 4)
}


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_expert_parallel_training_matches_reference_world2(stage: int) -> None:
    cases = [(ep, k, True, stage, "fp32") for ep in (1, 2) for k in (1, 2)]
    _check(run_distributed(_train, 2, 2, cases, timeout=300))


def test_expert_parallel_no_drop_and_bf16_world2() -> None:
    cases = [(2, 1, False, 2, "fp32"), (2, 2, True, 3, "bf16"), (2, 2, False, 0, "bf16")]
    _check(run_distributed(_train, 2, 2, cases, timeout=300))


def test_expert_parallel_training_matches_reference_world4() -> None:
    cases = [(2, 2, True, 0, "fp32"), (4, 1, True, 2, "fp32"), (2, 1, True, 3, "fp32")]
    _check(run_distributed(_train, 4, 4, cases, timeout=300))


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("world", [2, 4])
def test_expert_parallel_full_matrix(world: int, dtype: str) -> None:
    cases = [c for c in _ALL[world] if c[4] == dtype]
    _check(run_distributed(_train, world, world, cases, timeout=600))
