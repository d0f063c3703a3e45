"""One rank of the two-host job (2 hosts x 1 rank), and the training bodies it shares with
the one-host runs of ``test_two_hosts.py``.

Under torchrun: ``python two_host_worker.py OUT_DIR`` writes ``OUT_DIR/rank{R}.pt`` with

* ``nodes``: where the rank ran and its node-local groups (with one all-reduce on each);
* ``zero1``: losses and final parameters of the parity GPT trained at ZeRO 1;
* ``zero3``: the same at ZeRO 3, saving a checkpoint into ``OUT_DIR/ckpt`` (one folder both
  hosts see) after step ``SAVE_AT``, then trying a save into a folder per host, which the
  writer must refuse (it needs a shared filesystem).
"""

from __future__ import annotations

import os
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
from parity_common import ParitySpec, make_model, train_steps

STEPS = 4
SAVE_AT = 2  # the checkpoint holds steps 0..SAVE_AT-1
GLOBAL_MICRO_BATCHES = 2  # world x GAS: 2 x 1 across hosts, 1 x 2 on one rank


def zero1_spec() -> ParitySpec:
    return ParitySpec(stage=1, world=2, steps=STEPS)


def zero3_spec(world: int = 2) -> ParitySpec:
    spec = ParitySpec(stage=3, world=world, gas=GLOBAL_MICRO_BATCHES // world, steps=STEPS)
    # 20 elements: the matrices are sharded unit flats, the LayerNorm weights a persistent one
    spec.extra["zero_optimization"] = {"stage": 3, "stage3_param_persistence_threshold": 20}
    return spec


def new_engine(spec: ParitySpec, seed: int | None = None) -> Any:
    import shardspeed

    model = make_model(spec if seed is None else replace(spec, seed=seed))
    engine, _, _, _ = shardspeed.initialize(model=model, config=spec.config())
    return engine


def full_params(engine: Any) -> dict[str, torch.Tensor]:
    """Every parameter in full (gathered at stage 3: a collective)."""
    state = engine.state_dict()
    return {n: state[n].detach().float().clone() for n, _ in engine.module.named_parameters()}


def train_zero1() -> dict[str, Any]:
    spec = zero1_spec()
    engine = new_engine(spec)
    losses = train_steps(engine, spec, range(STEPS))
    params = full_params(engine)
    engine.destroy()
    return {"losses": losses, "params": params}


def train_zero3(shared_dir: str, per_host_dir: str | None = None) -> dict[str, Any]:
    """ZeRO 3 for STEPS steps with a checkpoint after SAVE_AT; optionally a per-host save."""
    from shardspeed.checkpoint import save_checkpoint
    from shardspeed.checkpoint.commit import CheckpointError

    spec = zero3_spec()
    engine = new_engine(spec)
    losses = train_steps(engine, spec, range(SAVE_AT))
    save_checkpoint(engine, shared_dir)
    losses += train_steps(engine, spec, range(SAVE_AT, STEPS))
    params = full_params(engine)
    refused = None
    if per_host_dir is not None:
        try:
            save_checkpoint(engine, per_host_dir)
        except CheckpointError as err:
            refused = str(err)
    engine.destroy()
    return {"losses": losses, "params": params, "per_host_refused": refused}


def resume_zero3_on_one_rank(ckpt_dir: str) -> dict[str, Any]:
    """Load the two-host checkpoint into a 1-rank ZeRO-3 engine (other init) and finish."""
    from shardspeed.checkpoint import load_checkpoint

    spec = zero3_spec(world=1)
    engine = new_engine(spec, seed=99)  # everything must come from the checkpoint
    path, _ = load_checkpoint(engine, ckpt_dir)
    assert path is not None and engine.global_steps == SAVE_AT, (path, engine.global_steps)
    losses = train_steps(engine, spec, range(SAVE_AT, STEPS))
    params = full_params(engine)
    engine.destroy()
    return {"losses": losses, "params": params}


def one_host_run(ckpt_dir: str) -> dict[str, Any]:
    """The same training on one host (the harness's ranks), for comparison."""
    return {"zero1": train_zero1(), "zero3": train_zero3(ckpt_dir)}


def node_report() -> dict[str, Any]:
    """Where this rank runs and what its node-local groups are, checked with collectives."""
    from shardspeed import comm
    from shardspeed.topology import Topology

    topo = Topology.build()
    nodes = topo.node_groups()
    rank = comm.get_rank()
    intra = torch.tensor([float(rank + 1)])
    comm.all_reduce(intra, group=nodes.intra_host)
    inter = torch.tensor([float(rank + 1)])
    comm.all_reduce(inter, group=nodes.inter_host)
    return {
        "host_label": os.environ.get("SS_TEST_HOST"),
        "interfaces": sorted(os.listdir("/sys/class/net")),
        "group_rank": os.environ.get("GROUP_RANK"),
        "master_addr": os.environ.get("MASTER_ADDR"),
        "hosts": nodes.layout.hosts,
        "host_index": nodes.host_index,
        "local_rank": nodes.local_rank,
        "intra_host_ranks": nodes.intra_host_ranks(),
        "inter_host_ranks": nodes.inter_host_ranks(),
        "intra_host_sum": float(intra),
        "inter_host_sum": float(inter),
        "data_axis_spans_hosts": nodes.layout.spans_hosts(topo.axis_ranks("data")),
        "cached": topo.node_groups() is nodes,
    }


def main(out_dir: Path) -> None:
    from shardspeed import comm

    comm.init_distributed()
    torch.set_num_threads(1)  # as the harness's ranks and the reference run
    rank = comm.get_rank()
    nodes = node_report()
    result = {
        "nodes": nodes,
        "zero1": train_zero1(),
        "zero3": train_zero3(
            str(out_dir / "ckpt"), str(out_dir / f"per_host_{nodes['host_index']}")
        ),
    }
    torch.save(result, out_dir / f"rank{rank}.pt")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
