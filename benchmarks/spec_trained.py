"""Speculative decoding with a trained target and an independently trained 1/4-size draft.

Both models are Llamas trained here, single process, on the Python standard library's
sources (no hub download): a byte-level BPE (``--vocab`` ids) is trained on the training
files, every ``--holdout-every``-th file is held out for the evaluation loss and the
prompts. The target (hidden 768, 8 layers, GQA 12/4, ~62M parameters) decodes
weight-bound at batch 1 on a CPU; the draft (hidden 384, 6 layers, GQA 6/2) reads about a
quarter of the target's per-token weights (embedding rows excluded: one row is read per
token). ``--train ...,draft_distill`` also trains a draft of the same shape on the
target's logits (KL at T = 1) instead of the data's next tokens.

Measured through ``InferenceEngine.from_pretrained``: batch-1 greedy decode of
``--new-tokens`` after each of ``--prompts`` held-out file beginnings, target alone
against target + draft for each k in ``--ks`` and each draft decoding alone (its cost),
per dtype; rounds interleave the engines.
Printed per row: tokens/s (median round and best round), ratio, acceptance rate, tokens
per verify step (``engine.speculator.stats``) and how many sequences were identical to
the target alone's greedy output (asserted in fp32; bf16 near-ties may flip, see
docs/serving.md).

    nice -n 19 python benchmarks/spec_trained.py --out runs/spec30 --threads 1 --skip-measure
    nice -n 19 python benchmarks/spec_trained.py --out runs/spec30 --train draft_distill --skip-measure
    python benchmarks/spec_trained.py --out runs/spec30 --skip-train --measure-threads 1
    python benchmarks/spec_trained.py --out runs/spec30 --skip-train --measure-threads 1 \
        --dtypes bfloat16 --ks 3,4 --draft-quantization none,int8,int4   # quantized drafts

(``--measure-threads 2`` only on a quiet machine: with other jobs on 2 cores, two torch
threads made single rounds 10-20x slower.)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import sysconfig
import time
import zlib
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_common import machine_description  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="runs/spec_trained", help="model directories go here")
    p.add_argument("--skip-train", action="store_true", help="reuse the models under --out")
    p.add_argument("--skip-measure", action="store_true", help="train and save only")
    p.add_argument(
        "--train",
        default="target,draft",
        help="models to train: target, draft, draft_distill (a draft trained on "
        "the target's logits; the target is loaded from --out when not listed)",
    )
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--max-files", type=int, default=0, help="use the first N files (0: all)")
    p.add_argument("--holdout-every", type=int, default=12)
    # target / draft shapes: hidden, layers, heads, kv heads, intermediate
    p.add_argument("--target-shape", default="768,8,12,4,2048")
    p.add_argument("--draft-shape", default="384,6,6,2,1024")
    p.add_argument("--target-steps", type=int, default=170)
    p.add_argument("--draft-steps", type=int, default=220)
    p.add_argument("--target-lr", type=float, default=1.5e-3)
    p.add_argument("--draft-lr", type=float, default=2e-3)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--threads", type=int, default=1, help="torch threads for training")
    p.add_argument("--no-bf16", action="store_true", help="train in fp32 (no bf16 autocast)")
    p.add_argument("--eval-windows", type=int, default=24)
    p.add_argument("--measure-threads", type=int, default=1)
    p.add_argument("--dtypes", default="bfloat16,float32")
    p.add_argument("--ks", default="2,3,4,5")
    p.add_argument(
        "--draft-quantization",
        default="none",
        help="comma-separated speculative_config.quantization values for the draft "
        "(none, int8, int4, int4-g128, ...); each is a row per draft and k",
    )
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--json", default=None, help="write the report here")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- data
def corpus_files(max_files: int, holdout_every: int) -> tuple[list[Path], list[Path]]:
    """The standard library's top-level .py files, split into (train, held out)."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    files = files[:max_files] if max_files else files
    held = [f for i, f in enumerate(files) if i % holdout_every == holdout_every - 1]
    return [f for f in files if f not in held], held


def train_tokenizer(files: list[Path], vocab_size: int):
    """Byte-level BPE (GPT-2 style) trained on ``files`` only."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["</s>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )  # fmt: skip
    backend.train([str(f) for f in files], trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>")


def encode_files(tokenizer, files: list[Path]) -> list[list[int]]:
    texts = [f.read_text(encoding="utf-8", errors="replace") for f in files]
    return [ids + [tokenizer.eos_token_id] for ids in tokenizer(texts)["input_ids"]]


# ----------------------------------------------------------------------------- models
def llama(shape: str, vocab: int, max_positions: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, layers, heads, kv_heads, intermediate = (int(x) for x in shape.split(","))
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
        max_position_embeddings=max_positions, tie_word_embeddings=False,
    )  # fmt: skip
    return LlamaForCausalLM(cfg)


def per_token_weights(model: torch.nn.Module) -> int:
    """Parameters read per decoded token: all but the input embedding table."""
    embed = model.get_input_embeddings().weight.numel()
    return sum(p.numel() for p in model.parameters()) - embed


def lr_at(step: int, steps: int, peak: float) -> float:
    warmup = max(steps // 20, 1)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(steps - warmup, 1)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def train(model, tokens: torch.Tensor, steps: int, lr: float, args, name: str, teacher=None):
    """AdamW on random windows of ``tokens``; with ``teacher`` the loss is KL(teacher || model)."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)
    gen = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    model.train()
    losses, t_start = [], time.perf_counter()
    for step in range(steps):
        for group in opt.param_groups:
            group["lr"] = lr_at(step, steps, lr)
        starts = torch.randint(0, tokens.numel() - args.seq - 1, (args.batch,), generator=gen)
        window = torch.stack([tokens[s : s + args.seq + 1] for s in starts.tolist()])
        x, y = window[:, :-1], window[:, 1:]  # (B, T) each
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=not args.no_bf16):
            logits = model(input_ids=x).logits.float()  # (B, T, V)
            if teacher is not None:
                with torch.no_grad():
                    target = F.log_softmax(teacher(input_ids=x).logits.float(), -1)
        if teacher is None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), y.reshape(-1))
        else:
            loss = F.kl_div(F.log_softmax(logits, -1), target, log_target=True, reduction="none")
            loss = loss.sum(-1).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if step % 10 == 0 or step == steps - 1:
            elapsed = time.perf_counter() - t_start
            print(f"[{name}] step {step}/{steps} loss {losses[-1]:.3f} "
                  f"{elapsed:.0f}s load {os.getloadavg()[0]:.1f}", flush=True)  # fmt: skip
    model.eval()
    return {"steps": steps, "seconds": round(time.perf_counter() - t_start, 1),
            "first_loss": losses[0], "last10_loss": statistics.mean(losses[-10:])}  # fmt: skip


@torch.no_grad()
def heldout_loss(model, tokens: torch.Tensor, seq: int, windows: int) -> float:
    """Mean next-token cross-entropy (fp32) over the first ``windows`` windows of ``tokens``."""
    n = min(windows, (tokens.numel() - 1) // seq)
    x = tokens[: n * seq + 1]
    inputs, labels = x[:-1].view(n, seq), x[1:].view(n, seq)  # (n, seq) each
    total = 0.0
    for i in range(n):
        logits = model.float()(input_ids=inputs[i : i + 1]).logits[0]  # (seq, V)
        total += F.cross_entropy(logits, labels[i]).item()
    return total / n


def train_all(args, out: Path) -> dict:
    """Train the models named in ``--train``; a target not named is loaded from ``--out``."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    names = args.train.split(",")
    if unknown := set(names) - {"target", "draft", "draft_distill"}:
        raise ValueError(f"--train {args.train}: unknown {sorted(unknown)}; allowed: "
                         "target, draft, draft_distill")  # fmt: skip
    train_files, held_files = corpus_files(args.max_files, args.holdout_every)
    t0 = time.perf_counter()
    if "target" in names:
        tokenizer = train_tokenizer(train_files, args.vocab)
    else:  # reuse the trained target and its tokenizer
        tokenizer = AutoTokenizer.from_pretrained(out / "target")
    train_ids = torch.tensor([t for ids in encode_files(tokenizer, train_files) for t in ids])
    print(f"tokenizer + encode {time.perf_counter() - t0:.0f}s: {len(train_files)} train files "
          f"({train_ids.numel()} tokens), {len(held_files)} held out", flush=True)  # fmt: skip
    max_positions = max(args.seq, args.prompt_len + args.new_tokens + 16)
    report_path = out / "train_report.json"
    report = json.loads(report_path.read_text()) if report_path.exists() else {}
    target = None
    for name in names:
        torch.manual_seed(zlib.crc32(name.encode()))
        shape = args.target_shape if name == "target" else args.draft_shape
        model = llama(shape, args.vocab, max_positions)
        teacher = None
        if name == "draft_distill":
            teacher = target or LlamaForCausalLM.from_pretrained(out / "target").eval()
        steps = args.target_steps if name == "target" else args.draft_steps
        lr = args.target_lr if name == "target" else args.draft_lr
        report[name] = train(model, train_ids, steps, lr, args, name, teacher=teacher)
        report[name]["tokens_seen"] = steps * args.batch * args.seq
        model.save_pretrained(out / name)
        tokenizer.save_pretrained(out / name)
        report_path.write_text(json.dumps(report, indent=1))
        target = model if name == "target" else target
    return {"train": report}


# ----------------------------------------------------------------------------- measure
def eval_data(args, tokenizer) -> tuple[torch.Tensor, list[list[int]]]:
    """Held-out tokens (concatenated) and the prompts: held-out file beginnings."""
    _, held_files = corpus_files(args.max_files, args.holdout_every)
    held = encode_files(tokenizer, held_files)
    prompts = [ids[: args.prompt_len] for ids in held if len(ids) > args.prompt_len]
    if len(prompts) < args.prompts:
        raise ValueError(f"--prompts {args.prompts}: only {len(prompts)} held-out files have "
                         f"more than --prompt-len {args.prompt_len} tokens; lower either")  # fmt: skip
    return torch.tensor([t for ids in held for t in ids]), prompts[: args.prompts]


@torch.no_grad()
def rows_cost(model, rows: int, reps: int = 20) -> float:
    """Best-of-``reps`` seconds of a bf16 batch-1 forward over ``rows`` positions."""
    model = model.to(torch.bfloat16)
    x = torch.arange(3, 3 + rows)[None]  # (1, rows)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        model(input_ids=x)
        best = min(best, time.perf_counter() - t0)
    return best


def engine(target: Path, dtype: str, spec: dict | None, max_seq_len: int):
    from shardspeed.inference.fastgen.engine import InferenceEngine

    return InferenceEngine.from_pretrained(
        str(target), dtype=dtype, block_size=16, num_blocks=max_seq_len // 16 + 8,
        max_seq_len=max_seq_len, speculative_config=spec,
    )  # fmt: skip


def decode_all(eng, prompts: list[list[int]], new_tokens: int) -> tuple[float, list[list[int]]]:
    """Batch 1: each prompt alone; returns (tokens/s over all prompts, outputs)."""
    from shardspeed.inference.fastgen.sampling_params import SamplingParams

    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    outs, t0 = [], time.perf_counter()
    for prompt in prompts:
        outs.append(eng.generate([prompt], params)[0].output_token_ids)
    return new_tokens * len(prompts) / (time.perf_counter() - t0), outs


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def measure_dtype(args, out: Path, drafts: list[str], prompts, dtype: str) -> list[dict]:
    max_seq_len = args.prompt_len + args.new_tokens + 16
    quants = args.draft_quantization.split(",")
    variants = [(d, q) for d in drafts for q in quants]  # (draft, quantization)

    def label(d: str, q: str) -> str:
        return d if q == "none" else f"{d} {q}"

    spec_names = [f"{label(d, q)}:k={k}" for d, q in variants for k in args.k_list]
    # "<draft> alone": the draft decoding by itself, its cost relative to the target's
    names = ["target", *spec_names, *(f"{d} alone" for d in drafts)]
    engines = {"target": engine(out / "target", dtype, None, max_seq_len)}
    for d in drafts:
        engines[f"{d} alone"] = engine(out / d, dtype, None, max_seq_len)
    for d, q in variants:
        for k in args.k_list:
            spec = {"model": str(out / d), "num_speculative_tokens": k}
            if q != "none":
                spec["quantization"] = q
            engines[f"{label(d, q)}:k={k}"] = engine(out / "target", dtype, spec, max_seq_len)
    for eng in engines.values():  # warm-up
        decode_all(eng, prompts[:1], 8)
    start = {n: vars(e.speculator.stats).copy() for n, e in engines.items() if e.speculator}
    tok_s: dict[str, list[float]] = {n: [] for n in names}
    reference: list[list[int]] | None = None
    identical: dict[str, list[list[bool]]] = {n: [] for n in spec_names}
    first_diff: dict[str, list[int]] = {n: [] for n in spec_names}  # token index, prompt excluded
    for r in range(args.rounds):
        order = names if r % 2 == 0 else names[::-1]  # interleaved, alternating order
        outputs = {}
        for n in order:
            tps, outputs[n] = decode_all(engines[n], prompts, args.new_tokens)
            tok_s[n].append(tps)
        reference = reference or outputs["target"]
        for n in spec_names:
            identical[n].append([o == ref for o, ref in zip(outputs[n], reference)])
            prefix = [common_prefix(o, ref) for o, ref in zip(outputs[n], reference)]
            first_diff[n] += [i for i, o in zip(prefix, outputs[n]) if i < len(o)]
            if dtype == "float32":
                assert outputs[n] == reference, f"{n}: fp32 greedy output differs at {prefix}"
        print(f"  {dtype} round {r}: " + ", ".join(f"{n} {tok_s[n][-1]:.1f}" for n in names)
              + f" tok/s; load {os.getloadavg()}", flush=True)  # fmt: skip
    rows = []
    base_med, base_best = statistics.median(tok_s["target"]), max(tok_s["target"])
    for n in names:
        row = {"dtype": dtype, "engine": n, "tok_s": statistics.median(tok_s[n]),
               "best_tok_s": max(tok_s[n]), "rounds": [round(t, 2) for t in tok_s[n]]}  # fmt: skip
        if n in identical:
            row["identical"] = f"{sum(map(sum, identical[n]))}/{sum(map(len, identical[n]))}"
            row["first_diff"] = first_diff[n]
        row["speedup"] = row["tok_s"] / base_med
        row["speedup_best"] = row["best_tok_s"] / base_best
        if n in start:
            now, was = vars(engines[n].speculator.stats), start[n]
            d = {key: now[key] - was[key] for key in now}
            row["acceptance"] = d["num_accepted_tokens"] / max(d["num_draft_tokens"], 1)
            row["tokens_per_verify"] = d["num_emitted_tokens"] / max(d["num_verified"], 1)
        rows.append(row)
    return rows


def measure(args, out: Path) -> dict:
    from transformers import AutoTokenizer, LlamaForCausalLM

    torch.set_num_threads(args.measure_threads)
    tokenizer = AutoTokenizer.from_pretrained(out / "target")
    held_ids, prompts = eval_data(args, tokenizer)
    drafts = [d for d in ("draft", "draft_distill") if (out / d).exists()]
    report: dict = {"machine": machine_description(), "load_before": os.getloadavg(),
                    "models": {}, "rows": []}  # fmt: skip
    for name in ["target"] + drafts:
        model = LlamaForCausalLM.from_pretrained(out / name).eval()
        loss = heldout_loss(model, held_ids, args.seq, args.eval_windows)
        report["models"][name] = {
            "params": sum(p.numel() for p in model.parameters()),
            "per_token_weights": per_token_weights(model),
            "heldout_loss": round(loss, 4), "heldout_ppl": round(math.exp(loss), 2),
            "bf16_forward_ms": {r: round(1e3 * rows_cost(model, r), 2) for r in (1, 5)},
        }  # fmt: skip
    for name in drafts:
        ratio = (
            report["models"][name]["per_token_weights"]
            / report["models"]["target"]["per_token_weights"]
        )
        report["models"][name]["weight_ratio"] = round(ratio, 3)
    print(json.dumps(report, indent=1), flush=True)
    for dtype in args.dtypes.split(","):
        report["rows"].extend(measure_dtype(args, out, drafts, prompts, dtype))
    report["load_after"] = os.getloadavg()
    return report


def print_table(report: dict) -> None:
    print(f"\n{report['machine']}; load before {report['load_before']}, after "
          f"{report['load_after']}")  # fmt: skip
    print(
        "| dtype | engine | acceptance | tokens / verify | tok/s (rounds) | speedup "
        "(best rounds) | greedy identical |\n| --- | --- | --- | --- | --- | --- | --- |"
    )
    for r in report["rows"]:
        acc = f"{r['acceptance']:.2f}" if "acceptance" in r else "-"
        tpv = f"{r['tokens_per_verify']:.2f}" if "tokens_per_verify" in r else "-"
        print(f"| {r['dtype']} | {r['engine']} | {acc} | {tpv} | {r['tok_s']:.1f} "
              f"{r['rounds']} | {r['speedup']:.2f}x ({r['speedup_best']:.2f}x) | "
              f"{r.get('identical', '-')} |")  # fmt: skip


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    args.k_list = [int(k) for k in args.ks.split(",")]
    out = Path(args.out)
    report: dict = {}
    if not args.skip_train:
        torch.set_num_threads(args.threads)
        report.update(train_all(args, out))
    elif not (out / "target").exists():
        raise ValueError(f"--skip-train: no trained models under --out {out}; train first")
    if not args.skip_measure:
        report.update(measure(args, out))
        print_table(report)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
