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

Not here: ``all_to_all_quant_reduce`` (ZeRO++ qgZ). It needs DeepSpeed's int4 swizzled
quantization kernels and node-local / cross-node groups; ShardSpeed does not implement qgZ
(``zero_optimization.zero_quantized_gradients`` is refused by the config).
"""

from __future__ import annotations

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


__all__ = ["reduce_scatter_coalesced"]
