"""``quantize_model``: swap a model's linear layers for :class:`QuantizedLinear` in place."""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Mapping

import torch
import torch.nn as nn

from shardspeed.inference.quantization.config import WeightQuantConfig
from shardspeed.inference.quantization.linear import QuantizedLinear
from shardspeed.inference.quantization.qtensor import QuantizedWeight

logger = logging.getLogger(__name__)


def _is_conv1d(module: nn.Module) -> bool:
    """``transformers.pytorch_utils.Conv1D`` (GPT-2's linear with an ``(in, out)`` weight)."""
    cls = type(module)
    return cls.__name__ == "Conv1D" and cls.__module__.startswith("transformers")


def _tied_weight_ids(model: nn.Module) -> set[int]:
    """ids of weights that an embedding shares (tied output heads must stay unquantized)."""
    return {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}


def select_layers(model: nn.Module, config: WeightQuantConfig) -> list[tuple[str, nn.Module]]:
    """``(name, module)`` of the ``nn.Linear`` / ``Conv1D`` layers ``config`` quantizes.

    Name filters (``skip_modules`` / ``modules``) apply; a layer whose weight is tied
    to an embedding is left out (and logged).
    """
    tied = _tied_weight_ids(model)
    targets: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if isinstance(module, QuantizedLinear) or not name:
            continue
        if not (isinstance(module, nn.Linear) or _is_conv1d(module)):
            continue
        if not config.selects(name):
            continue
        if id(module.weight) in tied:
            logger.info("not quantizing %s: its weight is tied to an embedding", name)
            continue
        targets.append((name, module))
    return targets


def quantize_model(
    model: nn.Module,
    config: WeightQuantConfig | str | dict,
    target_device: torch.device | str | None = None,
    prequantized: Mapping[str, QuantizedWeight] | None = None,
) -> nn.Module:
    """Replace ``nn.Linear`` / GPT-2 ``Conv1D`` layers of ``model`` by quantized ones, in place.

    Layers are selected by name with ``config.skip_modules`` / ``config.modules``
    (defaults: every linear layer except the output head and MoE routers); embeddings
    and norms are never touched, nor a linear layer whose weight is tied to an
    embedding. Each weight is quantized from its current dtype and device, and the
    quantized buffers stay there. ``target_device`` is where the model will run (None:
    where each weight is): kernels and their packing are chosen for it, so a model can
    be quantized on the host and moved to its GPU later. Returns ``model`` (the same
    object) in eval mode. ``prequantized`` maps layer names to weights already quantized
    elsewhere (a tensor-parallel rank's slice of a weight quantized whole); those layers
    use them instead of quantizing their own ``weight``.

    Raises ``ValueError`` when a selected layer cannot be quantized with ``config``
    (e.g. its input size is not a multiple of the group size); exclude it with
    ``skip_modules`` or choose another group size.
    """
    config = WeightQuantConfig.parse(config)
    device = None if target_device is None else torch.device(target_device)
    if not isinstance(model, nn.Module):
        raise TypeError(f"quantize_model expects an nn.Module, got {type(model).__name__}.")
    targets = select_layers(model, config)
    prequantized = prequantized or {}
    if not targets:
        logger.warning("quantize_model: no layer matched %s; the model is unchanged", config)
    kernels: Counter[str] = Counter()
    for name, module in targets:
        try:
            if name in prequantized:
                qw = prequantized[name].to(module.weight.device)
                quantized = QuantizedLinear.from_quantized(qw, module.bias, config, device)
            elif isinstance(module, nn.Linear):
                quantized = QuantizedLinear.from_linear(module, config, device)
            else:
                quantized = QuantizedLinear.from_conv1d(module, config, device)
        except ValueError as exc:
            raise ValueError(f"cannot quantize layer {name!r}: {exc}") from exc
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, child, quantized)
        kernels[quantized.kernel.name] += 1
    logger.info(
        "quantized %d layer(s) to int%d (group_size=%s, %s); kernels: %s",
        len(targets), config.bits, config.effective_group_size or "per-channel",
        "symmetric" if config.symmetric else "asymmetric", dict(kernels),
    )  # fmt: skip
    return model.eval()
