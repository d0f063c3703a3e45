"""OpenAI ``logprobs`` bodies from the engine's :class:`TokenLogprob` lists.

Completions use the legacy parallel lists (``tokens``, ``token_logprobs``,
``top_logprobs``, ``text_offset``); chat uses ``content: [{token, logprob, bytes,
top_logprobs}]``. A token's string is its own decoded text. ``-inf`` (a token
masked by ``min_tokens`` or ``logit_bias``) becomes -9999.0, as JSON has no infinity.
"""

from __future__ import annotations

import math
from typing import Any

from shardspeed.inference.fastgen.outputs import RequestOutput, TokenLogprob
from shardspeed.inference.serving.protocol import (
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    TopLogprob,
)

MIN_LOGPROB = -9999.0


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_LOGPROB


def _token_text(tokenizer: Any, token_id: int) -> str:
    return str(tokenizer.decode([int(token_id)]))


def completion_logprobs(
    tokenizer: Any, out: RequestOutput, echo: bool, text_offset: int = 0
) -> CompletionLogprobs:
    """Legacy completions ``logprobs`` of ``out``; with ``echo`` the prompt tokens come first."""
    entries: list[tuple[int, TokenLogprob | None]] = []
    if echo:
        prompt_lps = out.prompt_logprobs or [None] * len(out.prompt_token_ids)
        entries += list(zip(out.prompt_token_ids, prompt_lps))
    entries += [(e.token_id, e) for e in out.logprobs or []]
    body = CompletionLogprobs()
    offset = text_offset
    for token_id, entry in entries:
        text = _token_text(tokenizer, token_id)
        body.tokens.append(text)
        body.text_offset.append(offset)
        offset += len(text)
        if entry is None:
            body.token_logprobs.append(None)
            body.top_logprobs.append(None)
            continue
        body.token_logprobs.append(_finite(entry.logprob))
        top: dict[str, float] = {}
        for tid, lp in entry.top:
            top.setdefault(_token_text(tokenizer, tid), _finite(lp))
        if entry.top:  # as OpenAI: the sampled token too (up to logprobs + 1 entries)
            top.setdefault(text, _finite(entry.logprob))
        body.top_logprobs.append(top)
    return body


def chat_logprobs(tokenizer: Any, out: RequestOutput) -> ChatLogprobs:
    """Chat ``logprobs.content`` of ``out``'s generated tokens."""

    def top(token_id: int, logprob: float) -> TopLogprob:
        text = _token_text(tokenizer, token_id)
        return TopLogprob(token=text, logprob=_finite(logprob), bytes=list(text.encode()))

    content = []
    for e in out.logprobs or []:
        head = top(e.token_id, e.logprob)
        alts = [top(t, lp) for t, lp in e.top]
        content.append(ChatTokenLogprob(**head.model_dump(), top_logprobs=alts))
    return ChatLogprobs(content=content)
