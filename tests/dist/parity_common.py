"""Shared pieces of the training parity tests: a tiny GPT, data, and the single-process reference.

The reference trains the same model on the same global batch in one process with plain
PyTorch: per micro-batch forward/backward in the parameter dtype, gradients summed in
fp32, global-norm clipping, the optimizer on fp32 masters, masters cast back to the
parameters. For fp32 this is ordinary training; for bf16/fp16 it is the precision policy
the engine claims to implement, computed without any sharding, including DeepSpeed's
zero-gradient optimizer step at construction at 16-bit ZeRO 0 (config
``initial_zero_grad_step``; :func:`takes_initial_zero_grad_step`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch

from shardspeed.models import GPT, GPTConfig

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class ParitySpec:
    stage: int = 0
    precision: str = "fp32"
    gas: int = 1
    world: int = 2
    micro: int = 2
    steps: int = 5
    lr: float = 1e-2
    clip: float = 0.0
    weight_decay: float = 0.01
    scheduler: dict[str, Any] | None = None
    two_groups: bool = False  # client optimizer with decay / no-decay groups
    optimizer: str = "AdamW"  # or "SGD" (momentum 0.9)
    seq: int = 8
    seed: int = 1234
    bucket_size: int = 500_000_000
    extra: dict[str, Any] = field(default_factory=dict)

    def optimizer_params(self) -> dict[str, Any]:
        params: dict[str, Any] = {"lr": self.lr, "weight_decay": self.weight_decay}
        if self.optimizer == "SGD":
            params["momentum"] = 0.9
        return params

    def config(self) -> dict[str, Any]:
        cfg: dict[str, Any] = {
            "train_micro_batch_size_per_gpu": self.micro,
            "gradient_accumulation_steps": self.gas,
            "gradient_clipping": self.clip,
            "zero_optimization": {"stage": self.stage, "reduce_bucket_size": self.bucket_size},
        }
        if not self.two_groups:
            cfg["optimizer"] = {"type": self.optimizer, "params": self.optimizer_params()}
        if self.scheduler is not None:
            cfg["scheduler"] = self.scheduler
        if self.precision == "bf16":
            cfg["bf16"] = {"enabled": True}
        if self.precision == "fp16":
            cfg["fp16"] = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 1000}
        cfg.update(self.extra)
        return cfg


def make_model(spec: ParitySpec) -> GPT:
    """A 2-layer GPT with tied embedding/head and no biases.

    No biases: the attention key bias has a mathematically zero gradient (softmax is
    shift-invariant), so its computed gradient is pure rounding noise whose sign depends
    on summation order, and Adam turns that noise into full +-lr steps.
    """
    torch.manual_seed(spec.seed)
    return GPT(
        GPTConfig(vocab_size=32, block_size=spec.seq, n_layer=2, n_head=2, n_embd=16, bias=False)
    )


def param_groups(model: torch.nn.Module, spec: ParitySpec, params: list | None = None) -> list:
    """Decay / no-decay groups (1-D tensors get no weight decay)."""
    named = list(model.named_parameters())
    tensors = params if params is not None else [p for _, p in named]
    decay = [t for (n, p), t in zip(named, tensors) if p.dim() >= 2]
    no_decay = [t for (n, p), t in zip(named, tensors) if p.dim() < 2]
    return [
        {"params": decay, "weight_decay": spec.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def takes_initial_zero_grad_step(spec: ParitySpec) -> bool:
    """Whether the engine steps the optimizer once with zero gradients when built, as
    DeepSpeed 0.19.8 does at ZeRO 0 with 16-bit parameters (unless the config opts out)."""
    opted_out = spec.extra.get("initial_zero_grad_step") == "none"
    return spec.stage == 0 and spec.precision != "fp32" and not opted_out


def step_with_zero_grads(opt: torch.optim.Optimizer, masters: list[torch.Tensor]) -> None:
    """One optimizer step with all-zero gradients (counts a step; weight decay applies)."""
    for m in masters:
        m.grad = torch.zeros_like(m)
    opt.step()
    for m in masters:
        m.grad = None


def micro_batch(spec: ParitySpec, step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Micro-batch ``index`` (0..world*gas-1) of optimizer step ``step``: same on every process."""
    g = torch.Generator().manual_seed(spec.seed * 7919 + step * 1009 + index)
    tokens = torch.randint(0, 32, (spec.micro, spec.seq + 1), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def reference_run(spec: ParitySpec) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Single-process training of the same global batch; returns losses and final params.

    Runs with one intra-op thread, like the harness's ranks: reductions inside CPU kernels
    (e.g. LayerNorm backward) split work by thread count, which shows in 16-bit results.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _reference_run(spec)
    finally:
        torch.set_num_threads(threads)


def _reference_run(spec: ParitySpec) -> tuple[list[float], dict[str, torch.Tensor]]:
    from shardspeed.optim import build_optimizer
    from shardspeed.runtime.lr_schedules import build_lr_scheduler

    model = make_model(spec)
    dtype = DTYPES[spec.precision]
    model.to(dtype)
    params = list(model.parameters())  # tied weight appears once
    masters = [p.detach().float().clone() for p in params]
    # Same optimizer construction as the engine (fused/foreach kernels round differently).
    if spec.two_groups:
        opt = build_optimizer("AdamW", {"lr": spec.lr}, param_groups(model, spec, masters))
    else:
        opt = build_optimizer(spec.optimizer, spec.optimizer_params(), masters)
    if takes_initial_zero_grad_step(spec):  # before the scheduler, as in the engine
        step_with_zero_grads(opt, masters)
    sched = None
    if spec.scheduler is not None:
        sched = build_lr_scheduler(spec.scheduler["type"], dict(spec.scheduler["params"]), opt)
    scale = 2.0**8 if spec.precision == "fp16" else 1.0
    n_micro = spec.world * spec.gas
    losses = []
    for step in range(spec.steps):
        micro_grads = []  # [j][param]: fp32 gradient of global micro-batch j
        total = 0.0
        for j in range(n_micro):
            x, y = micro_batch(spec, step, j)
            _, loss = model(x, y)
            (loss / spec.gas * scale).backward()  # the engine differentiates loss / GAS
            micro_grads.append([p.grad.float() for p in params])
            for p in params:
                p.grad = None
            total += float(loss.detach())
        acc = sum_in_engine_order(micro_grads, spec)
        for m, a in zip(masters, acc):
            m.grad = a / (scale * spec.world)
        norm = math.sqrt(sum(float(m.grad.pow(2).sum()) for m in masters))
        if spec.clip > 0 and spec.clip / (norm + 1e-6) < 1.0:
            for m in masters:
                m.grad.mul_(spec.clip / (norm + 1e-6))
        opt.step()
        if sched is not None:
            sched.step()
        with torch.no_grad():
            for p, m in zip(params, masters):
                p.copy_(m)
        losses.append(total / n_micro)
    final = {n: p.detach().float().clone() for n, p in model.named_parameters()}
    return losses, final


def _fold(tensors: list[list[torch.Tensor]]) -> list[torch.Tensor]:
    """Left-to-right sum of per-parameter gradient lists."""
    out = [t.clone() for t in tensors[0]]
    for more in tensors[1:]:
        for o, t in zip(out, more):
            o.add_(t)
    return out


def sum_in_engine_order(
    micro_grads: list[list[torch.Tensor]], spec: ParitySpec
) -> list[torch.Tensor]:
    """Sum micro-batch gradients in the order the engine adds them.

    Global micro-batch ``j = k * world + rank`` runs on ``rank`` as its ``k``-th micro-step.
    Stages 0/1 accumulate each rank's micro-steps locally, then reduce over ranks once; stages
    2/3 reduce every micro-step and accumulate the reduced gradients. The same terms summed
    in another order differ by rounding only, but gradients that nearly cancel (|g| ~ 1e-9
    against Adam's eps 1e-8) turn that rounding into visible update differences, which would
    say nothing about sharding. Ranks are folded in rank order.
    """
    world, gas = spec.world, spec.gas
    if spec.stage >= 2:
        per_micro = [_fold(micro_grads[k * world : (k + 1) * world]) for k in range(gas)]
        return _fold(per_micro)
    per_rank = [_fold([micro_grads[k * world + r] for k in range(gas)]) for r in range(world)]
    return _fold(per_rank)


def train_steps(engine: Any, spec: ParitySpec, steps: range) -> list[float]:
    """Train ``engine`` for ``steps`` (each ``spec.gas`` micro-batches, this rank's share of
    the global batch); the loss of every step averaged over all ranks and micro-batches."""
    from shardspeed import comm

    rank, world = comm.get_rank(), comm.get_world_size()
    losses = []
    for step in steps:
        total = torch.zeros((), dtype=torch.float64)
        for k in range(spec.gas):
            x, y = micro_batch(spec, step, k * world + rank)
            _, loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            total += float(loss.detach())
        comm.all_reduce(total)
        losses.append(float(total) / (world * spec.gas))
    return losses


def engine_run(spec: ParitySpec) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The same training through shardspeed.initialize on the current process group."""
    import shardspeed
    from shardspeed import comm

    world = comm.get_world_size()
    assert world == spec.world, (world, spec.world)
    model = make_model(spec)
    optimizer = None
    if spec.two_groups:
        from shardspeed.optim import build_optimizer

        optimizer = build_optimizer("AdamW", {"lr": spec.lr}, param_groups(model, spec))
    engine, _, _, _ = shardspeed.initialize(model=model, optimizer=optimizer, config=spec.config())
    losses = train_steps(engine, spec, range(spec.steps))
    final = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    return losses, final
