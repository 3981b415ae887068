"""models.layers.paged_attention's fast paths (a view of consecutive pool slots, ungathered query rows, no mask when
every key is visible, one half-precision query run as two) against a naive per-query softmax over the same pool."""

from __future__ import annotations

import math

import pytest
import torch

from dflash_trt.kv_cache import PagedKVCache
from dflash_trt.models.layers import paged_attention

HD = 16


def naive_attention(q, k_pool, v_pool, cache: PagedKVCache, seq_ids, starts, lens, causal, window, sinks):
    NH, NKV = q.shape[1], k_pool.shape[1]
    """One query at a time: softmax(q·kᵀ/√d) over the keys it may see (GQA: head h reads kv head h // (NH/NKV)), in
    float64; sinks join the denominator."""
    out = []
    row = 0
    for s, start, n in zip(seq_ids, starts, lens):
        slots = cache.slots(s, 0, start + n)
        k, v = k_pool[slots].double(), v_pool[slots].double()
        for i in range(n):
            p = start + i
            keys = torch.arange(start + n)
            see = torch.ones(start + n, dtype=torch.bool)
            if causal:
                see &= keys <= p
            if window is not None:
                see &= (p - keys < window) & ((keys - p < window) if not causal else True)
            heads = []
            for h in range(NH):
                kv = h // (NH // NKV)
                logits = (k[see, kv] @ q[row, h].double()) / math.sqrt(HD)
                m = logits.max() if sinks is None else torch.maximum(logits.max(), sinks[h].double())
                w = (logits - m).exp()
                denom = w.sum() + (0 if sinks is None else (sinks[h].double() - m).exp())
                heads.append((w[:, None] * v[see, kv]).sum(0) / denom)
            out.append(torch.cat(heads))
            row += 1
    return torch.stack(out)


CASES = {
    # (context lengths, new tokens per sequence, causal, window, sinks[, (heads, kv heads)]); default 6 heads over 2
    "one-seq-one-token": ([37], [1], True, None, False),
    "mha-one-token": ([37], [1], True, None, False, (4, 4)),
    "mha-two-seqs-block": ([12, 30], [4, 2], True, None, False, (4, 4)),
    "grouped-two-seqs-tree-like-window": ([12, 30], [5, 5], True, 7, False, (8, 2)),
    "one-seq-verify-block": ([37], [6], True, None, False),
    "one-seq-noncausal-block": ([21], [8], False, None, False),
    "one-seq-window-cuts-in": ([37], [1], True, 9, False),
    "one-seq-sinks": ([37], [1], True, None, True),
    "two-seqs-same-len": ([12, 30], [1, 1], True, None, False),
    "two-seqs-padded": ([12, 30], [3, 1], True, None, False),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shuffled", [False, True], ids=["consecutive-pages", "shuffled-pages"])
@pytest.mark.parametrize("name", list(CASES))
def test_paged_attention_equals_naive_softmax(name, shuffled, dtype):
    ctx, lens, causal, window, use_sinks, *heads = CASES[name]
    NH, NKV = heads[0] if heads else (6, 2)
    gen = torch.Generator().manual_seed(7)
    cache = PagedKVCache(1, NKV, HD, num_pages=24, page_size=4, dtype=dtype)
    if shuffled:
        cache.shuffle_free_pages(gen)
    seq_ids = list(range(len(ctx)))
    for s, n in zip(seq_ids, ctx):  # the context: K/V already in the pool
        cache.add_sequence(s)
        cache.reserve(s, n)
        slots = cache.slots(s, 0, n)
        cache.k[0][slots] = torch.randn(n, NKV, HD, generator=gen).to(dtype)
        cache.v[0][slots] = torch.randn(n, NKV, HD, generator=gen).to(dtype)
        cache.set_length(s, n)
    batch = cache.prepare(seq_ids, lens)
    T = sum(lens)
    cache.k[0][batch.write_slots] = torch.randn(T, NKV, HD, generator=gen).to(dtype)
    cache.v[0][batch.write_slots] = torch.randn(T, NKV, HD, generator=gen).to(dtype)
    q = torch.randn(T, NH, HD, generator=gen).to(dtype)
    sinks = torch.randn(NH, generator=gen).to(dtype) if use_sinks else None

    # the path taken is the one the case is for
    assert (batch.kv_run() is not None) == (len(ctx) == 1 and not shuffled)
    assert batch.unpadded() == (min(lens) == max(lens))
    same_keys = len({c + n for c, n in zip(ctx, lens)}) == 1 and min(lens) == max(lens)
    assert batch.mask_is_full(causal, window) == (same_keys and window is None and (not causal or max(lens) == 1))

    got = paged_attention(q, cache.k[0], cache.v[0], batch, causal=causal, window=window, sinks=sinks)
    want = naive_attention(q, cache.k[0], cache.v[0], cache, seq_ids, ctx, lens, causal, window, sinks)
    assert got.shape == (T, NH * HD) and got.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # bf16: the output's own rounding (values are O(1))
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)
