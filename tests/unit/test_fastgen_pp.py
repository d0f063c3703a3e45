"""FastGen pipeline parallelism without processes: partition math, refusals before any
spawn, and every stage of a model chained in one process against the whole model.

The spawned-stage runs (token parity, rank death) are in tests/dist/test_fastgen_pp_dist.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from shardspeed.inference.fastgen.engine import InferenceEngine
from shardspeed.inference.fastgen.kv_cache import KVCache, KVCacheSpec
from shardspeed.inference.fastgen.loader import build_model
from shardspeed.inference.fastgen.pipeline_parallel import messages as msg
from shardspeed.inference.fastgen.pipeline_parallel.partition import (
    balance_layers,
    check_num_stages,
    stage_layouts,
)
from shardspeed.inference.fastgen.pipeline_parallel.stage_model import (
    build_stage_model,
    plan_stages,
)
from shardspeed.inference.fastgen.pipeline_parallel.worker import last_stage_result
from shardspeed.inference.fastgen.ragged import build_ragged_batch
from shardspeed.inference.fastgen.scheduler import ScheduledBatch, ScheduledSequence

VOCAB = 128
COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.1,
)  # fmt: skip
ENGINE = dict(block_size=4, num_blocks=64, max_ragged_batch_size=16, device="cpu")


def _hf(config_cls: str, **overrides: Any) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    cfg = getattr(transformers, config_cls)(**{**COMMON, **overrides})
    return transformers.AutoModelForCausalLM.from_config(cfg).float().eval()


def _gpt2(n_layer: int = 4) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        vocab_size=VOCAB, n_positions=128, n_embd=64, n_layer=n_layer, n_head=4, eos_token_id=2
    )
    return transformers.GPT2LMHeadModel(cfg).float().eval()


# ------------------------------------------------------------------ partition math
@pytest.mark.parametrize(
    ("params", "stages", "first", "last", "bounds"),
    [
        ([10] * 4, 2, 0, 0, [0, 2, 4]),
        ([10] * 4, 4, 0, 0, [0, 1, 2, 3, 4]),
        ([10] * 6, 2, 20, 0, [0, 2, 6]),  # big embeddings: fewer layers on stage 0
        ([10] * 6, 2, 0, 20, [0, 4, 6]),  # big head: fewer layers on the last stage
        ([5, 30, 5, 5, 5, 5], 3, 0, 0, [0, 1, 2, 6]),
    ],
)
def test_balance_layers_minimises_the_largest_stage(params, stages, first, last, bounds) -> None:
    got = balance_layers(params, stages, first, last)
    assert got == bounds
    costs = [sum(params[a:b]) for a, b in zip(got, got[1:])]
    costs[0] += first
    costs[-1] += last
    # brute force over every split: nothing beats the chosen maximum
    import itertools

    best = min(
        max(
            sum(params[a:b]) + (first if i == 0 else 0) + (last if i == stages - 1 else 0)
            for i, (a, b) in enumerate(zip((0, *cuts), (*cuts, len(params))))
        )
        for cuts in itertools.combinations(range(1, len(params)), stages - 1)
    )
    assert max(costs) == best


def test_stage_layouts_cover_every_layer_once() -> None:
    layouts = stage_layouts([0, 3, 5, 8])
    assert [list(s.layers) for s in layouts] == [[0, 1, 2], [3, 4], [5, 6, 7]]
    assert layouts[0].is_first and layouts[-1].is_last and not layouts[1].is_last


def test_more_stages_than_layers_is_refused_naming_the_numbers() -> None:
    with pytest.raises(ValueError, match="pipeline_parallel=5 stages .* has 4 decoder layers"):
        check_num_stages(5, 4, "llama")
    with pytest.raises(ValueError, match="pipeline_parallel=0 must be an int >= 1"):
        check_num_stages(0, 4)


def test_plan_counts_the_tied_head_on_the_last_stage() -> None:
    # GPT-2, 2 layers of ~50K params, wte 8K (tied head) + wpe 8K: a 1/1 split either way
    layouts = plan_stages(_gpt2(2), 2)
    assert [(s.first_layer, s.end_layer) for s in layouts] == [(0, 1), (1, 2)]
    with pytest.raises(ValueError, match="pipeline_parallel=3 stages .* 2 decoder layers"):
        plan_stages(_gpt2(2), 3)


# ----------------------------------------------------------- refusals (no spawn)
@pytest.mark.parametrize(
    ("options", "match"),
    [
        (dict(pipeline_parallel=5), "pipeline_parallel=5 stages but this llama model has 4"),
        (dict(pipeline_parallel=2, tensor_parallel=3), "tensor_parallel=3 cannot split"),
        (dict(pipeline_parallel=2, offload={"device": "cpu"}), "offload='cpu' with pipeline_par"),
        (dict(pipeline_parallel=2, compile_decode=True), "compile_decode=True with pipeline"),
        (dict(pipeline_parallel=2, scheduler="static"), "scheduler='static' with pipeline"),
        (dict(pipeline_parallel=2, pipeline_schedule="gpipe"), "pipeline_schedule='gpipe'"),
        (dict(pipeline_parallel=0), "pipeline_parallel=0 must be an int >= 1"),
    ],
)
def test_bad_pipeline_options_fail_before_any_stage_starts(options, match, monkeypatch) -> None:
    import torch.multiprocessing as mp

    def no_spawn(*args, **kwargs):
        raise AssertionError("a refused configuration must not start processes")

    monkeypatch.setattr(mp, "get_context", no_spawn)
    with pytest.raises(ValueError, match=match):
        InferenceEngine.from_pretrained(_hf("LlamaConfig"), **options, **ENGINE)


def test_unsupported_family_and_built_models_are_refused_by_name() -> None:
    import transformers

    opt = transformers.OPTForCausalLM(
        transformers.OPTConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            ffn_dim=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            word_embed_proj_dim=32,
        )  # fmt: skip
    )
    with pytest.raises(ValueError, match="OPTModel .* cannot be split into pipeline stages"):
        InferenceEngine.from_pretrained(opt, pipeline_parallel=2, **ENGINE)
    ragged, _ = build_model(_hf("LlamaConfig"), None, torch.device("cpu"))
    with pytest.raises(ValueError, match="already-built LlamaModel"):
        InferenceEngine.from_pretrained(ragged, pipeline_parallel=2, **ENGINE)
    from shardspeed.inference.fastgen.config import EngineConfig

    with pytest.raises(ValueError, match="needs the pipeline engine"):
        InferenceEngine(_hf("LlamaConfig"), config=EngineConfig(pipeline_parallel=2, **ENGINE))


# ------------------------------------------------- stages chained in one process
def _steps(prompt: list[int], next_token: int) -> list[ScheduledSequence]:
    """A whole-prompt prefill (logits of every token), then one decode token."""
    n = len(prompt)
    table = list(range(-(-(n + 1) // 4)))
    prefill = ScheduledSequence(None, prompt, 0, list(range(n)), table, True, all_logits=True)  # type: ignore[arg-type]
    decode = ScheduledSequence(None, [next_token], n, [n], table, True)  # type: ignore[arg-type]
    return [prefill, decode]


def _cache(model: Any, num_layers: int) -> KVCache:
    spec = KVCacheSpec(num_layers, model.num_kv_heads, model.head_dim, 4, torch.float32)
    return KVCache(spec, 16, torch.device("cpu"))


def _chained_logits(source: Any, num_stages: int, quant: Any = None) -> list[torch.Tensor]:
    cpu = torch.device("cpu")
    stages = [
        build_stage_model(source, s, None, cpu, quant) for s in plan_stages(source, num_stages)
    ]
    caches = [_cache(s.model, s.layout.num_layers) for s in stages]
    out = []
    for seq in _steps(list(range(3, 12)), 5):
        batch = build_ragged_batch(ScheduledBatch([seq]), 4, cpu, "torch")
        hidden = None
        for stage, cache in zip(stages, caches):
            hidden = stage.forward(batch, cache, hidden)
        out.append(hidden)
    return out


def _full_logits(source: Any, quant: Any = None) -> list[torch.Tensor]:
    cpu = torch.device("cpu")
    model, _ = build_model(source, None, cpu, quant)
    cache = _cache(model, model.num_layers)
    with torch.inference_mode():
        return [
            model(build_ragged_batch(ScheduledBatch([seq]), 4, cpu, "torch"), cache)
            for seq in _steps(list(range(3, 12)), 5)
        ]


FAMILIES = {
    "llama_gqa": lambda: _hf("LlamaConfig", attention_bias=True),
    "qwen2": lambda: _hf("Qwen2Config", num_key_value_heads=1),
    "gemma2": lambda: _hf("Gemma2Config", head_dim=16, final_logit_softcapping=2.0),
    "gpt2_tied": _gpt2,
}


@pytest.mark.parametrize(
    ("family", "num_stages"),
    [(f, 2) for f in sorted(FAMILIES)] + [("llama_gqa", 4), ("gpt2_tied", 4)],
)
def test_chained_stages_equal_the_whole_model(family: str, num_stages: int) -> None:
    source = FAMILIES[family]()
    for got, want in zip(_chained_logits(source, num_stages), _full_logits(source), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_int8_stages_equal_the_int8_whole_model() -> None:
    from shardspeed.inference.quantization import WeightQuantConfig

    quant = WeightQuantConfig(bits=8, kernel="reference", compute_dtype="float32")
    source = _hf("LlamaConfig")
    got, want = _chained_logits(source, 2, quant), _full_logits(source, quant)
    for g, w in zip(got, want, strict=True):
        torch.testing.assert_close(g, w, rtol=0, atol=0)


def test_each_stage_holds_only_its_layers_and_the_tied_head_once() -> None:
    source = _gpt2()
    cpu = torch.device("cpu")
    first, last = (build_stage_model(source, s, None, cpu) for s in plan_stages(source, 2))
    assert sorted(first.model.h.keys()) == ["0", "1"] and sorted(last.model.h.keys()) == ["2", "3"]
    assert first.model.lm_head is None and first.model.ln_f is None
    assert last.model.wpe is None and last.model.lm_head.weight is last.model.wte.weight
    whole, _ = build_model(source, None, cpu)
    layer_bytes = sum(p.numel() * p.element_size() for p in whole.h.parameters())
    for stage in (first, last):
        assert stage.layer_bytes() <= 0.55 * layer_bytes


def test_last_stage_returns_argmax_tokens_and_the_rows_rank0_samples() -> None:
    def seq(n: int, needs: bool, all_logits: bool = False) -> ScheduledSequence:
        return ScheduledSequence(None, [1] * n, 0, [0] * n, [0], needs, all_logits)  # type: ignore[arg-type]

    batch = ScheduledBatch([seq(3, True), seq(2, False), seq(2, True, True), seq(1, True)])
    modes = [msg.ARGMAX, msg.NO_ROWS, msg.LOGITS, msg.ARGMAX]
    logits = torch.randn(4, 10)  # rows: seq 0 (1), seq 2 (2), seq 3 (1)
    logits[0, 7] = float("nan")  # as one-process greedy: nan is never picked
    tokens, rows = last_stage_result(logits, batch, modes)
    want0 = torch.nan_to_num(logits[0], nan=float("-inf")).argmax().item()
    assert tokens == [want0, logits[3].argmax().item()]
    assert torch.equal(rows, logits[1:3])
