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
import time
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

VOCAB = 128
COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.1,
)  # fmt: skip
ENGINE = dict(block_size=4, num_blocks=256, max_ragged_batch_size=16, device="cpu")
GREEDY = SamplingParams(max_new_tokens=8, ignore_eos=True)


def _hf_model(config_cls: str, **overrides: Any) -> torch.nn.Module:
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


def _gpt2() -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=128, n_embd=64, n_layer=4, n_head=4, eos_token_id=2
    )
    return transformers.GPT2LMHeadModel(cfg).float().eval()


def _prompts(seed: int, lengths: tuple[int, ...] = (3, 29, 11, 17, 6, 9, 4)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]
    prompts.append(prompts[1][:20] + [7, 8, 9])  # shares 5 blocks of prompt 1 (prefix cache)
    return prompts


def _params(num_prompts: int) -> list[SamplingParams]:
    forked = SamplingParams(max_new_tokens=8, ignore_eos=True, n=2, temperature=0.8, seed=7)
    return [forked] + [GREEDY] * (num_prompts - 1)


def _generate(engine: InferenceEngine, prompts: list[list[int]]) -> list[list[int]]:
    return [o.output_token_ids for o in engine.generate(prompts, _params(len(prompts)))]


def _assert_pp_matches_one_process(source: Any, prompts: list[list[int]], pp: int, **engine: Any):
    kwargs = {**ENGINE, "enable_prefix_caching": True, **engine}
    want = _generate(InferenceEngine.from_pretrained(source, **kwargs), prompts)
    pipe = pipeline(source, pipeline_parallel=pp, **kwargs)
    assert isinstance(pipe.engine, PipelineInferenceEngine)
    got = _generate(pipe.engine, prompts)
    assert got == want
    assert pipe.engine.stats().prefix_cache_hit_blocks > 0
    return pipe


def _gone(pid: int | None, timeout: float = 10.0) -> bool:
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


def _layer_bytes(source: Any) -> int:
    model, _ = build_model(source, None, torch.device("cpu"))
    layers = model.layers if hasattr(model, "layers") else model.h
    return sum(p.numel() * p.element_size() for p in layers.parameters())


def _kill_stage_and_check_every_request_ends(engine: PipelineInferenceEngine) -> None:
    """Kill stage rank 1 with requests in flight: the engine raises naming it, ends every
    request with that error, stops the other stages and stays down."""
    for prompt in _prompts(8)[:3]:
        engine.add_request(prompt, SamplingParams(max_new_tokens=50, ignore_eos=True))
    engine.step()
    pids = engine.stages.worker_pids
    os.kill(pids[0], signal.SIGKILL)
    assert _gone(pids[0])
    start = time.monotonic()
    with pytest.raises(PipelineParallelError, match="failed; stage rank 1 exited"):
        while engine.has_unfinished():
            engine.step()
    assert time.monotonic() - start < 10
    assert all(_gone(pid) for pid in pids)  # no orphan: the other stages were stopped
    finals = engine.step()  # every request ended, each with the error
    assert len(finals) == 3 and {o.finish_reason for o in finals} == {"error"}
    for out in finals:
        error = engine.take_error(out.request_id)
        assert isinstance(error, RequestFailedError), error
        assert isinstance(error.__cause__, PipelineParallelError)
        assert "stage rank 1 exited with code -9" in str(error)
    with pytest.raises(PipelineParallelError, match="Create a new engine"):
        engine.generate([[3, 4, 5]], GREEDY)  # stays down, fails fast


def test_llama_gqa_pp2_is_token_identical_with_half_the_layers_and_a_dead_stage_ends_all(
    tmp_path,
) -> None:
    model = _hf_model("LlamaConfig", attention_bias=True)
    model.save_pretrained(tmp_path / "ckpt")
    pipe = _assert_pp_matches_one_process(tmp_path / "ckpt", _prompts(5), pp=2)
    engine = pipe.engine
    whole = _layer_bytes(tmp_path / "ckpt")
    per_rank = [layer for layer, _ in engine.stage_weight_bytes()]
    assert len(per_rank) == 2 and all(b <= 0.55 * whole for b in per_rank), (per_rank, whole)
    assert sum(per_rank) == whole
    responses = pipe([[5, 6, 7, 8]], max_new_tokens=4, ignore_eos=True)  # the Pipeline API
    assert len(responses[0].token_ids) == 4
    _kill_stage_and_check_every_request_ends(engine)
    pipe.shutdown()


@pytest.mark.slow  # ~10 s: a second spawned engine; the chained-stage unit test covers GPT-2
def test_gpt2_tied_pp2_naive_schedule_is_token_identical_and_shutdown_stops_the_stage() -> None:
    pipe = _assert_pp_matches_one_process(_gpt2(), _prompts(7), pp=2, pipeline_schedule="naive")
    assert pipe.engine.depth == 1
    pids = pipe.engine.stages.worker_pids
    pipe.shutdown()
    assert all(_gone(pid) for pid in pids)


@pytest.mark.slow  # ~10 s: another spawned engine; the chained-stage unit test covers Qwen2
def test_qwen2_one_kv_head_pp2_is_token_identical() -> None:
    pipe = _assert_pp_matches_one_process(_hf_model("Qwen2Config", num_key_value_heads=1),
                                          _prompts(6), pp=2)  # fmt: skip
    pipe.shutdown()


@pytest.mark.slow  # ~15 s: three stage workers
def test_llama_pp4_is_token_identical_and_a_dead_middle_stage_stops_the_others() -> None:
    pipe = _assert_pp_matches_one_process(_hf_model("LlamaConfig"), _prompts(9), pp=4)
    engine = pipe.engine
    long = SamplingParams(max_new_tokens=20, ignore_eos=True)
    ids = [engine.add_request(p, long) for p in _prompts(3)[:4]]
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
    assert _gone(pids[1])
    with pytest.raises(PipelineParallelError, match="stage rank 2"):
        engine.generate([[3, 4, 5]], GREEDY)
    assert all(_gone(pid) for pid in pids)  # no orphan: stages 1 and 3 were stopped
    pipe.shutdown()


@pytest.mark.slow  # ~10 s: another spawned engine
def test_sampling_features_prefill_first_and_int8_pp2_match_one_process() -> None:
    """Rows rank 0 samples (seeded temperature, penalties, logprobs, best_of) and rows the
    last stage samples, stop token ids, the prefill_first scheduler and int8 weights."""
    from shardspeed.inference.quantization import WeightQuantConfig

    quant = WeightQuantConfig(bits=8, kernel="reference", compute_dtype="float32")
    source = _hf_model("LlamaConfig")
    prompts = _prompts(10)
    params = [
        SamplingParams(max_new_tokens=8, temperature=0.7, seed=3, logprobs=2),
        SamplingParams(max_new_tokens=8, repetition_penalty=1.3, ignore_eos=True),
        SamplingParams(max_new_tokens=8, n=2, best_of=3, temperature=1.0, seed=5),
        SamplingParams(max_new_tokens=12, stop_token_ids=[int(prompts[3][0])]),
    ] + [GREEDY] * (len(prompts) - 4)
    kwargs = {**ENGINE, "scheduler": "prefill_first", "quantization": quant}

    def run(engine: InferenceEngine) -> list[tuple]:
        outs = engine.generate(prompts, params)
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
