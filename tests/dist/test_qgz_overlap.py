"""qgZ's gradient reduction overlaps backward and gives the synchronous numbers bitwise.

:class:`~shardspeed.zero.zeropp.grads.QuantizedReduction` starts stage 1 asynchronously from
the grad hook and issues each bucket's stage 2 at the next launch (or at flush). Checked on
gloo ranks, ZeRO-3 + ``zero_quantized_gradients``, the tiny parity GPT, 3 steps:

* parity: losses, the first step's reduced gradient shards and the final parameters equal
  bitwise those of the synchronous order (each launch patched to wait for its bucket at
  once, as qgZ ran before), on 2 ranks (one host: stage 1 only) and on 4 ranks posing as
  2 hosts x 2 (both stages); both also with CPU optimizer offload, where finished
  reductions are completed from the grad hooks during backward (the path whose timing
  differs between ranks); on 2 ranks also with ``overlap_comm: false`` (every bucket at
  flush, nothing inside backward);
* overlap: every bucket's stage-1 all-to-alls are issued inside backward (from its grad
  hook, before backward returns), and on 2 hosts every stage 2 but the last bucket's as
  well; both orders issue the same collectives on the same groups with the same
  comms-logger tags.
"""

from __future__ import annotations

from typing import Any

import torch
from zeropp_common import run_zeropp, zeropp_spec

from shardspeed.testing import run_distributed

TWO_HOSTS = ["a", "a", "b", "b"]
STEPS = 3


def _record_and_run(world: int, hosts: list[str], synchronous: bool, **extra: Any) -> dict:
    """One run; every all-to-all as (group's ranks, tag, issued inside backward)."""
    import torch.distributed as dist

    from shardspeed import comm
    from shardspeed.zero.zeropp import grads
    from shardspeed.zero.zeropp.weights import in_backward

    events: list[tuple[tuple[int, ...], str, bool]] = []
    all_to_all = comm.all_to_all_single
    launch = grads.QuantizedReduction.launch

    def recording(output: Any, input: Any, *args: Any, group: Any = None, **kw: Any) -> Any:
        ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else ()
        events.append((ranks or tuple(range(world)), str(comm.current_tag()), in_backward()))
        return all_to_all(output, input, *args, group=group, **kw)

    def launch_and_wait(self: Any, buf: torch.Tensor, shard: Any) -> Any:
        launched = launch(self, buf, shard)
        if launched.work is not None:
            launched.work.wait()  # the synchronous order: each bucket done at its launch
        return launched

    comm.all_to_all_single = recording  # type: ignore[assignment]
    if synchronous:
        grads.QuantizedReduction.launch = launch_and_wait  # type: ignore[method-assign]
    try:
        spec = zeropp_spec(world, STEPS, zero_quantized_gradients=True, **extra)
        got = run_zeropp(spec, hosts)
    finally:  # pooled workers: restore
        comm.all_to_all_single = all_to_all  # type: ignore[assignment]
        grads.QuantizedReduction.launch = launch  # type: ignore[method-assign]
    return {**got, "events": events}


def _pairs(world: int, hosts: list[str], extras: list[dict[str, Any]]) -> list[tuple]:
    """(overlapped, synchronous) runs for each set of extra ``zero_optimization`` keys."""
    return [
        tuple(_record_and_run(world, hosts, sync, **extra) for sync in (False, True))
        for extra in extras
    ]


def _check(
    overlapped: dict[str, Any], synchronous: dict[str, Any], nodes: int, overlap: bool = True
) -> None:
    assert overlapped["losses"] == synchronous["losses"]
    assert torch.equal(overlapped["first_grads"], synchronous["first_grads"])
    for name, value in synchronous["final"].items():
        assert torch.equal(overlapped["final"][name], value), name
    # the same collectives on the same groups with the same labels (in another order)
    assert sorted(e[:2] for e in overlapped["events"]) == sorted(
        e[:2] for e in synchronous["events"]
    )
    events = overlapped["events"]
    groups = sorted({ranks for ranks, _, _ in events})  # (node group, cross-node group)
    assert len(groups) == (2 if nodes > 1 else 1), groups
    # the node group holds consecutive ranks ((0, 1)), the cross-node one strides ((0, 2))
    node_group = max(groups, key=lambda ranks: ranks[-1] - ranks[0] == len(ranks) - 1)
    stage1 = [e for e in events if e[0] == node_group]
    stage2 = [e for e in events if e[0] != node_group]
    buckets = len(stage1) // 2 // STEPS  # two all-to-alls (codes, scales) per bucket
    assert buckets >= 3, events  # units + root: several buckets to overlap
    if not overlap:  # overlap_comm false: every bucket launched at flush, after backward
        assert not any(in_bwd for _, _, in_bwd in events), events
        return
    assert events[0][2], events  # the first bucket's stage 1 runs inside backward
    assert all(in_bwd for _, _, in_bwd in stage1), events
    if nodes > 1:  # chained at the next launch: all but the last bucket's, per step
        in_backward = sum(in_bwd for _, _, in_bwd in stage2)
        assert in_backward == 2 * (buckets - 1) * STEPS, events
        assert len(stage2) == len(stage1)


def test_qgz_overlapped_equals_synchronous_on_one_host() -> None:
    extras = [{}, {"overlap_comm": False}, {"offload_optimizer": {"device": "cpu"}}]
    for pairs in run_distributed(_pairs, 2, 2, ["a", "a"], extras, timeout=300):
        for (overlapped, synchronous), extra in zip(pairs, extras):
            _check(overlapped, synchronous, nodes=1, overlap=extra.get("overlap_comm", True))


def test_qgz_overlapped_equals_synchronous_on_two_hosts_with_offload() -> None:
    offloads = [{}, {"offload_optimizer": {"device": "cpu"}}]
    for pairs in run_distributed(_pairs, 4, 4, TWO_HOSTS, offloads, timeout=300):
        for overlapped, synchronous in pairs:
            _check(overlapped, synchronous, nodes=2)
