"""A cleaned compressed checkpoint of a weight-bound Llama, served by ``pipeline()`` (issue 28).

One invocation:

1. builds a random Llama (``--size 200m``: hidden 1024, 12 layers, GQA 16/4, vocab 32000,
   192M parameters; seeded, no hub) as the teacher;
2. compresses it as a DeepSpeed compression client does, once per weight width
   (``--bits 8,4``): ``init_compression`` with ``layer_reduction`` (``--keep-layers``
   teacher layers, default every other one: half the depth; the student's layers start as
   those teacher layers through ``student_initialization``), symmetric weight quantization
   in forward of every attention / MLP linear (8 bits per row, 4 bits per row and
   ``--group-size`` columns: the int8 / int4 kernels' grouping, set by
   ``set_weight_group_size``) and, with ``--head-ratio`` < 1, top-k head pruning of whole
   key/value groups (``num_heads = num_key_value_heads``, q/k/v as related modules);
   ``--steps`` training steps of next-token loss on random tokens through
   ``shardspeed.initialize`` (the engine steps the compression scheduler);
   ``redundancy_clean``; ``save_pretrained`` (safetensors) to a temp folder;
3. checks the parameter counts the ratios predict, and that ``pipeline()`` on each cleaned
   checkpoint generates the cleaned model's own greedy tokens (HF ``generate``, fp32):
   unquantized fp32, and int8 / int4 weight-only layers with fp32 compute (the reference
   kernel). "The model it came from" is the cleaned model: ``redundancy_clean`` left its
   weights on the symmetric grid, which the inference quantizer recognises and stores as
   they are, so the int layers hold exactly the cleaned weights and fp32 compute must give
   the same tokens. The fast kernels (torch's weight-only int8 / int4, bf16 compute, bf16
   checkpoint load) are compared with the cleaned model served in bf16: their tokens and
   the largest difference between their stored weights and the cleaned ones are reported,
   not asserted (the bf16 load rounds int8 levels off their grid);
4. measures batch-1 decode tokens/s (``--prompt`` random prompt tokens, ``--new-tokens``
   generated) of: original fp32, original bf16, cleaned fp32 / bf16 (the 8-bit
   checkpoint), cleaned int8 (bf16 + int8 kernel), cleaned int4 (bf16 + int4 kernel), each
   in its own process with ``--threads`` threads after one warm-up call (the method of
   ``serve_vs_vllm.py``), ``--rounds`` rounds with the case order shuffled per round
   (seeded); median and every round. ``--reps N`` takes the best of N timed calls per
   process; ``--cpu-time`` tabulates tokens per CPU-second of the case's process instead
   of per wall second (for a shared box, with ``--threads 1``: other processes' turns on
   the core then do not count, while with 2 threads a descheduled OpenMP thread stalls the
   other at every barrier). ``--serve-only DIR`` times a ``--keep-dir DIR`` run's
   checkpoints again without compressing.

    .venv/bin/python benchmarks/compress_serve_bench.py --markdown           # 200M teacher
    .venv/bin/python benchmarks/compress_serve_bench.py --size tiny --group-size 32 --rounds 1

CPU cost (2 cores, 200m): compression ~1-2 min per width, checks ~1 min, decode 6 cases x
rounds x ~10-40 s.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
SIZES: dict[str, dict[str, int]] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                 num_attention_heads=8, num_key_value_heads=2, vocab_size=256),
    "200m": dict(hidden_size=1024, intermediate_size=2816, num_hidden_layers=12,
                 num_attention_heads=16, num_key_value_heads=4, vocab_size=32000),
}  # fmt: skip
CASES = ("orig-fp32", "orig-bf16", "clean-fp32", "clean-bf16", "clean-int8", "clean-int4")
LINEARS = r"layers\.\d+\.(self_attn|mlp)\."


# ---- models and compression ----------------------------------------------------------------
def llama_config(size: str, num_layers: int | None = None) -> Any:
    from transformers import LlamaConfig

    shape = dict(SIZES[size])
    if num_layers is not None:
        shape["num_hidden_layers"] = num_layers
    return LlamaConfig(
        **shape, max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=1,
        eos_token_id=2, pad_token_id=0, torch_dtype="float32",
    )  # fmt: skip


def build_teacher(size: str, seed: int) -> torch.nn.Module:
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(llama_config(size)).eval()


def compression_config(
    teacher_layers: list[int], bits: int, head_ratio: float, num_kv_heads: int, batch: int
) -> dict[str, Any]:
    """The ds_config: layer reduction, ``bits``-bit weights in forward from step 0 and, when
    ``head_ratio`` < 1, top-k pruning of whole key/value groups."""
    block: dict[str, Any] = {
        "layer_reduction": {
            "enabled": True,
            "keep_number_layer": len(teacher_layers),
            "module_name_prefix": "model.layers",
            "teacher_layer": teacher_layers,
            "other_module_name": ["model.embed_tokens", "model.norm", "lm_head"],
        },
        "weight_quantization": {
            "shared_parameters": {
                "enabled": True,
                "schedule_offset": 0,
                "quantize_weight_in_forward": True,
                "quantization_type": "symmetric",
            },
            "different_groups": {
                "wq": {"params": {"start_bits": bits, "target_bits": bits}, "modules": [LINEARS]}
            },
        },
    }
    if head_ratio < 1:
        block["head_pruning"] = {
            "shared_parameters": {
                "enabled": True, "schedule_offset": 0, "method": "topk",
                "num_heads": num_kv_heads,
            },
            "different_groups": {
                "hp": {
                    "params": {"dense_ratio": head_ratio},
                    "modules": [r"self_attn\.o_proj"],
                    "related_modules": [[r"self_attn\.q_proj", r"self_attn\.k_proj",
                                         r"self_attn\.v_proj"]],
                }
            },
        }  # fmt: skip
    return {
        "train_micro_batch_size_per_gpu": batch,
        "gradient_clipping": 1.0,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4}},
        "compression_training": block,
    }


def compress(
    teacher: torch.nn.Module,
    size: str,
    teacher_layers: list[int],
    bits: int,
    group_size: int | None,
    head_ratio: float,
    steps: int,
    seq: int = 32,
    batch: int = 2,
    seed: int = 0,
) -> tuple[torch.nn.Module, list[float]]:
    """Student of ``teacher_layers``, compressed and trained ``steps`` steps through the
    engine, then cleaned. Returns the cleaned model (eval) and the training losses."""
    from transformers import LlamaForCausalLM

    import shardspeed
    from shardspeed.compression import init_compression, redundancy_clean, set_weight_group_size

    kv = teacher.config.num_key_value_heads
    config = compression_config(teacher_layers, bits, head_ratio, kv, batch)
    torch.manual_seed(seed)
    student = LlamaForCausalLM(llama_config(size, len(teacher_layers)))
    student = init_compression(student, config, teacher_model=teacher)
    set_weight_group_size(student, group_size)
    engine, *_ = shardspeed.initialize(model=student, config=config)
    data = torch.Generator().manual_seed(seed + 1)
    vocab = teacher.config.vocab_size
    losses = []
    for _ in range(steps):
        tokens = torch.randint(3, vocab, (batch, seq), generator=data)
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    model = redundancy_clean(engine.module, config)
    engine.destroy()
    return model.eval(), losses


def predicted_params(size: str, keep: int, head_ratio: float) -> int:
    """Parameters of the cleaned student from the shape and the ratios alone."""
    s = SIZES[size]
    hidden, inter, vocab = s["hidden_size"], s["intermediate_size"], s["vocab_size"]
    head_dim = hidden // s["num_attention_heads"]
    kv = s["num_key_value_heads"]
    kept_kv = kv if head_ratio >= 1 else _topk_count(kv, head_ratio)
    heads = s["num_attention_heads"] * kept_kv // kv
    attention = hidden * head_dim * (2 * heads + 2 * kept_kv)  # q, o + k, v
    layer = attention + 3 * hidden * inter + 2 * hidden  # gate, up, down + 2 RMSNorms
    return 2 * vocab * hidden + hidden + keep * layer  # embeddings, lm_head, final norm


def _topk_count(n: int, ratio: float) -> int:
    from shardspeed.compression.quantizers import topk_mask_ste

    return int(topk_mask_ste(torch.arange(n, dtype=torch.float32).view(1, -1), ratio).sum())


# ---- serving checks (in process) -----------------------------------------------------------
def hf_greedy(model: torch.nn.Module, prompt: list[int], new: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new, do_sample=False
        )
    return out[0, len(prompt) :].tolist()


def _pipe(path: Path, dtype: str, quant: Any) -> Any:
    from shardspeed.inference.serving.pipeline import pipeline

    return pipeline(str(path), quantization=quant, dtype=dtype, block_size=16, num_blocks=64)


def _served(pipe: Any, prompt: list[int], new: int) -> list[int]:
    (resp,) = pipe([prompt], max_new_tokens=new, ignore_eos=True)
    return list(resp.token_ids)


def weight_diffs(pipe: Any, cleaned: torch.nn.Module) -> dict[str, float]:
    """Per kind of served quantized layer: the largest |stored - cleaned| over that layer's
    largest |cleaned weight| (0.0: the int layers hold exactly the cleaned weights)."""
    from shardspeed.inference.quantization import QuantizedLinear

    fused = {"qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
             "o_proj": ("self_attn.o_proj",), "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
             "mlp.down_proj": ("mlp.down_proj",)}  # fmt: skip
    worst: dict[str, float] = {}
    for name, layer in pipe.engine.model.named_modules():
        if not isinstance(layer, QuantizedLinear):
            continue
        prefix, _, leaf = name.partition(".")  # "layers", "0.qkv_proj"
        index, _, part = leaf.partition(".")
        parts = [f"model.{prefix}.{index}.{p}" for p in fused[part]]
        ref = torch.cat([cleaned.get_submodule(p).weight.detach() for p in parts])  # (out, in)
        diff = float((layer.dequantized_weight(torch.float32) - ref.float()).abs().max())
        worst[part] = max(worst.get(part, 0.0), diff / float(ref.abs().max()))
    assert worst, "no quantized layer served"
    return worst


def check_serving(
    path: Path, cleaned: torch.nn.Module, bits: int, group_size: int | None,
    prompt: list[int], new: int,
) -> dict[str, Any]:  # fmt: skip
    """Token checks of one cleaned checkpoint (see the module docstring)."""
    from shardspeed.inference.quantization import WeightQuantConfig

    ref = hf_greedy(cleaned, prompt, new)
    exact_q = WeightQuantConfig(bits=bits, group_size=group_size, kernel="reference")
    fast_q = WeightQuantConfig(bits=bits, group_size=group_size)
    fp32 = _served(_pipe(path, "fp32", None), prompt, new)
    int_pipe = _pipe(path, "fp32", exact_q)
    int_ref = _served(int_pipe, prompt, new)
    bf16 = _served(_pipe(path, "bf16", None), prompt, new)
    fast_pipe = _pipe(path, "bf16", fast_q)
    fast = _served(fast_pipe, prompt, new)
    return {
        "reference": ref,
        "fp32_equal": fp32 == ref,
        "int_fp32_compute_equal": int_ref == ref,
        "int_fp32_weight_diff": weight_diffs(int_pipe, cleaned),
        "fast_vs_bf16_matching": _common_prefix(fast, bf16),
        "bf16_vs_fp32_matching": _common_prefix(bf16, ref),
        "fast_weight_diff": weight_diffs(fast_pipe, cleaned),
        "new": new,
    }


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


# ---- decode timing (one process per case) --------------------------------------------------
def case_spec(case: str, paths: dict[str, Path], group_size: int) -> tuple[Path, str, Any]:
    quant = {"clean-int8": {"bits": 8}, "clean-int4": {"bits": 4, "group_size": group_size}}
    which = {"orig": "orig", "clean": "clean8"}[case.split("-")[0]]
    if case == "clean-int4":
        which = "clean4"
    dtype = "fp32" if case.endswith("fp32") else "bf16"
    return paths[which], dtype, quant.get(case)


def worker(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    pipe = _pipe(Path(args.path), args.dtype, json.loads(args.quant))
    prompt = json.loads(args.prompt_ids)
    _served(pipe, prompt, args.new_tokens)  # warm-up: same shape, not timed
    rates, cpu_rates = [], []
    for _ in range(args.reps):  # best of reps: a shared box's stalls only slow a rep down
        start, cpu_start = time.perf_counter(), time.process_time()
        got = _served(pipe, prompt, args.new_tokens)
        rates.append(len(got) / (time.perf_counter() - start))
        cpu_rates.append(len(got) / (time.process_time() - cpu_start))
    # tokens per CPU-second of this process: the cost of a token even when other processes
    # take turns on the cores (with 1 thread; more threads add their spin-waits to it)
    result = {"tok_s": max(rates), "cpu_tok_s": max(cpu_rates), "reps": rates, "tokens": got}
    Path(args.result).write_text(json.dumps(result))


def run_case(args: argparse.Namespace, case: str, paths: dict[str, Path], prompt: list[int]):
    path, dtype, quant = case_spec(case, paths, args.group_size)
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        result = Path(f.name)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, __file__, "--worker", "--path", str(path), "--dtype", dtype,
           "--quant", json.dumps(quant), "--prompt-ids", json.dumps(prompt),
           "--new-tokens", str(args.new_tokens), "--threads", str(args.threads),
           "--reps", str(args.reps),
           "--result", str(result)]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        raise RuntimeError(f"case {case} failed:\n{done.stderr[-3000:]}")
    out = json.loads(result.read_text())
    result.unlink()
    return out


# ---- driver --------------------------------------------------------------------------------
def build_checkpoints(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Teacher + one cleaned checkpoint per width, with the checks; returns the report."""
    teacher = build_teacher(args.size, args.seed)
    layers = _teacher_layers(args)
    paths = {"orig": out / "orig"}
    teacher.save_pretrained(paths["orig"], safe_serialization=True)
    prompt = random.Random(args.seed).sample(range(3, SIZES[args.size]["vocab_size"]), args.prompt)
    report: dict[str, Any] = {
        "teacher_params": sum(p.numel() for p in teacher.parameters()),
        "teacher_layers": layers, "prompt": prompt, "widths": {},
    }  # fmt: skip
    for bits in args.bits:
        group = None if bits == 8 else args.group_size
        t0 = time.perf_counter()
        cleaned, losses = compress(
            teacher, args.size, layers, bits, group, args.head_ratio, args.steps, args.seq,
            args.batch, args.seed,
        )  # fmt: skip
        seconds = time.perf_counter() - t0
        path = out / f"clean{bits}"
        cleaned.save_pretrained(path, safe_serialization=True)
        paths[f"clean{bits}"] = path
        params = sum(p.numel() for p in cleaned.parameters())
        predicted = predicted_params(args.size, len(layers), args.head_ratio)
        checks = check_serving(path, cleaned, bits, group, prompt, args.check_tokens)
        report["widths"][bits] = {
            "params": params, "predicted_params": predicted, "losses": losses,
            "compress_s": seconds, "group_size": group,
            "heads": [cleaned.config.num_attention_heads, cleaned.config.num_key_value_heads],
            **checks,
        }  # fmt: skip
        print(
            f"{bits}-bit: {params / 1e6:.2f}M params (predicted {predicted / 1e6:.2f}M), "
            f"heads {cleaned.config.num_attention_heads}/{cleaned.config.num_key_value_heads}, "
            f"compress {seconds:.0f} s, losses {[round(x, 3) for x in losses]}; "
            f"fp32 served = cleaned: {checks['fp32_equal']}; int{bits} fp32-compute = cleaned: "
            f"{checks['int_fp32_compute_equal']} (weight diff {_fmt(checks['int_fp32_weight_diff'])});"
            f" int{bits} bf16 kernel vs bf16: {checks['fast_vs_bf16_matching']}/"
            f"{args.check_tokens} tokens equal (weight diff {_fmt(checks['fast_weight_diff'])}); "
            "bf16 vs fp32: "
            f"{checks['bf16_vs_fp32_matching']}/{args.check_tokens}",
            flush=True,
        )
    report["paths"] = {k: str(v) for k, v in paths.items()}
    return report


def serve_only(args: argparse.Namespace) -> dict[str, Any]:
    """The report of a previous ``--keep-dir`` run's folder, for timing only."""
    from safetensors import safe_open

    def params(path: Path) -> int:
        total = 0
        for f in path.glob("*.safetensors"):
            with safe_open(str(f), "pt") as st:
                total += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys())
        return total

    root = Path(args.serve_only)
    paths = {p.name: p for p in root.iterdir() if p.name in ("orig", "clean8", "clean4")}
    prompt = random.Random(args.seed).sample(range(3, SIZES[args.size]["vocab_size"]), args.prompt)
    widths = {int(k[5:]): {"params": params(v)} for k, v in paths.items() if k != "orig"}
    return {"teacher_params": params(paths["orig"]), "prompt": prompt, "widths": widths,
            "paths": {k: str(v) for k, v in paths.items()}}  # fmt: skip


def _fmt(diffs: dict[str, float]) -> str:
    return ", ".join(f"{k} {v:.1e}" for k, v in diffs.items())


def _teacher_layers(args: argparse.Namespace) -> list[int]:
    if args.keep_layers:
        return [int(v) for v in args.keep_layers.split(",")]
    n = SIZES[args.size]["num_hidden_layers"]
    return list(range(1, n, 2))  # every other layer: half the depth


def time_cases(args: argparse.Namespace, report: dict[str, Any]) -> dict[str, list[float]]:
    paths = {k: Path(v) for k, v in report["paths"].items()}
    cases = [c for c in CASES if c != "clean-int4" or "clean4" in paths]
    if "clean8" not in paths:
        cases = [c for c in cases if not c.startswith("clean") or c == "clean-int4"]
    rng = random.Random(args.seed)
    results: dict[str, list[float]] = {c: [] for c in cases}
    for r in range(args.rounds):
        order = cases[:]
        rng.shuffle(order)
        for case in order:
            out = run_case(args, case, paths, report["prompt"])
            results[case].append(out["cpu_tok_s" if args.cpu_time else "tok_s"])
            print(
                f"round {r + 1}: {case}: {out['tok_s']:.1f} tok/s, "
                f"{out['cpu_tok_s']:.1f} tok per CPU-s",
                flush=True,
            )
    return results


def markdown(args: argparse.Namespace, report: dict[str, Any], timing: dict[str, list[float]]):
    widths = report["widths"]
    size = {"orig": report["teacher_params"]}
    for bits, w in widths.items():
        size[f"clean{bits}"] = w["params"]
    labels = {
        "orig-fp32": "original fp32", "orig-bf16": "original bf16 (packed)",
        "clean-fp32": "cleaned fp32", "clean-bf16": "cleaned bf16 (packed)",
        "clean-int8": "cleaned int8 weight-only", "clean-int4":
        f"cleaned int4 g{args.group_size} weight-only",
    }  # fmt: skip
    unit = "tokens per CPU-s" if args.cpu_time else "tok/s"
    base = statistics.median(timing["orig-fp32"]) if timing.get("orig-fp32") else None
    bf = statistics.median(timing["orig-bf16"]) if timing.get("orig-bf16") else None
    lines = [
        f"| model | params | batch-1 {unit} (rounds) | vs original fp32 | vs original bf16 |",
        "| --- | --- | --- | --- | --- |",
    ]
    for case, vals in timing.items():
        path, _, _ = case_spec(case, {k: Path(k) for k in size}, args.group_size)
        med = statistics.median(vals)
        cells = " / ".join(f"{v:.1f}" for v in vals)
        r32 = f"{med / base:.2f}x" if base else "-"
        r16 = f"{med / bf:.2f}x" if bf else "-"
        lines.append(
            f"| {labels[case]} | {size[str(path)] / 1e6:.1f}M | {med:.1f} ({cells}) | {r32} | {r16} |"
        )
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--size", choices=sorted(SIZES), default="200m")
    p.add_argument("--keep-layers", default="", help="teacher layers kept (default: odd ones)")
    p.add_argument("--bits", default="8,4", help="weight widths, one cleaned model each")
    p.add_argument("--group-size", type=int, default=128, help="int4 columns per scale")
    p.add_argument("--head-ratio", type=float, default=0.5, help="kv groups kept (1: no pruning)")
    p.add_argument("--steps", type=int, default=4, help="training steps through the engine")
    p.add_argument("--seq", type=int, default=32)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--prompt", type=int, default=16, help="prompt tokens")
    p.add_argument("--check-tokens", type=int, default=32, help="greedy tokens compared")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens per timed decode")
    p.add_argument("--rounds", type=int, default=2, help="decode rounds (0: no timing)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--reps", type=int, default=1, help="timed calls per case process (best)")
    p.add_argument(
        "--cpu-time", action="store_true",
        help="tabulate tokens per CPU-second of the case's process (a busy box; --threads 1)",
    )  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=int, default=1200)
    p.add_argument("--keep-dir", default="", help="write the checkpoints here (default: temp)")
    p.add_argument(
        "--serve-only", default="", help="time the checkpoints a --keep-dir run left there"
    )
    p.add_argument("--markdown", action="store_true", help="print the table as markdown")
    p.add_argument("--json", default="", help="write the report here")
    for hidden in ("--path", "--dtype", "--quant", "--prompt-ids", "--result"):
        p.add_argument(hidden, default="", help=argparse.SUPPRESS)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.bits = [int(b) for b in str(args.bits).split(",")]
    if any(b not in (4, 8) for b in args.bits):
        raise SystemExit(f"--bits {args.bits}: allowed 8 and 4 (the weight-only kernels)")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    args = parse_args(argv)
    if args.worker:
        worker(args)
        return None
    torch.set_num_threads(args.threads)
    tmp = tempfile.TemporaryDirectory()
    out = Path(args.keep_dir or tmp.name)
    report = serve_only(args) if args.serve_only else build_checkpoints(args, out)
    timing = time_cases(args, report) if args.rounds > 0 else {}
    report["timing"] = timing
    report["timing_unit"] = "tokens per CPU-second" if args.cpu_time else "tokens per second"
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from _bench_common import machine_description

    cpu = machine_description()
    load = Path("/proc/loadavg").read_text().split()[:3] if Path("/proc/loadavg").exists() else []
    print(
        f"\nCPU: {cpu}; threads {args.threads}; size {args.size}; "
        f"rounds {args.rounds}; load average {' '.join(load)}"
    )
    if timing:
        table = markdown(args, report, timing)
        print(table if args.markdown else table.replace("|", " "))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    tmp.cleanup()
    failed = failed_checks(report)
    if failed:
        raise SystemExit(f"checks failed: {failed}")
    return report


def failed_checks(report: dict[str, Any]) -> list[str]:
    """The asserted checks (parameter count, exact tokens) that did not hold."""
    failed = []
    for bits, w in report["widths"].items():
        if "predicted_params" not in w:
            continue  # --serve-only: nothing was checked
        if w["params"] != w["predicted_params"]:
            failed.append(f"{bits}-bit params {w['params']} != {w['predicted_params']}")
        if not w["fp32_equal"]:
            failed.append(f"{bits}-bit: pipeline fp32 tokens != cleaned model's")
        if not w["int_fp32_compute_equal"]:
            failed.append(f"{bits}-bit: int{bits} (fp32 compute) tokens != cleaned model's")
    return failed


if __name__ == "__main__":
    main()
