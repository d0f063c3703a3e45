"""The routed families expert parallelism serves, on one process: Qwen2-MoE and Qwen3-MoE.

* every key of their HF configs is classified (honoured or neutral), the default
  configs build;
* greedy tokens equal HF ``generate`` (shared expert + gate, dense-MLP layers from
  ``mlp_only_layers`` / ``decoder_sparse_step``, ``norm_topk_prob`` both ways), from a
  saved directory (transformers 5's fused expert tensors) and from per-expert
  ``gate_proj/up_proj/down_proj`` names;
* tensor parallelism slices the routed and the shared experts (ranks in threads
  sum to the unsharded logits).
"""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from shardspeed.inference.fastgen.engine import InferenceEngine
from shardspeed.inference.fastgen.kv_cache import KVCache, KVCacheSpec
from shardspeed.inference.fastgen.loader import CheckpointSource, build_model, describe_source
from shardspeed.inference.fastgen.models import get_model_class
from shardspeed.inference.fastgen.models.config_check import unclassified_keys
from shardspeed.inference.fastgen.models.tp_shard import TensorShard
from shardspeed.inference.fastgen.ragged import build_ragged_batch
from shardspeed.inference.fastgen.sampling_params import SamplingParams
from shardspeed.inference.fastgen.scheduler import ScheduledBatch, ScheduledSequence

VOCAB = 128
COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    bos_token_id=1, eos_token_id=2, pad_token_id=0, initializer_range=0.1,
)  # fmt: skip
MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=48)
CASES: dict[str, tuple[str, dict[str, Any]]] = {
    "qwen2_moe_shared_dense_layer": (
        "Qwen2MoeConfig", dict(**MOE, shared_expert_intermediate_size=80, mlp_only_layers=[1]),
    ),
    "qwen3_moe_sparse_step_norm_topk": (
        "Qwen3MoeConfig", dict(**MOE, head_dim=16, decoder_sparse_step=2, norm_topk_prob=True),
    ),
    "qwen3_moe": ("Qwen3MoeConfig", dict(**MOE, head_dim=16, attention_bias=True)),
}  # fmt: skip
HF_CONFIGS = {"qwen2_moe": "Qwen2MoeConfig", "qwen3_moe": "Qwen3MoeConfig"}


@pytest.fixture(autouse=True)
def _one_thread():
    """One intra-op thread (the tensor-parallel test runs two rank threads)."""
    saved = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(saved)


def _hf_model(config_cls: str, **overrides: Any) -> torch.nn.Module:
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


def _prompts(seed: int, lengths: tuple[int, ...] = (3, 21, 9, 14)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, VOCAB, (n,), generator=g).tolist() for n in lengths]


def _hf_greedy(model: torch.nn.Module, prompts: list[list[int]], n: int) -> list[list[int]]:
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            gen = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                pad_token_id=0, eos_token_id=None,
            )  # fmt: skip
            out.append(gen[0, len(p) :].tolist())
    return out


@pytest.mark.parametrize("model_type", sorted(HF_CONFIGS))
def test_every_hf_config_key_is_classified(model_type: str) -> None:
    import transformers

    config = getattr(transformers, HF_CONFIGS[model_type])().to_dict()
    cls = get_model_class(model_type)
    assert unclassified_keys(config, *cls.config_fields(model_type)) == []
    with torch.device("meta"):  # the default config's values are accepted (2 of its layers)
        cls.from_config({**config, "num_hidden_layers": 2, "layer_types": None})


@pytest.mark.parametrize(
    "case",
    [pytest.param(c, marks=pytest.mark.slow) if c == "qwen3_moe" else c for c in sorted(CASES)],
)  # plain qwen3_moe in the slow tier: the other Qwen3 case covers its block
def test_qwen_moe_matches_hf_generate(case: str, tmp_path) -> None:
    config_cls, overrides = CASES[case]
    model = _hf_model(config_cls, **overrides)
    prompts = _prompts(4, (3, 21, 9))
    want = _hf_greedy(model, prompts, 8)
    model.save_pretrained(tmp_path / "ckpt")
    engine = InferenceEngine.from_pretrained(tmp_path / "ckpt", block_size=4, num_blocks=128)
    params = SamplingParams(max_new_tokens=8, ignore_eos=True)
    assert [o.output_token_ids for o in engine.generate(prompts, params)] == want


def test_per_expert_checkpoint_names_load_like_the_fused_ones() -> None:
    """``mlp.experts.{e}.gate_proj/up_proj/down_proj`` (older transformers) == fused tensors."""
    config_cls, overrides = CASES["qwen2_moe_shared_dense_layer"]
    model = _hf_model(config_cls, **overrides)
    config, weights, dtype = describe_source(model)
    split: dict[str, torch.Tensor] = {}
    inter = MOE["moe_intermediate_size"]
    for name, t in weights:
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name.removesuffix("gate_up_proj")
            for e in range(t.shape[0]):
                split[f"{base}{e}.gate_proj.weight"] = t[e, :inter]
                split[f"{base}{e}.up_proj.weight"] = t[e, inter:]
        elif name.endswith("mlp.experts.down_proj"):
            base = name.removesuffix("down_proj")
            for e in range(t.shape[0]):
                split[f"{base}{e}.down_proj.weight"] = t[e]
        else:
            split[name] = t
    fused, _ = build_model(model, None, torch.device("cpu"))
    legacy, _ = build_model(CheckpointSource(config, split, dtype), None, torch.device("cpu"))
    for (n, a), (_, b) in zip(fused.state_dict().items(), legacy.state_dict().items()):
        assert torch.equal(a, b), n


def _logits(model: Any, prompt: list[int]) -> torch.Tensor:
    spec = KVCacheSpec(model.num_layers, model.num_kv_heads, model.head_dim, 4, torch.float32)
    cache = KVCache(spec, 16, torch.device("cpu"))
    n = len(prompt)
    request: Any = None  # the forward never reads it
    seq = ScheduledSequence(request, prompt, 0, list(range(n)), list(range(-(-n // 4))), True,
                            all_logits=True)  # fmt: skip
    with torch.inference_mode():
        return model(build_ragged_batch(ScheduledBatch([seq]), 4, torch.device("cpu"), "torch"),
                     cache)  # fmt: skip


def test_tensor_parallel_slices_routed_and_shared_experts() -> None:
    config_cls, overrides = CASES["qwen2_moe_shared_dense_layer"]
    model = _hf_model(config_cls, **overrides)
    prompt = _prompts(5, (9,))[0]
    want = _logits(build_model(model, None, torch.device("cpu"))[0], prompt)
    parts: list[torch.Tensor | None] = [None, None]
    barrier = threading.Barrier(2, timeout=30)

    def all_reduce_for(rank: int):
        def all_reduce(x: torch.Tensor) -> torch.Tensor:
            parts[rank] = x.clone()
            barrier.wait()
            total = parts[0] + parts[1]  # type: ignore[operator]
            barrier.wait()
            return x.copy_(total)

        return all_reduce

    ranks = [
        build_model(model, None, torch.device("cpu"), shard=TensorShard(r, 2, all_reduce_for(r)))[0]
        for r in range(2)
    ]
    assert (
        ranks[0].layers[0].mlp.experts["0"].gate_up_proj.weight.shape[0]
        == MOE["moe_intermediate_size"]
    )  # 2 * 48 / 2: half of each expert's rows
    assert ranks[0].layers[0].mlp.shared_expert.down_proj.weight.shape[1] == 40
    got: list[torch.Tensor] = []
    t = threading.Thread(target=lambda: _logits(ranks[1], prompt))
    t.start()
    got.append(_logits(ranks[0], prompt))
    t.join(60)
    torch.testing.assert_close(got[0], want, rtol=1e-4, atol=1e-5)
