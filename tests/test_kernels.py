"""Triton kernels == their torch references (interpreter on CPU, compiled on CUDA), and the drafter on either path."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

if not torch.cuda.is_available():  # conftest sets it before any import of triton; say so if something undid it
    assert os.environ.get("TRITON_INTERPRET") == "1", "the Triton kernels need TRITON_INTERPRET=1 on CPU"
triton = pytest.importorskip("triton")

from conftest import write_drafter  # noqa: E402

from dflash_trt.kernels import accept_kernel as accept_triton  # noqa: E402
from dflash_trt.kernels import block_attention_kernel as attn_triton  # noqa: E402
from dflash_trt.kernels import kv_inject_kernel as inject_triton  # noqa: E402
from dflash_trt.kernels.reference import accept_reference, block_attention_reference, kv_inject_reference, to_cache  # noqa: E402
from dflash_trt.errors import ConfigError  # noqa: E402
from dflash_trt.kv_cache import PagedKVCache  # noqa: E402
from dflash_trt.kernels.rounding import round_to  # noqa: E402

tl = triton.language

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn
ULP = {torch.float32: 2e-6, torch.float16: 1e-3, torch.bfloat16: 8e-3, FP8: 0.125}


def shuffled_cache(nkv, hd, dtype, contexts, num_layers=1, page_size=4, seed=0) -> PagedKVCache:
    """Sequences holding `contexts` tokens each, on pages handed out in random order (last pages partly filled)."""
    need = sum(-(-(n + 9) // page_size) for n in contexts) + 3
    cache = PagedKVCache(num_layers, nkv, hd, need, page_size, dtype, DEVICE)
    cache.shuffle_free_pages(torch.Generator().manual_seed(seed))
    for i, n in enumerate(contexts):
        cache.add_sequence(i)
        cache.reserve(i, n)
        cache.set_length(i, n)
    return cache


def assert_matches(got, want, dtype, exact_fraction=0.99):
    """Within one ulp of `dtype` everywhere and bit-equal almost everywhere (the kernels mirror the reference's roundings)."""
    got, want = got.float(), want.float()
    torch.testing.assert_close(got, want, atol=ULP[dtype], rtol=ULP[dtype])
    if dtype != torch.float32:  # fp32 differs in the last bit (rsqrt vs 1/sqrt, summation order)
        assert (got == want).float().mean() >= exact_fraction


@pytest.mark.parametrize(
    "act,cache_dtype,nkv,hd",
    [(torch.float32, torch.float32, 2, 16), (torch.bfloat16, torch.bfloat16, 1, 32), (torch.float16, torch.float16, 2, 24), (torch.bfloat16, FP8, 2, 16)],
)
def test_kv_inject_equals_reference_and_writes_only_its_slots(act, cache_dtype, nkv, hd):
    g = torch.Generator().manual_seed(1)
    T, L = 7, 3
    cache = [shuffled_cache(nkv, hd, cache_dtype, [5, 11], num_layers=L) for _ in range(2)]
    kv = (2 * torch.randn(T, L * 2 * nkv * hd, generator=g)).to(act).to(DEVICE)
    k_norm = (1 + 0.2 * torch.randn(L, hd, generator=g)).to(act).to(DEVICE)
    positions = torch.tensor([5, 6, 7, 11, 12, 13, 14])
    freqs = positions.float()[:, None] / 10000 ** (torch.arange(0, hd, 2).float() / hd)
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos().to(act).to(DEVICE), emb.sin().to(act).to(DEVICE)
    for c in cache:
        c.reserve(0, 8)
        c.reserve(1, 15)
    slots = torch.cat([cache[0].slots(0, 5, 8), cache[0].slots(1, 11, 15)]).to(DEVICE)
    scales = (0.5, 0.25) if cache_dtype == FP8 else (1.0, 1.0)
    kv_inject_reference(kv, k_norm, cos, sin, slots, cache[0].k, cache[0].v, 1e-6, *scales)
    inject_triton.kv_inject(kv, k_norm, cos, sin, slots.to(torch.int32), cache[1].k, cache[1].v, 1e-6, *scales)
    # compared on the written slots only: the untouched ones are zero on both sides and would dilute the fraction
    assert_matches(cache[1].k[:, slots], cache[0].k[:, slots], cache_dtype)
    assert_matches(cache[1].v[:, slots], cache[0].v[:, slots], cache_dtype, exact_fraction=1.0)
    untouched = torch.ones(cache[1].k.shape[1], dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert cache[1].k[:, untouched].float().abs().sum() == 0 and cache[1].v[:, untouched].float().abs().sum() == 0


ATTENTION_CASES = {
    "fp32-noncausal": (torch.float32, torch.float32, False, None, 4, 2),
    "fp32-causal-window-edge": (torch.float32, torch.float32, True, 6, 4, 2),
    "fp32-noncausal-window-1": (torch.float32, torch.float32, False, 1, 4, 1),
    "fp32-noncausal-window-mid-block": (torch.float32, torch.float32, False, 3, 4, 4),
    "bf16-mha-noncausal": (torch.bfloat16, torch.bfloat16, False, None, 2, 2),
    "fp16-causal": (torch.float16, torch.float16, True, None, 4, 2),
    "bf16-q-fp8-kv-scaled": (torch.bfloat16, FP8, False, None, 4, 2),
    "fp32-q-fp8-kv-window": (torch.float32, FP8, True, 9, 4, 1),
}


@pytest.mark.parametrize("case", list(ATTENTION_CASES))
def test_block_attention_equals_reference(case):
    act, kv_dtype, causal, window, nh, nkv = ATTENTION_CASES[case]
    hd = 16
    g = torch.Generator().manual_seed(2)
    contexts, q_lens = [37, 0, 70, 9], [5, 1, 8, 3]  # different contexts; one request with no context at all
    cache = shuffled_cache(nkv, hd, kv_dtype, contexts, seed=3)
    batch = cache.prepare(list(range(len(contexts))), q_lens)
    scales = (0.5, 0.25) if kv_dtype == FP8 else (1.0, 1.0)
    cache.k.copy_(to_cache(3 * torch.randn(cache.k.shape, generator=g), kv_dtype, scales[0]))
    cache.v.copy_(to_cache(torch.randn(cache.v.shape, generator=g), kv_dtype, scales[1]))
    q = torch.randn(sum(q_lens), nh, hd, generator=g).to(act).to(DEVICE)
    want = block_attention_reference(q, cache.k[0], cache.v[0], batch, causal, window, *scales)
    got = attn_triton.from_batch(q, cache.k[0], cache.v[0], batch, causal, window, *scales)
    tol = 2e-5 if act == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)
    # the same with the keys cut into many splits: the combine kernel merges them exactly
    meta = (batch.q_index[:, 0].contiguous(), batch.q_valid.sum(1), batch.kv_valid.sum(1))
    split = attn_triton.block_attention(q, cache.k[0], cache.v[0], batch.kv_slots.to(torch.int32), *meta, batch.q_index.shape[1], causal, window, *scales, splits=5)
    torch.testing.assert_close(split.float(), want.float(), atol=tol, rtol=tol)


def test_greedy_accept_equals_reference():
    g = torch.Generator().manual_seed(4)
    B, K = 12, 7
    target = torch.randint(0, 5, (B, K + 1), generator=g)
    drafts = target[:, :K].clone()
    cut = torch.randint(0, K + 1, (B,), generator=g)  # first forced mismatch (K: none)
    for b in range(B):
        if cut[b] < K:
            drafts[b, cut[b]] = (target[b, cut[b]] + 1) % 5
    num_drafts = torch.randint(0, K + 1, (B,), generator=g)
    num_drafts[0], num_drafts[1] = 0, K
    drafts[num_drafts < K, -1] = -1  # padding beyond num_drafts is ignored either way
    seq_lens = torch.randint(1, 100, (B,), generator=g)
    args = [t.to(DEVICE) for t in (drafts, num_drafts, target, seq_lens)]
    want = accept_reference(*args)
    got = accept_triton.greedy_accept(*args)
    for w, x in zip(want, got):
        assert torch.equal(w, x)
    assert torch.equal(want[0], torch.minimum(cut, num_drafts).to(DEVICE))
    # K = 0 (plain decoding): nothing accepted, the bonus is the target's token
    got = accept_triton.greedy_accept(args[0][:, :0], torch.zeros_like(args[1]), args[2][:, :1], args[3])
    assert int(got[0].abs().sum()) == 0 and torch.equal(got[1], args[2][:, 0]) and torch.equal(got[2], args[3] + 1)


@pytest.mark.skipif(importlib.util.find_spec("transformers") is None and torch.cuda.is_available(),
                    reason="the tiny target is written by transformers, which the lent GPU machine lacks (CPU CI has it)")
@pytest.mark.parametrize("sliding", [False, True])
def test_drafter_drafts_the_same_tokens_on_the_triton_path(tiny_dirs, tmp_path, monkeypatch, sliding):
    from dflash_trt.loading import load_torch_backend

    target_dir, drafter_dir = tiny_dirs
    if sliding:
        drafter_dir = write_drafter(tmp_path / "swa", target_dir, num_layers=2, block_size=8, layer_types=["full_attention", "sliding_attention"], sliding_window=5)
    prompts = [[5, 9, 13, 7, 22, 40, 41], [17, 3, 8], [60, 61, 62, 63, 64, 65, 66, 67, 68, 69, 70, 71, 72]]
    results = []
    for mode in ("torch", "triton"):
        monkeypatch.setenv("DFLASH_KERNELS", mode)
        backend = load_torch_backend(target_dir, drafter_dir, device=DEVICE, num_pages=64, page_size=4)
        ids = list(range(len(prompts)))
        for i in ids:
            backend.add_sequence(i)
        last = [int(s.tokens[-1]) for s in backend.prefill(ids, prompts)]
        drafts = backend.draft(ids, last, [7, 3, 5])
        # a second step: verify the drafts, commit some, inject the new context, draft again
        backend.verify(ids, [[t] + d for t, d in zip(last, drafts)])
        backend.commit(ids, [2, 1, 4])
        drafts2 = backend.draft(ids, [d[0] for d in drafts], [7, 7, 7])
        results.append((drafts, drafts2, backend.drafter_cache.k.clone(), backend.drafter_cache.v.clone()))
    (d_ref, d2_ref, k_ref, v_ref), (d_tri, d2_tri, k_tri, v_tri) = results
    assert d_tri == d_ref and d2_tri == d2_ref
    torch.testing.assert_close(k_tri, k_ref, atol=1e-5, rtol=1e-5)  # fp32: last-bit differences of the norm
    torch.testing.assert_close(v_tri, v_ref, atol=1e-5, rtol=1e-5)  # block scratch V follows the attention output


def test_switch_picks_triton_on_cuda_only_in_auto_mode(monkeypatch):
    from dflash_trt import kernels

    monkeypatch.setenv("DFLASH_KERNELS", "auto")
    assert not kernels.use_triton("cpu") and kernels.use_triton("cuda")
    monkeypatch.setenv("DFLASH_KERNELS", "torch")
    assert not kernels.use_triton("cuda")
    monkeypatch.setenv("DFLASH_KERNELS", "triton")
    assert kernels.use_triton("cpu")
    monkeypatch.setenv("DFLASH_KERNELS", "cuda")
    with pytest.raises(ConfigError, match="DFLASH_KERNELS"):
        kernels.use_triton("cpu")


@triton.jit
def _round_to_kernel(x_ptr, out_ptr, n, DTYPE: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(out_ptr + offs, round_to(x, DTYPE), mask=offs < n)


@pytest.mark.parametrize("dtype, tl_name", [(torch.float16, "float16"), (torch.bfloat16, "bfloat16"), (FP8, "float8e4nv")])
def test_round_to_gives_torchs_cast_bits_ties_subnormals_and_overflow_included(dtype, tl_name):
    g = torch.Generator().manual_seed(3)
    info = torch.finfo(dtype)
    values = [torch.randn(4000, generator=g) * s for s in (1e-7, 1e-5, 1e-3, 1.0, 100.0, 1e4)]
    grid = torch.linspace(-4, 4, 2001).to(dtype).float()  # exact ties: midpoints of neighbouring grid values
    values += [grid, (grid[1:] + grid[:-1]) / 2, torch.tensor([0.0, -0.0, info.tiny, info.tiny / 2, info.max, -info.max])]
    if dtype == torch.float16:
        values.append(torch.tensor([65519.0, 65520.0, -65520.0, 70000.0]))  # the last finite / the first to round to inf
    x = torch.cat(values).float()
    if dtype == FP8:
        x = x.clamp(-info.max, info.max)  # round_to saturates for FP8; torch's cast does not
    out = torch.empty_like(x)
    x, out = x.to(DEVICE), out.to(DEVICE)
    _round_to_kernel[(triton.cdiv(x.numel(), 256),)](x, out, x.numel(), DTYPE=getattr(tl, tl_name), BLOCK=256)
    want = x.to(dtype).float()
    assert torch.equal(out.cpu(), want.cpu())
