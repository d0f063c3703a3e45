"""LoRA cost: how much slower is a forward whose requests use adapters?

One random Llama (hidden 384, 4 layers, GQA 8/2, vocab 32000: the 31M model of issue 30),
fp32 on CPU, ``--threads`` threads. 32 requests with 64-token prompts; four PEFT adapters
of rank ``--rank`` on all seven projections (q/k/v/o/gate/up/down). Two batches are
timed with ``ModelRunner.execute`` (the forward alone, no sampling), ``--reps`` times each
with the modes interleaved, keeping each one's fastest run (contention on a shared
machine only ever slows a run):

* ``decode``: the 32 sequences' single-token decode step;
* ``prefill``: a 512-token prefill chunk (8 prompts of 64).

Modes: ``base`` (an engine without ``enable_lora``), ``lora-off`` (``enable_lora``, every
request on the base model: the cost of the hooks alone), ``lora-4x`` (the requests spread
over the four adapters), ``lora-mixed`` (half base, half over the adapters).

    python benchmarks/lora_bench.py --reps 30 --rank 16
"""

from __future__ import annotations

import argparse
import copy
import tempfile
import time

import torch

from shardspeed.inference.fastgen.config import EngineConfig
from shardspeed.inference.fastgen.engine import InferenceEngine
from shardspeed.inference.fastgen.sampling_params import SamplingParams

MODES = ("base", "lora-off", "lora-4x", "lora-mixed")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
NUM_SEQS, PROMPT_LEN = 32, 64


def _adapters(base, rank: int, root: str) -> list[str]:
    from peft import LoraConfig, get_peft_model

    paths = []
    for i in range(4):
        cfg = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS)
        model = get_peft_model(copy.deepcopy(base), cfg)
        model.save_pretrained(f"{root}/a{i}")
        paths.append(f"{root}/a{i}")
    return paths


def _names(mode: str) -> list[str | None]:
    if mode in ("base", "lora-off"):
        return [None] * NUM_SEQS
    if mode == "lora-4x":
        return [f"a{i % 4}" for i in range(NUM_SEQS)]
    return [None if i % 2 == 0 else f"a{(i // 2) % 4}" for i in range(NUM_SEQS)]


def _batches(base, mode: str, paths: list[str], rank: int, prompts: list[list[int]]):
    """(engine, a 512-token prefill batch, the 32-token decode batch) for ``mode``."""
    lora = mode != "base"
    cfg = EngineConfig(
        block_size=16, num_blocks=512, device="cpu", max_ragged_batch_size=512,
        max_ragged_sequence_count=NUM_SEQS, enable_lora=lora, max_loras=4, max_lora_rank=rank,
    )  # fmt: skip
    engine = InferenceEngine(base, config=cfg)
    for i, path in enumerate(paths if lora else []):
        engine.lora.load(f"a{i}", path)
    for prompt, name in zip(prompts, _names(mode)):
        params = SamplingParams(max_new_tokens=400, ignore_eos=True, lora_name=name)
        engine.add_request(prompt, params)
    prefill = engine.scheduler.schedule()  # 512 tokens: 8 prompts of 64
    engine.step()
    pending = engine.scheduler
    while any(r.num_computed_tokens < PROMPT_LEN for r in [*pending.running, *pending.waiting]):
        engine.step()
    engine.step()  # the first decode step
    decode = engine.scheduler.schedule()  # NUM_SEQS sequences of one token
    assert decode.num_tokens == NUM_SEQS, decode.num_tokens
    return engine, prefill, decode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=32000, hidden_size=384, intermediate_size=1024, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512,
    )  # fmt: skip
    base = LlamaForCausalLM(cfg).float().eval()
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, 32000, (PROMPT_LEN,), generator=gen).tolist() for _ in range(32)]
    with tempfile.TemporaryDirectory() as root:
        paths = _adapters(base, args.rank, root)
        runs = {mode: _batches(base, mode, paths, args.rank, prompts) for mode in MODES}
        best = {mode: [float("inf"), float("inf")] for mode in MODES}
        for _ in range(args.reps):
            for mode in MODES:
                engine, prefill, decode = runs[mode]
                for k, batch in enumerate((decode, prefill)):
                    start = time.perf_counter()
                    engine.runner.execute(batch)  # rewrites the same KV slots
                    best[mode][k] = min(best[mode][k], time.perf_counter() - start)
    print(f"rank {args.rank}, {args.reps} reps, {args.threads} threads: fastest forward")
    print("| mode | decode (32 tokens) | vs base | prefill (512 tokens) | vs base |")
    print("| --- | --- | --- | --- | --- |")
    for mode in MODES:
        d, p = best[mode]
        bd, bp = best["base"]
        print(f"| {mode} | {d * 1e3:.2f} ms | {d / bd:.3f}x | {p * 1e3:.2f} ms | {p / bp:.3f}x |")


if __name__ == "__main__":
    main()
