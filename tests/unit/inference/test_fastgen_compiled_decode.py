"""The compiled decode step gives the same greedy tokens as the eager engine and HF.

Fast tests trace the step with ``torch.compile(backend="eager")`` (Dynamo's graph
capture, dynamic batch / context dimensions, padding, routing) without Inductor's
code generation; the Inductor run is behind ``slow`` (one CPU compile takes tens of
seconds on a loaded 2-core machine).
"""

from __future__ import annotations

import pytest
import torch
from fastgen_helpers import VOCAB, engine_for, hf_greedy, make_prompts

from shardspeed.inference.fastgen.compiled_decode import (
    CompiledDecoder,
    batch_buckets,
    decode_forward,
    unsupported_reason,
)
from shardspeed.inference.fastgen.model_runner import resolve_compile_decode
from shardspeed.inference.fastgen.sampling_params import SamplingParams
from shardspeed.inference.fastgen.scheduler import ScheduledBatch, ScheduledSequence

COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
)  # fmt: skip


def _hf(family: str) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    if family == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON))
    elif family == "qwen2":  # q/k/v biases, made non-zero
        model = transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**COMMON))
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0.0, 0.5)
    else:  # gemma2: sandwich norms, alternating sliding window, soft-capping, GeGLU
        cfg = transformers.Gemma2Config(
            **COMMON, head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
            attn_logit_softcapping=1.5, final_logit_softcapping=2.0,
        )  # fmt: skip
        model = transformers.Gemma2ForCausalLM(cfg)
    model.generation_config.eos_token_id = None
    return model.float().eval()


def _compiled_engine(model, backend: str = "eager", **kwargs):
    engine = engine_for(model, compile_decode=False, **kwargs)
    runner = engine.runner
    runner.compiled = CompiledDecoder(
        runner.model, runner.kv_cache, runner.device, engine.config.max_ragged_sequence_count,
        engine.max_seq_len, "compile", compile_backend=backend,
    )  # fmt: skip
    return engine


def _staggered(engine, prompts: list[list[int]], max_new: list[int]) -> list[list[int]]:
    """Requests arrive in three waves and finish at different steps (the batch changes)."""
    ids, finals = [], {}
    third = len(prompts) // 3
    waves = [(0, third, 3), (third, 2 * third, 4), (2 * third, len(prompts), None)]
    for lo, hi, steps in waves:
        for p, n in zip(prompts[lo:hi], max_new[lo:hi]):
            ids.append(engine.add_request(p, SamplingParams(max_new_tokens=n, ignore_eos=True)))
        done = 0
        while engine.has_unfinished() and (steps is None or done < steps):
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out.output_token_ids
            done += 1
    return [finals[i] for i in ids]


def _count_calls(decoder: CompiledDecoder) -> list[int]:
    sizes: list[int] = []
    run = decoder.run

    def counted(batch):
        sizes.append(len(batch.sequences))
        return run(batch)

    decoder.run = counted
    return sizes


@pytest.mark.parametrize(
    "family",
    [
        "llama",
        "qwen2",
        pytest.param("gemma2", marks=pytest.mark.slow),
    ],
)
def test_traced_decode_matches_eager_and_hf(family):
    model = _hf(family)
    prompts = make_prompts(9, 3, 30, seed=5)
    max_new = [4 + (5 * i) % 9 for i in range(len(prompts))]
    refs = [hf_greedy(model, [p], n)[0] for p, n in zip(prompts, max_new)]
    eager = engine_for(model, compile_decode=False)
    compiled = _compiled_engine(model)
    sizes = _count_calls(compiled.runner.compiled)
    got_eager = _staggered(eager, prompts, max_new)
    got = _staggered(compiled, prompts, max_new)
    assert got_eager == refs
    assert got == refs
    assert len(set(sizes)) >= 3, sizes  # the batch grew and shrank during decode
    assert 1 in sizes  # the last request decodes alone (its own batch-1 graph)
    # Same allocation order => same slots: padding rows wrote nothing anywhere else.
    for a, b in zip(eager.kv_cache.k + eager.kv_cache.v, compiled.kv_cache.k + compiled.kv_cache.v):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_decode_forward_matches_ragged_logits():
    """Direct: one decode step of 3 sequences, logits vs the eager ragged forward."""
    model = _hf("llama")
    engine = engine_for(model, compile_decode=False)
    prompts = make_prompts(3, 5, 10, seed=2)  # all three prefill in one step (budget 32)
    for p in prompts:
        engine.add_request(p, SamplingParams(max_new_tokens=4, ignore_eos=True))
    engine.step()
    batch = engine.scheduler.schedule()
    assert all(s.num_tokens == 1 for s in batch.sequences)
    ref = engine.runner.execute(batch)  # [3, V] eager (writes the same K/V we rewrite below)
    bs = engine.kv_cache.spec.block_size
    width = max(len(s.block_table) for s in batch.sequences)
    table = torch.zeros(3, width, dtype=torch.long)  # [B, MB]
    for i, s in enumerate(batch.sequences):
        table[i, : len(s.block_table)] = torch.tensor(s.block_table)
    assert width * bs >= max(s.context_len for s in batch.sequences)
    with torch.inference_mode():
        got = decode_forward(
            engine.model,
            torch.tensor([s.token_ids[0] for s in batch.sequences]),
            torch.tensor([s.start_position for s in batch.sequences]),
            torch.tensor([s.slot_mapping[0] for s in batch.sequences]),
            table,
            torch.tensor([s.context_len for s in batch.sequences]),
            engine.kv_cache.k,
            engine.kv_cache.v,
        )
    torch.testing.assert_close(got.float(), ref, rtol=1e-5, atol=1e-5)


def _seq(n_tokens: int, needs_logits: bool = True, all_logits: bool = False):
    return ScheduledSequence(
        request=None, token_ids=[5] * n_tokens, start_position=3, slot_mapping=[3] * n_tokens,
        block_table=[0], needs_logits=needs_logits, all_logits=all_logits,
    )  # fmt: skip


def test_routing_takes_only_decode_batches():
    model = _hf("llama")
    engine = _compiled_engine(model, max_ragged_sequence_count=4)
    dec = engine.runner.compiled
    assert dec.accepts(ScheduledBatch([_seq(1), _seq(1)]))
    assert not dec.accepts(ScheduledBatch([]))
    assert not dec.accepts(ScheduledBatch([_seq(1), _seq(3)]))  # mixed: eager
    assert not dec.accepts(ScheduledBatch([_seq(1, needs_logits=False)]))
    assert not dec.accepts(ScheduledBatch([_seq(1, all_logits=True)]))  # prompt logprobs
    assert not dec.accepts(ScheduledBatch([_seq(1)] * 5))  # beyond the largest bucket


def test_batch_buckets():
    assert batch_buckets(1) == [1]
    assert batch_buckets(8) == [1, 2, 4, 8]
    assert batch_buckets(12) == [1, 2, 4, 8, 12]
    with pytest.raises(ValueError, match="max_batch"):
        batch_buckets(0)


def test_option_resolution_and_refusals():
    from transformers import GPT2Config, GPT2LMHeadModel

    from shardspeed.inference.fastgen.loader import build_model

    cpu = torch.device("cpu")
    llama, _ = build_model(_hf("llama"), torch.float32, cpu)
    assert resolve_compile_decode(None, llama, cpu) is None  # auto: eager (compile latency)
    assert resolve_compile_decode(True, llama, cpu) == "compile"
    assert resolve_compile_decode(False, llama, cpu) is None
    with pytest.raises(ValueError, match="compile_decode='fast'"):
        resolve_compile_decode("fast", llama, cpu)
    with pytest.raises(ValueError, match="cuda_graph"):
        engine_for(_hf("llama"), compile_decode="cuda_graph")  # no CUDA here
    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=1, n_head=2)).eval()
    ours, _ = build_model(gpt2, torch.float32, cpu)
    assert "not a DecoderModel" in unsupported_reason(ours)
    assert resolve_compile_decode(None, ours, cpu) is None
    with pytest.raises(ValueError, match="compile_decode=True"):
        resolve_compile_decode(True, ours, cpu)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["llama", "gemma2"])
def test_inductor_decode_matches_hf(family):
    """The real ``torch.compile`` (Inductor C++ kernels): same greedy tokens as HF."""
    model = _hf(family)
    prompts = make_prompts(6, 3, 30, seed=7)
    max_new = [3 + (4 * i) % 7 for i in range(len(prompts))]
    refs = [hf_greedy(model, [p], n)[0] for p, n in zip(prompts, max_new)]
    engine = engine_for(model, compile_decode=True)
    assert engine.runner.compiled is not None
    assert _staggered(engine, prompts, max_new) == refs
    assert set(engine.runner.compiled.first_call_seconds) == {0, 1}  # batch 1, batch >= 2
