"""Pure tensor-parallel pieces: DeepSpeed AutoTP's split widths, shard layouts, policies.

The expected widths are written out from DeepSpeed 0.19.8's ``tp_shard.get_shard_size``
rules (and match the shards ``tests/dist/test_autotp.py`` gets from DeepSpeed itself).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from shardspeed.parallel.tensor.partition import (
    ShardLayout,
    assemble,
    autotp_split,
    even_split,
    group_split,
    slice_shard,
)
from shardspeed.parallel.tensor.policies import (
    GPT2,
    LLAMA,
    LayerRule,
    from_hf_tp_plan,
    from_partition_config,
    head_counts,
    hf_tp_plan,
    policy_for,
    splits_by_kv_heads,
)


# ----------------------------------------------------------------- split widths
@pytest.mark.parametrize(
    ("total", "tp", "grain", "expected"),
    [
        (40, 2, 1, (20, 20)),
        (37, 2, 1, (19, 18)),  # uneven MLP: first ranks get the extra element
        (63, 2, 1, (32, 31)),  # uneven vocabulary
        (10, 4, 1, (3, 3, 2, 2)),
        (3, 4, 1, (1, 1, 1, 0)),
        (130, 2, 64, (64, 66)),  # whole grains, the tail to the last rank
        (200, 4, 64, (64, 64, 64, 8)),
        (50, 4, 64, (13, 13, 12, 12)),  # smaller than a grain: by elements
        (0, 2, 1, (0, 0)),
    ],
)
def test_even_split(total: int, tp: int, grain: int, expected: tuple[int, ...]) -> None:
    assert even_split(total, tp, grain) == expected


def test_even_split_tiles_every_size() -> None:
    for total, tp, grain in itertools.product(range(0, 70), range(1, 9), (1, 4, 16)):
        widths = even_split(total, tp, grain)
        assert len(widths) == tp and sum(widths) == total and min(widths) >= 0
        assert max(widths[:-1] or (0,)) - min(widths[:-1] or (0,)) <= grain


@pytest.mark.parametrize(
    ("total", "tp", "groups", "expected"),
    [
        (32, 2, 2, (16, 16)),  # q_proj of 8 heads / 2 KV heads: one KV group (4 heads) each
        (48, 2, 3, (32, 16)),  # 3 KV groups on 2 ranks: 2 + 1, never a cut group
        (24, 2, 3, (16, 8)),
        (24, 4, 3, (8, 8, 8, 0)),  # more ranks than groups: the last holds nothing
    ],
)
def test_group_split_keeps_kv_groups_whole(
    total: int, tp: int, groups: int, expected: tuple
) -> None:
    assert group_split(total, tp, groups) == expected


def test_group_split_rejects_a_partial_group() -> None:
    with pytest.raises(ValueError, match="multiple of num_groups"):
        group_split(10, 2, 3)


@pytest.mark.parametrize(
    ("total", "kv", "aligned", "expected"),
    [
        (48, 3, True, (32, 16)),  # attention: by KV groups
        (48, 3, False, (24, 24)),  # MLP / head: near-even
        (37, 3, True, (19, 18)),  # not a multiple of the KV count: near-even
        (48, None, True, (24, 24)),  # no head count known: near-even
    ],
)
def test_autotp_split_follows_deepspeed(
    total: int, kv: int | None, aligned: bool, expected: tuple
) -> None:
    assert autotp_split(total, 2, num_kv_heads=kv, head_aligned=aligned) == expected


def test_autotp_split_gives_zero_width_shards_like_deepspeed() -> None:
    """Fewer KV heads than ranks: whole KV groups to the first ranks, nothing to the rest
    (DeepSpeed 0.19.8 trains such a layout; tests/dist/test_autotp_zero_width.py)."""
    assert autotp_split(32, 4, num_kv_heads=2, head_aligned=True) == (16, 16, 0, 0)
    assert autotp_split(32, 4, num_kv_heads=2, head_aligned=False) == (8, 8, 8, 8)


@pytest.mark.parametrize(
    ("name", "aligned"),
    [
        ("model.layers.0.self_attn.q_proj", True),
        ("model.layers.0.self_attn.o_proj", True),
        ("transformer.h.3.attn.c_attn", True),
        ("model.layers.0.mlp.gate_proj", False),
        ("model.layers.0.mlp.down_proj", False),
        ("transformer.h.3.mlp.c_fc", False),
        ("lm_head", False),
        ("embed_out", False),
        ("model.layers.0.block_sparse_moe.experts.0.w1", False),
    ],
)
def test_which_layers_split_by_kv_heads(name: str, aligned: bool) -> None:
    assert splits_by_kv_heads(name) is aligned


# ----------------------------------------------------------------- layouts
def test_fused_layout_ranges() -> None:
    layout = ShardLayout.fused(0, [(2, 2), (1, 1), (3, 1)])  # q: 4, k: 2, v: 4 on 2 ranks
    assert layout.full_size == 10 and layout.num_sub == 3 and layout.tp_size == 2
    assert layout.shard_sizes == (6, 4)
    assert layout.ranges(0) == ((0, 2), (4, 5), (6, 9))
    assert layout.ranges(1) == ((2, 4), (5, 6), (9, 10))


@pytest.mark.parametrize("dim", [0, 1])
def test_slice_and_assemble_round_trip(dim: int) -> None:
    gen = torch.Generator().manual_seed(0)
    for tp in (1, 2, 3, 4):
        for sub_sizes in ((7,), (4, 4, 4), (6, 2, 2), (1, 5)):
            widths = [even_split(s, tp) for s in sub_sizes]
            layout = ShardLayout.fused(dim, widths)
            shape = [5, 5]
            shape[dim] = layout.full_size
            full = torch.randn(shape, generator=gen)
            shards = [slice_shard(full, layout, r) for r in range(tp)]
            for r, shard in enumerate(shards):
                assert shard.shape[dim] == layout.shard_size(r) and shard.is_contiguous()
            assert torch.equal(assemble(shards, layout), full)


def test_slice_names_a_wrong_full_size() -> None:
    with pytest.raises(ValueError, match="expects 10"):
        slice_shard(torch.zeros(8, 3), ShardLayout.of(0, (5, 5)), 0)


def test_layout_widths_must_tile() -> None:
    with pytest.raises(AssertionError):
        ShardLayout(0, (10,), ((4, 4),))


# ----------------------------------------------------------------- policies
def _tiny(kind: str, **kwargs):
    tf = pytest.importorskip("transformers")
    with torch.device("meta"):
        if kind == "llama":
            config = tf.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=40, num_hidden_layers=1,
                                    num_attention_heads=8, num_key_value_heads=2, **kwargs)  # fmt: skip
            return tf.LlamaForCausalLM(config)
        return tf.GPT2LMHeadModel(
            tf.GPT2Config(vocab_size=64, n_embd=32, n_layer=1, n_head=4, **kwargs)
        )


def test_llama_plan_splits_attention_and_mlp_like_deepspeed() -> None:
    model = _tiny("llama")
    policy = policy_for(model)
    rule = lambda name: policy.rule_for(name, "llama")  # noqa: E731
    for name in ("q_proj", "k_proj", "v_proj"):
        assert rule(f"model.layers.0.self_attn.{name}") == LayerRule("column")
    assert rule("model.layers.0.self_attn.o_proj") == LayerRule("row")
    assert (
        rule("model.layers.0.mlp.gate_proj")
        == rule("model.layers.0.mlp.up_proj")
        == LayerRule("column")
    )
    assert rule("model.layers.0.mlp.down_proj") == LayerRule("row")
    assert rule("lm_head") == LayerRule("column", gather_output=True)
    assert rule("model.embed_tokens") in (None, LayerRule("skip"))  # replicated unless tied
    assert head_counts(model) == (2, 8)


def test_builtin_llama_policy_equals_the_hf_plan() -> None:
    model = _tiny("llama")
    plan_policy = from_hf_tp_plan(hf_tp_plan(model))
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    assert names
    for name in names:
        assert LLAMA.rule_for(name, "llama") == plan_policy.rule_for(name, "llama"), name


def test_tied_llama_plan_skips_the_embedding() -> None:
    plan = hf_tp_plan(_tiny("llama", tie_word_embeddings=True))
    assert plan.get("model.embed_tokens") == "embedding_rowwise"
    assert from_hf_tp_plan(plan).rule_for("model.embed_tokens", "llama") == LayerRule("skip")


def test_gpt2_policy_cuts_fused_qkv_per_projection() -> None:
    model = _tiny("gpt2")
    assert policy_for(model) is GPT2
    assert GPT2.rule_for("transformer.h.0.attn.c_attn", "gpt2") == LayerRule("column", num_sub=3)
    assert GPT2.rule_for("transformer.h.0.attn.c_proj", "gpt2") == LayerRule("row")
    assert GPT2.rule_for("transformer.h.0.mlp.c_fc", "gpt2") == LayerRule("column")
    assert GPT2.rule_for("transformer.h.0.mlp.c_proj", "gpt2") == LayerRule("row")
    assert head_counts(model) == (4, 4)
    assert LayerRule("column", num_sub=3).split_sizes(96, "c_attn") == (32, 32, 32)


def test_partition_config_in_deepspeeds_format() -> None:
    policy = from_partition_config(
        {
            "use_default_specs": False,
            "layer_specs": [
                {"patterns": [r".*\.o_proj\.weight$", r".*\.down_proj\.weight$"], "partition_type": "row"},
                {"patterns": [r".*\.[qkv]_proj\.weight$"], "partition_type": "column"},
                {"patterns": [r".*\.gate_up_proj\.weight$"], "partition_type": "column", "shape": [2, -1],
                 "partition_dim": 0},
                {"patterns": [r".*\.qkv\.weight$"], "partition_type": "column", "shape": [[32, 8, 8], -1]},
                {"patterns": [r".*\.q_norm\.weight$"], "partition_type": "skip", "grad_allreduce": True},
                {"patterns": [r".*\.only_here\.weight$"], "partition_type": "row", "model_types": ["Llama"]},
            ],
        }
    )  # fmt: skip
    assert policy.rule_for("m.layers.0.self_attn.o_proj", None) == LayerRule("row")
    assert policy.rule_for("m.layers.0.self_attn.k_proj", None) == LayerRule("column")
    assert policy.rule_for("m.layers.0.mlp.gate_up_proj", None) == LayerRule("column", num_sub=2)
    assert policy.rule_for("m.layers.0.attn.qkv", None) == LayerRule("column", sub_sizes=(32, 8, 8))
    assert policy.rule_for("m.layers.0.attn.q_norm", None) == LayerRule("skip", grad_allreduce=True)
    assert policy.rule_for("m.only_here", "llama") == LayerRule("row")
    assert policy.rule_for("m.only_here", "qwen2") is None  # model_types filter
    assert policy.rule_for("m.lm_head", None) is None  # unmatched: replicated
    assert policy.tied_head == "replicate"  # DeepSpeed keeps a tied head whole with a custom config


def test_partition_config_merges_a_preset_after_the_user_specs() -> None:
    policy = from_partition_config(
        {"layer_specs": [{"patterns": [r".*\.q_proj\.weight$"], "partition_type": "skip"}]}, LLAMA
    )
    # the user's spec comes first, the preset's after it
    assert policy.rule_for("m.layers.0.self_attn.q_proj", "llama") == LayerRule("skip")
    assert policy.rule_for("m.layers.0.self_attn.k_proj", "llama") == LayerRule("column")


@pytest.mark.parametrize(
    ("config", "match"),
    [
        ({"layer_specs": [{"patterns": ["x"], "partition_type": "diagonal"}]}, "not one of"),
        ({"layer_specs": [{"patterns": "x"}]}, "non-empty list"),
        ({"layer_spec": []}, "unknown keys"),
        (
            {"layer_specs": [{"patterns": ["x"], "partition_type": "row", "gather_output": True}]},
            "column-parallel",
        ),
    ],
)
def test_partition_config_errors_name_the_problem(config: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        from_partition_config(config)


def test_unsupported_shapes_are_refused() -> None:
    with pytest.raises(NotImplementedError, match="shape"):
        from_partition_config({"layer_specs": [{"patterns": ["x"], "shape": [4, -1, 8]}]})
    with pytest.raises(NotImplementedError, match="partition_dim"):
        from_partition_config({"layer_specs": [{"patterns": ["x"], "partition_dim": 1}]})


def test_strict_mode_requires_a_match() -> None:
    policy = from_partition_config({"layer_specs": [], "strict_mode": True})
    with pytest.raises(ValueError, match="strict_mode"):
        policy.rule_for("m.fc", None)


def test_unknown_model_and_preset_errors() -> None:
    with pytest.raises(ValueError, match="no sharding policy"):
        policy_for(torch.nn.Sequential(torch.nn.Linear(2, 2)))
    with pytest.raises(ValueError, match="preset_model"):
        policy_for(torch.nn.Linear(2, 2), preset_model="bloomz")
    assert policy_for(torch.nn.Linear(2, 2), preset_model="mistral") is LLAMA


def test_unknown_hf_style_is_refused() -> None:
    with pytest.raises(ValueError, match="sequence_parallel"):
        from_hf_tp_plan({"layers.*.norm": "sequence_parallel"})


def test_uneven_sub_sizes_must_sum() -> None:
    with pytest.raises(ValueError, match="sum to"):
        LayerRule("column", sub_sizes=(4, 4)).split_sizes(10, "qkv")
