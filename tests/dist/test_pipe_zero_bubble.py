"""Zero-bubble pipeline schedules (ZB-H1, ZBV, DualPipeV) against the one-process reference.

The 8-layer model of ``test_pipe_engine`` (residual tanh MLP blocks, each an
``nn.Linear``: their weight gradients are deferred to W) trained for three steps with
ZeRO-1, AdamW and active gradient clipping; loss of every step and every final parameter
within 1e-5 relative (fp32), as the other pipeline parity tests.

* pp=2: every zero-bubble schedule with m in {4, 8}; ZBV with a tied embedding/head,
  which the V placement puts on the same stage (the first and the last virtual stage are
  both on stage 0, so the loss is computed there and relayed to the last stage). After
  training, ``eval_batch(return_logits=True)`` of that ZBV engine must match the
  reference model's loss and logits (the relay of losses and outputs);
* pp=4 / pp=2 x dp=2: each schedule at m=8 over four stages (DualPipeV needs m >= 2p - 1),
  ZB-H1 with a tied embedding across the first and the last stage, ZBV with ZeRO-1
  sharding over two data-parallel ranks.
"""

from __future__ import annotations

from typing import Any

import torch
from test_pipe_engine import (
    NUM_LAYERS,
    PipeSpec,
    _run_all,
    build_reference,
    check_parity,
    micro_batch,
    reference_forward,
    reference_run,
)

from shardspeed.testing import assert_close_rel, run_distributed

EVAL_STEP = 100  # micro-batches of a step the training never saw


def _v(kind: str) -> int:
    return 2 if kind in ("zbv", "dualpipev") else 1


def _eval_after_training(spec: PipeSpec) -> tuple[float, Any, int]:
    """Train ``spec`` as ``pipeline_run`` does, then ``eval_batch`` fresh micro-batches."""
    import shardspeed
    from shardspeed.pipe import PipeDataParallelTopology, PipelineModule

    net = PipelineModule(
        spec.layers(),
        topology=PipeDataParallelTopology(num_pp=spec.pp, num_dp=spec.dp),
        loss_fn=spec.loss_fn(),
        seed_layers=True,
        partition_method="uniform",
        schedule=spec.schedule,
    )
    engine, _, _, _ = shardspeed.initialize(model=net, config=spec.config())
    data = iter([micro_batch(spec, step, k) for step in range(spec.steps) for k in range(spec.m)])
    for _ in range(spec.steps):
        engine.train_batch(data)
    batches = [micro_batch(spec, EVAL_STEP, k) for k in range(spec.m)]
    loss, logits = engine.eval_batch(iter(batches), return_logits=True)
    engine.destroy()
    return float(loss), logits, engine.stage_id


def _train_and_eval(specs: list[PipeSpec], eval_spec: PipeSpec) -> tuple[list[Any], Any]:
    return _run_all(specs), _eval_after_training(eval_spec)


def check_eval(spec: PipeSpec, per_rank: list[tuple[float, Any, int]]) -> None:
    _, params = reference_run(spec)
    layers = build_reference(spec)
    for i, layer in enumerate(layers):
        for pname, p in layer.named_parameters():
            tied = spec.tied and i in (0, NUM_LAYERS - 1)
            p.data.copy_(params[f"tied_modules.embed.{pname}" if tied else f"{i}.{pname}"])
    with torch.no_grad():
        batches = [micro_batch(spec, EVAL_STEP, k) for k in range(spec.m)]
        outputs = [reference_forward(spec, layers, x) for x, _ in batches]
        losses = [float(spec.loss_fn()(out, y)) for out, (_, y) in zip(outputs, batches)]
    for rank, (loss, logits, stage) in enumerate(per_rank):
        assert_close_rel(loss, sum(losses) / len(losses), rtol=1e-5, msg=f"eval loss rank {rank}")
        if stage == spec.pp - 1:  # the engine's last stage holds the outputs
            assert len(logits) == spec.m
            for got, want in zip(logits, outputs):
                assert_close_rel(got, want, rtol=1e-5, atol=1e-6, msg=f"eval logits rank {rank}")
        else:
            assert logits is None


def test_zero_bubble_parity_two_stages() -> None:
    specs = [
        PipeSpec(pp=2, m=m, schedule=kind, virtual=_v(kind))
        for kind in ("zb-h1", "zbv", "dualpipev")
        for m in (4, 8)
    ]
    specs.append(PipeSpec(pp=2, m=4, schedule="zbv", virtual=2, tied=True))
    results = run_distributed(_train_and_eval, 2, specs, specs[-1], timeout=300)
    check_parity(specs, [r[0] for r in results])
    check_eval(specs[-1], [r[1] for r in results])


def test_zero_bubble_parity_four_ranks() -> None:
    specs = [
        PipeSpec(pp=4, m=8, schedule=kind, virtual=_v(kind))
        for kind in ("zb-h1", "zbv", "dualpipev")
    ]
    specs += [
        PipeSpec(pp=4, m=4, schedule="zb-h1", tied=True),
        PipeSpec(pp=2, dp=2, m=4, schedule="zbv", virtual=2),
    ]
    check_parity(specs, run_distributed(_run_all, 4, specs, timeout=300))
