"""A corpus of realistic ds_config mistakes: each error names the key, the value and the fix.

Every case is one mistake a user makes in practice (a typo, a string where a number goes,
a value out of range, a half-filled block). The error must be a single ``ConfigError``
whose issue path is the key, whose text shows the received value as JSON (``(got ...)``)
and carries a fix (``Fix: ...``) containing the given hint. The cases of
``tests/unit/test_config_errors.py`` are not repeated here. Issue 20 defect 8 is the first
case: ``"betas": [0.9]`` used to pass validation and fail later with a bare IndexError.
"""

from __future__ import annotations

from typing import Any

import pytest

from shardspeed.config import ConfigError, load_config
from shardspeed.config.base import show

Z = "zero_optimization"
DEFAULT = "or remove the key to use the default"


def _opt(kind: str = "AdamW", **params: Any) -> dict:
    return {"optimizer": {"type": kind, "params": params}}


def _sched(kind: str, **params: Any) -> dict:
    return {"scheduler": {"type": kind, "params": params}}


# (id, config, path, value, fix hint)
CASES: list[tuple[str, dict, str, Any, str]] = [
    # -- optimizer params (issue 20, defect 8) --------------------------------------------------
    ("betas one value", _opt(betas=[0.9]), "optimizer.params.betas", [0.9], '"betas": [0.9, 0.999]'),
    ("betas three values", _opt("Lamb", betas=[0.9, 0.999, 0.9]), "optimizer.params.betas", [0.9, 0.999, 0.9], '"betas": [0.9, 0.999]'),
    ("beta2 of one", _opt(betas=[0.9, 1.0]), "optimizer.params.betas", [0.9, 1.0], '"betas": [0.9, 0.999]'),
    ("negative beta1", _opt("Adam", betas=[-0.1, 0.999]), "optimizer.params.betas", [-0.1, 0.999], "two decay rates"),
    ("betas as a string", _opt(betas="0.9,0.999"), "optimizer.params.betas", "0.9,0.999", '"betas": [0.9, 0.999]'),
    ("betas as one number", _opt(betas=0.9), "optimizer.params.betas", 0.9, '"betas": [0.9, 0.999]'),
    ("beta2 quoted", _opt(betas=[0.9, "0.999"]), "optimizer.params.betas", [0.9, "0.999"], '"betas": [0.9, 0.999]'),
    ("betas in percent", _opt("Lion", betas=[90, 99]), "optimizer.params.betas", [90, 99], "two decay rates"),
    ("negative lr", _opt(lr=-1e-3), "optimizer.params.lr", -1e-3, '"lr": 1e-3'),
    ("lr quoted (YAML)", _opt(lr="3e-4"), "optimizer.params.lr", "3e-4", '"lr": 1e-3'),
    ("lr true", _opt(lr=True), "optimizer.params.lr", True, '"lr": 1e-3'),
    ("lr as a list", _opt(lr=[1e-3]), "optimizer.params.lr", [1e-3], '"lr": 1e-3'),
    ("eps zero", _opt(eps=0), "optimizer.params.eps", 0, '"eps": 1e-8'),
    ("negative eps", _opt(eps=-1e-8), "optimizer.params.eps", -1e-8, '"eps": 1e-8'),
    ("eps quoted", _opt(eps="1e-8"), "optimizer.params.eps", "1e-8", '"eps": 1e-8'),
    ("negative weight decay", _opt(weight_decay=-0.01), "optimizer.params.weight_decay", -0.01, "0 to disable"),
    ("weight decay quoted", _opt("SGD", lr=0.1, weight_decay="0.01"), "optimizer.params.weight_decay", "0.01", '"weight_decay": 0.01'),
    ("params as a list", {"optimizer": {"type": "Adam", "params": [1e-3]}}, "optimizer.params", [1e-3], '"params": {...}'),
    ("optimizer type misspelt", {"optimizer": {"type": "adam_w"}}, "optimizer.type", "adam_w", "did you mean 'Adam'?"),
    ("optimizer type empty", {"optimizer": {"type": ""}}, "optimizer.type", "", "use one of the allowed names"),
    # -- scheduler ---------------------------------------------------------------------------
    ("warmup type cosine", _sched("WarmupLR", warmup_type="cosine"), "scheduler.params.warmup_type", "cosine", "WarmupCosineLR"),
    ("scheduler type snake case", {"scheduler": {"type": "warmup_lr"}}, "scheduler.type", "warmup_lr", "did you mean 'WarmupLR'?"),
    ("total steps on WarmupLR", _sched("WarmupLR", total_num_steps=100), "scheduler.params.total_num_steps", 100, "did you mean 'warmup_num_steps'?"),
    ("warmup_steps (HF name)", _sched("WarmupLR", warmup_steps=100), "scheduler.params.warmup_steps", 100, "did you mean 'warmup_num_steps'?"),
    ("min lr on cosine", _sched("WarmupCosineLR", total_num_steps=100, warmup_min_lr=0), "scheduler.params.warmup_min_lr", 0, "did you mean 'warmup_min_ratio'?"),
    ("total steps zero", _sched("WarmupDecayLR", total_num_steps=0), "scheduler.params.total_num_steps", 0, "a step count >= 1"),
    ("negative warmup", _sched("WarmupDecayLR", total_num_steps=1000, warmup_num_steps=-10), "scheduler.params.warmup_num_steps", -10, "for no warmup use 1"),
    ("one-cycle step name", _sched("OneCycle", cycle_min_lr=1e-4, cycle_max_lr=1e-3, cycle_first_step=1000), "scheduler.params.cycle_first_step", 1000, "did you mean 'cycle_first_step_size'?"),
    # -- ZeRO --------------------------------------------------------------------------------
    ("stage 2.5", {Z: {"stage": 2.5}}, f"{Z}.stage", 2.5, "use an integer"),
    ("stage -1", {Z: {"stage": -1}}, f"{Z}.stage", -1, "use 3 to shard"),
    ("stage in words", {Z: {"stage": "three"}}, f"{Z}.stage", "three", "use an integer"),
    ("negative bucket", {Z: {"stage": 2, "reduce_bucket_size": -1}}, f"{Z}.reduce_bucket_size", -1, f"{DEFAULT} (default 500000000)"),
    ("bucket with a unit", {Z: {"stage": 2, "reduce_bucket_size": "500MB"}}, f"{Z}.reduce_bucket_size", "500MB", "use an integer"),
    ("overlap_com typo", {Z: {"stage": 2, "overlap_com": True}}, f"{Z}.overlap_com", True, "did you mean 'overlap_comm'?"),
    ("contiguous_gradient typo", {Z: {"stage": 2, "contiguous_gradient": True}}, f"{Z}.contiguous_gradient", True, "did you mean 'contiguous_gradients'?"),
    ("round robin as a number", {Z: {"stage": 2, "round_robin_gradients": 3}}, f"{Z}.round_robin_gradients", 3, "use true or false"),
    ("live parameters negative", {Z: {"stage": 3, "stage3_max_live_parameters": -5}}, f"{Z}.stage3_max_live_parameters", -5, "(default 1000000000)"),
    ("sub group zero", {Z: {"stage": 3, "sub_group_size": 0}}, f"{Z}.sub_group_size", 0, DEFAULT),
    ("prefetch negative", {Z: {"stage": 3, "stage3_prefetch_bucket_size": -1}}, f"{Z}.stage3_prefetch_bucket_size", -1, "(default 50000000)"),
    ("persistence in words", {Z: {"stage": 3, "stage3_param_persistence_threshold": "big"}}, f"{Z}.stage3_param_persistence_threshold", "big", "use an integer"),
    ("gather flag sentence", {Z: {"stage": 3, "stage3_gather_16bit_weights_on_model_save": "true please"}}, f"{Z}.stage3_gather_16bit_weights_on_model_save", "true please", "use true or false"),
    ("nvme path as a number", {Z: {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": 5}}}, f"{Z}.offload_param.nvme_path", 5, "use a string"),
    ("offload ratio above one", {Z: {"stage": 2, "offload_optimizer": {"device": "cpu", "ratio": 1.5}}}, f"{Z}.offload_optimizer.ratio", 1.5, "(default 1.0)"),
    ("pin memory maybe", {Z: {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": "maybe"}}}, f"{Z}.offload_optimizer.pin_memory", "maybe", "use true or false"),
    ("no offload buffers", {Z: {"stage": 3, "offload_param": {"device": "cpu", "buffer_count": 0}}}, f"{Z}.offload_param.buffer_count", 0, "(default 5)"),
    ("negative optimizer buffers", {Z: {"stage": 2, "offload_optimizer": {"device": "cpu", "buffer_count": -2}}}, f"{Z}.offload_optimizer.buffer_count", -2, "(default 4)"),
    # -- precision ---------------------------------------------------------------------------
    ("negative loss scale", {"fp16": {"enabled": True, "loss_scale": -1}}, "fp16.loss_scale", -1, "(default 0.0)"),
    ("loss scale window zero", {"fp16": {"enabled": True, "loss_scale_window": 0}}, "fp16.loss_scale_window", 0, "(default 1000)"),
    ("initial_scale_pow typo", {"fp16": {"enabled": True, "initial_scale_pow": 16}}, "fp16.initial_scale_pow", 16, "did you mean 'initial_scale_power'?"),
    ("min loss scale zero", {"fp16": {"enabled": True, "min_loss_scale": 0}}, "fp16.min_loss_scale", 0, "(default 1.0)"),
    ("hysteresis zero", {"fp16": {"enabled": True, "hysteresis": 0}}, "fp16.hysteresis", 0, "(default 2)"),
    ("fp16 as a string", {"fp16": "true"}, "fp16", "true", "use a JSON object"),
    ("fp16 enable typo", {"fp16": {"enable": True}}, "fp16.enable", True, "did you mean 'enabled'?"),
    ("bf16 flag x", {"bf16": {"enabled": True, "immediate_grad_update": "x"}}, "bf16.immediate_grad_update", "x", "use true or false"),
    ("accumulation dtype fp8", {"data_types": {"grad_accum_dtype": "float8"}}, "data_types.grad_accum_dtype", "float8", "use one of the allowed values"),
    # -- batch and top level -----------------------------------------------------------------
    ("batch not a multiple", {"train_batch_size": 10, "train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2}, "train_batch_size", None, "make it 6 * <dp world size>"),
    ("fractional accumulation", {"gradient_accumulation_steps": 2.5}, "gradient_accumulation_steps", 2.5, "use an integer"),
    ("micro batch in words", {"train_micro_batch_size_per_gpu": "eight"}, "train_micro_batch_size_per_gpu", "eight", "use an integer"),
    ("micro batch fraction", {"train_micro_batch_size_per_gpu": 0.5}, "train_micro_batch_size_per_gpu", 0.5, "use an integer"),
    ("negative clipping", {"gradient_clipping": -1.0}, "gradient_clipping", -1.0, "(default 1.0)"),
    ("clipping as a list", {"gradient_clipping": [1.0]}, "gradient_clipping", [1.0], "use a number"),
    ("predivide zero", {"gradient_predivide_factor": 0}, "gradient_predivide_factor", 0, "(default 1.0)"),
    ("untested optimizer 2", {"zero_allow_untested_optimizer": 2}, "zero_allow_untested_optimizer", 2, "use true or false"),
    ("memory breakdown 5", {"memory_breakdown": 5}, "memory_breakdown", 5, "use true or false"),
    # -- activation checkpointing, I/O, monitoring -------------------------------------------
    ("checkpoints negative", {"activation_checkpointing": {"number_checkpoints": -1}}, "activation_checkpointing.number_checkpoints", -1, DEFAULT),
    ("partition sometimes", {"activation_checkpointing": {"partition_activations": "sometimes"}}, "activation_checkpointing.partition_activations", "sometimes", "use true or false"),
    ("aio block zero", {"aio": {"block_size": 0}}, "aio.block_size", 0, "(default 1048576)"),
    ("aio queue negative", {"aio": {"queue_depth": -1}}, "aio.queue_depth", -1, "(default 8)"),
    ("tensorboard path number", {"tensorboard": {"enabled": True, "output_path": 5}}, "tensorboard.output_path", 5, "use a string"),
    ("tensorboard enabeld", {"tensorboard": {"enabeld": True}}, "tensorboard.enabeld", True, "did you mean 'enabled'?"),
    ("profile step zero", {"flops_profiler": {"enabled": True, "profile_step": 0}}, "flops_profiler.profile_step", 0, "(default 1)"),
    ("wandb project number", {"wandb": {"enabled": True, "project": 5}}, "wandb.project", 5, "use a string"),
    ("csv job name list", {"csv_monitor": {"enabled": True, "job_name": []}}, "csv_monitor.job_name", [], "use a string"),
    ("comms verbose loud", {"comms_logger": {"enabled": True, "verbose": "loud"}}, "comms_logger.verbose", "loud", "use true or false"),
    ("pipeline partition_method", {"pipeline": {"partition_method": "random"}}, "pipeline.partition_method", "random", "did you mean 'partition'?"),
]  # fmt: skip


def test_corpus_is_large_and_distinct() -> None:
    assert len(CASES) >= 50
    assert len({case[0] for case in CASES}) == len(CASES)


@pytest.mark.parametrize(
    ("config", "path", "value", "fix"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_mistake_names_key_value_and_fix(config: dict, path: str, value: Any, fix: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(config)
    err = info.value
    text = str(err)
    assert [issue.path for issue in err.issues] == [path], text
    assert path in text
    if value is not None:  # cross-field rules quote the values in their own words
        assert f"(got {show(value)})" in text, text
    else:
        assert "(10)" in text and "(3)" in text and "(2)" in text, text
    assert "Fix:" in text and fix in text, text
    assert len(text.splitlines()) == 1
