"""Turn the engine's growing output text into safe streaming deltas.

The engine reports the whole detokenized output after every step. A client that
streams wants only the new part, and must never receive text that later turns out
to be wrong. Two things can still change at the end of the text:

* an incomplete UTF-8 sequence decodes to U+FFFD until its last byte arrives;
* the start of a stop string may be followed by the rest of it, and the stop
  string is trimmed from the final text.

:class:`TextDeltaStream` holds both back until they are settled, so the
concatenated deltas always equal the final text.
"""

from __future__ import annotations

from collections.abc import Sequence

_REPLACEMENT_CHAR = "\ufffd"


def truncate_at_stop(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    """Cut ``text`` before the earliest stop string; returns (text, whether one was found)."""
    cut = min((i for i in (text.find(s) for s in stop if s) if i >= 0), default=-1)
    if cut < 0:
        return text, False
    return text[:cut], True


def _held_stop_prefix(text: str, stop: Sequence[str]) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
    held = 0
    for s in stop:
        for k in range(min(len(s) - 1, len(text)), held, -1):
            if text.endswith(s[:k]):
                held = k
                break
    return held


class TextDeltaStream:
    """Computes the text to send for each new snapshot of one request's output."""

    def __init__(self, stop: Sequence[str] = ()) -> None:
        self.stop = [s for s in stop if s]
        self.text = ""  # everything emitted so far

    def update(self, text: str, finished: bool) -> str:
        """Return the new settled text given the full output ``text`` so far."""
        text, hit_stop = truncate_at_stop(text, self.stop)
        if finished or hit_stop:
            safe = len(text)
        else:
            safe = len(text)
            while safe > len(self.text) and text[safe - 1] == _REPLACEMENT_CHAR:
                safe -= 1
            safe -= _held_stop_prefix(text[:safe], self.stop)
        if safe <= len(self.text) or not text.startswith(self.text):
            # Nothing new, or the detokenizer rewrote already-sent text (rare): send nothing
            # now; the final flush sends whatever follows the sent prefix.
            return ""
        delta = text[len(self.text) : safe]
        self.text = text[:safe]
        return delta
