"""Scheduling rule and block accounting, driven without a model."""

from __future__ import annotations

import time

import pytest

from shardspeed.inference.fastgen.block_pool import BlockPool
from shardspeed.inference.fastgen.request import Request, RequestStatus
from shardspeed.inference.fastgen.sampling_params import SamplingParams
from shardspeed.inference.fastgen.scheduler import ScheduledBatch, Scheduler

BS = 4


def _make(policy="splitfuse", num_blocks=64, budget=16, seqs=8, caching=False):
    pool = BlockPool(num_blocks, BS, enable_prefix_caching=caching)
    return Scheduler(pool, budget, seqs, policy), pool


def _req(i: int, prompt_len: int, max_new: int = 3, first_token: int = 0) -> Request:
    prompt = [first_token + i * 1000 + t for t in range(prompt_len)]
    return Request(f"r{i}", prompt, SamplingParams(max_new_tokens=max_new))


def _run(sched: Scheduler, arrivals: dict[int, list[Request]], check=None) -> list[ScheduledBatch]:
    """Step until idle; every scheduled last token 'samples' token 7."""
    batches, step = [], 0
    while step == 0 or sched.has_unfinished() or any(s >= step for s in arrivals):
        for req in arrivals.get(step, []):
            sched.add(req)
        batch = sched.schedule()
        assert batch.num_tokens <= sched.max_ragged_batch_size
        assert len(batch.sequences) <= sched.max_ragged_sequence_count
        sched.commit(batch)
        for seq in batch.sequences:
            if seq.needs_logits:
                seq.request.append_token(7, time.perf_counter())
                if len(seq.request.output_token_ids) >= seq.request.params.max_new_tokens:
                    sched.finish(seq.request, "length")
        if check:
            check(sched, batch)
        batches.append(batch)
        step += 1
        assert step < 500, "scheduler made no progress"
    return batches


def _waste_below_one_block(sched: Scheduler, batch: ScheduledBatch) -> None:
    for req in sched.running:
        assert len(req.block_table) * BS - req.num_computed_tokens < BS


@pytest.mark.parametrize("policy", ["splitfuse", "prefill_first", "static"])
def test_budget_each_prompt_token_once_and_blocks_freed(policy):
    sched, pool = _make(policy)
    reqs = [_req(i, n) for i, n in enumerate([3, 40, 7, 17, 1, 25, 9, 12])]
    batches = _run(sched, {0: reqs[:3], 2: reqs[3:6], 5: reqs[6:]}, check=_waste_below_one_block)
    computed: dict[str, list[int]] = {r.request_id: [] for r in reqs}
    for b in batches:
        for s in b.sequences:
            computed[s.request.request_id] += list(range(s.start_position, s.context_len))
            # token ids are the request's own tokens at those positions
            assert s.token_ids == s.request.all_token_ids[s.start_position : s.context_len]
    for r in reqs:
        # every prompt token and every generated-but-last token computed exactly once
        assert computed[r.request_id] == list(range(len(r.prompt_token_ids) + 2))
        assert r.status is RequestStatus.FINISHED and r.block_table == []
    assert pool.num_free == pool.num_blocks and sched.num_preemptions == 0


def test_splitfuse_decodes_first_and_budget_filled_exactly():
    sched, _ = _make("splitfuse", budget=16)
    sched.add(_req(0, 5, max_new=20))
    sched.commit(b := sched.schedule())
    b.sequences[0].request.append_token(7, 0.0)  # r0 now decodes
    for i in range(1, 4):
        sched.add(_req(i, 10))
    batch = sched.schedule()
    assert [s.request.request_id for s in batch.sequences] == ["r0", "r1", "r2"]
    assert [s.num_tokens for s in batch.sequences] == [1, 10, 5]  # r2 split to fill 16
    assert [s.needs_logits for s in batch.sequences] == [True, True, False]
    sched.commit(batch)
    batch.sequences[1].request.append_token(7, 0.0)  # r1 finished its prompt: now decodes
    nxt = sched.schedule()
    # r0 has no new token (not sampled here) so it is skipped; decode r1, chunk r2, new r3
    got = [(s.request.request_id, s.start_position, s.num_tokens) for s in nxt.sequences]
    assert got == [("r1", 10, 1), ("r2", 5, 5), ("r3", 0, 10)]


def test_prefill_first_never_mixes_decode_and_prefill():
    sched, _ = _make("prefill_first", budget=16)
    arrivals = {0: [_req(0, 6, 6), _req(1, 9, 6)], 3: [_req(2, 12, 4)], 4: [_req(3, 30, 3)]}
    num_mixed = []

    def check(sched, batch):
        prefill = [s for s in batch.sequences if s.start_position < len(s.request.prompt_token_ids)]
        num_mixed.append(0 < len(prefill) < len(batch.sequences))
        for s in prefill:  # whole prompts, except r3 which alone exceeds the budget
            if s.request.request_id != "r3":
                assert s.start_position == 0 and s.needs_logits

    _run(sched, arrivals, check=check)
    assert not any(num_mixed)


def test_static_admits_next_batch_only_when_idle():
    sched, _ = _make("static", seqs=2)
    reqs = [_req(i, 5, max_new=2 + i) for i in range(5)]
    seen_running: list[set[str]] = []
    _run(
        sched, {0: reqs}, check=lambda s, b: seen_running.append({r.request_id for r in s.running})
    )
    batches = [x for x in seen_running if x]
    assert batches[0] == {"r0", "r1"}
    assert {"r2", "r3"} in batches and not any("r2" in x and "r1" in x for x in batches)


def test_preemption_under_tiny_cache_completes_without_deadlock():
    # 6 blocks = 24 slots; each request needs up to 4-5 blocks.
    sched, pool = _make("splitfuse", num_blocks=6, budget=8, seqs=4)
    reqs = [_req(i, 12, max_new=6) for i in range(4)]
    _run(sched, {0: reqs}, check=_waste_below_one_block)
    assert sched.num_preemptions > 0
    assert all(r.is_finished and len(r.output_token_ids) == 6 for r in reqs)
    assert pool.num_free == pool.num_blocks


def test_abort_frees_blocks():
    sched, pool = _make()
    a, b = _req(0, 20), _req(1, 4)
    sched.add(a)
    sched.add(b)
    sched.commit(sched.schedule())
    assert pool.num_used > 0
    sched.finish(a, "abort")
    sched.finish(b, "abort")
    assert pool.num_free == pool.num_blocks and not sched.has_unfinished()
    assert a.finish_reason == "abort" and a.metrics.finish_time is not None


def test_prefix_cache_admission_skips_cached_blocks():
    sched, pool = _make(caching=True, budget=64)
    first = Request("a", list(range(10)), SamplingParams(max_new_tokens=1))
    _run(sched, {0: [first]})
    second = Request("b", list(range(10)) + [99], SamplingParams(max_new_tokens=1))
    sched.add(second)
    batch = sched.schedule()
    # 10 shared tokens = 2 full blocks reused; computation starts at position 8
    assert batch.sequences[0].start_position == 8 and pool.num_cache_hits == 2
    same = Request("c", list(range(8)), SamplingParams(max_new_tokens=1))
    sched.add(same)
    # a prompt fully covered by cached blocks still computes its last block for logits
    batch = sched.schedule()
    assert [s.start_position for s in batch.sequences if s.request is same] == [4]


@pytest.mark.parametrize("policy", ["splitfuse", "prefill_first", "static"])
@pytest.mark.parametrize("caching", [False, True])
def test_random_workloads_never_deadlock_or_leak(policy, caching):
    import random

    rng = random.Random(f"{policy}-{caching}")
    for trial in range(5):
        num_blocks = rng.randint(8, 20)
        sched, pool = _make(
            policy,
            num_blocks=num_blocks,
            budget=rng.randint(4, 24),
            seqs=rng.randint(1, 6),
            caching=caching,
        )
        shared = [rng.randrange(50) for _ in range(rng.randint(0, 9))]
        arrivals: dict[int, list[Request]] = {}
        reqs = []
        for i in range(12):
            max_new = rng.randint(1, 6)
            plen = rng.randint(1, num_blocks * BS - max_new)  # always fits the whole cache
            prompt = (shared + [rng.randrange(50) for _ in range(plen)])[:plen]
            req = Request(f"t{trial}-{i}", prompt, SamplingParams(max_new_tokens=max_new))
            reqs.append(req)
            arrivals.setdefault(rng.randint(0, 10), []).append(req)
        _run(sched, arrivals, check=_waste_below_one_block)
        assert all(
            r.is_finished and len(r.output_token_ids) == r.params.max_new_tokens for r in reqs
        )
        assert pool.num_free == num_blocks and all(c == 0 for c in pool.ref_counts)
