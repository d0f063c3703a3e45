"""Batch-1 decode tokens/s: HF ``generate`` vs the FastGen engine, eager and compiled.

A random-initialised Llama built from a config (default ~34M parameters: hidden
512, 8 layers, 8 heads, intermediate 768, vocab 32000, tied embeddings) decodes
``--new-tokens`` greedy tokens after a ``--prompt-len``-token prompt, EOS ignored,
in the same dtype everywhere. Decode rate = (tokens - 1) / (time of last token -
time of first token), so the prompt's prefill is excluded for all three.

The engines run in interleaved rounds (hf, eager, compiled, hf, ...) and the
ratios are taken per round, which cancels most of the drift of a shared machine.
The compiled engine's first call (the ``torch.compile``) is timed separately.

    python benchmarks/decode_bench.py --rounds 5 --out /tmp/decode_bench.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch


def build_model(args: argparse.Namespace) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    config = LlamaConfig(
        vocab_size=args.vocab,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads or args.heads,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    model = LlamaForCausalLM(config).to(getattr(torch, args.dtype)).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


class _Clock:
    """A ``generate`` streamer that timestamps each put (the first is the prompt)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_decode(model, prompt: list[int], new: int) -> tuple[float, list[int]]:
    clock = _Clock()
    with torch.inference_mode():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            use_cache=True,
            streamer=clock,
            pad_token_id=0,
        )
    steps = clock.times[1:]  # token times
    return (len(steps) - 1) / (steps[-1] - steps[0]), out[0, len(prompt) :].tolist()


def engine_decode(engine, prompt: list[int], new: int) -> tuple[float, list[int]]:
    from shardspeed.inference.fastgen.sampling_params import SamplingParams

    rid = engine.add_request(prompt, SamplingParams(max_new_tokens=new, ignore_eos=True))
    times: list[float] = []
    tokens: list[int] = []
    while engine.has_unfinished():
        for out in engine.step():
            if out.request_id == rid and out.new_token_ids:
                times.append(time.perf_counter())
                tokens = list(out.output_token_ids)
    return (len(times) - 1) / (times[-1] - times[0]), tokens


def make_engine(model, compiled: bool, args: argparse.Namespace):
    from shardspeed.inference.fastgen.engine import InferenceEngine

    return InferenceEngine.from_pretrained(
        model,
        block_size=16,
        num_blocks=64,
        max_seq_len=args.prompt_len + args.new_tokens + 16,
        max_ragged_sequence_count=8,
        dtype=getattr(torch, args.dtype),
        device="cpu",
        compile_decode=compiled,
    )


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None, help="JSON file for the raw numbers")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = build_model(args)
    params = sum(t.numel() for t in model.parameters())
    prompt = [3 + (7 * i) % (args.vocab - 3) for i in range(args.prompt_len)]

    eager = make_engine(model, False, args)
    compiled = make_engine(model, True, args)
    t0 = time.perf_counter()
    engine_decode(compiled, prompt, 4)  # first call: compile
    compile_s = time.perf_counter() - t0
    hf_decode(model, prompt, 4)
    engine_decode(eager, prompt, 4)

    rates: dict[str, list[float]] = {"hf": [], "eager": [], "compiled": []}
    outputs: dict[str, list[int]] = {}
    runners = {
        "hf": lambda: hf_decode(model, prompt, args.new_tokens),
        "eager": lambda: engine_decode(eager, prompt, args.new_tokens),
        "compiled": lambda: engine_decode(compiled, prompt, args.new_tokens),
    }
    for r in range(args.rounds):
        for name, run in runners.items():
            rate, toks = run()
            rates[name].append(rate)
            outputs[name] = toks
        print(
            f"round {r + 1}: " + ", ".join(f"{k} {v[-1]:.1f} tok/s" for k, v in rates.items()),
            flush=True,
        )
    same = outputs["hf"] == outputs["eager"] == outputs["compiled"]
    ratio = {
        f"{a}/{b}": [x / y for x, y in zip(rates[a], rates[b])]
        for a, b in (("compiled", "hf"), ("eager", "hf"), ("compiled", "eager"))
    }
    print(
        f"\nmodel: Llama {params / 1e6:.1f}M params, {args.dtype}, threads {torch.get_num_threads()}"
    )
    print(f"compiled first call (compile) {compile_s:.1f} s; tokens identical: {same}")
    print(f"{'engine':<9} {'median tok/s':>12} {'best tok/s':>10}")
    for k, v in rates.items():
        print(f"{k:<9} {statistics.median(v):12.1f} {max(v):10.1f}")
    print(f"{'ratio':<17} {'median':>7} {'min':>6} {'max':>6}")
    for k, v in ratio.items():
        print(f"{k:<17} {statistics.median(v):7.2f} {min(v):6.2f} {max(v):6.2f}")
    if args.out:
        meta = {
            "args": vars(args),
            "params": params,
            "torch": torch.__version__,
            "threads": torch.get_num_threads(),
            "cpu_count": os.cpu_count(),
            "platform": platform.platform(),
            "loadavg": os.getloadavg(),
        }
        with open(args.out, "w") as f:
            json.dump(
                {"meta": meta, "compile_s": compile_s, "rates": rates, "ratios": ratio,
                 "tokens_identical": same}, f, indent=1,
            )  # fmt: skip


if __name__ == "__main__":
    main()
