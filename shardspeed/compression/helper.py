"""DeepSpeed's ``compression.helper`` utilities that scripts call directly."""

from __future__ import annotations

from torch import nn

from shardspeed.compression.matching import get_submodule, set_submodule

recursive_getattr = get_submodule
recursive_setattr = set_submodule


def convert_conv1d_to_linear(model: nn.Module, convert_type: type) -> nn.Module:
    """Replace every ``convert_type`` module (e.g. Hugging Face GPT-2's ``Conv1D``, weight
    ``(in, out)``) by an equivalent ``nn.Linear`` (weight ``(out, in)``) so it can be
    compressed. ``model`` may be an engine (its ``module`` is converted)."""
    inner = getattr(model, "module", None)
    inner = inner if isinstance(inner, nn.Module) else model
    for name, module in list(inner.named_modules()):
        if not isinstance(module, convert_type):
            continue
        weight = module.weight.data  # (in, out)
        linear = nn.Linear(weight.size(0), weight.size(1), bias=module.bias is not None)
        linear.weight.data = weight.t().contiguous()  # (out, in)
        if linear.bias is not None:
            linear.bias.data = module.bias.data.view(-1)
        set_submodule(inner, name, linear)
    return model
