"""DeepSpeed module paths under ``runtime``/``utils`` (single process): tiling, leaf modules by
name, partition helpers (DeepSpeed 0.19.8 goldens), lr-schedule argument helpers,
``SparseTensor``, ``config_utils``, the checkpoint engine, generation unwrapping."""

from __future__ import annotations

import argparse
import json

import pytest
import torch
import torch.nn as nn
from pydantic import Field

# -- TiledLinear ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("in_splits", "out_splits", "bias"), [(1, 1, True), (3, 2, True), (4, 5, False), (7, 1, True)]
)
def test_tiled_linear_equals_the_linear_it_tiles(in_splits, out_splits, bias):
    from shardspeed.runtime.zero.tiling import TiledLinear

    torch.manual_seed(0)
    linear = nn.Linear(10, 7, bias=bias)
    tiled = TiledLinear(10, 7, bias=bias, in_splits=in_splits, out_splits=out_splits)
    tiled.copy_params_from(linear)
    assert len(tiled.linears) == out_splits and all(len(r) == in_splits for r in tiled.linears)
    x = torch.randn(3, 4, 10, requires_grad=True)
    x2 = x.detach().clone().requires_grad_(True)
    want, got = linear(x), tiled(x2)
    torch.testing.assert_close(got, want)
    want.square().sum().backward()
    got.square().sum().backward()
    torch.testing.assert_close(x2.grad, x.grad)
    # tile (r, c) got the matching block of the full weight's gradient
    rows, cols = tiled.out_parts, tiled.in_parts
    for r, row in enumerate(tiled.linears):
        for c, tile in enumerate(row):
            block = linear.weight.grad[rows[r] : rows[r + 1], cols[c] : cols[c + 1]]
            torch.testing.assert_close(tile.weight.grad, block)
            assert (tile.bias is not None) == (bias and c == in_splits - 1)


def test_tiled_linear_options_split_inputs_outputs_and_init():
    from shardspeed.runtime.zero.tiling import TiledLinear

    torch.manual_seed(1)
    linear = nn.Linear(9, 6)
    tiled = TiledLinear(
        9, 6, in_splits=2, out_splits=3, input_is_already_split=True, combine_out_splits=False,
        init_linear=linear,
    )  # fmt: skip
    assert tiled.in_parts == [0, 5, 9] and tiled.out_parts == [0, 2, 4, 6]
    x = torch.randn(2, 9)
    outs = tiled([x[:, :5], x[:, 5:]])
    assert isinstance(outs, list) and len(outs) == 3
    torch.testing.assert_close(torch.cat(outs, -1), linear(x))
    with pytest.raises(ValueError, match="expects 2 input chunks"):
        tiled([x])
    with pytest.raises(ValueError, match=r"in_splits=10.*\[1, in_features=9\]"):
        TiledLinear(9, 6, in_splits=10)
    with pytest.raises(ValueError, match="other.weight has shape"):
        tiled.copy_params_from(nn.Linear(6, 9))
    with pytest.raises(ValueError, match="bias=True"):
        tiled.copy_params_from(nn.Linear(9, 6, bias=False))
    assert set(tiled.state_dict()) >= {"linears.0.0.weight", "linears.2.1.bias"}


class _ReturnBiasLinear(nn.Linear):
    """Megatron-style: returns (x @ W^T, bias) without adding the bias."""

    def forward(self, x):
        return nn.functional.linear(x, self.weight), self.bias


def test_tiled_linear_return_bias_passes_the_bias_through():
    from shardspeed.runtime.zero.tiling import TiledLinearReturnBias

    torch.manual_seed(2)
    linear = nn.Linear(8, 6)
    tiled = TiledLinearReturnBias(
        8, 6, in_splits=2, out_splits=2, linear_cls=_ReturnBiasLinear, init_linear=linear
    )
    x = torch.randn(5, 8)
    out, bias = tiled(x)
    torch.testing.assert_close(out, x @ linear.weight.T)
    torch.testing.assert_close(bias, linear.bias)
    no_bias = TiledLinearReturnBias(8, 6, bias=False, in_splits=2, linear_cls=_ReturnBiasLinear)
    assert no_bias(x)[1] is None


# -- leaf modules by name / suffix -----------------------------------------------------------


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.Linear(4, 4)
        self.mlp = nn.Sequential(nn.Linear(4, 4))


class _Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Block(), _Block()])


def test_set_z3_leaf_modules_by_name_and_suffix():
    from shardspeed import utils

    net = _Net()
    leaves, missing = utils.set_z3_leaf_modules_by_name(net, ["layers.0.attn", "nope"], True, False)
    assert leaves == [net.layers[0].attn] and missing == ["nope"]
    assert utils.z3_leaf_module(net.layers[0].attn) and not utils.z3_leaf_module(net.layers[1].attn)
    with pytest.raises(ValueError, match=r"No modules named \['nope'\].*layers"):
        utils.set_z3_leaf_modules_by_name(net, ["nope"])
    leaves, missing = utils.set_z3_leaf_modules_by_suffix(net, ["attn", ".attn"])
    assert leaves == [net.layers[0].attn, net.layers[1].attn] and missing == []
    assert utils.get_z3_leaf_modules(net) == leaves
    leaves, _ = utils.set_z3_leaf_modules_by_suffix(net, ["attn"], flag=False)
    assert utils.get_z3_leaf_modules(net) == []
    with pytest.raises(ValueError, match="matching suffixes"):
        utils.set_z3_leaf_modules_by_suffix(net, ["missing"])
    # a leaf that holds stage-3 units of its own (the layer list) is refused
    with pytest.raises(ValueError, match="stage-3 units of its own"):
        utils.set_z3_leaf_modules_by_name(net, ["layers"])
    assert utils.set_z3_leaf_modules_by_name(net, ["layers.0"])[0] == [net.layers[0]]


def test_safe_accessor_names_match_deepspeed_utils():
    import shardspeed.utils as utils

    names = [
        "safe_get_full_fp32_param", "safe_get_full_grad", "safe_get_full_optimizer_state",
        "safe_set_full_fp32_param", "safe_set_full_optimizer_state", "safe_set_full_grad",
        "safe_get_local_fp32_param", "safe_get_local_grad", "safe_get_local_optimizer_state",
        "safe_set_local_fp32_param", "safe_set_local_grad", "safe_set_local_optimizer_state",
        "safe_update_full_grad_vectorized",
    ]  # fmt: skip
    assert all(callable(getattr(utils, n)) for n in names)
    with pytest.raises(ValueError, match="not trained by a ShardSpeed engine"):
        utils.safe_set_full_grad(nn.Parameter(torch.zeros(2)), torch.ones(2))


# -- partition helpers: DeepSpeed 0.19.8 outputs ------------------------------------------------

UNIFORM_GOLDENS = {
    (10, 3): [0, 4, 7, 10],
    (7, 7): [0, 1, 2, 3, 4, 5, 6, 7],
    (3, 5): [0, 1, 2, 3, 3, 3],
    (0, 2): [0, 0, 0],
    (11, 4): [0, 3, 6, 9, 11],
    (100, 7): [0, 15, 30, 44, 58, 72, 86, 100],
}
BALANCED_GOLDENS = [
    ([1, 2, 3, 4, 5, 6], 3, [0, 3, 5, 6]),
    ([5, 1, 1, 1, 1, 5], 2, [0, 3, 6]),
    ([1, 1, 1, 1], 2, [0, 2, 4]),
    ([3, 3, 3], 5, [0, 1, 2, 3, 3, 3]),
    ([10, 1, 1, 1, 1, 1, 1, 10], 3, [0, 1, 7, 8]),
    ([0, 0, 0, 0], 2, [0, 3, 4]),
    ([2, 7, 1, 8, 2, 8, 1, 8], 4, [0, 2, 4, 6, 8]),
    ([1.5, 2.5, 0.5, 4.0], 2, [0, 3, 4]),
    ([4, 1, 1, 1, 4], 3, [0, 1, 4, 5]),
]


def test_partition_uniform_and_balanced_match_deepspeed():
    from shardspeed.runtime.utils import partition_balanced, partition_uniform

    for args, want in UNIFORM_GOLDENS.items():
        assert partition_uniform(*args) == want, args
    for weights, parts, want in BALANCED_GOLDENS:
        assert partition_balanced(weights, parts) == want, (weights, parts)
        assert partition_balanced(weights, parts, eps=1e-2) == want  # older signature


# -- lr schedule argument helpers ----------------------------------------------------------------


def test_lr_schedule_arguments_and_configs_follow_deepspeed():
    from shardspeed.runtime import lr_schedules as ls

    assert ls.VALID_LR_SCHEDULES == [
        "LRRangeTest", "OneCycle", "WarmupLR", "WarmupDecayLR", "WarmupCosineLR",
    ]  # fmt: skip
    assert (ls.LR_SCHEDULE, ls.WARMUP_MAX_LR, ls.CYCLE_MIN_LR) == (
        "lr_schedule", "warmup_max_lr", "cycle_min_lr",
    )  # fmt: skip
    parser = ls.add_tuning_arguments(argparse.ArgumentParser())
    args = parser.parse_args([])
    assert args.lr_schedule is None
    assert ls.get_config_from_args(args) == (None, "--lr_schedule not specified on command line")
    args = parser.parse_args(["--lr_schedule", "OneCycle"])
    assert ls.get_config_from_args(args) == (
        {
            "type": "OneCycle",
            "params": {
                "cycle_first_step_size": 1000, "cycle_first_stair_count": -1,
                "cycle_second_step_size": -1, "cycle_second_stair_count": -1,
                "decay_step_size": 1000, "cycle_min_lr": 0.01, "cycle_max_lr": 0.1,
                "decay_lr_rate": 0.0, "cycle_min_mom": 0.8, "cycle_max_mom": 0.9,
                "decay_mom_rate": 0.0,
            },
        },
        None,
    )  # fmt: skip
    args = parser.parse_args(["--lr_schedule", "WarmupCosineLR", "--warmup_num_steps", "7"])
    config, _ = ls.get_config_from_args(args)
    assert config["params"] == {
        "warmup_num_steps": 7, "warmup_type": "log", "warmup_min_ratio": 0.01,
        "cos_min_ratio": 0.01,
    }  # fmt: skip
    args = parser.parse_args(["--lr_schedule", "WarmupDecayLR", "--lr_range_test_staircase"])
    config, _ = ls.get_config_from_args(args)
    assert config["params"] == {
        "warmup_min_lr": 0, "warmup_max_lr": 0.001, "warmup_num_steps": 1000, "warmup_type": "log",
    }  # fmt: skip
    assert ls.get_lr_from_config(config) == (0.001, "")
    assert ls.get_config_from_args(parser.parse_args(["--lr_schedule", "X"]))[1] == (
        "X is not supported LR schedule"
    )
    params: dict = {}
    ls.override_params(args, params)
    assert params["lr_range_test_staircase"] is True and params["cycle_max_lr"] == 0.1
    assert ls.get_lr_from_config({"type": "OneCycle", "params": {"cycle_max_lr": 0.3}}) == (0.3, "")
    assert (
        ls.get_lr_from_config({"type": "LRRangeTest", "params": {"lr_range_test_min_lr": 2}})[0]
        == 2
    )
    assert ls.get_lr_from_config({"type": "WarmupCosineLR", "params": {}})[0] is None
    assert ls.get_lr_from_config({"params": {}}) == (None, "LR schedule type not defined in config")
    # a built schedule still takes the parsed params
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(1))], lr=0.5)
    sched = ls.WarmupLR(opt, **config["params"])
    assert opt.param_groups[0]["lr"] == 0 and sched is not None


# -- SparseTensor ---------------------------------------------------------------------------------


def test_sparse_tensor_round_trips_and_adds_rows():
    from shardspeed.runtime.sparse_tensor import SparseTensor

    emb = nn.Embedding(10, 3, sparse=True)
    emb(torch.tensor([1, 4, 4])).sum().backward()
    st = SparseTensor(emb.weight.grad)
    assert SparseTensor.type() == "deepspeed.SparseTensor" and st.dtype == torch.float32
    assert st.indices.tolist() == [1, 4] and st.dense_size == [10, 3]
    torch.testing.assert_close(st.to_dense(), emb.weight.grad.to_dense())
    assert st.sparse_size() == (2 + 6, 30)
    st.add(SparseTensor(emb.weight.grad))
    assert st.indices.tolist() == [1, 4, 1, 4]
    torch.testing.assert_close(st.to_coo_tensor().to_dense(), 2 * emb.weight.grad.to_dense())
    assert "reduction_factor" in str(st)
    with pytest.raises(ValueError, match="natively sparse"):
        SparseTensor(torch.zeros(2, 2))
    with pytest.raises(ValueError, match="dense sizes differ"):
        st.add(SparseTensor(torch.zeros(3, 3).to_sparse()))


# -- config_utils ---------------------------------------------------------------------------------


def test_config_utils_deprecated_fields_and_helpers():
    from shardspeed.runtime import config_utils as cu

    class Inner(cu.DeepSpeedConfigModel):
        size: int = 1

    class Conf(cu.DeepSpeedConfigModel):
        new_size: int = 0
        inner: Inner = Inner()
        old_size: str = Field(
            "0",
            json_schema_extra={"deprecated": True, "new_param": "new_size", "new_param_fn": int},
        )
        old_inner: int = Field(0, json_schema_extra={"deprecated": True, "new_param": "inner.size"})
        gone: int = Field(0, json_schema_extra={"deprecated": True, "deprecated_msg": "unused"})

    assert Conf(old_size="12").new_size == 12
    assert Conf(old_inner=5).inner.size == 5
    assert Conf(new_size="auto").new_size == 0  # "auto" dropped unless strict
    with pytest.raises(ValueError, match="keep only 'new_size'"):
        Conf(old_size="1", new_size=2)
    with pytest.raises(ValueError):
        Conf(unknown=1)  # extra="forbid"
    assert Conf(gone=3).gone == 3
    assert cu.get_config_default(Conf, "new_size") == 0
    assert cu.get_scalar_param({"a": 1}, "a", 2) == 1 and cu.get_list_param({}, "b", [3]) == [3]
    assert cu.get_dict_param({}, "c", {"d": 1}) == {"d": 1}
    with pytest.raises(ValueError, match=r"Duplicate keys in DeepSpeed config: \['a'\]"):
        json.loads('{"a": 1, "a": 2}', object_pairs_hook=cu.dict_raise_error_on_duplicate_keys)
    # DeepSpeed 0.19.8 output, recorded
    text = json.dumps(
        {"a": 12345, "b": [1, 2000.5], "c": {"d": True, "e": "x"}, "f": 0.5},
        cls=cu.ScientificNotationEncoder,
        indent=2,
    )
    assert text == (
        '{\n  "a": 1.234500e+04, \n  "b": [1, 2.000500e+03], \n  "c": {\n    "d": true, \n'
        '    "e": "x"\n  }, \n  "f": 0.5\n}'
    )
    obj = cu.DeepSpeedConfigObject()
    obj.x, obj.y = 5000, "s"
    assert repr(obj) == '{\n    "x": 5.000000e+03, \n    "y": "s"\n}'
    assert repr(cu.pp_int(100000)) == "100,000" and repr(cu.pp_int(5, "five")) == "five"


# -- checkpoint engine ----------------------------------------------------------------------------


def test_torch_checkpoint_engine_saves_loads_and_commits(tmp_path):
    from shardspeed.runtime.checkpoint_engine import (
        CheckpointCommitInfo,
        CheckpointEngine,
        TorchCheckpointEngine,
        create_checkpoint_engine,
    )

    engine = create_checkpoint_engine(None, None, 0, False, False)
    assert isinstance(engine, TorchCheckpointEngine) and isinstance(engine, CheckpointEngine)
    assert engine.name == "TorchCheckpointEngine" and engine.zipfile_serialization is False
    info = CheckpointCommitInfo(tag="step1", save_dir=str(tmp_path), save_latest=True)
    engine.create(info)
    engine.makedirs(str(tmp_path / "step1"), exist_ok=True)
    state = {"w": torch.arange(4.0), "args": argparse.Namespace(lr=0.1)}
    engine.save(state, str(tmp_path / "step1" / "model.pt"))
    assert engine.commit(info) is True
    back = engine.load(str(tmp_path / "step1" / "model.pt"), map_location="cpu")
    torch.testing.assert_close(back["w"], state["w"])
    assert back["args"].lr == 0.1
    assert engine.is_data_parallel_writer(0) and not engine.is_data_parallel_writer(1)
    assert not engine.is_decoupled() and engine.get_commit_info() is None
    zipped = TorchCheckpointEngine(
        type("C", (), {"checkpoint_config": {"checkpoint_serialization": True}})()
    )
    assert zipped.zipfile_serialization is True
    with pytest.raises(TypeError):
        CheckpointEngine()  # abstract


# -- generation unwrapping ------------------------------------------------------------------------


def test_unwrap_model_for_generation_passes_a_plain_module_through():
    from shardspeed.runtime.zero.stage3 import attach_parameter_offload, unwrap_model_for_generation

    model = nn.Linear(2, 2)
    with unwrap_model_for_generation(model) as unwrapped:
        assert unwrapped is model
    assert attach_parameter_offload(model) is None
