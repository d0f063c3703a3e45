"""Optimizer factory: ds_config name mapping, update rules checked by hand, errors."""

from __future__ import annotations

import math

import pytest
import torch

from shardspeed.optim import (
    OPTIMIZER_NAMES,
    Lamb,
    Lion,
    build_optimizer,
    is_elementwise,
)

P0 = [0.5, -1.5, 2.0, -0.25]
G = [0.3, 0.2, -0.4, 0.1]


def _param(values: list[float] = P0, grad: list[float] = G) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.tensor(values, dtype=torch.float64))
    p.grad = torch.tensor(grad, dtype=torch.float64)
    return p


def _adam_first_step(p: float, g: float, lr: float, wd: float, decoupled: bool) -> float:
    """One Adam step by hand: after step 1 the bias-corrected moments are g and g*g."""
    eps = 1e-8
    if decoupled:
        return p * (1 - lr * wd) - lr * g / (abs(g) + eps)
    g = g + wd * p
    return p - lr * g / (abs(g) + eps)


@pytest.mark.parametrize(
    ("type_name", "extra", "decoupled", "cls"),
    [
        ("Adam", {}, True, torch.optim.AdamW),  # DeepSpeed: adam_w_mode defaults to true
        ("adam", {"adam_w_mode": False}, False, torch.optim.Adam),
        ("AdamW", {"adam_w_mode": False}, True, torch.optim.AdamW),  # AdamW always decoupled
        ("ADAM", {"adam_w_mode": True, "torch_adam": True}, True, torch.optim.AdamW),
    ],
)
def test_adam_weight_decay_semantics(type_name, extra, decoupled, cls):
    lr, wd = 0.1, 0.5
    p = _param()
    opt = build_optimizer(type_name, {"lr": lr, "weight_decay": wd, **extra}, [p])
    assert type(opt) is cls
    opt.step()
    expected = [_adam_first_step(x, g, lr, wd, decoupled) for x, g in zip(P0, G)]
    torch.testing.assert_close(p.detach(), torch.tensor(expected, dtype=torch.float64))
    # the same update as torch's own class with the same arguments
    ref = _param()
    cls([ref], lr=lr, weight_decay=wd).step()
    torch.testing.assert_close(p.detach(), ref.detach())


def test_adam_defaults_follow_deepspeed_not_torch():
    opt = build_optimizer("Adam", {"lr": 1e-3}, [_param()])
    assert opt.defaults["weight_decay"] == 0.0  # FusedAdam default, not AdamW's 0.01
    torch_opt = build_optimizer("Adam", {"lr": 1e-3, "torch_adam": True}, [_param()])
    assert torch_opt.defaults["weight_decay"] == 0.01  # torch_adam: torch's own defaults
    assert "adam_w_mode" not in opt.defaults and "torch_adam" not in torch_opt.defaults


def test_cpu_kernel_default_is_fused_unless_requested():
    p = torch.nn.Parameter(torch.zeros(8))
    assert build_optimizer("AdamW", {}, [p]).defaults["fused"] is True
    assert build_optimizer("sgd", {"lr": 0.1}, [p]).defaults["fused"] is True
    chosen = build_optimizer("AdamW", {"foreach": True}, [p]).defaults
    assert chosen["foreach"] is True and not chosen["fused"]


def test_torch_names_case_insensitive_and_groups_from_generators():
    model = torch.nn.Linear(3, 2)
    opt = build_optimizer("rmsprop", {"lr": 0.01}, model.parameters())
    assert type(opt) is torch.optim.RMSprop and len(opt.param_groups[0]["params"]) == 2
    groups = [{"params": (p for p in [model.weight]), "lr": 0.5}, {"params": [model.bias]}]
    opt = build_optimizer("Adagrad", {"lr": 0.1}, groups)
    assert [g["lr"] for g in opt.param_groups] == [0.5, 0.1]
    assert "Lamb" in OPTIMIZER_NAMES and "SGD" in OPTIMIZER_NAMES


def _lamb_step_by_hand(p, g, m, v, t, lr, wd, eps=1e-6, b1=0.9, b2=0.999, lo=0.01, hi=10.0):
    m = [b1 * mi + (1 - b1) * gi for mi, gi in zip(m, g)]
    v = [b2 * vi + (1 - b2) * gi * gi for vi, gi in zip(v, g)]
    u = [
        (mi / (1 - b1**t)) / (math.sqrt(vi / (1 - b2**t)) + eps) + wd * pi
        for mi, vi, pi in zip(m, v, p)
    ]
    w_norm = math.sqrt(sum(x * x for x in p))
    u_norm = math.sqrt(sum(x * x for x in u))
    ratio = min(max(w_norm / u_norm, lo), hi)
    return [pi - lr * ratio * ui for pi, ui in zip(p, u)], m, v, ratio


def test_lamb_trust_ratio_matches_hand_computation():
    lr, wd, eps = 0.01, 0.1, 1e-6
    p = _param()
    opt = build_optimizer("lamb", {"lr": lr, "weight_decay": wd, "eps": eps}, [p])
    assert type(opt) is Lamb
    ref, m, v = list(P0), [0.0] * 4, [0.0] * 4
    grads = [G, [-0.2, 0.4, 0.1, 0.3]]
    for t, g in enumerate(grads, start=1):
        p.grad = torch.tensor(g, dtype=torch.float64)
        opt.step()
        ref, m, v, ratio = _lamb_step_by_hand(ref, g, m, v, t, lr, wd, eps)
        torch.testing.assert_close(p.detach(), torch.tensor(ref, dtype=torch.float64))
        assert opt.get_lamb_coeffs() == pytest.approx([ratio])


def test_lamb_clamps_trust_ratio():
    p = _param([30.0, 40.0], [1.0, 1.0])  # ||p|| = 50, ||u|| ~ sqrt(2): ratio 35 > max
    opt = Lamb([p], lr=0.1, max_coeff=2.0)
    opt.step()
    assert opt.get_lamb_coeffs() == pytest.approx([2.0])
    torch.testing.assert_close(p.detach(), torch.tensor([29.8, 39.8], dtype=torch.float64))


@pytest.mark.parametrize("foreach", [True, False])
def test_lion_two_steps_by_hand(foreach):
    lr, wd, b1, b2 = 0.1, 0.2, 0.9, 0.99
    p = _param()
    q = _param([1.0, -2.0], [0.5, -0.5])  # a second tensor exercises the multi-tensor path
    opt = Lion([p, q], lr=lr, betas=(b1, b2), weight_decay=wd, foreach=foreach)
    opt.step()
    sign = [math.copysign(1.0, g) for g in G]  # m = 0: direction = sign((1 - b1) g)
    step1 = [x * (1 - lr * wd) - lr * s for x, s in zip(P0, sign)]
    torch.testing.assert_close(p.detach(), torch.tensor(step1, dtype=torch.float64))
    m1 = [(1 - b2) * g for g in G]
    torch.testing.assert_close(opt.state[p]["exp_avg"], torch.tensor(m1, dtype=torch.float64))
    g2 = [-0.01, 0.02, 0.5, -0.3]
    p.grad = torch.tensor(g2, dtype=torch.float64)
    opt.step()
    direction = [math.copysign(1.0, b1 * m + (1 - b1) * g) for m, g in zip(m1, g2)]
    step2 = [x * (1 - lr * wd) - lr * d for x, d in zip(step1, direction)]
    torch.testing.assert_close(p.detach(), torch.tensor(step2, dtype=torch.float64))


def test_offload_picks_deepspeed_cpu_classes():
    from shardspeed.ops.adagrad import DeepSpeedCPUAdagrad
    from shardspeed.ops.adam import DeepSpeedCPUAdam
    from shardspeed.ops.lion import DeepSpeedCPULion

    p = torch.nn.Parameter(torch.zeros(4))
    adam = build_optimizer(
        "Adam", {"adam_w_mode": False, "fp32_optimizer_states": True}, [p], offload=True
    )
    assert type(adam) is DeepSpeedCPUAdam and adam.adamw_mode is False
    assert adam.defaults["fused"] is True
    assert type(build_optimizer("lion", {}, [p], offload=True)) is DeepSpeedCPULion
    assert type(build_optimizer("Adagrad", {}, [p], offload=True)) is DeepSpeedCPUAdagrad
    assert (
        type(build_optimizer("Adam", {"torch_adam": True}, [p], offload=True)) is torch.optim.AdamW
    )


def test_ops_compat_classes():
    import shardspeed.ops as ops

    p, ref = _param(), _param()
    fused = ops.adam.FusedAdam([p], lr=0.1, weight_decay=0.5)  # adam_w_mode=True: AdamW
    fused.step()
    torch.optim.AdamW([ref], lr=0.1, weight_decay=0.5).step()
    torch.testing.assert_close(p.detach(), ref.detach())
    keep = ops.adam.FusedAdam([p], set_grad_none=False)
    keep.zero_grad()
    assert p.grad is not None and float(p.grad.abs().sum()) == 0.0
    assert is_elementwise(fused) and is_elementwise(ops.lion.FusedLion([p]))
    assert not is_elementwise(ops.lamb.FusedLamb([p]))
    with pytest.raises(ValueError, match="gradient_clipping"):
        ops.lamb.FusedLamb([p], max_grad_norm=1.0)
    with pytest.raises(AttributeError):
        ops.no_such_kernel  # noqa: B018


def test_is_elementwise():
    p = [torch.nn.Parameter(torch.zeros(2))]

    class LoggedAdamW(torch.optim.AdamW):  # keeps AdamW.step
        pass

    class Custom(torch.optim.SGD):
        def step(self, closure=None):  # changes the update: unknown
            return None

    class DeclaredElementwise(Custom):
        elementwise = True

    for opt in (torch.optim.AdamW(p), torch.optim.SGD(p, lr=0.1), Lion(p), LoggedAdamW(p)):
        assert is_elementwise(opt), type(opt).__name__
    assert is_elementwise(DeclaredElementwise(p, lr=0.1))
    for opt in (Lamb(p), torch.optim.LBFGS(p), torch.optim.Adafactor(p), Custom(p, lr=0.1)):
        assert not is_elementwise(opt), type(opt).__name__


def test_errors_name_the_problem():
    p = [torch.nn.Parameter(torch.zeros(2))]
    with pytest.raises(ValueError, match=r"'Adamm'.*Valid names.*AdamW.*Did you mean 'Adam'"):
        build_optimizer("Adamm", {}, p)
    with pytest.raises(ValueError, match=r"max_grad_norm.*top-level 'gradient_clipping'"):
        build_optimizer("Adam", {"max_grad_norm": 1.0}, p)
    with pytest.raises(ValueError) as err:
        build_optimizer("SGD", {"lr": 0.1, "beta": 0.9}, p)
    message = str(err.value)
    assert "'SGD'" in message and "['beta']" in message and "momentum" in message
    with pytest.raises(ValueError, match=r"'Lion'.*\['eps'\].*weight_decay"):
        build_optimizer("Lion", {"eps": 1e-8}, p)
    with pytest.raises(ValueError, match="betas"):
        Lion(p, betas=(0.9, 1.5))
    with pytest.raises(ValueError, match="bias_correction"):
        build_optimizer("Adam", {"bias_correction": False}, p)
