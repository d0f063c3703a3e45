"""Muon through ``shardspeed.initialize`` on 2 gloo ranks against a one-process reference.

The reference (plain torch, written here and in ``tests/unit/test_muon_optimizer.py``)
trains the parity GPT on the same global batch: Muon with the Newton-Schulz polynomial applied to
singular values from an fp64 SVD, AdamW for embeddings and norms. The engine runs ZeRO 0,
1 and 2 (small buckets, so matrices straddle the two ranks' shards and must be brought
whole to one owner rank), ZeRO 2 with ``offload_optimizer: cpu``, and ZeRO-3 (one flat per
layer unit, each rank holding half of it), with CPU offload and from a ``zero.Init`` model
(partitioned at construction, weights loaded through ``GatheredParameters``); the
parameters after every step equal the reference's (fp32: rtol 1e-5, atol 1e-6, as the
ZeRO parity tests), and the sharded runs with ZeRO 0's ``ns_method`` equal its run to
rounding (rtol 1e-6, atol 1e-7). At ZeRO 2 and 3 a checkpoint saved before the last step
and loaded into a fresh engine repeats that step bitwise.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
import torch.nn as nn
from parity_common import ParitySpec, make_model, micro_batch

from shardspeed.testing import run_distributed

SPEC = ParitySpec(steps=3, bucket_size=700)
MUON = {"lr": 0.02, "adam_lr": 1e-2, "weight_decay": 0.01}
Z3 = {"stage": 3, "stage3_param_persistence_threshold": 0}  # every matrix in a unit flat
CASES = [
    ("stage 0", {"stage": 0}, {}),
    ("stage 1, standard", {"stage": 1}, {"ns_method": "standard"}),
    ("stage 2", {"stage": 2}, {}),
    ("stage 2 offload", {"stage": 2, "offload_optimizer": {"device": "cpu"}}, {}),
    ("stage 3", Z3, {}),
    ("stage 3 offload", {**Z3, "offload_optimizer": {"device": "cpu"}}, {}),
    ("stage 3 zero.Init", Z3, {}),
]
RESUMED = ("stage 2", "stage 3")  # checkpointed before the last step, resumed
A, B, C = 3.4445, -4.7750, 2.0315


def _orthogonal(u: torch.Tensor) -> torch.Tensor:
    """Newton-Schulz (5 steps) as a polynomial of the singular values, fp64."""
    m = u.reshape(u.shape[0], -1).double()
    left, s, right = torch.linalg.svd(m, full_matrices=False)
    s = s / (torch.linalg.matrix_norm(m) + 1e-7)
    for _ in range(5):
        s = A * s + B * s**3 + C * s**5
    return (left @ torch.diag(s) @ right) * math.sqrt(max(1.0, m.shape[0] / m.shape[1]))


def reference(steps: int) -> list[dict[str, torch.Tensor]]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks run; restored: this runs in the pytest process
    try:
        return _reference(steps)
    finally:
        torch.set_num_threads(threads)


def _reference(steps: int) -> list[dict[str, torch.Tensor]]:
    model = make_model(SPEC)
    named = dict(model.named_parameters())
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    muon = {n for n, p in named.items() if p.dim() >= 2 and id(p) not in embeddings}
    state: dict[str, dict] = {n: {} for n in named}
    lr, adam_lr, wd = MUON["lr"], MUON["adam_lr"], MUON["weight_decay"]
    history = []
    for step in range(steps):
        grads = []
        for rank in range(SPEC.world):
            x, y = micro_batch(SPEC, step, rank)
            model.zero_grad()
            model(x, y)[1].backward()
            grads.append({n: p.grad.clone() for n, p in named.items()})
        with torch.no_grad():
            for n, p in named.items():
                g = ((grads[0][n] + grads[1][n]) / SPEC.world).double()
                s = state[n]
                if n in muon:
                    s["m"] = 0.95 * s.get("m", torch.zeros_like(g)) + 0.05 * g
                    u = 0.05 * g + 0.95 * s["m"]
                    new = p.double() * (1 - lr * wd) - lr * _orthogonal(u).view(p.shape)
                else:
                    t = s["t"] = s.get("t", 0) + 1
                    s["m"] = 0.9 * s.get("m", torch.zeros_like(g)) + 0.1 * g
                    s["v"] = 0.95 * s.get("v", torch.zeros_like(g)) + 0.05 * g * g
                    adam = (s["m"] / (1 - 0.9**t)) / ((s["v"] / (1 - 0.95**t)).sqrt() + 1e-10)
                    new = p.double() * (1 - adam_lr * wd) - adam_lr * adam
                p.copy_(new)
        history.append({n: p.detach().clone() for n, p in named.items()})
    return history


def _engine(zero: dict, params: dict, seed: int = SPEC.seed, zero_init: bool = False):
    import shardspeed

    cfg = SPEC.config()
    cfg["zero_optimization"] = {"reduce_bucket_size": SPEC.bucket_size, **zero}
    cfg["optimizer"] = {"type": "Muon", "params": {**MUON, **params}}
    if zero_init:  # partitioned at construction; the same weights loaded as a user would
        with shardspeed.zero.Init(config_dict_or_path=cfg):
            model = make_model(ParitySpec(seed=seed))
        assert all(p.numel() == 0 for p in model.parameters())
        with shardspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=0):
            model.load_state_dict(make_model(ParitySpec(seed=seed)).state_dict())
    else:
        model = make_model(ParitySpec(seed=seed))
    return shardspeed.initialize(model=model, config=cfg)[0]


def _train(engine, steps: range, history: list) -> None:
    import shardspeed
    from shardspeed import comm

    for step in steps:
        x, y = micro_batch(SPEC, step, comm.get_rank())
        engine.backward(engine(x, y)[1])
        engine.step()
        params = list(engine.module.parameters())
        with shardspeed.zero.GatheredParameters(params, enabled=engine.stage == 3):
            history.append({n: p.detach().clone() for n, p in engine.module.named_parameters()})


def _rank(tmp: str) -> list[tuple[list[dict[str, torch.Tensor]], int, bool, int]]:
    from shardspeed import comm
    from shardspeed.checkpoint import load_checkpoint, save_checkpoint

    out = []
    for label, zero, params in CASES:
        engine = _engine(zero, params, zero_init=label.endswith("zero.Init"))
        layout = engine.basic_optimizer._layout
        partial = sum(  # matrix fragments this rank holds only part of
            f.length < math.prod(f.shape) for per in layout.values() for m in per for f in m
        )
        rank = comm.get_rank()
        sent = sum(  # elements this rank sends to the owners of its other matrices, per step
            n for plans in engine.basic_optimizer._plans.values() for plan, _ in plans
            for r, n in enumerate(plan.send_splits) if r != rank
        )  # fmt: skip
        history: list = []
        _train(engine, range(SPEC.steps - 1), history)
        if label in RESUMED:
            save_checkpoint(engine, Path(tmp) / "muon")  # momentum + AdamW state by fragment
        _train(engine, range(SPEC.steps - 1, SPEC.steps), history)
        engine.destroy()
        resumed_equal = True
        if label in RESUMED:  # exact resume: fresh weights, load, the same last step
            engine = _engine(zero, params, seed=99)
            load_checkpoint(engine, Path(tmp) / "muon")
            resumed: list = []
            _train(engine, range(SPEC.steps - 1, SPEC.steps), resumed)
            engine.destroy()
            resumed_equal = all(torch.equal(v, history[-1][n]) for n, v in resumed[-1].items())
        out.append((history, partial, resumed_equal, sent))
    return out


def test_muon_zero_stages_match_reference(tmp_path: Path) -> None:
    expected = reference(SPEC.steps)
    results = run_distributed(_rank, SPEC.world, str(tmp_path))
    for c, (label, zero, params) in enumerate(CASES):
        for rank, per_case in enumerate(results):
            history, partial, resumed_equal, sent = per_case[c]
            assert resumed_equal, f"{label} rank {rank}: resumed run differs"
            if zero["stage"] >= 1:
                assert partial > 0, f"{label}: no matrix straddles a shard edge on rank {rank}"
                assert sent > 0, f"{label}: rank {rank} owns every matrix it holds a piece of"
            if zero["stage"] >= 1 and params == CASES[0][2]:  # whole matrices: as unsharded
                for name, value in history[-1].items():
                    torch.testing.assert_close(
                        value,
                        per_case[0][0][-1][name],
                        rtol=1e-6,
                        atol=1e-7,
                        msg=lambda m, label=label, name=name: f"{label} {name} vs stage 0: {m}",
                    )
            for step, (ours, ref) in enumerate(zip(history, expected)):
                for name, value in ref.items():
                    torch.testing.assert_close(
                        ours[name].double(),
                        value.double(),
                        rtol=1e-5,
                        atol=1e-6,  # the fp32 parity tolerance of test_zero_parity
                        msg=lambda m, label=label, step=step, name=name: (
                            f"{label} step {step} {name}: {m}"
                        ),
                    )
