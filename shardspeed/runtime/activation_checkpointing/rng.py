"""Named RNG streams (Megatron-style tracker) and whole-process RNG snapshots.

Tensor-parallel layers need two kinds of randomness: dropout on *replicated* activations
must draw the same mask on every model-parallel rank (the default generator, seeded the
same everywhere), while dropout on *partitioned* activations must draw different masks per
rank (a separate "model-parallel-rng" stream seeded with ``seed + 2718 + tp_rank``). The
tracker holds the extra streams as saved generator states and swaps one in for the
duration of ``with tracker.fork(name):``.

The streams live on the accelerator's generator when CUDA is in use and on the CPU
generator otherwise, so the same model code runs (and tests) on a CPU box.

Activation checkpointing replays a forward pass; :func:`capture_rng_state` and
:func:`restore_rng_state` snapshot and restore *all* of the RNG state that the forward pass
may consume (CPU, CUDA and every tracker stream) so the replay draws identical dropout masks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from shardspeed.accelerator import get_accelerator

_MODEL_PARALLEL_RNG = "model-parallel-rng"
_MODEL_PARALLEL_SEED_OFFSET = 2718


def _uses_cuda() -> bool:
    return get_accelerator().name == "cuda" and torch.cuda.is_available()


def _get_generator_state() -> torch.Tensor:
    return torch.cuda.get_rng_state() if _uses_cuda() else torch.get_rng_state()


def _set_generator_state(state: torch.Tensor) -> None:
    if _uses_cuda():
        torch.cuda.set_rng_state(state)
    else:
        torch.set_rng_state(state)


def _seed_generator(seed: int) -> None:
    if _uses_cuda():
        torch.cuda.manual_seed(seed)
    else:
        torch.manual_seed(seed)


class CudaRNGStatesTracker:
    """Named RNG streams that can be swapped in with :meth:`fork`.

    The name is DeepSpeed's / Megatron's; on a machine without CUDA the streams are
    states of the CPU generator.
    """

    def __init__(self) -> None:
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def reset(self) -> None:
        """Forget every stream and seed."""
        self.states_ = {}
        self.seeds_ = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        """A copy of the name -> generator-state map (safe to keep and restore later)."""
        return {name: state.clone() for name, state in self.states_.items()}

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        """Replace the streams with ``states`` (as returned by :meth:`get_states`)."""
        self.states_ = {name: state.clone() for name, state in states.items()}

    def add(self, name: str, seed: int) -> None:
        """Create stream ``name`` seeded with ``seed``; the current generator is untouched."""
        if seed in self.seeds_:
            raise ValueError(
                f"RNG tracker: seed {seed} is already used by another stream; "
                "give each stream (e.g. 'model-parallel-rng') its own seed."
            )
        if name in self.states_:
            raise ValueError(
                f"RNG tracker: stream {name!r} already exists; call reset() first "
                "or pick a different name."
            )
        self.seeds_.add(seed)
        original = _get_generator_state()
        _seed_generator(seed)
        self.states_[name] = _get_generator_state()
        _set_generator_state(original)

    @contextlib.contextmanager
    def fork(self, name: str = _MODEL_PARALLEL_RNG) -> Iterator[None]:
        """Run the block on stream ``name``; the stream advances, the default one does not."""
        if name not in self.states_:
            raise ValueError(
                f"RNG tracker: no stream named {name!r} (known: {sorted(self.states_)}); "
                "call model_parallel_cuda_manual_seed(seed) or tracker.add(name, seed) first."
            )
        original = _get_generator_state()
        _set_generator_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = _get_generator_state()
            _set_generator_state(original)


_TRACKER = CudaRNGStatesTracker()


def get_cuda_rng_tracker() -> CudaRNGStatesTracker:
    """The process-wide RNG tracker (Megatron / DeepSpeed name)."""
    return _TRACKER


def model_parallel_cuda_manual_seed(seed: int, tp_rank: int | None = None) -> None:
    """Seed the default generator with ``seed`` and the model-parallel stream per rank.

    Default generator: ``seed`` (identical on all tensor-parallel ranks). Stream
    ``'model-parallel-rng'``: ``seed + 2718 + tp_rank``. ``tp_rank`` defaults to the
    model-parallel rank of the mpu given to ``configure`` (0 without one).
    """
    if tp_rank is None:
        from shardspeed.runtime.activation_checkpointing.config import model_parallel_rank

        tp_rank = model_parallel_rank()
    _TRACKER.reset()
    _seed_generator(seed)
    _TRACKER.add(_MODEL_PARALLEL_RNG, seed + _MODEL_PARALLEL_SEED_OFFSET + tp_rank)


@dataclass
class RNGSnapshot:
    """All RNG state a forward pass may consume."""

    cpu: torch.Tensor
    cuda: torch.Tensor | None
    tracker: dict[str, torch.Tensor]


def capture_rng_state() -> RNGSnapshot:
    """Snapshot the CPU generator, the current CUDA generator (if used) and the tracker."""
    cuda_state = torch.cuda.get_rng_state() if _uses_cuda() else None
    return RNGSnapshot(torch.get_rng_state(), cuda_state, _TRACKER.get_states())


def restore_rng_state(snapshot: RNGSnapshot) -> None:
    """Put back every generator and tracker stream recorded in ``snapshot``."""
    torch.set_rng_state(snapshot.cpu)
    if snapshot.cuda is not None:
        torch.cuda.set_rng_state(snapshot.cuda)
    _TRACKER.set_states(snapshot.tracker)


@contextlib.contextmanager
def replay_rng_state(snapshot: RNGSnapshot) -> Iterator[None]:
    """Run the block with ``snapshot``'s RNG state; the caller's state is restored after."""
    current = capture_rng_state()
    restore_rng_state(snapshot)
    try:
        yield
    finally:
        restore_rng_state(current)
