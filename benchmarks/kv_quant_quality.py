"""Quantized KV cache quality on the trained demo GPT (``runs/demo``, ``make demo``).

Perplexity of the held-out 5% of the demo corpus (the Python standard library's sources,
byte-level; the split of ``benchmarks/quant_quality.py``) scored *through the engine*:
each window of ``--window`` tokens is a prompt whose ``prompt_logprobs`` come from the
paged attention reading the KV cache, in fp32 / bf16 (``kv_cache_dtype="auto"``) and
int8 / fp8; plus the greedy continuation of a short prompt against fp32 KV (first
divergence) and the KV blocks each cache gets in the same bytes.

    python benchmarks/kv_quant_quality.py --eval-tokens 16384
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO_ROOT))

from shardspeed.data import load_stdlib_corpus  # noqa: E402
from shardspeed.inference.fastgen.engine import InferenceEngine  # noqa: E402
from shardspeed.inference.fastgen.sampling_params import SamplingParams  # noqa: E402
from shardspeed.models.gpt import GPT  # noqa: E402
from shardspeed.models.tokenizer import ByteTokenizer  # noqa: E402

ROWS = [("fp32", "auto", None), ("bf16", "auto", "bf16"), ("int8", "int8", None),
        ("fp8", "fp8", None), ("int8+bf16", "int8", "bf16")]  # fmt: skip


def perplexity(engine: InferenceEngine, windows: list[list[int]]) -> float:
    params = SamplingParams(max_new_tokens=1, prompt_logprobs=0)
    outs = engine.generate(windows, params)
    nll = [-lp.logprob for o in outs for lp in o.prompt_logprobs[1:]]
    return math.exp(sum(nll) / len(nll))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--checkpoint", default=str(REPO_ROOT / "runs" / "demo"))
    ap.add_argument("--eval-tokens", type=int, default=16384)
    ap.add_argument("--window", type=int, default=128)
    ap.add_argument("--budget", type=int, default=2**22, help="KV bytes for the block counts")
    args = ap.parse_args()
    torch.set_num_threads(2)
    model = GPT.from_pretrained(args.checkpoint).float().eval()
    tokens = load_stdlib_corpus().long()
    held = tokens[int(tokens.numel() * 0.95) :][: args.eval_tokens].tolist()
    w = min(args.window, model.config.block_size - 1)  # one position left to generate
    windows = [held[i : i + w] for i in range(0, len(held) - w + 1, w)]
    prompt = "def read_config(path):\n    with open(path) as f:\n"
    rows, ref_tokens = [], None
    for name, kv, dtype in ROWS:
        engine = InferenceEngine.from_pretrained(
            model, tokenizer=ByteTokenizer(), device="cpu", dtype=dtype, kv_cache_dtype=kv,
            kv_cache_memory=args.budget,
        )  # fmt: skip
        start = time.perf_counter()
        ppl = perplexity(engine, windows)
        greedy = engine.generate([prompt], SamplingParams(max_new_tokens=64))[0].output_token_ids
        ref_tokens = ref_tokens or greedy
        diverge = next((i for i, (a, b) in enumerate(zip(ref_tokens, greedy)) if a != b), None)
        rows.append({
            "kv": name, "ppl": round(ppl, 4), "blocks_in_budget": engine.block_pool.num_blocks,
            "greedy_first_divergence_vs_fp32": diverge, "seconds": round(time.perf_counter() - start, 1),
        })  # fmt: skip
        print(json.dumps(rows[-1]), flush=True)
    base = {r["kv"]: r["ppl"] for r in rows}
    for r in rows:
        r["ppl_vs_fp32"] = round(r["ppl"] / base["fp32"] - 1, 5)
        r["ppl_vs_bf16"] = round(r["ppl"] / base["bf16"] - 1, 5)
    print(json.dumps({"windows": len(windows), "window": w, "rows": rows,
                      "loadavg": open("/proc/loadavg").read().split()[:3]}, indent=1))  # fmt: skip


if __name__ == "__main__":
    main()
