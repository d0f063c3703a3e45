"""Each compression technique against values computed by hand on tiny tensors."""

from __future__ import annotations

from collections import OrderedDict

import pytest
import torch
from torch import nn

from shardspeed.compression import (
    CompressionTrainingHook,
    compress,
    get_compression_config,
    init_compression,
    redundancy_clean,
)
from shardspeed.compression.bit_schedule import WeightBitSchedule
from shardspeed.compression.conv import CompressedBatchNorm2d, CompressedConv2d
from shardspeed.compression.linear import CompressedEmbedding, CompressedLinear
from shardspeed.compression.matching import compressed_copy
from shardspeed.compression.quantizers import (
    quantize_asymmetric,
    quantize_binary,
    quantize_symmetric,
    quantize_ternary,
    quantize_weight,
    quantize_weight_ste,
    topk_mask,
)
from shardspeed.compression.technique_state import StaticActivationRange


def _t(*values: float) -> torch.Tensor:
    return torch.tensor(values)


# -- quantizers ------------------------------------------------------------------------------


def test_topk_mask_keeps_ceil_ratio_largest():
    scores = _t(0.1, 0.5, 0.3, 0.9)
    assert topk_mask(scores, 0.5).tolist() == [0, 1, 0, 1]
    assert topk_mask(scores, 0.6).tolist() == [0, 1, 1, 1]  # ceil(2.4) = 3


def test_symmetric_levels_and_clamp():
    # 3 bits: scale = 2 * 1 / 8 = 0.25, levels -4..3 (so +1 clamps to 0.75)
    out = quantize_symmetric(_t(-1.0, -0.5, 0.25, 1.0), 3)
    assert out.tolist() == [-1.0, -0.5, 0.25, 0.75]


def test_asymmetric_levels():
    # 2 bits: scale = 3 / 4, zero point 0, codes round(x / 0.75) clamped to 0..3
    out = quantize_asymmetric(_t(0.0, 1.0, 2.0, 3.0), 2)
    assert out.tolist() == [0.0, 0.75, 2.25, 2.25]


def test_ternary_and_binary():
    # mean|x| = 0.925, threshold 0.6475; kept 1 and -2, alpha = 1.5
    assert quantize_ternary(_t(1.0, -0.2, 0.5, -2.0)).tolist() == [1.5, 0.0, 0.0, -1.5]
    assert quantize_binary(_t(1.0, -3.0)).tolist() == [2.0, -2.0]
    assert quantize_weight(_t(1.0, -3.0), 1, "symmetric", 1).tolist() == [2.0, -2.0]


def test_per_group_scales():
    # two groups, each binarised with its own mean |x|
    assert quantize_binary(_t(1.0, -3.0, 10.0, -10.0), 2).tolist() == [2.0, -2.0, 10.0, -10.0]
    # symmetric 3 bits per group: group maxima 1 and 4
    out = quantize_symmetric(_t(1.0, 0.5, 4.0, 2.0), 3, num_groups=2)
    assert out.tolist() == [0.75, 0.5, 3.0, 2.0]


def test_straight_through_gradient():
    x = _t(0.3, -0.7, 1.0).requires_grad_()
    quantize_weight_ste(x, 2, "symmetric", 1).sum().backward()
    assert x.grad.tolist() == [1.0, 1.0, 1.0]


# -- bit schedule ----------------------------------------------------------------------------


def _wq_config(start: int, target: int, period: int, in_forward: bool = False, **shared):
    return {
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {
                    "enabled": True,
                    "quantize_weight_in_forward": in_forward,
                    **shared,
                },
                "different_groups": {
                    "g": {
                        "params": {
                            "start_bits": start,
                            "target_bits": target,
                            "quantization_period": period,
                        },
                        "modules": ["lin"],
                    }
                },
            }
        }
    }


class _One(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x)


@pytest.mark.parametrize(
    ("period", "expected"),
    [(1, [7, 6, 6, 5, 5, 5, 5, 4, 4]), (2, [8, 7, 7, 6, 6, 6, 6, 5, 5])],
)
def test_bit_schedule_drops_one_bit_per_doubling_period(period, expected):
    model = init_compression(_One(), _wq_config(8, 4, period))
    cfg = get_compression_config(_wq_config(8, 4, period))
    schedule = WeightBitSchedule(model, cfg.weight_quantization.shared_parameters)
    seen = []
    for _ in expected:
        schedule.step()
        seen.append(model.lin.weight_bits.bits)
    assert seen == expected


def test_in_place_quantization_after_each_step_at_current_bits():
    torch.manual_seed(0)
    model = init_compression(_One(), _wq_config(3, 2, 2))
    hook = CompressionTrainingHook(model, get_compression_config(_wq_config(3, 2, 2)))
    raw = model.lin.weight.data.clone()
    hook.before_forward(0)  # step-0 check: switch on, quantize at 3 bits
    assert torch.equal(model.lin.weight.data, quantize_symmetric(raw, 3))
    hook.after_optimizer_step(applied=False)  # skipped step: nothing
    assert model.lin.weight_bits.bits == 3
    hook.after_optimizer_step(applied=True)  # step 2 >= period 2: ternary
    assert model.lin.weight_bits.bits == 2
    assert len(torch.unique(model.lin.weight.data)) <= 3


def test_in_forward_quantization_follows_schedule_and_keeps_float_master():
    model = init_compression(_One(), _wq_config(8, 2, 1, in_forward=True))
    hook = CompressionTrainingHook(model, get_compression_config(_wq_config(8, 2, 1, True)))
    master = model.lin.weight.data.clone()
    hook.before_forward(0)
    assert torch.equal(model.lin.weight.data, master)  # no in-place write
    x = torch.eye(4)
    # step 1 >= period 1: 7 bits in forward (DeepSpeed would use target_bits directly)
    out = model(x)
    expected = x @ quantize_symmetric(master, 7).t() + model.lin.bias
    torch.testing.assert_close(out, expected)
    redundancy_clean(model, _wq_config(8, 2, 1, in_forward=True))
    assert torch.equal(model.lin.weight.data, quantize_ternary(master))  # fixed at target


def test_stochastic_rounding_draws_from_global_rng():
    cfg = _wq_config(4, 4, 1, rounding="stochastic")
    torch.manual_seed(0)
    model = init_compression(_One(), cfg)
    raw = model.lin.weight.data.clone()
    state = torch.get_rng_state()
    hook = CompressionTrainingHook(model, get_compression_config(cfg))
    hook.before_forward(0)
    torch.set_rng_state(state)
    noise = torch.empty(1, 8).uniform_(-0.5, 0.5)
    assert torch.equal(model.lin.weight.data, quantize_symmetric(raw, 4, noise=noise))


# -- pruning ---------------------------------------------------------------------------------


def _linear(weight: list[list[float]], bias: bool = True) -> CompressedLinear:
    w = torch.tensor(weight)
    layer = CompressedLinear(w.size(1), w.size(0), bias=bias)
    layer.weight.data = w
    if bias:
        layer.bias.data = torch.arange(1.0, w.size(0) + 1)
    return layer


def test_sparse_l1_mask_and_fold():
    layer = _linear([[1.0, -4.0], [3.0, 0.5]], bias=False)
    layer.enable_sparse_pruning(0.5, "l1")
    assert layer.sparse_pruning_mask.tolist() == [[0, 1], [1, 0]]
    layer.sparse_pruning_enabled = True
    assert layer(torch.eye(2)).tolist() == [[0.0, 3.0], [-4.0, 0.0]]
    layer.fix_sparse_pruning()
    assert layer.weight.tolist() == [[0.0, -4.0], [3.0, 0.0]]
    assert "sparse_pruning_mask" not in dict(layer.named_buffers())


def test_sparse_topk_scores_are_learned_and_fold():
    torch.manual_seed(0)
    layer = _linear([[1.0, 2.0], [3.0, 4.0]], bias=False)
    layer.enable_sparse_pruning(0.25, "topk")
    layer.sparse_mask_scores.data = torch.tensor([[0.0, 0.0], [0.9, 0.1]])
    layer.sparse_pruning_enabled = True
    layer(torch.ones(1, 2)).sum().backward()
    assert layer.sparse_mask_scores.grad is not None  # straight-through to the scores
    layer.fix_sparse_pruning()
    assert layer.weight.tolist() == [[0.0, 0.0], [3.0, 0.0]]
    assert not hasattr(layer, "sparse_mask_scores")


def test_row_l1_mask_zero_or_remove():
    rows = [[1.0, 1.0], [3.0, 0.0], [0.5, 0.5], [-2.0, 2.0]]  # L1 norms 2, 3, 1, 4
    layer = _linear(rows)
    layer.enable_row_pruning(0.5, "l1")
    assert layer.row_pruning_mask.view(-1).tolist() == [0, 1, 0, 1]
    layer.row_pruning_enabled = True
    assert layer(torch.zeros(1, 2)).tolist() == [[0.0, 2.0, 0.0, 4.0]]  # bias masked too
    keep = layer.fix_row_pruning(dim_reduction=True)
    assert layer.weight.tolist() == [[3.0, 0.0], [-2.0, 2.0]]
    assert layer.bias.tolist() == [2.0, 4.0] and layer.out_features == 2
    nxt = _linear([[1.0, 2.0, 3.0, 4.0]])
    nxt.fix_row_pruning(keep)
    assert nxt.weight.tolist() == [[2.0, 4.0]] and nxt.in_features == 2

    zeroed = _linear(rows)
    zeroed.enable_row_pruning(0.5, "l1")
    zeroed.fix_row_pruning(dim_reduction=False)
    assert zeroed.weight.tolist() == [[0.0, 0.0], [3.0, 0.0], [0.0, 0.0], [-2.0, 2.0]]


def test_head_pruning_masks_input_blocks_and_shrinks_qkv():
    out_proj = _linear([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0]], bias=False)
    out_proj.enable_head_pruning(0.5, "topk", num_heads=2)
    out_proj.head_pruning_scores.data = torch.tensor([[0.1, 0.9]])  # keep head 1
    out_proj.head_pruning_enabled = True
    assert out_proj(torch.ones(1, 4)).tolist() == [[7.0, 15.0]]  # columns 2, 3 only
    mask = out_proj.fix_head_pruning(dim_reduction=True)
    assert out_proj.weight.tolist() == [[3.0, 4.0], [7.0, 8.0]] and out_proj.in_features == 2
    query = _linear([[1.0], [2.0], [3.0], [4.0]])  # 2 heads of 2 output features
    query.fix_head_pruning(mask, num_heads=2)
    assert query.weight.tolist() == [[3.0], [4.0]] and query.bias.tolist() == [3.0, 4.0]
    assert query.out_features == 2


def test_head_pruning_refuses_indivisible_head_count():
    with pytest.raises(ValueError, match="num_heads=3 does not divide in_features=4"):
        _linear([[1.0, 2.0, 3.0, 4.0]]).enable_head_pruning(0.5, "topk", 3)


def test_channel_l1_with_related_batchnorm_and_conv():
    conv = CompressedConv2d(1, 3, 1)
    conv.weight.data = torch.tensor([1.0, -3.0, 2.0]).view(3, 1, 1, 1)
    conv.bias.data = torch.tensor([1.0, 2.0, 3.0])
    conv.enable_channel_pruning(2 / 3, "l1")
    assert conv.channel_pruning_mask.view(-1).tolist() == [0, 1, 1]
    conv.channel_pruning_enabled = True
    assert conv(torch.ones(1, 1, 1, 1)).view(-1).tolist() == [0.0, -1.0, 5.0]
    keep = conv.fix_channel_pruning(dim_reduction=True)
    assert conv.weight.view(-1).tolist() == [-3.0, 2.0] and conv.out_channels == 2
    bn = compressed_copy(nn.BatchNorm2d(3))
    assert isinstance(bn, CompressedBatchNorm2d)
    bn.fix_channel_pruning(keep)
    assert bn.num_features == 2 and bn.running_mean.shape == (2,)
    nxt = CompressedConv2d(3, 1, 1)
    nxt.fix_channel_pruning(keep)
    assert nxt.weight.shape == (1, 2, 1, 1) and nxt.in_channels == 2


# -- activation quantization ---------------------------------------------------------------


def test_dynamic_activation_quantization_per_token():
    layer = _linear([[1.0, 0.0], [0.0, 1.0]], bias=False)
    layer.enable_activation_quantization(4, "symmetric", "dynamic")
    layer.activation_quantization_enabled = True
    # 4 bits, per token: scale 2 * 1 / 16; 1.0 clamps to 7 * 0.125, 0.3 -> 0.25
    out = layer(torch.tensor([[1.0, 0.3], [0.5, 0.5]]))
    assert out.tolist() == [[0.875, 0.25], [0.4375, 0.4375]]


def test_static_activation_range_momentum():
    act = StaticActivationRange("symmetric")
    out = act(torch.tensor([-1.0, 2.0]), 4)  # range [-1, 2]: scale 0.25
    assert out.tolist() == [-1.0, 1.75]
    act(torch.tensor([0.0, 4.0]), 4)
    torch.testing.assert_close(act.x_min_max, torch.tensor([-0.95, 2.1]))
    act.eval()
    act(torch.tensor([100.0]), 4)
    torch.testing.assert_close(act.x_min_max, torch.tensor([-0.95, 2.1]))  # frozen


def test_embedding_quantized_token_wise_in_forward():
    emb = CompressedEmbedding(2, 2)
    emb.weight.data = torch.tensor([[1.0, -3.0], [2.0, 2.0]])
    emb.enable_weight_quantization(1, 1, 1, True, "symmetric", 1)
    emb.weight_quantization_enabled = True
    assert emb(torch.tensor([0, 1])).tolist() == [[2.0, -2.0], [2.0, 2.0]]


# -- wrapping, scheduler, layer reduction, errors --------------------------------------------


def test_wrapping_draws_like_rebuilding_and_keeps_parameters():
    torch.manual_seed(0)
    model = _One()
    weight = model.lin.weight
    state = torch.get_rng_state()
    nn.Linear(4, 2)  # what DeepSpeed's rebuild draws
    expected = torch.rand(1)
    torch.set_rng_state(state)
    init_compression(model, {})
    assert torch.equal(torch.rand(1), expected)
    assert isinstance(model.lin, CompressedLinear) and model.lin.weight is weight


def _row_config(offset: int, related: bool) -> dict:
    group = {"params": {"dense_ratio": 0.5}, "modules": ["^a$"]}
    if related:
        group["related_modules"] = [["^b$"]]
    return {
        "compression_training": {
            "row_pruning": {
                "shared_parameters": {"enabled": True, "schedule_offset": offset},
                "different_groups": {"g": group},
            }
        }
    }


def _two_layer() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict(a=nn.Linear(3, 4), b=nn.Linear(4, 2)))


def test_scheduler_switches_on_at_offset():
    model = init_compression(_two_layer(), _row_config(2, related=False))
    hook = CompressionTrainingHook(model, get_compression_config(_row_config(2, False)))
    hook.before_forward(0)
    assert not model.a.row_pruning_enabled
    hook.after_optimizer_step(True)
    assert not model.a.row_pruning_enabled
    hook.after_optimizer_step(True)
    assert model.a.row_pruning_enabled and not model.b.row_pruning_enabled


def test_redundancy_clean_shrinks_only_with_related_modules():
    shrunk = redundancy_clean(
        init_compression(_two_layer(), _row_config(0, True)), _row_config(0, True)
    )
    assert shrunk.a.weight.shape == (2, 3) and shrunk.b.weight.shape == (2, 2)
    zeroed = redundancy_clean(
        init_compression(_two_layer(), _row_config(0, False)), _row_config(0, False)
    )
    assert zeroed.a.weight.shape == (4, 3)
    assert int((zeroed.a.weight.abs().sum(1) == 0).sum()) == 2


def test_sparse_pruning_offset_reached_without_schedule_offset_end():
    cfg = {
        "compression_training": {
            "sparse_pruning": {
                "shared_parameters": {"enabled": True, "schedule_offset": 1},
                "different_groups": {"g": {"params": {"dense_ratio": 0.5}, "modules": ["a"]}},
            }
        }
    }
    model = init_compression(_two_layer(), cfg)
    hook = CompressionTrainingHook(model, get_compression_config(cfg))
    hook.after_optimizer_step(True)  # DeepSpeed 0.19.6: KeyError 'schedule_offset_end'
    assert model.a.sparse_pruning_enabled


class _Stack(nn.Module):
    def __init__(self, num_layers: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(5, 2)
        self.layers = nn.ModuleList(nn.Linear(2, 2) for _ in range(num_layers))


def test_layer_reduction_copies_chosen_teacher_layers():
    teacher, student = _Stack(4), _Stack(2)
    cfg = {
        "compression_training": {
            "layer_reduction": {
                "enabled": True,
                "keep_number_layer": 2,
                "module_name_prefix": "layers",
                "teacher_layer": [1, 3],
                "other_module_name": ["embed"],
            }
        }
    }
    compress.init_compression(student, cfg, teacher_model=teacher)
    assert torch.equal(student.layers[0].weight, teacher.layers[1].weight)
    assert torch.equal(student.layers[1].bias, teacher.layers[3].bias)
    assert torch.equal(student.embed.weight, teacher.embed.weight)
    with pytest.raises(ValueError, match="teacher_model=None"):
        compress.init_compression(_Stack(2), cfg)


def test_errors_name_the_argument():
    with pytest.raises(ValueError, match="mpu="):
        init_compression(_One(), {}, mpu=object())
    conv_cfg = _row_config(0, False)
    conv_cfg["compression_training"]["row_pruning"]["different_groups"]["g"]["modules"] = ["c"]
    model = nn.Module()
    model.c = nn.Conv2d(1, 1, 1)
    with pytest.raises(ValueError, match="module 'c' is a Conv2d; allowed for row_pruning"):
        init_compression(model, conv_cfg)
    bad_regex = _row_config(0, False)
    bad_regex["compression_training"]["row_pruning"]["different_groups"]["g"]["modules"] = ["(a"]
    with pytest.raises(ValueError, match="not a valid regular expression"):
        init_compression(_two_layer(), bad_regex)
    overlap = _row_config(0, False)
    groups = overlap["compression_training"]["row_pruning"]["different_groups"]
    groups["h"] = {"params": {"dense_ratio": 0.5}, "modules": ["a"]}
    with pytest.raises(ValueError, match="module 'a' is already compressed by another group"):
        init_compression(_two_layer(), overlap)
