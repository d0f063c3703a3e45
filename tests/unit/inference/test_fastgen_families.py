"""Every supported family is token-identical to HF ``generate`` (greedy, 32 new tokens).

Tiny random models (hidden 64, 2 layers) with norm weights and biases pushed
away from 1/0, saved with ``save_pretrained`` and loaded from the directory, so
the checkpoint-name mapping is exercised too. Sliding-window cases use an
8-token window with prompts up to 40 tokens; rope-scaling cases cover linear,
dynamic, yarn, llama3 and longrope.
"""

from __future__ import annotations

import pytest
import torch
from fastgen_helpers import VOCAB, hf_greedy, make_prompts, run_staggered

from shardspeed.inference.fastgen.engine import InferenceEngine
from shardspeed.inference.fastgen.sampling_params import SamplingParams

MAX_NEW = 32
GREEDY = SamplingParams(max_new_tokens=MAX_NEW)
COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.1,
)  # fmt: skip


def _randomize(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Perturb every 1-D parameter (norm weights, biases) so they matter."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(torch.randn(p.shape, generator=g) * 0.3)
    return model.float().eval()


def _build(config_cls_name: str, **overrides):
    import transformers

    torch.manual_seed(0)
    cfg = getattr(transformers, config_cls_name)(**{**COMMON, **overrides})
    return _randomize(transformers.AutoModelForCausalLM.from_config(cfg))


def _assert_matches_hf(model, tmp_path, prompts, **engine_kwargs) -> None:
    refs = hf_greedy(model, prompts, MAX_NEW)
    model.save_pretrained(tmp_path / "ckpt")
    kwargs = dict(block_size=4, num_blocks=512, max_ragged_batch_size=512)
    kwargs.update(engine_kwargs)
    engine = InferenceEngine.from_pretrained(tmp_path / "ckpt", **kwargs)
    outs = run_staggered(engine, prompts, GREEDY)
    got = [o.output_token_ids for o in outs]
    for i, (a, b) in enumerate(zip(got, refs, strict=True)):
        assert a == b, f"prompt {i} (len {len(prompts[i])}): engine {a} != HF {b}"


MIXED = make_prompts(8, 3, 40, seed=11)  # 8 mixed-length prompts
LONG = make_prompts(8, 17, 40, seed=12)  # all longer than the 8-token windows below

FAMILIES = {
    "qwen3": ("Qwen3Config", dict(head_dim=16, attention_bias=True)),
    "phi3_partial_rotary": (
        "Phi3Config",
        dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                              "partial_rotary_factor": 0.5}),
    ),
    "gemma": ("GemmaConfig", dict(head_dim=16, attention_bias=True)),
    "gemma2": (
        "Gemma2Config",
        dict(head_dim=16, sliding_window=8, query_pre_attn_scalar=24,
             attn_logit_softcapping=1.5, final_logit_softcapping=2.0),
    ),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, num_experts_per_tok=2)),
    "gpt_neox_parallel": (
        "GPTNeoXConfig",
        dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                              "partial_rotary_factor": 0.25}),
    ),
    "gpt_neox_sequential_untied_bias_free": (
        "GPTNeoXConfig",
        dict(use_parallel_residual=False, attention_bias=False, hidden_act="gelu_new"),
    ),
    "opt_pre_norm": ("OPTConfig", dict(ffn_dim=96)),
    "opt_post_norm_projected": (
        "OPTConfig", dict(ffn_dim=96, do_layer_norm_before=False, word_embed_proj_dim=32),
    ),
    "falcon_multi_query_parallel": ("FalconConfig", dict(bias=True)),
    "falcon_new_arch_gqa": (
        "FalconConfig", dict(new_decoder_architecture=True, num_kv_heads=2, ffn_hidden_size=96),
    ),
    "falcon_sequential_mha": (
        "FalconConfig", dict(multi_query=False, parallel_attn=False, bias=True),
    ),
    "llama_gelu_biases": (
        "LlamaConfig",
        dict(hidden_act="gelu", attention_bias=True, mlp_bias=True, rms_norm_eps=1e-2,
             head_dim=32, tie_word_embeddings=True),
    ),
}  # fmt: skip


# variants beyond one per family run with the slow tier (keeps this file < 60 s here)
SLOW = pytest.mark.slow


def _params(table: dict, slow: set[str]) -> list:
    return [pytest.param(k, marks=SLOW) if k in slow else k for k in table]


@pytest.mark.parametrize(
    "name",
    _params(
        FAMILIES,
        {"gpt_neox_sequential_untied_bias_free", "opt_pre_norm", "falcon_multi_query_parallel",
         "falcon_sequential_mha"},
    ),
)  # fmt: skip
def test_family_matches_hf(name, tmp_path):
    cls_name, overrides = FAMILIES[name]
    _assert_matches_hf(_build(cls_name, **overrides), tmp_path, MIXED)


SLIDING = {
    "mistral": ("MistralConfig", dict(sliding_window=8)),
    "qwen2_max_window_layers": (
        "Qwen2Config",
        dict(use_sliding_window=True, sliding_window=8, max_window_layers=1),
    ),
    "phi3": ("Phi3Config", dict(sliding_window=8)),
    "gemma2_alternating": ("Gemma2Config", dict(head_dim=16, sliding_window=8)),
    "mixtral": ("MixtralConfig", dict(num_local_experts=4, sliding_window=8)),
}


SLIDING_LAYERS = {  # window per layer, as HF's layer_types say
    "mistral": [8, 8],
    "qwen2_max_window_layers": [None, 8],
    "phi3": [8, 8],
    "gemma2_alternating": [8, None],
    "mixtral": [8, 8],
}


@pytest.mark.parametrize("name", _params(SLIDING, {"phi3", "mixtral"}))
def test_sliding_window_longer_than_window_matches_hf(name, tmp_path):
    cls_name, overrides = SLIDING[name]
    from shardspeed.inference.fastgen.loader import build_model

    model = _build(cls_name, **overrides)
    ragged, _ = build_model(model, torch.float32, torch.device("cpu"))
    assert [layer.window for layer in ragged.layers] == SLIDING_LAYERS[name]
    assert ragged.kv_window == (8 if None not in SLIDING_LAYERS[name] else None)
    # chunked prefill (16-token budget) also exercises windows inside prompt chunks
    _assert_matches_hf(model, tmp_path, LONG, max_ragged_batch_size=16)


def _rope(rope_type: str, **params) -> dict:
    return {"rope_type": rope_type, "rope_theta": 10000.0, **params}


ROPES = {
    "linear": (dict(rope_parameters=_rope("linear", factor=4.0)), MIXED),
    "llama3": (
        dict(rope_parameters=_rope("llama3", factor=8.0, low_freq_factor=1.0,
                                   high_freq_factor=4.0, original_max_position_embeddings=16)),
        MIXED,
    ),
    "yarn": (
        dict(rope_parameters=_rope("yarn", factor=4.0, original_max_position_embeddings=16)),
        MIXED,
    ),
    "yarn_mscale_beta": (
        dict(rope_parameters=_rope("yarn", factor=8.0, original_max_position_embeddings=16,
                                   beta_fast=16, beta_slow=2, mscale=0.8, mscale_all_dim=0.6)),
        MIXED,
    ),
    # dynamic NTK rescales once a sequence passes max_position_embeddings (32) while decoding
    "dynamic": (
        dict(max_position_embeddings=32, rope_parameters=_rope("dynamic", factor=4.0)),
        make_prompts(8, 3, 28, seed=13),
    ),
}  # fmt: skip
_ENGINE = {"dynamic": dict(max_seq_len=128)}  # let sequences pass the trained 32 positions


@pytest.mark.parametrize("name", _params(ROPES, {"linear", "llama3"}))
def test_rope_scaling_matches_hf(name, tmp_path):
    overrides, prompts = ROPES[name]
    _assert_matches_hf(
        _build("LlamaConfig", **overrides), tmp_path, prompts, **_ENGINE.get(name, {})
    )


@pytest.mark.parametrize("regime", [pytest.param("short", marks=SLOW), "long"])
def test_phi3_longrope_matches_hf(regime, tmp_path):
    # HF recomputes the whole cache when a sequence crosses original_max_position_embeddings
    # mid-generation; these regimes never cross: all-short (<= 16) or prompts already long.
    g = torch.Generator().manual_seed(4)
    rope = _rope(
        "longrope",
        long_factor=(1.0 + torch.rand(8, generator=g) * 4).tolist(),
        short_factor=(1.0 + torch.rand(8, generator=g)).tolist(),
    )
    model = _build(
        "Phi3Config", rope_parameters=rope, original_max_position_embeddings=16,
        max_position_embeddings=128,
    )  # fmt: skip
    if regime == "short":
        prompts = make_prompts(8, 2, 6, seed=14)
        refs = hf_greedy(model, prompts, 10)
        model.save_pretrained(tmp_path / "ckpt")
        engine = InferenceEngine.from_pretrained(tmp_path / "ckpt", block_size=4, num_blocks=256)
        outs = engine.generate(prompts, SamplingParams(max_new_tokens=10))
        assert [o.output_token_ids for o in outs] == refs
    else:
        _assert_matches_hf(model, tmp_path, make_prompts(8, 17, 40, seed=15))


@SLOW
def test_mixtral_loads_state_dict_and_legacy_expert_names(tmp_path):
    """Both expert layouts (fused 3-D tensors, per-expert w1/w2/w3) give HF's tokens."""
    from safetensors.torch import save_file

    model = _build("MixtralConfig", num_local_experts=4)
    prompts = MIXED[:3]
    refs = hf_greedy(model, prompts, MAX_NEW)
    kwargs = dict(block_size=4, num_blocks=256)
    engine = InferenceEngine.from_pretrained(model, **kwargs)
    assert [o.output_token_ids for o in engine.generate(prompts, GREEDY)] == refs

    legacy: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict().items():
        if ".mlp.experts." in name:
            prefix = name.split(".mlp.")[0] + ".block_sparse_moe.experts."
            inter = COMMON["intermediate_size"]
            for e in range(t.shape[0]):
                if name.endswith("gate_up_proj"):
                    legacy[f"{prefix}{e}.w1.weight"] = t[e, :inter].clone()
                    legacy[f"{prefix}{e}.w3.weight"] = t[e, inter:].clone()
                else:
                    legacy[f"{prefix}{e}.w2.weight"] = t[e].clone()
        else:
            legacy[name.replace(".mlp.gate.", ".block_sparse_moe.gate.")] = t.clone()
    out = tmp_path / "legacy"
    out.mkdir()
    model.config.to_json_file(out / "config.json")
    save_file(legacy, str(out / "model.safetensors"))
    engine = InferenceEngine.from_pretrained(out, **kwargs)
    assert [o.output_token_ids for o in engine.generate(prompts, GREEDY)] == refs


def _dense(q, k, v, window, scale, cap):
    """Reference attention of one full sequence; q [L, H, D], k/v [L, H_kv, D]."""
    rep = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * (scale or q.shape[-1] ** -0.5)
    if cap is not None:
        scores = torch.tanh(scores / cap) * cap
    pos = torch.arange(q.shape[0])
    keep = pos[None, :] <= pos[:, None]  # [q, k] causal
    if window is not None:
        keep &= pos[None, :] > pos[:, None] - window
    return torch.einsum("hqk,khd->qhd", scores.masked_fill(~keep, -torch.inf).softmax(-1), v)


@pytest.mark.parametrize(
    ("window", "scale", "cap"), [(5, None, None), (3, 0.2, None), (None, None, 2.0), (6, 0.5, 1.0)]
)
def test_windowed_softcapped_attention_matches_dense(window, scale, cap):
    """Prompt chunks and decode groups with a sliding window / scale / soft-cap vs dense."""
    from shardspeed.inference.fastgen.attention import paged_attention
    from shardspeed.inference.fastgen.block_pool import BlockPool
    from shardspeed.inference.fastgen.kv_cache import KVCache, KVCacheSpec
    from shardspeed.inference.fastgen.ragged import build_ragged_batch
    from shardspeed.inference.fastgen.request import Request
    from shardspeed.inference.fastgen.scheduler import Scheduler

    torch.manual_seed(0)
    H, H_KV, D, BS, EXTRA = 4, 2, 8, 4, 9
    prompt_lens = [11, 3, 17, 6, 9]
    total = [n + EXTRA for n in prompt_lens]
    qs = [torch.randn(n, H, D) for n in total]
    ks = [torch.randn(n, H_KV, D) for n in total]
    vs = [torch.randn(n, H_KV, D) for n in total]
    sched = Scheduler(BlockPool(48, BS), max_ragged_batch_size=7, max_ragged_sequence_count=4)
    reqs = [Request(str(i), [0] * n, SamplingParams()) for i, n in enumerate(prompt_lens)]
    for r in reqs:
        sched.add(r)
    cache = KVCache(KVCacheSpec(1, H_KV, D, BS, torch.float32), 48, torch.device("cpu"))
    got = [torch.zeros(n, H, D) for n in total]
    while sched.has_unfinished():
        batch = sched.schedule()
        ragged = build_ragged_batch(batch, BS, torch.device("cpu"), "torch")
        rows = [
            (int(s.request.request_id), p)
            for s in batch.sequences
            for p in range(s.start_position, s.context_len)
        ]
        q = torch.stack([qs[i][p] for i, p in rows])  # [N, H, D]
        k = torch.stack([ks[i][p] for i, p in rows])  # [N, H_kv, D]
        v = torch.stack([vs[i][p] for i, p in rows])
        out = paged_attention(
            q, k, v, cache, 0, ragged.slot_mapping, ragged.attn,
            window=window, scale=scale, softcap=cap,
        )  # fmt: skip
        for row, (i, p) in enumerate(rows):
            got[i][p] = out[row]
        sched.commit(batch)
        for s in batch.sequences:
            if s.needs_logits:
                if s.request.num_computed_tokens == total[int(s.request.request_id)]:
                    sched.finish(s.request, "length")
                else:
                    s.request.append_token(0, 0.0)
    for i in range(len(total)):
        ref = _dense(qs[i], ks[i], vs[i], window, scale, cap)
        torch.testing.assert_close(got[i], ref, atol=1e-5, rtol=1e-5)


def _prefill_logits(model, prompt: list[int]) -> torch.Tensor:
    """Last-position logits of one prompt through the ragged forward (one prefill chunk)."""
    from shardspeed.inference.fastgen.block_pool import BlockPool
    from shardspeed.inference.fastgen.kv_cache import KVCache, KVCacheSpec
    from shardspeed.inference.fastgen.ragged import build_ragged_batch
    from shardspeed.inference.fastgen.request import Request
    from shardspeed.inference.fastgen.scheduler import Scheduler

    spec = KVCacheSpec(model.num_layers, model.num_kv_heads, model.head_dim, 4, torch.float32)
    cache = KVCache(spec, 32, torch.device("cpu"))
    sched = Scheduler(BlockPool(32, 4), max_ragged_batch_size=128, max_ragged_sequence_count=1)
    sched.add(Request("0", prompt, SamplingParams()))
    batch = build_ragged_batch(sched.schedule(), 4, torch.device("cpu"), "torch")
    with torch.no_grad():
        return model(batch, cache)[0]  # [vocab]


def test_gemma2_final_logit_softcap_matches_hf_logits():
    """Soft-capping is monotonic (greedy cannot see it): compare the logits themselves."""
    from shardspeed.inference.fastgen.loader import build_model

    hf = _build("Gemma2Config", **FAMILIES["gemma2"][1])
    prompt = MIXED[0]
    ours, _ = build_model(hf, torch.float32, torch.device("cpu"))
    got = _prefill_logits(ours, prompt)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0, -1]
    assert got.abs().max() <= 2.0  # final_logit_softcapping
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
