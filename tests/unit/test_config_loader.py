"""shardspeed.config.load_config sources: JSON files with comments, duplicates, base64, paths."""

from __future__ import annotations

import base64
import json

import pytest

from shardspeed.config import ConfigError, load_config, parse_json_text

COMMENTED = """\
// ds_config with comments
{
  /* batch
     settings */
  "train_micro_batch_size_per_gpu": 4, // per rank
  "gradient_accumulation_steps": 2,
  "tensorboard": {
    "enabled": true,
    "output_path": "http://not-a-comment//path/*still*/string", // trailing comment
    "job_name": "a \\"quoted\\" name, ]",
  },
  "zero_optimization": {"stage": 2, "reduce_bucket_size": 5e8,},
  "comms_logger": {"prof_ops": ["all_reduce", "all_gather",],},
}
"""


def test_comments_and_trailing_commas(tmp_path):
    path = tmp_path / "ds_config.json"
    path.write_text(COMMENTED)
    cfg = load_config(str(path), dp_world_size=2)
    assert cfg.train_batch_size == 16
    assert cfg.tensorboard.output_path == "http://not-a-comment//path/*still*/string"
    assert cfg.tensorboard.job_name == 'a "quoted" name, ]'
    assert cfg.zero_optimization.reduce_bucket_size == 500_000_000
    assert cfg.comms_logger.prof_ops == ["all_reduce", "all_gather"]
    assert cfg.raw["gradient_accumulation_steps"] == 2
    assert load_config(path).train_micro_batch_size_per_gpu == 4  # os.PathLike works too


def test_duplicate_keys_rejected_with_lines(tmp_path):
    path = tmp_path / "dup.json"
    path.write_text(
        '{\n  "train_micro_batch_size_per_gpu": 1,\n  "fp16": {"enabled": true},\n'
        '  "train_micro_batch_size_per_gpu": 2\n}\n'
    )
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    text = str(info.value)
    assert "Duplicate keys" in text and "'train_micro_batch_size_per_gpu' (lines 2, 4)" in text


def test_nested_duplicate_key():
    with pytest.raises(ConfigError, match="'stage'"):
        parse_json_text('{"zero_optimization": {"stage": 1, "stage": 2}}')


def test_syntax_error_reports_line_and_column(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text('{\n  "train_batch_size": 8\n  "steps_per_print": 5\n}\n')
    with pytest.raises(ConfigError) as info:
        load_config(str(path))
    text = str(info.value)
    assert "line 3, column 3" in text and str(path) in text and "Expecting ','" in text


def test_top_level_must_be_object():
    with pytest.raises(ConfigError, match="must be a JSON object"):
        parse_json_text("[1, 2]")


@pytest.mark.parametrize("encode", [base64.b64encode, base64.urlsafe_b64encode])
def test_base64_input(encode):
    config = {"train_batch_size": 8, "zero_optimization": {"stage": 1}}
    config["tensorboard"] = {"job_name": "run?>>~~"}  # makes '+' '/' (or '-' '_') appear
    text = encode(json.dumps(config).encode()).decode()
    assert set(text) & set("+/-_")
    cfg = load_config(text, dp_world_size=4)
    assert cfg.zero_stage == 1 and cfg.train_micro_batch_size_per_gpu == 2
    assert cfg.tensorboard.job_name == "run?>>~~" and cfg.raw == config
    unpadded = text.rstrip("=")
    assert load_config(unpadded).zero_stage == 1


def test_json_text_input():
    cfg = load_config('{"train_batch_size": 4, // comment\n "bf16": {"enabled": true}}')
    assert cfg.bf16_enabled


def test_missing_path_explains_what_was_expected(tmp_path):
    missing = tmp_path / "nope.json"
    with pytest.raises(ConfigError) as info:
        load_config(str(missing))
    text = str(info.value)
    assert "Expected a path to an existing JSON config file, a dict, base64-encoded JSON" in text
    assert str(missing) in text and "not base64-encoded JSON" in text


def test_directory_is_not_a_config(tmp_path):
    with pytest.raises(ConfigError, match="exists but is not a file"):
        load_config(str(tmp_path))


def test_empty_file(tmp_path):
    path = tmp_path / "empty.json"
    path.write_text("")
    with pytest.raises(ConfigError, match="line 1, column 1"):
        load_config(str(path))
