"""KV blocks outside a sliding window are freed; length-dependent RoPE matches HF exactly.

* Sliding window (Mistral, 8-token window, 4-token blocks): a decoding request holds at
  most ``ceil((window - 1) / block_size) + 1`` blocks, output is token-identical to HF
  ``generate``, requests far longer than the whole cache run, and ``n`` > 1 forks,
  prefix caching and preemption give the same tokens as with freeing turned off.
* longrope (Phi-3) crossing ``original_max_position_embeddings`` mid-generation: the
  scheduler recomputes the sequence as HF does.
* dynamic / longrope with chunked prompts longer than the limit: every chunk is rotated
  for the whole prompt's length, as HF's one-shot prefill.
"""

from __future__ import annotations

import pytest
import torch
from fastgen_helpers import VOCAB, hf_greedy, make_prompts, run_staggered

from shardspeed.inference.fastgen.block_pool import PLACEHOLDER_BLOCK
from shardspeed.inference.fastgen.engine import InferenceEngine
from shardspeed.inference.fastgen.request import Request
from shardspeed.inference.fastgen.sampling_params import SamplingParams

WINDOW, BS = 8, 4
BOUND = -(-(WINDOW - 1) // BS) + 1  # blocks a decoding request may hold: 3
COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.1,
)  # fmt: skip


def _build(config_cls_name: str, **overrides):
    import transformers

    torch.manual_seed(0)
    cfg = getattr(transformers, config_cls_name)(**{**COMMON, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return model.float().eval()


_MISTRAL: dict = {}


def _mistral():
    if not _MISTRAL:
        _MISTRAL["model"] = _build("MistralConfig", sliding_window=WINDOW)
    return _MISTRAL["model"]


def _engine(model, **kwargs) -> InferenceEngine:
    config = dict(block_size=BS, num_blocks=256, max_ragged_batch_size=16)
    config.update(kwargs)
    return InferenceEngine.from_pretrained(model, **config)


def _live(req: Request) -> int:
    return sum(b != PLACEHOLDER_BLOCK for b in req.block_table)


def _run_tracking(engine: InferenceEngine, prompts, params) -> tuple[list, int, int]:
    """Outputs in prompt order, the most blocks a decoding request held and the most
    blocks used in all."""
    sched, peaks = engine.scheduler, [0, 0]
    schedule = sched.schedule

    def tracked():  # blocks held while the step's forward runs
        batch = schedule()
        for seq in batch.sequences:
            if seq.num_tokens == 1:
                peaks[0] = max(peaks[0], _live(seq.request))
        peaks[1] = max(peaks[1], engine.block_pool.num_used)
        return batch

    sched.schedule = tracked
    ids = [engine.add_request(p, params) for p in prompts]
    finals = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                finals[out.request_id] = out
    assert engine.block_pool.num_free == engine.block_pool.num_blocks  # nothing leaked
    return [finals[i] for i in ids], peaks[0], peaks[1]


def test_window_blocks_bounded_and_match_hf():
    model = _mistral()
    prompts = make_prompts(6, 10, 30, seed=21)
    refs = hf_greedy(model, prompts, 48)
    engine = _engine(model)
    assert engine.scheduler.kv_window == WINDOW
    outs, peak_decode, _ = _run_tracking(engine, prompts, SamplingParams(max_new_tokens=48))
    assert [o.output_token_ids for o in outs] == refs
    assert 0 < peak_decode <= BOUND
    assert engine.scheduler.num_window_freed_blocks > 0


def test_requests_longer_than_the_cache_fit():
    """8 requests of ~70 tokens (~18 blocks each, ~140 in all) in a 40-block cache; one
    request of 120 tokens (30 blocks) in a 12-block cache."""
    model = _mistral()
    prompts = make_prompts(8, 12, 24, seed=22)
    refs = hf_greedy(model, prompts, 48)
    engine = _engine(model, num_blocks=40, max_ragged_batch_size=32)
    outs, _, peak_used = _run_tracking(engine, prompts, SamplingParams(max_new_tokens=48))
    assert [o.output_token_ids for o in outs] == refs
    assert engine.stats().num_preemptions == 0 and peak_used <= 40
    full = sum(engine.block_pool.blocks_for_tokens(len(p) + 47) for p in prompts)
    assert full > 3 * 40

    long_prompt = make_prompts(1, 20, 20, seed=23)
    small = _engine(model, num_blocks=12, max_ragged_batch_size=8)
    outs, _, peak_used = _run_tracking(small, long_prompt, SamplingParams(max_new_tokens=100))
    assert outs[0].output_token_ids == hf_greedy(model, long_prompt, 100)[0]
    assert peak_used <= 12


def _without_freeing(engine: InferenceEngine) -> InferenceEngine:
    engine.scheduler.kv_window = None  # the reference: every block kept
    return engine


def test_forks_prefix_cache_and_preemption_unchanged_by_freeing():
    """Seeded n=3 samples forked after a chunked prompt longer than the window (the parent
    holds placeholders when it forks), prefix caching and preemption in a small cache give
    exactly the tokens of the same engine keeping every block."""
    model = _mistral()
    prompts = make_prompts(6, 18, 30, seed=24)
    prompts[3] = prompts[0][:20] + prompts[3][:6]  # shares 5 full blocks with prompts[0]
    params = SamplingParams(max_new_tokens=24, n=3, temperature=0.9, seed=7)
    for kwargs in (
        dict(enable_prefix_caching=True, max_ragged_batch_size=8),
        dict(num_blocks=14, max_ragged_batch_size=64),  # tight: forces preemptions
    ):
        engine = _engine(model, **kwargs)
        forked_from, add_forked = [], engine.scheduler.add_forked

        def tracked(child, parent, kv_cache, seen=forked_from, fork=add_forked):
            seen.append(list(parent.block_table))
            return fork(child, parent, kv_cache)

        engine.scheduler.add_forked = tracked
        got = engine.generate(prompts, params)
        assert any(PLACEHOLDER_BLOCK in table for table in forked_from)
        ref = _without_freeing(_engine(model, **kwargs)).generate(prompts, params)
        assert [o.output_token_ids for o in got] == [o.output_token_ids for o in ref]
        assert len(got) == 3 * len(prompts) and engine.scheduler.num_window_freed_blocks > 0
    engine = _engine(model, num_blocks=14, max_ragged_batch_size=64)
    greedy = engine.generate(prompts, SamplingParams(max_new_tokens=24))
    assert engine.stats().num_preemptions > 0
    assert [o.output_token_ids for o in greedy] == hf_greedy(model, prompts, 24)


def test_prefix_hit_needs_only_the_blocks_inside_the_window():
    """The first blocks of a cached prefix were evicted: a later prompt with that prefix
    still reuses the blocks inside its window (the evicted ones become placeholders)."""
    model = _mistral()
    engine = _engine(model, enable_prefix_caching=True)
    prefix = make_prompts(1, 32, 32, seed=25)[0]
    engine.generate([prefix], SamplingParams(max_new_tokens=2))
    req = Request("probe", prefix, SamplingParams())
    hashes = req.compute_block_hashes(BS, len(prefix))
    pool = engine.block_pool
    assert all(pool.cached_block(h) is not None for h in hashes)
    for h in hashes[:4]:  # evict the first 16 tokens' blocks
        pool.forget(pool.cached_block(h))
    hits_before = pool.num_cache_hits
    prompt = prefix + [5, 6, 7]
    out = engine.generate([prompt], SamplingParams(max_new_tokens=16))[0]
    assert out.output_token_ids == hf_greedy(model, [prompt], 16)[0]
    # tokens 0..31 cached; the window of token 32 needs blocks 6 and 7 only
    assert pool.num_cache_hits - hits_before == 2
    assert out.metrics is not None


# ---------------------------------------------------------------- length-dependent RoPE
def _longrope_phi3(**overrides):
    g = torch.Generator().manual_seed(4)
    rope = {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "long_factor": (1.0 + torch.rand(8, generator=g) * 4).tolist(),
        "short_factor": (1.0 + torch.rand(8, generator=g)).tolist(),
    }
    return _build(
        "Phi3Config", rope_parameters=rope, original_max_position_embeddings=16,
        max_position_embeddings=128, **overrides,
    )  # fmt: skip


def _hf_fresh(model, prompts, max_new):
    """HF greedy, each prompt on fresh rotary state (dynamic NTK keeps the longest length
    it has seen across calls; a 1-token forward resets it)."""
    refs = []
    for p in prompts:
        with torch.no_grad():
            model(torch.tensor([[p[0]]]))
        refs += hf_greedy(model, [p], max_new)
    return refs


def test_longrope_crossing_mid_generation_matches_hf():
    model = _longrope_phi3()
    prompts = make_prompts(6, 3, 14, seed=26)  # all cross 16 while generating 24 tokens
    refs = hf_greedy(model, prompts, 24)
    engine = _engine(model, enable_prefix_caching=True)
    assert engine.scheduler.rope_recompute_len == 17
    outs = run_staggered(engine, prompts, SamplingParams(max_new_tokens=24))
    assert [o.output_token_ids for o in outs] == refs
    assert engine.scheduler.num_rope_recomputes == len(prompts)


def test_longrope_prefix_cache_keeps_short_and_long_keys_apart():
    """A short prompt's blocks (short factors) are never reused by a prompt longer than the
    original length (long factors), and vice versa."""
    model = _longrope_phi3()
    short = make_prompts(1, 12, 12, seed=27)[0]
    long = short + make_prompts(1, 12, 12, seed=28)[0]  # 24 > 16 tokens
    engine = _engine(model, enable_prefix_caching=True)
    for prompt in (short, long, short):
        out = engine.generate([prompt], SamplingParams(max_new_tokens=3))[0]
        assert out.output_token_ids == hf_greedy(model, [prompt], 3)[0]
    assert engine.block_pool.num_cache_hits == 2  # only the repeated short prompt hit


def test_chunked_long_prompts_match_hf():
    """Prompts longer than the rope limit, prefilled in 8-token chunks (dynamic: limit 32;
    longrope: original length 16), with a small cache forcing recomputes."""
    dyn = _build(
        "LlamaConfig", max_position_embeddings=32,
        rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 4.0},
    )  # fmt: skip
    prompts = make_prompts(4, 36, 50, seed=29)
    refs = _hf_fresh(dyn, prompts, 12)
    for kwargs in (dict(), dict(num_blocks=32, max_ragged_sequence_count=4)):
        engine = _engine(dyn, max_ragged_batch_size=8, max_seq_len=128, **kwargs)
        outs = engine.generate(prompts, SamplingParams(max_new_tokens=12))
        assert [o.output_token_ids for o in outs] == refs
    assert engine.stats().num_preemptions > 0

    lr = _longrope_phi3()
    prompts = make_prompts(4, 18, 40, seed=30)
    engine = _engine(lr, max_ragged_batch_size=8)
    outs = engine.generate(prompts, SamplingParams(max_new_tokens=12))
    assert [o.output_token_ids for o in outs] == hf_greedy(lr, prompts, 12)


def test_block_pool_skips_placeholders():
    from shardspeed.inference.fastgen.block_pool import BlockPool

    pool = BlockPool(4, BS, enable_prefix_caching=True)
    a, b = pool.allocate(2)
    table = [PLACEHOLDER_BLOCK, a, b]
    assert pool.fork(table) == table and pool.ref_counts[a] == pool.ref_counts[b] == 2
    pool.register(PLACEHOLDER_BLOCK, b"h")
    assert pool.cached_block(b"h") is None
    pool.free(table)
    pool.free(table)
    assert pool.num_free == 4


@pytest.mark.slow
def test_window_freeing_through_compiled_decode():
    """The compiled decode step reads block tables with freed blocks (shown as a live block
    of the sequence, masked): same tokens as HF (~12 s of Inductor compile on CPU)."""
    model = _mistral()
    prompts = make_prompts(4, 10, 30, seed=21)
    engine = _engine(model, compile_decode="compile")
    assert engine.runner.compiled is not None
    outs, peak_decode, _ = _run_tracking(engine, prompts, SamplingParams(max_new_tokens=40))
    assert [o.output_token_ids for o in outs] == hf_greedy(model, prompts, 40)
    assert 0 < peak_decode <= BOUND
