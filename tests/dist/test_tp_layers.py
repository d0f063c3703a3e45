"""Tensor-parallel layers on gloo (tp=2 and tp=4) against their unsharded torch counterparts.

Every case runs the same full module on every rank as the reference, shards a copy, and
compares the forward output, the input gradient and the full (gathered) weight gradients at
fp32 1e-5 relative. One ``run_distributed`` call per world size loops over the cases.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from shardspeed import comm
from shardspeed.parallel.tensor.comm_ops import (
    gather_from_sequence_region,
    scatter_to_sequence_region,
)
from shardspeed.parallel.tensor.cross_entropy import vocab_parallel_cross_entropy
from shardspeed.parallel.tensor.groups import tensor_group, topology_for
from shardspeed.parallel.tensor.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    sum_sequence_parallel_grads,
)
from shardspeed.parallel.tensor.partition import ShardLayout, even_split
from shardspeed.parallel.tensor.state import gather_full_tensor
from shardspeed.testing import assert_close_rel, run_distributed

RTOL, ATOL = 1e-5, 1e-6


class Conv1D(nn.Module):
    """Hugging Face's Conv1D (weight stored (in, out)), without importing transformers."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.1)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.addmm(self.bias, x.reshape(-1, x.shape[-1]), self.weight).view(
            *x.shape[:-1], self.nf
        )


def _close(actual: torch.Tensor, expected: torch.Tensor, msg: str) -> None:
    assert_close_rel(actual, expected, rtol=RTOL, atol=ATOL, msg=msg)


def _check_grads(sharded: nn.Module, full: nn.Module, group, msg: str) -> None:
    reference = dict(full.named_parameters())
    for name, param in sharded.named_parameters():
        grad = param.grad.detach()
        if getattr(param, "tp_layout", None) is not None:
            grad = grad.clone()
            grad.tp_layout = param.tp_layout
            grad = gather_full_tensor(grad, group)
        _close(grad, reference[name].grad, f"{msg}: grad of {name}")


def _layers_body(tp: int) -> int:
    topology_for(tp)
    group = tensor_group(tp)
    rank = comm.get_rank(group)
    checked = 0

    # ---- column-parallel, plain and fused (uneven q/k/v-like sub-parameters), with/without gather
    for gather in (True, False):
        for layout in (
            ShardLayout.of(0, even_split(10, tp)),
            ShardLayout.fused(0, [even_split(6, tp), even_split(3 * tp, tp), even_split(5, tp)]),
        ):
            torch.manual_seed(10)
            full = nn.Linear(7, layout.full_size)
            x = torch.randn(2, 3, 7)
            sharded = ColumnParallelLinear.from_module(
                copy.deepcopy(full), layout, group=group, gather_output=gather
            )
            x_ref, x_tp = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
            y_ref, y_tp = full(x_ref), sharded(x_tp)
            probe = torch.randn_like(y_ref)
            (y_ref * probe).sum().backward()
            if gather:
                _close(y_tp, y_ref, f"column gather {layout}")
                (y_tp * probe).sum().backward()
            else:
                idx = torch.cat([torch.arange(lo, hi) for lo, hi in layout.ranges(rank)])
                _close(y_tp, y_ref[..., idx], f"column local {layout}")
                (y_tp * probe[..., idx]).sum().backward()
            _close(x_tp.grad, x_ref.grad, f"column input grad {layout} gather={gather}")
            _check_grads(sharded, full, group, f"column {layout}")
            assert sharded.weight.tensor_model_parallel and sharded.weight.partition_dim == 0
            assert sharded.weight.partition_stride == layout.num_sub
            checked += 1

    # ---- row-parallel, input already split or scattered here
    for input_is_parallel in (True, False):
        torch.manual_seed(11)
        layout = ShardLayout.of(1, even_split(9, tp))
        full = nn.Linear(9, 5)
        x = torch.randn(2, 3, 9)
        sharded = RowParallelLinear.from_module(
            copy.deepcopy(full), layout, group=group, input_is_parallel=input_is_parallel
        )
        ((lo, hi),) = layout.ranges(rank)
        x_ref = x.clone().requires_grad_(True)
        x_tp = (x[..., lo:hi] if input_is_parallel else x).clone().requires_grad_(True)
        y_ref, y_tp = full(x_ref), sharded(x_tp)
        probe = torch.randn_like(y_ref)
        (y_ref * probe).sum().backward()
        (y_tp * probe).sum().backward()
        _close(y_tp, y_ref, "row forward")
        expected = x_ref.grad[..., lo:hi] if input_is_parallel else x_ref.grad
        _close(x_tp.grad, expected, f"row input grad (input_is_parallel={input_is_parallel})")
        _check_grads(sharded, full, group, "row")
        assert not hasattr(sharded.bias, "tensor_model_parallel")  # replicated bias carries nothing
        checked += 1

    # ---- Conv1D layout: a column (fused [q|k|v]) then a row layer, as in GPT-2 attention
    torch.manual_seed(12)
    width = 4 * tp
    c_attn, c_proj = Conv1D(3 * width, 6), Conv1D(6, width)
    x = torch.randn(2, 3, 6)
    attn_layout = ShardLayout.fused(0, [even_split(width, tp)] * 3)
    col = ColumnParallelLinear.from_module(copy.deepcopy(c_attn), attn_layout, group=group)
    row = RowParallelLinear.from_module(
        copy.deepcopy(c_proj), ShardLayout.of(1, even_split(width, tp)), group=group
    )
    assert col.weight.partition_dim == 1 and row.weight.partition_dim == 0  # (in, out) storage

    def attn_like(qkv_proj, out_proj, x, local_width):
        q, k, v = qkv_proj(x).split(local_width, dim=-1)  # (B, T, w) each
        return out_proj(q * k.sigmoid() + v)

    x_ref, x_tp = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y_ref = attn_like(c_attn, c_proj, x_ref, width)
    y_tp = attn_like(col, row, x_tp, attn_layout.shard_size(rank) // 3)
    probe = torch.randn_like(y_ref)
    (y_ref * probe).sum().backward()
    (y_tp * probe).sum().backward()
    _close(y_tp, y_ref, "conv1d attention forward")
    _close(x_tp.grad, x_ref.grad, "conv1d attention input grad")
    _check_grads(col, c_attn, group, "conv1d c_attn")
    _check_grads(row, c_proj, group, "conv1d c_proj")
    checked += 1

    # ---- sequence parallel: tokens sharded outside the column->row pair (Megatron SP)
    torch.manual_seed(13)
    fc, proj = nn.Linear(6, 4 * tp), nn.Linear(4 * tp, 6)
    col = ColumnParallelLinear.from_module(
        copy.deepcopy(fc),
        ShardLayout.of(0, even_split(4 * tp, tp)),
        group=group,
        sequence_parallel=True,
    )
    row = RowParallelLinear.from_module(
        copy.deepcopy(proj),
        ShardLayout.of(1, even_split(4 * tp, tp)),
        group=group,
        sequence_parallel=True,
    )
    x = torch.randn(2, 2 * tp, 6)  # (B, T, H)
    x_ref = x.clone().requires_grad_(True)
    x_tp = x.clone().requires_grad_(True)
    y_ref = proj(F.gelu(fc(x_ref)))  # (B, T, H)
    y_tp = row(F.gelu(col(scatter_to_sequence_region(x_tp, group))))  # (B, T / tp, H)
    y_tp = gather_from_sequence_region(y_tp, group, reduce_grads=False)  # (B, T, H)
    probe = torch.randn_like(y_ref)
    (y_ref * probe).sum().backward()
    (y_tp * probe).sum().backward()
    assert row.bias.sequence_parallel  # added to token shards: its gradient is partial
    sum_sequence_parallel_grads(row, group)
    _close(y_tp, y_ref, "sequence-parallel MLP forward")
    _close(x_tp.grad, x_ref.grad, "sequence-parallel MLP input grad")
    _check_grads(col, fc, group, "sequence-parallel fc")
    _check_grads(row, proj, group, "sequence-parallel proj")
    checked += 1

    # ---- vocabulary-parallel embedding (uneven vocabulary, padding row)
    torch.manual_seed(14)
    vocab = 4 * tp + 3
    full = nn.Embedding(vocab, 5, padding_idx=2)
    layout = ShardLayout.of(0, even_split(vocab, tp))
    sharded = VocabParallelEmbedding.from_module(copy.deepcopy(full), layout, group=group)
    ids = torch.randint(0, vocab, (3, 7))
    ids[0, 0] = 2
    y_ref, y_tp = full(ids), sharded(ids)
    probe = torch.randn_like(y_ref)
    (y_ref * probe).sum().backward()
    (y_tp * probe).sum().backward()
    _close(y_tp, y_ref, "vocab embedding forward")
    _check_grads(sharded, full, group, "vocab embedding")
    checked += 1

    # ---- vocabulary-parallel cross-entropy == F.cross_entropy (no full logits on any rank)
    torch.manual_seed(15)
    logits = torch.randn(4, 6, vocab) * 3
    target = torch.randint(0, vocab, (4, 6))
    target[0, :2] = -100
    ((lo, hi),) = layout.ranges(rank)
    for reduction in ("mean", "sum", "none"):
        full_logits = logits.clone().requires_grad_(True)
        local = logits[..., lo:hi].clone().requires_grad_(True)
        ref = F.cross_entropy(full_logits.transpose(1, 2), target, reduction=reduction)
        out = vocab_parallel_cross_entropy(local, target, group, reduction=reduction)
        _close(out, ref, f"vocab CE {reduction}")
        probe = torch.rand_like(ref)
        (ref * probe).sum().backward()
        (out * probe).sum().backward()
        _close(local.grad, full_logits.grad[..., lo:hi], f"vocab CE grad {reduction}")
        checked += 1
    return checked


@pytest.mark.parametrize("tp", [2, 4])
def test_layers_match_unsharded(tp: int) -> None:
    counts = run_distributed(_layers_body, tp, tp, timeout=120)
    assert counts == [counts[0]] * tp and counts[0] == 12


def _group_body() -> tuple[list[int], bool]:
    topo = topology_for(2)
    same = topology_for(2) is topo  # cached: built once per world and tp size
    return topo.axis_ranks("tensor"), same


def test_tensor_group_is_the_topology_tensor_axis() -> None:
    results = run_distributed(_group_body, 4, timeout=60)
    assert [r[0] for r in results] == [[0, 1], [0, 1], [2, 3], [2, 3]]  # DeepSpeed's grid
    assert all(r[1] for r in results)
