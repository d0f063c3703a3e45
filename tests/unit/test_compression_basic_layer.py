"""DeepSpeed's ``basic_layer`` names, the distillation losses and kernel-shaped weight
groups, against values computed by hand on tiny tensors."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from shardspeed.compression import (
    capture_outputs,
    hidden_state_mse,
    init_compression,
    kd_loss,
    redundancy_clean,
    set_weight_group_size,
)
from shardspeed.compression.basic_layer import (
    BNLayer_Compress,
    ColumnParallelLinear_Compress,
    Conv2dLayer_Compress,
    Embedding_Compress,
    LinearLayer_Compress,
    QuantAct,
    RowParallelLinear_Compress,
)


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(4, 4)
        self.fc1 = nn.Linear(4, 4)
        self.fc2 = nn.Linear(4, 2)
        self.conv = nn.Conv2d(1, 2, 1)
        self.bn = nn.BatchNorm2d(2)


def _row_config(method: str = "l1") -> dict:
    return {
        "compression_training": {
            "row_pruning": {
                "shared_parameters": {"enabled": True, "schedule_offset": 0, "method": method},
                "different_groups": {
                    "rp": {
                        "params": {"dense_ratio": 0.5},
                        "modules": ["fc1"],
                        "related_modules": [["fc2"]],
                    }
                },
            }
        }
    }


def test_init_compression_builds_deepspeed_classes():
    model = init_compression(_Net(), _row_config())
    assert isinstance(model.emb, Embedding_Compress)
    assert isinstance(model.fc1, LinearLayer_Compress)
    assert isinstance(model.conv, Conv2dLayer_Compress)
    assert isinstance(model.bn, BNLayer_Compress)


def test_linear_get_mask_and_fix_helpers():
    model = init_compression(_Net(), _row_config())
    w = torch.tensor([[1.0, 0, 0, 0], [0, 0, 0, 5], [0, 2, 0, 0], [0, 0, 3, 0]])
    model.fc1.weight.data.copy_(w)
    # re-attach so the l1 mask is ranked on these weights: row L1 norms 1, 5, 2, 3 -> keep 5, 3
    model.fc1.enable_row_pruning(0.5, "l1")
    assert model.fc1.get_mask("row").view(-1).tolist() == [0, 1, 0, 1]
    with pytest.raises(ValueError, match="pruning_type='channel'"):
        model.fc1.get_mask("channel")
    keep = model.fc1.fix_row_col_pruning_helper(dim_reduction=True)
    assert model.fc1.weight.tolist() == [[0, 0, 0, 5], [0, 0, 3, 0]]
    assert model.fc2.fix_row_col_pruning_helper(keep) is None
    assert model.fc2.in_features == 2


def test_linear_skip_bias_add_returns_output_and_bias():
    layer = LinearLayer_Compress(2, 1)
    layer.weight.data = torch.tensor([[1.0, 2.0]])
    layer.bias.data = torch.tensor([0.5])
    out, bias = layer(torch.tensor([[3.0, 4.0]]), skip_bias_add=True)
    assert out.tolist() == [[11.0]] and bias.tolist() == [0.5]
    assert layer(torch.tensor([[3.0, 4.0]])).tolist() == [[11.5]]


def test_head_pruning_reshape_zeroes_input_blocks():
    layer = LinearLayer_Compress(4, 1, bias=False)
    layer.enable_head_pruning(0.5, "topk", 2)
    w = torch.tensor([[1.0, 2.0, 3.0, 4.0]])
    # two heads of 2 input features each; mask drops head 0
    assert layer.head_pruning_reshape(w, torch.tensor([[0.0, 1.0]])).tolist() == [
        [0.0, 0.0, 3.0, 4.0]
    ]


def test_conv_and_batchnorm_channel_helpers():
    conv = Conv2dLayer_Compress(1, 2, 1)
    conv.weight.data = torch.tensor([1.0, -3.0]).view(2, 1, 1, 1)
    conv.enable_channel_pruning(0.5, "l1")  # kernel L1 norms 1, 3: keep channel 1
    assert conv.get_mask("channel").view(-1).tolist() == [0, 1]
    keep = conv.fix_channel_pruning_helper(dim_reduction=True)
    bn = BNLayer_Compress(2)
    bn.running_mean = torch.tensor([7.0, 9.0])
    bn.fix_channel_pruning_helper(keep)
    assert conv.out_channels == 1 and bn.running_mean.tolist() == [9.0]


def test_quant_act_takes_deepspeeds_argument_order():
    act = QuantAct(0.0, "symmetric")  # momentum 0: the range is the last batch's
    act.train()
    # 2 bits, range [-1, 1]: scale 2 * 1 / 4 = 0.5, levels -2..1 -> 1.0 clamps to 0.5
    out = act(torch.tensor([-1.0, 0.3, 1.0]), 2, "ignored")
    assert out.tolist() == [-1.0, 0.5, 0.5]
    assert act.quant_mode == "symmetric"


@pytest.mark.parametrize("cls", [ColumnParallelLinear_Compress, RowParallelLinear_Compress])
def test_tensor_parallel_layers_are_refused(cls):
    with pytest.raises(ValueError, match="mpu=None"):
        cls(object(), 4, 4)


# -- distillation -------------------------------------------------------------------------------


def test_kd_loss_hand_values():
    student = torch.zeros(1, 2)
    teacher = torch.tensor([[math.log(3.0), 0.0]])  # p_t = (3/4, 1/4); p_s = (1/2, 1/2)
    expected = 0.75 * math.log(1.5) + 0.25 * math.log(0.5)
    assert kd_loss(student, teacher).item() == pytest.approx(expected, rel=1e-6)
    # T = 2: p_t = (sqrt3, 1) / (1 + sqrt3), and the loss is scaled by T^2 = 4
    a = math.sqrt(3.0) / (1 + math.sqrt(3.0))
    expected_t2 = 4 * (a * math.log(2 * a) + (1 - a) * math.log(2 * (1 - a)))
    assert kd_loss(student, teacher, temperature=2.0).item() == pytest.approx(expected_t2, rel=1e-6)
    # averaged over positions: a second, identical position leaves it unchanged; equal logits: 0
    two = kd_loss(student.expand(3, 2), teacher.expand(3, 2))
    assert two.item() == pytest.approx(expected, rel=1e-6)
    assert kd_loss(teacher, teacher).item() == pytest.approx(0.0, abs=1e-7)


def test_kd_loss_gradient_reaches_only_the_student():
    student = torch.zeros(1, 2, requires_grad=True)
    teacher = torch.tensor([[1.0, 0.0]], requires_grad=True)
    kd_loss(student, teacher).backward()
    # d/ds KL(p_t || softmax(s)) = softmax(s) - p_t
    p_t = torch.softmax(teacher.detach(), -1)
    torch.testing.assert_close(student.grad, torch.full((1, 2), 0.5) - p_t)
    assert teacher.grad is None


def test_kd_loss_errors_name_the_argument():
    with pytest.raises(ValueError, match="temperature=0"):
        kd_loss(torch.zeros(1, 2), torch.zeros(1, 2), temperature=0)
    with pytest.raises(ValueError, match="differ"):
        kd_loss(torch.zeros(1, 2), torch.zeros(1, 3))


def test_hidden_state_mse_with_layer_map():
    student = [torch.ones(2), torch.zeros(2)]
    teacher = [torch.zeros(2), torch.full((2,), 2.0), torch.full((2,), 3.0)]
    # student 0 vs teacher 1: (1 - 2)^2 = 1; student 1 vs teacher 2: 3^2 = 9 -> mean 5
    assert hidden_state_mse(student, teacher, [1, 2]).item() == 5.0
    assert hidden_state_mse(student, teacher[:2]).item() == (1.0 + 4.0) / 2
    with pytest.raises(ValueError, match="layer_map"):
        hidden_state_mse(student, teacher)


def test_capture_outputs_records_named_modules_in_order():
    net = nn.Sequential(nn.Linear(2, 2), nn.ReLU(), nn.Linear(2, 1))
    x = torch.tensor([[1.0, -1.0]])
    with capture_outputs(net, ["2", "0"]) as seen:
        out = net(x)
    assert torch.equal(seen.outputs[0], out)
    assert torch.equal(seen.outputs[1], net[0](x))
    assert not net[0]._forward_hooks  # removed on exit
    with pytest.raises(ValueError, match="no submodule"):
        capture_outputs(net, ["h.0"])


# -- kernel-shaped weight groups -----------------------------------------------------------------


def wq_config(bits: int, modules: str = "fc1", in_forward: bool = True) -> dict:
    """Weight quantization at ``bits`` (start = target) of ``modules`` from step 0."""
    return {
        "compression_training": {
            "weight_quantization": {
                "shared_parameters": {
                    "enabled": True,
                    "schedule_offset": 0,
                    "quantize_weight_in_forward": in_forward,
                },
                "different_groups": {
                    "wq": {
                        "params": {"start_bits": bits, "target_bits": bits},
                        "modules": [modules],
                    }
                },
            }
        }
    }


def test_set_weight_group_size_gives_one_scale_per_row_piece():
    model = init_compression(_Net(), wq_config(3))
    assert set_weight_group_size(model, 2) == 1
    assert model.fc1.weight_quantize_num_groups == 8  # 16 weights / 2 columns
    model.fc1.weight.data = torch.tensor(
        [[1.0, 0.5, 4.0, 1.0], [-2.0, 1.0, 0.25, 0.125]] * 2
    )  # (4, 4)
    redundancy_clean(model, wq_config(3))
    # 3 bits: scale = 2 * max|group| / 8; levels -4..3
    # (1, .5): s .25 -> 1 clamps to .75, .5 | (4, 1): s 1 -> 4 clamps to 3, 1
    # (-2, 1): s .5 -> -2, 1 | (.25, .125): s .0625 -> .25 clamps to .1875, .125
    row0 = [0.75, 0.5, 3.0, 1.0]
    row1 = [-2.0, 1.0, 0.1875, 0.125]
    assert model.fc1.weight.tolist() == [row0, row1, row0, row1]


def test_set_weight_group_size_errors():
    model = init_compression(_Net(), wq_config(8))
    with pytest.raises(ValueError, match="in_features=4"):
        set_weight_group_size(model, 3)
    with pytest.raises(ValueError, match="group_size=0"):
        set_weight_group_size(model, 0)
    assert set_weight_group_size(model, None) == 1
    assert model.fc1.weight_quantize_num_groups == 4  # one per row
