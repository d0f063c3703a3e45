"""Which modules a group covers, and the swap of ``torch.nn`` layers for compressed ones.

Module names are matched as DeepSpeed matches them: each pattern of a group's ``modules`` is
a Python regular expression searched (``re.search``) in every *compressible* module's dotted
name (``nn.Linear``, ``nn.Conv2d``, ``nn.Embedding``, ``nn.BatchNorm2d``); ``"*"`` alone
matches them all. Within one technique a module may belong to one group only.

Wrapping draws from the global RNG exactly as DeepSpeed does (each compressed layer is built
with its base class's constructor, which initialises throw-away weights before the original
parameters are put back), so later draws (top-k scores, the user's own) line up with a
DeepSpeed run of the same script.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from torch import nn

from shardspeed.compression.basic_layer import (
    BNLayer_Compress,
    Conv2dLayer_Compress,
    Embedding_Compress,
    LinearLayer_Compress,
)
from shardspeed.compression.conv import CompressedBatchNorm2d, CompressedConv2d
from shardspeed.compression.linear import CompressedEmbedding, CompressedLinear

COMPRESSIBLE = (nn.Linear, nn.Conv2d, nn.Embedding, nn.BatchNorm2d)


@dataclass
class GroupTarget:
    """One pattern of a group: the modules it matched and, per related pattern, theirs."""

    modules: list[str]
    related: list[list[str]] = field(default_factory=list)


def is_compressible(module: nn.Module) -> bool:
    return isinstance(module, COMPRESSIBLE)


def get_submodule(model: nn.Module, name: str) -> nn.Module:
    """``model.a.b.c`` for ``"a.b.c"`` (DeepSpeed's ``recursive_getattr``)."""
    out = model
    for part in name.split("."):
        out = getattr(out, part)
    return out


def set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    parent = get_submodule(model, parent_name) if parent_name else model
    setattr(parent, leaf, module)


def _compile(pattern: str, where: str) -> re.Pattern[str] | None:
    if pattern == "*":
        return None
    try:
        return re.compile(pattern)
    except re.error as exc:
        raise ValueError(
            f"{where}: module pattern {pattern!r} is not a valid regular expression ({exc}); "
            "allowed: a Python regex searched in module names, or '*' for all. Fix: escape "
            "special characters (e.g. '.*' instead of '*')."
        ) from None


def match_modules(model: nn.Module, pattern: str, taken: set[str] | None, where: str) -> list[str]:
    """Names of the compressible modules whose name contains a match of ``pattern``.

    ``taken`` (names already used by this technique) is updated; a module matched twice is
    an error naming the group. ``None`` skips the check (related modules).
    """
    regex = _compile(pattern, where)
    found = []
    for name, module in model.named_modules():
        if not is_compressible(module) or (regex is not None and regex.search(name) is None):
            continue
        if taken is not None:
            if name in taken:
                raise ValueError(
                    f"{where}: module '{name}' is already compressed by another group of this "
                    "technique; allowed: each module in at most one group per technique. Fix: "
                    "narrow the 'modules' patterns so the groups do not overlap."
                )
            taken.add(name)
        found.append(name)
    return found


def compressed_copy(module: nn.Module) -> nn.Module:
    """The compressed counterpart of ``module`` sharing its parameters (itself if it is
    already compressed). Built with the base constructor first: see the module docstring."""
    if isinstance(
        module, (CompressedLinear, CompressedConv2d, CompressedEmbedding, CompressedBatchNorm2d)
    ):
        return module
    reference = module.weight if module.weight is not None else next(module.buffers())
    factory = {"device": reference.device, "dtype": reference.dtype}
    new: nn.Module
    if isinstance(module, nn.Linear):
        new = LinearLayer_Compress(
            module.in_features, module.out_features, bias=module.bias is not None
        )
    elif isinstance(module, nn.Conv2d):
        new = Conv2dLayer_Compress(
            module.in_channels,
            module.out_channels,
            module.kernel_size,
            module.stride,
            module.padding,
            module.dilation,
            module.groups,
            module.bias is not None,
            module.padding_mode,
        )
    elif isinstance(module, nn.Embedding):
        new = Embedding_Compress(
            module.num_embeddings,
            module.embedding_dim,
            module.padding_idx,
            module.max_norm,
            module.norm_type,
            module.scale_grad_by_freq,
            module.sparse,
        )
    else:
        assert isinstance(module, nn.BatchNorm2d)
        new = BNLayer_Compress(
            module.num_features,
            module.eps,
            module.momentum,
            module.affine,
            module.track_running_stats,
        )
        for buffer in ("running_mean", "running_var", "num_batches_tracked"):
            setattr(new, buffer, getattr(module, buffer))
    new = new.to(**factory)
    # the original Parameter objects move over (an optimizer built earlier keeps working)
    new.weight = module.weight
    if getattr(module, "bias", None) is not None:
        new.bias = module.bias
    new.train(module.training)
    return new


def wrap_compressible(model: nn.Module) -> None:
    """Swap every compressible module of ``model`` for its compressed counterpart."""
    for name, module in list(model.named_modules()):
        if name and is_compressible(module):
            set_submodule(model, name, compressed_copy(module))
