"""Append sampled tokens to their requests, detokenize and decide when each stops."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from shardspeed.inference.fastgen import detokenizer
from shardspeed.inference.fastgen.request import Request


class OutputProcessor:
    """Applies stop rules in order: stop/EOS token, stop string, length.

    Stop strings are searched in the detokenized text, so a stop string split across
    several tokens is found once its last piece arrives. Below ``min_tokens`` no stop
    rule but the context length applies. The text is detokenized incrementally
    (:mod:`.detokenizer`): constant work per token, the full decode's text at the end.
    """

    def __init__(self, tokenizer: Any, eos_token_ids: Sequence[int], max_seq_len: int):
        self.tokenizer = tokenizer
        self.eos_token_ids = set(eos_token_ids)
        self.max_seq_len = max_seq_len

    def append(self, req: Request, token: int, now: float) -> str | None:
        """Record ``token`` for ``req``; return the finish reason if it must stop now."""
        req.append_token(token, now)
        params = req.params
        reason = None
        may_stop = len(req.output_token_ids) >= params.min_tokens  # no stop before min_tokens
        if may_stop and (
            token in params.stop_token_ids
            or (not params.ignore_eos and token in self.eos_token_ids)
        ):
            reason = "stop"
        trimmed = False
        if self.tokenizer is not None:
            ids = req.output_token_ids
            req.text = detokenizer.update(self.tokenizer, ids, req.text, req.detokenizer)
            if reason is None and may_stop and params.stop and self._trim_at_stop_string(req):
                reason, trimmed = "stop", True
            elif not may_stop:  # a stop string completed below min_tokens does not count
                req.stop_checked_chars = len(req.text)
        if reason is None and (
            len(req.output_token_ids) >= params.max_new_tokens or req.num_tokens >= self.max_seq_len
        ):
            reason = "length"
        if reason is not None and not trimmed and self.tokenizer is not None:
            req.text = detokenizer.flush(self.tokenizer, ids, req.text, req.detokenizer)
        return reason

    @staticmethod
    def _trim_at_stop_string(req: Request) -> bool:
        """Cut ``req.text`` before the earliest stop string; True if one was found."""
        longest = max(len(s) for s in req.params.stop)
        start = max(0, req.stop_checked_chars - longest + 1)
        hits = [i for i in (req.text.find(s, start) for s in req.params.stop) if i >= 0]
        req.stop_checked_chars = len(req.text)
        if not hits:
            return False
        req.text = req.text[: min(hits)]
        return True
