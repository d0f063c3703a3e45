"""AutoTP sharding policies: which ``nn.Linear`` / ``Conv1D`` of a model is split how.

A :class:`TPPolicy` is a frozen list of name patterns, each with a :class:`LayerRule`
(column, row or skip), matched against ``<module name>.weight`` with ``re.match`` (first
match wins), the way DeepSpeed's ``tensor_parallel.partition_config`` ``layer_specs`` are.
:func:`policy_for` chooses one per model, in DeepSpeed 0.19.8's order:

1. a user ``partition_config`` (optionally on top of a ``preset_model``);
2. the model's Hugging Face ``tp_plan`` (Llama, Mistral, Qwen2, ... in transformers >= 4.5x:
   ``q/k/v/gate/up`` colwise, ``o/down`` rowwise, ``lm_head`` colwise with a gathered output);
3. a built-in policy by ``config.model_type``: the Llama family (same split as the plan, for
   older transformers) and GPT-2 (fused ``c_attn`` Conv1D cut per q/k/v; DeepSpeed's AutoTP
   refuses GPT-2 for training, so this one is ours).

How wide each rank's shard is does not depend on the policy but on the layer's name, as in
DeepSpeed (:func:`splits_by_kv_heads`): attention layers keep whole KV-head groups per rank
(GQA), MLP layers and the LM head are split near-evenly.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from torch import nn

_STYLES = ("column", "row", "skip")
_HEAD_NAMES = ("lm_head", "embed_out")
# DeepSpeed's tp_shard.get_shard_size: names split near-evenly, never by KV heads.
_EVEN_SPLIT_SUBSTRINGS = ("mlp", "gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")


@dataclass(frozen=True)
class LayerRule:
    """What AutoTP does with one linear layer."""

    style: str  # "column" (split outputs), "row" (split inputs) or "skip" (replicate)
    gather_output: bool = False  # column: all-gather the output (e.g. an untied LM head)
    num_sub: int | None = None  # equal fused sub-parameters along the split dim ([q|k|v]: 3)
    sub_sizes: tuple[int, ...] | None = None  # unequal fused sub-parameters (GQA qkv)
    grad_allreduce: bool = False  # skip: the replicated weight's gradient is summed over TP

    def __post_init__(self) -> None:
        if self.style not in _STYLES:
            raise ValueError(f"partition_type {self.style!r} is not one of {list(_STYLES)}.")
        if self.gather_output and self.style != "column":
            raise ValueError("gather_output applies to column-parallel layers only.")
        if self.grad_allreduce and self.style != "skip":
            raise ValueError("grad_allreduce applies to replicated (skip) layers only.")

    def split_sizes(self, total: int, name: str) -> tuple[int, ...]:
        """The fused sub-parameter sizes along a split dim of ``total`` elements."""
        if self.sub_sizes is not None:
            if sum(self.sub_sizes) != total:
                raise ValueError(
                    f"AutoTP layer {name!r}: sub-parameter sizes {list(self.sub_sizes)} sum to "
                    f"{sum(self.sub_sizes)}, but the split dim has {total} elements."
                )
            return self.sub_sizes
        num_sub = self.num_sub or 1
        if total % num_sub:
            raise ValueError(
                f"AutoTP layer {name!r}: {total} elements do not split into {num_sub} equal "
                "sub-parameters; give their sizes as a nested list in 'shape'."
            )
        return (total // num_sub,) * num_sub


@dataclass(frozen=True)
class PatternSpec:
    """One ``layer_specs`` entry: regexes over parameter names and the rule they select."""

    patterns: tuple[str, ...]
    rule: LayerRule
    model_types: tuple[str, ...] | None = None

    def matches(self, param_name: str, model_type: str | None) -> bool:
        if self.model_types is not None and (model_type or "").lower() not in self.model_types:
            return False
        return any(re.match(p, param_name) for p in self.patterns)


@dataclass(frozen=True)
class TPPolicy:
    """The sharding decisions for one model family (or one user config)."""

    name: str
    specs: tuple[PatternSpec, ...]
    head_names: tuple[str, ...] = _HEAD_NAMES
    # A head tied to the input embedding: "vocab" (vocabulary-parallel head + embedding and
    # a vocabulary-parallel loss, DeepSpeed's choice for HF plans) or "replicate".
    tied_head: str = "vocab"
    strict: bool = False  # every linear layer must match a spec
    fixups: tuple[Callable[[nn.Module], None], ...] = field(default_factory=tuple)

    def rule_for(self, module_name: str, model_type: str | None) -> LayerRule | None:
        """The first matching rule for ``module_name`` (None: leave the layer replicated)."""
        param_name = f"{module_name}.weight"
        rule = self.match(param_name, model_type)
        if rule is None and self.strict:
            raise ValueError(
                f"AutoTP partition_config (strict_mode): no layer_specs pattern matches "
                f"{param_name!r}; add a pattern for it (partition_type 'skip' to replicate)."
            )
        return rule

    def match(self, param_name: str, model_type: str | None) -> LayerRule | None:
        """The first rule whose patterns match the parameter name ``param_name``."""
        return next((s.rule for s in self.specs if s.matches(param_name, model_type)), None)

    def is_head(self, module_name: str) -> bool:
        return module_name.rsplit(".", 1)[-1] in self.head_names


def splits_by_kv_heads(module_name: str) -> bool:
    """Whether DeepSpeed AutoTP keeps whole KV-head groups when splitting this layer."""
    if module_name in _HEAD_NAMES:
        return False
    return not any(s in module_name for s in _EVEN_SPLIT_SUBSTRINGS)


def head_counts(model: nn.Module) -> tuple[int | None, int | None]:
    """``(num_kv_heads, num_attention_heads)`` from the model's config (DeepSpeed's probe order)."""
    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config
    if config is None:
        return None, None
    kv_names = (
        "num_key_value_heads", "num_kv_heads", "multi_query_group_num", "n_head_kv", "kv_n_heads",
        "num_attention_heads", "n_heads", "attention_heads",
    )  # fmt: skip
    heads_names = ("num_attention_heads", "num_heads", "n_heads", "n_head", "attention_heads")
    kv = next((getattr(config, n) for n in kv_names if getattr(config, n, None) is not None), None)
    heads = next(
        (getattr(config, n) for n in heads_names if getattr(config, n, None) is not None), None
    )
    return kv, heads


# ----------------------------------------------------------------- attribute fixups
def _local_width(module: nn.Module) -> int | None:
    weight = getattr(module, "weight", None)
    if weight is None or not getattr(weight, "tensor_model_parallel", False):
        return None
    return weight.shape[weight.partition_dim]


def llama_attention_fixup(module: nn.Module) -> None:
    """Older transformers reshape with ``num_heads``/``hidden_size``: make them rank-local."""
    q, k = getattr(module, "q_proj", None), getattr(module, "k_proj", None)
    head_dim = getattr(module, "head_dim", None)
    if q is None or k is None or not head_dim:
        return
    q_width, k_width = _local_width(q), _local_width(k)
    if q_width is None or k_width is None:
        return
    for attr, value in (
        ("num_heads", q_width // head_dim),
        ("num_key_value_heads", k_width // head_dim),
        ("hidden_size", q_width),
    ):
        if isinstance(getattr(module, attr, None), int):
            setattr(module, attr, value)


def gpt2_attention_fixup(module: nn.Module) -> None:
    """GPT-2 splits its fused ``c_attn`` output by ``split_size``: make it this rank's width."""
    c_attn = getattr(module, "c_attn", None)
    if c_attn is None or not hasattr(module, "split_size"):
        return
    layout = getattr(c_attn.weight, "tp_layout", None)
    if layout is None:
        return
    if getattr(module, "is_cross_attention", False):
        raise NotImplementedError(
            "AutoTP does not shard GPT-2 cross-attention (c_attn holds only k/v there); use a "
            "partition_config that skips it."
        )
    width = c_attn.weight.shape[c_attn.weight.partition_dim] // layout.num_sub
    module.split_size = module.embed_dim = width
    module.num_heads = width // module.head_dim


_FIXUPS = (llama_attention_fixup, gpt2_attention_fixup)


# ----------------------------------------------------------------- built-in policies
def _column(*patterns: str, **kw: Any) -> PatternSpec:
    return PatternSpec(patterns, LayerRule("column", **kw))


def _row(*patterns: str) -> PatternSpec:
    return PatternSpec(patterns, LayerRule("row"))


LLAMA = TPPolicy(
    "llama",
    (
        _column(r".*\.(q_proj|k_proj|v_proj|gate_proj|up_proj)\.weight$"),
        _row(r".*\.(o_proj|down_proj)\.weight$"),
        _column(r"(.*\.)?lm_head\.weight$", gather_output=True),
    ),
    fixups=_FIXUPS,
)

GPT2 = TPPolicy(
    "gpt2",
    (
        _column(r".*\.attn\.c_attn\.weight$", num_sub=3),  # [q | k | v], each cut by heads
        _row(r".*\.attn\.c_proj\.weight$"),
        _column(r".*\.mlp\.c_fc\.weight$"),
        _row(r".*\.mlp\.c_proj\.weight$"),
        _column(r"(.*\.)?lm_head\.weight$", gather_output=True),  # only when untied
    ),
    fixups=_FIXUPS,
)

PRESETS: dict[str, TPPolicy] = {"llama": LLAMA, "mistral": LLAMA, "qwen2": LLAMA, "gpt2": GPT2}


# ----------------------------------------------------------------- from configs
_HF_STYLES = {
    "colwise": LayerRule("column"),
    "colwise_rep": LayerRule("column", gather_output=True),
    "colwise_gather_output": LayerRule("column", gather_output=True),
    "rowwise": LayerRule("row"),
    "embedding_rowwise": LayerRule("skip"),  # the tied-head logic shards it, nothing else
    "replicated_with_grad_allreduce": LayerRule("skip", grad_allreduce=True),
}


def hf_tp_plan(model: nn.Module) -> dict[str, str]:
    """The model's Hugging Face tensor-parallel plan: config's, the class's, the instance's."""
    config = getattr(model, "config", None)
    plans = (
        getattr(config, "base_model_tp_plan", None),
        getattr(type(model), "_tp_plan", None),
        vars(model).get("_tp_plan"),
    )
    merged: dict[str, str] = {}
    for plan in plans:
        if isinstance(plan, Mapping):
            for pattern, style in plan.items():
                bare = pattern.removeprefix("model.")
                if pattern.startswith("model.") and any(
                    k.removeprefix("model.") == bare for k in merged
                ):
                    continue
                merged[pattern] = style
    return merged


def from_hf_tp_plan(plan: Mapping[str, str], name: str = "hf_tp_plan") -> TPPolicy:
    """A policy from a Hugging Face ``tp_plan`` (``"layers.*.self_attn.q_proj": "colwise"``)."""
    unknown = sorted({s for s in plan.values() if s.lower() not in _HF_STYLES})
    if unknown:
        raise ValueError(
            f"the model's Hugging Face tp_plan uses styles {unknown} that AutoTP does not know "
            f"(known: {sorted(_HF_STYLES)}); give a tensor_parallel.partition_config instead."
        )
    specs = []
    for pattern, style in plan.items():
        regex = ".*" + pattern.replace(".", r"\.").replace("*", ".*")
        regex += "$" if regex.endswith(r"\.weight") else r"\.weight$"
        specs.append(PatternSpec((regex,), _HF_STYLES[style.lower()]))
    return TPPolicy(name, tuple(specs), fixups=_FIXUPS)


def _rule_from_spec(spec: Mapping[str, Any]) -> LayerRule:
    style = str(spec.get("partition_type", "column")).lower()
    default_dim = 0 if style == "column" else 1
    partition_dim = spec.get("partition_dim", default_dim)
    if style != "skip" and partition_dim != default_dim:
        raise NotImplementedError(
            f"layer_specs {list(spec.get('patterns', []))}: partition_dim {partition_dim} is not "
            f"supported for '{style}' layers (only {default_dim}: the "
            f"{'output' if style == 'column' else 'input'} features)."
        )
    num_sub = sub_sizes = None
    shape = spec.get("shape")
    if shape is not None:
        shape = list(shape)
        other = shape[1 - default_dim] if len(shape) == 2 else None
        at_dim = shape[default_dim] if len(shape) == 2 else None
        if other != -1 or not (isinstance(at_dim, (int, list, tuple))):
            raise NotImplementedError(
                f"layer_specs {list(spec.get('patterns', []))}: shape {shape} is not supported; "
                "AutoTP takes fused sub-parameters along the split dim only: [n, -1] / "
                "[[q, k, v], -1] for column layers, [-1, n] / [-1, [a, b]] for row layers."
            )
        if isinstance(at_dim, int):
            num_sub = at_dim
        else:
            sub_sizes = tuple(int(s) for s in at_dim)
    return LayerRule(
        style,
        gather_output=bool(spec.get("gather_output", False)),
        num_sub=num_sub,
        sub_sizes=sub_sizes,
        grad_allreduce=bool(spec.get("grad_allreduce", False)),
    )


def from_partition_config(config: Mapping[str, Any], preset: TPPolicy | None = None) -> TPPolicy:
    """A policy from DeepSpeed's ``tensor_parallel.partition_config`` dict.

    Keys: ``layer_specs`` (each: ``patterns``, ``partition_type`` column/row/skip,
    ``gather_output``, ``grad_allreduce``, ``shape``, ``partition_dim``, ``model_types``),
    ``lm_head_patterns``, ``use_default_specs`` (prepend nothing, append ``preset``'s specs),
    ``strict_mode``. A head tied to the embedding is left replicated, as DeepSpeed does.
    """
    known = {"layer_specs", "lm_head_patterns", "use_default_specs", "strict_mode", "tp_size",
             "embedding_partition_dim"}  # fmt: skip
    extra = sorted(set(config) - known)
    if extra:
        raise ValueError(
            f"tensor_parallel.partition_config: unknown keys {extra}; allowed: {sorted(known)}."
        )
    specs = []
    for spec in config.get("layer_specs", []):
        patterns = spec.get("patterns")
        if not patterns or isinstance(patterns, str):
            raise ValueError(
                f"tensor_parallel.partition_config.layer_specs entry {dict(spec)}: 'patterns' must "
                "be a non-empty list of regular expressions over parameter names."
            )
        model_types = spec.get("model_types")
        specs.append(
            PatternSpec(
                tuple(patterns),
                _rule_from_spec(spec),
                tuple(t.lower() for t in model_types) if model_types else None,
            )
        )
    if preset is not None and config.get("use_default_specs", True):
        specs.extend(preset.specs)
    return TPPolicy(
        "partition_config",
        tuple(specs),
        head_names=tuple(config.get("lm_head_patterns", _HEAD_NAMES)),
        tied_head="replicate",
        strict=bool(config.get("strict_mode", False)),
        fixups=_FIXUPS,
    )


def policy_for(
    model: nn.Module,
    partition_config: Mapping[str, Any] | None = None,
    preset_model: str | None = None,
) -> TPPolicy:
    """The policy AutoTP uses for ``model`` (see the module docstring for the order)."""
    preset = None
    if preset_model is not None:
        preset = PRESETS.get(preset_model.lower())
        if preset is None:
            raise ValueError(
                f"tensor_parallel.preset_model={preset_model!r} is not a known preset; "
                f"choose one of {sorted(PRESETS)} or give a partition_config."
            )
    if partition_config is not None:
        return from_partition_config(partition_config, preset)
    if preset is not None:
        return preset
    plan = hf_tp_plan(model)
    if plan:
        return from_hf_tp_plan(plan)
    model_type = model_type_of(model)
    if model_type in PRESETS:  # older transformers without a plan; GPT-2 (Conv1D) never has one
        return PRESETS[model_type]
    raise ValueError(
        f"AutoTP has no sharding policy for {type(model).__name__} (model_type "
        f"{model_type!r}, no Hugging Face tp_plan); pass tensor_parallel.partition_config with "
        f"layer_specs (column/row patterns) or preset_model (one of {sorted(PRESETS)})."
    )


def model_type_of(model: nn.Module) -> str | None:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    return str(model_type).lower() if model_type else None
