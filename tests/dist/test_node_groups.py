"""Node-local process groups on 4 ranks posing as hosts (``SHARDSPEED_HOST_ID`` per rank).

The real two-host job (``tests/multinode``) checks them across network namespaces with one
rank per host; here 2 hosts x 2 ranks and an uneven 3 + 1 split check that every group is
created on every rank in one order and reduces over the right members.
"""

from __future__ import annotations

import pytest
import torch

from shardspeed.testing import run_distributed


def _groups(hosts: list[str]) -> dict:
    from shardspeed import comm
    from shardspeed.comm.node_groups import NodeGroups
    from shardspeed.topology import Topology

    rank = comm.get_rank()
    env = {"SHARDSPEED_HOST_ID": hosts[rank], "LOCAL_WORLD_SIZE": str(hosts.count(hosts[rank]))}
    nodes = NodeGroups.build(env)
    intra = torch.tensor([float(rank + 1)])
    comm.all_reduce(intra, group=nodes.intra_host)
    inter = torch.tensor([float(rank + 1)])
    comm.all_reduce(inter, group=nodes.inter_host)
    topo = Topology.build(tp=2)  # the Topology's own node groups: one host here
    return {
        "hosts": nodes.layout.hosts,
        "where": (nodes.host_index, nodes.local_rank, nodes.local_world_size),
        "intra": (nodes.intra_host_ranks(), float(intra)),
        "inter": (nodes.inter_host_ranks(), float(inter)),
        "topology": topo.node_groups().layout.hosts,
        "cached": topo.node_groups() is topo.node_groups(),
    }


@pytest.mark.parametrize(
    "hosts, expect_hosts",
    [(["a", "a", "b", "b"], ((0, 1), (2, 3))), (["a", "a", "a", "b"], ((0, 1, 2), (3,)))],
)
def test_node_groups_reduce_over_their_members(hosts: list[str], expect_hosts: tuple) -> None:
    results = run_distributed(_groups, 4, hosts)
    for rank, got in enumerate(results):
        assert got["hosts"] == expect_hosts
        host = next(h for h in expect_hosts if rank in h)
        local = host.index(rank)
        assert got["where"] == (expect_hosts.index(host), local, len(host))
        assert got["intra"] == (list(host), float(sum(r + 1 for r in host)))
        inter = [h[local] for h in expect_hosts if local < len(h)]
        assert got["inter"] == (inter, float(sum(r + 1 for r in inter)))
        assert got["topology"] == ((0, 1, 2, 3),) and got["cached"]
