"""Muon with tensor parallelism (AutoTP, ``"tensor_parallel": {"autotp_size": 2}``) against
one process.

A tiny Hugging Face Llama (GQA) is sharded by AutoTP: q/k/v, gate/up column-parallel,
o/down row-parallel. Muon must orthogonalise each weight's *full* update, not the shard's
(the orthogonal factor of a row block is not a row block of the orthogonal factor), so the
engine all-gathers each sharded matrix's update over the tensor axis, runs Newton-Schulz
on the whole matrix and keeps its slice
(:class:`~shardspeed.parallel.tensor.full_matrix.TensorSplit`). The reference trains the
unsharded model in one process on the same global batch with the same :class:`Muon`
(whose Newton-Schulz ``tests/unit/test_muon_optimizer.py`` checks against the singular-value
polynomial); embeddings, norms and the LM head train with its AdamW half. Compared: every
rank's loss and the full weights (``engine.state_dict()``) after the last step, fp32
tolerance of the parity tests (rtol 1e-5, atol 1e-6). ZeRO 0-3 at tp 2 on 2 ranks, and ZeRO-3
from a model built under ``zero.Init``; tp 2 x dp 2 at ZeRO 1 and 3 on 4 ranks (slow tier).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
import torch

from shardspeed.testing import assert_close_rel, run_distributed

pytest.importorskip("transformers")

LLAMA = dict(vocab_size=64, hidden_size=32, intermediate_size=40, num_hidden_layers=2,
             num_attention_heads=8, num_key_value_heads=2)  # fmt: skip
STEPS, MICRO, SEQ, CLIP = 3, 2, 8, 1.0
MUON = {"lr": 0.02, "adam_lr": 1e-3, "weight_decay": 0.01}
TOL = {"rtol": 1e-5, "atol": 1e-6}


@dataclass(frozen=True)
class Case:
    stage: int
    zero_init: bool = False

    def config(self, tp: int) -> dict[str, Any]:
        zero: dict[str, Any] = {"stage": self.stage}
        if self.stage == 3:  # every parameter in a unit flat (released after use)
            zero["stage3_param_persistence_threshold"] = 0
        return {
            "train_micro_batch_size_per_gpu": MICRO,
            "gradient_clipping": CLIP,
            "tensor_parallel": {"autotp_size": tp},
            "optimizer": {"type": "Muon", "params": MUON},
            "zero_optimization": zero,
        }


def _model() -> Any:
    import transformers as tf

    torch.manual_seed(0)
    return tf.LlamaForCausalLM(tf.LlamaConfig(**LLAMA))


def _ids(step: int, data_rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + data_rank)
    return torch.randint(0, 64, (MICRO, SEQ), generator=g)


def _reference(dp: int) -> tuple[list[list[float]], dict[str, torch.Tensor]]:
    """The whole model in one process (one thread, like the ranks), the global batch of
    ``dp`` micro-batches, gradients averaged in data-rank order and clipped, Muon + AdamW."""
    from shardspeed.ops.muon import Muon, split_muon_groups

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = _model()
        params = list(model.parameters())
        opt = Muon(split_muon_groups(model, [{"params": params}]), **MUON)
        losses = []
        for step in range(STEPS):
            grads = [torch.zeros_like(p) for p in params]
            per_rank = []
            for d in range(dp):
                loss = model(_ids(step, d), labels=_ids(step, d)).loss
                loss.backward()
                for g, p in zip(grads, params):
                    g.add_(p.grad)
                    p.grad = None
                per_rank.append(float(loss.detach()))
            for p, g in zip(params, grads):
                p.grad = g / dp
            torch.nn.utils.clip_grad_norm_(params, CLIP)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append(per_rank)
        return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
    finally:
        torch.set_num_threads(threads)


def _train(cases: list[Case], tp: int) -> list[dict[str, Any]]:
    import shardspeed
    from shardspeed import comm

    out = []
    for case in cases:
        if case.zero_init:
            with shardspeed.zero.Init(config_dict_or_path=case.config(tp)):
                model = _model()
            assert all(p.numel() == 0 for p in model.parameters())
            params = list(model.parameters())
            with shardspeed.zero.GatheredParameters(params, modifier_rank=0):
                model.load_state_dict(_model().state_dict())
        else:
            model = _model()
        engine, _, _, _ = shardspeed.initialize(model=model, config=case.config(tp))
        splits = sum(  # Muon fragments that are tensor-parallel shards
            f.split is not None
            for per in engine.basic_optimizer._layout.values()
            for m in per
            for f in m
        )
        data_rank = engine.topology.coords(comm.get_rank()).data
        losses = []
        for step in range(STEPS):
            ids = _ids(step, data_rank)
            loss = engine(ids, labels=ids).loss
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
        state = {k: v.detach().float().clone() for k, v in engine.state_dict().items()}
        out.append({"case": case, "losses": losses, "state": state, "splits": splits,
                    "data_rank": data_rank, "mp": engine.mp_world_size})  # fmt: skip
        engine.destroy()
    return out


def _check(results: list[list[dict[str, Any]]], tp: int, dp: int) -> None:
    ref_losses, ref_state = _reference(dp)
    for per_rank in results:
        for r in per_rank:
            case = r["case"]
            assert r["mp"] == tp
            assert r["splits"] > 0, f"{case}: no tensor-parallel matrix reached Muon"
            expected = [per[r["data_rank"]] for per in ref_losses]
            assert_close_rel(r["losses"], expected, **TOL, msg=f"{case} losses")
            assert set(r["state"]) == set(ref_state)
            for name, value in ref_state.items():
                assert_close_rel(r["state"][name], value, **TOL, msg=f"{case} {name}")


def test_muon_tp2_matches_reference() -> None:
    """tp 2 at ZeRO 0-3, and ZeRO-3 from a zero.Init model (2 ranks, dp 1)."""
    cases = [Case(0), Case(1), Case(2), Case(3), Case(3, zero_init=True)]
    _check(run_distributed(_train, 2, cases, 2, timeout=300), tp=2, dp=1)


@pytest.mark.slow
def test_muon_tp2_dp2_matches_reference() -> None:
    """tp 2 x dp 2 (4 ranks): matrices are sharded over both axes at ZeRO 1 and 3."""
    cases = [Case(1), Case(3)]
    _check(run_distributed(_train, 4, cases, 2, timeout=300), tp=2, dp=2)
