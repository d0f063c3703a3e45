"""FastGen pipeline x tensor parallelism (``pipeline_parallel=2, tensor_parallel=2``: two
stages of two tensor ranks, four processes): token-identical to one process, each rank
holds about a quarter of the layers, a dead rank ends every request with an error and
leaves no process behind, and impossible layouts are refused before any process starts.

The prompts, sampling parameters and helpers are the pipeline-parallel tests'
(chunked prompts under a small token budget, a prefix-cache hit on blocks written by
micro-batches still in flight, a seeded ``n=2`` request whose second sample forks the
first's KV blocks on every rank). Every rank runs one torch thread: four ranks with the
caller's two threads each on a 2-core box spin their thread pools against each other
(about 20x slower).
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from shardspeed.inference.fastgen.engine import InferenceEngine, RequestFailedError
from shardspeed.inference.fastgen.loader import build_model
from shardspeed.inference.fastgen.pipeline_parallel import (
    PipelineInferenceEngine,
    PipelineParallelError,
)
from shardspeed.inference.fastgen.sampling_params import SamplingParams
from shardspeed.inference.serving.pipeline import pipeline
from tests.dist.test_fastgen_pp_dist import (
    ENGINE,
    GREEDY,
    _generate,
    _gone,
    _gpt2,
    _hf_model,
    _prompts,
)

PPTP = dict(pipeline_parallel=2, tensor_parallel=2)


@pytest.fixture
def one_thread() -> Iterator[None]:
    """One torch thread in this process and (copied at spawn) in every rank; restored after."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _assert_pptp_matches_one_process(source: Any, prompts: list[list[int]], **engine: Any):
    kwargs = {**ENGINE, "enable_prefix_caching": True, **engine}
    want = _generate(InferenceEngine.from_pretrained(source, **kwargs), prompts)
    pipe = pipeline(source, **PPTP, **kwargs)
    assert isinstance(pipe.engine, PipelineInferenceEngine)
    assert len(pipe.engine.stages.worker_pids) == 3
    got = _generate(pipe.engine, prompts)
    assert got == want
    assert pipe.engine.stats().prefix_cache_hit_blocks > 0
    return pipe


def test_llama_gqa_pp2_tp2_is_token_identical_with_a_quarter_of_the_layers_and_a_dead_rank_ends_all(
    tmp_path, one_thread
) -> None:
    model = _hf_model("LlamaConfig", attention_bias=True)  # 4 heads, 2 KV heads: 1 per rank
    model.save_pretrained(tmp_path / "ckpt")
    pipe = _assert_pptp_matches_one_process(tmp_path / "ckpt", _prompts(5))
    engine = pipe.engine
    assert "pipeline_parallel=2, tensor_parallel=2" in repr(engine)
    whole, _ = build_model(tmp_path / "ckpt", None, torch.device("cpu"))
    layer_bytes = sum(p.numel() * p.element_size() for p in whole.layers.parameters())
    per_rank = [layer for layer, _ in engine.stage_weight_bytes()]
    assert len(per_rank) == 4 and all(b <= 0.3 * layer_bytes for b in per_rank), per_rank
    times = engine.stage_times()  # one per stage (its tensor rank 0), measured
    assert len(times) == 2 and all(t.num_batches > 0 for t in times)

    # Kill the last stage's tensor rank 1: it sends rank 0 nothing, its death is seen
    # through its tensor peer's failed all-reduce or its exit.
    for prompt in _prompts(8)[:3]:
        engine.add_request(prompt, SamplingParams(max_new_tokens=50, ignore_eos=True))
    engine.step()
    assert engine._in_flight  # the timers are read past the in-flight micro-batch's result
    assert len(engine.stage_times(reset=True)) == 2
    engine.step()
    pids = engine.stages.worker_pids
    os.kill(pids[2], signal.SIGKILL)
    assert _gone(pids[2])
    start = time.monotonic()
    with pytest.raises(PipelineParallelError, match="stage 1 tensor rank 1 \\(rank 3\\)"):
        while engine.has_unfinished():
            engine.step()
    assert time.monotonic() - start < 15
    assert all(_gone(pid) for pid in pids)  # no orphan: the other ranks were stopped
    finals = engine.step()  # every request ended, each with the error
    assert len(finals) == 3 and {o.finish_reason for o in finals} == {"error"}
    for out in finals:
        error = engine.take_error(out.request_id)
        assert isinstance(error, RequestFailedError), error
        assert isinstance(error.__cause__, PipelineParallelError)
    with pytest.raises(PipelineParallelError, match="Create a new engine"):
        engine.generate([[3, 4, 5]], GREEDY)  # stays down, fails fast
    pipe.shutdown()


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (dict(pipeline_parallel=2, tensor_parallel=3), "tensor_parallel=3 cannot split .* heads"),
        (dict(pipeline_parallel=5, tensor_parallel=2), "pipeline_parallel=5 stages but .* 4 dec"),
        (dict(pipeline_parallel=2, tensor_parallel=2, quantization="int8"),
         "quantization=int8 with tensor_parallel=2 with pipeline_parallel=2"),
        (dict(pipeline_parallel=2, tensor_parallel=2, offload={"device": "cpu"}), "offload="),
    ],
)  # fmt: skip
def test_impossible_pp_tp_layouts_fail_before_any_rank_starts(options, match, monkeypatch) -> None:
    import torch.multiprocessing as mp

    def no_spawn(*args, **kwargs):
        raise AssertionError("a refused configuration must not start processes")

    monkeypatch.setattr(mp, "get_context", no_spawn)
    with pytest.raises(ValueError, match=match):
        InferenceEngine.from_pretrained(_hf_model("LlamaConfig"), **options, **ENGINE)


@pytest.mark.slow  # ~15 s: another four-rank engine (tied head on the last stage, sliced)
def test_gpt2_tied_pp2_tp2_is_token_identical_and_shutdown_stops_every_rank(one_thread) -> None:
    pipe = _assert_pptp_matches_one_process(_gpt2(), _prompts(7))
    pids = pipe.engine.stages.worker_pids
    pipe.shutdown()
    assert all(_gone(pid) for pid in pids)


@pytest.mark.slow  # ~15 s: another four-rank engine
def test_qwen2_one_kv_head_replicated_pp2_tp2_is_token_identical_and_a_dead_stage0_rank_ends_it(
    one_thread,
) -> None:
    """One KV head replicated on both tensor ranks; then stage 0's other tensor rank dies
    (rank 0's own all-reduce partner)."""
    source = _hf_model("Qwen2Config", num_key_value_heads=1)
    pipe = _assert_pptp_matches_one_process(source, _prompts(6))
    engine = pipe.engine
    pids = engine.stages.worker_pids
    os.kill(pids[0], signal.SIGKILL)  # stage 0 tensor rank 1
    assert _gone(pids[0])
    with pytest.raises(PipelineParallelError, match="stage 0 tensor rank 1 \\(rank 1\\)"):
        engine.generate([[3, 4, 5]], GREEDY)
    assert all(_gone(pid) for pid in pids)
    pipe.shutdown()
