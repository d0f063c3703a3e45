"""Decode speed of weight-only quantization vs Hugging Face ``generate`` (issue 17, item 6).

A Llama built from a config with random weights (speed does not need trained weights;
default ~220M parameters, large enough that reading the weights dominates a decode
step on CPU) is run by:

* ``hf``      - ``transformers`` ``generate`` (greedy, KV cache) on the model itself;
  ``int8`` / ``int4`` rows run on a copy quantized with ``quantize_model``;
* ``fastgen`` - ShardSpeed's ``pipeline()`` on the same weights
  (``pipeline(model, dtype=..., quantization=...)``).

Each (engine, precision, batch) cell is measured in interleaved rounds (every cell once
per round, so machine load drifts hit all cells alike). A measurement generates
``--new-tokens`` tokens and 1 token for the same prompts; the time per output token is
``(T(new_tokens) - T(1)) / (new_tokens - 1)`` (prefill and setup cancel) and decode
tokens/s is ``batch / TPOT``. The table reports the median over rounds and the ratio to
HF fp32 at the same batch.

    python benchmarks/inference_bench.py                       # full default grid
    python benchmarks/inference_bench.py --quick               # small model, 1 round
    python benchmarks/inference_bench.py --engines hf --precisions fp32,int8 --batches 1
    python benchmarks/inference_bench.py --engines fastgen --offload none,cpu   # ZeRO-Inference

``--offload`` adds rows where FastGen streams the decoder layers from host memory
(``cpu``) or from files under ``--offload-path`` (``nvme``) (``pipeline(offload=...)``,
prefetch ``--offload-prefetch``); HF rows are always ``none``.

``--tp 1,2`` adds FastGen rows with tensor parallelism (``pipeline(tensor_parallel=T)``:
this process + T-1 spawned workers). Every rank runs ``--threads`` threads, so a tp=T
row uses T x threads cores; compare fairly with ``--threads cores//T``. tp > 1 is
refused with int8/int4 or offload, so those cells are skipped with a note. Each pipeline
is shut down (workers stopped) after the rounds.

    python benchmarks/inference_bench.py --engines fastgen --precisions fp32 --tp 1,2 --threads 1
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

PRECISIONS = ("fp32", "bf16", "int8", "int4")
ENGINES = ("hf", "fastgen")
OFFLOADS = ("none", "cpu", "nvme")


@dataclass(frozen=True)
class Cell:
    """One measured configuration (a table row at one batch size)."""

    engine: str
    precision: str  # fp32 | bf16 | int8 | int4
    batch: int
    tp: int = 1
    offload: str = "none"

    @property
    def label(self) -> str:
        return f"{self.engine} {self.precision} tp{self.tp} offload={self.offload}"


@dataclass
class Result:
    cell: Cell
    tpot_s: list[float] = field(default_factory=list)

    def median_tpot(self) -> float:
        return statistics.median(self.tpot_s)

    def tokens_per_s(self) -> float:
        return self.cell.batch / self.median_tpot()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--intermediate", type=int, default=2816)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--batches", default="1,16")
    p.add_argument("--precisions", default=",".join(PRECISIONS))
    p.add_argument("--engines", default=",".join(ENGINES))
    p.add_argument("--offload", default="none", help="fastgen weight offload: none,cpu,nvme")
    p.add_argument("--offload-path", default=None, help="directory for --offload nvme")
    p.add_argument("--offload-prefetch", type=int, default=1)
    p.add_argument("--tp", default="1", help="fastgen tensor-parallel degrees, e.g. 1,2")
    p.add_argument("--int4-group-size", type=int, default=128)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="tiny model, 1 round (a smoke run)")
    p.add_argument("--json", default=None, help="also write the raw results here")
    args = p.parse_args(argv)
    if args.quick:
        args.hidden, args.intermediate, args.layers, args.vocab = 256, 512, 2, 1024
        args.rounds, args.new_tokens = 1, 6
    for name, allowed in (("precisions", PRECISIONS), ("engines", ENGINES), ("offload", OFFLOADS)):
        values = [v for v in getattr(args, name).split(",") if v]
        bad = sorted(set(values) - set(allowed))
        if bad:
            p.error(f"--{name} {bad} unknown; choose from {allowed}")
        setattr(args, name, values)
    try:
        args.batches = [int(b) for b in args.batches.split(",") if b]
        args.tp = sorted({int(t) for t in args.tp.split(",") if t})
    except ValueError as exc:
        p.error(f"--batches and --tp take comma-separated ints ({exc})")
    if not args.tp or min(args.tp) < 1:
        p.error(f"--tp {args.tp} must list ints >= 1, e.g. --tp 1,2")
    if "nvme" in args.offload and not args.offload_path:
        p.error("--offload nvme needs --offload-path DIR (an existing writable directory)")
    if args.new_tokens < 2:
        p.error("--new-tokens must be >= 2 (TPOT needs two lengths)")
    return args


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.TimeoutExpired):
        return platform.processor() or "unknown CPU"
    fields_ = dict(
        line.split(":", 1) for line in out.splitlines() if ":" in line
    )  # "Model name:   AMD EPYC" -> {"Model name": "   AMD EPYC"}
    name = fields_.get("Model name", "unknown").strip()
    cpus = fields_.get("CPU(s)", "?").strip()
    flags = fields_.get("Flags", "")
    extras = [f for f in ("avx512_bf16", "amx_bf16", "avx512_vnni", "avx2") if f in flags.split()]
    return f"{name}, {cpus} CPU(s), {' '.join(extras)}"


def build_llama(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, max_position_embeddings=512,
        tie_word_embeddings=False,
    )  # fmt: skip
    return LlamaForCausalLM(config).float().eval()


def quant_config(precision: str, args: argparse.Namespace) -> Any:
    from shardspeed.inference.quantization import WeightQuantConfig

    if precision == "int8":
        return WeightQuantConfig(bits=8)
    if precision == "int4":
        return WeightQuantConfig(bits=4, group_size=args.int4_group_size)
    return None


# ----------------------------------------------------------------------------- runners
# A runner prepares one (engine, precision, tp, offload) once and returns
# ``(generate(prompts, new_tokens) -> None, close() -> None)``; cells at every batch size
# share it and ``close`` releases it after the rounds (tensor-parallel workers).

Generate = Callable[[list[list[int]], int], None]
Prepared = tuple[Generate, Callable[[], None]]


def _nothing_to_close() -> None:
    return None


def hf_runner(base: torch.nn.Module, cell: Cell, args: argparse.Namespace) -> Prepared:
    from shardspeed.inference.quantization import quantize_model

    if cell.precision == "fp32":
        model = base
    elif cell.precision == "bf16":
        model = copy.deepcopy(base).to(torch.bfloat16)
    else:
        model = quantize_model(copy.deepcopy(base), quant_config(cell.precision, args))

    @torch.inference_mode()
    def generate(prompts: list[list[int]], new_tokens: int) -> None:
        ids = torch.tensor(prompts)  # (B, prompt_len): equal lengths, no padding
        model.generate(
            ids, attention_mask=torch.ones_like(ids), do_sample=False,
            max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0,
        )  # fmt: skip

    return generate, _nothing_to_close


def fastgen_runner(base: torch.nn.Module, cell: Cell, args: argparse.Namespace) -> Prepared:
    from shardspeed.inference.serving.pipeline import pipeline

    dtype = "bf16" if cell.precision == "bf16" else "fp32"
    max_batch = max(args.batches)
    offload = None
    if cell.offload != "none":
        offload = {"device": cell.offload, "prefetch": args.offload_prefetch}
        if cell.offload == "nvme":
            offload["path"] = args.offload_path
    pipe = pipeline(
        base, dtype=dtype, quantization=quant_config(cell.precision, args), block_size=16,
        offload=offload, tensor_parallel=cell.tp,
        num_blocks=max_batch * ((args.prompt_len + args.new_tokens) // 16 + 2),
        max_ragged_sequence_count=max_batch, max_ragged_batch_size=max_batch * args.prompt_len,
        max_seq_len=args.prompt_len + args.new_tokens + 1,
    )  # fmt: skip

    def generate(prompts: list[list[int]], new_tokens: int) -> None:
        pipe(prompts, max_new_tokens=new_tokens, ignore_eos=True)

    return generate, pipe.shutdown


def skip_reason(cell: Cell) -> str | None:
    """Why ``cell`` is not run (the engine refuses it), or None."""
    if cell.tp > 1 and cell.precision in ("int8", "int4"):
        return f"tensor_parallel={cell.tp} with {cell.precision} quantization is refused"
    if cell.tp > 1 and cell.offload != "none":
        return f"tensor_parallel={cell.tp} with offload={cell.offload} is refused"
    return None


RUNNERS: dict[str, Callable[[torch.nn.Module, Cell, argparse.Namespace], Prepared]] = {
    "hf": hf_runner,
    "fastgen": fastgen_runner,
}


# ----------------------------------------------------------------------------- measurement


def measure_tpot(generate: Generate, prompts: list[list[int]], new_tokens: int) -> float:
    t0 = time.perf_counter()
    generate(prompts, 1)
    t_one = time.perf_counter() - t0
    t0 = time.perf_counter()
    generate(prompts, new_tokens)
    t_all = time.perf_counter() - t0
    return max(t_all - t_one, 1e-9) / (new_tokens - 1)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    base = build_llama(args)
    num_params = sum(p.numel() for p in base.parameters())
    print(f"CPU: {cpu_model()}; torch {torch.__version__}, {torch.get_num_threads()} threads")
    print(
        f"model: Llama (random weights) hidden {args.hidden}, {args.layers} layers, "
        f"intermediate {args.intermediate}, heads {args.heads}/{args.kv_heads} kv, vocab "
        f"{args.vocab}: {num_params / 1e6:.0f}M params; prompt {args.prompt_len} tokens, "
        f"{args.new_tokens} new tokens; int4 group size {args.int4_group_size}",
        flush=True,
    )
    gen = torch.Generator().manual_seed(0)
    prompts = {
        b: torch.randint(3, args.vocab, (b, args.prompt_len), generator=gen).tolist()
        for b in args.batches
    }
    # (engine, precision, tp, offload) -> (generate, close)
    runners: dict[tuple[str, str, int, str], Prepared] = {}
    for engine in args.engines:
        offloads = args.offload if engine == "fastgen" else ["none"]
        tps = args.tp if engine == "fastgen" else [1]
        for precision in args.precisions:
            for tp in tps:
                for offload in offloads:
                    cell = Cell(engine, precision, 1, tp=tp, offload=offload)
                    why_not = skip_reason(cell)
                    if why_not is not None:
                        print(f"skipping {cell.label}: {why_not}", flush=True)
                        continue
                    t0 = time.perf_counter()
                    runners[(engine, precision, tp, offload)] = RUNNERS[engine](base, cell, args)
                    print(f"prepared {cell.label} in {time.perf_counter() - t0:.1f}s", flush=True)
    results = {
        (e, p, t, o, b): Result(Cell(e, p, b, tp=t, offload=o))
        for (e, p, t, o) in runners for b in args.batches
    }  # fmt: skip
    try:
        for generate, _ in runners.values():  # warm-up: first calls allocate and pick kernels
            generate(prompts[min(args.batches)], 2)
        for r in range(args.rounds):
            for (engine, precision, tp, offload, batch), result in results.items():
                generate, _ = runners[(engine, precision, tp, offload)]
                result.tpot_s.append(measure_tpot(generate, prompts[batch], args.new_tokens))
                print(
                    f"  round {r + 1} {result.cell.label} batch {batch}: "
                    f"TPOT {1e3 * result.tpot_s[-1]:.1f} ms",
                    flush=True,
                )
            print(f"round {r + 1}/{args.rounds} done", flush=True)
    finally:
        for _, close in runners.values():  # stop tensor-parallel workers now
            close()
    print_table(results, args)
    if args.json:
        rows = [
            {**asdict(res.cell), "tpot_s": res.tpot_s, "tokens_per_s": res.tokens_per_s()}
            for res in results.values()
        ]
        Path(args.json).write_text(json.dumps(rows, indent=2))


def print_table(
    results: dict[tuple[str, str, int, str, int], Result], args: argparse.Namespace
) -> None:
    print()
    print(
        f"Each rank (tp=T: this process + T-1 workers) uses --threads={args.threads} threads, "
        f"so a tp=T row uses T x {args.threads} cores; for a fair CPU comparison run "
        "--threads cores//T."
    )
    print(
        "| engine | precision | tp | offload | batch | TPOT ms (median) | decode tok/s | vs HF fp32 |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for (engine, precision, tp, offload, batch), res in results.items():
        base = results.get(("hf", "fp32", 1, "none", batch))
        ratio = f"{res.tokens_per_s() / base.tokens_per_s():.2f}x" if base else "-"
        spread = ", ".join(f"{1e3 * t:.0f}" for t in res.tpot_s)
        print(
            f"| {engine} | {precision} | {tp} | {offload} | {batch} | "
            f"{1e3 * res.median_tpot():.1f} ({spread}) | {res.tokens_per_s():.1f} | {ratio} |"
        )


if __name__ == "__main__":
    main()
