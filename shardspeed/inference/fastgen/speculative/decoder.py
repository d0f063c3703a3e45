"""One speculative decode step of a decode-only batch (the engine's hook).

::

    k_i     = tokens to propose per request (eligible requests; max_tokens / context caps)
    reserve = lookahead slots for positions n_i .. n_i + k_i - 1  (fewer if blocks run out)
    drafts  = proposer.propose(...)                       # draft model or n-gram lookup
    logits  = target forward over [x_i, d_i1 .. d_ik] per request (one ragged batch)
    emitted = verify (greedy match or rejection sampling)  # accepted prefix + 1 token
    commit  = num_computed_tokens += 1 + accepted; free blocks past the emitted tokens
    append  = the engine's per-token path (logprobs, stop strings, EOS, max_tokens)

A request proposes nothing (it decodes one token as usual, in the same forward) when
its output is constrained per position (structured output, repetition / presence /
frequency penalties, ``logit_bias``, ``min_tokens``): those would need the processors
re-applied at every draft position. Each request's tokens stop at its first stop
condition, so nothing past ``max_tokens`` or a stop string is ever emitted.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from shardspeed.inference.fastgen.outputs import RequestOutput
from shardspeed.inference.fastgen.request import Request
from shardspeed.inference.fastgen.sampling import sample_next_tokens
from shardspeed.inference.fastgen.scheduler import ScheduledBatch, ScheduledSequence
from shardspeed.inference.fastgen.speculative.config import SpeculativeConfig
from shardspeed.inference.fastgen.speculative.lookahead import (
    live_table,
    reserve_slots,
    sequence,
    trim_blocks,
)
from shardspeed.inference.fastgen.speculative.proposal import Proposal, Proposer
from shardspeed.inference.fastgen.speculative.rejection import (
    sampling_probs,
    verify_greedy,
    verify_sampled,
)
from shardspeed.inference.fastgen.structured import apply_guides
from shardspeed.utils.logging import get_logger

if TYPE_CHECKING:
    from shardspeed.inference.fastgen.engine import InferenceEngine

logger = get_logger(__name__)

# engine._append_token(req, token, row_logits [1, V], now, outputs)
AppendToken = Callable[[Request, int, torch.Tensor, float, list[RequestOutput]], None]
# engine._fail(req, exc, outputs): finish req with finish_reason="error"
FailRequest = Callable[[Request, Exception, list[RequestOutput]], None]


@dataclass
class SpeculativeStats:
    """Counters of speculative decoding since the engine started."""

    num_steps: int = 0  # speculative engine steps
    num_verified: int = 0  # request-steps that proposed at least one token
    num_draft_tokens: int = 0  # tokens proposed
    num_accepted_tokens: int = 0  # proposals the target kept
    num_emitted_tokens: int = 0  # tokens appended by those request-steps (<= accepted + 1)

    @property
    def acceptance_rate(self) -> float:
        """Fraction of proposed tokens the target kept."""
        return self.num_accepted_tokens / max(self.num_draft_tokens, 1)

    @property
    def mean_tokens_per_step(self) -> float:
        """Tokens one verify forward gave a request, on average (1 = no gain)."""
        return self.num_emitted_tokens / max(self.num_verified, 1)


def may_speculate(req: Request) -> bool:
    """True when ``req``'s next tokens depend on the logits alone (no per-position
    processors or grammar), so proposals can be verified position by position."""
    p = req.params
    return (
        req.guide is None
        and p.repetition_penalty == 1.0
        and p.presence_penalty == 0.0
        and p.frequency_penalty == 0.0
        and not p.logit_bias
        and len(req.output_token_ids) >= p.min_tokens
    )


class SpeculativeDecoder:
    """Runs decode-only engine steps speculatively (see the module docstring)."""

    def __init__(self, config: SpeculativeConfig, engine: InferenceEngine, proposer: Proposer):
        self.config = config
        self.num_speculative_tokens = config.num_speculative_tokens
        self.proposer = proposer
        self.runner = engine.runner
        self.scheduler = engine.scheduler
        self.pool = engine.block_pool
        self.max_seq_len = engine.max_seq_len
        self.token_budget = engine.config.max_ragged_batch_size
        self.stats = SpeculativeStats()

    @staticmethod
    def accepts(batch: ScheduledBatch) -> bool:
        """True for a batch of one-token decodes (prompt chunks run the usual path)."""
        return all(s.num_tokens == 1 and s.needs_logits and not s.all_logits
                   for s in batch.sequences)  # fmt: skip

    def _num_to_propose(self, req: Request, k: int) -> int:
        if not may_speculate(req):
            return 0
        # the step emits up to k + 1 tokens: stay within max_new_tokens and the context
        left = min(req.params.max_new_tokens - len(req.output_token_ids),
                   self.max_seq_len - req.num_tokens)  # fmt: skip
        return max(0, min(k, left - 1, self.proposer.max_tokens(req)))

    def step(
        self,
        batch: ScheduledBatch,
        outputs: list[RequestOutput],
        append: AppendToken,
        fail: FailRequest,
    ) -> int | None:
        """Run ``batch`` speculatively; return the number of tokens appended, or None when
        the speculative forward failed (nothing was appended, the lookahead was rolled
        back: the caller runs the batch the usual way)."""
        seqs = batch.sequences
        reqs = [s.request for s in seqs]
        k = min(self.num_speculative_tokens, max(0, self.token_budget // len(seqs) - 1))
        wanted = [self._num_to_propose(r, k) for r in reqs]
        ks = [reserve_slots(self.pool, r, r.num_tokens + w) - r.num_tokens
              for r, w in zip(reqs, wanted)]  # fmt: skip
        tables = [live_table(s, r) for s, r in zip(seqs, reqs)]
        try:
            proposals = self.proposer.propose(reqs, tables, ks)
            verify = [
                sequence(r, [s.token_ids[0], *p.tokens], s.start_position, t,
                         self.pool.block_size, all_logits=bool(p.tokens))
                for s, r, p, t in zip(seqs, reqs, proposals, tables)
            ]  # fmt: skip
            logits = self.runner.execute(ScheduledBatch(sequences=verify))  # [sum(1 + k_i), V]
        except Exception as exc:
            logger.warning("speculative step failed (%s); running the batch without it", exc)
            for r in reqs:
                trim_blocks(self.pool, r, r.num_tokens)
                self.proposer.forget(r)
            return None
        self.stats.num_steps += 1
        now = time.perf_counter()
        row = 0
        appended = 0
        for seq, req, prop, vseq in zip(seqs, reqs, proposals, verify):
            rows = logits[row : row + vseq.num_logits_rows]  # [1 + k_i, V]
            row += vseq.num_logits_rows
            try:
                emitted = self._verify(req, prop, rows)
            except Exception as exc:  # this request's draw failed: it alone ends
                fail(req, exc, outputs)
                self.proposer.forget(req)
                continue
            accepted = len(emitted) - 1
            self._commit(seq, req, vseq, accepted)
            num_appended = self._append_all(req, emitted, rows, append, now, outputs)
            appended += num_appended
            if prop.tokens:
                self.stats.num_verified += 1
                self.stats.num_draft_tokens += len(prop.tokens)
                self.stats.num_accepted_tokens += accepted
                self.stats.num_emitted_tokens += num_appended
            if req.is_finished:
                self.proposer.forget(req)
        return appended

    def _verify(self, req: Request, prop: Proposal, rows: torch.Tensor) -> list[int]:
        if not prop.tokens:  # the usual one-token draw: processors, grammar and all
            return sample_next_tokens(apply_guides(rows, [req]), [req])
        if req.params.greedy:
            return verify_greedy(rows, prop.tokens)
        probs = sampling_probs(rows, req.params)  # [1 + k, V]
        return verify_sampled(probs, prop.tokens, prop.probs, req.generator)

    def _commit(
        self, seq: ScheduledSequence, req: Request, vseq: ScheduledSequence, accepted: int
    ) -> None:
        """The KV of the last token and the accepted proposals is kept; the rest rolls back."""
        kept = vseq.token_ids[: 1 + accepted]
        self.scheduler.commit(ScheduledBatch(sequences=[
            ScheduledSequence(req, kept, seq.start_position, vseq.slot_mapping[: len(kept)],
                              vseq.block_table, True)
        ]))  # fmt: skip
        trim_blocks(self.pool, req, req.num_computed_tokens)  # the next step allocates again
        self.proposer.rollback(req, req.num_computed_tokens)

    def _append_all(
        self,
        req: Request,
        emitted: list[int],
        rows: torch.Tensor,
        append: AppendToken,
        now: float,
        outputs: list[RequestOutput],
    ) -> int:
        """Append ``emitted`` until ``req`` finishes; one output for all of them."""
        emitted_before = req.num_emitted_tokens
        scratch: list[RequestOutput] = []
        count = 0
        for j, token in enumerate(emitted):
            append(req, token, rows[j : j + 1], now, scratch)  # row j predicted token j
            count += 1
            if req.is_finished:
                break
        req.num_emitted_tokens = emitted_before
        outputs.append(req.make_output())
        return count
