"""FastGen expert parallelism on CPU: MoE ep=2 vs one process on the same 2 cores.

One random Mixtral (8 experts, top-2) is saved once and served two ways:

* ``1 proc``: one process with ``--threads 2`` (and ``1 proc 1 thread``: with one);
* ``ep=2``: ``pipeline(expert_parallel=2)``, this process + 1 worker, 1 thread each,
  each rank holding 4 of the 8 experts of every layer (dense parts replicated), tokens
  moved by all-to-all (3 collectives per routed layer); ``ep=2 all_gather``: the same
  with ``expert_parallel_dispatch="all_gather"`` (1 collective per routed layer).

Rows: offline throughput (``--requests`` prompts of varied lengths and output lengths,
greedy, every request's generated tokens / wall time of ``generate``) and batch-1
latency (one 16-token prompt, ms per generated token after the first). Both
configurations must produce the same tokens (checked). ``--rounds`` interleaves them;
the median round is reported with every round's value, and the load average (the box
may be shared) before each round. Per-rank routed-expert bytes are printed too.

Usage:
    .venv/bin/python benchmarks/fastgen_ep_bench.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

CONFIGS = ("1 proc", "1 proc 1 thread", "ep=2", "ep=2 all_gather")
LAYOUTS = {  # config -> (expert_parallel, expert_parallel_dispatch)
    "1 proc": (1, "all_to_all"),
    "1 proc 1 thread": (1, "all_to_all"),
    "ep=2": (2, "all_to_all"),
    "ep=2 all_gather": (2, "all_gather"),
}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=768, help="each expert's width")
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=48, help="batch-1 row's generated tokens")
    p.add_argument("--threads", type=int, default=2, help="threads of the 1-process row")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path, default=None)
    return p.parse_args()


def save_model(args: argparse.Namespace, directory: Path) -> None:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.MixtralConfig(
        vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
        num_hidden_layers=args.layers, num_attention_heads=8, num_key_value_heads=4,
        num_local_experts=args.experts, num_experts_per_tok=args.top_k,
        max_position_embeddings=1024, eos_token_id=2, bos_token_id=1, initializer_range=0.05,
    )  # fmt: skip
    transformers.AutoModelForCausalLM.from_config(cfg).float().save_pretrained(directory)


def workload(args: argparse.Namespace) -> tuple[list[list[int]], list[Any]]:
    """``--requests`` prompts of 8..120 tokens, each generating 8..64 tokens (greedy)."""
    from shardspeed.inference.fastgen.sampling_params import SamplingParams

    g = torch.Generator().manual_seed(1)
    prompts, params = [], []
    for _ in range(args.requests):
        n = int(torch.randint(8, 121, (1,), generator=g))
        new = int(torch.randint(8, 65, (1,), generator=g))
        prompts.append(torch.randint(3, args.vocab, (n,), generator=g).tolist())
        params.append(SamplingParams(max_new_tokens=new, ignore_eos=True))
    return prompts, params


def offline(engine: Any, prompts: list[list[int]], params: list[Any]) -> tuple[float, list]:
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    wall = time.perf_counter() - start
    tokens = [o.output_token_ids for o in outs]
    return sum(len(t) for t in tokens) / wall, tokens


def batch1(engine: Any, args: argparse.Namespace) -> tuple[float, list[int]]:
    """ms per generated token after the first (one 16-token prompt)."""
    from shardspeed.inference.fastgen.sampling_params import SamplingParams

    prompt = torch.randint(3, args.vocab, (16,), generator=torch.Generator().manual_seed(2))
    engine.add_request(
        prompt.tolist(), SamplingParams(max_new_tokens=args.new_tokens, ignore_eos=True)
    )
    first, tokens = None, []
    while engine.has_unfinished():
        for out in engine.step():
            tokens = out.output_token_ids
        if first is None and tokens:
            first = time.perf_counter()
    assert first is not None
    return (time.perf_counter() - first) * 1e3 / (len(tokens) - 1), tokens


def main() -> None:
    args = parse_args()
    from shardspeed.inference.fastgen.engine import InferenceEngine
    from shardspeed.inference.fastgen.expert_parallel.attach import expert_parameter_bytes

    engine_kwargs = dict(device="cpu", max_ragged_batch_size=512, max_ragged_sequence_count=64,
                         num_blocks=2048, block_size=16)  # fmt: skip
    threads = {"1 proc": args.threads, "1 proc 1 thread": 1, "ep=2": 1, "ep=2 all_gather": 1}
    with tempfile.TemporaryDirectory() as tmp:
        save_model(args, Path(tmp))
        engines = {}
        for name in CONFIGS:
            torch.set_num_threads(threads[name])  # ep=2: the worker inherits 1 thread
            ep, dispatch = LAYOUTS[name]
            engines[name] = InferenceEngine.from_pretrained(
                tmp, expert_parallel=ep, expert_parallel_dispatch=dispatch, **engine_kwargs
            )
        whole = expert_parameter_bytes(engines["1 proc"].model)
        held = expert_parameter_bytes(engines["ep=2"].model)
        prompts, params = workload(args)
        results: dict[str, dict[str, list[float]]] = {n: {"tok_s": [], "ms": []} for n in CONFIGS}
        loads, tokens = [], {}
        for _ in range(args.rounds):
            loads.append(os.getloadavg()[0])
            for name in CONFIGS:
                torch.set_num_threads(threads[name])
                tok_s, offline_tokens = offline(engines[name], prompts, params)
                ms, b1_tokens = batch1(engines[name], args)
                results[name]["tok_s"].append(tok_s)
                results[name]["ms"].append(ms)
                tokens[name] = (offline_tokens, b1_tokens)
        for engine in engines.values():
            engine.shutdown()
    same = all(tokens[name] == tokens["1 proc"] for name in CONFIGS)
    n_params = sum(p.numel() for p in engines["1 proc"].model.parameters())
    print(f"Mixtral {n_params / 1e6:.1f}M params ({args.layers} layers, hidden {args.hidden}, "
          f"{args.experts} experts x {args.intermediate}, top-{args.top_k}); routed experts "
          f"{whole / 2**20:.1f} MiB on 1 proc, {held / 2**20:.1f} MiB on ep rank 0 "
          f"({held / whole:.2f}x); tokens identical: {same}")  # fmt: skip
    print(f"load average (1 min) before each round: {', '.join(f'{x:.2f}' for x in loads)}")
    print("| config | offline tok/s (median; rounds) | batch-1 ms/token (median; rounds) |")
    print("| --- | --- | --- |")
    for name in CONFIGS:
        r = results[name]
        rounds_tok = ", ".join(f"{x:.0f}" for x in r["tok_s"])
        rounds_ms = ", ".join(f"{x:.1f}" for x in r["ms"])
        print(f"| {name} | {statistics.median(r['tok_s']):.1f} ({rounds_tok}) | "
              f"{statistics.median(r['ms']):.1f} ({rounds_ms}) |")  # fmt: skip
    if args.json is not None:
        args.json.write_text(json.dumps({"results": results, "loads": loads, "same": same}))
    if not same:
        raise SystemExit("ep=2 tokens differ from one process")


if __name__ == "__main__":
    main()
