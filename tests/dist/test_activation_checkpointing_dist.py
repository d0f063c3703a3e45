"""partition_activations across a 2-rank model-parallel group, with the RNG tracker."""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from shardspeed.testing import run_distributed


class _WorldMpu:
    """Megatron-style mpu whose model-parallel group is the whole (2-rank) world."""

    def get_model_parallel_rank(self) -> int:
        return dist.get_rank()

    def get_model_parallel_world_size(self) -> int:
        return dist.get_world_size()

    def get_model_parallel_group(self):
        return dist.group.WORLD


class _AllReduceSum(torch.autograd.Function):
    """Row-parallel output: sum partial results across the group; gradient passes through."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        x = x.clone()
        dist.all_reduce(x)
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        return grad


class _CopyToParallel(torch.autograd.Function):
    """Column-parallel input: identity forward; sum the partial input gradients backward."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> torch.Tensor:
        grad = grad.clone()
        dist.all_reduce(grad)
        return grad


class _TensorParallelLayer(nn.Module):
    """Megatron-style MLP: column-parallel fc1 (12 of 24 units per rank), row-parallel fc2.

    The layer input and output are replicated across the 2 ranks (what partitioning
    assumes); the hidden units are this rank's partition, so their dropout draws from the
    model-parallel stream (a different mask per rank).
    """

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(100 + dist.get_rank())
        self.fc1 = nn.Linear(10, 12)
        self.fc2 = nn.Linear(12, 10, bias=False)
        torch.manual_seed(7)
        self.bias = nn.Parameter(torch.randn(10))
        self.drop = nn.Dropout(0.25)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        import shardspeed

        x = self.drop(x)  # replicated activation: default stream, same mask on every rank
        with shardspeed.checkpointing.get_cuda_rng_tracker().fork():
            h = self.drop(
                torch.relu(self.fc1(_CopyToParallel.apply(x)))
            )  # partitioned activation: per-rank mask
        return x + _AllReduceSum.apply(self.fc2(h)) + self.bias


def _partitioned_ckpt_body(mode: str, cpu: bool) -> dict:
    import shardspeed
    from shardspeed.runtime.activation_checkpointing.stash import StashPolicy

    ck = shardspeed.checkpointing
    layers = nn.ModuleList(_TensorParallelLayer() for _ in range(3))
    torch.manual_seed(0)
    x0 = torch.randn(5, 3, 10)  # same input on both ranks; 150 elements -> 75 per rank

    kept_numel: list[int] = []
    kept_devices: set[str] = set()
    original_pack = StashPolicy.pack

    def recording_pack(self, tensor):
        kept, meta = original_pack(self, tensor)
        if tensor.numel():  # non_reentrant also saves an empty placeholder
            kept_numel.append(kept.numel())
            kept_devices.add(kept.device.type)
        return kept, meta

    def run(use_ckpt: bool) -> list[torch.Tensor]:
        ck.model_parallel_cuda_manual_seed(42)
        x = x0.clone().requires_grad_(True)
        for layer in layers:
            if not use_ckpt:
                x = layer(x)
            elif mode == "reentrant":
                x = ck.checkpoint(layer, x)
            else:
                x = ck.non_reentrant_checkpoint(layer, x)
        x.pow(2).sum().backward()
        grads = [p.grad.clone() for p in layers.parameters()]
        layers.zero_grad()
        return grads

    ck.configure(_WorldMpu(), partition_activations=True, checkpoint_in_cpu=cpu)
    reference = run(use_ckpt=False)
    StashPolicy.pack = recording_pack
    try:
        got = run(use_ckpt=True)
    finally:
        StashPolicy.pack = original_pack
    names = [n for n, _ in layers.named_parameters()]
    return {
        "max_diff": max((a - b).abs().max().item() for a, b in zip(reference, got)),
        "kept_numel": kept_numel,
        "kept_devices": kept_devices,
        "bias_grads": [
            g for n, g in zip(names, reference) if n.endswith(".bias") and "fc" not in n
        ],
    }


_CASES = (("reentrant", False), ("reentrant", True), ("non_reentrant", False))


def _all_cases() -> list[dict]:
    return [_partitioned_ckpt_body(mode, cpu) for mode, cpu in _CASES]


def test_partitioned_checkpoint_matches_plain_on_two_ranks():
    per_rank = run_distributed(_all_cases, 2, timeout=120)
    for case_index, (mode, cpu) in enumerate(_CASES):
        results = [per_rank[rank][case_index] for rank in range(2)]
        for r in results:
            assert r["max_diff"] == 0.0, (mode, cpu, results)
            assert r["kept_numel"] == [75, 75, 75], (mode, cpu, r)  # half of each input
            assert r["kept_devices"] == {"cpu"}
        # Replicated parameters get the same gradient on both ranks.
        assert len(results[0]["bias_grads"]) == 3
        for g0, g1 in zip(results[0]["bias_grads"], results[1]["bias_grads"]):
            torch.testing.assert_close(g0, g1)
