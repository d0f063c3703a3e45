"""With optimizer offload, gradient slices stream to the host during backward.

On the micro-step that ends an accumulation window, each bucket's (stage 1/2) or flat's
(stage 3) reduced gradient is copied into its host buffer as soon as its reduction has
completed, from the grad-ready hooks, not at the optimizer step. A slow backward op
between the layers gives every early reduction time to finish, so the test can assert
that copies started inside backward; it also checks that no copy starts off the boundary
(the accumulated gradient is not final there) and that each host buffer equals the
reduced shard the optimizer would otherwise copy.
"""

from __future__ import annotations

import pytest

from shardspeed.testing import run_distributed

WORLD = 2
GAS = 2


def _streaming(stage: int) -> list[dict[str, object]]:
    import time

    import torch
    import torch.nn as nn

    import shardspeed
    from shardspeed.zero.flat_buffer import FlatGroup

    class SlowBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx: object, x: torch.Tensor) -> torch.Tensor:
            return x.view_as(x)

        @staticmethod
        def backward(ctx: object, grad: torch.Tensor) -> torch.Tensor:
            time.sleep(0.05)  # the reduction launched before this has time to complete
            return grad

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = nn.Linear(32, 32, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return SlowBackward.apply(torch.tanh(self.linear(x)))

    torch.manual_seed(0)
    model = nn.Sequential(*[Layer() for _ in range(4)])
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "weight_decay": 0.0}},
        "zero_optimization": {
            "stage": stage,
            "reduce_bucket_size": 32 * 32,  # one layer per bucket (stages 1/2)
            "stage3_param_persistence_threshold": 0,
            "offload_optimizer": {"device": "cpu"},
        },
    }
    engine, _, _, _ = shardspeed.initialize(model=model, config=config)
    in_flush = [False]
    events: list[tuple[bool, bool]] = []  # (during backward hooks, on the boundary)
    originals = (FlatGroup.stage_host_grad, engine.reducer.flush)

    def record() -> None:
        events.append((not in_flush[0], engine.is_gradient_accumulation_boundary()))

    def group_stage(self: FlatGroup, bucket: object) -> None:
        record()
        originals[0](self, bucket)  # type: ignore[arg-type]

    def flush() -> None:
        in_flush[0] = True
        try:
            originals[1]()
        finally:
            in_flush[0] = False

    FlatGroup.stage_host_grad = group_stage  # type: ignore[method-assign]
    engine.reducer.flush = flush  # type: ignore[method-assign]
    out: list[dict[str, object]] = []
    try:
        rank = torch.distributed.get_rank()
        for micro in range(2 * GAS):
            events.clear()
            x = torch.randn(4, 32, generator=torch.Generator().manual_seed(10 * micro + rank))
            engine.backward(engine(x).pow(2).mean())
            if engine.is_gradient_accumulation_boundary():
                pairs = [  # stage 3: every flat is a bucket of its UnitGroup
                    (s.group.host_grads[s.bucket.index], s.group.shard_grad(s.bucket))
                    for s in engine.reducer.order
                ]
                equal = all(torch.equal(h, s.float()) for h, s in pairs)
                staged = len(pairs)
            else:
                equal, staged = True, 0
            out.append({"events": list(events), "equal": equal, "buckets": staged})
            engine.step()
    finally:
        FlatGroup.stage_host_grad = originals[0]  # type: ignore[method-assign]
        engine.destroy()
    return out


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_gradients_stream_to_host_during_backward_on_the_boundary(stage: int) -> None:
    results = run_distributed(_streaming, WORLD, stage, timeout=120)
    for per_micro in results:
        for micro, record in enumerate(per_micro):
            boundary = (micro + 1) % GAS == 0
            events = record["events"]
            if not boundary:
                assert events == [], f"micro-step {micro}: a host copy off the boundary"
                continue
            assert record["equal"], f"micro-step {micro}: host buffers differ from the shards"
            # every bucket streamed exactly once, all on the boundary, most during backward
            assert len(events) == record["buckets"] > 1
            assert all(on_boundary for _, on_boundary in events)
            during = sum(1 for in_hook, _ in events if in_hook)
            assert during >= len(events) - 1, f"micro-step {micro}: {events}"
