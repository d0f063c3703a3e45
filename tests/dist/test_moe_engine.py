"""An MoE model trained through ``shardspeed.initialize`` with expert parallelism, against
a single-process reference that holds every expert.

Model: ``dense -> MoE(ep) -> head``; loss ``mse + 0.01 * l_aux`` per micro-batch. Routing
is deterministic (``use_rts=False``, no second-expert sampling, no noise) and each rank's
gate sees only its own tokens (capacity from the local token count, tokens dropped), so
the reference reproduces every rank's routing by running each rank's micro-batch through
an ``ep_size=1`` copy holding all experts, and averages the ranks' losses. The engine must
then reduce dense gradients over the data axis and expert gradients over ``expert_data``
(divided by the whole data-parallel size), shard experts over ``expert_data`` at ZeRO
>= 1, and count them once per expert in the gradient norm (clipping is on).

Compared: every rank's loss every step and, at the end, the dense parameters and this
rank's local experts against the reference's global experts (fp32, rtol 1e-5 as the other
fp32 parity tests).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn as nn

from shardspeed.testing import assert_close_rel, run_distributed

HIDDEN, FFN, EXPERTS, TOKENS, STEPS = 8, 16, 4, 12, 4


class _Net(nn.Module):
    def __init__(self, ep: int, k: int) -> None:
        from shardspeed.moe.layer import MoE

        super().__init__()
        expert = nn.Sequential(nn.Linear(HIDDEN, FFN), nn.GELU(), nn.Linear(FFN, HIDDEN))
        self.dense = nn.Linear(HIDDEN, HIDDEN)
        self.moe = MoE(
            HIDDEN, expert, num_experts=EXPERTS, ep_size=ep, k=k, capacity_factor=1.0,
            min_capacity=1, use_rts=False, top2_2nd_expert_sampling=False,
        )  # fmt: skip
        self.head = nn.Linear(HIDDEN, 1)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h, l_aux, _ = self.moe(torch.tanh(self.dense(x)))
        return (self.head(h).squeeze(-1) - y).pow(2).mean() + 0.01 * l_aux


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(TOKENS, HIDDEN, generator=g), torch.randn(TOKENS, generator=g)


def _reference(world: int, k: int) -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    model = _Net(1, k)
    with torch.no_grad():  # distinct experts, so a mix-up of expert ids shows
        for i, e in enumerate(model.moe.deepspeed_moe.experts.deepspeed_experts):
            for p in e.parameters():
                p.add_(0.1 * (i + 1))
    initial = copy.deepcopy(model.state_dict())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        per_rank = [model(*_batch(step, r)) for r in range(world)]
        torch.stack(per_rank).mean().backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        losses.append([float(v) for v in per_rank])
    return losses, {"initial": initial, "final": model.state_dict()}


def _local_state(full: dict[str, torch.Tensor], ep_rank: int, local: int) -> dict[str, Any]:
    """The reference state as seen by expert-parallel rank ``ep_rank`` (its local experts)."""
    prefix = "moe.deepspeed_moe.experts.deepspeed_experts."
    out = {}
    for name, value in full.items():
        if name.startswith(prefix):
            idx, rest = name[len(prefix) :].split(".", 1)
            i = int(idx) - ep_rank * local
            if 0 <= i < local:
                out[f"{prefix}{i}.{rest}"] = value
        else:
            out[name] = value
    return out


def _train(world: int, cases: list[tuple[int, int, int]]) -> dict[tuple, Any]:
    import shardspeed
    from shardspeed import comm
    from shardspeed.parallel.moe.groups import topology_for
    from shardspeed.zero import GatheredParameters

    rank = comm.get_rank()
    out = {}
    for ep, k, stage in cases:
        ref_losses, ref = _reference(world, k)
        ep_rank = topology_for(ep).rank_in("expert")
        model = _Net(ep, k)
        model.load_state_dict(_local_state(ref["initial"], ep_rank, EXPERTS // ep))
        config = {
            "train_micro_batch_size_per_gpu": 1,
            "gradient_clipping": 0.5,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.0}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        }
        engine, _, _, _ = shardspeed.initialize(model=model, config=config)
        losses = []
        for step in range(STEPS):
            loss = engine(*_batch(step, rank))
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
        with GatheredParameters(list(model.parameters())):
            final = {n: p.detach().clone() for n, p in model.named_parameters()}
        expected = _local_state(ref["final"], ep_rank, EXPERTS // ep)
        out[(ep, k, stage)] = {
            "losses": losses,
            "ref_losses": [r[rank] for r in ref_losses],
            "final": final,
            "expected": {n: expected[n] for n in final},
        }
        engine.destroy()
    return out


def _check(results: list[dict[tuple, Any]]) -> None:
    for per_rank in results:
        for case, r in per_rank.items():
            assert_close_rel(
                r["losses"], r["ref_losses"], rtol=1e-5, atol=1e-6, msg=f"{case} losses"
            )
            for name, value in r["final"].items():
                assert_close_rel(
                    value, r["expected"][name], rtol=1e-5, atol=1e-6, msg=f"{case} {name}"
                )


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_expert_parallel_training_matches_reference_world2(stage: int) -> None:
    cases = [(ep, k, stage) for ep in (1, 2) for k in (1, 2)]
    _check(run_distributed(_train, 2, 2, cases, timeout=300))


def test_expert_parallel_training_matches_reference_world4() -> None:
    cases = [(2, 2, 0), (4, 1, 2), (2, 1, 3)]
    _check(run_distributed(_train, 4, 4, cases, timeout=300))


def _checkpoint_refused() -> str:
    import shardspeed

    torch.manual_seed(0)
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
    }
    engine, _, _, _ = shardspeed.initialize(model=_Net(2, 1), config=config)
    with pytest.raises(ValueError) as err:
        engine.save_checkpoint("/nonexistent-not-written")
    return str(err.value)


def test_expert_parallel_checkpoint_is_refused_not_merged() -> None:
    msg = run_distributed(_checkpoint_refused, 2)[0]
    assert "ep_size_2" in msg and "not supported yet" in msg
