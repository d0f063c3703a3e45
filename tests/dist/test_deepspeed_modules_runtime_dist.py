"""DeepSpeed module paths that communicate, on 2 gloo ranks, against plain PyTorch:

* ``TiledLinear`` trained under ZeRO-3 (``copy_params_from`` as a collective) = an
  ``nn.Linear`` trained in one process on the same global batch;
* ``safe_set_full_grad`` / ``safe_set_local_grad`` / ``safe_update_full_grad_vectorized``
  at ZeRO 1, 2, 3 (and 3 with optimizer offload): the step applies exactly the gradient set;
* ``unwrap_model_for_generation`` and TRL's hook removal at ZeRO-3: full weights inside,
  hooks paused, training after it unchanged;
* ``PipelineParallelGrid`` and ``reduce_scatter_coalesced``.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from shardspeed.testing import run_distributed

WORLD = 2
TOL = {"rtol": 1e-5, "atol": 1e-6}


# -- TiledLinear under ZeRO-3 --------------------------------------------------------------------


class TiledNet(nn.Module):
    def __init__(self, tiled: bool) -> None:
        super().__init__()
        from shardspeed.runtime.zero.tiling import TiledLinear

        torch.manual_seed(3)
        self.head = nn.Linear(6, 1)  # first: the tiles draw a different number of values
        self.proj = TiledLinear(8, 6, in_splits=2, out_splits=3) if tiled else nn.Linear(8, 6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.proj(x))).pow(2).mean()


def _source_linear() -> nn.Linear:
    torch.manual_seed(11)
    return nn.Linear(8, 6)


def _batch(step: int, j: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(100 * step + j))


def _tiled_zero3() -> dict[str, torch.Tensor]:
    import shardspeed
    from shardspeed import comm
    from shardspeed.zero import GatheredParameters

    rank = comm.get_rank()
    model = TiledNet(tiled=True)
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": 0.0,  # DeepSpeed's default is 1.0; the reference does not clip
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0},
    }
    engine, _, _, _ = shardspeed.initialize(model=model, config=config)
    source = _source_linear()
    if rank == 1:  # only data-parallel rank 0's values count
        source.weight.data.zero_()
    model.proj.copy_params_from(source)
    for step in range(3):
        engine.backward(engine(_batch(step, rank)))
        engine.step()
    with GatheredParameters(list(model.parameters())):
        rows = [torch.cat([t.weight for t in row], 1) for row in model.proj.linears]
        out = {
            "weight": torch.cat(rows, 0).detach().clone(),
            "bias": torch.cat([row[-1].bias for row in model.proj.linears]).detach().clone(),
            "tile_numel": torch.tensor(model.proj.linears[1][0].weight.numel()),
        }
    out["shard_numel"] = torch.tensor(model.proj.linears[1][0].weight.numel())  # released
    engine.destroy()
    return out


def _tiled_reference() -> dict[str, torch.Tensor]:
    model = TiledNet(tiled=False)
    model.proj.load_state_dict(_source_linear().state_dict())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(3):
        loss = sum(model(_batch(step, j)) for j in range(WORLD)) / WORLD
        loss.backward()
        opt.step()
        opt.zero_grad()
    return {"weight": model.proj.weight.detach(), "bias": model.proj.bias.detach()}


def test_tiled_linear_under_zero3_trains_like_the_linear():
    per_rank = run_distributed(_tiled_zero3, WORLD, timeout=120)
    ref = _tiled_reference()
    for got in per_rank:
        torch.testing.assert_close(got["weight"], ref["weight"], **TOL)
        torch.testing.assert_close(got["bias"], ref["bias"], **TOL)
        assert int(got["tile_numel"]) == 2 * 4 and int(got["shard_numel"]) == 0


# -- gradient setters at ZeRO 1-3 ----------------------------------------------------------------


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(7)
        self.layers = nn.ModuleList([nn.Linear(8, 12), nn.Linear(12, 12)])
        self.head = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x).pow(2).mean()


LOCAL = "layers.1.weight"  # set through safe_set_local_grad (x3)
VECTORIZED = ("head.weight", "head.bias")  # through safe_update_full_grad_vectorized (x0.5)


def _target_grad(name: str, shape: torch.Size) -> torch.Tensor:
    seed = sum(map(ord, name))
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def _expected_grad(name: str, shape: torch.Size) -> torch.Tensor:
    g = _target_grad(name, shape)
    return g * 3 if name == LOCAL else g * 0.5 if name in VECTORIZED else g


def _grad_config(stage: int, offload: bool = False) -> dict:
    zero: dict = {"stage": stage, "reduce_bucket_size": 100}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_clipping": 0.0,  # the step must apply exactly the gradient set
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.01}},
        "zero_optimization": zero,
    }


GRAD_CASES = {
    "stage1": _grad_config(1),
    "stage2": _grad_config(2),
    "stage3": _grad_config(3),
    "stage3-offload": _grad_config(3, offload=True),
}


def _set_grads_then_step(config: dict) -> dict[str, dict[str, torch.Tensor]]:
    import shardspeed
    from shardspeed import comm, utils
    from shardspeed.zero import GatheredParameters

    model = Net()
    engine, _, _, _ = shardspeed.initialize(model=model, config=config)
    named = dict(model.named_parameters())
    engine.backward(engine(_batch(0, comm.get_rank())))
    for name, p in named.items():
        utils.safe_set_full_grad(
            p, _target_grad(name, p.ds_shape if hasattr(p, "ds_shape") else p.shape)
        )
    local = utils.safe_get_local_grad(named[LOCAL])
    utils.safe_set_local_grad(named[LOCAL], local * 3)
    utils.safe_update_full_grad_vectorized(
        [named[n] for n in VECTORIZED], lambda grad, param: grad * 0.5
    )
    seen = {n: utils.safe_get_full_grad(p).clone() for n, p in named.items()}
    engine.step()
    with GatheredParameters(list(model.parameters())):
        params = {n: p.detach().clone() for n, p in named.items()}
    engine.destroy()
    return {"grads": seen, "params": params}


def _grads_reference() -> dict[str, dict[str, torch.Tensor]]:
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    grads = {n: _expected_grad(n, p.shape) for n, p in model.named_parameters()}
    for n, p in model.named_parameters():
        p.grad = grads[n].clone()
    opt.step()
    return {"grads": grads, "params": {n: p.detach() for n, p in model.named_parameters()}}


def _run_grad_cases() -> dict[str, object]:
    return {name: _set_grads_then_step(config) for name, config in GRAD_CASES.items()}


def test_gradient_setters_step_like_plain_torch_with_that_gradient():
    per_rank = run_distributed(_run_grad_cases, WORLD, timeout=180)
    ref = _grads_reference()
    for rank, results in enumerate(per_rank):
        for case, got in results.items():
            for key in ("grads", "params"):
                for name, want in ref[key].items():
                    torch.testing.assert_close(
                        got[key][name], want, **TOL, msg=lambda m, r=rank, c=case, n=name, k=key: (
                            f"rank {r} {c} {k} {n}: {m}"
                        )
                    )  # fmt: skip


# -- generation on gathered weights ----------------------------------------------------------------


def _trl_remove_hooks(engine: object) -> None:
    """What trl 1.16 ``models.utils.remove_hooks`` does to a DeepSpeed engine."""
    offload = engine.optimizer.parameter_offload  # type: ignore[attr-defined]
    module = offload.module
    params = [p for _, p in module.named_parameters(recurse=True)]
    params += [p for _, p in module.ds_external_parameters()]
    for p in params:
        p.ds_active_sub_modules.clear()
    for hook in offload.forward_hooks:
        hook.remove()
    for hook in offload.backward_hooks:
        hook.remove()
    offload.forward_hooks = []
    offload.backward_hooks = []


def _trl_add_hooks(engine: object) -> None:
    """What trl 1.16 ``models.utils.add_hooks`` does."""
    offload = engine.optimizer.parameter_offload  # type: ignore[attr-defined]
    if not offload.param_coordinator.is_invalid_trace():
        offload.param_coordinator._invalidate_trace()
    offload._register_deepspeed_module(offload.module)


def _generation() -> dict[str, object]:
    import shardspeed
    from shardspeed import comm
    from shardspeed.runtime.zero.stage3 import attach_parameter_offload, unwrap_model_for_generation
    from shardspeed.zero import GatheredParameters

    rank = comm.get_rank()
    model = Net()
    engine, _, _, _ = shardspeed.initialize(model=model, config=_grad_config(3))
    coordinator = engine.sharding.coordinator
    out: dict[str, object] = {"losses": []}
    x = _batch(9, 0)
    for step in range(2):
        with unwrap_model_for_generation(engine) as unwrapped, torch.no_grad():
            assert unwrapped is engine and coordinator.paused
            out[f"shapes{step}"] = [tuple(p.shape) for p in model.parameters()]
            out[f"gen{step}"] = model(x)
        assert not coordinator.paused
        out[f"after{step}"] = [p.numel() for p in model.parameters()]
        loss = engine(_batch(step, rank))
        engine.backward(loss)
        engine.step()
        out["losses"].append(float(loss))
    # TRL's path: GatheredParameters + remove_hooks ... add_hooks
    offload = attach_parameter_offload(engine)
    assert attach_parameter_offload(engine) is offload
    with GatheredParameters(model.parameters()):
        _trl_remove_hooks(engine)
        out["trl_paused"] = coordinator.paused
        with torch.no_grad():
            out["trl_gen"] = model(x)
        _trl_add_hooks(engine)
        out["trl_resumed"] = not coordinator.paused
    loss = engine(_batch(2, rank))
    engine.backward(loss)
    engine.step()
    out["losses"].append(float(loss))
    engine.destroy()
    return out


def _generation_reference() -> dict[str, object]:
    model = Net()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    x = _batch(9, 0)
    out: dict[str, object] = {"losses": [], "shapes": [tuple(p.shape) for p in model.parameters()]}
    for step in range(3):
        with torch.no_grad():
            out[f"gen{step}"] = model(x)
        losses = [model(_batch(step, j)) for j in range(WORLD)]
        (sum(losses) / WORLD).backward()
        opt.step()
        opt.zero_grad()
        out["losses"].append([float(v.detach()) for v in losses])
    return out


def test_unwrap_model_for_generation_and_trl_hook_removal_at_zero3():
    per_rank = run_distributed(_generation, WORLD, timeout=120)
    ref = _generation_reference()
    for rank, got in enumerate(per_rank):
        for step in (0, 1):
            assert got[f"shapes{step}"] == ref["shapes"]
            assert all(n == 0 for n in got[f"after{step}"])  # released again
            torch.testing.assert_close(got[f"gen{step}"], ref[f"gen{step}"], **TOL)
        assert got["trl_paused"] and got["trl_resumed"]
        torch.testing.assert_close(got["trl_gen"], ref["gen2"], **TOL)
        for step in range(3):
            assert abs(got["losses"][step] - ref["losses"][step][rank]) < 1e-5


# -- PipelineParallelGrid and reduce_scatter_coalesced ---------------------------------------------


def _grid_and_collectives() -> dict[str, object]:
    from shardspeed import comm
    from shardspeed.runtime.comm.coalesced_collectives import reduce_scatter_coalesced
    from shardspeed.runtime.pipe.topology import PipeDataParallelTopology, PipelineParallelGrid

    rank = comm.get_rank()
    out: dict[str, object] = {}
    grid = PipelineParallelGrid()  # DeepSpeed's default for 2 ranks: 2 stages, 1 replica
    out["pipe"] = (
        grid.get_stage_id(), grid.get_pipe_parallel_world_size(), grid.is_first_stage,
        grid.is_last_stage, grid.get_data_parallel_world_size(), grid.get_data_parallel_rank(),
        grid.get_model_parallel_world_size(), grid.get_model_parallel_rank(),
        grid.get_slice_parallel_world_size(), grid.get_slice_parallel_rank(),
        grid.stage_to_global(1 - grid.get_stage_id()), grid.p2p_groups, grid.pp_group,
        comm.get_world_size(grid.get_pipe_parallel_group()),
        comm.get_world_size(grid.get_data_parallel_group()),
    )  # fmt: skip
    grid = PipelineParallelGrid(PipeDataParallelTopology(num_pp=1, num_dp=2))
    t = torch.tensor([float(rank + 1)])
    comm.all_reduce(t, group=grid.get_data_parallel_group())
    out["data"] = (
        grid.get_stage_id(), grid.is_first_stage and grid.is_last_stage,
        grid.get_data_parallel_world_size(), grid.get_data_parallel_rank(),
        grid.get_data_parallel_group_ranks(), grid.get_model_parallel_world_size(),
        grid.p2p_groups, float(t),
    )  # fmt: skip
    tensors = [
        torch.arange(5.0) * (rank + 1),
        torch.arange(6.0).view(2, 3) + 10 * rank,
        torch.tensor([7.0 + rank]),
    ]
    out["rs"] = reduce_scatter_coalesced(tensors)
    out["inputs_unchanged"] = torch.equal(tensors[0], torch.arange(5.0) * (rank + 1))
    return out


def test_pipeline_grid_and_reduce_scatter_coalesced():
    per_rank = run_distributed(_grid_and_collectives, WORLD, timeout=60)
    for rank, got in enumerate(per_rank):
        assert got["pipe"] == (
            rank, 2, rank == 0, rank == 1, 1, 0, 2, rank, 1, 0, 1 - rank, [[0, 1], [1, 0]],
            [0, 1], 2, 1,
        )  # fmt: skip
        assert got["data"] == (0, True, 2, rank, [0, 1], 1, [[0, 0], [1, 1]], 3.0)
        # averages: a = arange(5) * 1.5, b = arange(6) + 5, c = 7.5; 3 / 3 / 1 elements per chunk
        a, b, c = torch.arange(5.0) * 1.5, torch.arange(6.0) + 5, torch.tensor([7.5])
        want = [a[3 * rank : 3 * rank + 3], b[3 * rank : 3 * rank + 3], c[rank : rank + 1]]
        assert [t.tolist() for t in got["rs"]] == [t.tolist() for t in want]
        assert got["inputs_unchanged"]
