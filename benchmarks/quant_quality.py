"""Weight-only quantization quality on a *trained* model (issue 17, item 2).

Trains the demo GPT (``examples/train_gpt.py``'s model and corpus: byte-level GPT on the
Python standard library's sources) wider and longer than ``make demo``, caches the
checkpoint, then measures on the held-out 5% of the corpus:

* perplexity of fp32 vs int8 (per-channel) vs int4 (group size 128 / 64 / 32), symmetric
  and asymmetric, through the default kernel path (bf16 compute on CPU) and the fp32
  dequantize reference path;
* teacher-forced top-1 agreement with fp32 (share of positions where the argmax token of
  the quantized model equals fp32's);
* bytes of the quantized layers (packed weights + scales + zero points) over their fp32
  bytes.

    python benchmarks/quant_quality.py                   # trains once (cached), then measures
    python benchmarks/quant_quality.py --train-only      # just the checkpoint
    python benchmarks/quant_quality.py --eval-tokens 65536 --json /tmp/q.json

Targets (issue 17 "Done when"): int8 ppl within 1% of fp32 and top-1 >= 95%; int4 g128
ppl within 5%; bytes 0.27x (int8) and 0.15x (int4) of fp32.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from shardspeed.data import load_stdlib_corpus  # noqa: E402
from shardspeed.models import GPT, GPTConfig  # noqa: E402

DEFAULT_CACHE = REPO_ROOT / "runs" / "quant_quality"  # runs/ is gitignored


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--embd", type=int, default=256, help="demo: 128 (must divide by 128 for g128)")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--block", type=int, default=128)
    p.add_argument("--steps", type=int, default=300, help="demo: 600 x 16 sequences")
    p.add_argument("--batch", type=int, default=4, help="sequences per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--max-train-seconds", type=float, default=2400.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--cache-dir", default=str(DEFAULT_CACHE))
    p.add_argument("--retrain", action="store_true", help="ignore a cached checkpoint")
    p.add_argument("--train-only", action="store_true")
    p.add_argument(
        "--checkpoint",
        default=None,
        help="measure this GPT.save_pretrained directory (e.g. runs/demo) instead of training",
    )
    p.add_argument("--eval-tokens", type=int, default=32768, help="held-out tokens scored")
    p.add_argument("--json", default=None, help="also write the results here")
    p.add_argument(
        "--variants",
        default=None,
        help="comma-separated subset of the variant names (e.g. 'int8 sym,int4 g128 asym')",
    )
    return p.parse_args(argv)


# ----------------------------------------------------------------------------- training


def checkpoint_path(args: argparse.Namespace) -> Path:
    name = f"gpt_l{args.layers}_e{args.embd}_h{args.heads}_b{args.block}_s{args.steps}"
    return Path(args.cache_dir) / f"{name}_bs{args.batch}_seed{args.seed}.pt"


def corpus_split(block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(train tokens, held-out tokens): the demo's 95% / 5% split of the stdlib corpus."""
    tokens = load_stdlib_corpus().long()
    split = int(tokens.numel() * 0.95)
    return tokens[:split], tokens[split:]


def train(args: argparse.Namespace, path: Path) -> GPT:
    torch.manual_seed(args.seed)
    config = GPTConfig(
        vocab_size=256, block_size=args.block, n_layer=args.layers, n_head=args.heads,
        n_embd=args.embd,
    )  # fmt: skip
    model = GPT(config)
    train_tokens, _ = corpus_split(args.block)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01, betas=(0.9, 0.95))
    warmup = max(args.steps // 20, 2)

    def lr_at(step: int) -> float:
        if step < warmup:
            return args.lr * (step + 1) / warmup
        progress = (step - warmup) / max(args.steps - warmup, 1)
        return args.lr * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))

    gen = torch.Generator().manual_seed(args.seed)
    t0 = time.perf_counter()
    model.train()
    for step in range(args.steps):
        starts = torch.randint(
            0, train_tokens.numel() - args.block - 1, (args.batch,), generator=gen
        )
        window = torch.stack([train_tokens[s : s + args.block + 1] for s in starts.tolist()])
        x, y = window[:, :-1], window[:, 1:]  # (B, T) each
        for group in opt.param_groups:
            group["lr"] = lr_at(step)
        _, loss = model(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        elapsed = time.perf_counter() - t0
        if step % 50 == 0 or step == args.steps - 1:
            print(f"step {step:5d}  loss {loss.item():.4f}  {elapsed:7.1f}s", flush=True)
        if elapsed > args.max_train_seconds:
            print(f"stopping at step {step}: --max-train-seconds {args.max_train_seconds} reached")
            break
    model.eval()
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"config": config.to_dict(), "state_dict": model.state_dict()}, path)
    print(f"saved {path} ({time.perf_counter() - t0:.0f}s of training)")
    return model


def load_or_train(args: argparse.Namespace) -> GPT:
    path = checkpoint_path(args)
    if path.is_file() and not args.retrain:
        blob = torch.load(path, map_location="cpu")
        model = GPT(GPTConfig(**blob["config"]))
        model.load_state_dict(blob["state_dict"])
        print(f"loaded cached checkpoint {path}")
        return model.eval()
    return train(args, path)


# ----------------------------------------------------------------------------- measurement


@torch.no_grad()
def score(model: GPT, tokens: torch.Tensor, block: int) -> tuple[float, torch.Tensor]:
    """(mean next-token NLL, argmax predictions) over non-overlapping windows of ``tokens``."""
    num_windows = (tokens.numel() - 1) // block
    x = tokens[: num_windows * block].view(num_windows, block)  # (W, T)
    y = tokens[1 : num_windows * block + 1].view(num_windows, block)  # (W, T)
    nll_sum, preds = 0.0, []
    for i in range(0, num_windows, 16):
        logits, _ = model(x[i : i + 16])  # (w, T, V)
        logits = logits.float()
        nll_sum += F.cross_entropy(
            logits.reshape(-1, logits.size(-1)), y[i : i + 16].reshape(-1), reduction="sum"
        ).item()
        preds.append(logits.argmax(-1))
    return nll_sum / y.numel(), torch.cat(preds)


def layer_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(bytes of the quantized layers now, bytes those layers' weights had in fp32)."""
    from shardspeed.inference.quantization import QuantizedLinear

    now = fp32 = 0
    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            now += module.weight_nbytes()
            fp32 += module.in_features * module.out_features * 4
    return now, fp32


def measure(args: argparse.Namespace, model: GPT) -> list[dict]:
    from shardspeed.inference.quantization import WeightQuantConfig, quantize_model

    _, held_out = corpus_split(args.block)
    held_out = held_out[: args.eval_tokens + 1]
    t0 = time.perf_counter()
    base_nll, base_pred = score(model, held_out, args.block)
    rows = [
        {
            "name": "fp32", "ppl": math.exp(base_nll), "ppl_delta_pct": 0.0, "top1": 1.0,
            "bytes_ratio": 1.0, "seconds": time.perf_counter() - t0,
        }
    ]  # fmt: skip
    variants = [
        ("int8 sym", dict(bits=8, symmetric=True)),
        ("int8 asym", dict(bits=8, symmetric=False)),
        ("int8 sym (ref fp32)", dict(bits=8, symmetric=True, kernel="reference")),
        ("int4 g128 sym", dict(bits=4, group_size=128, symmetric=True)),
        ("int4 g128 asym", dict(bits=4, group_size=128, symmetric=False)),
        ("int4 g128 asym (ref fp32)", dict(bits=4, group_size=128, symmetric=False, kernel="reference")),
        ("int4 g64 asym", dict(bits=4, group_size=64, symmetric=False)),
        ("int4 g32 asym", dict(bits=4, group_size=32, symmetric=False)),
        ("int4 g32 sym", dict(bits=4, group_size=32, symmetric=True)),
    ]  # fmt: skip
    if args.variants:
        wanted = {v.strip() for v in args.variants.split(",")}
        unknown = sorted(wanted - {name for name, _ in variants})
        if unknown:
            raise SystemExit(f"--variants {unknown} unknown; known: {[n for n, _ in variants]}")
        variants = [(name, kw) for name, kw in variants if name in wanted]
    for name, kwargs in variants:
        t0 = time.perf_counter()
        qmodel = quantize_model(copy.deepcopy(model), WeightQuantConfig(**kwargs))
        nll, pred = score(qmodel, held_out, args.block)
        now, fp32 = layer_bytes(qmodel)
        rows.append(
            {
                "name": name,
                "config": str(qmodel_config(qmodel)),
                "ppl": math.exp(nll),
                "ppl_delta_pct": 100 * (math.exp(nll) / math.exp(base_nll) - 1),
                "top1": (pred == base_pred).float().mean().item(),
                "bytes_ratio": now / fp32,
                "seconds": time.perf_counter() - t0,
            }
        )
        print_row(rows[-1])
    return rows


def qmodel_config(model: torch.nn.Module) -> str:
    from shardspeed.inference.quantization import QuantizedLinear

    for module in model.modules():
        if isinstance(module, QuantizedLinear):
            return module.extra_repr()
    return "-"


def print_row(r: dict) -> None:
    print(
        f"| {r['name']:<26} | {r['ppl']:8.4f} | {r['ppl_delta_pct']:+7.2f}% | "
        f"{100 * r['top1']:6.2f}% | {r['bytes_ratio']:.4f}x |",
        flush=True,
    )


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(max(torch.get_num_threads(), 1))
    if args.checkpoint:
        model = GPT.from_pretrained(args.checkpoint).float().eval()
        c = model.config
        args.layers, args.embd, args.block = c.n_layer, c.n_embd, c.block_size
        print(f"loaded {args.checkpoint}")
    else:
        model = load_or_train(args)
    if args.train_only:
        return
    print(
        f"model: GPT {args.layers} layers x {args.embd} wide, "
        f"{model.num_parameters() / 1e6:.2f}M params; held-out tokens: {args.eval_tokens}"
    )
    print("| variant | ppl | ppl vs fp32 | top-1 agree | quantized-layer bytes / fp32 |")
    print("|---|---|---|---|---|")
    rows = measure(args, model)
    print_row(rows[0])
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
