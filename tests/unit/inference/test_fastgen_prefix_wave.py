"""Prefix caching within one wave: requests admitted in the same step share the full
blocks an earlier request of that step fills (token-identical to HF greedy)."""

from __future__ import annotations

import torch
from fastgen_helpers import engine_for, hf_greedy

from shardspeed.inference.fastgen.sampling_params import SamplingParams

PREFIX = list(range(10, 34))  # 24 tokens = 6 blocks of 4


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(5)
    return [PREFIX + torch.randint(3, 128, (n,), generator=g).tolist() for n in (3, 6, 9, 5)]


def test_same_wave_requests_share_prefix_blocks(tiny_llama):
    prompts = _prompts()
    refs = hf_greedy(tiny_llama, prompts, 6)
    for budget in (256, 40):  # all prompts in one step; the second prompt split in two
        engine = engine_for(
            tiny_llama, enable_prefix_caching=True, max_ragged_batch_size=budget, block_size=4
        )
        params = SamplingParams(max_new_tokens=6)
        ids = [engine.add_request(p, params) for p in prompts]
        outs = {}
        first = engine.step()  # the first wave: nothing was cached before it
        assert engine.stats().prefix_cache_hit_blocks >= 6
        outs.update({o.request_id: o for o in first if o.finished})
        while engine.has_unfinished():
            outs.update({o.request_id: o for o in engine.step() if o.finished})
        assert [outs[i].output_token_ids for i in ids] == refs
        assert engine.stats().prefix_cache_hit_blocks == 6 * (len(prompts) - 1)
        assert engine.block_pool.num_used == 0


def test_failed_filler_requeues_the_requests_reading_its_blocks(tiny_llama):
    prompts = _prompts()[:2]
    refs = hf_greedy(tiny_llama, prompts, 4)
    engine = engine_for(tiny_llama, enable_prefix_caching=True, block_size=4)
    real = engine.runner.execute
    calls = {"n": 0}

    def failing_first_prefill(batch, *args):
        calls["n"] += 1
        if calls["n"] <= 2 and any(s.request.request_id == "a" for s in batch.sequences):
            raise RuntimeError("injected")  # the batched forward, then "a" alone
        return real(batch, *args)

    engine.runner.execute = failing_first_prefill
    requeued: list[str] = []
    requeue = engine.scheduler.requeue
    engine.scheduler.requeue = lambda req: (requeued.append(req.request_id), requeue(req))
    params = SamplingParams(max_new_tokens=4)
    engine.add_request(prompts[0], params, request_id="a")
    engine.add_request(prompts[1], params, request_id="b")
    outs = {}
    while engine.has_unfinished():
        outs.update({o.request_id: o for o in engine.step() if o.finished})
    assert requeued == ["b"]  # "b" had taken "a"'s blocks of the same step
    assert outs["a"].finish_reason == "error" and "injected" in str(engine.take_error("a"))
    assert outs["b"].output_token_ids == refs[1]  # recomputed, not read from unwritten blocks
    assert engine.block_pool.num_used == 0
