"""Ulysses head layouts (pure math) and the argument checks that need no process group."""

from __future__ import annotations

import pytest
import torch

from shardspeed.parallel.sequence.heads import HeadLayout, plan_heads
from shardspeed.parallel.sequence.layer import DistributedAttention, apply_rotary_pos_emb


def _local_kv_of_each_q_head(layout: HeadLayout, rank: int) -> list[int]:
    """For each of ``rank``'s query heads, the index of its KV copy within the rank."""
    group_size = layout.num_q_heads // layout.num_kv_heads
    piece = group_size // layout.kv_replicas  # query heads served by one KV copy
    kv_start, kv_stop = layout.kv_range(rank)
    local = []
    for head in range(*layout.q_range(rank)):
        copy = head // group_size * layout.kv_replicas + head % group_size // piece
        assert kv_start <= copy < kv_stop, (layout, rank, head, copy)
        local.append(copy - kv_start)
    return local


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 8])
def test_every_plan_keeps_query_heads_with_their_kv_head(world_size: int) -> None:
    for num_kv in range(1, 17):
        for num_q in range(num_kv, 33, num_kv):
            try:
                layout = plan_heads(num_q, num_kv, world_size)
            except ValueError as exc:
                # impossible only when some rank would get no whole KV head
                assert num_q < world_size or num_kv < world_size, (num_q, num_kv, world_size)
                assert "Sequence-parallel sizes that work" in str(exc)
                continue
            assert sum(layout.q_counts) == num_q
            assert sum(layout.kv_counts) == num_kv * layout.kv_replicas
            assert min(layout.q_counts) >= 1 and min(layout.kv_counts) >= 1
            for rank in range(world_size):
                ratio, rest = divmod(layout.q_counts[rank], layout.kv_counts[rank])
                assert rest == 0
                # the local kernel's GQA rule (local q head t reads local kv head t // ratio)
                # must agree with the global one
                local = _local_kv_of_each_q_head(layout, rank)
                assert local == [t // ratio for t in range(len(local))]


def test_layouts_named_in_the_docs() -> None:
    assert plan_heads(8, 2, 2) == HeadLayout(8, 2, 1, (4, 4), (1, 1))
    assert plan_heads(8, 2, 4) == HeadLayout(8, 2, 2, (2, 2, 2, 2), (1, 1, 1, 1))
    assert plan_heads(4, 1, 4) == HeadLayout(4, 1, 4, (1, 1, 1, 1), (1, 1, 1, 1))
    six = plan_heads(6, 6, 4)  # DeepSpeed's uneven split, larger first
    assert (six.q_counts, six.kv_replicas, six.is_even) == ((2, 2, 1, 1), 1, False)
    assert plan_heads(12, 6, 4).kv_counts == (3, 3, 3, 3)  # replicate x2 beats uneven


@pytest.mark.parametrize(
    ("num_q", "num_kv", "world_size", "reason"),
    [
        (3, 3, 4, "cannot give each of 4 ranks one head"),
        (6, 3, 4, "fewer than 4 ranks"),
        (6, 4, 2, "not a multiple"),
    ],
)
def test_impossible_layouts_name_the_fix(
    num_q: int, num_kv: int, world_size: int, reason: str
) -> None:
    with pytest.raises(ValueError, match=reason) as info:
        plan_heads(num_q, num_kv, world_size)
    assert f"num_q_heads={num_q}" in str(info.value)
    assert "Sequence-parallel sizes that work" in str(info.value)


def test_constructor_rejects_layouts_it_cannot_run() -> None:
    attn = torch.nn.Identity()
    with pytest.raises(ValueError, match="scatter_idx=2"):
        DistributedAttention(attn, object(), scatter_idx=1)
    with pytest.raises(ValueError, match="gather_idx"):
        DistributedAttention(attn, object(), gather_idx=2)
    with pytest.raises(ValueError, match="sequence_process_group"):
        DistributedAttention(attn, None)


def test_rotary_matches_the_half_rotation_formula() -> None:
    t = torch.randn(5, 2, 3, 8)
    angle = torch.randn(5, 1, 1, 4)
    cos, sin = torch.cat((angle, angle), -1).cos(), torch.cat((angle, angle), -1).sin()
    out = apply_rotary_pos_emb(t, cos, sin)
    x1, x2 = t[..., :4], t[..., 4:]
    expected = torch.cat(
        (x1 * cos[..., :4] - x2 * sin[..., :4], x2 * cos[..., 4:] + x1 * sin[..., 4:]), -1
    )
    torch.testing.assert_close(out, expected)
    partial = apply_rotary_pos_emb(t, cos[..., :4], sin[..., :4])  # rotate 4 of 8 features
    torch.testing.assert_close(partial[..., 4:], t[..., 4:])


def test_deepspeed_import_path() -> None:
    import shardspeed
    from shardspeed.parallel.sequence import DistributedAttention as impl

    assert shardspeed.sequence.layer.DistributedAttention is impl
