"""Tables of ``tp_bench.py``: every row, then shardspeed / DeepSpeed and Ulysses / full ratios."""

from __future__ import annotations

from typing import Any

from _bench_common import ratio, render_table

from trainbench.report import print_failures, print_ratios, print_run_header, timing_cells

RowKey = tuple[str, str, int]  # (kind, engine, degree)


def row_key(result: dict[str, Any]) -> RowKey:
    return result["kind"], result["engine"], result["degree"]


def _ok(results: list[dict[str, Any]]) -> dict[RowKey, dict[str, Any]]:
    return {row_key(r): r for r in results if r.get("status") == "ok"}


def _worst(values: list[float]) -> float:
    return max(values)


def results_table(results: list[dict[str, Any]], markdown: bool) -> str:
    """One line per row: step time, throughput, per-rank memory, init time, losses."""
    headers = ["row", "ranks", "median ms", "p90 ms", "min ms", "tok/s", "peak MiB/rank"]
    headers += ["+MiB/rank", "params/rank", "init s", "loss@1", "loss@end"]
    rows = []
    for r in results:
        if r.get("status") != "ok":
            note = "not available" if r.get("status") == "unavailable" else "FAILED"
            rows.append([r["label"], r.get("nproc", "-"), note, *["-"] * (len(headers) - 3)])
            continue
        info = r.get("engine_info", {})
        rows.append(
            [
                r["label"],
                r["world_size"],
                *timing_cells(r),
                info.get("module_numel", r["num_params"]),
                r["init_s"],
                f"{r['loss_step1']:.5f}",
                f"{r['loss_final']:.5f}",
            ]
        )
    return render_table(headers, rows, markdown)


def pairings(results: list[dict[str, Any]]) -> list[tuple[RowKey, RowKey]]:
    """(numerator, denominator) rows to compare, both present and ok, in table order.

    Ulysses: each library's sp row / full attention on one rank. Then, for TP and Ulysses,
    shardspeed / DeepSpeed at each degree.
    """
    ok = _ok(results)
    full: RowKey = ("ulysses", "full", 1)
    wanted = [(key, full) for key in ok if key[0] == "ulysses" and key != full]
    wanted += [(key, (key[0], "deepspeed", key[2])) for key in ok if key[1] == "shardspeed"]
    return [(a, b) for a, b in wanted if a in ok and b in ok]


def ratio_table(results: list[dict[str, Any]], markdown: bool) -> str:
    """numerator / denominator per pairing: time and memory (< 1: faster / smaller), loss gap."""
    ok = _ok(results)
    headers = ["numerator / denominator", "time ratio", "p90 ratio", "min ratio"]
    headers += ["peak mem ratio", "+mem ratio", "|dloss@1|", "|dloss@end|"]
    rows = []
    for mine_key, peer_key in pairings(results):
        mine, peer = ok[mine_key], ok[peer_key]
        rows.append(
            [
                f"{mine['label']} / {peer['label']}",
                *(ratio(mine[k], peer[k]) for k in ("median_ms", "p90_ms", "min_ms")),
                *(
                    ratio(_worst(mine[k]), _worst(peer[k]))
                    for k in ("peak_mem_mb_per_rank", "peak_mem_delta_mb_per_rank")
                ),
                f"{abs(mine['loss_step1'] - peer['loss_step1']):.2e}",
                f"{abs(mine['loss_final'] - peer['loss_final']):.2e}",
            ]
        )
    return render_table(headers, rows, markdown)


def ulysses_scaling(results: list[dict[str, Any]]) -> list[str]:
    """One sentence per sequence-parallel row: speed-up over full attention and efficiency."""
    ok = _ok(results)
    full = ok.get(("ulysses", "full", 1))
    lines = []
    for (kind, engine, degree), r in sorted(ok.items()):
        if kind != "ulysses" or engine == "full" or full is None:
            continue
        speedup = full["median_ms"] / r["median_ms"]
        mem = ratio(
            _worst(r["peak_mem_delta_mb_per_rank"]), _worst(full["peak_mem_delta_mb_per_rank"])
        )
        lines.append(
            f"{r['label']}: {speedup:.2f}x the step rate of full attention on one rank "
            f"(scaling efficiency {speedup / degree:.0%} on {degree} ranks); per-rank memory "
            f"added by training {mem:.2f}x the one-rank run's"
        )
    return lines


def print_tp_report(header: dict[str, Any], results: list[dict[str, Any]], markdown: bool) -> None:
    """Header, results table, ratio table, Ulysses scaling, failures."""
    wl = next((r["workload"] for r in results if "workload" in r), None)
    print_run_header(header)
    if header.get("oversubscribed"):
        print(f"NOTE: the widest launch is oversubscribed ({header['oversubscribed']})")
    if wl is not None:
        stage = next((f" | ZeRO {r['stage']}" for r in results if r.get("kind") == "tp"), "")
        print(
            f"layers={wl['n_layer']} hidden={wl['n_embd']} heads={wl['n_head']} "
            f"kv_heads={wl['n_kv_head']} mlp={wl['intermediate_size']} T={wl['block_size']} "
            f"vocab={wl['vocab_size']} micro_batch={wl['micro_batch']} {wl['dtype']} | "
            f"warmup {wl['warmup']} + {wl['steps']} timed steps{stage}"
        )
    print()
    print(results_table(results, markdown))
    print_ratios(ratio_table(results, markdown))
    for line in ulysses_scaling(results):
        print(line)
    print_failures(results)
