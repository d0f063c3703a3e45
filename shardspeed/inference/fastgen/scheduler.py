"""Continuous-batching scheduler: one token-budget rule per step, pure CPU bookkeeping.

Every step hands out at most ``max_ragged_batch_size`` tokens to at most
``max_ragged_sequence_count`` sequences so that each request's
``num_computed_tokens`` catches up with its token count:

* ``"splitfuse"`` (Dynamic SplitFuse): running decodes first (1 token each), then
  in-progress prompt chunks, then new prompts in arrival order; the last prompt is
  split so that the budget is met exactly.
* ``"prefill_first"`` (vLLM v0 style): whole prompts first; a step that runs any
  prefill runs no decode. A prompt larger than the whole budget is chunked alone.
* ``"static"`` (HF-style static batching): a batch of up to
  ``max_ragged_sequence_count`` requests is admitted only when nothing is running,
  and runs to completion before the next batch.

Blocks are allocated here, at schedule time. When a running request needs a
block and none is free, the most recently admitted running request is preempted
by recompute: its blocks are freed, its ``num_computed_tokens`` is reset and it
goes back to the front of the waiting queue (its generated tokens are recomputed
together with its prompt when it is re-admitted). A step that preempted admits no
new requests.

Model-dependent KV rules (set by the engine from the model):

* ``kv_window`` (every layer slides over the last ``kv_window`` tokens): before a
  step, blocks that end before ``num_computed_tokens - kv_window + 1`` can never be
  read again; they are freed and left as :data:`~.block_pool.PLACEHOLDER_BLOCK` in
  the request's table, so a decoding request holds at most
  ``ceil((kv_window - 1) / block_size) + 1`` blocks. A freed block that was
  registered in the prefix cache keeps its hash: its K/V are a function of the
  tokens its hash chain covers and stay untouched until the block is reallocated
  (which drops the hash). Prefix lookups then need only the blocks inside the
  window of the first uncomputed token.
* ``rope_recompute_len`` (longrope): when a request reaches this many tokens
  while its cached keys were rotated for a shorter length, its KV is dropped and
  recomputed for the new length, as HF's Phi-3 ``generate`` does.
* ``rope_key``: the RoPE variant a request's keys are rotated with (part of the
  prefix-cache hash, so keys rotated for another length are never shared).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from shardspeed.inference.fastgen.block_pool import PLACEHOLDER_BLOCK, BlockPool
from shardspeed.inference.fastgen.kv_cache import KVCache
from shardspeed.inference.fastgen.request import Request, RequestStatus
from shardspeed.utils.logging import get_logger

logger = get_logger(__name__)

SCHEDULER_POLICIES = ("splitfuse", "prefill_first", "static")


@dataclass
class ScheduledSequence:
    """One sequence's share of a step."""

    request: Request
    token_ids: list[int]  # the tokens computed this step
    start_position: int  # == num_computed_tokens before this step
    slot_mapping: list[int]  # KV slot of each token
    # the sequence's blocks (covering context_len); blocks freed outside the attention
    # window are replaced by one of the sequence's own live blocks (its keys are masked)
    block_table: list[int]
    needs_logits: bool  # True when the chunk ends at the request's last token
    all_logits: bool = False  # logits of every token of the chunk (prompt logprobs)
    rope_base_len: int = 0  # see Request.rope_base_len (0: positions alone)

    @property
    def num_logits_rows(self) -> int:
        """Rows of logits this sequence contributes to the step's output."""
        return self.num_tokens if self.all_logits else int(self.needs_logits)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def context_len(self) -> int:
        """Tokens this sequence attends over after the step (cached + new)."""
        return self.start_position + len(self.token_ids)


@dataclass
class ScheduledBatch:
    """What one ragged forward computes."""

    sequences: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.sequences)

    @property
    def is_empty(self) -> bool:
        return not self.sequences


class _StepPlan:
    """Tokens granted so far in one step, with the budget left."""

    def __init__(self, token_budget: int, seq_budget: int):
        self.token_budget = token_budget
        self.seq_budget = seq_budget
        self.grants: dict[str, tuple[Request, int]] = {}
        self.preempted: list[Request] = []

    def full(self) -> bool:
        return self.token_budget <= 0 or self.seq_budget <= 0

    def grant(self, req: Request, n: int) -> None:
        self.grants[req.request_id] = (req, n)
        self.token_budget -= n
        self.seq_budget -= 1

    def revoke(self, req: Request) -> None:
        entry = self.grants.pop(req.request_id, None)
        if entry is not None:
            self.token_budget += entry[1]
            self.seq_budget += 1


class Scheduler:
    """Decides, each step, which tokens of which requests to compute."""

    def __init__(
        self,
        block_pool: BlockPool,
        max_ragged_batch_size: int,
        max_ragged_sequence_count: int,
        policy: str = "splitfuse",
        watermark_blocks: int = 0,
    ):
        if policy not in SCHEDULER_POLICIES:
            raise ValueError(
                f"scheduler={policy!r} is not supported; choose one of {SCHEDULER_POLICIES}."
            )
        self.pool = block_pool
        self.block_size = block_pool.block_size
        self.max_ragged_batch_size = max_ragged_batch_size
        self.max_ragged_sequence_count = max_ragged_sequence_count
        self.policy = policy
        self.watermark_blocks = watermark_blocks
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order
        self.num_preemptions = 0
        # Set by the engine from the model (see the module docstring).
        self.kv_window: int | None = None
        self.rope_recompute_len: int | None = None
        self.rope_key: Callable[[int], bytes] | None = None
        self.num_rope_recomputes = 0
        self.num_window_freed_blocks = 0

    def max_blocks_needed(self, num_kv_tokens: int) -> int:
        """Blocks a request with ``num_kv_tokens`` cached tokens must hold at once to make
        progress: all of them, or with ``kv_window`` those of one window plus one."""
        full = self.pool.blocks_for_tokens(num_kv_tokens)
        if self.kv_window is None:
            return full
        return min(full, self.pool.blocks_for_tokens(self.kv_window - 1) + 1)

    # -------------------------------------------------------------- queue ops
    def add(self, req: Request) -> None:
        self._set_rope_base(req, req.rope_base_len)
        self.waiting.append(req)

    def _set_rope_base(self, req: Request, base: int) -> None:
        """Set the length ``req``'s keys are rotated for; re-key its prefix hashes."""
        req.rope_base_len = base
        root = b"root" + (self.rope_key(base) if self.rope_key is not None else b"")
        if root != req.hash_root:
            req.hash_root = root
            req.block_hashes = []

    def _first_live_block(self, num_computed: int) -> int:
        """Index of the first block a query at position >= ``num_computed`` may read."""
        if self.kv_window is None:
            return 0
        return max(0, num_computed - self.kv_window + 1) // self.block_size

    def _release_window(self, req: Request) -> None:
        """Free ``req``'s blocks that lie wholly before its attention window."""
        first = self._first_live_block(req.num_computed_tokens)
        table = req.block_table
        if first == 0 or not table or table[first - 1] == PLACEHOLDER_BLOCK:
            return  # placeholders always form a prefix of the table
        dead = [b for b in table[:first] if b != PLACEHOLDER_BLOCK]
        self.pool.free(dead)
        table[:first] = [PLACEHOLDER_BLOCK] * first
        self.num_window_freed_blocks += len(dead)

    def _needs_rope_recompute(self, req: Request) -> bool:
        """True when ``req`` grew past ``rope_recompute_len`` but its base length is below."""
        limit = self.rope_recompute_len
        return limit is not None and req.num_tokens >= limit > req.rope_base_len

    def _rope_recompute(self, req: Request) -> None:
        """Drop ``req``'s KV so it is recomputed for its full current length (HF drops its
        cache at this point too)."""
        if req.block_table:
            self._free_blocks(req)
            self.num_rope_recomputes += 1
            logger.debug("recomputing %s for rope length %d", req.request_id, req.num_tokens)
        self._set_rope_base(req, req.num_tokens)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def add_forked(self, child: Request, parent: Request, kv_cache: KVCache) -> bool:
        """Start ``child`` (same prompt as ``parent``, whose prefill just completed) on
        ``parent``'s KV: full blocks are shared by reference count, the partly filled
        last block is copied. Returns False (child left untouched) when no block is free
        for that copy; the caller then queues the child to compute its own prompt."""
        bs = self.block_size
        num_full = parent.num_computed_tokens // bs
        partial = parent.num_computed_tokens % bs
        if partial and self.pool.num_free < 1:
            return False
        table = self.pool.fork(parent.block_table[:num_full])  # placeholders stay placeholders
        if partial:
            (copy,) = self.pool.allocate(1)
            kv_cache.copy_block(parent.block_table[num_full], copy)
            table.append(copy)
        child.block_table = table
        child.num_computed_tokens = parent.num_computed_tokens
        child.block_hashes = list(parent.block_hashes)
        child.num_registered_blocks = min(parent.num_registered_blocks, num_full)
        child.num_cached_prompt_tokens = parent.num_cached_prompt_tokens
        child.rope_base_len, child.hash_root = parent.rope_base_len, parent.hash_root
        child.status = RequestStatus.RUNNING
        self.running.append(child)
        return True

    def finish(self, req: Request, reason: str, now: float | None = None) -> None:
        """Mark ``req`` finished and give its blocks back."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self._free_blocks(req)
        req.finish(reason, now)

    # --------------------------------------------------------------- schedule
    def schedule(self) -> ScheduledBatch:
        """Grant this step's tokens and allocate their blocks."""
        plan = _StepPlan(self.max_ragged_batch_size, self.max_ragged_sequence_count)
        for req in self.running:
            if self._needs_rope_recompute(req):
                self._rope_recompute(req)  # recomputes from token 0 in this very step
            self._release_window(req)
        if self.policy == "prefill_first":
            self._schedule_running(plan, prefills=True, decodes=False)
            if not plan.preempted:
                self._admit_waiting(plan, whole_prompts=True)
            if not plan.grants:
                self._schedule_running(plan, prefills=False, decodes=True)
        else:
            if self.policy == "static" and not self.running:
                self._admit_static_batch()
            self._schedule_running(plan, prefills=True, decodes=True)
            if self.policy == "splitfuse" and not plan.preempted:
                self._admit_waiting(plan, whole_prompts=False)
        return self._build_batch(plan)

    def _schedule_running(self, plan: _StepPlan, prefills: bool, decodes: bool) -> None:
        decoding = [r for r in self.running if r.is_decoding]
        prefilling = [r for r in self.running if not r.is_decoding]
        order = (decoding if decodes else []) + (prefilling if prefills else [])
        for req in order:
            if plan.full():
                break
            if req.status is not RequestStatus.RUNNING or req.request_id in plan.grants:
                continue  # preempted earlier in this step
            n = min(req.num_remaining_tokens, plan.token_budget)
            if n <= 0:
                continue  # nothing to compute until its next token is sampled
            while True:
                got = self._fit(req, n, partial=not req.is_decoding, reserve=0)
                if got > 0:
                    self._grant(plan, req, got)
                    break
                if not req.block_table:
                    break  # holds nothing yet (static batch): wait rather than evict others
                victim = self._pick_victim(req)
                self._preempt(victim, plan)
                if victim is req:
                    break

    def _admit_waiting(self, plan: _StepPlan, whole_prompts: bool) -> None:
        while self.waiting and not plan.full():
            req = self.waiting[0]
            if self._needs_rope_recompute(req):
                self._rope_recompute(req)
            self._take_prefix_hits(req)
            n = req.num_remaining_tokens
            if n > plan.token_budget:
                if whole_prompts and plan.grants:
                    self._free_blocks(req)
                    break
                n = plan.token_budget
            reserve = self.watermark_blocks if self.running else 0
            got = self._fit(req, n, partial=not whole_prompts, reserve=reserve)
            if got == 0:
                self._free_blocks(req)
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            self._grant(plan, req, got)

    def _admit_static_batch(self) -> None:
        while self.waiting and len(self.running) < self.max_ragged_sequence_count:
            req = self.waiting.popleft()
            if self._needs_rope_recompute(req):
                self._rope_recompute(req)
            self._take_prefix_hits(req)
            req.status = RequestStatus.RUNNING
            self.running.append(req)

    # ------------------------------------------------------------ block math
    def _fit(self, req: Request, n: int, partial: bool, reserve: int) -> int:
        """Allocate blocks so ``n`` more tokens of ``req`` fit; return how many fit (0..n)."""
        if n <= 0:
            return 0
        held = len(req.block_table)
        slack = held * self.block_size - req.num_computed_tokens  # allocated, unused slots
        if n <= slack:
            return n
        need = self.pool.blocks_for_tokens(req.num_computed_tokens + n) - held
        avail = max(self.pool.num_free - reserve, 0)
        if need <= avail:
            req.block_table.extend(self.pool.allocate(need))
            return n
        if not partial or slack + avail * self.block_size <= 0:
            return 0
        req.block_table.extend(self.pool.allocate(avail))
        return slack + avail * self.block_size

    def _grant(self, plan: _StepPlan, req: Request, n: int) -> None:
        """Grant ``n`` tokens of ``req`` and, under prefix caching, offer the blocks this
        step fills to requests admitted after it in the same step: every layer writes the
        step's K/V before any sequence attends, so they read this step's values."""
        plan.grant(req, n)
        self._register_blocks(req, req.num_computed_tokens + n)

    def _register_blocks(self, req: Request, upto_tokens: int) -> None:
        """Register ``req``'s full blocks within its first ``upto_tokens`` tokens."""
        if not self.pool.enable_prefix_caching:
            return
        hashes = req.compute_block_hashes(self.block_size, upto_tokens)
        for i in range(req.num_registered_blocks, len(hashes)):
            self.pool.register(req.block_table[i], hashes[i])  # (skips placeholders)
        req.num_registered_blocks = max(req.num_registered_blocks, len(hashes))

    def uncomputed_registered_blocks(self, req: Request) -> list[int]:
        """Blocks of ``req`` offered to the prefix cache that its K/V does not fill yet."""
        first = req.num_computed_tokens // self.block_size
        return req.block_table[first : req.num_registered_blocks]

    def requeue(self, req: Request) -> None:
        """Send a running request back to the front of the queue to recompute (its step's
        results are dropped), as a preemption does."""
        if req in self.running:
            self.running.remove(req)
        self._free_blocks(req)
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.waiting.appendleft(req)

    def _take_prefix_hits(self, req: Request) -> None:
        """On admission, reuse cached full blocks of the request's leading tokens."""
        if not self.pool.enable_prefix_caching or req.block_table or req.wants_prompt_logprobs:
            return  # (prompt logprobs need the logits of every prompt position)
        # Leave at least the last token to compute so that there are logits to sample.
        hashes = req.compute_block_hashes(self.block_size, req.num_tokens - 1)
        hits = self._lookup(hashes)
        if hits:
            self.pool.touch(hits)
            req.block_table = list(hits)
            req.num_computed_tokens = len(hits) * self.block_size
            req.num_registered_blocks = len(hits)
            if not req.output_token_ids and not req.num_preemptions:
                req.num_cached_prompt_tokens = req.num_computed_tokens

    def _lookup(self, hashes: list[bytes]) -> list[int]:
        """Cached blocks for the longest usable prefix of ``hashes``. With ``kv_window`` only
        the blocks inside the window of the first uncomputed token must still be cached;
        the ones before it become placeholders."""
        if self.kv_window is None:
            return self.pool.lookup(hashes)
        cached = [self.pool.cached_block(h) for h in hashes]
        for k in range(len(hashes), 0, -1):
            first = self._first_live_block(k * self.block_size)
            if all(cached[j] is not None for j in range(first, k)):
                return [PLACEHOLDER_BLOCK] * first + [b for b in cached[first:k] if b is not None]
        return []

    def _free_blocks(self, req: Request) -> None:
        if req.block_table:
            for block in self.uncomputed_registered_blocks(req):
                self.pool.forget(block)  # offered this step, never written: not a cache hit
            self.pool.free(req.block_table)
        req.block_table = []
        req.num_computed_tokens = 0
        req.num_registered_blocks = 0

    def _pick_victim(self, req: Request) -> Request:
        """The most recently admitted running request that holds blocks (maybe ``req``).

        Preempting newest-first means the oldest request always progresses: it can
        take every block, and a single request always fits the cache.
        """
        for other in reversed(self.running):
            if other.block_table:
                return other
        return req

    def _preempt(self, victim: Request, plan: _StepPlan) -> None:
        plan.revoke(victim)
        self.running.remove(victim)
        self._free_blocks(victim)
        victim.status = RequestStatus.WAITING
        victim.num_preemptions += 1
        self.waiting.appendleft(victim)
        plan.preempted.append(victim)
        self.num_preemptions += 1
        logger.debug("preempted %s (recompute)", victim.request_id)

    # ------------------------------------------------------------------ batch
    def _build_batch(self, plan: _StepPlan) -> ScheduledBatch:
        bs = self.block_size
        batch = ScheduledBatch(preempted=plan.preempted)
        for req, n in plan.grants.values():
            start = req.num_computed_tokens
            live = req.block_table[start // bs]  # holds the step's first token
            table = [live if b == PLACEHOLDER_BLOCK else b for b in req.block_table]
            slots = [table[p // bs] * bs + p % bs for p in range(start, start + n)]
            batch.sequences.append(
                ScheduledSequence(
                    request=req,
                    token_ids=req.token_slice(start, start + n),
                    start_position=start,
                    slot_mapping=slots,
                    block_table=table,
                    needs_logits=start + n == req.num_tokens,
                    all_logits=req.wants_prompt_logprobs,
                    rope_base_len=req.rope_base_len,
                )
            )
        return batch

    def commit(self, batch: ScheduledBatch) -> None:
        """After the forward: advance ``num_computed_tokens`` and cache full blocks."""
        for seq in batch.sequences:
            req = seq.request
            req.num_computed_tokens += seq.num_tokens
            self._register_blocks(req, req.num_computed_tokens)
