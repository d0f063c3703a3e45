"""Muon in one process: Newton-Schulz against the singular-value polynomial, the optimizer
against a plain-torch reference written here, flat masters equal whole tensors, the
Muon/AdamW split rule (zero.Init parameters by their full shape), the factory, and the
refusals (NVMe optimizer offload, bad keys)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

from shardspeed.ops.muon import Muon, split_muon_groups
from shardspeed.ops.newton_schulz import gram_newton_schulz, newton_schulz, orthogonalise
from shardspeed.optim import build_optimizer

A, B, C = 3.4445, -4.7750, 2.0315


def svd_newton_schulz(matrix: torch.Tensor, steps: int = 5) -> torch.Tensor:
    """The quintic iteration as what it does to singular values: s -> p(s), ``steps``
    times, on s / ||matrix||_F (fp64 SVD)."""
    m = matrix.double()
    u, s, vh = torch.linalg.svd(m, full_matrices=False)
    s = s / (torch.linalg.matrix_norm(m) + 1e-7)
    for _ in range(steps):
        s = A * s + B * s**3 + C * s**5
    return u @ torch.diag(s) @ vh


@pytest.mark.parametrize("shape", [(12, 40), (40, 12), (16, 16), (3, 5)])
def test_newton_schulz_is_the_singular_value_polynomial(shape: tuple[int, int]) -> None:
    g = torch.randn(*shape, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    expected = svd_newton_schulz(g)
    for run in (newton_schulz, gram_newton_schulz):
        torch.testing.assert_close(run(g, 5, torch.float64), expected, rtol=0, atol=1e-12)
        torch.testing.assert_close(run(g.float(), 5).double(), expected, rtol=0, atol=2e-6)
    singular = torch.linalg.svdvals(newton_schulz(g, 5, torch.float64))
    assert 0.6 < float(singular.min()) and float(singular.max()) < 1.2  # ~orthogonal
    half = gram_newton_schulz(g.float(), 5, torch.float16).double()
    assert float((half - expected).abs().max()) < 2e-2  # fp16 gram stays close


def test_orthogonalise_scales_tall_matrices_and_views_conv_filters() -> None:
    g = torch.randn(4, 3, 2, 2, generator=torch.Generator().manual_seed(1))
    out = orthogonalise(g, method="standard")
    torch.testing.assert_close(out, newton_schulz(g.view(4, 12), 5).view(4, 3, 2, 2))
    tall = torch.randn(40, 10, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(
        orthogonalise(tall, method="gram"),
        newton_schulz(tall, 5) * math.sqrt(4.0),
        atol=2e-6,
        rtol=0,
    )


def reference_muon_step(
    params: dict[str, torch.Tensor],
    grads: dict[str, torch.Tensor],
    state: dict[str, dict[str, torch.Tensor]],
    muon_names: set[str],
    *,
    lr: float,
    adam_lr: float,
    wd: float,
    beta: float = 0.95,
    betas: tuple[float, float] = (0.9, 0.95),
    eps: float = 1e-10,
) -> None:
    """Plain-torch Muon + AdamW, one tensor at a time (written from the algorithm)."""
    for name, p in params.items():
        g = grads[name].double()
        s = state.setdefault(name, {})
        if name in muon_names:
            m = s["m"] = beta * s.get("m", torch.zeros_like(g)) + (1 - beta) * g
            u = ((1 - beta) * g + beta * m).reshape(p.shape[0], -1)
            o = svd_newton_schulz(u) * math.sqrt(max(1.0, u.shape[0] / u.shape[1]))
            p.copy_(p.double() * (1 - lr * wd) - lr * o.reshape(p.shape))
        else:
            t = s["t"] = s.get("t", 0) + 1
            m = s["m"] = betas[0] * s.get("m", torch.zeros_like(g)) + (1 - betas[0]) * g
            v = s["v"] = betas[1] * s.get("v", torch.zeros_like(g)) + (1 - betas[1]) * g * g
            step = (m / (1 - betas[0] ** t)) / ((v / (1 - betas[1] ** t)).sqrt() + eps)
            p.copy_(p.double() * (1 - adam_lr * wd) - adam_lr * step)


def _tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    shapes = {"w1": (24, 8), "w2": (8, 24), "conv": (6, 2, 3, 3), "bias": (24,)}
    return {n: torch.randn(*s, generator=g) * 0.1 for n, s in shapes.items()}


def test_muon_equals_reference_on_tensors() -> None:
    ours = {n: t.clone() for n, t in _tensors().items()}
    ref = {n: t.clone() for n, t in _tensors().items()}
    opt = Muon(list(ours.values()), lr=0.02, adam_lr=1e-2, weight_decay=0.1, ns_method="standard")
    assert [g["use_muon"] for g in opt.param_groups] == [True, False]
    state: dict = {}
    g = torch.Generator().manual_seed(4)
    for _ in range(4):
        grads = {n: torch.randn(t.shape, generator=g) for n, t in ours.items()}
        for n, t in ours.items():
            t.grad = grads[n].clone()
        opt.step()
        reference_muon_step(ref, grads, state, {"w1", "w2", "conv"}, lr=0.02, adam_lr=1e-2, wd=0.1)
        for n in ours:
            torch.testing.assert_close(ours[n], ref[n], rtol=1e-5, atol=1e-7, msg=n)


def test_flat_masters_with_layout_equal_whole_tensors() -> None:
    """Two matrices concatenated in one flat master (plus padding) step like the tensors."""
    w1, w2 = torch.randn(24, 8), torch.randn(8, 24)
    flat = torch.cat([w1.reshape(-1), w2.reshape(-1), torch.zeros(5)])  # (389,)
    whole = [w1.clone(), w2.clone()]
    opt = Muon([{"params": [flat], "use_muon": True}], lr=0.05)
    opt.set_matrix_layout([[[(0, 192, 0, [24, 8], 0), (192, 192, 0, [8, 24], 192)]]], [None])
    ref = Muon([{"params": whole, "use_muon": True}], lr=0.05)
    g = torch.Generator().manual_seed(5)
    for _ in range(3):
        g1, g2 = torch.randn(24, 8, generator=g), torch.randn(8, 24, generator=g)
        flat.grad = torch.cat([g1.reshape(-1), g2.reshape(-1), torch.zeros(5)])
        whole[0].grad, whole[1].grad = g1, g2
        opt.step()
        ref.step()
    torch.testing.assert_close(flat[:192].view(24, 8), whole[0], rtol=0, atol=1e-7)
    torch.testing.assert_close(flat[192:384].view(8, 24), whole[1], rtol=0, atol=1e-7)
    assert flat[384:].eq(0).all()


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.wte = nn.Embedding(10, 8)
        self.proj = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 10, bias=False)
        self.head.weight = self.wte.weight  # tied LM head
        self.embed_proj = nn.Linear(8, 8, bias=False)


def test_split_rule_and_overrides() -> None:
    model = _Tiny()
    groups = split_muon_groups(model, [{"params": list(model.parameters()), "weight_decay": 0.1}])
    muon, adam = groups
    assert muon["use_muon"] and not adam["use_muon"] and adam["weight_decay"] == 0.1
    assert [id(p) for p in muon["params"]] == [id(model.proj.weight)]
    assert {id(p) for p in adam["params"]} == {
        id(model.wte.weight), id(model.proj.bias), id(model.norm.weight),
        id(model.norm.bias), id(model.embed_proj.weight),
    }  # fmt: skip
    model.embed_proj.weight.use_muon = True  # a parameter attribute wins over the rule
    kept = {"params": [model.norm.weight], "use_muon": True}  # a group flag is kept
    groups = split_muon_groups(model, [{"params": [model.embed_proj.weight]}, kept])
    assert groups[0]["use_muon"] and groups[1] is kept


def test_factory_and_deepspeed_defaults() -> None:
    w, b = torch.zeros(4, 4), torch.zeros(4)
    groups = [{"params": [w], "use_muon": True}, {"params": [b], "use_muon": False}]
    opt = build_optimizer("muon", {"lr": 1e-3, "muon_lr": 0.03, "weight_decay": 0.1}, groups)
    assert isinstance(opt, Muon)
    muon, adam = opt.param_groups
    assert (muon["lr"], muon["momentum"], muon["ns_method"]) == (0.03, 0.95, "gram")
    assert (adam["lr"], adam["betas"], adam["eps"]) == (1e-3, (0.9, 0.95), 1e-10)
    assert muon["weight_decay"] == adam["weight_decay"] == 0.1
    plain = Muon([{"params": [w], "use_muon": True}, {"params": [b], "use_muon": False}])
    assert [g["lr"] for g in plain.param_groups] == [0.02, 3e-4]  # DeepSpeed's defaults


@pytest.mark.parametrize(
    "params, match",
    [
        ({"per_head_muon": True}, "per_head_muon"),
        ({"ns_method": "svd"}, "ns_method='svd'"),
        ({"ns_dtype": "int8"}, "ns_dtype='int8'"),
        ({"momentum": 1.0}, "momentum=1.0"),
        ({"nesterow": True}, "nesterov"),
    ],
)
def test_bad_params_are_refused_by_name(params: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_optimizer("Muon", params, [torch.zeros(4, 4, requires_grad=True)])


def test_one_dim_tensor_in_muon_group_without_layout_is_refused() -> None:
    flat = torch.zeros(16)
    opt = Muon([{"params": [flat], "use_muon": True}])
    flat.grad = torch.ones(16)
    with pytest.raises(ValueError, match="use_muon=False group"):
        opt.step()


@pytest.mark.parametrize("stage, tp", [(0, False), (2, False), (3, False), (1, True), (3, True)])
def test_every_stage_and_tensor_parallel_accepted(stage: int, tp: bool) -> None:
    """ZeRO 0-3 and tensor parallelism are checked by parity in tests/dist/test_muon_*.py."""
    from shardspeed.runtime.optimizer_caps import OptimizerCaps

    caps = OptimizerCaps.of(Muon([torch.zeros(4, 4)]), None)
    assert caps.whole_matrices and caps.supported
    caps.check(stage, sharded=stage > 0, tensor_parallel=tp)


def test_nvme_optimizer_offload_refused_by_name() -> None:
    from types import SimpleNamespace

    from shardspeed.runtime.optimizer_caps import OptimizerCaps

    opt = Muon([torch.zeros(4, 4)])
    ctx = SimpleNamespace(stage=3, offload=SimpleNamespace(optimizer_swapper=object()))
    sharding = SimpleNamespace(ctx=ctx, shards_optimizer_state=True)
    topology = SimpleNamespace(size=lambda axis: 1)
    with pytest.raises(ValueError, match='offload_optimizer.device "cpu" or "none" with Muon'):
        OptimizerCaps.of(opt, None).connect(
            opt, sharding=sharding, topology=topology, dp_group=None, shard_axes=[],
            sharded_group_mask=[],
        )  # fmt: skip


def test_zero_init_partitioned_matrix_gets_muon() -> None:
    """A zero.Init parameter is an empty local tensor with its shape in ``ds_shape``: the
    split goes by that shape (an empty 1-D tensor would otherwise fall to AdamW)."""
    model = nn.Sequential(nn.Linear(8, 8, bias=True))
    weight, bias = model[0].weight, model[0].bias
    for p in (weight, bias):
        p.ds_shape = p.shape
        p.data = torch.empty(0)
    muon, adam = split_muon_groups(model, [{"params": [weight, bias]}])
    assert muon["use_muon"] and muon["params"] == [weight]
    assert not adam["use_muon"] and adam["params"] == [bias]
