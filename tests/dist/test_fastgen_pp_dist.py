"""FastGen pipeline parallelism with spawned stages: ``pipeline(model, pipeline_parallel=P)``
is token-identical to one process, holds about 1/P of the layers per rank, and a dead
stage ends every request with an error and leaves no process behind.

Each case runs several prompts of different lengths under a small token budget (prompts
are chunked and batched with decodes across micro-batches), a prompt sharing a prefix
(prefix-cache hits on blocks written by micro-batches still in flight) and a seeded
``n=2`` request (the second sample forks the first's KV blocks on every stage). Each
spawned engine costs a worker start (~2-6 s CPU, mostly ``import torch``).
"""

from __future__ import annotations

import os
import signal
from typing import Any

import pytest
import torch

from shardspeed.inference.fastgen.engine import InferenceEngine
from shardspeed.inference.fastgen.loader import build_model
from shardspeed.inference.fastgen.pipeline_parallel import PipelineParallelError
from shardspeed.inference.fastgen.sampling_params import SamplingParams
from shardspeed.inference.serving.pipeline import pipeline
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


def _layer_bytes(source: Any) -> int:
    model, _ = build_model(source, None, torch.device("cpu"))
    layers = model.layers if hasattr(model, "layers") else model.h
    return sum(p.numel() * p.element_size() for p in layers.parameters())


def test_llama_gqa_pp2_is_token_identical_with_half_the_layers_and_a_dead_stage_ends_all(
    tmp_path,
) -> None:
    model = hf_model("LlamaConfig", attention_bias=True)
    model.save_pretrained(tmp_path / "ckpt")
    pipe = assert_matches_one_process(tmp_path / "ckpt", prompts(5), pipeline_parallel=2)
    engine = pipe.engine
    whole = _layer_bytes(tmp_path / "ckpt")
    per_rank = [layer for layer, _ in engine.stage_weight_bytes()]
    assert len(per_rank) == 2 and all(b <= 0.55 * whole for b in per_rank), (per_rank, whole)
    assert sum(per_rank) == whole
    responses = pipe([[5, 6, 7, 8]], max_new_tokens=4, ignore_eos=True)  # the Pipeline API
    assert len(responses[0].token_ids) == 4
    # Kill stage rank 1 with requests in flight.
    add_long_requests(engine)
    engine.step()
    assert_killed_rank_ends_every_request(
        engine, 0, "stage rank 1 exited with code -9", within_s=10, num_requests=3
    )
    pipe.shutdown()


@pytest.mark.slow  # ~10 s: a second spawned engine; the chained-stage unit test covers GPT-2
def test_gpt2_tied_pp2_naive_schedule_is_token_identical_and_shutdown_stops_the_stage() -> None:
    pipe = assert_matches_one_process(
        gpt2(), prompts(7), pipeline_parallel=2, pipeline_schedule="naive"
    )
    assert pipe.engine.depth == 1
    pids = pipe.engine.stages.worker_pids
    pipe.shutdown()
    assert all(gone(pid) for pid in pids)


@pytest.mark.slow  # ~10 s: another spawned engine; the chained-stage unit test covers Qwen2
def test_qwen2_one_kv_head_pp2_is_token_identical() -> None:
    source = hf_model("Qwen2Config", num_key_value_heads=1)
    pipe = assert_matches_one_process(source, prompts(6), pipeline_parallel=2)
    pipe.shutdown()


@pytest.mark.slow  # ~15 s: three stage workers
def test_llama_pp4_is_token_identical_and_a_dead_middle_stage_stops_the_others() -> None:
    pipe = assert_matches_one_process(hf_model("LlamaConfig"), prompts(9), pipeline_parallel=4)
    engine = pipe.engine
    long = SamplingParams(max_new_tokens=20, ignore_eos=True)
    ids = [engine.add_request(p, long) for p in prompts(3)[:4]]
    engine.step()
    assert engine._in_flight  # timers read while the last stage's results are in flight
    assert len(engine.stage_times(reset=True)) == 4
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished():
        engine.step()
    pids = engine.stages.worker_pids
    assert len(pids) == 3
    os.kill(pids[1], signal.SIGKILL)  # stage 2 of 4
    assert gone(pids[1])
    with pytest.raises(PipelineParallelError, match="stage rank 2"):
        engine.generate([[3, 4, 5]], GREEDY)
    assert all(gone(pid) for pid in pids)  # no orphan: stages 1 and 3 were stopped
    pipe.shutdown()


@pytest.mark.slow  # ~10 s: another spawned engine
def test_sampling_features_prefill_first_and_int8_pp2_match_one_process() -> None:
    """Rows rank 0 samples (seeded temperature, penalties, logprobs, best_of) and rows the
    last stage samples, stop token ids, the prefill_first scheduler and int8 weights."""
    from shardspeed.inference.quantization import WeightQuantConfig

    quant = WeightQuantConfig(bits=8, kernel="reference", compute_dtype="float32")
    source = hf_model("LlamaConfig")
    prompt_ids = prompts(10)
    params = [
        SamplingParams(max_new_tokens=8, temperature=0.7, seed=3, logprobs=2),
        SamplingParams(max_new_tokens=8, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(max_new_tokens=8, n=2, best_of=3, temperature=1.0, seed=5),
        SamplingParams(max_new_tokens=12, stop_token_ids=[int(prompt_ids[3][0])]),
    ] + [GREEDY] * (len(prompt_ids) - 4)
    kwargs = {**ENGINE, "scheduler": "prefill_first", "quantization": quant}

    def run(engine: InferenceEngine) -> list[tuple]:
        outs = engine.generate(prompt_ids, params)
        return [(o.output_token_ids, o.finish_reason, o.cumulative_logprob) for o in outs]

    want = run(InferenceEngine.from_pretrained(source, **kwargs))
    pipe = pipeline(source, pipeline_parallel=2, **kwargs)
    got = run(pipe.engine)
    assert [g[:2] for g in got] == [w[:2] for w in want]
    for g, w in zip(got, want):
        assert (g[2] is None) == (w[2] is None)
        if w[2] is not None:
            assert abs(g[2] - w[2]) < 1e-4
    pipe.shutdown()


def test_structured_output_pp2_matches_one_process_with_masks_computed_in_flight(
    monkeypatch,
) -> None:
    """Guided rows are sampled on rank 0; their grammar masks are computed on a worker
    while their micro-batch is in the pipeline. Same tokens as one process, valid JSON."""
    import json

    import jsonschema

    from shardspeed.inference.fastgen.structured import MaskPrefetcher, StructuredOutputParams
    from shardspeed.models.tokenizer import ByteTokenizer

    taken = []
    take = MaskPrefetcher.take
    monkeypatch.setattr(MaskPrefetcher, "take", lambda self: taken.append(take(self)) or taken[-1])

    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 5},
            "n": {"type": "integer", "minimum": 0, "maximum": 99},
        },
        "required": ["name", "n"],
        "additionalProperties": False,
    }
    tokenizer = ByteTokenizer()
    source = hf_model("LlamaConfig", vocab_size=tokenizer.vocab_size)
    guided = [
        SamplingParams(max_new_tokens=80, temperature=1.0, seed=s,
                       structured_output=StructuredOutputParams(json=schema))
        for s in range(4)
    ]  # fmt: skip
    texts = ["json:", "object: ", "{", "a json", "plain", "more plain text"]
    params = guided + [GREEDY, GREEDY]
    one = InferenceEngine.from_pretrained(source, tokenizer=tokenizer, **ENGINE)
    want = [(o.output_token_ids, o.text) for o in one.generate(texts, params)]
    pipe = pipeline(source, tokenizer=tokenizer, pipeline_parallel=2, **ENGINE)
    engine = pipe.engine
    taken.clear()
    got = [(o.output_token_ids, o.text) for o in engine.generate(texts, params)]
    assert sum(m is not None for m in taken) > 10  # masks were ready when their rows came back
    assert got == want
    for _, text in got[:4]:  # each grammar completes well within 80 tokens
        jsonschema.validate(json.loads(text), schema)
    assert len(engine._free_masks) == engine.depth  # every prefetcher came back
    pipe.shutdown()
