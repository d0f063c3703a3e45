"""Greedy outputs of the ragged engine match HF generate token for token."""

from __future__ import annotations

import pytest
import torch
from fastgen_helpers import MAX_NEW, VOCAB, engine_for, hf_greedy, make_prompts, run_staggered

from shardspeed.inference.fastgen.engine import InferenceEngine
from shardspeed.inference.fastgen.sampling_params import SamplingParams

GREEDY = SamplingParams(max_new_tokens=MAX_NEW)


def _tokens(outputs):
    return [o.output_token_ids for o in outputs]


@pytest.mark.parametrize("scheduler", ["splitfuse", "prefill_first", "static"])
def test_llama_gqa_matches_hf_with_staggered_arrivals(tiny_llama, prompts, llama_refs, scheduler):
    engine = engine_for(tiny_llama, scheduler=scheduler)
    outs = run_staggered(engine, prompts, GREEDY)
    assert _tokens(outs) == llama_refs
    assert all(o.finish_reason in ("length", "stop") for o in outs)
    assert engine.stats().kv_blocks_used == 0


@pytest.mark.parametrize("scheduler", ["splitfuse", "prefill_first", "static"])
def test_llama_preemption_by_recompute_matches_uninterrupted(
    tiny_llama, prompts, llama_refs, scheduler
):
    # 14 blocks of 4 slots hold ~1.5 of the longest requests: preemption is unavoidable.
    engine = engine_for(tiny_llama, num_blocks=14, watermark=0.0, scheduler=scheduler)
    outs = run_staggered(engine, prompts, GREEDY)
    assert engine.stats().num_preemptions > 0
    assert _tokens(outs) == llama_refs
    assert engine.stats().kv_blocks_used == 0


def test_llama_prefix_caching_reuses_blocks_and_matches(tiny_llama):
    shared = make_prompts(1, 17, 17, seed=7)[0]
    tails = make_prompts(6, 2, 9, seed=8)
    prompts = [shared + t for t in tails]
    refs = hf_greedy(tiny_llama, prompts, MAX_NEW)
    engine = engine_for(tiny_llama, enable_prefix_caching=True, max_ragged_sequence_count=2)
    outs = run_staggered(engine, prompts, GREEDY)
    assert _tokens(outs) == refs
    assert engine.stats().prefix_cache_hit_blocks >= 4  # 17 shared tokens = 4 full blocks
    # the same prompt again hits every full block but the one holding its last token
    again = engine.generate([prompts[0]], GREEDY)[0]
    assert again.output_token_ids == refs[0]


def test_gpt2_matches_hf(prompts):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(
        vocab_size=VOCAB,
        n_positions=128,
        n_embd=64,
        n_layer=2,
        n_head=4,
        bos_token_id=1,
        eos_token_id=1,
    )
    model = GPT2LMHeadModel(cfg).eval()
    refs = hf_greedy(model, prompts, MAX_NEW)
    outs = run_staggered(engine_for(model), prompts, GREEDY)
    assert _tokens(outs) == refs


def test_shardspeed_gpt_matches_uncached_greedy_loop(prompts):
    from shardspeed.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=VOCAB, block_size=64, n_layer=2, n_head=4, n_embd=64)).eval()
    refs = []
    with torch.no_grad():
        for p in prompts:
            out = model.generate(torch.tensor([p]), MAX_NEW, temperature=0.0)
            refs.append(out[0, len(p) :].tolist())
    engine = engine_for(model)
    outs = run_staggered(engine, prompts, SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))
    assert _tokens(outs) == refs


@pytest.mark.parametrize("variant", ["qwen2", "llama3_rope_tied"])
def test_llama_family_variants_match_hf(variant):
    torch.manual_seed(0)
    common = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=128,
    )  # fmt: skip
    if variant == "qwen2":
        from transformers import Qwen2Config, Qwen2ForCausalLM

        model = Qwen2ForCausalLM(Qwen2Config(**common))
    else:
        from transformers import LlamaConfig, LlamaForCausalLM

        rope = {
            "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
            "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 16,
        }  # fmt: skip
        cfg = LlamaConfig(**common, rope_parameters=rope, tie_word_embeddings=True)
        model = LlamaForCausalLM(cfg)
    model.eval()
    prompts = make_prompts(3, 5, 30, seed=3)
    refs = hf_greedy(model, prompts, MAX_NEW)
    assert _tokens(engine_for(model).generate(prompts, GREEDY)) == refs


def test_load_from_sharded_hf_dir_and_gpt_dir(tmp_path, tiny_llama):
    from shardspeed.models.gpt import GPT, GPTConfig
    from shardspeed.models.tokenizer import ByteTokenizer

    tiny_llama.save_pretrained(tmp_path / "llama", max_shard_size="100KB")
    assert (tmp_path / "llama" / "model.safetensors.index.json").is_file()
    prompts = make_prompts(2, 4, 12, seed=5)
    refs = hf_greedy(tiny_llama, prompts, MAX_NEW)
    engine = InferenceEngine.from_pretrained(tmp_path / "llama", block_size=4, num_blocks=64)
    assert _tokens(engine.generate(prompts, GREEDY)) == refs

    torch.manual_seed(0)
    gpt = GPT(GPTConfig(vocab_size=256, block_size=64, n_layer=1, n_head=2, n_embd=32)).eval()
    gpt.save_pretrained(tmp_path / "gpt")
    from_dir = InferenceEngine.from_pretrained(tmp_path / "gpt", num_blocks=32)
    from_obj = InferenceEngine.from_pretrained(gpt, num_blocks=32)
    assert isinstance(from_dir.tokenizer, ByteTokenizer)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    a, b = from_dir.generate(["hello"], params)[0], from_obj.generate(["hello"], params)[0]
    assert a.output_token_ids == b.output_token_ids
    assert a.text == ByteTokenizer().decode(a.output_token_ids)
