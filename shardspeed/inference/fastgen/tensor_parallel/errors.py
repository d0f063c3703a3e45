"""The error a tensor-parallel engine raises when its ranks cannot go on together."""

from __future__ import annotations


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank failed, died or hung; the engine cannot step any more.

    The message carries the failing rank's error (its traceback when it sent one).
    Create a new engine (or pipeline) to continue.
    """
