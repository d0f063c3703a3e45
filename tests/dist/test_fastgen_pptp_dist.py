"""FastGen pipeline x tensor parallelism (``pipeline_parallel=2, tensor_parallel=2``: two
stages of two tensor ranks, four processes): token-identical to one process, each rank
holds about a quarter of the layers, a dead rank ends every request with an error and
leaves no process behind, and impossible layouts are refused before any process starts.

The prompts, sampling parameters and helpers are the pipeline-parallel tests'
(``fastgen_pp_helpers.py``: chunked prompts under a small token budget, a prefix-cache
hit on blocks written by micro-batches still in flight, a seeded ``n=2`` request whose
second sample forks the first's KV blocks on every rank); int8 / int4 weights are
quantized by each tensor rank as ``tensor_parallel`` alone quantizes them. Every rank
runs one torch thread: four ranks with the caller's two threads each on a 2-core box
spin their thread pools against each other (about 20x slower).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from shardspeed.inference.fastgen.engine import InferenceEngine
from shardspeed.inference.fastgen.loader import build_model
from shardspeed.inference.fastgen.pipeline_parallel import PipelineParallelError
from shardspeed.inference.quantization import WeightQuantConfig
from tests.dist.fastgen_pp_helpers import (
    ENGINE,
    GREEDY,
    add_long_requests,
    assert_killed_rank_ends_every_request,
    assert_matches_one_process,
    gone,
    gpt2,
    hf_model,
    prompts,
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


def _assert_pptp_matches_one_process(source: Any, prompt_ids: list[list[int]], **engine: Any):
    pipe = assert_matches_one_process(source, prompt_ids, **PPTP, **engine)
    assert len(pipe.engine.stages.worker_pids) == 3
    return pipe


def test_llama_gqa_pp2_tp2_int8_is_token_identical_with_a_quarter_of_the_layers_and_a_dead_rank_ends_all(
    tmp_path, one_thread
) -> None:
    """int8 on layers 1 and 2 (one on each stage; 0 and 3 stay unquantized): each tensor
    rank's row-parallel slices carry the whole weight's per-channel scales, as
    ``tensor_parallel`` alone (scales of the local slices change the tokens here)."""
    model = hf_model("LlamaConfig", attention_bias=True)  # 4 heads, 2 KV heads: 1 per rank
    model.save_pretrained(tmp_path / "ckpt")
    int8 = WeightQuantConfig(
        bits=8, kernel="reference", compute_dtype="float32", modules=["layers.1.", "layers.2."]
    )
    pipe = _assert_pptp_matches_one_process(tmp_path / "ckpt", prompts(5), quantization=int8)
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
    add_long_requests(engine)
    engine.step()
    assert engine._in_flight  # the timers are read past the in-flight micro-batch's result
    assert len(engine.stage_times(reset=True)) == 2
    engine.step()
    assert_killed_rank_ends_every_request(
        engine, 2, "stage 1 tensor rank 1 \\(rank 3\\)", within_s=15, num_requests=3
    )
    pipe.shutdown()


@pytest.mark.parametrize(
    ("options", "match"),
    [
        (dict(pipeline_parallel=2, tensor_parallel=3), "tensor_parallel=3 cannot split .* heads"),
        (dict(pipeline_parallel=5, tensor_parallel=2), "pipeline_parallel=5 stages but .* 4 dec"),
        (dict(pipeline_parallel=2, tensor_parallel=2, quantization={"bits": 4, "group_size": 64}),
         "group_size=64 with tensor_parallel=2: layer .* holds 32 input columns"),
        (dict(pipeline_parallel=2, tensor_parallel=2, offload={"device": "cpu"}), "offload="),
    ],
)  # fmt: skip
def test_impossible_pp_tp_layouts_fail_before_any_rank_starts(options, match, monkeypatch) -> None:
    import torch.multiprocessing as mp

    def no_spawn(*args, **kwargs):
        raise AssertionError("a refused configuration must not start processes")

    monkeypatch.setattr(mp, "get_context", no_spawn)
    with pytest.raises(ValueError, match=match):
        InferenceEngine.from_pretrained(hf_model("LlamaConfig"), **options, **ENGINE)


@pytest.mark.slow  # ~15 s: another four-rank engine (tied head on the last stage, sliced)
def test_gpt2_tied_pp2_tp2_is_token_identical_and_shutdown_stops_every_rank(one_thread) -> None:
    pipe = _assert_pptp_matches_one_process(gpt2(), prompts(7))
    pids = pipe.engine.stages.worker_pids
    pipe.shutdown()
    assert all(gone(pid) for pid in pids)


@pytest.mark.slow  # ~15 s: another four-rank engine
def test_qwen2_one_kv_head_replicated_int4_pp2_tp2_is_token_identical_and_a_dead_stage0_rank_ends_it(
    one_thread,
) -> None:
    """One KV head replicated on both tensor ranks, int4 g32 weights (every rank's columns
    whole groups: 32 of ``o_proj``, 64 of ``down_proj``); then stage 0's other tensor rank
    dies (rank 0's own all-reduce partner)."""
    source = hf_model("Qwen2Config", num_key_value_heads=1, intermediate_size=128)
    int4 = WeightQuantConfig(bits=4, group_size=32, kernel="reference", compute_dtype="float32")
    pipe = _assert_pptp_matches_one_process(source, prompts(6), quantization=int4)
    engine = pipe.engine
    pids = engine.stages.worker_pids
    os.kill(pids[0], signal.SIGKILL)  # stage 0 tensor rank 1
    assert gone(pids[0])
    with pytest.raises(PipelineParallelError, match="stage 0 tensor rank 1 \\(rank 1\\)"):
        engine.generate([[3, 4, 5]], GREEDY)
    assert all(gone(pid) for pid in pids)
    pipe.shutdown()
