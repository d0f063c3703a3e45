"""Speculative decoding (draft model and n-gram): greedy tokens equal the target alone's,
the lookahead KV is rolled back, stop rules hold mid-acceptance, bad configs are refused.

Drafts are 1-layer early exits of the tiny random targets (the target's embeddings,
first layer and head), so some proposals are accepted and some rejected.
"""

from __future__ import annotations

import pytest
import torch
from fastgen_helpers import VOCAB, engine_for, make_prompts, run_staggered

from shardspeed.inference.fastgen.engine import EngineConfig, InferenceEngine
from shardspeed.inference.fastgen.sampling_params import SamplingParams
from shardspeed.inference.fastgen.speculative import SpeculativeConfig, lookup_ngram
from shardspeed.ops import cpu_gemv

COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    bos_token_id=1, eos_token_id=2, pad_token_id=0,
)  # fmt: skip
FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "qwen3": ("Qwen3Config", dict(head_dim=16)),
    "gpt2": (
        "GPT2Config",
        dict(n_embd=64, n_layer=3, n_head=4, n_positions=256, initializer_range=0.2),
    ),
}
LLAMA_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "max_position_embeddings")  # fmt: skip
MIXED = make_prompts(6, 3, 40, seed=21)


def _family(name: str) -> tuple[torch.nn.Module, torch.nn.Module]:
    """A 3-layer random target and its 1-layer early-exit draft (same family)."""
    import transformers

    cls_name, overrides = FAMILIES[name]
    torch.manual_seed(0)
    common = {k: v for k, v in COMMON.items() if name != "gpt2" or k not in LLAMA_KEYS}
    cfg = getattr(transformers, cls_name)(**{**common, **overrides})
    target = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    layers = {"n_layer": 1} if name == "gpt2" else {"num_hidden_layers": 1}
    small = getattr(transformers, cls_name)(**{**common, **overrides, **layers})
    draft = transformers.AutoModelForCausalLM.from_config(small).float().eval()
    missing = draft.load_state_dict(target.state_dict(), strict=False).missing_keys
    assert not missing, missing
    return target, draft


def _run(model, prompts, params, **kwargs):
    engine = engine_for(model, **kwargs)
    outs = run_staggered(engine, prompts, params)  # prompts join while others decode
    return engine, outs


@pytest.mark.parametrize("name", list(FAMILIES))
def test_greedy_draft_model_is_token_identical_to_target_alone(name):
    target, draft = _family(name)
    params = SamplingParams(max_new_tokens=20)
    _, ref = _run(target, MIXED, params)
    spec = {"model": draft, "num_speculative_tokens": 3}
    engine, got = _run(target, MIXED, params, speculative_config=spec)
    for i, (a, b) in enumerate(zip(got, ref, strict=True)):
        assert a.output_token_ids == b.output_token_ids, f"prompt {i}"
        assert a.finish_reason == b.finish_reason
    stats = engine.speculator.stats
    assert 0.0 < stats.acceptance_rate < 1.0, stats  # both accept and reject paths ran
    assert engine.block_pool.num_used == 0  # every lookahead block came back


@pytest.mark.parametrize("quantization", ["int8", "int4-g32"])
def test_quantized_draft_is_token_identical_and_reads_quantized_weights(quantization):
    """speculative_config.quantization quantizes the draft's linears only: the target's
    output is unchanged, and the draft still agrees with it often."""
    from shardspeed.inference.quantization.linear import QuantizedLinear

    target, draft = _family("llama")
    params = SamplingParams(max_new_tokens=20)
    _, ref = _run(target, MIXED, params)
    spec = {"model": draft, "num_speculative_tokens": 3, "quantization": quantization}
    engine, got = _run(target, MIXED, params, speculative_config=spec)
    assert [o.output_token_ids for o in got] == [o.output_token_ids for o in ref]
    draft_linears = [m for m in engine.speculator.proposer.model.modules()
                     if isinstance(m, QuantizedLinear)]  # fmt: skip
    assert len(draft_linears) == 4  # its layer's qkv, o, gate_up, down (the head: skip_modules)
    assert not any(isinstance(m, QuantizedLinear) for m in engine.runner.model.modules())
    assert 0.0 < engine.speculator.stats.acceptance_rate < 1.0


def test_greedy_ngram_token_identical_with_logprobs_and_stop_ids(tiny_llama, prompts):
    # a repetitive prompt makes prompt lookup propose; logprobs come from the verify rows
    loop = [5, 6, 7, 8, 9] * 6
    stop_id = 9
    params = [SamplingParams(max_new_tokens=n, logprobs=2) for n in (1, 2, 7, 16)]
    params.append(SamplingParams(max_new_tokens=16, stop_token_ids=[stop_id]))
    batch = [loop, *prompts[:3], loop]
    ref = engine_for(tiny_llama).generate(batch, params)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    engine = engine_for(tiny_llama, speculative_config=spec)
    got = engine.generate(batch, params)
    for a, b in zip(got, ref, strict=True):
        assert a.output_token_ids == b.output_token_ids
        assert a.finish_reason == b.finish_reason
        if b.logprobs is not None:
            for x, y in zip(a.logprobs, b.logprobs, strict=True):
                assert x.token_id == y.token_id and x.logprob == pytest.approx(y.logprob, abs=1e-4)
                assert [t for t, _ in x.top] == [t for t, _ in y.top]
    assert [len(o.output_token_ids) for o in got[:4]] == [1, 2, 7, 16]  # never past max
    assert engine.speculator.stats.num_accepted_tokens > 0


def test_lookahead_blocks_roll_back_after_each_step(tiny_llama):
    target, draft = _family("llama")
    spec = {"model": draft, "num_speculative_tokens": 4}
    engine = engine_for(target, speculative_config=spec, block_size=4)
    for p in MIXED[:3]:
        engine.add_request(p, SamplingParams(max_new_tokens=30))
    pool = engine.block_pool
    seen_reject = False
    stats = engine.speculator.stats
    while engine.has_unfinished():
        rejected = stats.num_draft_tokens - stats.num_accepted_tokens
        engine.step()
        seen_reject |= stats.num_draft_tokens - stats.num_accepted_tokens > rejected
        running = engine.scheduler.running
        for req in [r for r in running if r.output_token_ids]:
            # exactly the blocks of its computed tokens (as without speculation); only the
            # last token lacks its K/V
            assert len(req.block_table) == pool.blocks_for_tokens(req.num_computed_tokens)
            assert req.num_computed_tokens == req.num_tokens - 1
        assert pool.num_used == sum(len(r.block_table) for r in running)
    assert seen_reject and pool.num_used == 0


def test_tight_cache_proposes_fewer_tokens_instead_of_failing(tiny_llama, prompts):
    params = SamplingParams(max_new_tokens=12)
    ref = engine_for(tiny_llama, num_blocks=24).generate(prompts[:4], params)
    spec = {"model": tiny_llama, "num_speculative_tokens": 6}  # the target drafts itself
    engine = engine_for(tiny_llama, num_blocks=24, speculative_config=spec)
    got = engine.generate(prompts[:4], params)
    assert [o.output_token_ids for o in got] == [o.output_token_ids for o in ref]
    assert engine.speculator.stats.acceptance_rate == 1.0
    assert engine.block_pool.num_used == 0


def test_stop_string_inside_accepted_tokens_cuts_there():
    from shardspeed.models.gpt import GPT, GPTConfig
    from shardspeed.models.tokenizer import ByteTokenizer

    torch.manual_seed(0)
    model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=64))

    def engine(**kw):
        return InferenceEngine.from_pretrained(
            model, tokenizer=ByteTokenizer(), device="cpu", block_size=4, num_blocks=64, **kw
        )

    base = dict(max_new_tokens=30, ignore_eos=True)
    full = engine().generate(["abcabc"], SamplingParams(**base))[0]
    stop = full.text[7:10]
    spec = {"model": model, "num_speculative_tokens": 5}
    plain = engine().generate(["abcabc"], SamplingParams(**base, stop=stop))[0]
    fast = engine(speculative_config=spec)
    got = fast.generate(["abcabc"], SamplingParams(**base, stop=stop))[0]
    assert got.text == plain.text and got.output_token_ids == plain.output_token_ids
    assert got.finish_reason == "stop" and fast.speculator.stats.num_accepted_tokens > 0


def test_processors_and_structured_requests_decode_without_proposals(tiny_llama, prompts):
    params = SamplingParams(max_new_tokens=8, repetition_penalty=1.3)
    ref = engine_for(tiny_llama).generate(prompts[:2], params)
    engine = engine_for(
        tiny_llama, speculative_config={"model": tiny_llama, "num_speculative_tokens": 3}
    )
    got = engine.generate(prompts[:2], params)
    assert [o.output_token_ids for o in got] == [o.output_token_ids for o in ref]
    assert engine.speculator.stats.num_draft_tokens == 0


def test_lookup_ngram_takes_the_longest_latest_full_match():
    assert lookup_ngram([1, 2, 3, 9, 1, 2, 3, 7, 1, 2, 3], 2, 1, 3) == [7, 1]
    assert lookup_ngram([4, 1, 2, 5, 2], 3, 1, 2) == [5, 2]  # only the 1-gram [2] recurs
    assert lookup_ngram([1, 2, 3], 3, 1, 3) == []
    assert lookup_ngram([7, 7], 4, 1, 1) == [7]
    assert lookup_ngram([5, 6] * 4, 4, 1, 4) == [5, 6, 5, 6]  # a loop: a full k, not 1 period


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        ({"method": "eagle", "num_speculative_tokens": 2}, r"method='eagle' is not supported"),
        ({"method": "ngram", "num_speculative_tokens": 0}, r"num_speculative_tokens=0 must be"),
        ({"method": "ngram"}, r"needs 'num_speculative_tokens'"),
        ({"num_speculative_tokens": 2}, r"needs a 'method'"),
        ({"method": "draft_model", "num_speculative_tokens": 2}, r"needs 'model'"),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4,
          "prompt_lookup_max": 2}, r"prompt_lookup_min=4 is above prompt_lookup_max=2"),
        ({"method": "ngram", "num_speculative_tokens": 2, "k": 3}, r"unknown key\(s\) \['k'\]"),
        ({"method": "ngram", "num_speculative_tokens": 2, "quantization": "int8"},
         r"quantization='int8' is set but method='ngram' uses no draft model"),
        ({"model": "x", "num_speculative_tokens": 2, "quantization": "int3"},
         r"speculative_config.quantization: .*int3"),
        ({"model": "x", "num_speculative_tokens": 2, "quantization": 8},
         r"speculative_config.quantization: quantization=8"),
        ("ngram", r"must be None, a dict"),
    ],
)  # fmt: skip
def test_bad_speculative_config_is_refused_by_name(spec, match):
    with pytest.raises(ValueError, match=match):
        EngineConfig(speculative_config=spec).validate()


def test_speculation_refuses_parallel_engines_and_foreign_vocabularies(tiny_llama):
    spec = {"method": "ngram", "num_speculative_tokens": 2}
    with pytest.raises(ValueError, match=r"cannot be combined with tensor_parallel=2"):
        EngineConfig(speculative_config=spec, tensor_parallel=2).validate()
    from transformers import LlamaConfig, LlamaForCausalLM

    other = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=VOCAB + 2000,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
        )
    )
    with pytest.raises(ValueError, match=r"draft's vocabulary \(2128\) is not the target's"):
        engine_for(tiny_llama, speculative_config={"model": other, "num_speculative_tokens": 2})
    assert SpeculativeConfig.parse({"model": "x", "num_speculative_tokens": 2}).method == (
        "draft_model"
    )


@pytest.mark.parametrize(
    "engine_kwargs",
    [dict(enable_prefix_caching=True), dict(kv_cache_dtype="int8"), dict(scheduler="static")],
    ids=["prefix_caching", "int8_kv", "static"],
)
def test_draft_model_with_prefix_caching_int8_kv_and_static_batches(engine_kwargs):
    # the target drafts for itself: every proposal must be accepted, which holds only if
    # the draft's own KV (shared prefix blocks, int8 blocks) is right
    target, _ = _family("llama")
    shared = MIXED[0] * 2  # the prompts share their first blocks
    batch = [shared + p for p in MIXED[1:4]]
    params = SamplingParams(max_new_tokens=12)
    _, ref = _run(target, batch, params, **engine_kwargs)
    spec = {"model": target, "num_speculative_tokens": 3}
    engine, got = _run(target, batch, params, speculative_config=spec, **engine_kwargs)
    assert [o.output_token_ids for o in got] == [o.output_token_ids for o in ref]
    assert engine.speculator.stats.acceptance_rate == 1.0, engine.speculator.stats
    assert engine.block_pool.num_used == 0


def test_sampled_n_samples_with_seeds_are_reproducible(tiny_llama, prompts):
    spec = {"model": tiny_llama, "num_speculative_tokens": 3}
    params = SamplingParams(max_new_tokens=10, temperature=0.8, top_p=0.9, seed=7, n=2)

    def run():
        return [o.output_token_ids for o in engine_for(tiny_llama, speculative_config=spec)
                .generate(prompts[:2], params)]  # fmt: skip

    first = run()
    assert len(first) == 4 and all(len(t) == 10 for t in first)
    assert first == run()  # seeded samples draw from their own generators


def test_ngram_on_a_sliding_window_target_and_draft_refused_there():
    import transformers

    torch.manual_seed(0)
    cfg = transformers.MistralConfig(**{**COMMON, "num_hidden_layers": 2, "sliding_window": 8})
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    prompts = make_prompts(4, 17, 40, seed=12)  # longer than the window: blocks get freed
    params = SamplingParams(max_new_tokens=24)
    _, ref = _run(model, prompts, params)
    spec = {"method": "ngram", "num_speculative_tokens": 4}
    engine, got = _run(model, prompts, params, speculative_config=spec)
    assert [o.output_token_ids for o in got] == [o.output_token_ids for o in ref]
    assert engine.scheduler.num_window_freed_blocks > 0
    assert engine.speculator.stats.num_accepted_tokens > 0
    _, draft = _family("llama")
    with pytest.raises(ValueError, match=r"sliding window.*method='ngram'"):
        engine_for(model, speculative_config={"model": draft, "num_speculative_tokens": 2})


def test_failed_speculative_forward_falls_back_to_the_usual_step(tiny_llama, prompts):
    params = SamplingParams(max_new_tokens=10)
    ref = engine_for(tiny_llama).generate(prompts[:3], params)
    engine = engine_for(tiny_llama, speculative_config={"model": tiny_llama,
                                                        "num_speculative_tokens": 3})  # fmt: skip
    propose = engine.speculator.proposer.propose
    calls = []

    def flaky(*args):
        calls.append(1)
        if len(calls) % 2:
            raise RuntimeError("draft broke")
        return propose(*args)

    engine.speculator.proposer.propose = flaky
    got = engine.generate(prompts[:3], params)
    assert [o.output_token_ids for o in got] == [o.output_token_ids for o in ref]
    assert len(calls) > 2 and engine.block_pool.num_used == 0


@pytest.mark.skipif(
    torch.bfloat16 not in cpu_gemv.kernel_dtypes(), reason="no AVX-512-BF16 GEMV kernel here"
)
def test_bf16_batch1_verify_takes_the_decode_kernel_and_keeps_every_token(monkeypatch):
    """In bf16 at batch 1 a verify of 3 drafts is a 4-row product: it runs through the GEMV
    kernel, whose sums do not depend on the rows beside them, so each verified position
    gets the logits its 1-row decode would, and greedy output equals the target alone's,
    ties included, over many tokens."""
    target, draft = _family("llama")
    target, draft = target.to(torch.bfloat16), draft.to(torch.bfloat16)
    rows: list[int] = []
    kernel = cpu_gemv.linear
    monkeypatch.setattr(
        cpu_gemv, "linear", lambda x, w, b: rows.append(x.shape[0]) or kernel(x, w, b)
    )
    params = SamplingParams(max_new_tokens=48, ignore_eos=True)
    plain = engine_for(target, dtype=torch.bfloat16)
    spec = engine_for(target, dtype=torch.bfloat16,
                      speculative_config={"model": draft, "num_speculative_tokens": 3})  # fmt: skip
    for prompt in MIXED:  # one request at a time: batch 1
        ref = plain.generate([prompt], params)[0].output_token_ids
        rows.clear()
        got = spec.generate([prompt], params)[0].output_token_ids
        assert got == ref
        assert 4 in rows  # the verify forwards (1 + 3 rows) went through the kernel
    assert 0.0 < spec.speculator.stats.acceptance_rate < 1.0
