"""Muon's owner exchange, measured by the comms logger, equals its byte formula.

At ZeRO 1-3 each matrix of a Muon bucket is brought whole to one owner rank and sent back
(``shardspeed/ops/muon_owners.py``): two fp32 ``all_to_all_single`` calls per bucket and
step, and no other all-to-all in a step. The comms logger records an all-to-all's bytes as
its input tensor, the rank's own piece included (nccl-tests' convention). So per rank and
bucket, with ``piece(j, r)`` the elements of matrix ``j`` in rank ``r``'s slice and ``M_j``
its size::

    send call  4 * sum_j piece(j, r)                    (every Muon element of my slice)
    back call  4 * sum_{j owned by r} M_j               (the matrices I orthogonalised)
    off-rank   the same minus 4 * 2 * sum_{j owned by r} piece(j, r)

Summed over ranks the logged bytes are ``8 P`` per step (P: the model's Muon parameters;
each element leaves its rank once and comes back once) and the off-rank bytes are
``8 sum_j (M_j - piece(j, owner_j))``; when every matrix is spread evenly over all N
slices that is ``8 P (N-1)/N``, i.e. ``8 (N-1)/N^2`` bytes per Muon parameter per rank
(docs/muon.md), against ``4 (N-1)/N`` received by an all-gather of the bucket.

The test runs the parity GPT (2 blocks of 4 matrices, P = 6144) with Muon at ZeRO 1, 2 and
3 on 2 ranks (4 ranks in the slow tier), one warm-up step (the owner plan's one
``all_gather_object``), then two logged steps, and checks every logged all-to-all against
the formula, the totals against ``8 P``, and the off-rank bytes against the geometry and
owners. ``python tests/dist/test_muon_comm_bytes.py`` prints the table of docs/muon.md.
"""

from __future__ import annotations

import sys
from typing import Any

import pytest
import torch.nn as nn
from parity_common import ParitySpec, make_model, micro_batch

from shardspeed.testing import run_distributed

STEPS = 2  # logged steps, after one warm-up step
MUON = {"lr": 0.02, "adam_lr": 1e-2, "weight_decay": 0.01}
STAGES = (1, 2, 3)


def muon_numel(model: nn.Module) -> int:
    """P: elements of the parameters Muon trains (2-D and up, not embeddings or tied heads)."""
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    seen: set[int] = set()
    total = 0
    for p in model.parameters():  # a tied lm_head is the embedding: listed once
        if p.dim() >= 2 and id(p) not in embeddings and id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


def _piece(offset: int, numel: int, rank: int, shard_numel: int) -> int:
    """Elements of ``[offset, offset + numel)`` in ``rank``'s slice of the bucket."""
    lo = max(offset, rank * shard_numel)
    hi = min(offset + numel, (rank + 1) * shard_numel)
    return max(hi - lo, 0)


def _measure(stage: int) -> dict[str, Any]:
    """Train with Muon and the comms logger on this rank; logged and expected bytes."""
    import shardspeed
    from shardspeed import comm
    from shardspeed.comm import logger as comms

    spec = ParitySpec(world=comm.get_world_size())
    zero: dict[str, Any] = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0  # every matrix in a unit flat
    cfg = spec.config()
    cfg["zero_optimization"] = zero
    cfg["optimizer"] = {"type": "Muon", "params": dict(MUON)}
    cfg["comms_logger"] = {"enabled": True, "prof_all": True}
    model = make_model(spec)
    numel = muon_numel(model)  # before ZeRO-3 releases the parameters
    engine = shardspeed.initialize(model=model, config=cfg)[0]
    rank, world = comm.get_rank(), comm.get_world_size()

    def step(index: int) -> None:
        x, y = micro_batch(spec, index, rank)
        engine.backward(engine(x, y)[1])
        engine.step()

    step(0)  # builds the owner plans
    comms.reset_log()
    for index in range(1, STEPS + 1):
        step(index)
    logged = comms.get_logged_comm_ops().get("all_to_all_single", {"msg_sizes": []})["msg_sizes"]

    # the formula, from each bucket's matrices (offset, size), shard size and owners
    optimizer = engine.basic_optimizer
    expected: list[int] = []
    own_bytes = off_rank_formula = 0
    for gi, plans in sorted(optimizer._plans.items()):
        for i, (plan, matrices) in enumerate(plans):
            shard_numel = optimizer.param_groups[gi]["params"][i].numel()
            pieces = [_piece(m.offset, m.numel, rank, shard_numel) for m in matrices]
            owned = [j for j, owner in enumerate(plan.owners) if owner == rank]
            expected += [4 * sum(pieces), 4 * sum(matrices[j].numel for j in owned)]
            own_bytes += 4 * 2 * sum(pieces[j] for j in owned)
            off_rank_formula += sum(  # every rank computes the whole model's off-rank total
                8 * (m.numel - _piece(m.offset, m.numel, owner, shard_numel))
                for m, owner in zip(matrices, plan.owners)
            )
    engine.destroy()
    comms.configure(enabled=False)
    comms.reset_log()
    return {
        "logged": logged,
        "expected": expected * STEPS,
        "own_bytes": own_bytes,  # per step
        "off_rank_formula": off_rank_formula,  # per step, summed over ranks
        "muon_numel": numel,
        "world": world,
    }


def _measure_all(stages: tuple[int, ...]) -> list[dict[str, Any]]:
    return [_measure(stage) for stage in stages]


def _rows(world: int, stages: tuple[int, ...] = STAGES) -> list[dict[str, Any]]:
    """Per stage: the per-rank measurements, checked against the formula."""
    per_rank = run_distributed(_measure_all, world, stages, timeout=600)
    rows = []
    for s, stage in enumerate(stages):
        results = [r[s] for r in per_rank]
        p = results[0]["muon_numel"]
        for rank, res in enumerate(results):
            where = f"ZeRO {stage}, {world} ranks, rank {rank}"
            assert res["logged"] == res["expected"], where
        logged = sum(sum(r["logged"]) for r in results) / STEPS  # per step, all ranks
        off_rank = sum(sum(r["logged"]) / STEPS - r["own_bytes"] for r in results)
        assert logged == 8 * p, (stage, world, logged, p)
        assert off_rank == results[0]["off_rank_formula"], (stage, world, off_rank)
        rows.append(
            {
                "stage": stage,
                "world": world,
                "muon_numel": p,
                "logged_per_rank": logged / world,
                "off_rank_per_rank": off_rank / world,
                "calls_per_step": len(results[0]["logged"]) // STEPS,
            }
        )
    return rows


def test_muon_exchange_bytes_equal_the_formula_2_ranks() -> None:
    rows = _rows(2)
    assert all(r["calls_per_step"] > 0 for r in rows)
    assert any(r["off_rank_per_rank"] > 0 for r in rows)  # some matrix straddles a slice edge


@pytest.mark.slow
def test_muon_exchange_bytes_equal_the_formula_4_ranks() -> None:
    rows = _rows(4)
    assert all(r["off_rank_per_rank"] > 0 for r in rows)


def _table() -> str:
    lines = [
        "| ZeRO | ranks N | all-to-alls per step | logged bytes / Muon param / rank | "
        "off-rank bytes / Muon param / rank | 8(N-1)/N^2 | all-gather 4(N-1)/N |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for world in (2, 4):
        for row in _rows(world):
            p, n = row["muon_numel"], world
            lines.append(
                f"| {row['stage']} | {n} | {row['calls_per_step']} | "
                f"{row['logged_per_rank'] / p:.3f} | {row['off_rank_per_rank'] / p:.3f} | "
                f"{8 * (n - 1) / n**2:.3f} | {4 * (n - 1) / n:.3f} |"
            )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    import test_muon_comm_bytes as module  # workers import the functions by module name

    print(module._table())
