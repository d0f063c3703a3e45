"""Compression recipes on the demo GPT: held-out perplexity, size and served decode speed
(issue 28).

Runs the recipes of ``examples/compression/`` on ``make demo``'s GPT (``runs/demo``) and, per
row: held-out perplexity (the last 5% of the corpus, as ``quant_quality.py``) of the
compressed model as trained (activation quantization included), its size as stored
compactly (quantized weights at their bits + fp16 scales, the rest fp32) over the fp32
model's, whether ``pipeline()`` serving the cleaned checkpoint with the weight-only int8 /
int4 kernels gives the same greedy tokens as the cleaned model itself (fp32 reference
kernel), and batch-1 decode tokens/s through ``pipeline()`` (default kernels).

    python benchmarks/compression_bench.py                          # every row
    python benchmarks/compression_bench.py --rows w8a8,w4a8-lkd --lkd-steps 100
    python benchmarks/compression_bench.py --rows xtc --xtc-steps 1200 --json /tmp/c.json

CPU cost (2 cores): LKD and XTC distillation dominate (minutes); the rest is seconds.

Targets (issue 28): W8A8 PTQ within 1% of fp32; W4 g128 + A8 with LKD within 5%; XTC 2-of-4
layers ternary within 15%.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT / "examples" / "compression"))

from common import (  # noqa: E402
    DEFAULT_TEACHER,
    corpus_split,
    linear_names,
    load_teacher,
    model_bytes,
    perplexity,
)
from xtc_gpt import distill  # noqa: E402
from zeroquant_gpt import layerwise_distill, quantize  # noqa: E402

from shardspeed.compression import redundancy_clean  # noqa: E402
from shardspeed.models import GPT  # noqa: E402

ROWS = ("fp32", "w8a8", "w4a8", "w4a8-lkd", "xtc")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--teacher", default=str(DEFAULT_TEACHER))
    p.add_argument("--rows", default=",".join(ROWS), help=f"subset of {ROWS}")
    p.add_argument("--eval-tokens", type=int, default=16384)
    p.add_argument("--lkd-steps", type=int, default=50, help="LKD steps per block")
    p.add_argument("--xtc-fp-steps", type=int, default=300)
    p.add_argument("--xtc-steps", type=int, default=1500)
    p.add_argument("--xtc-batch", type=int, default=8)
    p.add_argument("--decode-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5, help="interleaved decode-timing rounds")
    p.add_argument("--keep-dir", default=None, help="keep the cleaned checkpoints here")
    p.add_argument(
        "--serve-only",
        default=None,
        help="time decode of the checkpoints a --keep-dir run left there (no training)",
    )
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def _greedy_reference(model: GPT, prompt: list[int], new: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), new, temperature=0)
    return out[0, len(prompt) :].tolist()


def _pipe(path: Path, quantization: dict | None, **overrides):
    from shardspeed.inference.serving.pipeline import pipeline

    q = None if quantization is None else {**quantization, **overrides}
    return pipeline(str(path), quantization=q, block_size=16, num_blocks=64)


def decode_tokens_per_s(pipe, prompt: list[int], new: int) -> float:
    t0 = time.perf_counter()
    (resp,) = pipe([prompt], max_new_tokens=new, ignore_eos=True)
    assert resp.generated_length == new
    return new / (time.perf_counter() - t0)


def build_rows(args: argparse.Namespace, teacher: GPT, out_dir: Path) -> list[dict]:
    wanted = [r.strip() for r in args.rows.split(",")]
    unknown = sorted(set(wanted) - set(ROWS))
    if unknown:
        raise SystemExit(f"--rows {unknown} unknown; known: {ROWS}")
    train_tokens, held_out = corpus_split()
    block = teacher.config.block_size
    fp32_bytes = model_bytes(teacher, {}, None)
    rows = []
    for name in wanted:
        t0 = time.perf_counter()
        if name == "fp32":
            model, bits, group, serve, label = teacher, None, None, None, "fp32 (teacher)"
        elif name in ("w8a8", "w4a8", "w4a8-lkd"):
            bits = 8 if name == "w8a8" else 4
            group = None if bits == 8 else 128  # int8: per row (torch's int8 kernel)
            model, config = quantize(teacher, bits, group, 8)
            label = f"ZeroQuant W{bits}A8 {'per-row' if group is None else 'g128'} PTQ"
            if name == "w4a8-lkd":
                layerwise_distill(model, teacher, train_tokens, args.lkd_steps)
                label = f"ZeroQuant W4A8 g128 + LKD ({args.lkd_steps} steps / block)"
            redundancy_clean(model, config)
            serve = {"bits": bits, "group_size": group}
        else:
            bits, group = 2, 128
            model, config = distill(
                teacher, [1, 3], bits, group, args.xtc_fp_steps, args.xtc_steps,
                batch=args.xtc_batch,
            )  # fmt: skip
            redundancy_clean(model, config)
            serve = {"bits": 4, "group_size": group}
            label = (
                f"XTC 2-of-4 layers, ternary g128 ({args.xtc_steps} KD steps x "
                f"{args.xtc_batch} seqs, ternary from step {args.xtc_fp_steps})"
            )
        seconds = time.perf_counter() - t0
        ppl = perplexity(model, held_out, block, args.eval_tokens)
        weight_bits = {} if bits is None else dict.fromkeys(linear_names(model), bits)
        path = out_dir / name
        if name == "fp32":
            path = Path(args.teacher)
        else:
            model.save_pretrained(path)
        rows.append(
            {
                "row": name, "label": label, "ppl": ppl, "bytes_ratio":
                model_bytes(model, weight_bits, group) / fp32_bytes, "seconds": seconds,
                "path": str(path), "serve": serve, "model": model,
            }
        )  # fmt: skip
    base = next((r["ppl"] for r in rows if r["row"] == "fp32"), None)
    if base is None:
        base = perplexity(teacher, held_out, block, args.eval_tokens)
    for r in rows:
        r["ppl_delta_pct"] = 100 * (r["ppl"] / base - 1)
    return rows


def serve_rows(args: argparse.Namespace, rows: list[dict]) -> None:
    """Token-exactness (fp32 reference kernel) and decode tokens/s (default kernels)."""
    prompt = list(b"def main(argv=None):\n    ")[:16]
    for r in rows:
        if r["serve"] is None:
            r["token_exact"] = None
            continue
        reference = GPT.from_pretrained(r["path"]).eval()  # the cleaned weights, no A8
        expected = _greedy_reference(reference, prompt, args.decode_tokens)
        exact = _pipe(Path(r["path"]), r["serve"], kernel="reference", compute_dtype="float32")
        (resp,) = exact([prompt], max_new_tokens=args.decode_tokens, ignore_eos=True)
        r["token_exact"] = resp.token_ids == expected
    pipes = {r["row"]: _pipe(Path(r["path"]), r["serve"]) for r in rows}
    for pipe in pipes.values():  # first calls: kernel checks, allocations
        decode_tokens_per_s(pipe, prompt, args.decode_tokens)
    speeds: dict[str, list[float]] = {r["row"]: [] for r in rows}
    for _ in range(args.rounds):
        for r in rows:
            speeds[r["row"]].append(
                decode_tokens_per_s(pipes[r["row"]], prompt, args.decode_tokens)
            )
    for r in rows:
        r["tokens_per_s"] = statistics.median(speeds[r["row"]])
        r["tokens_per_s_rounds"] = speeds[r["row"]]


SERVE = {
    "fp32": None,
    "w8a8": {"bits": 8, "group_size": None},
    "w4a8": {"bits": 4, "group_size": 128},
    "w4a8-lkd": {"bits": 4, "group_size": 128},
    "xtc": {"bits": 4, "group_size": 128},
}


def saved_rows(args: argparse.Namespace) -> list[dict]:
    """Rows for the checkpoints of an earlier ``--keep-dir`` run (decode timing only)."""
    rows = []
    for name in [r.strip() for r in args.rows.split(",")]:
        path = Path(args.teacher) if name == "fp32" else Path(args.serve_only) / name
        rows.append(
            {"row": name, "label": name, "ppl": float("nan"), "ppl_delta_pct": float("nan"),
             "bytes_ratio": float("nan"), "seconds": 0.0, "path": str(path),
             "serve": SERVE[name], "model": None}
        )  # fmt: skip
    return rows


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.manual_seed(0)
    teacher = load_teacher(args.teacher)
    with tempfile.TemporaryDirectory() as tmp:
        if args.serve_only:
            rows = saved_rows(args)
        else:
            rows = build_rows(args, teacher, Path(args.keep_dir or tmp))
        serve_rows(args, rows)
    base_speed = next((r["tokens_per_s"] for r in rows if r["row"] == "fp32"), None)
    print("| recipe | held-out ppl | vs fp32 | model bytes / fp32 | served tokens = cleaned "
          "| batch-1 decode tok/s (rounds) | vs fp32 | compress s |")  # fmt: skip
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        exact = "-" if r["token_exact"] is None else ("yes" if r["token_exact"] else "NO")
        rounds = ", ".join(f"{v:.0f}" for v in r["tokens_per_s_rounds"])
        speedup = f"{r['tokens_per_s'] / base_speed:.2f}x" if base_speed else "-"
        print(
            f"| {r['label']} | {r['ppl']:.4f} | {r['ppl_delta_pct']:+.2f}% | "
            f"{r['bytes_ratio']:.3f}x | {exact} | {r['tokens_per_s']:.0f} ({rounds}) | "
            f"{speedup} | {r['seconds']:.0f} |"
        )
    if args.json:
        for r in rows:
            r.pop("model")
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
