"""A job across two hosts (network namespaces, one torchrun agent each, c10d rendezvous on
host A, gloo over the veth link): 2 hosts x 1 rank.

One job (``two_host_worker.py``) trains the parity GPT at ZeRO 1 and at ZeRO 3 and saves a
ZeRO-3 checkpoint into a folder both hosts see; the tests read its per-rank results:

* each rank ran in its own namespace, and the node-local groups put the two ranks on
  different hosts (intra-host groups [0] and [1], inter-host group [0, 1]);
* ZeRO 1 and ZeRO 3 losses and final parameters equal the one-process reference (fp32,
  1e-5 relative, as ``tests/dist``), and the same training on one host with 2 ranks
  bitwise;
* the checkpoint loads into one rank on one host (ZeRO 3, world 2 -> 1, GAS 1 -> 2: the
  same global batch) and training continues with the reference's losses;
* a save into a folder per host is refused on both ranks and publishes nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hosts import TwoHosts
from parity_common import reference_run
from two_host_worker import (
    SAVE_AT,
    STEPS,
    one_host_run,
    resume_zero3_on_one_rank,
    zero1_spec,
    zero3_spec,
)

from shardspeed.checkpoint.format import load_manifest
from shardspeed.testing import run_distributed

WORKER = Path(__file__).resolve().parent / "two_host_worker.py"
FP32 = {"rtol": 1e-5, "atol": 1e-6}


@pytest.fixture(scope="module")
def job(two_hosts: TwoHosts, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Run the two-host job once; every rank's results, the folder and the wall time."""
    out = tmp_path_factory.mktemp("two_hosts")
    wall = two_hosts.run(WORKER, [str(out)], out)
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]
    return {"ranks": ranks, "dir": out, "wall": wall, "hosts": two_hosts}


@pytest.fixture(scope="module")
def one_host(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """The same training on one host, 2 ranks (the harness)."""
    ckpt = tmp_path_factory.mktemp("one_host_ckpt")
    return run_distributed(one_host_run, 2, str(ckpt), timeout=180)


def _assert_close(losses: list[float], params: dict, ref_losses: list[float], ref_params: dict,
                  label: str) -> None:  # fmt: skip
    torch.testing.assert_close(
        torch.tensor(losses), torch.tensor(ref_losses), **FP32, msg=lambda m: f"{label} losses: {m}"
    )
    assert set(params) == set(ref_params), label
    for name, ref in ref_params.items():
        torch.testing.assert_close(
            params[name], ref, **FP32, msg=lambda m, name=name: f"{label} {name}: {m}"
        )


def test_each_rank_runs_on_its_own_host_with_node_local_groups(job: dict) -> None:
    hosts: TwoHosts = job["hosts"]
    for rank, host in enumerate(hosts.hosts):  # host A's address sorts first: rank 0
        nodes = job["ranks"][rank]["nodes"]
        assert nodes["host_label"] == host.label
        assert nodes["interfaces"] == sorted(["lo", host.ifname]), nodes["interfaces"]
        assert nodes["group_rank"] == str(rank) and nodes["master_addr"] == hosts.a.addr
        assert nodes["hosts"] == ((0,), (1,))
        assert (nodes["host_index"], nodes["local_rank"]) == (rank, 0)
        assert nodes["intra_host_ranks"] == [rank] and nodes["intra_host_sum"] == rank + 1
        assert nodes["inter_host_ranks"] == [0, 1] and nodes["inter_host_sum"] == 3.0
        assert nodes["data_axis_spans_hosts"] and nodes["cached"]


@pytest.mark.parametrize("stage", [1, 3])
def test_zero_across_two_hosts_matches_reference_and_one_host(
    job: dict, one_host: list, stage: int
) -> None:
    key = f"zero{stage}"
    ref_losses, ref_params = reference_run(zero1_spec() if stage == 1 else zero3_spec())
    for rank in range(2):
        got = job["ranks"][rank][key]
        _assert_close(got["losses"], got["params"], ref_losses, ref_params, f"{key} rank {rank}")
        # same world, same collectives, same gloo algorithms: only the links differ
        same = one_host[rank][key]
        assert got["losses"] == same["losses"], (key, rank, got["losses"], same["losses"])
        for name, p in got["params"].items():
            assert torch.equal(p, same["params"][name]), f"{key} rank {rank} {name} vs one host"


def test_checkpoint_saved_across_hosts_resumes_on_one_rank(job: dict) -> None:
    ckpt = job["dir"] / "ckpt"
    tag = ckpt / f"global_step{SAVE_AT}"
    manifest = load_manifest(tag)
    assert manifest["world_size"] == 2 and len(manifest["files"]) == 2, manifest["files"]
    (resumed,) = run_distributed(resume_zero3_on_one_rank, 1, str(ckpt), timeout=180)
    ref_losses, ref_params = reference_run(zero3_spec())
    _assert_close(resumed["losses"], resumed["params"], ref_losses[SAVE_AT:STEPS], ref_params,
                  "resumed on one rank")  # fmt: skip


def test_checkpoint_into_per_host_folders_is_refused(job: dict) -> None:
    """The writer needs one folder every rank sees (rank 0 reads every rank's file before
    publishing); a folder per host fails on every rank and publishes no tag."""
    for rank in range(2):
        message = job["ranks"][rank]["zero3"]["per_host_refused"]
        assert message is not None and "was not saved" in message, message
    for host_index in range(2):
        folder = job["dir"] / f"per_host_{host_index}"
        assert not (folder / "latest").exists()
        assert not (folder / f"global_step{STEPS}").exists()
