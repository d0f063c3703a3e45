"""One MoE training client for the bf16 clipping-norm oracle, run by both libraries.

:func:`train_cases` is written against DeepSpeed's API and runs under DeepSpeed 0.19.8
(``.venv-peers``, started by ``torch.distributed.run`` with this file as the script: it
keeps its groups in module globals) and under ShardSpeed (``import shardspeed as
deepspeed``, spawned by ``run_distributed``). Model: ``dense -> MoE(ep_size=2, k,
use_residual, capacity_factor=0.5, min_capacity=1: tokens dropped) -> head``; loss
``mse + 0.01 * l_aux``; bf16 parameters, GAS 2, gradient clipping ``CLIP`` (below every
step's norm, so the clipping norm shapes each update).

A case is ``(stage, k, optimizer)``; ``optimizer`` is ``"client"`` (a ``torch.optim.Adam``
instance over ``split_params_into_different_moe_groups_for_optimizer`` groups) or
``"config"`` (``"optimizer": {"type": "Adam"}``, which DeepSpeed builds as ``FusedAdam``).
Per case: every micro-step's loss, every step's ``get_global_grad_norm()``, and, under
DeepSpeed at stage 0, two reference norms of the reduced gradients it keeps in ``.grad``
at each boundary (``dense``: non-expert parameters only; ``true``: dense plus each
expert once), which say which rule DeepSpeed's clipping norm followed.

As a script (one DeepSpeed rank): ``argv = [result_dir, case, case, ...]``, each case
written ``stage:k:optimizer``.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

HIDDEN, FFN, EXPERTS, BATCH, SEQ, STEPS, GAS, CLIP, EP = 8, 16, 4, 2, 8, 3, 2, 0.05, 2
Case = tuple[int, int, str]


def _net(moe_class: Any, k: int) -> torch.nn.Module:
    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.dense = torch.nn.Linear(HIDDEN, HIDDEN)
            expert = torch.nn.Sequential(
                torch.nn.Linear(HIDDEN, FFN), torch.nn.GELU(), torch.nn.Linear(FFN, HIDDEN)
            )
            self.moe = moe_class(
                HIDDEN, expert, num_experts=EXPERTS, ep_size=EP, k=k, capacity_factor=0.5,
                min_capacity=1, use_residual=True,
            )  # fmt: skip
            self.head = torch.nn.Linear(HIDDEN, 1)

        def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            # x: (BATCH, SEQ, HIDDEN) in the parameter dtype; y: (BATCH, SEQ) fp32
            h, l_aux, _ = self.moe(torch.tanh(self.dense(x)))
            return (self.head(h).squeeze(-1).float() - y).pow(2).mean() + 0.01 * l_aux.float()

    return Net()


def _reference_norms(model: torch.nn.Module, is_moe_param: Any) -> dict[str, float]:
    """Norms of the reduced gradients DeepSpeed holds in ``.grad`` at a boundary."""
    dense = sum(
        float(p.grad.float().pow(2).sum())
        for p in model.parameters()
        if p.grad is not None and not is_moe_param(p)
    )
    local = sum(
        float(p.grad.float().pow(2).sum())
        for p in model.parameters()
        if p.grad is not None and is_moe_param(p)
    )
    experts = torch.tensor([local], dtype=torch.float64)
    torch.distributed.all_reduce(experts)  # every expert_data replica adds the same experts
    replicas = torch.distributed.get_world_size() // EP
    return {"dense": dense**0.5, "true": (dense + float(experts[0]) / replicas) ** 0.5}


def _initialize(ds: Any, model: torch.nn.Module, split_groups: Any, stage: int, opt: str) -> Any:
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": BATCH,
        "gradient_accumulation_steps": GAS,
        "gradient_clipping": CLIP,
        "zero_optimization": {"stage": stage},
        "bf16": {"enabled": True},
    }
    if opt == "config":
        config["optimizer"] = {"type": "Adam", "params": {"lr": 1e-2}}
        engine, _, _, _ = ds.initialize(
            model=model, model_parameters=model.parameters(), config=config
        )
        return engine
    groups = split_groups({"name": "params", "params": list(model.parameters())})
    optimizer = torch.optim.Adam(groups, lr=1e-2)
    engine, _, _, _ = ds.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def train_cases(
    ds: Any, moe_class: Any, split_groups: Any, is_moe_param: Any, cases: list[Case]
) -> dict[Case, dict[str, Any]]:
    """Every case on this rank; only torch and the given DeepSpeed-API objects."""
    rank = torch.distributed.get_rank()
    local = EXPERTS // EP
    references = ds.__name__ == "deepspeed"
    results: dict[Case, dict[str, Any]] = {}
    for stage, k, opt in cases:
        torch.manual_seed(10 * stage + k)
        model = _net(moe_class, k)
        with torch.no_grad():  # distinct experts (copies start equal), by global expert id
            for i, module in enumerate(model.moe.deepspeed_moe.experts.deepspeed_experts):
                g = torch.Generator().manual_seed(1000 + (rank % EP) * local + i)
                for p in module.parameters():
                    p.add_(0.3 * torch.randn(p.shape, generator=g))
        engine = _initialize(ds, model, split_groups, stage, opt)
        dtype = next(engine.module.parameters()).dtype
        losses, norms, refs = [], [], []
        for step in range(STEPS):
            for micro in range(GAS):
                g = torch.Generator().manual_seed(100 * step + 10 * micro + rank)
                x = torch.randn(BATCH, SEQ, HIDDEN, generator=g).to(dtype)
                y = torch.randn(BATCH, SEQ, generator=g)
                torch.manual_seed(7 * step + micro + 31 * rank)  # RTS / Gumbel draws
                loss = engine(x, y)
                engine.backward(loss)
                if references and stage == 0 and micro == GAS - 1:
                    refs.append(_reference_norms(engine.module, is_moe_param))
                engine.step()
                losses.append(float(loss.detach()))
            norm = engine.get_global_grad_norm()
            norms.append(None if norm is None else float(norm))
        results[(stage, k, opt)] = {"losses": losses, "norms": norms, "refs": refs}
        if hasattr(engine, "destroy"):
            engine.destroy()
    return results


def deepspeed_rank(result_dir: str, cases: list[Case]) -> None:
    """One DeepSpeed rank (under torch.distributed.run in the peers venv)."""
    import deepspeed
    import deepspeed.comm.torch as ds_comm_torch
    from deepspeed.moe.layer import MoE
    from deepspeed.moe.utils import is_moe_param
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer as split

    ds_comm_torch.build_shm_op = lambda: None  # skip a JIT build the gloo test never uses
    deepspeed.init_distributed(dist_backend="gloo")
    torch.set_num_threads(1)
    results = train_cases(deepspeed, MoE, split, is_moe_param, cases)
    torch.save(results, Path(result_dir) / f"rank{torch.distributed.get_rank()}.pt")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def shardspeed_rank(cases: list[Case]) -> dict[Case, dict[str, Any]]:
    """One ShardSpeed rank (under ``run_distributed``)."""
    import shardspeed as deepspeed
    from shardspeed.moe.layer import MoE
    from shardspeed.moe.utils import is_moe_param
    from shardspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer as split

    return train_cases(deepspeed, MoE, split, is_moe_param, cases)


def parse_case(text: str) -> Case:
    stage, k, opt = text.split(":")
    return int(stage), int(k), opt


if __name__ == "__main__":  # a DeepSpeed rank
    deepspeed_rank(sys.argv[1], [parse_case(c) for c in sys.argv[2:]])
