"""MoE gating on small inputs: capacity, which routes are dropped, l_aux and exp_counts.

Logits are ``log(p)`` for chosen probability rows, so ``softmax(logits) == p`` and every
expected value below is worked out by hand from ``p`` (DeepSpeed's definitions, see
``shardspeed/parallel/moe/gating.py``). DeepSpeed itself is compared in
``tests/dist/test_moe_deepspeed_oracle.py``.
"""

from __future__ import annotations

import pytest
import torch

from shardspeed.parallel.moe.dispatch import CapacityDispatch, UnevenDispatch
from shardspeed.parallel.moe.ds_format import top1gating, top2gating
from shardspeed.parallel.moe.gating import (
    TopKGate,
    expert_capacity,
    gumbel_rsample,
    route_top1,
    route_top2,
    route_topk,
)
from shardspeed.parallel.moe.layer import MoE
from shardspeed.parallel.moe.utils import (
    is_moe_param,
    split_params_into_different_moe_groups_for_optimizer,
)


def logits_of(probs: list[list[float]]) -> torch.Tensor:
    return torch.tensor(probs).log()


def close(actual: torch.Tensor, expected: list) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype))


# ----------------------------------------------------------------------------- capacity
@pytest.mark.parametrize(
    ("tokens", "experts", "factor", "min_capacity", "expected"),
    [
        (16, 4, 0.5, 1, 2),  # ceil(16 / 4 * 0.5)
        (16, 4, 1.0, 4, 4),
        (4, 4, 1.0, 4, 4),  # min_capacity wins
        (10, 4, 1.0, 0, 3),  # ceil(2.5)
        (25, 2, 1.2, 0, 16),  # float32: 12.5 * 1.2f = 15.000001 -> 16 (DeepSpeed's value)
        (35, 3, 0.6, 0, 8),  # float32 again (exact math would give 7)
    ],
)
def test_capacity(tokens: int, experts: int, factor: float, min_capacity: int, expected: int):
    assert expert_capacity(tokens, experts, factor, min_capacity) == expected


# ----------------------------------------------------------------------------- top-1
# 4 tokens, 2 experts: tokens 0-2 choose expert 0, token 3 expert 1.
TOP1 = [[0.75, 0.25], [0.6, 0.4], [0.9, 0.1], [0.2, 0.8]]
# me = [2.45 / 4, 1.55 / 4], ce = [3 / 4, 1 / 4]: l_aux = 2 * (0.6125 * 0.75 + 0.3875 * 0.25)
TOP1_L_AUX = 1.1125


def test_top1_no_drop():
    r = route_top1(logits_of(TOP1), capacity_factor=1.0, min_capacity=0, drop_tokens=False)
    assert r.capacity is None
    close(r.expert_ids, [[0, 0, 0, 1]])
    close(r.locations, [[0, 1, 2, 0]])  # slots in token order
    close(r.weights, [[0.75, 0.6, 0.9, 0.8]])  # top-1 weight: the raw probability
    close(r.exp_counts, [3, 1])
    close(r.l_aux, TOP1_L_AUX)


def test_top1_rts_drops_the_lowest_priorities():
    # seed 3: RTS priorities of tokens 0, 1, 2 on expert 0 are 0.0043, 0.286, 0.472
    torch.manual_seed(3)
    r = route_top1(logits_of(TOP1), capacity_factor=1.0, min_capacity=0, use_rts=True)
    assert r.capacity == 2  # ceil(4 / 2 * 1.0)
    close(r.expert_ids, [[-1, 0, 0, 1]])  # token 0 loses: not token order
    close(r.locations, [[0, 0, 1, 0]])
    close(r.weights, [[0.0, 0.6, 0.9, 0.8]])
    close(r.exp_counts, [3, 1])  # counted before dropping
    close(r.l_aux, TOP1_L_AUX)  # from the choices, not the survivors


def test_top1_rts_consumes_one_uniform_draw():
    torch.manual_seed(3)
    route_top1(logits_of(TOP1), capacity_factor=1.0, min_capacity=0)
    after = torch.rand(1)
    torch.manual_seed(3)
    torch.rand(4, 2)
    assert torch.equal(torch.rand(1), after)


def test_top1_without_rts_keeps_capacity_routed_tokens():
    """DeepSpeed keeps whichever tokens torch.topk picks among equal 0/1 keys."""
    r = route_top1(logits_of(TOP1), capacity_factor=1.0, min_capacity=0, use_rts=False)
    kept0 = (r.expert_ids[0] == 0).nonzero().flatten().tolist()
    assert len(kept0) == 2 and set(kept0) <= {0, 1, 2}
    assert r.expert_ids[0, 3] == 1
    assert sorted(r.locations[0, kept0].tolist()) == [0, 1]
    keys = torch.nn.functional.one_hot(torch.tensor([0, 0, 0, 1]), 2)
    assert set(kept0) == set(torch.topk(keys, k=2, dim=0).indices[:, 0].tolist())


def test_top1_used_token_and_min_capacity():
    used = torch.tensor([1, 0, 1, 1])
    r = route_top1(
        logits_of(TOP1), capacity_factor=1.0, min_capacity=0, used_token=used, drop_tokens=False
    )
    close(r.expert_ids, [[0, -1, 0, 1]])
    close(r.exp_counts, [2, 1])
    close(r.l_aux, 2 * (0.6125 * 0.5 + 0.3875 * 0.25))
    with pytest.raises(ValueError, match="min_capacity"):
        route_top1(logits_of(TOP1), capacity_factor=1.0, min_capacity=5)


def test_top1_rsample_noise_picks_experts_weights_stay_clean():
    logits = logits_of(TOP1)
    torch.manual_seed(0)
    noisy_choice = (logits + gumbel_rsample(logits.shape)).argmax(dim=1)
    torch.manual_seed(0)
    r = route_top1(logits, capacity_factor=2.0, min_capacity=0, noisy_gate_policy="RSample")
    assert torch.equal(r.expert_ids[0], noisy_choice)
    probs = torch.tensor(TOP1)
    close(r.weights[0], probs[torch.arange(4), noisy_choice].tolist())


def test_top1_min_capacity_raises_the_capacity():
    # ceil(4 / 2 * 0.5) = 1, but min_capacity 3: expert 0's three tokens all fit
    torch.manual_seed(3)
    r = route_top1(logits_of(TOP1), capacity_factor=0.5, min_capacity=3)
    assert r.capacity == 3
    close(r.expert_ids, [[0, 0, 0, 1]])
    close(r.locations, [[0, 1, 2, 0]])
    close(r.exp_counts, [3, 1])
    close(r.l_aux, TOP1_L_AUX)


def _identity_gate(**kwargs: object) -> TopKGate:
    """A 2-expert gate whose logits are its input (``wg`` = identity)."""
    gate = TopKGate(2, 2, min_capacity=0, **kwargs)
    with torch.no_grad():
        gate.wg.weight.copy_(torch.eye(2))
    return gate


def test_eval_capacity_factor_applies_in_eval_mode_only():
    gate = _identity_gate(k=1, capacity_factor=2.0, eval_capacity_factor=0.5)
    torch.manual_seed(3)
    train = gate.route(logits_of(TOP1))
    assert train.capacity == 4  # ceil(4 / 2 * 2.0): nothing dropped
    close(train.expert_ids, [[0, 0, 0, 1]])
    gate.eval()
    torch.manual_seed(3)  # RTS priorities of tokens 0, 1, 2: 0.0043, 0.286, 0.472
    r = gate.route(logits_of(TOP1))
    assert r.capacity == 1  # ceil(4 / 2 * 0.5)
    close(r.expert_ids, [[-1, -1, 0, 1]])  # expert 0 keeps its highest priority, token 2
    close(r.locations, [[0, 0, 0, 0]])
    close(r.weights, [[0.0, 0.0, 0.9, 0.8]])
    close(r.exp_counts, [3, 1])
    close(r.l_aux, TOP1_L_AUX)


# ----------------------------------------------------------------------------- top-2
# 4 tokens, 3 experts. first / second choice: t0 e0/e1, t1 e0/e2, t2 e1/e0, t3 e0/e1.
TOP2 = [[0.5, 0.3, 0.2], [0.6, 0.1, 0.3], [0.2, 0.7, 0.1], [0.4, 0.35, 0.25]]
# me = [1.7, 1.45, 0.85] / 4, ce (first choices) = [3, 1, 0] / 4; l_aux = 9 * mean(me * ce)
TOP2_L_AUX = 1.228125


def test_top2_no_drop():
    kwargs = {"capacity_factor": 1.0, "min_capacity": 0, "second_expert_sampling": False}
    r = route_top2(logits_of(TOP2), drop_tokens=False, **kwargs)
    close(r.expert_ids, [[0, 0, 1, 0], [1, 2, 0, 1]])
    # second choices queue behind all first choices: e0 has 3 firsts, e1 has 1
    close(r.locations, [[0, 1, 0, 2], [1, 0, 3, 2]])
    close(
        r.weights,
        [
            [0.5 / 0.8, 0.6 / 0.9, 0.7 / 0.9, 0.4 / 0.75],
            [0.3 / 0.8, 0.3 / 0.9, 0.2 / 0.9, 0.35 / 0.75],
        ],
    )
    close(r.exp_counts, [4, 3, 1])
    close(r.l_aux, TOP2_L_AUX)


def test_top2_drop_order_first_choices_then_token_order():
    kwargs = {"capacity_factor": 0.5, "min_capacity": 0, "second_expert_sampling": False}
    r = route_top2(logits_of(TOP2), drop_tokens=True, **kwargs)
    assert r.capacity == 2  # ceil(4 / 3 * 0.5 * 2)
    # e0 keeps t0, t1 (firsts); t3's first (slot 2) and t2's second (slot 3) are dropped;
    # e1 keeps t2 (first) and t0 (second, slot 1); t3's second (slot 2) is dropped
    close(r.expert_ids, [[0, 0, 1, -1], [1, 2, -1, -1]])
    close(r.locations, [[0, 1, 0, 0], [1, 0, 0, 0]])
    # weights renormalised over kept routes; a token with nothing kept gets 0
    close(r.weights, [[0.5 / 0.8, 0.6 / 0.9, 1.0, 0.0], [0.3 / 0.8, 0.3 / 0.9, 0.0, 0.0]])
    close(r.exp_counts, [4, 3, 1])
    close(r.l_aux, TOP2_L_AUX)


def test_top2_min_capacity_keeps_every_route():
    kwargs = {"capacity_factor": 0.5, "min_capacity": 4, "second_expert_sampling": False}
    r = route_top2(logits_of(TOP2), drop_tokens=True, **kwargs)
    assert r.capacity == 4  # max(ceil(4 / 3 * 0.5 * 2), 4)
    close(r.expert_ids, [[0, 0, 1, 0], [1, 2, 0, 1]])  # as without dropping
    close(r.locations, [[0, 1, 0, 2], [1, 0, 3, 2]])
    close(r.exp_counts, [4, 3, 1])
    close(r.l_aux, TOP2_L_AUX)


def test_top2_sampling_changes_only_the_second_choice():
    torch.manual_seed(0)
    r = route_top2(logits_of(TOP2), capacity_factor=1.0, min_capacity=0, drop_tokens=False)
    close(r.expert_ids[0], [0, 0, 1, 0])
    assert bool((r.expert_ids[1] != r.expert_ids[0]).all())
    close(r.l_aux, TOP2_L_AUX)


# ----------------------------------------------------------------------------- top-k
TOPK = [[0.4, 0.3, 0.2, 0.1], [0.1, 0.2, 0.3, 0.4]]  # k=3: t0 -> e0 e1 e2, t1 -> e3 e2 e1


def test_topk_no_drop_is_mixtral_routing():
    r = route_topk(logits_of(TOPK), 3, capacity_factor=1.0, min_capacity=0, drop_tokens=False)
    close(r.expert_ids, [[0, 3], [1, 2], [2, 1]])
    close(r.weights, [[0.4 / 0.9, 0.4 / 0.9], [0.3 / 0.9, 0.3 / 0.9], [0.2 / 0.9, 0.2 / 0.9]])
    close(r.locations, [[0, 0], [0, 1], [0, 1]])
    close(r.exp_counts, [1, 2, 2, 1])
    close(r.l_aux, 1.0)  # me = 1/4 each, ce = [1, 2, 2, 1] / 2: mean(me*ce) * 16 / 3


@pytest.mark.parametrize(
    ("policy", "ids", "weights"),
    [
        # capacity 1: e1 keeps t0 (p 0.3 > 0.2), e2 keeps t1 (0.3 > 0.2)
        ("probs", [[0, 3], [1, 2], [-1, -1]], [[4 / 7, 4 / 7], [3 / 7, 3 / 7], [0, 0]]),
        # capacity 1: e1 and e2 keep their first token, t0
        ("position", [[0, 3], [1, -1], [2, -1]], [[4 / 9, 1], [3 / 9, 0], [2 / 9, 0]]),
    ],
)
def test_topk_drop_policies(policy: str, ids: list, weights: list):
    r = route_topk(logits_of(TOPK), 3, capacity_factor=0.5, min_capacity=0, drop_policy=policy)
    assert r.capacity == 1  # ceil(2 / 4 * 0.5 * 3)
    close(r.expert_ids, ids)
    close(r.weights, weights)
    close(r.exp_counts, [1, 2, 2, 1])  # every choice, before dropping
    close(r.l_aux, 1.0)  # from the choices, not the survivors (as without dropping)


# ----------------------------------------------------------------------------- formats
def test_deepspeed_dense_outputs():
    l_aux, combine, dispatch, counts = top1gating(
        logits_of(TOP1), 1.0, 0, drop_tokens=False, use_rts=False
    )
    assert combine.shape == (4, 2, 3)  # no drop: capacity = max load (3) on one process
    expected = torch.zeros(4, 2, 3)
    expected[0, 0, 0], expected[1, 0, 1], expected[2, 0, 2], expected[3, 1, 0] = 0.75, 0.6, 0.9, 0.8
    torch.testing.assert_close(combine, expected)
    assert torch.equal(dispatch, expected.bool())
    close(l_aux, TOP1_L_AUX)
    close(counts, [3, 1])
    sparse = top2gating(logits_of(TOP2), 0.5, 0, top2_2nd_expert_sampling=False, sparse_routes=True)
    assert int(sparse[1]) == 2 and sparse[2] == 3
    close(sparse[3], [[0, 0, 1, -1], [1, 2, -1, -1]])
    assert sparse[3].dtype == torch.int32


def test_gate_jitter_only_in_training():
    gate = TopKGate(4, 2, k=1, min_capacity=0, noisy_gate_policy="Jitter")
    x = torch.randn(6, 4)
    gate.eval()
    torch.manual_seed(0)
    a = gate.route(x)
    state = torch.get_rng_state()
    torch.manual_seed(0)
    torch.rand(6, 2)  # eval: only the RTS draw
    assert torch.equal(torch.get_rng_state(), state)
    gate.train()
    torch.manual_seed(0)
    b = gate.route(x)
    assert not torch.equal(a.weights, b.weights)  # jittered input


# ----------------------------------------------------------------------------- dispatch
def test_capacity_and_uneven_dispatch_agree_without_drops():
    torch.manual_seed(0)
    moe = MoE(6, torch.nn.Linear(6, 6), num_experts=4, k=2, min_capacity=0, capacity_factor=4.0)
    tokens = torch.randn(10, 6)
    torch.manual_seed(1)
    routing = moe.deepspeed_moe.gate.route(tokens)
    assert bool(routing.kept.all())
    experts = moe.deepspeed_moe.experts
    padded = CapacityDispatch(None, 1, 4)(tokens, routing, experts)
    uneven = UnevenDispatch(None, 1, 4)(tokens, routing, experts)
    torch.testing.assert_close(padded, uneven)
    reference = sum(
        routing.weights[r, :, None]
        * torch.stack(
            [experts.deepspeed_experts[int(e)](t) for e, t in zip(routing.expert_ids[r], tokens)]
        )
        for r in range(2)
    )
    torch.testing.assert_close(padded, reference)


# ----------------------------------------------------------------------------- params
def test_expert_params_marked_and_grouped_like_deepspeed():
    moe = MoE(4, torch.nn.Linear(4, 4), num_experts=2, use_residual=True)
    names = {id(p): n for n, p in moe.named_parameters()}
    expert = [n for n, p in moe.named_parameters() if is_moe_param(p)]
    assert expert == [
        f"deepspeed_moe.experts.deepspeed_experts.{i}.{w}"
        for i in (0, 1)
        for w in ("weight", "bias")
    ]
    for p in moe.deepspeed_moe.experts.parameters():
        assert p.allreduce is False and p.group_name == "ep_size_1"
    groups = split_params_into_different_moe_groups_for_optimizer(
        {"name": "dense", "params": list(moe.parameters()), "lr": 0.5}, max_group_size=20
    )
    summary = [
        (g["name"], g.get("moe"), g["lr"], [names[id(p)] for p in g["params"]]) for g in groups
    ]
    assert summary == [
        ("dense", None, 0.5, ["deepspeed_moe.gate.wg.weight", "mlp.weight", "mlp.bias",
                              "coefficient.weight", "coefficient.bias"]),
        ("ep_size_1", True, 0.5, ["deepspeed_moe.experts.deepspeed_experts.0.weight",
                                  "deepspeed_moe.experts.deepspeed_experts.0.bias"]),
        ("ep_size_1", True, 0.5, ["deepspeed_moe.experts.deepspeed_experts.1.weight",
                                  "deepspeed_moe.experts.deepspeed_experts.1.bias"]),
    ]  # fmt: skip
    with pytest.raises(ValueError, match="'name'"):
        split_params_into_different_moe_groups_for_optimizer([{"params": list(moe.parameters())}])


def test_moe_argument_errors():
    with pytest.raises(ValueError, match="multiple of ep_size"):
        MoE(4, torch.nn.Linear(4, 4), num_experts=3, ep_size=2)
    with pytest.raises(ValueError, match="noisy_gate_policy"):
        MoE(4, torch.nn.Linear(4, 4), num_experts=2, noisy_gate_policy="Gaussian")
    with pytest.raises(ValueError, match="k must be"):
        MoE(4, torch.nn.Linear(4, 4), num_experts=2, k=3)
    moe = MoE(4, torch.nn.Linear(4, 4), num_experts=2, ep_size=2)  # fine until it runs
    with pytest.raises(ValueError, match="needs torch.distributed"):
        moe(torch.randn(8, 4))
