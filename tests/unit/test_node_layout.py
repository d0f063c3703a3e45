"""NodeLayout: hosts from host keys, intra-/inter-host groups, and the host-key rules."""

from __future__ import annotations

import socket

import pytest

from shardspeed.comm.node_groups import (
    HOST_ID_ENV,
    NodeLayout,
    check_local_world_sizes,
    host_key,
)


def test_two_hosts_of_two() -> None:
    layout = NodeLayout.from_host_keys(["a", "a", "b", "b"])
    assert layout.hosts == ((0, 1), (2, 3))
    assert (layout.num_hosts, layout.world_size, layout.is_uniform) == (2, 4, True)
    assert layout.intra_host_groups() == [[0, 1], [2, 3]]
    assert layout.inter_host_groups() == [[0, 2], [1, 3]]
    assert [layout.host_of(r) for r in range(4)] == [0, 0, 1, 1]
    assert [layout.local_rank(r) for r in range(4)] == [0, 1, 0, 1]
    assert layout.intra_host_ranks(3) == [2, 3] and layout.inter_host_ranks(3) == [1, 3]
    assert layout == NodeLayout.uniform(4, 2)


def test_interleaved_keys_keep_rank_order_within_hosts() -> None:
    # round-robin placement (e.g. an MPI mapping): hosts ordered by their lowest rank
    layout = NodeLayout.from_host_keys(["y", "x", "y", "x", "y", "x"])
    assert layout.hosts == ((0, 2, 4), (1, 3, 5))
    assert layout.inter_host_groups() == [[0, 1], [2, 3], [4, 5]]
    assert layout.local_rank(4) == 2


def test_uneven_hosts() -> None:
    layout = NodeLayout.from_host_keys(["a", "a", "a", "b"])
    assert not layout.is_uniform
    assert layout.inter_host_groups() == [[0, 3], [1], [2]]
    assert layout.inter_host_ranks(3) == [0, 3] and layout.inter_host_ranks(2) == [2]


def test_one_host_and_one_rank_per_host() -> None:
    one = NodeLayout.from_host_keys(["h"] * 3)
    assert one.intra_host_groups() == [[0, 1, 2]] and one.inter_host_groups() == [[0], [1], [2]]
    spread = NodeLayout.from_host_keys(["a", "b", "c"])
    assert spread.intra_host_groups() == [[0], [1], [2]]
    assert spread.inter_host_groups() == [[0, 1, 2]]


def test_spans_hosts() -> None:
    layout = NodeLayout.uniform(8, 4)
    assert not layout.spans_hosts([0, 1, 2, 3])  # e.g. a tensor-parallel group inside a node
    assert layout.spans_hosts([0, 4])  # a data-parallel group across nodes


def test_errors_name_the_values() -> None:
    with pytest.raises(ValueError, match="local_world_size=3 must be >= 1 and divide world_size=4"):
        NodeLayout.uniform(4, 3)
    with pytest.raises(ValueError, match="rank 9 is outside"):
        NodeLayout.uniform(4, 2).host_of(9)


def test_host_key_rules() -> None:
    name = socket.gethostname()
    assert host_key({}) == name
    assert host_key({"GROUP_RANK": "1"}) == f"{name}/1"  # torchrun agents sharing a hostname
    assert host_key({HOST_ID_ENV: "rack3-node7", "GROUP_RANK": "1"}) == "rack3-node7"


def test_local_world_size_mismatch_is_refused_with_the_fix() -> None:
    layout = NodeLayout.from_host_keys(["same", "same"])  # two hosts with one hostname
    check_local_world_sizes(layout, [2, None])  # agrees (None: not told)
    with pytest.raises(ValueError, match=f"LOCAL_WORLD_SIZE=1 but 2 ranks.*set {HOST_ID_ENV}"):
        check_local_world_sizes(layout, [1, 1])
