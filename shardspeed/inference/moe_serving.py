"""``init_inference(model, moe={"ep_size": E, ...})``: serve a model's ``shardspeed.moe`` layers.

A model built with :class:`shardspeed.moe.layer.MoE` at ``ep_size=E`` already holds
``num_experts / E`` experts per rank and moves tokens with all-to-all; what serving
adds (DeepSpeed-MoE inference's contract) is checked and set up here, before the
first forward:

* the layout: every MoE layer's ``ep_size`` is ``moe.ep_size``, ``moe.moe_experts``
  (when given) lists each layer's expert count, ``moe.type`` matches the layers'
  ``use_residual``, ``num_experts`` divides by ``E``, and ``E x tp_size`` is the world
  (each refusal names the numbers);
* the groups: each layer joins its expert-parallel group now (one collective);
* no capacity: every gate stops dropping tokens (``drop_tokens=False``, no
  ``min_capacity``) and dispatches with uneven all-to-all splits after exchanging the
  per-expert counts, so a served token is never dropped, whatever batch it lands in;
* the placement (which rank holds which experts) is logged once.

Without a ``moe`` block (or with ``enabled: false``) the layers run as built.
"""

from __future__ import annotations

from torch import nn

from shardspeed import comm
from shardspeed.inference.fastgen.expert_parallel.placement import (
    ExpertPlacement,
    check_expert_layout,
    describe_placement,
)
from shardspeed.inference.moe_config import InferenceMoEConfig
from shardspeed.parallel.moe.dispatch import make_dispatch
from shardspeed.parallel.moe.layer import MoE
from shardspeed.utils.logging import get_logger

logger = get_logger(__name__)


def moe_layers(model: nn.Module) -> list[MoE]:
    """The ``shardspeed.moe`` layers of ``model``, in module order."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def check_moe_layout(layers: list[MoE], moe: InferenceMoEConfig, tp_size: int, world: int) -> None:
    """``ValueError`` naming the numbers when ``layers`` cannot be served as ``moe`` asks."""
    where = "init_inference: moe.ep_size"
    if not layers:
        raise ValueError(
            f"init_inference: moe is enabled (ep_size={moe.ep_size}) but the model has no "
            "shardspeed.moe.layer.MoE layers; build it with MoE layers or remove the moe block."
        )
    if moe.ep_size > 1 and tp_size > 1:
        raise ValueError(
            f"init_inference: moe.ep_size={moe.ep_size} with tensor_parallel.tp_size={tp_size} "
            "is not supported yet; serve the MoE model with tp_size=1."
        )
    for i, layer in enumerate(layers):
        if layer.ep_size != moe.ep_size:
            raise ValueError(
                f"{where}={moe.ep_size}, but MoE layer {i} was built with ep_size="
                f"{layer.ep_size} (its ranks hold num_experts / {layer.ep_size} experts); build "
                f"the model with MoE(ep_size={moe.ep_size}) or set moe.ep_size={layer.ep_size}."
            )
        if moe.moe_experts != [1] and layer.num_experts not in moe.moe_experts:
            raise ValueError(
                f"init_inference: moe.moe_experts={moe.moe_experts}, but MoE layer {i} has "
                f"num_experts={layer.num_experts}; list every layer's expert count or leave "
                "moe_experts unset."
            )
        if (moe.type == "residual") != layer.use_residual:
            raise ValueError(
                f"init_inference: moe.type={moe.type!r}, but MoE layer {i} has use_residual="
                f"{layer.use_residual}; set moe.type="
                f"{'residual' if layer.use_residual else 'standard'!r}."
            )
        check_expert_layout(
            layer.num_experts, moe.ep_size, tp_size, world if moe.ep_size > 1 else None, where
        )


def prepare_moe_inference(model: nn.Module, moe: InferenceMoEConfig, tp_size: int) -> None:
    """Check ``model``'s MoE layers against ``moe``, join their groups and stop dropping
    tokens (see the module docstring); nothing when ``moe`` is disabled."""
    if not moe.enabled:
        return
    layers = moe_layers(model)
    world = comm.get_world_size() if comm.is_initialized() else 1
    check_moe_layout(layers, moe, tp_size, world)
    for layer in layers:
        if comm.is_initialized():
            layer.set_deepspeed_parallelism()
        inner = layer.deepspeed_moe
        inner.gate.drop_tokens = False  # no capacity at inference: nothing is dropped
        inner.gate.min_capacity = 0  # a capacity floor means nothing without a capacity
        inner._dispatch = make_dispatch(
            False, inner.ep_group, inner.ep_size, inner.num_local_experts
        )
    placement = ExpertPlacement(layers[0].num_experts, moe.ep_size)
    logger.info(
        "init_inference MoE: %s; tokens dispatched by all-to-all with uneven splits (per-expert "
        "counts exchanged first), no capacity: nothing dropped",
        describe_placement(placement, len(layers)),
    )


__all__ = ["check_moe_layout", "moe_layers", "prepare_moe_inference"]
