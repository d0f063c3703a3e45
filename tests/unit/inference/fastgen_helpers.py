"""Helpers shared by the FastGen engine tests (imported by name: unique module)."""

from __future__ import annotations

import torch

from shardspeed.inference.fastgen.engine import EngineConfig, InferenceEngine
from shardspeed.inference.fastgen.outputs import RequestOutput
from shardspeed.inference.fastgen.sampling_params import SamplingParams

VOCAB = 128
MAX_NEW = 10


def make_prompts(n: int = 16, lo: int = 3, hi: int = 40, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(lo, hi + 1, (n,), generator=g).tolist()
    return [torch.randint(3, VOCAB, (length,), generator=g).tolist() for length in lengths]


def run_staggered(
    engine: InferenceEngine, prompts: list[list[int]], params: SamplingParams
) -> list[RequestOutput]:
    """Add prompts in three waves with steps in between; run to completion."""
    ids: list[str] = []
    finals: dict[str, RequestOutput] = {}

    def drain(steps: int | None) -> None:
        n = 0
        while engine.has_unfinished() and (steps is None or n < steps):
            for out in engine.step():
                if out.finished:
                    finals[out.request_id] = out
            n += 1

    third = len(prompts) // 3
    for wave, steps in (
        (prompts[:third], 3),
        (prompts[third : 2 * third], 2),
        (prompts[2 * third :], None),
    ):
        ids += [engine.add_request(p, params) for p in wave]
        drain(steps)
    return [finals[i] for i in ids]


def hf_greedy(model, prompts: list[list[int]], max_new: int) -> list[list[int]]:
    refs = []
    with torch.no_grad():
        for p in prompts:
            out = model.generate(
                torch.tensor([p]), do_sample=False, max_new_tokens=max_new, pad_token_id=0
            )
            refs.append(out[0, len(p) :].tolist())
    return refs


def engine_for(model, **kwargs) -> InferenceEngine:
    defaults = dict(
        block_size=4, num_blocks=256, max_ragged_batch_size=32, max_ragged_sequence_count=8
    )
    defaults.update(kwargs)
    return InferenceEngine(model, config=EngineConfig(**defaults))
