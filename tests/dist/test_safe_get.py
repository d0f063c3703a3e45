"""``shardspeed.utils.safe_get_*`` / ``safe_set_*`` at ZeRO stages 0-3 (+ stage-3 CPU offload).

Every case trains a small MLP (two ModuleList units and a head; small buckets so that
parameters straddle rank slices) with AdamW in fp32 on 2 ranks, GAS 2, and compares with
a one-process reference that sums micro-batch gradients in the engine's order
(``parity_common.sum_in_engine_order``), at the fp32 parity tolerance (1e-5 relative):

* mid-window gradient: the partial sum at stages 2/3, ``RuntimeError`` at stages 0/1;
* boundary gradient (after ``backward``, before ``step``) = the reference's averaged gradient;
* after the step: fp32 params, ``exp_avg`` and ``exp_avg_sq`` = the reference optimizer's,
  and the parameters themselves equal their masters;
* setters: full param x 0.5, full ``exp_avg`` = 0, local param x 2 and local ``exp_avg_sq``
  x 0.25 on every rank; a second step then matches the reference with the same edits.

A bf16 stage-2 case checks that masters and 16-bit parameters stay consistent; error cases
(unmanaged or frozen parameter, missing or unknown optimizer state, wrong value sizes) check
the messages.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from parity_common import ParitySpec, sum_in_engine_order

from shardspeed.testing import run_distributed

WORLD, GAS, LR = 2, 2, 1e-2
TOL = {"rtol": 1e-5, "atol": 1e-6}
EDITED = ("layers.0.weight", "layers.1.bias", "head.weight")  # set-full / set-state / local


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(8, 12), nn.Linear(12, 12)])
        self.head = nn.Linear(12, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.tanh(layer(x))
        return self.head(x).pow(2).mean()


def _model() -> Net:
    torch.manual_seed(7)
    return Net()


def _batch(step: int, j: int) -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(1000 * step + j))


def _config(stage: int, bf16: bool = False, **zero: object) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": GAS,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.01}},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 100, **zero},
    }
    if stage == 3:
        config["zero_optimization"].setdefault("stage3_param_persistence_threshold", 0)
    if bf16:
        config["bf16"] = {"enabled": True}
    return config


CASES = {
    "stage0": _config(0),
    "stage1": _config(1),
    "stage2": _config(2),
    "stage3": _config(3),
    "stage3-persistent": _config(3, stage3_param_persistence_threshold=1000),
    "stage3-offload": _config(3, offload_optimizer={"device": "cpu"}),
}


def _full(fn, model: nn.Module, *args: object) -> dict[str, torch.Tensor]:
    return {n: fn(p, *args).detach().cpu().clone() for n, p in model.named_parameters()}


def _params_now(engine: object, model: nn.Module) -> dict[str, torch.Tensor]:
    from shardspeed.zero import GatheredParameters

    with GatheredParameters(list(model.parameters())):
        return {n: p.detach().float().clone() for n, p in model.named_parameters()}


def _apply_edits(model: nn.Module) -> None:
    from shardspeed import utils

    params = dict(model.named_parameters())
    full = utils.safe_get_full_fp32_param(params[EDITED[0]])
    utils.safe_set_full_fp32_param(params[EDITED[0]], full * 0.5)
    zeros = torch.zeros_like(utils.safe_get_full_optimizer_state(params[EDITED[1]], "exp_avg"))
    utils.safe_set_full_optimizer_state(params[EDITED[1]], zeros, "exp_avg")
    local = utils.safe_get_local_fp32_param(params[EDITED[2]])
    utils.safe_set_local_fp32_param(params[EDITED[2]], local * 2)
    state = utils.safe_get_local_optimizer_state(params[EDITED[2]], "exp_avg_sq")
    utils.safe_set_local_optimizer_state(params[EDITED[2]], state * 0.25, "exp_avg_sq")


def _run_case(config: dict) -> dict[str, object]:
    import shardspeed
    from shardspeed import comm, utils

    rank = comm.get_rank()
    model = _model()
    engine, _, _, _ = shardspeed.initialize(model=model, config=config)
    out: dict[str, object] = {}
    for step in range(2):
        for k in range(GAS):
            loss = engine(_batch(step, k * WORLD + rank))
            engine.backward(loss)
            if step == 0 and k == 0:  # mid-window
                try:
                    out["partial"] = _full(utils.safe_get_full_grad, model)
                except RuntimeError as err:
                    out["partial"] = str(err)
            if k == GAS - 1:
                out[f"grad{step}"] = _full(utils.safe_get_full_grad, model)
            engine.step()
        out[f"param{step}"] = _full(utils.safe_get_full_fp32_param, model)
        out[f"data{step}"] = _params_now(engine, model)
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{key}{step}"] = _full(utils.safe_get_full_optimizer_state, model, key)
        if step == 0:
            _apply_edits(model)
            out["edited"] = _full(utils.safe_get_full_fp32_param, model)
            out["edited_data"] = _params_now(engine, model)
    engine.destroy()
    return out


def _bf16_stage2() -> dict[str, bool]:
    """Masters are fp32, parameters bf16: every setter keeps the two consistent."""
    import shardspeed
    from shardspeed import comm, utils

    model = _model()
    engine, _, _, _ = shardspeed.initialize(model=model, config=_config(2, bf16=True))
    for k in range(GAS):
        engine.backward(engine(_batch(0, k * WORLD + comm.get_rank()).bfloat16()).float())
        engine.step()
    weight = model.layers[1].weight
    out = {}
    full = utils.safe_get_full_fp32_param(weight)
    out["param_is_rounded_master"] = torch.equal(full.bfloat16(), weight.data)
    out["master_has_more_bits"] = not torch.equal(full, weight.data.float())
    value = torch.linspace(-1, 1, weight.numel()).reshape(weight.shape)
    utils.safe_set_full_fp32_param(weight, value)
    out["set_full"] = torch.equal(utils.safe_get_full_fp32_param(weight), value) and torch.equal(
        weight.data, value.bfloat16()
    )
    utils.safe_set_local_fp32_param(weight, utils.safe_get_local_fp32_param(weight) * 3)
    out["set_local"] = torch.equal(weight.data, (value * 3).bfloat16())
    engine.destroy()
    return out


def _errors() -> dict[str, str]:
    import shardspeed
    from shardspeed import utils

    model = _model()
    model.layers[0].bias.requires_grad_(False)
    engine, _, _, _ = shardspeed.initialize(model=model, config=_config(1))
    weight = model.layers[0].weight
    calls = {
        "plain": lambda: utils.safe_get_full_fp32_param(nn.Parameter(torch.ones(2))),
        "frozen": lambda: utils.safe_get_full_grad(model.layers[0].bias),
        "no_state_yet": lambda: utils.safe_get_full_optimizer_state(weight, "exp_avg"),
        "full_shape": lambda: utils.safe_set_full_fp32_param(weight, torch.zeros(3)),
        "local_numel": lambda: utils.safe_set_local_fp32_param(weight, torch.zeros(1000)),
    }
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = "no error"
        except ValueError as err:
            out[name] = str(err)
    engine.backward(engine(_batch(0, 0)))
    engine.step()
    engine.backward(engine(_batch(0, 1)))
    engine.step()
    try:
        utils.safe_get_full_optimizer_state(weight, "momentum_buffer")
    except ValueError as err:
        out["unknown_key"] = str(err)
    engine.destroy()
    return out


def _run_all() -> dict[str, dict[str, object]]:
    out: dict[str, dict[str, object]] = {n: _run_case(c) for n, c in CASES.items()}
    out["bf16"] = _bf16_stage2()  # type: ignore[assignment]
    out["errors"] = _errors()  # type: ignore[assignment]
    return out


def _reference(stage: int) -> dict[str, object]:
    from shardspeed.optim import build_optimizer

    model = _model()
    names = [n for n, _ in model.named_parameters()]
    params = list(model.parameters())
    opt = build_optimizer("AdamW", {"lr": LR, "weight_decay": 0.01}, params)
    spec = ParitySpec(stage=stage, world=WORLD, gas=GAS)
    out: dict[str, object] = {}
    for step in range(2):
        micro = []
        for j in range(WORLD * GAS):
            (model(_batch(step, j)) / GAS).backward()
            micro.append([p.grad.clone() for p in params])
            model.zero_grad(set_to_none=True)
        if step == 0:
            first = sum_in_engine_order(micro[:WORLD], ParitySpec(stage=stage, world=WORLD, gas=1))
            out["partial"] = {n: g / WORLD for n, g in zip(names, first)}
        grads = [g / WORLD for g in sum_in_engine_order(micro, spec)]
        out[f"grad{step}"] = dict(zip(names, [g.clone() for g in grads]))
        for p, g in zip(params, grads):
            p.grad = g
        opt.step()
        opt.zero_grad(set_to_none=True)
        out[f"param{step}"] = {n: p.detach().clone() for n, p in zip(names, params)}
        for key in ("exp_avg", "exp_avg_sq"):
            out[f"{key}{step}"] = {n: opt.state[p][key].clone() for n, p in zip(names, params)}
        if step == 0:
            named = dict(zip(names, params))
            with torch.no_grad():
                named[EDITED[0]].mul_(0.5)
                opt.state[named[EDITED[1]]]["exp_avg"].zero_()
                named[EDITED[2]].mul_(2)
                opt.state[named[EDITED[2]]]["exp_avg_sq"].mul_(0.25)
            out["edited"] = {n: p.detach().clone() for n, p in zip(names, params)}
    return out


def _close(got: dict, ref: dict, label: str) -> None:
    assert got.keys() == ref.keys(), label
    for name in ref:
        torch.testing.assert_close(
            got[name], ref[name], **TOL, msg=lambda m, n=name: f"{label} {n}: {m}"
        )


def test_safe_get_set_match_plain_training_at_every_stage() -> None:
    per_rank = run_distributed(_run_all, WORLD, timeout=300)
    for name, config in CASES.items():
        stage = config["zero_optimization"]["stage"]
        ref = _reference(stage)
        for rank, results in enumerate(per_rank):
            got = results[name]
            label = f"{name} rank {rank}"
            if stage <= 1:
                assert "not reduced yet" in got["partial"], got["partial"]
                assert "accumulation-boundary" in got["partial"]
            else:
                _close(got["partial"], ref["partial"], f"{label} partial grad")
            for key in ("grad0", "param0", "exp_avg0", "exp_avg_sq0", "edited", "grad1"):
                _close(got[key], ref[key], f"{label} {key}")
            for key in ("param1", "exp_avg1", "exp_avg_sq1"):
                _close(got[key], ref[key], f"{label} {key}")
            for step in (0, 1):  # the parameters themselves follow their fp32 masters
                _close(got[f"data{step}"], got[f"param{step}"], f"{label} data{step}")
            _close(got["edited_data"], got["edited"], f"{label} edited data")

    for results in per_rank:
        assert all(results["bf16"].values()), results["bf16"]
        errors = results["errors"]
        assert "safe_get_full_fp32_param(param)" in errors["plain"]
        assert "not trained by a ShardSpeed engine" in errors["plain"]
        assert "requires_grad=False" in errors["frozen"]
        assert (
            "first step()" in errors["no_state_yet"] and "available: []" in errors["no_state_yet"]
        )
        assert "shape (3,)" in errors["full_shape"] and "(12, 8)" in errors["full_shape"]
        assert "value has 1000" in errors["local_numel"]
        assert "available: ['exp_avg', 'exp_avg_sq']" in errors["unknown_key"]
