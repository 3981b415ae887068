"""Achieved bandwidth of the Triton kernels vs the torch references at Qwen3-8B drafter shapes.

    python benchmarks/gpu_kernels.py            # on a GPU: 5 layers, 32/8 heads, hd 128, batch 1-64, context 1K-8K
    python benchmarks/gpu_kernels.py --dry-run  # on CPU: tiny shapes through TRITON_INTERPRET=1, to check the script
GB/s counts the bytes each kernel must move at least (K/V read or written once); % is of H200 HBM (4.8 TB/s).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

HBM_BYTES_PER_S = 4.8e12
DRY = "--dry-run" in sys.argv
if DRY or not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from dflash_trt.kernels import block_attention_kernel, kv_inject_kernel  # noqa: E402
from dflash_trt.kernels.reference import block_attention_reference, kv_inject_reference  # noqa: E402
from dflash_trt.kv_cache import PagedKVCache  # noqa: E402


def timed(fn, device, iters) -> float:
    fn()  # compile / warm up
    if device == "cuda":
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 1e3 / iters
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters


def report(name, nbytes, seconds_by_impl):
    cells = "  ".join(f"{impl} {s * 1e6:9.1f} us {nbytes / s / 1e9:8.1f} GB/s {100 * nbytes / s / HBM_BYTES_PER_S:5.1f}%" for impl, s in seconds_by_impl.items())
    print(f"{name:46s} {cells}", flush=True)


def bench_kv_inject(L, nkv, hd, tokens, dtype, device, iters):
    pages = -(-tokens // 16) + 1
    cache = PagedKVCache(L, nkv, hd, pages, 16, dtype, device)
    kv = torch.randn(tokens, L * 2 * nkv * hd, device=device).to(dtype)
    w = torch.ones(L, hd, device=device, dtype=dtype)
    cos, sin = torch.ones(tokens, hd, device=device, dtype=dtype), torch.zeros(tokens, hd, device=device, dtype=dtype)
    slots = torch.randperm(pages * 16, device=device)[:tokens]
    nbytes = 2 * kv.numel() * kv.element_size()  # read the GEMM output once, write K and V once
    report(f"kv_inject T={tokens} L={L} nkv={nkv} hd={hd}", nbytes, {
        "triton": timed(lambda: kv_inject_kernel.kv_inject(kv, w, cos, sin, slots, cache.k, cache.v, 1e-6), device, iters),
        "torch": timed(lambda: kv_inject_reference(kv, w, cos, sin, slots, cache.k, cache.v, 1e-6), device, iters),
    })


def bench_block_attention(nh, nkv, hd, batch, context, block, dtype, device, iters):
    page = 16
    cache = PagedKVCache(1, nkv, hd, batch * (-(-(context + block) // page)), page, dtype, device)
    cache.shuffle_free_pages(torch.Generator().manual_seed(0))  # pages scattered like a long-running server's
    for i in range(batch):
        cache.add_sequence(i)
        cache.reserve(i, context)
        cache.set_length(i, context)
    att = cache.prepare(list(range(batch)), [block] * batch)
    for pool in (cache.k, cache.v):  # normal_ has no FP8 kernel: draw in fp32, then store
        pool.copy_(torch.randn(pool.shape, device=pool.device).to(pool.dtype))
    q = torch.randn(batch * block, nh, hd, device=device, dtype=torch.bfloat16 if dtype == torch.float8_e4m3fn else dtype)  # FP8 pools, bf16 queries
    nbytes = 2 * batch * (context + block) * nkv * hd * cache.k.element_size() + 2 * q.numel() * q.element_size()
    report(f"block_attention B={batch} ctx={context} q={block} {str(dtype)[6:]}", nbytes, {
        "triton": timed(lambda: block_attention_kernel.from_batch(q, cache.k[0], cache.v[0], att, causal=False), device, iters),
        "torch": timed(lambda: block_attention_reference(q, cache.k[0], cache.v[0], att, causal=False), device, iters),
    })


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() and not args.dry_run else "cpu"
    if args.dry_run:  # tiny shapes, one iteration: checks the script end to end
        bench_kv_inject(2, 2, 16, 8, torch.bfloat16, device, 1)
        bench_block_attention(4, 2, 16, 2, 40, 4, torch.bfloat16, device, 1)
        bench_block_attention(4, 2, 16, 2, 40, 4, torch.float8_e4m3fn, device, 1)
        return 0
    print(f"device: {torch.cuda.get_device_name()}  (roofline {HBM_BYTES_PER_S / 1e12} TB/s)")
    L, nh, nkv, hd, block = 5, 32, 8, 128, 16  # Qwen3-8B DFlash drafter
    for tokens in (16, 256, 4096):
        bench_kv_inject(L, nkv, hd, tokens, torch.bfloat16, device, 20)
    for dtype in (torch.bfloat16, torch.float8_e4m3fn):
        for batch in (1, 8, 64):
            for context in (1024, 4096, 8192):
                bench_block_attention(nh, nkv, hd, batch, context, block, dtype, device, 20)
    return 0


if __name__ == "__main__":
    sys.exit(main())
