"""The ``compression_training`` block: defaults, DeepSpeed's keys, refusals by name."""

from __future__ import annotations

import json

import pytest

from shardspeed.compression import get_compression_config
from shardspeed.config.base import ConfigError


def _block(**techniques) -> dict:
    return {"compression_training": techniques}


def test_absent_block_is_all_off():
    config = get_compression_config({"train_batch_size": 8})
    assert config.enabled_techniques() == []
    assert config.weight_quantization.shared_parameters.schedule_offset == 0
    assert config.row_pruning.shared_parameters.schedule_offset == 1000  # DeepSpeed defaults


def test_full_deepspeed_block_parses(tmp_path):
    block = {
        "weight_quantization": {
            "shared_parameters": {
                "enabled": True,
                "quantizer_kernel": False,
                "schedule_offset": 0,
                "quantize_groups": 1,
                "quantize_verbose": False,
                "quantization_type": "symmetric",
                "quantize_weight_in_forward": False,
                "rounding": "nearest",
                "fp16_mixed_quantize": {"enabled": False, "quantize_change_ratio": 0.001},
            },
            "different_groups": {
                "wq1": {
                    "params": {"start_bits": 8, "target_bits": 8, "quantization_period": 50},
                    "modules": ["attention.self", "intermediate"],
                }
            },
        },
        "activation_quantization": {
            "shared_parameters": {
                "enabled": True,
                "quantization_type": "asymmetric",
                "range_calibration": "static",
                "schedule_offset": 50,
            },
            "different_groups": {"aq1": {"params": {"bits": 8}, "modules": ["attention"]}},
        },
        "sparse_pruning": {
            "shared_parameters": {"enabled": True, "schedule_offset": 30, "method": "l1"},
            "different_groups": {"sp1": {"params": {"dense_ratio": 0.5}, "modules": ["x"]}},
        },
        "channel_pruning": {
            "shared_parameters": {"enabled": True, "schedule_offset": 0, "method": "topk"},
            "different_groups": {
                "cp1": {
                    "params": {"dense_ratio": 0.5},
                    "modules": ["conv1"],
                    "related_modules": [["bn1", "conv2"]],
                }
            },
        },
        "layer_reduction": {
            "enabled": True,
            "keep_number_layer": 2,
            "module_name_prefix": "bert.encoder.layer",
            "teacher_layer": [2, 5],
            "other_module_name": ["bert.pooler"],
        },
    }
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"compression_training": block}))
    config = get_compression_config(str(path))
    assert config.enabled_techniques() == [
        "weight_quantization",
        "activation_quantization",
        "sparse_pruning",
        "channel_pruning",
    ]
    assert config.channel_pruning.different_groups["cp1"].related_modules == [["bn1", "conv2"]]


@pytest.mark.parametrize(
    ("block", "match"),
    [
        ({"weight_quantizaton": {}}, "did you mean 'weight_quantization'"),
        (
            {"weight_quantization": {"shared_parameters": {"quantizer_kernel": True}}},
            "quantizer_kernel.*CUDA quantizer kernel is not implemented",
        ),
        (
            {"sparse_pruning": {"shared_parameters": {"method": "snip_momentum"}}},
            "method: snip_momentum needs Intel neural-compressor",
        ),
        (
            {"sparse_pruning": {"shared_parameters": {"block_pattern": "4x1"}}},
            "block_pattern: is read only by the snip_momentum method",
        ),
        (
            {"head_pruning": {"shared_parameters": {"method": "l1"}}},
            "head pruning by l1 norm is not implemented",
        ),
        (
            {"head_pruning": {"shared_parameters": {"enabled": True}, "different_groups": {}}},
            "different_groups: is required when the technique is enabled",
        ),
        (
            {
                "head_pruning": {
                    "shared_parameters": {"enabled": True},
                    "different_groups": {"g": {"params": {"dense_ratio": 0.5}, "modules": ["o"]}},
                }
            },
            "num_heads: is required when head pruning is enabled",
        ),
        (
            {
                "row_pruning": {
                    "different_groups": {"g": {"params": {"dense_ratio": 0}, "modules": ["a"]}}
                }
            },
            "dense_ratio: is the fraction of weights kept",
        ),
        (
            {
                "row_pruning": {
                    "different_groups": {
                        "g": {
                            "params": {"dense_ratio": 0.5},
                            "modules": ["a", "b"],
                            "related_modules": [["c"]],
                        }
                    }
                }
            },
            "related_modules: needs one list of patterns per entry",
        ),
        (
            {
                "weight_quantization": {
                    "different_groups": {
                        "g": {"params": {"start_bits": 4, "target_bits": 8}, "modules": ["a"]}
                    }
                }
            },
            "target_bits: must not exceed start_bits",
        ),
        (
            {
                "weight_quantization": {
                    "shared_parameters": {"rounding": "stochastic"},
                    "different_groups": {
                        "g": {"params": {"start_bits": 8, "target_bits": 1}, "modules": ["a"]}
                    },
                }
            },
            "binary and ternary weights round to nearest only",
        ),
        (
            {"activation_quantization": {"different_groups": {"g": {"params": {"bits": 6}}}}},
            "bits",
        ),
        (
            {
                "layer_reduction": {
                    "enabled": True,
                    "module_name_prefix": "h",
                    "teacher_layer": [1],
                    "keep_number_layer": 3,
                }
            },
            "keep_number_layer: must equal the number of teacher_layer entries",
        ),
        (
            {
                "sparse_pruning": {
                    "shared_parameters": {"schedule_offset": 5, "schedule_offset_end": 2}
                }
            },
            "schedule_offset_end: must not be before schedule_offset",
        ),
    ],
)
def test_refusals_name_the_key(block, match):
    with pytest.raises(ConfigError, match=match) as err:
        get_compression_config(_block(**block))
    assert "compression_training." in str(err.value)


def test_bad_argument_type_and_missing_file():
    with pytest.raises(ValueError, match="no such file"):
        get_compression_config("/nonexistent/ds.json")
    with pytest.raises(ValueError, match="expected a dict or a JSON file path"):
        get_compression_config(42)
