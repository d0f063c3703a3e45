"""Shared pieces of the spawned pipeline-parallel FastGen tests (``pp`` and ``pp x tp``).

Tiny random transformers models, prompts that chunk under a small token budget and hit
the prefix cache on blocks written by micro-batches still in flight, a seeded ``n=2``
request (its second sample forks the first's KV blocks on every rank), the
token-identity check against one process, and the rank-death check: a killed rank ends
every request with an error naming it and leaves no process behind.
"""

from __future__ import annotations

import os
import re
import signal
import time
from typing import Any

import pytest
import torch

from shardspeed.inference.fastgen.engine import InferenceEngine, RequestFailedError
from shardspeed.inference.fastgen.pipeline_parallel import (
    PipelineInferenceEngine,
    PipelineParallelError,
)
from shardspeed.inference.fastgen.sampling_params import SamplingParams
from shardspeed.inference.serving.pipeline import Pipeline, pipeline

VOCAB = 128
COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.1,
)  # fmt: skip
ENGINE = dict(block_size=4, num_blocks=256, max_ragged_batch_size=16, device="cpu")
GREEDY = SamplingParams(max_new_tokens=8, ignore_eos=True)


def hf_model(config_cls: str, **overrides: Any) -> torch.nn.Module:
    """A tiny random transformers model with its 1-D weights (norms, biases) perturbed."""
    import transformers

    torch.manual_seed(0)
    cfg = getattr(transformers, config_cls)(**{**COMMON, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return model.float().eval()


def gpt2() -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=128, n_embd=64, n_layer=4, n_head=4, eos_token_id=2
    )
    return transformers.GPT2LMHeadModel(cfg).float().eval()


def prompts(seed: int, lengths: tuple[int, ...] = (3, 29, 11, 17, 6, 9, 4)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    out = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]
    out.append(out[1][:20] + [7, 8, 9])  # shares 5 blocks of prompt 1 (prefix cache)
    return out


def sampling_params(num_prompts: int) -> list[SamplingParams]:
    forked = SamplingParams(max_new_tokens=8, ignore_eos=True, n=2, temperature=0.8, seed=7)
    return [forked] + [GREEDY] * (num_prompts - 1)


def generate(engine: InferenceEngine, prompt_ids: list[list[int]]) -> list[list[int]]:
    outs = engine.generate(prompt_ids, sampling_params(len(prompt_ids)))
    return [o.output_token_ids for o in outs]


def assert_matches_one_process(
    source: Any, prompt_ids: list[list[int]], **options: Any
) -> Pipeline:
    """``pipeline(source, **options)`` (with the test engine settings and prefix caching)
    generates what one process does and hits the prefix cache; returns the pipeline."""
    layout = {k: options.pop(k) for k in ("pipeline_parallel", "tensor_parallel") if k in options}
    kwargs = {**ENGINE, "enable_prefix_caching": True, **options}
    want = generate(InferenceEngine.from_pretrained(source, **kwargs), prompt_ids)
    pipe = pipeline(source, **layout, **kwargs)
    assert isinstance(pipe.engine, PipelineInferenceEngine)
    assert generate(pipe.engine, prompt_ids) == want
    assert pipe.engine.stats().prefix_cache_hit_blocks > 0
    return pipe


def add_long_requests(engine: InferenceEngine, count: int = 3) -> None:
    """``count`` requests long enough to still run when a rank is killed."""
    for prompt in prompts(8)[:count]:
        engine.add_request(prompt, SamplingParams(max_new_tokens=50, ignore_eos=True))


def gone(pid: int | None, timeout: float = 10.0) -> bool:
    """True once process ``pid`` has exited (a zombie not yet reaped counts as exited)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return True
        except FileNotFoundError:
            return True
        time.sleep(0.05)
    return False


def assert_killed_rank_ends_every_request(
    engine: PipelineInferenceEngine, worker: int, match: str, within_s: float, num_requests: int
) -> None:
    """SIGKILL ``engine.stages.worker_pids[worker]`` while ``num_requests`` requests run:
    stepping raises a :class:`PipelineParallelError` matching ``match`` within ``within_s``
    seconds, every other rank is stopped, every request ends with that error, and the
    engine stays down."""
    pids = engine.stages.worker_pids
    os.kill(pids[worker], signal.SIGKILL)
    assert gone(pids[worker])
    start = time.monotonic()
    with pytest.raises(PipelineParallelError, match=match):
        while engine.has_unfinished():
            engine.step()
    assert time.monotonic() - start < within_s
    assert all(gone(pid) for pid in pids)  # no orphan: the other ranks were stopped
    finals = engine.step()  # every request ended, each with the error
    assert len(finals) == num_requests and {o.finish_reason for o in finals} == {"error"}
    for out in finals:
        error = engine.take_error(out.request_id)
        assert isinstance(error, RequestFailedError), error
        assert isinstance(error.__cause__, PipelineParallelError)
        assert re.search(match, str(error)), error
    with pytest.raises(PipelineParallelError, match="Create a new engine"):
        engine.generate([[3, 4, 5]], GREEDY)  # stays down, fails fast
