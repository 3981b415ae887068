"""Ahead-of-time compile the Triton kernels to cubins and emit the C++ header the plugins embed.

    python -m dflash_trt.kernels.aot --out build/dflash_kernels_aot.h [--shape L,nh,nkv,hd,max_q ...] [--archs 90,100,103]

Every kernel is specialized on its constexprs (head counts, head_dim, block rows, dtypes), so
the header holds one cubin per (kernel, variant, arch), looked up by a key string whose printf
format is emitted beside it (`DFLASH_KEY_*`): the C++ side formats the same key from the
plugin's attributes and tensor dtypes. Runs without a GPU (triton.compile for an explicit
GPUTarget); must run without TRITON_INTERPRET, which the CLI makes sure of.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from .plugin_spec import TARGET_ARCHS

DTYPES = {"fp32": "*fp32", "fp16": "*fp16", "bf16": "*bf16", "fp8": "*fp8e4nv"}
# printf formats of the lookup keys, shared with the C++ plugins through the header
KEY_FORMATS = {
    "kv_inject": "kv_inject act=%s cache=%s L=%d nkv=%d hd=%d",
    "block_attention_partial": "block_attention_partial act=%s kv=%s nh=%d nkv=%d hd=%d bm=%d causal=%d",
    "block_attention_combine": "block_attention_combine act=%s nh=%d nkv=%d hd=%d bm=%d",
    "accept": "accept bk=%d",
}
QWEN3_8B_DRAFTER = (5, 32, 8, 128, 16)  # layers, heads, kv heads, head_dim, block size


@dataclass
class Variant:
    kind: str  # a KEY_FORMATS key
    key_args: tuple
    fn_name: str  # module:function
    signature: dict[str, str]  # runtime args only, in order
    constexprs: dict
    num_warps: int = 4

    @property
    def key(self) -> str:
        return KEY_FORMATS[self.kind] % self.key_args


def kv_inject_variant(act, cache, L, nkv, hd) -> Variant:
    p = triton_next_pow2(hd)
    sig = dict(kv_ptr=DTYPES[act], k_norm_ptr=DTYPES[act], cos_ptr=DTYPES[act], sin_ptr=DTYPES[act], slots_ptr="*i32",
               k_cache_ptr=DTYPES[cache], v_cache_ptr=DTYPES[cache], num_slots="i32", eps="fp32", k_scale="fp32", v_scale="fp32")
    const = dict(NUM_LAYERS=L, NUM_KV_HEADS=nkv, HEAD_DIM=hd, BLOCK_D=p, CACHE_FP8=cache == "fp8")
    return Variant("kv_inject", (act, cache, L, nkv, hd), "kv_inject_kernel:kv_inject_kernel", sig, const, num_warps=1 if hd <= 64 else 2)


def block_attention_variants(act, kv, nh, nkv, hd, max_q, causal) -> list[Variant]:
    from .block_attention_kernel import BLOCK_N, block_m

    bm, bd = block_m(max_q, nh, nkv), triton_next_pow2(hd)
    sig = dict(q_ptr=DTYPES[act], k_pool_ptr=DTYPES[kv], v_pool_ptr=DTYPES[kv], kv_slots_ptr="*i32", q_starts_ptr="*i32",
               q_lens_ptr="*i32", kv_lens_ptr="*i32", acc_ptr="*fp32", m_ptr="*fp32", l_ptr="*fp32", max_kv="i32",
               keys_per_split="i32", qk_scale="fp32", k_scale="fp32", v_scale="fp32", window="i32")
    const = dict(NUM_HEADS=nh, NUM_KV_HEADS=nkv, HEAD_DIM=hd, BLOCK_D=bd, BLOCK_M=bm, BLOCK_N=BLOCK_N, CAUSAL=bool(causal), IEEE_DOT="fp32" in (act, kv))
    partial = Variant("block_attention_partial", (act, kv, nh, nkv, hd, bm, int(causal)), "block_attention_kernel:block_attention_partial_kernel", sig, const)
    sig = dict(acc_ptr="*fp32", m_ptr="*fp32", l_ptr="*fp32", q_starts_ptr="*i32", q_lens_ptr="*i32", out_ptr=DTYPES[act], num_splits="i32")
    const = dict(NUM_HEADS=nh, NUM_KV_HEADS=nkv, HEAD_DIM=hd, BLOCK_D=bd, BLOCK_M=bm)
    combine = Variant("block_attention_combine", (act, nh, nkv, hd, bm), "block_attention_kernel:block_attention_combine_kernel", sig, const)
    return [partial, combine]


def accept_variant(max_drafts) -> Variant:
    from .accept_kernel import block_k

    bk = block_k(max_drafts)
    sig = dict(drafts_ptr="*i32", num_drafts_ptr="*i32", target_ptr="*i32", seq_lens_ptr="*i32", accepted_ptr="*i32", bonus_ptr="*i32", new_lens_ptr="*i32", K="i32")
    return Variant("accept", (bk,), "accept_kernel:greedy_accept_kernel", sig, dict(BLOCK_K=bk), num_warps=1)


def variants_for(shape, acts=("bf16", "fp16"), fp8=True) -> list[Variant]:
    """Every variant one drafter shape (L, nh, nkv, hd, max_q) needs."""
    L, nh, nkv, hd, max_q = shape
    out = {}
    for act in acts:
        for cache in (act, "fp8") if fp8 else (act,):
            out_list = [kv_inject_variant(act, cache, L, nkv, hd)]
            for causal in (0, 1):
                out_list += block_attention_variants(act, cache, nh, nkv, hd, max_q, causal)
            for v in out_list:
                out[v.key] = v
    v = accept_variant(max_q - 1)
    out[v.key] = v
    return list(out.values())


def triton_next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


@dataclass
class Compiled:
    variant: Variant
    arch: int
    entry: str
    cubin: bytes
    num_params: int  # the cubin entry's parameters: our args + Triton's scratch pointers
    shared: int
    num_warps: int


def compile_variant(v: Variant, arch: int) -> Compiled:
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        raise RuntimeError("AOT compilation needs TRITON_INTERPRET unset (run python -m dflash_trt.kernels.aot)")
    module, name = v.fn_name.split(":")
    fn = getattr(importlib.import_module(f"dflash_trt.kernels.{module}"), name)
    assert isinstance(fn, JITFunction), fn
    signature = {a: v.signature.get(a, "constexpr") for a in fn.arg_names}
    assert set(v.signature) | set(v.constexprs) == set(fn.arg_names), (v.kind, set(fn.arg_names) ^ (set(v.signature) | set(v.constexprs)))
    src = ASTSource(fn=fn, signature=signature, constexprs=v.constexprs)
    target = GPUTarget("cuda", arch, 32)
    options = triton.compiler.make_backend(target).parse_options({"num_warps": v.num_warps}).__dict__
    k = triton.compile(src, target=target, options=options)
    if getattr(k.metadata, "global_scratch_size", 0) or getattr(k.metadata, "profile_scratch_size", 0):
        raise RuntimeError(f"{v.key}: kernels needing Triton scratch memory cannot be launched by the plugins")
    entry = k.metadata.name
    return Compiled(v, arch, entry, k.asm["cubin"], ptx_param_count(k.asm["ptx"], entry), k.metadata.shared, v.num_warps)


def ptx_param_count(ptx: str, entry: str) -> int:
    """Parameters of `.entry <entry>(...)` in PTX (Triton appends scratch pointers to our args)."""
    m = re.search(r"\.entry\s+" + re.escape(entry) + r"\s*\((.*?)\)", ptx, re.S)
    if m is None:
        raise ValueError(f"no .entry {entry} in the PTX")
    return len(re.findall(r"\.param\s", m.group(1)))


def render_header(compiled: list[Compiled]) -> str:
    lines = [
        "// Generated by `python -m dflash_trt.kernels.aot`: Triton cubins for the dflash TensorRT plugins. Do not edit.",
        "#pragma once",
        "#include <cstddef>",
        "",
    ]
    from .block_attention_kernel import BLOCK_N
    from .plugin_spec import TARGET_PROGRAMS

    for kind, fmt in KEY_FORMATS.items():
        lines.append(f'#define DFLASH_KEY_{kind.upper()} "{fmt}"')
    # the block-attention launch rules of block_attention.py, for the C++ launcher
    lines += [f"#define DFLASH_BLOCK_N {BLOCK_N}", f"#define DFLASH_TARGET_PROGRAMS {TARGET_PROGRAMS}"]
    lines += ["", "struct DFlashCubin", "{", "    char const* key;", "    int sm;", "    char const* entry;",
              "    unsigned char const* data;", "    size_t size;", "    int numParams;", "    int shared;", "    int numWarps;", "};", ""]
    for i, c in enumerate(compiled):
        body = ",".join(str(b) for b in c.cubin)
        lines.append(f"static unsigned char const kDFlashCubin{i}[] = {{{body}}};")
    lines += ["", "static DFlashCubin const kDFlashCubins[] = {"]
    for i, c in enumerate(compiled):
        lines.append(f'    {{"{c.variant.key}", {c.arch}, "{c.entry}", kDFlashCubin{i}, sizeof(kDFlashCubin{i}), {c.num_params}, {c.shared}, {c.num_warps}}},')
    lines += ["};", f"static int const kDFlashNumCubins = {len(compiled)};", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--shape", action="append", help="L,nh,nkv,hd,max_q of a drafter (default: Qwen3-8B's 5,32,8,128,16)")
    parser.add_argument("--archs", default=",".join(map(str, TARGET_ARCHS)))
    parser.add_argument("--acts", default="bf16,fp16", help="activation dtypes")
    parser.add_argument("--no-fp8", action="store_true")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):  # kernels are decorated at import: re-run clean
        env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
        os.execve(sys.executable, [sys.executable, "-m", "dflash_trt.kernels.aot", *(argv or sys.argv[1:])], env)
    shapes = [tuple(int(x) for x in s.split(",")) for s in args.shape] if args.shape else [QWEN3_8B_DRAFTER]
    variants = {}
    for shape in shapes:
        for v in variants_for(shape, tuple(args.acts.split(",")), fp8=not args.no_fp8):
            variants[v.key] = v
    compiled = [compile_variant(v, int(a)) for v in variants.values() for a in args.archs.split(",")]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(render_header(compiled))
    for c in compiled:
        print(f"sm_{c.arch} {c.variant.key}: {len(c.cubin)} B, {c.num_params} params, {c.shared} B shared")
    return 0


if __name__ == "__main__":
    sys.exit(main())
