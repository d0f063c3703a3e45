"""Ulysses sequence parallelism through ``shardspeed.initialize`` against one process.

``"sequence_parallel_size": 2`` in the config builds the mesh's sequence axis; the user
makes the Hugging Face Llama sequence-parallel over ``engine.topology.group("sequence")``
(``make_hf_sequence_parallel``) and feeds each rank its contiguous chunk of the data
rank's samples. The engine must shard ZeRO over data x sequence, sum gradients over it and
divide by the data-parallel size only, resolve the batch over the data axis, and give every
rank of a sequence group the same micro-batch. The reference trains the whole model on the
full sequences of the global batch in one process (same SGD with momentum and clipping: SGD
keeps Ulysses' legitimately reordered sums at rounding level; see test_tp_engine.py).
Compared: the loss every step and the final parameters, fp32 at 1e-5.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shardspeed.testing import assert_close_rel, run_distributed

pytest.importorskip("transformers")

VOCAB, SEQ, MICRO, STEPS = 64, 16, 2, 3


def _model() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=64, attn_implementation="sdpa")  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(config)


def _ids(step: int, data_rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + data_rank)
    return torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)


def _reference(dp: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        ids = torch.cat([_ids(step, d) for d in range(dp)])
        loss = model(input_ids=ids, labels=ids).loss  # the global batch's token mean
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        opt.step()
        losses.append(float(loss))
    return losses, {n: p.detach().clone() for n, p in model.named_parameters()}


def _train(stages: list[int]) -> dict[int, Any]:
    import shardspeed
    from shardspeed import comm
    from shardspeed.parallel.sequence import make_hf_sequence_parallel, shard_sequence
    from shardspeed.zero import GatheredParameters

    out = {}
    for stage in stages:
        config = {
            "train_micro_batch_size_per_gpu": MICRO,
            "sequence_parallel_size": 2,
            "gradient_clipping": 0.5,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}},
            "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 0},
        }
        model = _model()
        engine, _, _, _ = shardspeed.initialize(model=model, config=config)
        topo = engine.topology
        make_hf_sequence_parallel(model, topo.group("sequence"))
        data_rank = topo.coords(comm.get_rank()).data
        losses = []
        for step in range(STEPS):
            local = shard_sequence(_ids(step, data_rank), topo.group("sequence"))
            loss = engine(input_ids=local, labels=local).loss  # full-sequence mean
            engine.backward(loss)
            engine.step()
            mean = loss.detach().clone()
            comm.all_reduce(mean, group=topo.group("data"))
            losses.append(float(mean) / topo.size("data"))
        ref_losses, ref_params = _reference(topo.size("data"))
        with GatheredParameters(list(model.parameters())):
            params = {n: p.detach().clone() for n, p in model.named_parameters()}
        out[stage] = {"losses": losses, "ref": ref_losses, "params": params, "ref_params": ref_params,
                      "batch": engine.train_batch_size()}  # fmt: skip
        engine.destroy()
    return out


def _check(results: list[dict[int, Any]], dp: int) -> None:
    for per_rank in results:
        for stage, r in per_rank.items():
            assert r["batch"] == MICRO * dp  # the sequence axis does not multiply the batch
            assert_close_rel(r["losses"], r["ref"], rtol=1e-5, atol=1e-6, msg=f"z{stage} losses")
            for name, value in r["ref_params"].items():
                assert_close_rel(
                    r["params"][name], value, rtol=1e-5, atol=1e-6, msg=f"z{stage} {name}"
                )


def test_ulysses_sp2_through_initialize_matches_one_process() -> None:
    _check(run_distributed(_train, 2, [0, 1, 2, 3], timeout=300), dp=1)


def test_ulysses_sp2_dp2_through_initialize_matches_one_process() -> None:
    _check(run_distributed(_train, 4, [2], timeout=300), dp=2)
