"""Combine repeated launches of one row (``--rounds``) into one result object."""

from __future__ import annotations

import statistics
from typing import Any

from _bench_common import summarize_times


def _elementwise_max(lists: list[list[float]]) -> list[float]:
    return [max(values) for values in zip(*lists)]


def merge_rounds(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Merge the launches of one (engine, stage) row.

    Step times of every successful round are pooled before the median/p90 are taken (rounds
    are interleaved across rows, so load from other processes on a shared machine spreads
    over all rows alike). Memory is the worst round, init time the median round, losses come
    from the first round, and ``loss_round_max_diff`` says whether rounds reproduced it.
    """
    ok = [r for r in runs if r.get("status") == "ok"]
    if not ok:
        return runs[-1]
    merged = dict(ok[0])
    merged["rounds"] = len(ok)
    if len(runs) > len(ok):
        merged["failed_rounds"] = len(runs) - len(ok)
    if len(ok) == 1:
        return merged
    times_ms = [t for r in ok for t in r["step_times_ms"]]
    stats = summarize_times([t / 1e3 for t in times_ms])
    merged.update(stats)
    merged["step_times_ms"] = times_ms
    if all("cpu_ms" in r for r in ok):  # --paired rows: CPU time per step too
        merged["cpu_ms"] = [t for r in ok for t in r["cpu_ms"]]
    merged["tokens_per_s"] = ok[0]["tokens_per_s"] * ok[0]["median_ms"] / stats["median_ms"]
    merged["round_median_ms"] = [r["median_ms"] for r in ok]
    merged["init_s"] = statistics.median(r["init_s"] for r in ok)
    merged["peak_mem_mb_per_rank"] = _elementwise_max([r["peak_mem_mb_per_rank"] for r in ok])
    merged["peak_mem_delta_mb_per_rank"] = _elementwise_max(
        [r["peak_mem_delta_mb_per_rank"] for r in ok]
    )
    merged["loss_round_max_diff"] = max(
        max(abs(a - b) for a, b in zip(r["losses"], ok[0]["losses"])) for r in ok
    )
    return merged
