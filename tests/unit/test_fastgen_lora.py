"""Multi-LoRA in the FastGen engine: each request's greedy tokens equal HF ``generate`` on
the PEFT model with that request's adapter merged (``merge_and_unload``), with four
adapters and the base model in one batch, on Llama, Qwen2 and GPT-2 (Conv1D layout)."""

from __future__ import annotations

import json

import pytest
import torch
from lora_helpers import hf_greedy, make_adapter, prompts, tiny_gpt2, tiny_llama

from shardspeed.inference.fastgen.config import EngineConfig
from shardspeed.inference.fastgen.engine import InferenceEngine
from shardspeed.inference.fastgen.lora import LoRANotFoundError
from shardspeed.inference.fastgen.sampling_params import SamplingParams

MAX_NEW = 8
LLAMA_ADAPTERS = [  # (target modules, extra LoraConfig fields)
    (["q_proj", "v_proj"], {}),
    (["q_proj", "v_proj", "down_proj"], {"use_rslora": True}),
    (["gate_proj", "up_proj", "o_proj"], {"r": 8, "lora_alpha": 4}),
    (["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"], {}),
]
GPT2_ADAPTERS = [
    (["c_attn"], {}),
    (["c_attn", "c_fc"], {"use_rslora": True}),
    (["c_proj"], {"r": 8, "lora_alpha": 4}),
    (["c_attn", "c_proj", "c_fc"], {}),
]


def _engine(model, **kwargs) -> InferenceEngine:
    cfg = dict(
        block_size=4, num_blocks=256, max_ragged_batch_size=256, max_ragged_sequence_count=8,
        enable_lora=True, max_loras=4, max_lora_rank=8,
    )  # fmt: skip
    cfg.update(kwargs)
    return InferenceEngine(model, config=EngineConfig(**cfg))


def _adapters(base, specs, tmp_path):
    """``[(name, path, merged HF model)]`` for ``specs``."""
    out = []
    for i, (targets, extra) in enumerate(specs):
        extra = dict(extra)
        rank = extra.pop("r", 4)
        path = tmp_path / f"adapter{i}"
        merged = make_adapter(base, path, targets, seed=10 + i, rank=rank, **extra)
        out.append((f"a{i}", path, merged))
    return out


@pytest.mark.parametrize("family", ["llama", pytest.param("qwen2", marks=pytest.mark.slow), "gpt2"])
def test_four_adapters_and_base_in_one_batch_match_peft_merged(family, tmp_path):
    base = tiny_gpt2() if family == "gpt2" else tiny_llama(family)
    adapters = _adapters(base, GPT2_ADAPTERS if family == "gpt2" else LLAMA_ADAPTERS, tmp_path)
    engine = _engine(base)
    for name, path, _ in adapters:
        engine.lora.load(name, str(path))
    # requests: base, a0..a3, a0 again; all in the first step's batch
    names = [None, "a0", "a1", "a2", "a3", "a0"]
    ps = prompts(len(names), seed=3)
    refs_by_model = {None: base, **{n: m for n, _, m in adapters}}
    want = [hf_greedy(refs_by_model[n], [p], MAX_NEW)[0] for n, p in zip(names, ps)]
    ids = [
        engine.add_request(p, SamplingParams(max_new_tokens=MAX_NEW, lora_name=n))
        for n, p in zip(names, ps)
    ]
    got: dict[str, list[int]] = {}
    engine.step()
    assert len(engine.scheduler.running) == len(names)  # one batch held them all
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                got[out.request_id] = out.output_token_ids
    assert [got[i] for i in ids] == want
    base_ref = hf_greedy(base, ps[1:5], MAX_NEW)
    assert sum(w != b for w, b in zip(want[1:5], base_ref)) >= 3  # the adapters matter


def test_prefix_cache_never_shares_blocks_across_adapters(tmp_path):
    base = tiny_llama()
    ((name, path, merged),) = _adapters(base, LLAMA_ADAPTERS[3:], tmp_path)
    engine = _engine(base, enable_prefix_caching=True)
    engine.lora.load(name, str(path))
    prompt = prompts(1, seed=5, lo=17, hi=18)[0]  # 4 full blocks
    greedy = SamplingParams(max_new_tokens=MAX_NEW)
    base_out = engine.generate([prompt], greedy)[0].output_token_ids
    lora_params = SamplingParams(max_new_tokens=MAX_NEW, lora_name=name)
    lora_out = engine.generate([prompt], lora_params)[0].output_token_ids
    assert base_out == hf_greedy(base, [prompt], MAX_NEW)[0]
    assert lora_out == hf_greedy(merged, [prompt], MAX_NEW)[0]
    assert engine.generate([prompt], lora_params)[0].output_token_ids == lora_out  # own hits


def test_unload_while_running_finishes_running_requests_and_refuses_new(tmp_path):
    base = tiny_llama()
    ((name, path, merged),) = _adapters(base, LLAMA_ADAPTERS[:1], tmp_path)
    engine = _engine(base)
    engine.lora.load(name, str(path))
    prompt = prompts(1, seed=6)[0]
    rid = engine.add_request(prompt, SamplingParams(max_new_tokens=12, lora_name=name))
    engine.step()
    engine.step()
    engine.lora.unload(name)
    assert engine.lora.names() == []
    with pytest.raises(LoRANotFoundError, match="'a0' is not loaded"):
        engine.add_request(prompt, SamplingParams(max_new_tokens=2, lora_name=name))
    outs = {}
    while engine.has_unfinished():
        outs.update((o.request_id, o) for o in engine.step() if o.finished)
    assert outs[rid].output_token_ids == hf_greedy(merged, [prompt], 12)[0]
    engine.lora.load(name, str(path))  # the name can be loaded again
    assert engine.generate([prompt], SamplingParams(max_new_tokens=3, lora_name=name))


def test_limits_and_refusals(tmp_path):
    base = tiny_llama()
    specs = [(["q_proj"], {}), (["v_proj"], {"r": 8}), (["q_proj"], {})]
    (n0, p0, _), (n1, p1, _), (n2, p2, _) = _adapters(base, specs, tmp_path)
    engine = _engine(base, max_loras=1, max_lora_rank=4)
    with pytest.raises(ValueError, match="not a directory"):
        engine.lora.load("x", str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="rank 8 .* max_lora_rank=4"):
        engine.lora.load(n1, str(p1))
    engine.lora.load(n0, str(p0))
    with pytest.raises(ValueError, match="already loaded"):
        engine.lora.load(n0, str(p2))
    with pytest.raises(ValueError, match="max_loras=1"):
        engine.lora.load(n2, str(p2))
    with pytest.raises(
        LoRANotFoundError, match="'nope' is not loaded; loaded adapters: \\['a0'\\]"
    ):
        engine.add_request([5, 6], SamplingParams(lora_name="nope"))
    with pytest.raises(LoRANotFoundError, match="'nope'"):
        engine.lora.unload("nope")
    weights = p2 / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:40])  # truncated on disk
    engine.lora.unload(n0)
    with pytest.raises(ValueError, match="cannot read it as a safetensors file"):
        engine.lora.load(n2, str(p2))
    plain = InferenceEngine(base, config=EngineConfig(block_size=4, num_blocks=64))
    with pytest.raises(ValueError, match="started without LoRA"):
        plain.add_request([5, 6], SamplingParams(lora_name=n0))


@pytest.mark.parametrize(
    "key, value, match",
    [
        ("modules_to_save", ["lm_head"], "modules_to_save=\\['lm_head'\\]"),
        ("use_dora", True, "use_dora=True"),
        ("bias", "all", "bias='all'"),
        ("peft_type", "IA3", "peft_type='IA3'"),
    ],
)
def test_adapter_config_refusals(tmp_path, key, value, match):
    base = tiny_llama()
    ((name, path, _),) = _adapters(base, [(["q_proj"], {})], tmp_path)
    config_path = path / "adapter_config.json"
    config = json.loads(config_path.read_text())
    config[key] = value
    config_path.write_text(json.dumps(config))
    engine = _engine(base)
    with pytest.raises(ValueError, match=match):
        engine.lora.load(name, str(path))


def test_untargetable_module_is_refused_by_name(tmp_path):
    from safetensors.torch import load_file, save_file

    base = tiny_llama()
    ((name, path, _),) = _adapters(base, [(["q_proj"], {})], tmp_path)
    weights = path / "adapter_model.safetensors"
    tensors = {  # the same A/B pairs, named as if they targeted the LM head
        k.replace("model.layers.0.self_attn.q_proj", "lm_head"): v
        for k, v in load_file(str(weights)).items()
    }
    save_file(tensors, str(weights))
    with pytest.raises(ValueError, match="'lm_head' cannot be placed"):
        _engine(base).lora.load(name, str(path))


@pytest.mark.parametrize(
    "field, value", [("compile_decode", True), ("tensor_parallel", 2), ("max_loras", 0)]
)
def test_engine_config_refusals(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(enable_lora=True, **{field: value}).validate()


def test_grouped_delta_matches_per_token_reference():
    """The segmented apply equals a per-token loop, tokens of 3 adapters interleaved."""
    from types import SimpleNamespace

    from shardspeed.inference.fastgen.lora.apply import LoRAHooks
    from shardspeed.inference.fastgen.lora.placement import LoRAWeights

    torch.manual_seed(0)
    lin = torch.nn.Linear(8, 6)
    model = torch.nn.Module()
    model.proj = lin
    adapters = [
        SimpleNamespace(weights={"proj": LoRAWeights(torch.randn(2, 8), torch.randn(6, 2))}),
        SimpleNamespace(weights={"proj": LoRAWeights(torch.randn(3, 8), torch.randn(6, 3))}),
        None,
    ]
    owners = [0, 2, 1, 0, 1, 2, 0]
    seqs = [
        SimpleNamespace(request=SimpleNamespace(lora=adapters[o]), num_tokens=1) for o in owners
    ]
    batch = SimpleNamespace(sequences=seqs, num_tokens=len(owners))
    hooks = LoRAHooks(model, torch.device("cpu"))
    x = torch.randn(len(owners), 8)
    with hooks.scope(batch):
        got = lin(x)
    want = lin(x).clone()
    for t, o in enumerate(owners):
        if adapters[o] is not None:
            w = adapters[o].weights["proj"]
            want[t] += w.b @ (w.a @ x[t])
    torch.testing.assert_close(got, want)


def test_rank_and_alpha_patterns_match_peft(tmp_path):
    base = tiny_llama()
    spec = (
        ["q_proj", "v_proj", "down_proj"],
        {"r": 4, "rank_pattern": {"down_proj": 8}, "alpha_pattern": {"v_proj": 2}},
    )
    ((name, path, merged),) = _adapters(base, [spec], tmp_path)
    engine = _engine(base)
    engine.lora.load(name, str(path))
    ps = prompts(3, seed=9)
    outs = engine.generate(ps, SamplingParams(max_new_tokens=MAX_NEW, lora_name=name))
    assert [o.output_token_ids for o in outs] == hf_greedy(merged, ps, MAX_NEW)
