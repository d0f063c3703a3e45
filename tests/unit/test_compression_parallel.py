"""What compression refuses under parallelism, by name: tensor-parallel models, in-place
(MoQ) weight quantization at ZeRO stage 3, and ``redundancy_clean`` of partitioned
parameters outside their engine. (What works at stage 3 is checked on 2 ranks in
``tests/dist/test_compression_zero3.py``.)"""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from shardspeed.compression import build_compression_hook, init_compression, redundancy_clean
from shardspeed.compression.zero3 import gather_zero3

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_compression_basic_layer import wq_config  # noqa: E402


def _config(in_forward: bool) -> dict:
    return wq_config(8, "fc", in_forward)


def test_tensor_parallel_model_is_refused_with_the_reason():
    model = nn.Sequential()
    model.add_module("fc", nn.Linear(4, 4))
    model.shardspeed_tp = SimpleNamespace(tp_size=2)  # what tp_model_init / AutoTP leaves
    with pytest.raises(ValueError, match=r"weight_quantization.*tensor\s+parallelism"):
        init_compression(model, _config(True))
    with pytest.raises(ValueError, match="tp_size=2"):
        build_compression_hook(model, _config(True))
    with pytest.raises(ValueError, match="mpu=None"):
        init_compression(model, _config(True), mpu=object())


def test_stage_3_refuses_in_place_quantization_only():
    model = nn.Sequential()
    model.add_module("fc", nn.Linear(4, 4))
    init_compression(model, _config(False))
    with pytest.raises(ValueError, match="quantize_weight_in_forward=false"):
        build_compression_hook(model, _config(False), zero_stage=3)
    assert build_compression_hook(model, _config(False), zero_stage=2) is not None
    assert build_compression_hook(model, _config(True), zero_stage=3) is not None


def test_redundancy_clean_refuses_partitioned_parameters_outside_the_engine():
    model = nn.Sequential()
    model.add_module("fc", nn.Linear(4, 4))
    init_compression(model, _config(True))
    model.fc.weight._ss_flat = object()  # marks a stage-3 managed parameter
    with pytest.raises(ValueError, match="not the engine"):
        redundancy_clean(model, _config(True))
    del model.fc.weight._ss_flat
    assert gather_zero3(model) is False  # whole parameters: nothing to gather
    redundancy_clean(model, _config(True))
    assert isinstance(model.fc.weight, torch.nn.Parameter)
