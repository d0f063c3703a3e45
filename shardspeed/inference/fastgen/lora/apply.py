"""The batched LoRA delta: one forward hook per projection, adapters grouped per batch.

Before a forward, :meth:`LoRAHooks.scope` turns the scheduled batch into groups: for
every adapter present, the rows (tokens) of the flattened ``[N, hidden]`` batch that
belong to its requests (tokens of base-model requests are in no group). Each
projection an adapter targets then adds, per group, one segmented pair of GEMMs::

    xs = x[rows]                        # [n_i, in]   the adapter's tokens
    out[rows] += (xs @ A_i^T) @ B_i^T    # [n_i, R] -> [n_i, out], scale in B_i

so the Python work is one loop over the adapters in the batch (at most ``max_loras``)
per projection, never over requests or tokens. A batch with no adapter requests
costs one ``None`` check per projection.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

import torch
import torch.nn as nn

from shardspeed.inference.fastgen.lora.placement import lora_modules
from shardspeed.inference.fastgen.models import RaggedModel

if TYPE_CHECKING:
    from shardspeed.inference.fastgen.lora.registry import LoRAAdapter
    from shardspeed.inference.fastgen.scheduler import ScheduledBatch

# (adapter, its token rows or None when it owns every token of the batch)
Group = tuple["LoRAAdapter", torch.Tensor | None]


class LoRAHooks:
    """Forward hooks on every projection of ``model`` that add the batch's LoRA deltas.

    The hooks are installed once, up front, so loading an adapter never changes the
    model while another thread runs it.
    """

    def __init__(self, model: RaggedModel, device: torch.device) -> None:
        self.device = device
        self._groups: list[Group] | None = None
        self._num_tokens = 0
        self._handles = [
            module.register_forward_hook(self._make_hook(name))
            for name, module in lora_modules(model).items()
        ]

    def remove(self) -> None:
        """Take the hooks off the model."""
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @contextmanager
    def scope(self, batch: ScheduledBatch) -> Iterator[None]:
        """Apply the adapters of ``batch``'s requests in the forwards run inside."""
        self._groups, self._num_tokens = self._group(batch), batch.num_tokens
        try:
            yield
        finally:
            self._groups = None

    def _group(self, batch: ScheduledBatch) -> list[Group] | None:
        adapters: list[LoRAAdapter | None] = [
            getattr(seq.request, "lora", None) for seq in batch.sequences
        ]
        present = list({id(a): a for a in adapters if a is not None}.values())
        if not present:
            return None
        if len(present) == 1 and all(a is not None for a in adapters):
            return [(present[0], None)]
        slot = {id(a): k for k, a in enumerate(present)}
        seq_slots = torch.tensor([slot[id(a)] if a is not None else -1 for a in adapters])
        counts = torch.tensor([seq.num_tokens for seq in batch.sequences])
        token_slots = torch.repeat_interleave(seq_slots, counts)  # [N]
        return [
            (a, (token_slots == k).nonzero().squeeze(1).to(self.device))
            for k, a in enumerate(present)
        ]

    def _make_hook(self, name: str) -> Any:
        def hook(module: nn.Module, inputs: tuple[Any, ...], out: torch.Tensor) -> None:
            if self._groups is not None:
                self._add_deltas(name, inputs[0], out)

        return hook

    def _add_deltas(self, name: str, x: torch.Tensor, out: torch.Tensor) -> None:
        assert self._groups is not None
        for adapter, rows in self._groups:
            weights = adapter.weights.get(name)
            if weights is None:
                continue
            if out.dim() != 2 or out.shape[0] != self._num_tokens:
                raise RuntimeError(
                    f"LoRA on {name!r}: its output has shape {tuple(out.shape)} but the batch "
                    f"has {self._num_tokens} tokens; this model applies {name!r} to other rows "
                    "than the batch's tokens, so adapters cannot target it."
                )
            xs = x if rows is None else x.index_select(0, rows)  # [n_i, in]
            delta = (xs @ weights.a.t()) @ weights.b.t()  # [n_i, R] -> [n_i, out]
            if rows is None:
                out.add_(delta)
            else:
                out.index_add_(0, rows, delta)
