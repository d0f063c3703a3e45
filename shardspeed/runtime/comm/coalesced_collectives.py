"""DeepSpeed's ``deepspeed.runtime.comm.coalesced_collectives``: one reduce-scatter for many
tensors.

:func:`reduce_scatter_coalesced` averages a list of tensors over a group and leaves each rank
its 1/world slice of every tensor, with one collective. Each flattened tensor is cut into
``world`` chunks of ``ceil(numel / world)`` elements (the last ones short or empty), and the
chunks are laid out rank-major with zero padding, so rank r's contiguous block holds its
chunk of every tensor::

    tensors a (5,), b (2,), world 2:  chunks a: [a0 a1 a2] [a3 a4 .]   b: [b0] [b1]
    send buffer:  | a0 a1 a2 b0 | a3 a4 0 b1 |   (world x block)
    rank 1 gets   (a3 a4 0 b1) / world   ->  [a3 a4], [b1]   (padding dropped)

:func:`all_to_all_quant_reduce` (ZeRO++ qgZ) gives each rank the same slice of the average,
reduced with int4 block-quantized all-to-alls within each node and then across nodes
(:class:`shardspeed.zero.zeropp.grads.QuantizedReduction`; the engine uses it for
``zero_optimization.zero_quantized_gradients``). Its result differs from the exact average
by at most the quantization bound documented there (docs/zeropp.md).
"""

from __future__ import annotations

from typing import Any

import torch

from shardspeed import comm


def _chunk(numel: int, world: int) -> int:
    return -(-numel // world)  # ceil


@torch.no_grad()
def reduce_scatter_coalesced(
    tensors: list[torch.Tensor], group: object = None
) -> list[torch.Tensor]:
    """This rank's slice of the average over ``group`` of every tensor in ``tensors``
    (module docstring): output ``i`` holds elements ``[r * c, r * c + c)`` of the flattened
    average of ``tensors[i]`` (``c = ceil(numel / world)``, clipped at ``numel``).

    A collective: every rank passes tensors of the same shapes and dtype. The inputs are
    left unchanged (DeepSpeed may divide a lone input in place).
    """
    if not tensors:
        return []
    dtypes = {t.dtype for t in tensors}
    if len(dtypes) != 1:
        raise ValueError(
            f"reduce_scatter_coalesced(tensors): got dtypes {sorted(map(str, dtypes))}; one "
            "reduce-scatter needs one dtype. Fix: cast the tensors, or call once per dtype."
        )
    rank, world = comm.get_rank(group), comm.get_world_size(group)
    chunks = [_chunk(t.numel(), world) for t in tensors]
    block = sum(chunks)  # elements each rank receives
    # send: (world, block); row r holds rank r's chunk of every tensor, zero-padded
    send = torch.zeros(world, block, dtype=tensors[0].dtype, device=tensors[0].device)
    offset = 0
    for tensor, chunk in zip(tensors, chunks):
        flat = tensor.reshape(-1)
        for r in range(world):
            piece = flat[r * chunk : (r + 1) * chunk]
            send[r, offset : offset + piece.numel()].copy_(piece)
        offset += chunk
    send.div_(world)  # average, divided first as DeepSpeed does (same rounding)
    mine = torch.empty(block, dtype=send.dtype, device=send.device)
    comm.reduce_scatter_tensor(mine, send.view(-1), group=group)
    out, offset = [], 0
    for tensor, chunk in zip(tensors, chunks):
        length = max(0, min(chunk, tensor.numel() - rank * chunk))
        out.append(mine.narrow(0, offset, length))
        offset += chunk
    return out


@torch.no_grad()
def all_to_all_quant_reduce(tensors: list[torch.Tensor], groups: Any = None) -> list[torch.Tensor]:
    """Like :func:`reduce_scatter_coalesced` over the world (same slices of the average),
    through qgZ's quantized two-stage all-to-all.

    ``groups``: DeepSpeed's dict of node groups (``"local_{node}"``: the ranks of one node,
    ``"global_{local_rank}"``: one rank per node), or None to find the nodes from the host
    of every rank (:func:`shardspeed.comm.node_groups.host_key`; a collective that creates
    the groups). A collective: every rank passes tensors of the same shapes.
    """
    from shardspeed.zero.zeropp.grads import QuantizedReduction
    from shardspeed.zero.zeropp.groups import build_groups

    rank, world = comm.get_rank(), comm.get_world_size()
    if groups is None:
        found = build_groups(None, 1, hierarchical=True)
        intra, local, inter, nodes = (
            found.intra, found.intra_size, found.inter, found.inter_size
        )  # fmt: skip
    else:
        local = world // max(sum(1 for key in groups if str(key).startswith("local_")), 1)
        intra = groups[f"local_{rank // local}"]
        inter = groups.get(f"global_{rank % local}") if world > local else None
        nodes = world // local
    reduction = QuantizedReduction(
        world_size=world, intra=intra, intra_size=local, inter=inter, inter_size=nodes
    )
    out = []
    for tensor in tensors:
        chunk = _chunk(tensor.numel(), world)
        padded = torch.zeros(world * chunk, dtype=torch.float32, device=tensor.device)
        padded[: tensor.numel()].copy_(tensor.reshape(-1))
        summed = reduction.reduce(padded, (rank * chunk, (rank + 1) * chunk))
        length = max(0, min(chunk, tensor.numel() - rank * chunk))
        out.append((summed[:length] / world).to(tensor.dtype))
    return out


__all__ = ["all_to_all_quant_reduce", "reduce_scatter_coalesced"]
