"""Shared worker of the ZeRO++ tests: a tiny GPT trained at ZeRO-3 with the given ZeRO++
keys, returning per-step losses, gradient L1 norms and quantization error bounds, the final
parameters, comm bytes per step and the group of every weight all-gather."""

from __future__ import annotations

import os
from typing import Any

import torch
from parity_common import ParitySpec, make_model, micro_batch

PLAIN = "plain"


def zeropp_spec(world: int, steps: int, **zeropp: Any) -> ParitySpec:
    """ZeRO-3, SGD without momentum (lr 0.05), every unit re-gathered for backward
    (``stage3_max_reuse_distance`` 0, so backward gathers exist for hpZ to serve)."""
    zc = {
        "stage": 3,
        "stage3_param_persistence_threshold": 0,
        "stage3_max_reuse_distance": 0,
        **zeropp,
    }
    spec = ParitySpec(stage=3, world=world, steps=steps, optimizer="SGD", lr=0.05)
    spec.weight_decay = 0.0
    spec.extra["zero_optimization"] = zc
    spec.extra["comms_logger"] = {"enabled": True}
    return spec


def _sgd(spec: ParitySpec) -> dict[str, Any]:
    return {"type": "SGD", "params": {"lr": spec.lr}}  # no momentum, no decay


def _model_and_loss(spec: ParitySpec) -> tuple[torch.nn.Module, Any]:
    """The parity GPT, or with tensor parallelism (AutoTP needs a Hugging Face model) a
    tiny GPT-2; and ``loss(engine, step, rank)``, this rank's loss of ``step``."""
    if "tensor_parallel" not in spec.extra:

        def gpt_loss(engine: Any, step: int, rank: int) -> torch.Tensor:
            x, y = micro_batch(spec, step, rank)
            return engine(x, y)[1]

        return make_model(spec), gpt_loss
    import transformers as tf

    torch.manual_seed(spec.seed)
    config = tf.GPT2Config(vocab_size=32, n_embd=32, n_layer=2, n_head=4, n_positions=16,
                           resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)  # fmt: skip

    def hf_loss(engine: Any, step: int, rank: int) -> torch.Tensor:
        data_rank = engine.topology.coords(rank).data  # tensor ranks share the batch
        ids, _ = micro_batch(spec, step, data_rank)
        return engine(ids, labels=ids).loss

    return tf.GPT2LMHeadModel(config), hf_loss


def run_zeropp(spec: ParitySpec, hosts: list[str] | None = None) -> dict[str, Any]:
    """Train ``spec`` on this rank; ``hosts[rank]`` fakes its host (SHARDSPEED_HOST_ID)."""
    import torch.distributed as dist

    import shardspeed
    from shardspeed import comm
    from shardspeed.comm import logger as comms_logger
    from shardspeed.zero import GatheredParameters
    from shardspeed.zero.zeropp.grads import error_bound_from
    from shardspeed.zero.zeropp.weights import in_backward

    rank, world = comm.get_rank(), comm.get_world_size()
    if hosts is not None:
        os.environ["SHARDSPEED_HOST_ID"] = hosts[rank]
    gathers: list[tuple[tuple[int, ...], bool]] = []  # (group ranks, in backward)
    original = comm.all_gather_into_tensor

    def recording(output: Any, input: Any, group: Any = None, async_op: bool = False) -> Any:
        ranks = tuple(dist.get_process_group_ranks(group)) if group is not None else ()
        gathers.append((ranks or tuple(range(world)), in_backward()))
        return original(output, input, group=group, async_op=async_op)

    config = spec.config()
    config["optimizer"] = _sgd(spec)
    comm.all_gather_into_tensor = recording  # type: ignore[assignment]
    try:
        model, loss_of = _model_and_loss(spec)
        engine, _, _, _ = shardspeed.initialize(model=model, config=config)
        flats = [f for g in engine.flat_groups for f in g.flats]
        weight_gathers = [f.residency.gathers for f in flats if f.residency.gathers is not None]
        reduction = engine.reducer.reductions[0]
        out: dict[str, list[float]] = {"losses": [], "g1": [], "delta": [], "eps": []}
        for step in range(spec.steps):
            if step == 1:  # the first step warms up; bytes and gathers are counted after
                comms_logger.reset_log()
                gathers.clear()
            for w in weight_gathers:
                w.max_error_bound = 0.0
            if hasattr(reduction, "max_stage_bounds"):
                reduction.max_stage_bounds = [0.0, 0.0]
            loss = loss_of(engine, step, rank)
            engine.backward(loss)  # reduces: the shards hold the averaged gradient
            g1 = sum(float(f.shard_grads[0].abs().sum()) for f in flats)
            if step == 0:  # same weights in every run: gradients comparable element-wise
                first_grads = torch.cat([f.shard_grads[0].float().clone() for f in flats])
            engine.step()
            stats = torch.tensor(
                [float(loss.detach()) / world, g1], dtype=torch.float64
            )  # summed over ranks: the mean loss and the gradient's L1 norm (with tensor
            # parallelism replicated parameters count once per tensor rank: a larger bound)
            comm.all_reduce(stats)
            bounds = torch.tensor(
                [
                    max((w.max_error_bound for w in weight_gathers), default=0.0),
                    *getattr(reduction, "max_stage_bounds", [0.0, 0.0]),
                ],
                dtype=torch.float64,
            )
            comm.all_reduce(bounds, op=dist.ReduceOp.MAX)
            out["losses"].append(float(stats[0]))
            out["g1"].append(float(stats[1]))
            out["delta"].append(float(bounds[0]))
            nodes = getattr(reduction, "nodes", 1)
            eps = error_bound_from([float(bounds[1]), float(bounds[2])], nodes)
            out["eps"].append(eps / reduction.average_over)  # of the averaged gradient
        by_op = {op: s["total_bytes"] for op, s in comms_logger.get_logged_comm_ops().items()}
        params = list(engine.module.parameters())
        with GatheredParameters(params):
            final = {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
            # a user's gather reads the exact shards, whatever qwZ does for compute
            exact_reads = all(
                torch.equal(f.residency.gathered_shard(), f.residency.storage.gather_source())
                for f in flats
            )
        served = sum(w.num_secondary_gathers for w in weight_gathers)
        engine.destroy()
    finally:
        comm.all_gather_into_tensor = original  # type: ignore[assignment]
        os.environ.pop("SHARDSPEED_HOST_ID", None)
    counted = max(spec.steps - 1, 1)
    return {
        **out,
        "final": final,
        "first_grads": first_grads,
        "exact_reads": exact_reads,
        "bytes_per_step": sum(by_op.values()) / counted,
        "by_op": {k: v / counted for k, v in by_op.items()},
        "gathers": sorted(set(gathers)),
        "secondary_gathers": served,
    }


def run_many(specs: list[ParitySpec], hosts: list[str] | None = None) -> list[dict[str, Any]]:
    """Every spec in one launch (the engines are built and destroyed in turn)."""
    return [run_zeropp(s, hosts) for s in specs]


def first_order_tolerance(exact: dict[str, Any], quant: dict[str, Any], lr: float) -> list[float]:
    """Per-step bound on |loss(ZeRO++) - loss(exact)| from the quantization error bounds.

    Step t's weights differ from the exact run's by the forward gathers' error (at most
    ``delta[t]`` per element, qwZ) plus the drift of earlier updates: plain SGD moves
    every weight by ``lr`` times its gradient, and each averaged gradient element was off
    by at most ``eps[s]`` (qgZ), so the drift is at most ``lr * sum(eps[s] for s < t)``.
    To first order the loss changes by at most ``||grad||_1`` times the largest weight
    change: ``g1[t] * (delta[t] + lr * sum(eps[:t]))``.
    """
    tol, drift = [], 0.0
    for t, g1 in enumerate(exact["g1"]):
        tol.append(g1 * (quant["delta"][t] + drift))
        drift += lr * quant["eps"][t]
    return tol


def report_table(names: list[str], results: list[dict[str, Any]], lr: float) -> str:
    """Markdown rows: bytes per step against the first run, losses against its losses."""
    plain = results[0]
    rows = ["| run | bytes/step | vs plain | final loss | max abs loss diff | max diff / bound |"]
    for name, got in zip(names, results):
        tol = first_order_tolerance(plain, got, lr)
        diff = [abs(a - b) for a, b in zip(got["losses"], plain["losses"])]
        worst = max((d / t if t > 0 else 0.0) for d, t in zip(diff, tol))
        rows.append(
            f"| {name} | {got['bytes_per_step']:,.0f} | "
            f"{got['bytes_per_step'] / plain['bytes_per_step']:.3f} | {got['losses'][-1]:.5f} | "
            f"{max(diff):.1e} | {worst:.3f} |"
        )
    return "\n".join(rows)
