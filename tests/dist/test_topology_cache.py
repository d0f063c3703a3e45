"""The one Topology cache (``shardspeed.parallel.topology_cache.TOPOLOGIES``) on 2 gloo ranks.

Its entries live as long as the world group they were built in: after
``destroy_process_group()`` and a new ``init_process_group()`` every lookup builds afresh
(a stale entry would hand out the dead world's groups and keep their gloo threads alive).
``deepspeed.utils.groups`` answers with the mesh the last ``initialize`` used, and its
expert getters with the groups of the ``ep_size`` named by ``group_name``.
"""

from __future__ import annotations

import os
from datetime import timedelta
from pathlib import Path

import torch

from shardspeed.testing import run_distributed

WORLD = 2


def _reinit(store_dir: str) -> dict[str, bool]:
    import torch.distributed as dist

    from shardspeed.parallel.tensor.groups import topology_for
    from shardspeed.parallel.topology_cache import TOPOLOGIES
    from shardspeed.utils import groups

    tensor = topology_for(2)
    data_group = groups.get_data_parallel_group()
    job = TOPOLOGIES.job()
    same_again = topology_for(2) is tensor and TOPOLOGIES.job() is job
    dist.destroy_process_group()
    nothing_without_world = TOPOLOGIES.job() is None and TOPOLOGIES.live("tensor") == []
    rank = int(os.environ["RANK"])
    store = dist.FileStore(os.path.join(store_dir, "store"), WORLD)
    dist.init_process_group(
        "gloo", store=store, rank=rank, world_size=WORLD, timeout=timedelta(seconds=60)
    )
    return {
        "same_again": same_again,
        "job_was_cached": job is not None,
        "nothing_without_world": nothing_without_world,
        "fresh_tensor": topology_for(2) is not tensor,
        "fresh_job": groups.get_data_parallel_group() is not data_group,
        "fresh_groups_work": _all_reduce_ok(topology_for(2).group("tensor")),
    }


def _all_reduce_ok(group: object) -> bool:
    import torch.distributed as dist

    t = torch.ones(1)
    dist.all_reduce(t, group=group)
    return t.item() == WORLD


def test_cache_lives_as_long_as_the_world_group(tmp_path: Path) -> None:
    for result in run_distributed(_reinit, WORLD, str(tmp_path)):
        assert result == dict.fromkeys(result, True), result


def _expert_getters() -> tuple[int, int, int, int, int]:
    import shardspeed
    from shardspeed.parallel.moe.layer import MoE
    from shardspeed.utils import groups

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(4, 4), MoE(4, torch.nn.Linear(4, 4), num_experts=2, ep_size=2)
    )
    engine, *_ = shardspeed.initialize(
        model=model,
        config={
            "train_micro_batch_size_per_gpu": 2,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
        },
    )
    name = model[1].expert_group_name
    out = (
        groups._get_expert_parallel_world_size(name),
        groups._get_expert_parallel_rank(name),
        groups._get_expert_data_parallel_world_size(name),
        groups.get_data_parallel_world_size(),
        groups.get_data_parallel_rank(),
    )
    engine.destroy()
    return out


def test_expert_getters_answer_for_the_named_ep_size() -> None:
    r0, r1 = run_distributed(_expert_getters, WORLD)
    assert r0 == (2, 0, 1, 2, 0) and r1 == (2, 1, 1, 2, 1)
