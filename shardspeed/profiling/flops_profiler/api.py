"""``get_model_profile``: one-call profile of a model's forward (or ``generate``)."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn

from shardspeed.profiling.flops_profiler.profiler import FlopsProfiler
from shardspeed.profiling.flops_profiler.report import (
    flops_to_string,
    macs_to_string,
    params_to_string,
)

_MODES = ("forward", "generate")


def _example_input(model: nn.Module, input_shape: tuple[int, ...]) -> torch.Tensor:
    """A tensor of ones with the model's dtype and device (DeepSpeed's ``input_shape``)."""
    first = next(model.parameters(), None)
    dtype = first.dtype if first is not None else torch.float32
    device = first.device if first is not None else torch.device("cpu")
    return torch.ones(tuple(input_shape), dtype=dtype, device=device)


def get_model_profile(
    model: nn.Module,
    input_shape: tuple[int, ...] | None = None,
    args: list[Any] | tuple[Any, ...] = [],  # noqa: B006 - DeepSpeed's signature
    kwargs: dict[str, Any] = {},  # noqa: B006
    print_profile: bool = True,
    detailed: bool = True,
    module_depth: int = -1,
    top_modules: int = 1,
    warm_up: int = 1,
    as_string: bool = True,
    output_file: str | None = None,
    ignore_modules: list[Any] | None = None,
    mode: str = "forward",
) -> tuple[Any, Any, Any]:
    """Profile one forward pass (``mode='forward'``) or ``model.generate`` call.

    Inputs: ``input_shape`` (a tensor of ones of that shape, in the model's dtype, is the
    only positional argument) or ``args`` / ``kwargs``. Runs ``warm_up`` unprofiled calls,
    one call that counts ops and one that measures module latencies (without the op
    counter's overhead), all under ``torch.no_grad()``. Returns ``(flops, macs, params)``,
    formatted strings if ``as_string``.
    """
    if mode not in _MODES:
        raise ValueError(f"get_model_profile(mode={mode!r}) is not supported; use one of {_MODES}.")
    if input_shape is not None and args:
        raise ValueError(
            "get_model_profile: pass either input_shape or args, not both "
            f"(got input_shape={tuple(input_shape)} and {len(args)} args)."
        )
    if input_shape is None and not args and not kwargs:
        raise ValueError(
            "get_model_profile needs inputs: input_shape=(batch, ...) or args=[...] / kwargs={...}."
        )
    call_args = [_example_input(model, input_shape)] if input_shape is not None else list(args)
    fn = model if mode == "forward" else model.generate

    profiler = FlopsProfiler(model)
    timing = FlopsProfiler(model)
    with torch.no_grad():
        for _ in range(warm_up):
            fn(*call_args, **kwargs)
        # Pass 1 counts ops; pass 2 measures latencies without the counter's overhead.
        for prof, count_ops in ((profiler, True), (timing, False)):
            prof.start_profile(ignore_list=ignore_modules, count_ops=count_ops)
            try:
                fn(*call_args, **kwargs)
            finally:
                prof.stop_profile()
    profiler.use_durations_from(timing)
    flops = profiler.get_total_flops()
    macs = profiler.get_total_macs()
    params = profiler.get_total_params()
    if print_profile:
        profiler.print_model_profile(
            profile_step=warm_up,
            module_depth=module_depth,
            top_modules=top_modules,
            detailed=detailed,
            output_file=output_file,
        )
    profiler.end_profile()
    if as_string:
        return flops_to_string(flops), macs_to_string(macs), params_to_string(params)
    return flops, macs, params
