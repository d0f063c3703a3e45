"""The error a pipeline-parallel engine raises when its stages cannot go on together."""

from __future__ import annotations

from shardspeed.inference.fastgen.tensor_parallel.errors import TensorParallelError


class PipelineParallelError(TensorParallelError):
    """A pipeline stage rank failed, died or hung; the engine cannot step any more.

    Every unfinished request was ended with ``finish_reason="error"``. A subclass of
    :class:`~shardspeed.inference.fastgen.tensor_parallel.TensorParallelError` so that
    whatever handles a dead multi-process engine (the async server's supervisor)
    handles this one too. Create a new engine (or pipeline) to continue.
    """
