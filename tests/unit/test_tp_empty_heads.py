"""Attention on a tensor rank with no heads: empty output, every projection in the graph."""

from __future__ import annotations

import torch

from shardspeed.parallel.tensor.empty_heads import empty_heads_attention


def test_empty_heads_output_shape_and_graph() -> None:
    q = torch.empty(2, 0, 8, 4, requires_grad=True)  # (B, heads=0, T, D)
    k = torch.empty(2, 0, 8, 4, requires_grad=True)
    v = torch.empty(2, 0, 8, 4, requires_grad=True)
    out, weights = empty_heads_attention(torch.nn.Module(), q, k, v, None, scaling=0.5)
    assert out.shape == (2, 8, 0, 4) and weights is None
    out.sum().backward()
    # every projection's backward runs (each ends in a collective the other ranks issue)
    assert q.grad is not None and k.grad is not None and v.grad is not None
