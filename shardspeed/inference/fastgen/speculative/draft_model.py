"""Draft-model proposals: a smaller model of the target's vocabulary drafts k tokens.

The draft keeps its own KV cache with the *same block ids* as the target (same
``block_size`` and ``num_blocks``, its own layers and heads): a request's block table
addresses both, so lookahead reservation and rollback (:mod:`.lookahead`) serve both.

Per request the draft remembers how many leading positions hold its own K/V
(``computed``). Each proposing step first runs one ragged chunk per request over the
positions it lacks (the whole prompt the first time; afterwards the one or two tokens
the last step accepted beyond what it drafted), then ``k - 1`` one-token decodes
feeding its own drafts. A preemption or a RoPE recompute of the request (its blocks
were freed) resets ``computed`` to 0.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from shardspeed.inference.fastgen.attention import select_backend
from shardspeed.inference.fastgen.cpu_prepack import pack_worker_model
from shardspeed.inference.fastgen.kv_cache import KVCacheSpec
from shardspeed.inference.fastgen.kv_quant import make_kv_cache
from shardspeed.inference.fastgen.loader import build_model
from shardspeed.inference.fastgen.model_runner import ModelRunner
from shardspeed.inference.fastgen.models import RaggedModel
from shardspeed.inference.fastgen.request import Request
from shardspeed.inference.fastgen.scheduler import ScheduledBatch
from shardspeed.inference.fastgen.speculative.config import SpeculativeConfig
from shardspeed.inference.fastgen.speculative.lookahead import sequence
from shardspeed.inference.fastgen.speculative.proposal import Proposal
from shardspeed.inference.fastgen.speculative.rejection import draw, sampling_probs
from shardspeed.utils.logging import get_logger

logger = get_logger(__name__)


@dataclass
class _DraftState:
    computed: int  # leading positions whose draft K/V are valid
    epoch: tuple[int, int]  # (num_preemptions, rope_base_len) when they were written


def _epoch(req: Request) -> tuple[int, int]:
    return (req.num_preemptions, req.rope_base_len)


class DraftModelProposer:
    """Drafts with a small model over its own blocked KV cache (see the module docstring)."""

    def __init__(
        self,
        config: SpeculativeConfig,
        target: RaggedModel,
        target_spec: KVCacheSpec,
        num_blocks: int,
        device: torch.device,
        attention_backend: str,
        cpu_prepack: bool | None = None,
    ):
        dtype = config.draft_dtype if config.draft_dtype is not None else target_spec.dtype
        self.model, _ = build_model(config.model, dtype, device, config.quantization)
        pack_worker_model(self.model, cpu_prepack, device)  # as the target is packed
        draft = self.model
        for name, value in (("kv_window", draft.kv_window), ("rope_recompute_len",
                            draft.rope_recompute_len)):  # fmt: skip
            if value is not None:
                raise ValueError(
                    f"speculative_config.model: the draft ({draft.model_type}) has {name}="
                    f"{value}, which draft-model speculation does not support yet; use a "
                    "draft without sliding-window attention / longrope, or method='ngram'."
                )
        if target.kv_window is not None:
            raise ValueError(
                f"speculative_config.model: the target ({target.model_type}) frees KV blocks "
                f"outside its {target.kv_window}-token sliding window, which a draft sharing "
                "its block tables cannot read; use method='ngram' with this target."
            )
        self.vocab_size = target.vocab_size
        # sizes of one tokenizer differ by padding (Qwen2.5 0.5B / 7B: 151936 / 152064 rows);
        # the draft's rows are cut or padded to the target's (see _to_target_vocab)
        if abs(draft.vocab_size - target.vocab_size) > 1024:
            raise ValueError(
                f"speculative_config.model: the draft's vocabulary ({draft.vocab_size}) is not "
                f"the target's ({target.vocab_size}); use a draft with the target's tokenizer."
            )
        self.max_positions = draft.max_positions if draft.learned_positions else None
        block_size = target_spec.block_size
        spec = KVCacheSpec(
            draft.num_layers, draft.num_kv_heads, draft.head_dim, block_size,
            next(draft.parameters()).dtype, target_spec.cache_dtype,
        )  # fmt: skip
        self.kv_cache = make_kv_cache(spec, num_blocks, device)
        backend = select_backend(attention_backend, device, block_size, spec.dtype)
        self.runner = ModelRunner(draft, self.kv_cache, device, backend)
        self.block_size = block_size
        # by Request object: a reused request id never sees an old request's state
        self._states: weakref.WeakKeyDictionary[Request, _DraftState] = weakref.WeakKeyDictionary()
        logger.info(
            "speculative draft: %s, %d layers, %.1fM parameters, KV %d blocks",
            draft.model_type, draft.num_layers,
            sum(p.numel() for p in draft.parameters()) / 1e6, num_blocks,
        )  # fmt: skip

    # ----------------------------------------------------------------- state
    def _state(self, req: Request) -> _DraftState:
        state = self._states.get(req)
        if state is None or state.epoch != _epoch(req):
            state = _DraftState(0, _epoch(req))
            self._states[req] = state
        return state

    def max_tokens(self, req: Request) -> int:
        if self.max_positions is None:
            return 1 << 30
        # drafting k tokens feeds positions up to num_tokens + k - 2
        return max(0, self.max_positions - req.num_tokens + 1)

    def rollback(self, req: Request, num_valid_tokens: int) -> None:
        state = self._states.get(req)
        if state is not None:
            state.computed = min(state.computed, num_valid_tokens)

    def forget(self, req: Request) -> None:
        self._states.pop(req, None)

    # --------------------------------------------------------------- propose
    def _next_tokens(
        self, logits: torch.Tensor, requests: list[Request], proposals: list[Proposal]
    ) -> list[int]:
        """Draw each request's next draft token from its rows of ``logits`` ([A, V])."""
        logits = self._to_target_vocab(logits)
        tokens: list[int] = []
        for row, (req, prop) in enumerate(zip(requests, proposals)):
            if req.params.greedy:
                tokens.append(int(logits[row].argmax()))
                continue
            q = sampling_probs(logits[row : row + 1], req.params)  # [1, V]
            tokens.append(draw(q[0], req.generator))
            prop.probs = q if prop.probs is None else torch.cat([prop.probs, q])
        return tokens

    def _to_target_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        v, vt = logits.shape[-1], self.vocab_size
        if v == vt:
            return logits
        if v > vt:
            return logits[:, :vt]
        pad = logits.new_full((logits.shape[0], vt - v), float("-inf"))
        return torch.cat([logits, pad], dim=-1)

    def propose(
        self, requests: list[Request], block_tables: list[list[int]], num_tokens: list[int]
    ) -> list[Proposal]:
        proposals = [Proposal() for _ in requests]
        active = [i for i, k in enumerate(num_tokens) if k > 0]
        if not active:
            return proposals
        bs = self.block_size
        # catch up: every position the draft lacks, up to the last token (one chunk each)
        seqs = []
        for i in active:
            req, state = requests[i], self._state(requests[i])
            n = req.num_tokens
            start = min(state.computed, n - 1)
            seqs.append(sequence(req, req.token_slice(start, n), start, block_tables[i], bs))
            state.computed = n
        logits = self.runner.execute(ScheduledBatch(sequences=seqs))  # [A, V]
        while True:
            reqs = [requests[i] for i in active]
            tokens = self._next_tokens(logits, reqs, [proposals[i] for i in active])
            for i, token in zip(active, tokens):
                proposals[i].tokens.append(token)
            active = [i for i in active if len(proposals[i].tokens) < num_tokens[i]]
            if not active:
                return proposals
            seqs = []
            for i in active:  # feed the newest draft token at its position
                req, state = requests[i], self._states[requests[i]]
                pos = req.num_tokens + len(proposals[i].tokens) - 1
                seqs.append(sequence(req, [proposals[i].tokens[-1]], pos, block_tables[i], bs))
                state.computed = pos + 1
            logits = self.runner.execute(ScheduledBatch(sequences=seqs))  # [A, V]
