"""GradNorm terms: slices summed over other mesh axes, or not counted, on 4 gloo ranks."""

from __future__ import annotations

import math

import torch

from shardspeed.testing import run_distributed


def _values(data: int, tensor: int) -> tuple[torch.Tensor, torch.Tensor]:
    # master 0: replicated over the tensor axis (depends on the data coordinate only);
    # master 1: [0:3) a tensor-parallel shard (differs per tensor rank), [3:5) a tied copy
    rest = torch.tensor([1.0 + data, 2.0, -0.5 * (data + 1)])
    shard = torch.tensor([0.3 * (tensor + 1) + data, -1.0 - tensor, 0.25, 7.0, -7.0])
    return rest, shard


def _norm() -> float:
    from shardspeed import comm
    from shardspeed.topology import Topology
    from shardspeed.zero.grad_norm import GradNorm, NormTerm

    topo = Topology.build(tp=2)  # world 4: dp=2 x tp=2
    c = topo.coords(comm.get_rank())
    grads = list(_values(c.data, c.tensor))
    terms = [
        NormTerm([(1, 0, 3)], [topo.group("data"), topo.group("tensor")]),
        NormTerm([(1, 3, 5)], None),  # counted elsewhere
    ]
    return GradNorm([topo.group("data")], torch.device("cpu"), terms)(grads)


def test_terms_sum_over_their_own_axes() -> None:
    expected = 0.0
    for data in range(2):
        rest, _ = _values(data, 0)
        expected += float(rest.pow(2).sum())
        for tensor in range(2):
            expected += float(_values(data, tensor)[1][0:3].pow(2).sum())
    norms = run_distributed(_norm, 4)
    assert all(math.isclose(n, math.sqrt(expected), rel_tol=1e-6) for n in norms), norms
