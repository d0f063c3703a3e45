"""Make a Hugging Face Llama-family model sequence-parallel (Ulysses) in place.

After ``make_hf_sequence_parallel(model, group)`` every rank of ``group`` feeds the model its
``s/p``-token chunk of the same samples and gets the logits of those tokens; attention sees
the whole sequence. Everything position-wise (embeddings, projections, rotary embedding with
global positions, MLPs, norms, LM head) runs on the local tokens unchanged; only the
attention kernel call is replaced::

    LlamaAttention.forward                             (unchanged)
      q, k, v = proj(hidden)                           (b, h, s/p, d) local tokens
      rotary(q, k, cos, sin)                           cos/sin from global position ids
      attention_interface("shardspeed_ulysses")  ->    DistributedAttention (batch_dim_idx=0):
                                                         all-to-all -> (b, s, h/p, d)
                                                         the model's own kernel (sdpa/eager/flash), causal
                                                         all-to-all -> (b, s/p, h, d)
      o_proj(...)                                      local tokens

The hook it installs on ``model.forward`` fills ``position_ids`` with this rank's global
positions when omitted, turns the KV cache off and drops an all-ones ``attention_mask``.
A causal LM's ``loss_function`` becomes :class:`~.loss.SequenceParallelCausalLMLoss`, so
``model(input_ids=chunk, labels=chunk).loss`` is the full-sequence mean.

Limits: causal attention over unpadded sequences (no padding or packed-sequence masks), no
KV cache (training and full-sequence scoring, not generation). The hook relies on
transformers' ``AttentionInterface`` (transformers >= 4.48).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from shardspeed.parallel.sequence.batch import local_position_ids
from shardspeed.parallel.sequence.layer import DistributedAttention
from shardspeed.parallel.sequence.loss import SequenceParallelCausalLMLoss

ATTN_IMPLEMENTATION = "shardspeed_ulysses"
_STATE_ATTR = "_shardspeed_ulysses"  # on each attention module: its DistributedAttention


def _is_hf_attention(module: nn.Module) -> bool:
    """A transformers decoder attention that calls ``ALL_ATTENTION_FUNCTIONS`` (Llama style)."""
    return all(hasattr(module, a) for a in ("num_key_value_groups", "head_dim", "config"))


class _LocalHeads:
    """``module`` as the attention kernel should see it: with this rank's query/KV ratio."""

    def __init__(self, module: nn.Module, num_key_value_groups: int) -> None:
        self._module = module
        self.num_key_value_groups = num_key_value_groups

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)


class _HFLocalAttention:
    """The model's own attention kernel on full-sequence ``(b, s, h_r, d)`` tensors, causal."""

    def __init__(self, kernel: Callable[..., Any], name: str) -> None:
        self.kernel = kernel
        self.name = name

    def __call__(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        module: nn.Module,
        **kwargs: Any,
    ) -> torch.Tensor:
        # (b, s, h_r, d) -> (b, h_r, s, d): the layout transformers' kernels take
        query, key, value = (t.transpose(1, 2) for t in (query, key, value))
        local = _LocalHeads(module, query.shape[1] // key.shape[1])
        mask = None
        if self.name == "eager":  # eager applies only the mask it is given
            num_tokens, lowest = query.shape[2], torch.finfo(query.dtype).min
            mask = torch.full((num_tokens, num_tokens), lowest, device=query.device).triu(1)
            mask = mask[None, None].to(query.dtype)  # (1, 1, s, s): 0 on and below the diagonal
        elif self.name == "sdpa":
            kwargs["is_causal"] = True
        context, _ = self.kernel(local, query, key, value, mask, **kwargs)
        return context  # (b, s, h_r, d)


def ulysses_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """The ``AttentionInterface`` entry: ``(b, h, s/p, d)`` in, ``(b, s/p, h, d)`` out."""
    attention = module.__dict__.get(_STATE_ATTR)
    if attention is None:
        raise RuntimeError(
            f"{type(module).__name__} runs attn_implementation={ATTN_IMPLEMENTATION!r} but was "
            "not made sequence-parallel; call make_hf_sequence_parallel(model, group) on the "
            "model that contains it."
        )
    if attention_mask is not None:
        raise ValueError(
            "Ulysses attention is causal over unpadded sequences: it cannot apply an attention "
            "mask (padding or packed sequences); pass attention_mask=None."
        )
    kwargs.pop("position_ids", None)  # this rank's positions: meaningless on the full sequence
    # (b, h, s/p, d) -> (b, s/p, h, d)
    query, key, value = (t.transpose(1, 2) for t in (query, key, value))
    return attention(query, key, value, 0, None, module, **kwargs), None


def _kernel_for(name: str, module: nn.Module) -> Callable[..., Any]:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name == "eager":
        kernel = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if kernel is None:
            raise ValueError(
                f"{type(module).__name__}'s module has no eager_attention_forward; load the model "
                "with attn_implementation='sdpa' or pass attn_implementation= explicitly."
            )
        return kernel
    if name not in ALL_ATTENTION_FUNCTIONS:
        raise ValueError(
            f"attn_implementation={name!r} is not registered in transformers' AttentionInterface; "
            f"choose one of {['eager', *ALL_ATTENTION_FUNCTIONS.valid_keys()]}."
        )
    return ALL_ATTENTION_FUNCTIONS[name]


def _register_interface() -> None:
    try:
        from transformers.modeling_utils import AttentionInterface
    except ImportError as exc:
        raise RuntimeError(
            "make_hf_sequence_parallel needs transformers >= 4.48 (AttentionInterface); "
            f"upgrade transformers ({exc})."
        ) from exc
    AttentionInterface.register(ATTN_IMPLEMENTATION, ulysses_attention_forward)


def _call_kwargs(
    module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> dict[str, Any]:
    """``module.forward``'s arguments, all by name."""
    if not args:
        return dict(kwargs)
    signature = inspect.signature(module.forward)
    bound = signature.bind_partial(*args, **kwargs)
    named: dict[str, Any] = {}
    for name, value in bound.arguments.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            raise ValueError(f"{type(module).__name__}.forward: pass its inputs by keyword")
        else:
            named[name] = value
    return named


def _input_hook(group: Any) -> Callable[..., tuple[tuple[()], dict[str, Any]]]:
    def prepare(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        kwargs = _call_kwargs(module, args, kwargs)
        mask = kwargs.get("attention_mask")
        if mask is not None:
            if not bool(mask.bool().all()):
                raise ValueError(
                    "a sequence-parallel model attends causally over unpadded sequences; this "
                    "attention_mask masks tokens out. Pack or trim the batch instead of padding."
                )
            kwargs["attention_mask"] = None
        if any(kwargs.get(k) is not None for k in ("cache", "past_key_values")):
            raise ValueError("a sequence-parallel model cannot use a KV cache; pass none.")
        kwargs["use_cache"] = False
        if kwargs.get("position_ids") is None:
            tokens = kwargs.get("input_ids")
            if tokens is None:
                tokens = kwargs.get("inputs_embeds")
            if tokens is not None:
                kwargs["position_ids"] = local_position_ids(tokens.shape[1], group, tokens.device)
        return (), kwargs

    return prepare


def make_hf_sequence_parallel(
    model: nn.Module, sequence_group: Any, *, attn_implementation: str | None = None
) -> nn.Module:
    """Make every Llama-style attention of ``model`` Ulysses sequence-parallel over ``sequence_group``.

    ``attn_implementation`` is the kernel run on the full sequence (default: the model's
    current one, e.g. ``"sdpa"`` or ``"eager"``). Returns ``model`` (changed in place).
    Every rank of ``sequence_group`` must then call the model with its chunk of the same
    samples (:func:`~.batch.shard_sequence`).
    """
    attentions = [m for m in model.modules() if _is_hf_attention(m)]
    if not attentions:
        raise ValueError(
            f"make_hf_sequence_parallel: found no transformers attention modules in "
            f"{type(model).__name__} (modules with num_key_value_groups, head_dim and config, "
            "as LlamaAttention, MistralAttention, Qwen2Attention)."
        )
    current = attentions[0].config._attn_implementation
    if current == ATTN_IMPLEMENTATION:
        raise ValueError("make_hf_sequence_parallel: this model is already sequence-parallel.")
    name = attn_implementation or current or "eager"
    _register_interface()
    attention = DistributedAttention(
        _HFLocalAttention(_kernel_for(name, attentions[0]), name), sequence_group, gather_idx=1
    )
    for module in attentions:
        module.__dict__[_STATE_ATTR] = attention  # not a submodule: no state_dict entries
        module.config._attn_implementation = ATTN_IMPLEMENTATION
    if hasattr(type(model), "loss_function"):
        model.loss_function = SequenceParallelCausalLMLoss(sequence_group)
    model.register_forward_pre_hook(_input_hook(sequence_group), with_kwargs=True)
    return model
