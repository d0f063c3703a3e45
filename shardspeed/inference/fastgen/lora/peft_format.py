"""Reading a PEFT LoRA adapter directory and refusing what FastGen cannot apply.

A PEFT ``save_pretrained`` directory holds ``adapter_config.json`` and
``adapter_model.safetensors`` whose tensors are named
``base_model.model.<module>.lora_A.weight`` (``[r, in]``) and
``base_model.model.<module>.lora_B.weight`` (``[out, r]``). The delta a target
module adds to its output is ``scale * x @ A^T @ B^T`` with ``scale = lora_alpha / r``
(``lora_alpha / sqrt(r)`` with ``use_rslora``); per-module ``rank_pattern`` /
``alpha_pattern`` entries override ``r`` / ``lora_alpha`` for the modules they match,
as PEFT resolves them. The scale is folded into ``B`` when the adapter is placed.

Everything that would change the math beyond that delta (DoRA, trained biases,
``modules_to_save``, layer replication, ...) is refused by name, so an adapter either
produces PEFT's tokens or does not load.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_KEY_RE = re.compile(r"^base_model\.model\.(.+)\.lora_(A|B)(?:\.[^.]+)?\.weight$")

# config keys that must be unset / false: each changes the forward beyond x @ A^T @ B^T
_REFUSED_KEYS: dict[str, str] = {
    "use_dora": "DoRA rescales the merged weight column-wise",
    "lora_bias": "a trained bias on lora_B",
    "modules_to_save": "whole modules trained beside the adapter (e.g. lm_head)",
    "layer_replication": "layers duplicated from the base model",
    "trainable_token_indices": "retrained embedding rows",
    "target_parameters": "LoRA on raw parameters (e.g. MoE expert tensors)",
    "alora_invocation_tokens": "activated LoRA (applies only after invocation tokens)",
    "use_qalora": "QA-LoRA's pooled inputs",
    "use_bdlora": "block-diagonal LoRA",
    "megatron_config": "Megatron-parallel LoRA layers",
}


@dataclass
class PeftLoRA:
    """One adapter as read from disk: ``{module: (A [r, in], B [out, r], scale)}``."""

    path: Path
    rank: int  # the largest rank over its modules
    modules: dict[str, tuple[torch.Tensor, torch.Tensor, float]]
    base_model_name_or_path: str | None = None


def read_peft_adapter(path: str | Path) -> PeftLoRA:
    """Read and validate the PEFT LoRA adapter in directory ``path``.

    Raises ``ValueError`` naming the file, key and value when the directory is not a
    LoRA adapter FastGen can apply.
    """
    from safetensors.torch import load_file

    root = Path(path)
    if not root.is_dir():
        raise ValueError(
            f"LoRA adapter path {str(path)!r} is not a directory; pass the directory a PEFT "
            f"model's save_pretrained() wrote (with {CONFIG_FILE} and {WEIGHTS_FILE})."
        )
    config_path, weights_path = root / CONFIG_FILE, root / WEIGHTS_FILE
    for needed in (config_path, weights_path):
        if not needed.is_file():
            hint = " (only safetensors is read; re-save with safe_serialization=True)"
            extra = hint if needed is weights_path and (root / "adapter_model.bin").exists() else ""
            raise ValueError(f"LoRA adapter {str(root)!r} has no {needed.name}{extra}.")
    try:
        config = json.loads(config_path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"{config_path}: cannot read it as JSON ({exc}).") from exc
    if not isinstance(config, dict):
        raise ValueError(f"{config_path}: expected a JSON object, got {type(config).__name__}.")
    _check_config(config, config_path)
    try:
        tensors = load_file(str(weights_path))
    except Exception as exc:  # safetensors' own error: truncated, corrupted, not safetensors
        raise ValueError(
            f"{weights_path}: cannot read it as a safetensors file ({exc}); re-save the adapter "
            "with save_pretrained()."
        ) from exc
    pairs = _pair_tensors(tensors, weights_path)
    modules: dict[str, tuple[torch.Tensor, torch.Tensor, float]] = {}
    for module, (a, b) in pairs.items():
        rank, alpha = _module_rank_alpha(config, module)
        if a.dim() != 2 or b.dim() != 2 or a.shape[0] != b.shape[1] or a.shape[0] != rank:
            raise ValueError(
                f"{weights_path}: {module} has lora_A {tuple(a.shape)} and lora_B "
                f"{tuple(b.shape)}; expected [r, in] and [out, r] with r={rank} as "
                f"{CONFIG_FILE} says."
            )
        root_r = math.sqrt(rank) if config.get("use_rslora") else rank
        modules[module] = (a, b, float(alpha) / root_r)
    return PeftLoRA(
        path=root,
        rank=max(a.shape[0] for a, _, _ in modules.values()),
        modules=modules,
        base_model_name_or_path=config.get("base_model_name_or_path"),
    )


def _check_config(config: dict[str, Any], where: Path) -> None:
    peft_type = config.get("peft_type")
    if peft_type != "LORA":
        raise ValueError(
            f"{where}: peft_type={peft_type!r}; FastGen serves LoRA adapters only "
            "(peft_type 'LORA')."
        )
    task = config.get("task_type")
    if task not in (None, "CAUSAL_LM"):
        raise ValueError(
            f"{where}: task_type={task!r}; FastGen serves causal-LM adapters "
            "(task_type 'CAUSAL_LM' or unset)."
        )
    for key, what in _REFUSED_KEYS.items():
        if config.get(key):
            raise ValueError(
                f"{where}: {key}={config[key]!r} ({what}) is not supported by FastGen's LoRA "
                f"serving; merge the adapter into the base model instead (PEFT "
                "merge_and_unload) or retrain without it."
            )
    if config.get("bias", "none") != "none":
        raise ValueError(
            f"{where}: bias={config['bias']!r} (trained base-model biases) is not supported; "
            "use bias='none' or merge the adapter into the base model."
        )
    # layers_to_transform / layers_pattern / target_modules only decide which tensors
    # exist; the saved tensors themselves say where the adapter applies
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise ValueError(f"{where}: r={rank!r} must be an int >= 1.")
    alpha = config.get("lora_alpha")
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool):
        raise ValueError(f"{where}: lora_alpha={alpha!r} must be a number.")


def _pair_tensors(
    tensors: dict[str, torch.Tensor], where: Path
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """``{module: (A, B)}`` from PEFT tensor names; anything else is refused by name."""
    found: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in tensors.items():
        m = _KEY_RE.match(name)
        if m is None:
            raise ValueError(
                f"{where}: tensor {name!r} is not a LoRA A/B matrix (e.g. a saved embedding, "
                "lm_head or DoRA magnitude); FastGen applies lora_A/lora_B pairs only."
            )
        found.setdefault(m.group(1), {})[m.group(2)] = tensor
    if not found:
        raise ValueError(f"{where}: holds no lora_A / lora_B tensors.")
    pairs = {}
    for module, ab in found.items():
        if set(ab) != {"A", "B"}:
            raise ValueError(f"{where}: {module} has lora_{next(iter(ab))} but not its pair.")
        pairs[module] = (ab["A"], ab["B"])
    return pairs


def _module_rank_alpha(config: dict[str, Any], module: str) -> tuple[int, float]:
    """``(r, lora_alpha)`` of ``module``: PEFT's ``rank_pattern`` / ``alpha_pattern`` key
    that matches the end of the module's name wins over ``r`` / ``lora_alpha``."""

    def lookup(patterns: dict[str, Any] | None, default: Any) -> Any:
        for key, value in (patterns or {}).items():
            if re.match(rf"(.*\.)?({key})$", module):
                return value
        return default

    return lookup(config.get("rank_pattern"), config["r"]), lookup(
        config.get("alpha_pattern"), config["lora_alpha"]
    )
