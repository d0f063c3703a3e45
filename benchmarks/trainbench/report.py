"""Tables of the side-by-side training benchmark: results, shardspeed/peer ratios, loss check."""

from __future__ import annotations

import statistics
from typing import Any

from _bench_common import ratio, render_table

from trainbench.engines import BASELINE, row_label
from trainbench.workload import flops_per_token

# For each stage: the peers shardspeed is compared with, as (engine, stage) keys.
PAIRINGS: dict[int, list[tuple[str, int]]] = {
    0: [("ddp", 0), ("deepspeed", 0)],
    1: [("deepspeed", 1)],
    2: [("fsdp2", 2), ("deepspeed", 2)],
    3: [("fsdp2", 3), ("deepspeed", 3)],
}


def _ok(results: list[dict[str, Any]]) -> dict[tuple[str, int], dict[str, Any]]:
    return {(r["engine"], r["stage"]): r for r in results if r.get("status") == "ok"}


def _max(values: list[float] | None) -> float | None:
    return max(values) if values else None


def _cpu_ms(r: dict[str, Any]) -> float | None:
    """Median CPU time per step of a ``--paired`` row (None for a normal row)."""
    return statistics.median(r["cpu_ms"]) if r.get("cpu_ms") else None


def _with_cpu(results: list[dict[str, Any]]) -> bool:
    return any(r.get("cpu_ms") for r in results if r.get("status") == "ok")


def timing_cells(r: dict[str, Any]) -> list[Any]:
    """median / p90 / min ms, tokens/s, worst rank's peak and added memory of an ok row."""
    times = [r["median_ms"], r["p90_ms"], r["min_ms"], round(r["tokens_per_s"])]
    return times + [_max(r["peak_mem_mb_per_rank"]), _max(r["peak_mem_delta_mb_per_rank"])]


def mfu(r: dict[str, Any], header: dict[str, Any]) -> str | None:
    """Model FLOPs utilisation of an ok row: achieved training FLOP/s over the devices'
    dense bf16 peak (None without a known peak, e.g. on CPU)."""
    peak = header.get("peak_tflops")
    if not peak or "workload" not in r:
        return None
    achieved = flops_per_token(r["workload"]) * r["tokens_per_s"]
    return f"{achieved / (peak * 1e12 * int(header['nproc'])):.1%}"


def results_table(
    results: list[dict[str, Any]], markdown: bool, header: dict[str, Any] | None = None
) -> str:
    """One row per launch: step time, throughput, memory, init time, losses (and MFU
    where the header carries the devices' peak)."""
    ok = _ok(results)
    ddp = ok.get(("ddp", 0))
    with_mfu = bool(header and header.get("peak_tflops"))
    headers = ["engine", "stage", "median ms", "p90 ms", "min ms", "tok/s", "peak MiB/rank"]
    headers += ["+MiB/rank", "init s", "loss@1", "loss@end", "time / DDP"]
    headers += ["MFU"] if with_mfu else []
    with_cpu = _with_cpu(results)
    headers += ["CPU ms"] if with_cpu else []
    rows = []
    for r in results:
        if r.get("status") != "ok":
            note = "not available yet" if r.get("status") == "unavailable" else "FAILED"
            rows.append([r["label"], r["stage"], note, *["-"] * (len(headers) - 3)])
            continue
        rows.append(
            [
                r["label"],
                r["stage"],
                *timing_cells(r),
                r["init_s"],
                f"{r['loss_step1']:.5f}",
                f"{r['loss_final']:.5f}",
                ratio(r["median_ms"], ddp["median_ms"]) if ddp else None,
                *([mfu(r, header or {})] if with_mfu else []),
                *([_cpu_ms(r)] if with_cpu else []),
            ]
        )
    return render_table(headers, rows, markdown)


def _ratio_cells(mine: dict[str, Any], peer: dict[str, Any], with_cpu: bool) -> list[Any]:
    """time / p90 / min / peak-memory / added-memory ratios, the final loss gap and (for
    ``--paired`` rows) the CPU-time ratio."""
    cells = [
        ratio(mine["median_ms"], peer["median_ms"]),
        ratio(mine["p90_ms"], peer["p90_ms"]),
        ratio(mine["min_ms"], peer["min_ms"]),
        ratio(_max(mine["peak_mem_mb_per_rank"]), _max(peer["peak_mem_mb_per_rank"])),
        ratio(_max(mine["peak_mem_delta_mb_per_rank"]), _max(peer["peak_mem_delta_mb_per_rank"])),
        f"{abs(mine['loss_final'] - peer['loss_final']):.2e}",
    ]
    return cells + ([ratio(_cpu_ms(mine), _cpu_ms(peer))] if with_cpu else [])


def ratio_table(results: list[dict[str, Any]], markdown: bool) -> str:
    """shardspeed / peer for each stage pairing (time: < 1 is faster; memory: < 1 is smaller);
    with ``--baseline-root`` rows, the baseline / peer and shardspeed / baseline too."""
    ok = _ok(results)
    headers = ["pairing", "time ratio", "p90 ratio", "min ratio", "peak mem ratio", "+mem ratio"]
    headers += ["abs dloss@end"]
    with_cpu = _with_cpu(results)
    headers += ["CPU ratio"] if with_cpu else []
    missing = ["n/a", *["-"] * (len(headers) - 2)]
    rows = []
    stages = sorted({r["stage"] for r in results})
    planned = {(r["engine"], r["stage"]) for r in results}
    for stage in stages:
        for engine in ("shardspeed", BASELINE):
            mine = ok.get((engine, stage))
            for peer_key in PAIRINGS.get(stage, []) if (engine, stage) in planned else []:
                peer = ok.get(peer_key)
                if peer is None:
                    continue
                name = f"{row_label(engine, stage)} / {peer['label']}"
                if mine is None:
                    rows.append([name, *missing])
                    continue
                rows.append([name, *_ratio_cells(mine, peer, with_cpu)])
        mine, base = ok.get(("shardspeed", stage)), ok.get((BASELINE, stage))
        if mine is not None and base is not None:
            rows.append([f"{mine['label']} / {base['label']}", *_ratio_cells(mine, base, with_cpu)])
        # Peer against peer (DeepSpeed / torch), useful while shardspeed rows are missing.
        torch_peer = next((ok.get(k) for k in PAIRINGS.get(stage, []) if k[0] != "deepspeed"), None)
        ds = ok.get(("deepspeed", stage))
        if torch_peer is not None and ds is not None:
            name = f"{ds['label']} / {torch_peer['label']}"
            rows.append([name, *_ratio_cells(ds, torch_peer, with_cpu)])
    return render_table(headers, rows, markdown)


def loss_check(results: list[dict[str, Any]]) -> dict[str, float]:
    """Largest disagreement between rows at step 1 (identical workloads) and at the end."""
    ok = list(_ok(results).values())
    if len(ok) < 2:
        return {}
    first = [r["loss_step1"] for r in ok]
    last = [r["loss_final"] for r in ok]
    n = min(len(r["losses"]) for r in ok)
    per_step = [max(r["losses"][i] for r in ok) - min(r["losses"][i] for r in ok) for i in range(n)]
    return {
        "max_diff_step1": max(first) - min(first),
        "max_diff_final": max(last) - min(last),
        "max_diff_any_step": max(per_step) if per_step else float("nan"),
    }


def print_run_header(header: dict[str, Any]) -> None:
    """Date, machine, ranks, threads, torch builds, rounds and the load average of a run."""
    print()
    gpu = f" ({header['gpu']})" if header.get("gpu") else ""
    print(f"date {header['date']} | {header['machine']} | device {header['device']}{gpu}")
    print(
        f"ranks per launch {header['nproc']} | threads per rank {header['threads_per_rank']} "
        f"| torch {', '.join(header['torch_versions'])} | rounds {header['rounds']}"
    )
    load = header.get("loadavg_start"), header.get("loadavg_end")
    if all(load):
        print(f"1-min load average: {load[0][0]:.2f} at start, {load[1][0]:.2f} at end")
    if header.get("paired"):
        print("paired: every row in one launch per round, the rows stepped in turn")
    if header.get("baseline_root"):
        print(
            f"{BASELINE} rows: shardspeed from {header['baseline_root']} "
            f"(commit {header.get('baseline_commit') or 'unknown'})"
        )
    if len(header["torch_versions"]) > 1:
        print("WARNING: rows ran on different torch builds; compare with care.")


def print_ratios(ratios: str) -> None:
    """A ratio table under its legend (nothing when it has no rows)."""
    if len(ratios.splitlines()) > 2:
        print()
        print("ratios (time and memory: < 1 means the numerator is faster / smaller)")
        print(ratios)


def print_failures(results: list[dict[str, Any]]) -> None:
    """Why each row that is not ok is missing or failed."""
    for r in results:
        if r.get("status") == "unavailable":
            print(f"{r['label']}: {r.get('error', 'not available yet')}")
        elif r.get("status") != "ok":
            print(f"\n{r['label']} FAILED: {r.get('error', '')}")


def print_report(header: dict[str, Any], results: list[dict[str, Any]], markdown: bool) -> None:
    """Print the header, the results table, the ratio table, the loss check and failures."""
    wl = next((r["workload"] for r in results if "workload" in r), None)
    print_run_header(header)
    if wl is not None:
        print(
            f"GPT n_layer={wl['n_layer']} n_embd={wl['n_embd']} n_head={wl['n_head']} "
            f"T={wl['block_size']} vocab={wl['vocab_size']} micro_batch={wl['micro_batch']} "
            f"{wl['dtype']} | warmup {wl['warmup']} + {wl['steps']} timed steps "
            f"| DeepSpeed optimizer: {wl['ds_optimizer']}"
        )
    print()
    print(results_table(results, markdown, header))
    if header.get("peak_tflops"):
        print(
            f"MFU: 6 x matmul weights + 12 L d T FLOPs per token x tok/s over "
            f"{header['nproc']} x {header['peak_tflops']} TFLOP/s (dense bf16 peak)"
        )
    print_ratios(ratio_table(results, markdown))
    check = loss_check(results)
    if check:
        print()
        print(
            f"loss check: max |diff| at step 1 = {check['max_diff_step1']:.2e} "
            f"(identical workloads: expect ~1e-6 fp32), at the end = "
            f"{check['max_diff_final']:.2e}, over all steps = {check['max_diff_any_step']:.2e}"
        )
    print_failures(results)
