"""Tensor-parallel shards in a checkpoint: stored per tensor rank, resharded on load.

A tensor-parallel parameter (one carrying a ``tp_layout``, see
:mod:`shardspeed.parallel.tensor.partition`) is stored as its tensor ranks' shards, each
flattened in its own (local) layout and cut into the usual data-axis fragments. The index
entry keeps the full shape and, under ``"tp"``, the split and every shard's pieces::

    index[name] = {"shape": full shape, "dtype": ..., "kinds": {kind: []},
                   "tp": {"dim": d, "sub_sizes": [...], "widths": [[...], ...],
                          "shards": [{"shape": local shape, "kinds": {kind: pieces}}, ...]}}

Loading at the same split reads a rank's own shard directly; at any other split (another
tp, or no tensor parallelism, or a checkpoint saved without it) the full tensor is
assembled from every shard along the split dim and re-sliced for the new layout, one
parameter and kind at a time. A zero-width shard (AutoTP with fewer KV heads than tensor
ranks) has no elements, so nothing is stored for it; its width 0 in ``widths`` stands in.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from shardspeed.parallel.tensor.partition import ShardLayout, assemble, slice_shard


@dataclass(frozen=True)
class Placement:
    """This rank's shard of a tensor-parallel parameter: the split and its tensor rank."""

    layout: ShardLayout
    rank: int

    @classmethod
    def of(cls, param: torch.Tensor, tensor_rank: int) -> Placement | None:
        layout = getattr(param, "tp_layout", None)
        return None if layout is None else cls(layout, tensor_rank)

    def full_shape(self, local_shape: list[int]) -> list[int]:
        shape = list(local_shape)
        shape[self.layout.dim] = self.layout.full_size
        return shape

    def to_json(self, local_shape: list[int]) -> dict[str, Any]:
        """The entry fields a writer records with each fragment of this shard."""
        return {
            "rank": self.rank,
            "dim": self.layout.dim,
            "sub_sizes": list(self.layout.sub_sizes),
            "widths": [list(w) for w in self.layout.widths],
            "local_shape": list(local_shape),
        }

    def matches(self, tp: dict[str, Any]) -> bool:
        """True when ``tp`` (an index entry's ``"tp"``) was saved with this very split."""
        return layout_from_json(tp) == self.layout


def layout_from_json(tp: dict[str, Any]) -> ShardLayout:
    return ShardLayout(
        int(tp["dim"]), tuple(tp["sub_sizes"]), tuple(tuple(w) for w in tp["widths"])
    )


def add_to_index(item: dict[str, Any], entry: dict[str, Any], piece: list[Any]) -> None:
    """File one stored fragment of a tensor-parallel shard under its index entry."""
    tp = entry["tp"]
    layout = layout_from_json(tp)
    record = item.setdefault(
        "tp",
        {
            "dim": layout.dim,
            "sub_sizes": list(layout.sub_sizes),
            "widths": [list(w) for w in layout.widths],
            "shards": [{"shape": None, "kinds": {}} for _ in range(layout.tp_size)],
        },
    )
    if layout_from_json(record) != layout:
        raise ValueError(
            f"ranks saved {entry['name']!r} with different tensor-parallel splits "
            f"({layout_from_json(record)} and {layout}); the save is inconsistent."
        )
    shard = record["shards"][int(tp["rank"])]
    shard["shape"] = list(tp["local_shape"])
    shard["kinds"].setdefault(entry["kind"], []).append(piece)
    item["kinds"].setdefault(entry["kind"], [])  # the kind exists; its pieces are per shard


def sort_pieces(item: dict[str, Any]) -> None:
    for shard in item.get("tp", {}).get("shards", []):
        for pieces in shard["kinds"].values():
            pieces.sort(key=lambda p: p[2])


def _numel(shape: list[int]) -> int:
    numel = 1
    for d in shape:
        numel *= d
    return numel


def read_full(reader: Any, entry: dict[str, Any], kind: str, name: str) -> torch.Tensor:
    """The full tensor of ``kind`` of a tensor-parallel entry: every shard read, assembled."""
    tp = entry["tp"]
    layout = layout_from_json(tp)
    dtype = reader.dtype(entry)
    shards = []
    for rank, shard in enumerate(tp["shards"]):
        if layout.shard_size(rank) == 0:  # fewer KV heads than ranks: nothing stored, width 0
            empty_shape = list(entry["shape"])
            empty_shape[layout.dim] = 0
            shards.append(torch.empty(empty_shape, dtype=dtype))
            continue
        if shard["shape"] is None or kind not in shard["kinds"]:
            raise ValueError(
                f"checkpoint lacks tensor rank {rank}'s shard of {name!r} ({kind}); the save is "
                "incomplete or corrupt."
            )
        out = torch.empty(_numel(shard["shape"]), dtype=dtype)
        reader.fill(out, shard["kinds"][kind], 0, f"{name} ({kind}, tensor rank {rank})")
        shards.append(out.view(shard["shape"]))
    return assemble(shards, layout)


class LocalReader:
    """Reads this rank's elements of a parameter from a checkpoint saved in any layout.

    ``fill(dest, entry, kind, name, start, placement)`` fills flat ``dest`` with elements
    [start, start + numel) of this rank's (flattened) tensor: its tensor-parallel shard
    when ``placement`` is given, else the whole tensor. Resharded full tensors are cached
    for the parameter being loaded (its other kinds and fragments reuse nothing else).
    """

    def __init__(self, reader: Any) -> None:
        self.reader = reader
        self._cache: dict[tuple[str, str], torch.Tensor] = {}

    def fill(
        self,
        dest: torch.Tensor,
        entry: dict[str, Any],
        kind: str,
        name: str,
        start: int,
        placement: Placement | None,
    ) -> None:
        tp = entry.get("tp")
        if tp is None and placement is None:  # neither side split: the plain layout
            self.reader.fill(dest, entry["kinds"][kind], start, f"{name} ({kind})")
            return
        if tp is not None and placement is not None and placement.matches(tp):
            shard = tp["shards"][placement.rank]
            what = f"{name} ({kind}, tensor rank {placement.rank})"
            self.reader.fill(dest, shard["kinds"][kind], start, what)
            return
        local = self._local(entry, kind, name, placement)
        dest.copy_(local[start : start + dest.numel()])

    def _local(
        self, entry: dict[str, Any], kind: str, name: str, placement: Placement | None
    ) -> torch.Tensor:
        key = (name, kind)
        if key not in self._cache:
            if not any(k[0] == name for k in self._cache):
                self._cache.clear()  # a new parameter: drop the previous one's tensors
            full = self.reader.full(entry, kind, name)
            if placement is not None:
                full = slice_shard(full, placement.layout, placement.rank)
            self._cache[key] = full.reshape(-1)  # (numel of this rank's tensor,)
        return self._cache[key]

    def tensor(
        self, entry: dict[str, Any], kind: str, name: str, placement: Placement | None
    ) -> torch.Tensor:
        """This rank's whole tensor (a frozen parameter's shard or a buffer)."""
        full = self.reader.full(entry, kind, name)
        return full if placement is None else slice_shard(full, placement.layout, placement.rank)
