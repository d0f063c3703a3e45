"""``checkpoint``: run a function without keeping its activations, recompute them in backward.

Two flavours, both replaying the exact RNG state of the original forward (CPU generator,
CUDA generator and every stream of the model-parallel RNG tracker) so dropout masks match:

* :func:`checkpoint` - reentrant (a ``torch.autograd.Function``), DeepSpeed's default.
  Saved inputs go through the configured :class:`StashPolicy` (partition across
  model-parallel ranks, keep on host).
* :func:`non_reentrant_checkpoint` - ``torch.utils.checkpoint`` with ``use_reentrant=False``
  underneath; the tracker streams are replayed through its ``context_fn`` and the stash
  policy is applied to the inputs it saves through ``saved_tensors_hooks``.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint

from shardspeed.accelerator import get_accelerator
from shardspeed.runtime.activation_checkpointing.config import settings
from shardspeed.runtime.activation_checkpointing.rng import (
    RNGSnapshot,
    capture_rng_state,
    get_cuda_rng_tracker,
    replay_rng_state,
)
from shardspeed.runtime.activation_checkpointing.stash import StashedTensor, StashPolicy
from shardspeed.utils.logging import log_dist, warning_once


@contextlib.contextmanager
def _boundary(label: str) -> Iterator[None]:
    """Optional device sync and timing around a checkpointed forward or recompute."""
    cfg = settings()
    if cfg.synchronize or cfg.profile:
        get_accelerator().synchronize()
    start = time.perf_counter()
    try:
        yield
    finally:
        if cfg.synchronize or cfg.profile:
            get_accelerator().synchronize()
        if cfg.profile:
            log_dist(f"activation checkpoint {label}: {(time.perf_counter() - start) * 1e3:.2f} ms")


def _autocast_state() -> tuple[str, bool, torch.dtype]:
    device_type = "cuda" if get_accelerator().name == "cuda" else "cpu"
    return (
        device_type,
        torch.is_autocast_enabled(device_type),
        torch.get_autocast_dtype(device_type),
    )


class CheckpointFunction(torch.autograd.Function):
    """Reentrant checkpoint: forward under no_grad, recompute with grad in backward."""

    @staticmethod
    def forward(ctx: Any, run_function: Callable[..., Any], policy: StashPolicy, *args: Any) -> Any:
        ctx.run_function = run_function
        ctx.policy = policy
        ctx.rng: RNGSnapshot = capture_rng_state()
        ctx.autocast = _autocast_state()
        ctx.tensor_positions = [i for i, a in enumerate(args) if torch.is_tensor(a)]
        ctx.non_tensor_args = [None if torch.is_tensor(a) else a for a in args]
        if not any(args[i].requires_grad for i in ctx.tensor_positions):
            warning_once(
                "checkpoint(): none of the tensor inputs requires grad, so parameters inside "
                "the checkpointed function get no gradient (reentrant checkpoint). Make the "
                "input require grad or use non_reentrant_checkpoint()."
            )
        with _boundary("forward"):
            outputs = run_function(*args)

        kept: list[torch.Tensor] = []
        metas: list[StashedTensor] = []
        for i in ctx.tensor_positions:
            tensor, meta = policy.pack(args[i])
            kept.append(tensor)
            metas.append(meta)
        ctx.metas = metas
        ctx.save_for_backward(*kept)

        flat = outputs if isinstance(outputs, tuple) else (outputs,)
        ctx.num_outputs = len(flat)
        non_diff = [t for t in flat if torch.is_tensor(t) and not t.is_floating_point()]
        if non_diff:
            ctx.mark_non_differentiable(*non_diff)
        return outputs

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Any) -> tuple[Any, ...]:
        if not torch.autograd._is_checkpoint_valid():
            raise RuntimeError(
                "checkpoint() is reentrant and works with loss.backward() only, not with "
                "torch.autograd.grad(); use non_reentrant_checkpoint() instead."
            )
        args = list(ctx.non_tensor_args)
        for pos, kept, meta in zip(ctx.tensor_positions, ctx.saved_tensors, ctx.metas):
            tensor = ctx.policy.unpack(kept, meta).detach()
            tensor.requires_grad_(meta.requires_grad)
            args[pos] = tensor

        device_type, autocast_on, autocast_dtype = ctx.autocast
        with (
            _boundary("recompute"),
            replay_rng_state(ctx.rng),
            torch.enable_grad(),
            torch.amp.autocast(device_type, enabled=autocast_on, dtype=autocast_dtype),
        ):
            outputs = ctx.run_function(*args)
        flat = outputs if isinstance(outputs, tuple) else (outputs,)

        roots: list[torch.Tensor] = []
        grads: list[torch.Tensor] = []
        for out, grad in zip(flat, grad_outputs):
            if torch.is_tensor(out) and out.requires_grad and grad is not None:
                roots.append(out)
                grads.append(grad)
        if not roots:
            raise RuntimeError(
                "checkpoint(): none of the function's outputs requires grad, so there is "
                "nothing to backpropagate through the checkpointed segment."
            )
        torch.autograd.backward(roots, grads)
        input_grads = tuple(
            a.grad if torch.is_tensor(a) and a.requires_grad else None for a in args
        )
        return (None, None, *input_grads)


def checkpoint(function: Callable[..., Any], *args: Any) -> Any:
    """Run ``function(*args)`` without storing its activations (reentrant, DeepSpeed default).

    Drop-in for ``torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=True)``.
    Non-tensor inputs and outputs pass through. Saved inputs are partitioned across the
    model-parallel group and/or kept on host according to :func:`configure`.
    """
    if not torch.is_grad_enabled():
        return function(*args)
    policy = StashPolicy.from_settings(settings())
    return CheckpointFunction.apply(function, policy, *args)


class _TrackerReplay:
    """Recompute context for torch's checkpoint: swaps in the tracker streams of forward."""

    def __init__(self, states: dict[str, torch.Tensor]) -> None:
        self.states = states
        self.saved: dict[str, torch.Tensor] | None = None

    def __enter__(self) -> None:
        tracker = get_cuda_rng_tracker()
        self.saved = tracker.get_states()
        tracker.set_states(self.states)

    def __exit__(self, *exc: object) -> None:
        assert self.saved is not None
        get_cuda_rng_tracker().set_states(self.saved)


def _tracker_context_fn() -> tuple[contextlib.AbstractContextManager, _TrackerReplay]:
    return contextlib.nullcontext(), _TrackerReplay(get_cuda_rng_tracker().get_states())


def non_reentrant_checkpoint(function: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Non-reentrant checkpoint (works with ``torch.autograd.grad`` and inputs without grad).

    Uses ``torch.utils.checkpoint.checkpoint(use_reentrant=False)`` with the tracker streams
    replayed on recompute and the configured stash policy applied to the saved inputs.
    """
    policy = StashPolicy.from_settings(settings())
    hooks: contextlib.AbstractContextManager = contextlib.nullcontext()
    if not policy.is_identity and torch.is_grad_enabled():
        hooks = torch.autograd.graph.saved_tensors_hooks(policy.pack, lambda p: policy.unpack(*p))
    with hooks, _boundary("forward"):
        return torch_checkpoint.checkpoint(
            function,
            *args,
            use_reentrant=False,
            context_fn=_tracker_context_fn,
            preserve_rng_state=True,
            **kwargs,
        )


def checkpoint_sequential(
    functions: torch.nn.Sequential | Sequence[Callable[[Any], Any]],
    segments: int,
    input: Any,
) -> Any:
    """Run ``functions`` in ``segments`` chunks, checkpointing every chunk but the last.

    Same contract as ``torch.utils.checkpoint.checkpoint_sequential``: each function takes
    the previous output; only the segment boundaries are stored.
    """
    funcs = (
        list(functions.children())
        if isinstance(functions, torch.nn.Sequential)
        else list(functions)
    )
    if not 1 <= segments <= max(len(funcs), 1):
        raise ValueError(
            f"checkpoint_sequential(segments={segments}) must be between 1 and the number of "
            f"functions ({len(funcs)})."
        )
    size = -(-len(funcs) // segments)  # ceil

    def run_segment(start: int, end: int) -> Callable[[Any], Any]:
        def forward(x: Any) -> Any:
            for fn in funcs[start:end]:
                x = fn(x)
            return x

        return forward

    end = 0
    for start in range(0, size * (segments - 1), size):
        end = min(start + size, len(funcs))
        input = checkpoint(run_segment(start, end), input)
    return run_segment(end, len(funcs))(input)
