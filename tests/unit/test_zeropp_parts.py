"""ZeRO++ pieces without process groups: the block quantizer and its error bound, the group
plan, and the config rules. The collectives are tested in ``tests/dist/test_zeropp.py``."""

from __future__ import annotations

import pytest
import torch

from shardspeed.config import ConfigError, load_config
from shardspeed.zero.zeropp import ZeroPPPolicy
from shardspeed.zero.zeropp.groups import plan_groups
from shardspeed.zero.zeropp.quantize import (
    block_for,
    dequantize_rows,
    error_bound,
    qmax,
    quantize_rows,
)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("numel", [1, 7, 256, 300, 1000])
def test_round_trip_error_is_within_half_a_step_of_its_block(bits: int, numel: int) -> None:
    g = torch.Generator().manual_seed(numel * bits)
    x = torch.randn(3, numel, generator=g) * torch.tensor([[1.0], [1e-3], [50.0]])
    x[1, : numel // 2] = 0.0  # a (partly) zero row
    q = quantize_rows(x, bits, 256)
    back = dequantize_rows(q)
    bound = error_bound(x, bits, 256)
    assert back.shape == x.shape
    err = (back - x).abs()
    # half a step, plus fp32 rounding of the product codes * scale
    assert bool((err <= bound * (1 + 1e-6) + 1e-12).all()), float((err - bound).max())
    if numel >= 256:  # the bound is tight: some element of a random row is 1/4 step off
        assert float((err / bound.clamp_min(1e-30))[0].max()) > 0.25


def test_zero_blocks_are_exact_and_bytes_are_counted() -> None:
    x = torch.zeros(2, 512)
    x[1, 300] = 3.0
    for bits in (8, 4):
        q = quantize_rows(x, bits, 256)
        assert torch.equal(dequantize_rows(q), x)  # 3.0 is the block max: exact
        codes_bytes = 2 * 512 * bits // 8
        assert q.nbytes() == codes_bytes + 2 * 2 * 4  # two fp32 scales per row


def test_int4_codes_pack_two_per_byte_and_unpack_exactly() -> None:
    top = qmax(4)
    x = torch.arange(-top, top + 1, dtype=torch.float32).repeat(2).view(1, -1)  # (1, 30)
    q = quantize_rows(x, 4, 256)
    assert q.codes.dtype == torch.uint8 and q.codes.shape == (1, 15)
    assert torch.equal(dequantize_rows(q), x)


def test_blocks_are_at_most_the_maximum_and_pad_little() -> None:
    assert block_for(256, 256) == 256
    assert block_for(257, 256) == 130  # two equal blocks, not 256 + 1
    assert block_for(780, 256) == 196
    assert block_for(7, 256) == 8  # even (int4 packing)
    assert block_for(0, 256) == 2
    with pytest.raises(ValueError, match="bits=3"):
        qmax(3)


def test_group_plan_two_hosts_of_two() -> None:
    plan = plan_groups([0, 1, 2, 3], ["a", "a", "b", "b"], hpz=2)
    assert plan.hpz == ((0, 1), (2, 3))
    assert plan.intra == ((0, 1), (2, 3))
    assert plan.inter == ((0, 2), (1, 3))


def test_group_plan_falls_back_to_one_stage() -> None:
    # one host, uneven hosts, or hosts interleaved on the data axis: one stage over all
    for hosts in (["a"] * 4, ["a", "a", "a", "b"], ["a", "b", "a", "b"]):
        plan = plan_groups([0, 1, 2, 3], hosts, hpz=1)
        assert plan.intra == ((0, 1, 2, 3),) and plan.inter == (), hosts
        assert plan.hpz == ((0,), (1,), (2,), (3,))
    plan = plan_groups([1, 3, 5, 7], ["a", "a", "b", "b"], hpz=4)  # a data group of a TP job
    assert plan.hpz == ((1, 3, 5, 7),) and plan.inter == ((1, 5), (3, 7))


def test_hpz_size_must_divide_the_data_parallel_size() -> None:
    with pytest.raises(ValueError, match="zero_hpz_partition_size=3 must divide"):
        plan_groups([0, 1, 2, 3], ["a"] * 4, hpz=3)


def _zero(**keys: object) -> dict:
    return {"train_batch_size": 8, "zero_optimization": keys}


def test_config_accepts_zeropp_at_stage_3_and_refuses_it_elsewhere_by_name() -> None:
    keys = dict(zero_quantized_weights=True, zero_hpz_partition_size=2)
    zero = load_config(_zero(stage=3, zero_quantized_gradients=True, **keys)).zero_optimization
    policy = ZeroPPPolicy.from_config(zero)
    assert policy == ZeroPPPolicy(True, 2, True) and policy.describe() == "ZeRO++ qwZ+hpZ 2+qgZ"
    assert not ZeroPPPolicy.from_config(load_config(_zero(stage=3)).zero_optimization).enabled
    for stage in (0, 1, 2):
        for key, value in (*keys.items(), ("zero_quantized_gradients", True)):
            with pytest.raises(ConfigError, match=f"zero_optimization.{key}") as info:
                load_config(_zero(stage=stage, **{key: value}))
            assert 'set "stage": 3' in str(info.value)
    with pytest.raises(ConfigError, match="zeropp_loco_param"):
        load_config(_zero(stage=3, zero_quantized_gradients=True, zeropp_loco_param={}))
