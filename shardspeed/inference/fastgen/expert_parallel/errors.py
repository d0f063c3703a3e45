"""The error an expert-parallel engine raises when its ranks cannot go on together."""

from __future__ import annotations

from shardspeed.inference.fastgen.tensor_parallel.errors import TensorParallelError


class ExpertParallelError(TensorParallelError):
    """An expert-parallel rank failed, died or hung; the engine cannot step any more.

    A :class:`TensorParallelError` (same process machinery), so code that handles a
    failed tensor-parallel engine handles this one too. Create a new engine to continue.
    """
