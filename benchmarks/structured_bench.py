"""Structured output cost: does a JSON-schema request slow the requests beside it?

One random Llama (hidden 384, 4 layers, GQA 8/2, the 31M model of issue 30) over a
byte-level BPE vocabulary trained here on the Python standard library's sources (no
hub), ``--vocab`` ids (32000 by default). Two batches of ``2 * --half`` requests, each
request generating exactly ``--tokens`` tokens (EOS ignored):

* ``plain``: every request unconstrained;
* ``mixed``: half of them constrained by a JSON schema (an array of at least 100 small
  objects, so no constrained request finishes before ``--tokens``);
* ``mixed_sync``: the same with the engine's mask prefetch off (every mask computed after
  the forward, on the engine thread), for comparison.

Both batches produce the same number of tokens in the same number of steps, so the ratio
of their tokens/s is the masking overhead that the unconstrained requests pay. Rounds
alternate plain / mixed; the median of the rounds is reported, with each round's number.
On a shared, loaded machine the tokens/s of single rounds swing widely, so the time the
engine thread spends in the mask step (waiting for the prefetched masks plus
``apply_guides``, timed in place) is also reported as a share of the mixed batch's wall
time, with its parts (``mask_split_share_of_wall_time``, see :func:`_time_mask_step`).

    python benchmarks/structured_bench.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import torch

SCHEMA = {
    "type": "array",
    "minItems": 100,
    "items": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 12},
            "age": {"type": "integer", "minimum": 0, "maximum": 150},
            "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
}


def train_tokenizer(vocab_size: int):
    """Byte-level BPE (GPT-2 style) trained on the standard library's .py files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    files = sorted(str(p) for p in Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train(files, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="</s>")


def build_engine(vocab: int, tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    from shardspeed.inference.fastgen.engine import InferenceEngine

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=vocab, hidden_size=384, intermediate_size=1024, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=1024,
    )  # fmt: skip
    model = LlamaForCausalLM(cfg).eval()
    return InferenceEngine.from_pretrained(model, tokenizer=tokenizer, device="cpu")


SECONDS = dict.fromkeys(("mask_step", "wait", "compute_now", "unpack", "worker_compute"), 0.0)


def _timed(module, name: str, key: str) -> None:
    """Accumulate the time of every call of ``module.name`` in ``SECONDS[key]``."""
    inner = getattr(module, name)

    def timed(*args):
        start = time.perf_counter()
        try:
            return inner(*args)
        finally:
            SECONDS[key] += time.perf_counter() - start

    setattr(module, name, timed)


def _time_mask_step(engine) -> None:
    """Time the engine's mask step in place: ``mask_step`` is what the engine thread spends
    in it after the forward: waiting for the prefetched masks (``wait``) plus
    ``apply_guides``, which includes ``compute_now`` (masks computed on the engine thread)
    and ``unpack`` (bits -> a float bias or bools; the rest is the fill).
    ``worker_compute`` is llguidance's time on the prefetch thread, overlapped with the
    forward."""
    import shardspeed.inference.fastgen.engine as engine_module
    import shardspeed.inference.fastgen.structured.masks as masks
    import shardspeed.inference.fastgen.structured.prefetch as prefetch

    _timed(masks, "compute_bitmask", "compute_now")
    _timed(masks, "mask_bias", "unpack")  # CPU float32 logits
    _timed(masks, "blocked_tokens", "unpack")  # other logits
    _timed(prefetch, "fill_bitmask", "worker_compute")
    _timed(engine_module, "apply_guides", "mask_step")
    _timed(engine.mask_prefetch, "take", "wait")


def run_batch(engine, prompts: list[str], constrained: list[bool], tokens: int) -> float:
    """Tokens per second of one batch run to completion."""
    from shardspeed.inference.fastgen.sampling_params import SamplingParams
    from shardspeed.inference.fastgen.structured import StructuredOutputParams

    params = []
    for i, guided in enumerate(constrained):
        sp = SamplingParams(max_new_tokens=tokens, temperature=1.0, seed=i, ignore_eos=True)
        if guided:
            sp.structured_output = StructuredOutputParams(json=SCHEMA)
        params.append(sp)
    start = time.perf_counter()
    outs = engine.generate(prompts, params)
    elapsed = time.perf_counter() - start
    produced = sum(len(o.output_token_ids) for o in outs)
    assert produced == tokens * len(prompts), "a request stopped early; the batches differ"
    return produced / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--half", type=int, default=16, help="requests of each kind")
    ap.add_argument("--tokens", type=int, default=64, help="tokens generated per request")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    tokenizer = train_tokenizer(args.vocab)
    vocab = len(tokenizer)
    print(f"tokenizer: {vocab} ids, trained in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    engine = build_engine(vocab, tokenizer)
    prompts = [f"Record {i}: list the people of town {i} as JSON." for i in range(2 * args.half)]
    plain = [False] * len(prompts)
    mixed = [i % 2 == 1 for i in range(len(prompts))]
    run_batch(engine, prompts[:4], [False, True, False, True], 8)  # warm-up (and compile)
    _time_mask_step(engine)
    rates: dict[str, list[float]] = {"plain": [], "mixed": [], "mixed_sync": []}
    mask_share = []
    split: dict[str, list[dict[str, float]]] = {"mixed": [], "mixed_sync": []}
    for _ in range(args.rounds):
        rates["plain"].append(run_batch(engine, prompts, plain, args.tokens))
        for kind in ("mixed", "mixed_sync"):  # masks prefetched during the forward, or not
            engine.mask_prefetch.enabled = kind == "mixed"
            SECONDS.update(dict.fromkeys(SECONDS, 0.0))
            start = time.perf_counter()
            rates[kind].append(run_batch(engine, prompts, mixed, args.tokens))
            wall = time.perf_counter() - start
            SECONDS["mask_step"] += SECONDS["wait"]
            if kind == "mixed":
                mask_share.append(SECONDS["mask_step"] / wall)
            split[kind].append({k: v / wall for k, v in SECONDS.items()})
    med = {k: statistics.median(v) for k, v in rates.items()}
    result = {
        "vocab": vocab,
        "requests": len(prompts),
        "tokens_per_request": args.tokens,
        "threads": args.threads,
        "rounds_tok_s": {k: [round(x, 1) for x in v] for k, v in rates.items()},
        "median_tok_s": {k: round(v, 1) for k, v in med.items()},
        "mixed_over_plain": round(med["mixed"] / med["plain"], 4),
        "mixed_sync_over_plain": round(med["mixed_sync"] / med["plain"], 4),
        "mask_share_of_mixed_wall_time": [round(x, 4) for x in mask_share],
        "mask_split_share_of_wall_time": {
            kind: {k: round(statistics.median(r[k] for r in rows), 4) for k in SECONDS}
            for kind, rows in split.items()
        },
        "loadavg": open("/proc/loadavg").read().split()[:3]
        if os.path.exists("/proc/loadavg")
        else None,
    }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
