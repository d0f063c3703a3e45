"""Gradient reductions split into comm spans (``overlap_bucket_size``) overlap backward
and change nothing in the numbers.

With a small ``zero_optimization.overlap_bucket_size`` each reduce bucket is all-reduced
in several contiguous parts, launched from the grad-ready hooks as their gradients arrive
(DDP's bucketing). Checked here, on 2 gloo ranks:

* parity: stages 0, 1, 2 (GAS 1 and 3, clipping active at GAS 3), several spans, equal the
  same run with one collective per bucket and the one-process reference at 1e-5 (fp32);
* overlap: at stage 0 the tiny GPT's single bucket becomes several spans, and all but the
  last are launched before the last gradient of the backward arrives;
* checkpoints: a stage-0 checkpoint saved with one span and reduce-bucket size resumes
  under another (both ways) and matches the uninterrupted run at 1e-5 (spans never reach the
  masters; the masters' bucket layout is not part of the format).
"""

from __future__ import annotations

import torch
from parity_common import ParitySpec, engine_run, reference_run

from shardspeed.testing import run_distributed

WORLD = 2
SPAN = 1000  # elements: the tiny GPT (~6.9k elements) splits into about eight spans
TOL = {"rtol": 1e-5, "atol": 1e-6}


def _spec(stage: int, gas: int, overlap_bucket_size: int) -> ParitySpec:
    spec = ParitySpec(stage=stage, gas=gas, world=WORLD)
    if gas == 3:
        spec.clip = 0.05  # active: the global norm is well above this
        spec.bucket_size = 3000  # several reduce buckets, each split further
    zero = {"stage": stage, "reduce_bucket_size": spec.bucket_size}
    spec.extra = {"zero_optimization": {**zero, "overlap_bucket_size": overlap_bucket_size}}
    return spec


def _pairs() -> list[tuple[ParitySpec, ParitySpec]]:
    """(split into spans, one collective per bucket) for every stage and GAS."""
    return [
        (_spec(stage, gas, SPAN), _spec(stage, gas, 0)) for stage in (0, 1, 2) for gas in (1, 3)
    ]


def _run_pairs(pairs: list[tuple[ParitySpec, ParitySpec]]) -> list:
    return [(engine_run(split), engine_run(whole)) for split, whole in pairs]


def test_split_reductions_match_one_bucket_and_reference() -> None:
    pairs = _pairs()
    per_rank = run_distributed(_run_pairs, WORLD, pairs, timeout=300)
    for i, (split, _) in enumerate(pairs):
        ref_losses, ref_params = reference_run(split)
        for rank, results in enumerate(per_rank):
            (losses, params), (whole_losses, whole_params) = results[i]
            where = f"stage={split.stage} gas={split.gas} rank {rank}"
            for name, other in (("one bucket", whole_losses), ("reference", ref_losses)):
                msg = f"{where} losses vs {name}"
                torch.testing.assert_close(
                    torch.tensor(losses), torch.tensor(other), **TOL, msg=msg
                )
            for pname, ref in ref_params.items():
                for name, other in (("one bucket", whole_params[pname]), ("reference", ref)):
                    msg = f"{where} param {pname} vs {name}"
                    torch.testing.assert_close(params[pname], other, **TOL, msg=msg)


def _launch_order(overlap_bucket_size: int) -> dict[str, int]:
    """One stage-0 backward; how many gradient collectives started before its last
    gradient arrived, and how many spans there are."""
    from parity_common import make_model, micro_batch

    import shardspeed
    from shardspeed import comm

    spec = _spec(0, 1, overlap_bucket_size)
    model = make_model(spec)
    events: list[str] = []
    # registered before the engine's hooks, so each fires before the reducer sees the grad
    for p in model.parameters():
        p.register_post_accumulate_grad_hook(lambda _p: events.append("grad"))
    engine, _, _, _ = shardspeed.initialize(model=model, config=spec.config())
    num_spans = len(engine.reducer.order)
    all_reduce = comm.all_reduce

    def logged(tensor: torch.Tensor, *args: object, **kwargs: object) -> object:
        events.append("launch")
        return all_reduce(tensor, *args, **kwargs)

    x, y = micro_batch(spec, 0, comm.get_rank())
    _, loss = engine(x, y)
    comm.all_reduce = logged
    try:
        engine.backward(loss)
    finally:
        comm.all_reduce = all_reduce
    engine.step()
    engine.destroy()
    last_grad = len(events) - 1 - events[::-1].index("grad")
    return {
        "num_spans": num_spans,
        "launches": events.count("launch"),
        "before_last_grad": events[:last_grad].count("launch"),
    }


def _both_launch_orders() -> list[dict[str, int]]:
    return [_launch_order(SPAN), _launch_order(0)]


def test_spans_launch_during_backward() -> None:
    for split, whole in run_distributed(_both_launch_orders, WORLD, timeout=120):
        assert split["num_spans"] >= 4, split
        assert split["launches"] == split["num_spans"], split
        # every span but the one holding the last gradient started inside backward
        assert split["before_last_grad"] == split["num_spans"] - 1, split
        # one collective per bucket: the tiny GPT is one bucket, launched by its last grad
        assert whole == {"num_spans": 1, "launches": 1, "before_last_grad": 0}, whole


def _resume_across_layouts(tmp: str) -> list:
    """Stage 0: 6 steps straight vs 3 steps + save + load into an engine with other span and
    reduce-bucket sizes + 3 steps, both ways (the layouts differ in masters and spans)."""
    from parity_common import make_model, train_steps

    import shardspeed
    from shardspeed.checkpoint import load_checkpoint, save_checkpoint

    def spec(bucket_size: int, span: int) -> ParitySpec:
        zero = {"stage": 0, "reduce_bucket_size": bucket_size, "overlap_bucket_size": span}
        return ParitySpec(stage=0, world=WORLD, clip=0.05, extra={"zero_optimization": zero})

    def build(spec: ParitySpec):
        engine, *_ = shardspeed.initialize(model=make_model(spec), config=spec.config())
        return engine

    def params(engine) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in engine.module.named_parameters()}

    split, whole = spec(3000, SPAN), spec(500_000_000, 0)
    out = []
    for tag, saved, loaded in (("split", split, whole), ("whole", whole, split)):
        engine = build(saved)
        straight = train_steps(engine, saved, range(6))
        final = params(engine)
        engine.destroy()
        engine = build(saved)
        first = train_steps(engine, saved, range(3))
        save_checkpoint(engine, tmp, tag=tag)
        engine.destroy()
        engine = build(loaded)
        path, _ = load_checkpoint(engine, tmp, tag=tag)
        assert path is not None
        rest = train_steps(engine, loaded, range(3, 6))
        out.append((straight, first + rest, final, params(engine)))
        engine.destroy()
    return out


def test_checkpoint_resumes_across_span_and_bucket_sizes(tmp_path) -> None:
    for rank_results in run_distributed(_resume_across_layouts, WORLD, str(tmp_path), timeout=180):
        for straight, resumed_losses, final, resumed in rank_results:
            torch.testing.assert_close(torch.tensor(resumed_losses), torch.tensor(straight), **TOL)
            for name, ref in final.items():
                torch.testing.assert_close(resumed[name], ref, **TOL, msg=name)
