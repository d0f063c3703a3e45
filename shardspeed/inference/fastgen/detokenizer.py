"""Incremental detokenization: a request's text in constant work per new token.

Decoding the whole output after every token costs O(length) per token (0.7 ms for 2048
tokens with a byte-level BPE here, per request per step). Instead each request keeps a
short window of its latest tokens and the window's text; a new token extends the window,
and the text it adds is the window's new text past the old. The window slides forward once
it holds more than :data:`WINDOW_MAX` tokens, keeping :data:`WINDOW_KEEP` as left context
(so leading-space rules and cleanups that look one character back see what they would in
the full text).

Two cases fall back to something slower but exact:

* the window's new text ends in U+FFFD: a character whose bytes are split across tokens.
  Its text is held back until the rest arrives (the full decode would show a replacement
  character that the next token turns into a different one); :func:`flush` adds what is
  still held when the request ends, so the final text equals the full decode.
* the new text does not start with the old (a tokenizer rule rewrote text across the
  window's end, e.g. a cleanup of " ." into "."): the whole output is decoded once.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

WINDOW_MAX = 8  # tokens in the window before it slides
WINDOW_KEEP = 4  # tokens of left context kept when it slides
_PARTIAL = "\ufffd"


def decode(tokenizer: Any, token_ids: list[int]) -> str:
    """``tokenizer.decode`` without special tokens (tolerates tokenizers without the kwarg)."""
    try:
        return tokenizer.decode(token_ids, skip_special_tokens=True)
    except TypeError:
        return tokenizer.decode(token_ids)


@dataclass
class DetokenizerState:
    """Per request: the window ``[start, end)`` of output tokens and its text; the request's
    text is the decode of ``output_token_ids[:end]``."""

    start: int = 0
    end: int = 0
    window_text: str = ""


def _slide(tokenizer: Any, ids: list[int], state: DetokenizerState) -> None:
    """Start the window :data:`WINDOW_KEEP` tokens before its end, unless those decode to
    nothing (special tokens, orphan bytes): a window without text would let rules for the
    start of a text (a stripped leading space) apply to the next token's text."""
    start = max(0, state.end - WINDOW_KEEP)
    text = decode(tokenizer, ids[start : state.end])
    if text or start == 0:
        state.start, state.window_text = start, text


def _restart(tokenizer: Any, ids: list[int], state: DetokenizerState) -> str:
    """Decode everything once and restart the window at the end."""
    full = decode(tokenizer, ids)
    state.start, state.end, state.window_text = 0, len(ids), full
    _slide(tokenizer, ids, state)
    return full


def update(
    tokenizer: Any, ids: list[int], text: str, state: DetokenizerState, final: bool = False
) -> str:
    """The text of ``ids`` (all output tokens so far), given ``text``, the text of
    ``ids[:state.end]``; updates ``state``. ``final``: do not hold back a split character."""
    window = decode(tokenizer, ids[state.start :])
    if window.endswith(_PARTIAL) and not final:  # a split character: wait for the rest
        return text
    if not window.startswith(state.window_text):
        return _restart(tokenizer, ids, state)
    text += window[len(state.window_text) :]
    state.end, state.window_text = len(ids), window
    if state.end - state.start > WINDOW_MAX:
        _slide(tokenizer, ids, state)
    return text


def flush(tokenizer: Any, ids: list[int], text: str, state: DetokenizerState) -> str:
    """The final text: :func:`update`'s plus anything it held back (an unfinished character
    at the very end shows as U+FFFD, as in the full decode)."""
    if state.end == len(ids):
        return text
    return update(tokenizer, ids, text, state, final=True)
