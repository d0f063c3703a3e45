"""Tensor parallelism for ``init_inference``: AutoTP sharding with full logits on every rank.

Reuses the training AutoTP (:func:`~shardspeed.parallel.tensor.autotp.tp_model_init`):
column-parallel q/k/v and gate/up, row-parallel o_proj and down_proj, so each attention
block and each MLP block ends in exactly one all-reduce. Inference adds two things:

* the vocabulary: a vocab-parallel LM head (tied GPT-2 style) is switched to all-gather its
  logits and the training loss hook is removed, so ``forward``/``generate`` see full logits;
  an untied input embedding is sharded by vocabulary rows (one all-reduce per forward);
* DeepSpeed's ``injection_policy`` (``{block class: (row-parallel linear names,)}``): the
  named linears of each block become row-parallel, every other linear in the block
  column-parallel (fused ``[q|k|v]`` layers keep the built-in preset's sub-parameter split).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from typing import Any

from torch import nn

from shardspeed import comm
from shardspeed.parallel.tensor.autotp import TensorParallelPlan, tp_model_init
from shardspeed.parallel.tensor.layers import VocabParallelEmbedding, is_conv1d
from shardspeed.parallel.tensor.partition import ShardLayout, autotp_split
from shardspeed.parallel.tensor.policies import PRESETS, model_type_of
from shardspeed.utils.logging import log_dist

_HEAD_PATTERN = r"(.*\.)?lm_head\.weight$"


def resolve_tp_group(tp_size: int, tp_group: Any, mpu: Any) -> Any:
    """The tensor group: ``tp_group``, else ``mpu.get_model_parallel_group()``, else AutoTP's."""
    if tp_group is None and mpu is not None:
        getter = getattr(mpu, "get_model_parallel_group", None) or getattr(
            mpu, "get_tensor_model_parallel_group", None
        )
        if getter is None:
            raise ValueError(
                f"tensor_parallel.mpu={type(mpu).__name__} has no get_model_parallel_group(); pass "
                "an mpu object with that method or tensor_parallel.tp_group."
            )
        tp_group = getter()
    if tp_size > 1 and not comm.is_initialized():
        launched = int(os.environ.get("WORLD_SIZE", "1"))
        if launched < tp_size:
            raise ValueError(
                f"init_inference: tensor_parallel.tp_size={tp_size} needs at least {tp_size} "
                f"processes, but this one was launched alone (WORLD_SIZE={launched}); start it "
                f"with `shardspeed --num_gpus {tp_size} script.py` or `torchrun --nproc_per_node "
                f"{tp_size} script.py`, or use tp_size 1."
            )
        comm.init_distributed()
    if tp_size > 1 and tp_group is None:
        world = comm.get_world_size()
        if world % tp_size:
            raise ValueError(
                f"init_inference: tensor_parallel.tp_size={tp_size} does not divide the world size "
                f"{world}; choose one of {[d for d in range(1, world + 1) if world % d == 0]}."
            )
    return tp_group


def shard_for_inference(
    model: nn.Module,
    tp_size: int,
    tp_group: Any = None,
    injection_policy: Mapping[Any, Any] | None = None,
) -> TensorParallelPlan:
    """Shard ``model`` in place over ``tp_size`` ranks with full logits; return AutoTP's plan."""
    head, tied = _lm_head(model)
    partition_config = None
    if injection_policy is not None:
        partition_config = partition_config_from_injection_policy(model, injection_policy)
        if head is not None and not tied:
            partition_config["layer_specs"].append(
                {"patterns": [_HEAD_PATTERN], "partition_type": "column", "gather_output": True}
            )
    saved_loss = vars(model).get("_loss_function", _MISSING)
    tp_model_init(
        model, tp_size, None, tp_group,
        partition_config=partition_config,
        vocab_parallel_lm_head=True if tied else None,
    )  # fmt: skip
    plan: TensorParallelPlan = model.shardspeed_tp
    if plan.vocab_parallel_head is not None:
        model.get_submodule(plan.vocab_parallel_head).gather_output = True  # full logits
        if saved_loss is _MISSING:
            vars(model).pop("_loss_function", None)
        else:
            model._loss_function = saved_loss
    _shard_input_embedding(model, plan.group)
    return plan


_MISSING = object()


def _lm_head(model: nn.Module) -> tuple[nn.Module | None, bool]:
    get_out = getattr(model, "get_output_embeddings", None)
    get_in = getattr(model, "get_input_embeddings", None)
    head = get_out() if callable(get_out) else None
    embedding = get_in() if callable(get_in) else None
    tied = head is not None and embedding is not None and head.weight is embedding.weight
    return head, tied


def _shard_input_embedding(model: nn.Module, group: Any) -> None:
    """Split an input embedding AutoTP left whole by vocabulary rows (it is not tied)."""
    get_in = getattr(model, "get_input_embeddings", None)
    embedding = get_in() if callable(get_in) else None
    if not isinstance(embedding, nn.Embedding) or isinstance(embedding, VocabParallelEmbedding):
        return
    if any(
        getattr(m, "weight", None) is embedding.weight
        for m in model.modules()
        if m is not embedding
    ):
        return  # shared with another module: stays replicated
    try:
        VocabParallelEmbedding.check_supported(embedding)
    except NotImplementedError as exc:
        log_dist(f"init_inference: input embedding left replicated ({exc})")
        return
    tp_size = comm.get_world_size(group)
    widths = autotp_split(embedding.num_embeddings, tp_size, num_kv_heads=None, head_aligned=False)
    new = VocabParallelEmbedding.from_module(embedding, ShardLayout.of(0, widths), group=group)
    name = next(n for n, m in model.named_modules() if m is embedding)
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, new)


def partition_config_from_injection_policy(
    model: nn.Module, injection_policy: Mapping[Any, Any]
) -> dict[str, Any]:
    """DeepSpeed's ``{block class: (row-parallel names,)}`` as an AutoTP ``partition_config``."""
    preset = PRESETS.get(model_type_of(model) or "")
    specs: list[dict[str, Any]] = []
    for block_type, row_names in injection_policy.items():
        rows = (row_names,) if isinstance(row_names, str) else tuple(row_names)
        if not rows or not all(isinstance(r, str) for r in rows):
            raise ValueError(
                f"injection_policy[{_type_name(block_type)}]={row_names!r}: expected a tuple of "
                "module names inside the block (the row-parallel output linears), e.g. "
                "('self_attn.o_proj', 'mlp.down_proj')."
            )
        blocks = [(n, m) for n, m in model.named_modules() if _is_block(m, block_type)]
        if not blocks:
            raise ValueError(
                f"injection_policy: no module of type {_type_name(block_type)} in "
                f"{type(model).__name__}; key the policy by the transformer block class."
            )
        used: set[str] = set()
        for prefix, block in blocks:
            for sub, leaf in block.named_modules():
                if not sub or not (isinstance(leaf, nn.Linear) or is_conv1d(leaf)):
                    continue
                param = f"{prefix}.{sub}.weight"
                row = next((r for r in rows if sub == r or sub.endswith("." + r)), None)
                if row is not None:
                    used.add(row)
                    specs.append({"patterns": [re.escape(param) + "$"], "partition_type": "row"})
                else:
                    specs.append(_column_spec(param, preset))
        unused = sorted(set(rows) - used)
        if unused:
            raise ValueError(
                f"injection_policy[{_type_name(block_type)}]: {unused} name no linear layer of "
                f"the block; its linears are {_linear_names(blocks[0][1])}."
            )
    return {"layer_specs": specs, "use_default_specs": False}


def _column_spec(param: str, preset: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"patterns": [re.escape(param) + "$"], "partition_type": "column"}
    rule = preset.match(param, None) if preset is not None else None
    if rule is not None and rule.style == "column":  # fused [q|k|v] (GPT-2 c_attn)
        if rule.sub_sizes is not None:
            spec["shape"] = [list(rule.sub_sizes), -1]
        elif rule.num_sub:
            spec["shape"] = [rule.num_sub, -1]
    return spec


def _is_block(module: nn.Module, block_type: Any) -> bool:
    if isinstance(block_type, str):
        return type(module).__name__ == block_type
    return isinstance(block_type, type) and isinstance(module, block_type)


def _type_name(block_type: Any) -> str:
    return (
        block_type
        if isinstance(block_type, str)
        else getattr(block_type, "__name__", repr(block_type))
    )


def _linear_names(block: nn.Module) -> list[str]:
    return [n for n, m in block.named_modules() if isinstance(m, nn.Linear) or is_conv1d(m)]
