"""Structured-output masks computed while the forward runs.

A guided request's next-token mask depends only on its grammar state, which is final as
soon as the previous step accepted its last token. So the engine hands the step's guided
requests to :meth:`MaskPrefetcher.submit` right after scheduling; one worker thread asks
llguidance for their bitmasks (llguidance releases the GIL while it computes) while the
engine thread runs the forward, and :meth:`MaskPrefetcher.take` gives them to
:func:`~.masks.apply_guides` after it::

    batch = scheduler.schedule()
    prefetcher.submit(requests that sample this step)    # worker: bitmasks [R, W]
    logits = runner.execute(batch)                         # engine thread: the forward
    apply_guides(logits, sampled, prefetcher.take())       # waits, then unpacks and masks

A precomputed row is used only for the same :class:`~.guide.Guide` object at the same
``num_accepted``; anything else (samples forked after the forward, a request whose forward
failed, a worker error) is computed on the engine thread, so the tokens are the same with
or without the prefetch. While a guide's mask is in flight llguidance holds its matcher
borrowed; the guide's own methods wait for it (``Guide.settle``).
"""

from __future__ import annotations

from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from shardspeed.inference.fastgen.structured.masks import fill_bitmask, mask_words
from shardspeed.utils.logging import get_logger

logger = get_logger(__name__)


class PrefetchedMasks:
    """Bitmasks of a set of guides as they stood at submission (``bitmask``: ``[R, W]``)."""

    def __init__(self, guides: list[Any], bitmask: torch.Tensor) -> None:
        self.bitmask = bitmask
        self._rows = {id(g): (k, g, g.num_accepted) for k, g in enumerate(guides)}

    def release(self, future: Future[None]) -> None:
        """Mark the guides as no longer read by ``future`` (done)."""
        for _, guide, _ in self._rows.values():
            if guide.in_flight is future:
                guide.in_flight = None

    def row_of(self, guide: Any) -> int | None:
        """``guide``'s row of ``bitmask``, or None when it was not computed for this guide
        at its current state."""
        entry = self._rows.get(id(guide))
        if entry is None:
            return None
        row, submitted, num_accepted = entry
        if submitted is not guide or num_accepted != guide.num_accepted:
            return None
        return row


class MaskPrefetcher:
    """Computes the guided rows' bitmasks of one engine step on a worker thread.

    ``enabled`` False makes :meth:`submit` a no-op (every mask is then computed after the
    forward, on the engine thread). Used by one thread (the engine's).
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._worker: ThreadPoolExecutor | None = None
        self._job: tuple[PrefetchedMasks, Future[None]] | None = None

    def submit(self, requests: Iterable[Any]) -> None:
        """Start computing the next-token masks of the guided ``requests`` (the ones about to
        sample). Requests that fork samples this step are left to the engine thread: the
        forks copy their parent's grammar state right after the forward."""
        self._drop()
        if not self.enabled:
            return
        guides = [r.guide for r in requests if r.guide is not None and not r.fork_ids]
        if not guides:
            return
        bitmask = torch.empty(len(guides), mask_words(guides[0]), dtype=torch.int32)  # [R, W]
        for guide in guides:
            guide.settle()
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="shardspeed-masks")
        future = self._worker.submit(fill_bitmask, guides, bitmask)
        for guide in guides:
            guide.in_flight = future
        self._job = PrefetchedMasks(guides, bitmask), future

    def take(self) -> PrefetchedMasks | None:
        """The masks of the last :meth:`submit` once computed (None if nothing was submitted
        or the worker failed: the caller computes them itself)."""
        job, self._job = self._job, None
        if job is None:
            return None
        masks, future = job
        error = future.exception()  # waits
        masks.release(future)
        if error is not None:
            logger.warning("structured output: prefetching masks failed (%s); recomputing", error)
            return None
        return masks

    def _drop(self) -> None:
        """Forget a job nobody took (its step raised): wait so no matcher stays borrowed."""
        if self._job is not None:
            masks, future = self._job
            future.exception()  # waits
            masks.release(future)
            self._job = None

    def close(self) -> None:
        """Stop the worker thread (a later :meth:`submit` starts a new one)."""
        self._drop()
        if self._worker is not None:
            self._worker.shutdown(wait=True)
            self._worker = None
