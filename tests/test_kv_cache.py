"""Paged KV cache invariants: pages track lengths exactly, rollback frees, exhaustion is a clear error."""

import pytest
import torch

from dflash_trt.errors import KVCacheFullError
from dflash_trt.kv_cache import PagedKVCache


def _cache(pages=6, page=4):
    return PagedKVCache(num_layers=2, num_kv_heads=1, head_dim=2, num_pages=pages, page_size=page)


def test_append_rollback_free_keep_pages_equal_to_ceil_of_length():
    cache = _cache()
    cache.add_sequence(0)
    cache.add_sequence(1)
    for length in (1, 4, 5, 13, 7, 8, 0, 16):
        cache.reserve(0, length)
        cache.set_length(0, length)
        assert len(cache.block_tables[0]) == -(-length // 4)
        assert cache.num_free_pages == 6 - len(cache.block_tables[0])
    cache.reserve(1, 3)
    cache.set_length(1, 3)
    assert set(cache.block_tables[0]).isdisjoint(cache.block_tables[1])
    cache.free(0)
    cache.free(1)
    assert cache.num_free_pages == 6 and not cache.block_tables


def test_slots_map_positions_through_the_block_table_and_survive_rollback():
    cache = _cache()
    cache.add_sequence(0)
    cache.add_sequence(1)
    cache.reserve(1, 4)  # interleave so sequence 0's pages are not contiguous
    cache.reserve(0, 10)
    table = cache.block_tables[0]
    slots = cache.slots(0, 0, 10)
    assert slots.tolist() == [table[p // 4] * 4 + p % 4 for p in range(10)]
    cache.k[0, slots] = torch.arange(10.0)[:, None, None].expand(10, 1, 2)
    cache.set_length(0, 6)  # roll back 4 tokens: the first 6 keep their values and slots
    assert cache.slots(0, 0, 6).tolist() == slots[:6].tolist()
    assert cache.k[0, cache.slots(0, 0, 6), 0, 0].tolist() == [0, 1, 2, 3, 4, 5]


def test_pool_exhaustion_raises_and_changes_nothing():
    cache = _cache(pages=3)
    cache.add_sequence(0)
    cache.reserve(0, 8)
    cache.add_sequence(1)
    with pytest.raises(KVCacheFullError, match="needs 2 more page"):
        cache.reserve(1, 5)
    assert cache.block_tables[1] == [] and cache.num_free_pages == 1
    cache.reserve(1, 4)  # what fits still works
    assert cache.num_free_pages == 0


def test_set_length_beyond_reservation_is_rejected():
    cache = _cache()
    cache.add_sequence(0)
    cache.reserve(0, 4)
    with pytest.raises(ValueError):
        cache.set_length(0, 5)
