"""Text report of a :class:`FlopsProfiler` run: summary, top modules per depth, module tree."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch.distributed as dist
import torch.nn as nn

from shardspeed.profiling.flops_profiler.peak import device_description, mfu, peak_bf16_flops

if TYPE_CHECKING:
    from shardspeed.profiling.flops_profiler.profiler import FlopsProfiler

_PREFIXES = [(1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "K")]
_RULE = "-" * 30


def number_to_string(num: float, precision: int = 2) -> str:
    """``1234567 -> '1.23 M'`` (SI prefixes up to P)."""
    for scale, prefix in _PREFIXES:
        if abs(num) >= scale:
            return f"{num / scale:.{precision}f} {prefix}"
    return f"{num:.{precision}f} " if isinstance(num, float) and num % 1 else f"{int(num)} "


def flops_to_string(flops: float, precision: int = 2) -> str:
    return number_to_string(flops, precision) + "FLOPs"


def macs_to_string(macs: float, precision: int = 2) -> str:
    return number_to_string(macs, precision) + "MACs"


def params_to_string(params: float, precision: int = 2) -> str:
    return number_to_string(params, precision).rstrip()


def rate_to_string(flops_per_s: float, precision: int = 2) -> str:
    return number_to_string(flops_per_s, precision) + "FLOP/s"


def duration_to_string(seconds: float, precision: int = 2) -> str:
    if seconds >= 1:
        return f"{seconds:.{precision}f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.{precision}f} ms"
    return f"{seconds * 1e6:.{precision}f} us"


def _pct(part: float, whole: float) -> str:
    return f"{100.0 * part / whole:.2f}%" if whole else "0.00%"


def _engine_seconds(engine: Any, name: str) -> float | None:
    """Mean duration (s) of engine timer ``name``, None if the engine has no such timer."""
    timers = getattr(engine, "timers", None)
    if timers is None or not hasattr(timers, "has") or not timers.has(name):
        return None
    return timers(name).mean() / 1e3


def _engine_size(engine: Any, attr: str, default: int) -> int:
    value = getattr(engine, attr, None)
    value = value() if callable(value) else value
    return int(value) if value is not None else default


def _summary(prof: FlopsProfiler, profile_step: int) -> list[str]:
    fwd_flops = prof.get_total_flops()
    fwd_macs = prof.get_total_macs()
    params = prof.get_total_params()
    fwd_s = prof.get_total_duration()
    lines = [f"{_RULE} ShardSpeed flops profiler {_RULE}", f"profile step: {profile_step}"]
    rows: list[tuple[str, str]] = []
    engine = prof.ds_engine
    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    mp = 1
    if engine is not None:
        world = _engine_size(engine, "world_size", world)
        mp = _engine_size(engine, "mp_world_size", 1)
        rows += [
            ("world size", str(world)),
            ("data parallel size", str(_engine_size(engine, "dp_world_size", world // mp))),
            ("model parallel size", str(mp)),
            (
                "micro batch size per GPU",
                str(_engine_size(engine, "train_micro_batch_size_per_gpu", 0)),
            ),
        ]
    rows += [
        ("device", device_description()),
        ("params per GPU", params_to_string(params)),
        ("params of model (x mp size)", params_to_string(params * mp)),
        ("fwd MACs per GPU", macs_to_string(fwd_macs)),
        ("fwd FLOPs per GPU", flops_to_string(fwd_flops)),
    ]
    if engine is not None and _engine_seconds(engine, "forward") is not None:
        fwd_s = _engine_seconds(engine, "forward") or fwd_s
    rows.append(("fwd latency", duration_to_string(fwd_s)))
    fwd_rate = fwd_flops / fwd_s if fwd_s else 0.0
    rows.append(("fwd FLOP/s per GPU", rate_to_string(fwd_rate)))
    best_rate = fwd_rate
    bwd_s = _engine_seconds(engine, "backward") if engine is not None else None
    if bwd_s is not None:
        bwd_flops = (2.0 + prof.recompute_fwd_factor) * fwd_flops
        step_s = _engine_seconds(engine, "step") or 0.0
        iter_s = fwd_s + bwd_s + step_s
        iter_flops = fwd_flops + bwd_flops
        best_rate = iter_flops / iter_s if iter_s else 0.0
        rows += [
            (
                f"bwd FLOPs per GPU ({2.0 + prof.recompute_fwd_factor:g} x fwd)",
                flops_to_string(bwd_flops),
            ),
            ("bwd latency", duration_to_string(bwd_s)),
            ("bwd FLOP/s per GPU", rate_to_string(bwd_flops / bwd_s if bwd_s else 0.0)),
            ("step latency", duration_to_string(step_s)),
            ("iter latency (fwd + bwd + step)", duration_to_string(iter_s)),
            ("iter FLOP/s per GPU", rate_to_string(best_rate)),
        ]
    peak = peak_bf16_flops()
    utilisation = mfu(best_rate)
    if utilisation is not None and peak is not None:
        rows.append(
            ("MFU (vs dense bf16 peak)", f"{100 * utilisation:.2f}% of {rate_to_string(peak)}")
        )
    else:
        rows.append(("MFU", "n/a (peak FLOP/s of this device unknown)"))
    width = max(len(k) for k, _ in rows) + 2
    lines += [f"{k + ':':<{width}}{v}" for k, v in rows]
    return lines


def _walk(model: nn.Module, max_depth: int) -> list[tuple[str, nn.Module, int]]:
    """(name, module, depth) in definition order, each module once."""
    seen: set[int] = set()
    out = []
    for name, module in model.named_modules():
        if id(module) in seen:
            continue
        seen.add(id(module))
        depth = 0 if not name else name.count(".") + 1
        if max_depth < 0 or depth <= max_depth:
            out.append((name, module, depth))
    return out


def aggregated_section(prof: FlopsProfiler, module_depth: int = -1, top_modules: int = 1) -> str:
    """Top ``top_modules`` modules by params, MACs and latency at each depth."""
    by_depth: dict[int, list[tuple[str, nn.Module]]] = {}
    for name, module, depth in _walk(prof.model, module_depth):
        by_depth.setdefault(depth, []).append((name or type(module).__name__, module))
    lines = [f"Top {top_modules} module(s) by params, MACs and fwd latency at each depth:"]
    for depth, entries in sorted(by_depth.items()):

        def top(key: Any, fmt: Any, entries: list = entries) -> str:
            ranked = sorted(entries, key=lambda e: -key(e[1]))[:top_modules]
            return ", ".join(f"{n} {fmt(key(m))}" for n, m in ranked)

        lines.append(f"depth {depth}:")
        lines.append(f"    params  - {top(prof.module_params, params_to_string)}")
        lines.append(f"    MACs    - {top(lambda m: prof.module_totals(m).macs, macs_to_string)}")
        lines.append(
            f"    latency - {top(lambda m: prof.module_totals(m).duration_s, duration_to_string)}"
        )
    return "\n".join(lines)


def module_tree(prof: FlopsProfiler, module_depth: int = -1) -> str:
    """One line per module, indented by depth, with inclusive numbers and percentages."""
    total = prof.module_totals(prof.model)
    total_params = prof.module_params(prof.model)
    lines = [
        "Per-module profile (inclusive of children): params (% of total), MACs, "
        "FLOPs (% of total), fwd latency (% of total), achieved FLOP/s"
    ]
    for name, module, depth in _walk(prof.model, module_depth):
        stats = prof.module_totals(module)
        params = prof.module_params(module)
        rate = stats.flops / stats.duration_s if stats.duration_s else 0.0
        label = name.rsplit(".", 1)[-1] if name else type(module).__name__
        lines.append(
            f"{'  ' * depth}{label} ({type(module).__name__}): "
            f"{params_to_string(params)} ({_pct(params, total_params)}), "
            f"{macs_to_string(stats.macs)}, "
            f"{flops_to_string(stats.flops)} ({_pct(stats.flops, total.flops)}), "
            f"{duration_to_string(stats.duration_s)} ({_pct(stats.duration_s, total.duration_s)}), "
            f"{rate_to_string(rate)}"
        )
    return "\n".join(lines)


def op_section(prof: FlopsProfiler, top: int = 8) -> str:
    """The ops that contribute most FLOPs."""
    total = prof.get_total_flops() or 0
    items = list(prof.get_flops_by_op().items())[:top]
    parts = [f"{name} {flops_to_string(f)} ({_pct(f, total)})" for name, f in items]
    return "FLOPs by op: " + (", ".join(parts) if parts else "none")


def build_report(
    prof: FlopsProfiler,
    profile_step: int = 1,
    module_depth: int = -1,
    top_modules: int = 1,
    detailed: bool = True,
) -> str:
    """The full report :meth:`FlopsProfiler.print_model_profile` emits."""
    sections = ["\n".join(_summary(prof, profile_step)), op_section(prof)]
    sections.append(aggregated_section(prof, module_depth, top_modules))
    if detailed:
        sections.append(module_tree(prof, module_depth))
    sections.append("-" * 88)
    return "\n\n".join(sections)
