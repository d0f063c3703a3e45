"""Config honesty: every HF config field is honoured, refused, or known not to change the math.

Each family declares the keys its ragged forward *reads* (``honoured``) and the
values it *refuses* (``Refusal`` rules). :func:`validate_config` raises
``ValueError`` for a refused value (naming the field, the value, what is
supported and the fix), and warns once about keys it does not know, since a
future config key may change the computation. :func:`unclassified_keys` lets a
test prove that every key of a family's current HF config is classified.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from shardspeed.utils.logging import warning_once

# Keys that never change a forward pass at inference (bookkeeping, training-only, generation defaults).
NEUTRAL_KEYS = frozenset(
    {
        "transformers_version", "architectures", "output_hidden_states", "return_dict", "dtype",
        "torch_dtype", "chunk_size_feed_forward", "is_encoder_decoder", "problem_type", "id2label",
        "label2id", "initializer_range", "init_std", "use_cache", "pad_token_id", "bos_token_id",
        "_name_or_path", "output_attentions", "attention_dropout", "dropout", "hidden_dropout",
        "resid_pdrop", "embd_pdrop", "attn_pdrop", "classifier_dropout", "layerdrop",
        "activation_dropout", "summary_type", "summary_use_proj", "summary_activation",
        "summary_proj_to_labels", "summary_first_dropout", "router_aux_loss_coef",
        "output_router_logits", "router_jitter_noise", "is_decoder", "add_cross_attention",
        "tie_encoder_decoder", "tokenizer_class", "prefix", "decoder_start_token_id",
        "sep_token_id", "task_specific_params", "finetuning_task", "pretraining_tp",
        "base_model_tp_plan", "base_model_pp_plan", "model_type", "use_return_dict",
        "keys_to_ignore_at_inference", "cross_attention_hidden_size",
        "pruned_heads", "tf_legacy_loss", "use_bfloat16", "torchscript", "auto_map",
        "cache_implementation", "attention_probs_dropout_prob", "hidden_dropout_prob",
        "attn_implementation", "_attn_implementation_autoset", "gradient_checkpointing",
    }
)  # fmt: skip


@dataclass(frozen=True)
class Refusal:
    """``key``'s value must satisfy ``ok``; otherwise ``ValueError`` with ``supported`` and ``fix``."""

    key: str
    ok: Callable[[Any], bool]
    supported: str
    fix: str


def falsy(key: str, what: str) -> Refusal:
    """Refuse a truthy ``key`` (a feature the engine does not implement)."""
    return Refusal(key, lambda v: not v, "unset/false", f"{what} is not implemented; remove it")


def validate_config(
    model_type: str,
    config: dict[str, Any],
    honoured: Iterable[str],
    refusals: Iterable[Refusal] = (),
) -> None:
    """Raise ``ValueError`` on a refused value; warn once about unknown keys."""
    for rule in refusals:
        if rule.key in config and not rule.ok(config[rule.key]):
            raise ValueError(
                f"{model_type} config {rule.key}={config[rule.key]!r} is not supported by the "
                f"FastGen engine (supported: {rule.supported}); {rule.fix}."
            )
    if config.get("quantization_config"):
        raise ValueError(
            f"{model_type} config quantization_config={config['quantization_config']!r} is not "
            "supported by the FastGen engine (supported: unquantized fp32/fp16/bf16 weights); "
            "dequantize the checkpoint first."
        )
    unknown = unclassified_keys(config, honoured, refusals)
    if unknown:
        warning_once(
            f"{model_type} config keys {unknown} are unknown to the FastGen engine and ignored; "
            "if they change the model's math, outputs will differ from the reference."
        )


def unclassified_keys(
    config: dict[str, Any], honoured: Iterable[str], refusals: Iterable[Refusal] = ()
) -> list[str]:
    """Keys of ``config`` that are neither honoured, refusal-checked nor neutral."""
    known = set(honoured) | {r.key for r in refusals} | NEUTRAL_KEYS | {"quantization_config"}
    return sorted(k for k in config if k not in known)
