"""DeepSpeed's API surface, through ``import shardspeed as deepspeed``.

Every name in ``deepspeed_api_names.txt`` resolves as an attribute chain after a bare
import (in a fresh interpreter, as DeepSpeed's eager subpackages do); module paths import
with ``import_module``; and the re-exported helpers keep DeepSpeed's semantics (CPU
accelerator answers, ``clip_grad_norm_``, ``clone_tensors_for_torch_save``, config values
DeepSpeed accepts). Multi-rank pieces (groups, ``_zero3_consolidated_16bit_state_dict``,
``zero_to_fp32``) are in ``tests/dist/test_deepspeed_api_dist.py``.
"""

from __future__ import annotations

import importlib
import json
import math
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

import shardspeed as deepspeed

NAMES_FILE = Path(__file__).with_name("deepspeed_api_names.txt")


def _entries() -> list[tuple[str, bool]]:
    """``(dotted path, must be a module)`` for each line of the names file."""
    entries = []
    for line in NAMES_FILE.read_text().splitlines():
        path, _, comment = line.partition("#")
        if path.strip():
            entries.append((path.strip(), comment.strip() == "module"))
    return entries


_WALK = """
import json, sys
import shardspeed as deepspeed
missing = []
for path in json.loads(sys.argv[1]):
    obj = deepspeed
    try:
        for part in path.split("."):
            obj = getattr(obj, part)
    except AttributeError as exc:
        missing.append(f"{path}: {exc}")
print(json.dumps(missing))
"""


def test_every_listed_name_is_an_attribute_after_a_bare_import() -> None:
    paths = [path for path, _ in _entries()]
    assert len(paths) > 100
    out = subprocess.run(
        [sys.executable, "-c", _WALK, json.dumps(paths)],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


@pytest.mark.parametrize("path", [p for p, is_module in _entries() if is_module])
def test_module_paths_import(path: str) -> None:
    module = importlib.import_module(f"shardspeed.{path}")
    assert isinstance(module, ModuleType)
    obj = deepspeed
    for part in path.split("."):
        obj = getattr(obj, part)
    assert obj is module


def test_bare_import_stays_cheap() -> None:
    code = "import sys, shardspeed; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_engine_names_are_the_one_engine() -> None:
    from shardspeed.runtime.engine import DeepSpeedEngine, ShardSpeedEngine

    assert deepspeed.DeepSpeedEngine is DeepSpeedEngine is ShardSpeedEngine
    assert callable(ShardSpeedEngine._zero3_consolidated_16bit_state_dict)


def test_version_info() -> None:
    assert deepspeed.version == deepspeed.__version__ == deepspeed.git_version_info.version
    assert set(deepspeed.git_version_info.torch_info) >= {"version", "cuda_version"}


# -- accelerator: DeepSpeed's CPU accelerator answers -------------------------------------
@pytest.fixture
def cpu_accel(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("SHARDSPEED_ACCELERATOR", "cpu")
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    monkeypatch.delenv("LOCAL_SIZE", raising=False)
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    return deepspeed.get_accelerator()


def test_cpu_accelerator_device_methods(cpu_accel, monkeypatch: pytest.MonkeyPatch) -> None:
    assert cpu_accel.device_name() == cpu_accel.current_device_name() == "cpu"
    assert cpu_accel.current_device() == 0 and cpu_accel.device_count() == 1
    monkeypatch.setenv("LOCAL_RANK", "3")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    assert cpu_accel.current_device() == 3 and cpu_accel.device_count() == 4
    assert cpu_accel.is_available() and cpu_accel.communication_backend_name() == "gloo"
    assert cpu_accel.is_synchronized_device() and cpu_accel.use_host_timers()
    assert cpu_accel.is_bf16_supported() and cpu_accel.is_fp64_supported()
    assert torch.float32 in cpu_accel.supported_dtypes()
    assert cpu_accel.on_accelerator(torch.zeros(1))
    assert cpu_accel.Stream is None and cpu_accel.Event is None
    assert cpu_accel.current_stream() is None and cpu_accel.create_graph() is None
    with cpu_accel.stream(None):
        pass
    assert cpu_accel.FloatTensor is torch.FloatTensor and cpu_accel.LongTensor is torch.LongTensor
    assert cpu_accel.empty_cache() is None and cpu_accel.synchronize() is None
    assert cpu_accel.memory_allocated() == 0 and cpu_accel.memory_stats() == {}
    assert cpu_accel.total_memory() >= cpu_accel.available_memory() > 0
    assert cpu_accel.lazy_call(lambda: 7) == 7
    assert deepspeed.accelerator.is_current_accelerator_supported()


def test_cpu_accelerator_rng(cpu_accel) -> None:
    cpu_accel.manual_seed(123)
    a = torch.rand(3)
    cpu_accel.manual_seed_all(123)
    assert torch.equal(torch.rand(3), a) and cpu_accel.initial_seed() == 123
    state = cpu_accel.get_rng_state()
    b = torch.rand(3)
    cpu_accel.set_rng_state(state)
    assert torch.equal(torch.rand(3), b)
    assert cpu_accel.default_generator(0) is torch.default_generator


# -- runtime.utils ------------------------------------------------------------------------
def test_set_random_seed_seeds_random_numpy_and_torch() -> None:
    import random

    import numpy as np

    from shardspeed.runtime.utils import set_random_seed

    set_random_seed(2**40 + 5)  # larger than numpy accepts: reduced as DeepSpeed does
    first = (random.random(), np.random.rand(), torch.rand(1).item())
    set_random_seed(2**40 + 5)
    assert (random.random(), np.random.rand(), torch.rand(1).item()) == first


def test_clip_grad_norm_matches_torch_single_process() -> None:
    from shardspeed.runtime.utils import clip_grad_norm_

    for norm_type in (2.0, 1.0, math.inf):
        torch.manual_seed(0)
        ours = [torch.nn.Parameter(torch.randn(4, 3)) for _ in range(3)]
        ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
        for p, q in zip(ours, ref):
            p.grad = torch.randn_like(p) * 5
            q.grad = p.grad.clone()
        total = clip_grad_norm_(ours, max_norm=1.0, norm_type=norm_type)
        expected = torch.nn.utils.clip_grad_norm_(ref, max_norm=1.0, norm_type=norm_type)
        torch.testing.assert_close(total.reshape(()), expected, rtol=1e-5, atol=1e-6)
        for p, q in zip(ours, ref):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-5, atol=1e-6)


def test_see_memory_usage_is_quiet_unless_forced(caplog: pytest.LogCaptureFixture) -> None:
    from shardspeed.runtime.utils import see_memory_usage

    with caplog.at_level("INFO"):
        see_memory_usage("not shown")
        see_memory_usage("after step", force=True)
    text = caplog.text
    assert "not shown" not in text and "after step" in text and "MA " in text


# -- checkpoint.utils ---------------------------------------------------------------------
def test_clone_tensors_for_torch_save() -> None:
    from collections import OrderedDict

    from shardspeed.checkpoint.utils import clone_tensors_for_torch_save

    flat = torch.arange(10.0)
    item = OrderedDict(a=flat[:3], b=[flat[3:5], (flat[5:], 7)], c="x")
    out = clone_tensors_for_torch_save(item)
    assert type(out) is OrderedDict and out["c"] == "x" and out["b"][1][1] == 7
    assert torch.equal(out["a"], flat[:3]) and out["a"].untyped_storage().nbytes() == 12
    assert out["a"].data_ptr() != flat.data_ptr() and isinstance(out["b"][1], tuple)
    assert clone_tensors_for_torch_save(flat, device="cpu").device.type == "cpu"


# -- config: values DeepSpeed accepts ----------------------------------------------------
def test_steps_per_print_infinity_means_never() -> None:
    from shardspeed.config import load_config

    cfg = load_config({"train_batch_size": 8, "steps_per_print": float("inf")})
    assert cfg.steps_per_print is None
    assert load_config({"train_batch_size": 8, "steps_per_print": 5}).steps_per_print == 5
    with pytest.raises(deepspeed.DeepSpeedConfigError):
        load_config({"train_batch_size": 8, "steps_per_print": -1})


def test_load_config_sections_leave_unresolved_auto_elsewhere() -> None:
    from shardspeed.config import ConfigError, load_config

    raw = {
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto"},
        "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": "auto"}},
    }
    with pytest.raises(ConfigError, match="total_num_steps"):
        load_config(raw)
    cfg = load_config(raw, sections=("fp16", "bf16", "zero_optimization"))
    assert cfg.bf16_enabled and cfg.zero_stage == 3 and cfg.scheduler is None


def test_deepspeed_config_view() -> None:
    from shardspeed.runtime.zero.config import DeepSpeedZeroConfig, ZeroStageEnum

    cfg = deepspeed.DeepSpeedConfig(
        {
            "train_batch_size": 8,
            "gradient_accumulation_steps": 2,
            "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}},
            "zero_optimization": {"stage": 2},
        }
    )
    assert (cfg.train_batch_size, cfg.train_micro_batch_size_per_gpu) == (8, 4)
    assert cfg.gradient_accumulation_steps == 2 and cfg.world_size == 1
    assert cfg.zero_optimization_stage == ZeroStageEnum.gradients and cfg.zero_enabled
    assert isinstance(cfg.zero_config, DeepSpeedZeroConfig) and cfg.bfloat16_enabled
    assert cfg.optimizer_name == "adamw" and cfg.optimizer_params == {"lr": 1e-3}
    assert cfg._param_dict["train_batch_size"] == 8


def test_precision_config_readers() -> None:
    from shardspeed.runtime.precision_config import get_bfloat16_config, get_float16_config

    assert get_bfloat16_config({"bfloat16": {"enabled": True}}).enabled  # legacy key
    assert not get_bfloat16_config({}).enabled
    fp16 = get_float16_config({"fp16": {"enabled": True, "loss_scale": 0}})
    assert fp16.enabled and fp16.loss_scale == 0


# -- activation checkpointing flags -------------------------------------------------------
def test_checkpointing_module_flags_follow_configure() -> None:
    from shardspeed.runtime.activation_checkpointing import checkpointing

    try:
        checkpointing.configure(None, partition_activations=False, checkpoint_in_cpu=True)
        assert checkpointing.CPU_CHECKPOINT is True
        assert checkpointing.PARTITION_ACTIVATIONS is False
    finally:
        checkpointing.configure(None, checkpoint_in_cpu=False)
    assert checkpointing.CPU_CHECKPOINT is False


# -- pipeline schedule names --------------------------------------------------------------
def test_train_schedule_steps_end_with_optimizer_step() -> None:
    from shardspeed.runtime.pipe.schedule import InferenceSchedule, OptimizerStep, TrainSchedule

    steps = list(TrainSchedule(micro_batches=4, stages=2, stage_id=1))
    assert isinstance(steps[-1][-1], OptimizerStep)
    assert not any(
        isinstance(i, OptimizerStep) for step in InferenceSchedule(4, 2, 0) for i in step
    )


def test_repeating_loader_restarts() -> None:
    loader = deepspeed.utils.RepeatingLoader([1, 2])
    assert [next(loader) for _ in range(5)] == [1, 2, 1, 2, 1]


# -- ZeRO-3 leaf modules ------------------------------------------------------------------
class _Experts(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.experts = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(3))


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.moe = _Experts()
        self.norm = torch.nn.LayerNorm(4)


def test_set_z3_leaf_modules_flags_modules_inside_units() -> None:
    utils = deepspeed.utils
    model = torch.nn.Sequential(_Block(), _Block())
    flagged = utils.set_z3_leaf_modules(model, [_Experts])
    assert flagged == [model[0].moe, model[1].moe]
    assert utils.get_z3_leaf_modules(model) == flagged and utils.z3_leaf_module(model[0].moe)
    assert utils.set_z3_leaf_modules(model, ["LayerNorm"]) == [model[0].norm, model[1].norm]
    assert utils.unset_z3_leaf_modules(model, [_Experts]) == flagged
    assert not utils.z3_leaf_module(model[0].moe)
    assert not utils.z3_leaf_parameter(model[0].norm.weight)
    with pytest.raises(ValueError, match="No modules of type"):
        utils.set_z3_leaf_modules(model, [torch.nn.Conv2d])
    assert utils.set_z3_leaf_modules(model, [torch.nn.Conv2d], raise_if_not_found=False) == []


def test_set_z3_leaf_modules_refuses_a_leaf_holding_its_own_units() -> None:
    model = _Experts()  # at the root: its experts are stage-3 units of their own
    with pytest.raises(ValueError, match="stage-3 units of its own"):
        deepspeed.utils.set_z3_leaf_modules(model, [_Experts])
