"""OpenAI / vLLM sampling features on the engine: logprobs, n / best_of with shared KV
blocks, presence / frequency / repetition penalties, logit_bias, min_tokens, stop
strings across token boundaries, the context limit and KV sizing for a 128k context.

References: HF's model forward (log-softmax within 1e-4), HF ``generate`` with its
repetition-penalty processor (token-identical), and hand-computed OpenAI penalties.
"""

from __future__ import annotations

import logging

import pytest
import torch
from fastgen_helpers import engine_for

from shardspeed.inference.fastgen import kv_cache as kv_cache_module
from shardspeed.inference.fastgen.engine import InferenceEngine
from shardspeed.inference.fastgen.sampling_params import SamplingParams
from shardspeed.models.tokenizer import ByteTokenizer

EOS = 2  # LlamaConfig's default eos_token_id


def _hf_log_probs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)  # [T, V]


def test_logprobs_and_prompt_logprobs_equal_hf_log_softmax(tiny_llama, prompts):
    engine = engine_for(tiny_llama)
    params = SamplingParams(max_new_tokens=5, logprobs=3, prompt_logprobs=2, ignore_eos=True)
    for prompt, out in zip(prompts[:4], engine.generate(prompts[:4], params)):
        ref = _hf_log_probs(tiny_llama, prompt + out.output_token_ids)
        n = len(prompt)
        assert len(out.logprobs) == len(out.output_token_ids) == 5
        for i, entry in enumerate(out.logprobs):
            row = ref[n - 1 + i]
            assert abs(entry.logprob - row[entry.token_id].item()) < 1e-4
            top_ids = [t for t, _ in entry.top]
            assert top_ids == row.topk(3).indices.tolist()
            assert entry.token_id == top_ids[0]  # greedy picks the most likely
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == n
        for pos in range(1, n):
            entry = out.prompt_logprobs[pos]
            assert entry.token_id == prompt[pos] and len(entry.top) == 2
            assert abs(entry.logprob - ref[pos - 1, prompt[pos]].item()) < 1e-4
        assert out.cumulative_logprob == pytest.approx(sum(e.logprob for e in out.logprobs))


def test_n_samples_fork_the_prompt_blocks_and_equal_solo_seeded_requests(tiny_llama, prompts):
    engine = engine_for(tiny_llama, block_size=4)
    prompt = prompts[2]  # 14 tokens: 3 full blocks + a partial one
    assert len(prompt) % 4 != 0
    params = SamplingParams(max_new_tokens=6, temperature=1.0, seed=11, n=3, ignore_eos=True)
    rid = engine.add_request(prompt, params)
    shared = None
    while shared is None:
        engine.step()
        parent = engine._requests[f"{rid}#0"]
        if parent.output_token_ids:
            shared = list(parent.block_table[: len(prompt) // 4])
    # After the prefill step the three samples hold the prompt's full blocks together.
    assert [engine.block_pool.ref_counts[b] for b in shared] == [3, 3, 3]
    finals = {}
    while engine.has_unfinished():
        finals.update({o.request_id: o for o in engine.step() if o.finished})
    assert sorted(finals) == [f"{rid}#{i}" for i in range(3)]
    assert engine.block_pool.num_used == 0  # every reference was dropped
    for i in range(3):  # sample i draws like a lone request seeded with seed + i
        solo = engine.generate(
            [prompt],
            SamplingParams(max_new_tokens=6, temperature=1.0, seed=11 + i, ignore_eos=True),
        )[0]
        assert finals[f"{rid}#{i}"].output_token_ids == solo.output_token_ids
        assert finals[f"{rid}#{i}"].index == i
    assert len({tuple(o.output_token_ids) for o in finals.values()}) > 1


def test_best_of_returns_the_most_likely_samples(tiny_llama, prompts):
    engine = engine_for(tiny_llama)
    params = SamplingParams(max_new_tokens=4, temperature=1.0, seed=3, n=2, best_of=4)
    outs = engine.generate(prompts[:2], params)
    assert [o.index for o in outs] == [0, 1, 0, 1]
    for out in outs:  # cumulative logprob re-derived from HF
        ref = _hf_log_probs(tiny_llama, out.prompt_token_ids + out.output_token_ids)
        n = len(out.prompt_token_ids)
        total = sum(ref[n - 1 + i, t].item() for i, t in enumerate(out.output_token_ids))
        assert out.cumulative_logprob == pytest.approx(total, abs=1e-3)
    assert outs[0].cumulative_logprob >= outs[1].cumulative_logprob


def test_abort_before_fork_finishes_every_sample(tiny_llama, prompts):
    engine = engine_for(tiny_llama)
    rid = engine.add_request(prompts[0], SamplingParams(temperature=1.0, n=3))
    engine.abort(rid)
    outs = engine.step()
    assert sorted(o.request_id for o in outs) == [f"{rid}#{i}" for i in range(3)]
    assert all(o.finish_reason == "abort" for o in outs) and not engine.has_unfinished()


def test_repetition_penalty_token_identical_to_hf(tiny_llama, prompts):
    engine = engine_for(tiny_llama)
    params = SamplingParams(max_new_tokens=10, repetition_penalty=1.8, ignore_eos=True)
    outs = engine.generate(prompts[:4], params)
    with torch.no_grad():
        for p, out in zip(prompts[:4], outs):
            ref = tiny_llama.generate(
                torch.tensor([p]),
                do_sample=False,
                max_new_tokens=10,
                repetition_penalty=1.8,
                pad_token_id=0,
                eos_token_id=None,
            )[0, len(p) :].tolist()
            assert out.output_token_ids == ref


def _hand_penalized_greedy(model, prompt, steps, presence, frequency, bias=None):
    """Greedy decoding with OpenAI's penalties computed by hand on HF logits."""
    ids = list(prompt)
    out: list[int] = []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([ids])).logits[0, -1].float().clone()
            for tok in set(out):
                count = out.count(tok)
                logits[tok] -= count * frequency + presence
            for tok, b in (bias or {}).items():
                logits[tok] += b
            nxt = int(logits.argmax())
            out.append(nxt)
            ids.append(nxt)
    return out


def test_presence_frequency_penalties_and_logit_bias_match_hand_computation(tiny_llama, prompts):
    engine = engine_for(tiny_llama)
    bias = {5: 0.8, 9: -3.0}
    params = SamplingParams(
        max_new_tokens=12,
        presence_penalty=1.2,
        frequency_penalty=0.9,
        logit_bias=bias,
        ignore_eos=True,
    )
    outs = engine.generate(prompts[:3], params)
    for p, out in zip(prompts[:3], outs):
        assert out.output_token_ids == _hand_penalized_greedy(tiny_llama, p, 12, 1.2, 0.9, bias)
    plain = engine.generate(prompts[:3], SamplingParams(max_new_tokens=12, ignore_eos=True))
    assert [o.output_token_ids for o in outs] != [o.output_token_ids for o in plain]


def test_min_tokens_holds_back_eos_and_logit_bias_forces_it(tiny_llama, prompts):
    engine = engine_for(tiny_llama)
    forced = SamplingParams(max_new_tokens=10, logit_bias={EOS: 100.0})
    out = engine.generate([prompts[0]], forced)[0]
    assert out.output_token_ids == [EOS] and out.finish_reason == "stop"
    held = SamplingParams(max_new_tokens=10, logit_bias={EOS: 100.0}, min_tokens=4, logprobs=0)
    out = engine.generate([prompts[0]], held)[0]
    assert len(out.output_token_ids) == 5 and out.output_token_ids[-1] == EOS
    assert EOS not in out.output_token_ids[:4] and out.finish_reason == "stop"
    assert all(e.logprob == float("-inf") for e in out.logprobs[:4] if e.token_id == EOS)


def test_stop_string_spanning_tokens_and_held_until_min_tokens():
    from shardspeed.models.gpt import GPT, GPTConfig

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=64))
    engine = InferenceEngine.from_pretrained(model, tokenizer=ByteTokenizer(), device="cpu")
    # Sample lowercase ASCII only (one byte token per character).
    only_letters = {t: -100.0 for t in range(256) if not 97 <= t <= 122}
    base = dict(max_new_tokens=12, temperature=1.0, seed=4, ignore_eos=True)
    base["logit_bias"] = only_letters
    full = engine.generate(["abc"], SamplingParams(**base))[0].text
    starts = [i for i in range(1, 8) if full.count(full[i : i + 3]) == 1]
    stop = full[starts[0] : starts[0] + 3]  # three tokens: only the last completes it
    out = engine.generate(["abc"], SamplingParams(**base, stop=stop))[0]
    assert out.text == full[: starts[0]] and out.finish_reason == "stop"
    late = SamplingParams(**base, stop=stop, min_tokens=starts[0] + 4)  # completes below it
    out = engine.generate(["abc"], late)[0]
    assert out.text == full and out.finish_reason == "length"
    edge = SamplingParams(**base, stop=stop, min_tokens=starts[0] + 2)  # spans min_tokens
    assert engine.generate(["abc"], edge)[0].text == full[: starts[0]]


def test_context_limit_rejects_unless_truncating(tiny_llama):
    engine = engine_for(tiny_llama)  # max_seq_len = 128 (max_position_embeddings)
    prompt = list(range(3, 103))
    with pytest.raises(ValueError, match=r"maximum context length is 128 tokens.*130 tokens"):
        engine.add_request(prompt, SamplingParams(max_new_tokens=30, truncate=False))
    out = engine.generate([prompt], SamplingParams(max_new_tokens=30, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.output_token_ids) == 28


def test_128k_context_kv_cache_is_sized_from_memory_budget(monkeypatch, caplog):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=131072,
    )
    model = LlamaForCausalLM(cfg).eval()
    free = 256 * 2**20
    monkeypatch.setattr(kv_cache_module, "free_memory_bytes", lambda device: free)
    for kv_cache_memory, fraction in (
        (None, kv_cache_module.DEFAULT_KV_FRACTION["cpu"]),
        (0.05, 0.05),
    ):
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="shardspeed.inference.fastgen.kv_cache"):
            engine = InferenceEngine.from_pretrained(
                model, device="cpu", kv_cache_memory=kv_cache_memory
            )
        assert engine.max_seq_len == 131072
        kv_bytes = sum(t.numel() * t.element_size() for t in engine.kv_cache.k + engine.kv_cache.v)
        assert kv_bytes <= fraction * free
        assert kv_bytes > 0.9 * fraction * free  # the budget is used, not a tiny default
        lines = [r.getMessage() for r in caplog.records if "KV cache:" in r.getMessage()]
        assert len(lines) == 1
        assert f"{fraction:g} x 0.250 GiB free" in lines[0] and "num_blocks" in lines[0]
        out = engine.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3, ignore_eos=True))
        assert len(out[0].output_token_ids) == 3
