"""Placing an adapter's HF-named modules onto a FastGen model's (fused) projections.

FastGen fuses projections (``q_proj``/``k_proj``/``v_proj`` -> ``qkv_proj``,
``gate_proj``/``up_proj`` -> ``gate_up_proj``) and some families reorder rows. Rather
than a table per family, placement asks the model's own checkpoint mapping
(:meth:`RaggedModel.map_weight`) where the HF weight ``<module>.weight`` would go, with
a *probe* tensor whose every row holds its own row index (a stride-0 view, no memory):
the rows that come out name, for each output row of the fused projection, which row of
``lora_B`` it takes. So ``q_proj``'s ``B`` lands on the ``q`` rows of ``qkv_proj`` in
every family that loads ``q_proj`` weights, and a module the mapping does not place
(or places other than as one linear projection) is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn

from shardspeed.inference.fastgen.lora.peft_format import PeftLoRA
from shardspeed.inference.fastgen.models import RaggedModel


@dataclass
class LoRAWeights:
    """An adapter's part on one model projection: ``out += (x @ a^T) @ b^T``.

    Several HF modules fused into one projection (``q_proj`` and ``v_proj`` on
    ``qkv_proj``) are stacked: ``a`` holds their ``A`` rows one after the other and ``b``
    each one's ``B`` in its own output rows and rank columns (zeros elsewhere), so a
    projection costs two GEMMs per adapter however many modules it fuses.
    """

    a: torch.Tensor  # [R, in], R = the fused modules' ranks summed
    b: torch.Tensor  # [out, R], the scale folded in


def lora_modules(model: RaggedModel) -> dict[str, nn.Module]:
    """Projections an adapter may target: linear-like modules that see every token (the
    LM head, which sees only the logits rows, routed MoE experts, which see the tokens
    routed to them, and embeddings are excluded)."""
    return {
        name: module
        for name, module in model.named_modules()
        if name != "lm_head"
        and ".experts." not in name
        and hasattr(module, "in_features")
        and hasattr(module, "out_features")
    }


def place_adapter(
    model: RaggedModel, adapter: PeftLoRA, dtype: torch.dtype, device: torch.device
) -> dict[str, LoRAWeights]:
    """``{model module name: weights}`` for every module of ``adapter``; ``ValueError``
    names a module that cannot be placed."""
    targets = lora_modules(model)
    pieces: dict[str, list[tuple[slice, torch.Tensor, torch.Tensor]]] = {}
    for hf_module, (a, b, scale) in adapter.modules.items():
        module_name, rows, order = _locate(model, targets, hf_module, b.shape[0], a.shape[1])
        b_rows = b.index_select(0, order).float() * scale  # [len(rows), r]
        pieces.setdefault(module_name, []).append((rows, a.float(), b_rows))
    placed = {}
    for module_name, parts in pieces.items():
        rank = sum(a.shape[0] for _, a, _ in parts)
        b_full = torch.zeros(targets[module_name].out_features, rank)  # [out, R]
        offset = 0
        for rows, a, b_rows in parts:
            b_full[rows, offset : offset + a.shape[0]] = b_rows
            offset += a.shape[0]
        a_full = torch.cat([a for _, a, _ in parts])  # [R, in]
        placed[module_name] = LoRAWeights(
            a_full.to(device=device, dtype=dtype), b_full.to(device=device, dtype=dtype)
        )
    return placed


def _locate(
    model: RaggedModel,
    targets: dict[str, nn.Module],
    hf_module: str,
    out_features: int,
    in_features: int,
) -> tuple[str, slice, torch.Tensor]:
    """(model module, output rows, which HF output row feeds each) of HF ``hf_module``."""
    name = f"{hf_module}.weight"
    refusal = ValueError(
        f"LoRA target module {hf_module!r} cannot be placed on this {model.model_type!r} "
        "model: FastGen's checkpoint mapping does not load it as one linear projection "
        "(LoRA on embeddings, lm_head, MoE experts or routers is not supported). Retrain the "
        "adapter with target_modules among the attention / MLP projections."
    )
    # Linear layout [out, in] first, then Conv1D layout [in, out] (GPT-2 style checkpoints)
    for transposed in (False, True):
        index = torch.arange(out_features, dtype=torch.float64)
        probe = (
            index[None, :].expand(in_features, out_features)
            if transposed
            else index[:, None].expand(out_features, in_features)
        )
        try:
            mapped = model.map_weight(name, probe)
        except Exception:  # the mapping rejected the probe's shape: try the other layout
            continue
        if not mapped or len(mapped) != 1:
            continue
        pname, src, rows, transpose = mapped[0]
        src = src.t() if transpose else src
        module = targets.get(pname.removesuffix(".weight"))
        if module is None or not pname.endswith(".weight") or src.dim() != 2:
            continue
        full = module.out_features
        start = (rows.start or 0) if rows is not None else 0
        stop = rows.stop if rows is not None else full
        if module.in_features != in_features or src.shape != (stop - start, in_features):
            continue
        if stop > full:
            continue
        if not bool((src[:, 0] == src[:, -1]).all()):  # a row does not hold one index
            continue
        return pname.removesuffix(".weight"), slice(start, stop), src[:, 0].long()
    raise refusal
