"""``init_inference(model, moe={"ep_size": 2})`` on a ``shardspeed.moe`` model trained at ep 2.

Two gloo ranks train a tiny token LM (embedding, a causal running-mean mix, one
``MoE(4 experts, top-2, capacity 1.0 with dropping)``, LM head) with
``shardspeed.initialize`` at ep 2 for a few steps and save a checkpoint. Then:

* the trained ep-2 model is served with ``init_inference(moe={"ep_size": 2})``: each
  rank keeps its 2 experts (half the expert bytes of the whole model), the gates stop
  dropping tokens, and greedy decoding of a batch of prompts gives the same tokens
  (and logits within fp32 rounding) as one process serving the checkpoint's
  consolidated weights with all 4 experts (``ep_size=1``, no dropping);
* a wrong ``moe.ep_size`` and a wrong ``moe.moe_experts`` are refused naming both numbers.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shardspeed.testing import run_distributed

VOCAB, HIDDEN, FFN, EXPERTS, STEPS, NEW = 32, 16, 32, 4, 3, 6


class _MoELM(nn.Module):
    def __init__(self, ep: int, drop: bool = True) -> None:
        from shardspeed.moe.layer import MoE

        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        expert = nn.Sequential(nn.Linear(HIDDEN, FFN), nn.GELU(), nn.Linear(FFN, HIDDEN))
        self.moe = MoE(
            HIDDEN, expert, num_experts=EXPERTS, ep_size=ep, k=2, capacity_factor=1.0,
            eval_capacity_factor=1.0, min_capacity=0 if not drop else 1, drop_tokens=drop,
            use_rts=False, top2_2nd_expert_sampling=False,
        )  # fmt: skip
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        h = self.embed(ids)  # [B, T, H]
        steps = torch.arange(1, ids.shape[1] + 1, dtype=h.dtype).view(1, -1, 1)
        h = h + h.cumsum(dim=1) / steps  # causal context: each position sees its prefix
        out, l_aux, _ = self.moe(h)
        logits = self.head(h + out)  # [B, T, V]
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, VOCAB), targets.reshape(-1)) + 0.01 * l_aux


def _greedy(model: Any, prompts: torch.Tensor) -> tuple[list[list[int]], torch.Tensor]:
    ids, first_logits = prompts, None
    with torch.no_grad():
        for _ in range(NEW):
            logits = model(ids)[:, -1]  # [B, V]
            first_logits = logits if first_logits is None else first_logits
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    return ids[:, prompts.shape[1] :].tolist(), first_logits  # type: ignore[return-value]


def _expert_bytes(model: nn.Module) -> int:
    experts = model.moe.deepspeed_moe.experts  # type: ignore[union-attr]
    return sum(p.numel() * p.element_size() for p in experts.parameters())


def _serve_trained_ep2(root: str) -> dict[str, Any]:
    import pytest

    import shardspeed
    from shardspeed import comm
    from shardspeed.checkpoint import get_fp32_state_dict_from_checkpoint

    rank = comm.get_rank()
    torch.manual_seed(0)
    model = _MoELM(ep=2)
    with torch.no_grad():  # make the experts distinct: global expert e gets + 0.05 * (e + 1)
        for i, expert in enumerate(model.moe.deepspeed_moe.experts.deepspeed_experts):
            for p in expert.parameters():
                p.add_(0.05 * (rank * (EXPERTS // 2) + i + 1))
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": 0},
    }
    engine, _, _, _ = shardspeed.initialize(model=model, config=config)
    g = torch.Generator().manual_seed(10 + rank)
    for _ in range(STEPS):
        tokens = torch.randint(0, VOCAB, (4, 9), generator=g)
        loss = engine(tokens[:, :-1], tokens[:, 1:])
        engine.backward(loss)
        engine.step()
    engine.save_checkpoint(root, tag="trained")
    served = engine.module.eval()

    with pytest.raises(ValueError, match="moe.ep_size=4, but MoE layer 0 was built with ep_size=2"):
        shardspeed.init_inference(served, moe={"ep_size": 4}, dtype=torch.float32)
    with pytest.raises(ValueError, match="moe.moe_experts=\\[8\\], but MoE layer 0 has num_"):
        shardspeed.init_inference(
            served, moe={"ep_size": 2, "moe_experts": [8]}, dtype=torch.float32
        )
    ds = shardspeed.init_inference(served, moe={"ep_size": 2}, dtype=torch.float32)
    assert not served.moe.deepspeed_moe.gate.drop_tokens  # nothing dropped when serving
    prompts = torch.randint(0, VOCAB, (3, 5), generator=torch.Generator().manual_seed(99))
    got, got_logits = _greedy(ds, prompts)

    full = get_fp32_state_dict_from_checkpoint(root, tag="trained")
    reference = _MoELM(ep=1, drop=False)
    reference.load_state_dict(full)
    want, want_logits = _greedy(reference.eval(), prompts)
    return dict(
        got=got, want=want, max_diff=float((got_logits - want_logits).abs().max()),
        held=_expert_bytes(served), whole=_expert_bytes(reference),
    )  # fmt: skip


def test_moe_model_trained_at_ep2_serves_at_ep2_like_one_process(tmp_path) -> None:
    results = run_distributed(_serve_trained_ep2, 2, str(tmp_path / "ckpt"), timeout=240)
    for r in results:
        assert r["got"] == r["want"]
        assert len({t for row in r["got"] for t in row}) > 2  # not a constant continuation
        assert r["max_diff"] < 1e-5
        assert r["held"] <= 0.55 * r["whole"] and r["held"] * 2 == r["whole"]
