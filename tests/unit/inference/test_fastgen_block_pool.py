"""Block allocator bookkeeping and the hash-chain prefix cache."""

from __future__ import annotations

import pytest
import torch

from shardspeed.inference.fastgen.block_pool import BlockPool, NoFreeBlocksError, hash_block_tokens
from shardspeed.inference.fastgen.kv_cache import KVCache, KVCacheSpec, resolve_num_blocks


def test_allocate_free_fork_refcounts():
    pool = BlockPool(num_blocks=6, block_size=4)
    a = pool.allocate(4)
    assert len(set(a)) == 4 and pool.num_free == 2 and pool.num_used == 4
    with pytest.raises(NoFreeBlocksError, match="asked for 3 KV blocks but only 2"):
        pool.allocate(3)
    shared = pool.fork(a[:2])
    assert [pool.ref_counts[b] for b in a] == [2, 2, 1, 1]
    pool.free(a)
    assert pool.num_free == 4  # the two forked blocks are still held
    pool.free(shared)
    assert pool.num_free == 6
    with pytest.raises(AssertionError, match="double free"):
        pool.free([a[0]])
    assert pool.blocks_for_tokens(0) == 0 and pool.blocks_for_tokens(5) == 2


def test_prefix_cache_hits_touch_and_lru_eviction():
    pool = BlockPool(num_blocks=4, block_size=2, enable_prefix_caching=True)
    h1 = hash_block_tokens(None, [1, 2])
    h2 = hash_block_tokens(h1, [3, 4])
    assert h2 != hash_block_tokens(None, [3, 4])  # chained: same tokens, other parent
    blocks = pool.allocate(2)
    pool.register(blocks[0], h1)
    pool.register(blocks[1], h2)
    assert pool.lookup([h1, h2]) == blocks
    pool.free(blocks)  # cached but free: still found
    assert pool.num_free == 4 and pool.num_cached_blocks == 2
    assert pool.lookup([h1, h2, b"miss"]) == blocks
    assert pool.num_free_among(blocks) == 2
    pool.touch(blocks[:1])
    assert pool.num_free == 3 and pool.ref_counts[blocks[0]] == 1
    pool.free(blocks[:1])
    # allocation takes never-used blocks first, then evicts least recently freed
    fresh = pool.allocate(2)
    assert set(fresh).isdisjoint(blocks) and pool.num_cached_blocks == 2
    evicted = pool.allocate(1)[0]
    assert evicted == blocks[1]  # freed in reverse order: the tail block goes first
    assert pool.lookup([h1, h2]) == [blocks[0]]


def test_kv_cache_sizing_arithmetic_and_slots(caplog):
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4, dtype=torch.float16)
    assert spec.bytes_per_block == 2 * 2 * 4 * 2 * 8 * 2
    dev = torch.device("cpu")
    assert resolve_num_blocks(spec, dev, None, 10 * spec.bytes_per_block + 1, 0) == 10
    assert resolve_num_blocks(spec, dev, 7, None, 0) == 7
    assert resolve_num_blocks(spec, dev, None, None, max_useful_tokens=9) == 3  # capped
    with pytest.raises(ValueError, match="kv_cache_memory=1.5"):
        resolve_num_blocks(spec, dev, None, 1.5, 0)
    with pytest.raises(ValueError, match="smaller than one block"):
        resolve_num_blocks(spec, dev, None, 10, 0)
    cache = KVCache(spec, 3, dev)
    k = torch.randn(2, 2, 8)
    cache.write(1, torch.tensor([5, 11]), k, -k)
    assert torch.equal(cache.k[1][1, 1], k[0].half()) and torch.equal(
        cache.v[1][2, 3], -k[1].half()
    )
