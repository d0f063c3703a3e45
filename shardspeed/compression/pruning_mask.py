"""The mask plumbing every pruning technique shares: ``l1`` (a fixed 0/1 buffer) or ``topk``
(learned scores binarised in each forward), by DeepSpeed's buffer and parameter names.

A :class:`MaskSlot` names one technique's buffer and scores on a layer; sparse, row and
channel pruning differ only in what they rank (``|w|``, row L1 norms, kernel L1 norms) and
in the mask's shape::

    slot = MaskSlot("row_pruning_mask", "row_mask_scores")
    slot.attach(layer, "l1", 0.5, ranking=row_norms.view(-1, 1))  # or "topk", shape=(out, 1)
    mask = slot.mask(layer, "l1", 0.5)   # (out, 1) 0/1, on the weight's device
    slot.drop(layer, "l1")               # after redundancy_clean folded the mask in
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from shardspeed.compression.quantizers import topk_mask, topk_mask_ste

L1 = "l1"
TOPK = "topk"


def uniform_scores(shape: tuple[int, ...], device: torch.device) -> nn.Parameter:
    """Learnable mask scores, initialised like ``nn.Linear`` weights (one global-RNG draw)."""
    scores = nn.Parameter(torch.empty(shape, device=device))
    nn.init.kaiming_uniform_(scores, a=math.sqrt(5))
    return scores


@dataclass(frozen=True)
class MaskSlot:
    """Where one pruning technique keeps its mask on a layer."""

    buffer: str
    """Buffer holding the fixed ``l1`` mask (None for ``topk``)."""
    scores: str
    """Parameter holding the learned ``topk`` scores (absent for ``l1``)."""

    def attach(
        self,
        layer: nn.Module,
        method: str,
        dense_ratio: float,
        ranking: torch.Tensor | None = None,
        shape: tuple[int, ...] | None = None,
    ) -> None:
        """``l1``: keep the largest ``ranking`` entries (mask of ``ranking``'s shape);
        ``topk``: learned scores of ``shape`` (one ``kaiming_uniform_`` draw)."""
        mask = None
        if method == L1:
            assert ranking is not None
            mask = topk_mask(ranking, dense_ratio)
        else:
            assert shape is not None
            setattr(layer, self.scores, uniform_scores(shape, layer.weight.device))
        layer.register_buffer(self.buffer, mask)

    def mask(self, layer: nn.Module, method: str, dense_ratio: float) -> torch.Tensor:
        """The current 0/1 mask (``topk``: straight-through to the scores)."""
        if method == L1:
            return getattr(layer, self.buffer).to(layer.weight.device)
        return topk_mask_ste(getattr(layer, self.scores), dense_ratio)

    def drop(self, layer: nn.Module, method: str) -> None:
        """Remove the buffer (and scores) once the mask is folded into the weights."""
        delattr(layer, self.buffer)
        if method == TOPK:
            delattr(layer, self.scores)


SPARSE = MaskSlot("sparse_pruning_mask", "sparse_mask_scores")
ROW = MaskSlot("row_pruning_mask", "row_mask_scores")
CHANNEL = MaskSlot("channel_pruning_mask", "channel_mask_scores")
