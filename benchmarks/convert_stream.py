"""Converter streaming benchmark (not a test): a synthetic Llama (or gpt-oss, MXFP4 experts) checkpoint, converted in each
quant mode in a fresh process; prints peak RSS against the goal (2 x largest tensor + 1 GiB) and MB/s
against two plain copies of the same file measured in the same run: in the kernel (sendfile) and through
user space (read + write), since a converter must bring every byte into user space.

    python benchmarks/convert_stream.py --workdir /tmp/convert-bench [--layers 9] [--modes none,fp8,nvfp4]

Calibration is not part of this measurement: the synthetic model gets fixed activation amax values
(the converter's `amax=` argument), so the figures are the streaming path alone.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

import torch

CONFIG = dict(
    architectures=["LlamaForCausalLM"], hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
    vocab_size=32000, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192, hidden_act="silu",
    tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16",
)


def make_checkpoint(directory: Path, layers: int) -> int:
    """Write the synthetic checkpoint tensor by tensor (bounded memory); returns its size in bytes."""
    from dflash_trt.safetensors_io import SafetensorsWriter

    directory.mkdir(parents=True, exist_ok=True)
    cfg = dict(CONFIG, num_hidden_layers=layers)
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    H, I, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = H // cfg["num_attention_heads"]
    kv = cfg["num_key_value_heads"] * hd
    shapes = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,), "lm_head.weight": (V, H)}
    for i in range(layers):
        p = f"model.layers.{i}"
        shapes.update({
            f"{p}.input_layernorm.weight": (H,), f"{p}.post_attention_layernorm.weight": (H,),
            f"{p}.self_attn.q_proj.weight": (H, H), f"{p}.self_attn.k_proj.weight": (kv, H), f"{p}.self_attn.v_proj.weight": (kv, H),
            f"{p}.self_attn.o_proj.weight": (H, H), f"{p}.mlp.gate_proj.weight": (I, H), f"{p}.mlp.up_proj.weight": (I, H),
            f"{p}.mlp.down_proj.weight": (H, I),
        })
    writer = SafetensorsWriter(directory / "model.safetensors", {n: (torch.bfloat16, s) for n, s in shapes.items()})
    gen = torch.Generator().manual_seed(0)
    for name, shape in shapes.items():
        rows = shape[0]
        step = max(1, (32 << 20) // (4 * (shape[1] if len(shape) > 1 else 1)))
        for a in range(0, rows, step):
            b = min(rows, a + step)
            if len(shape) == 1:
                t = 1 + 0.1 * torch.randn(b - a, generator=gen)
            else:
                t = 0.02 * torch.randn(b - a, shape[1], generator=gen)
            writer.write_rows(name, a, t.to(torch.bfloat16))
    writer.finish()
    return (directory / "model.safetensors").stat().st_size


GPT_OSS = dict(
    architectures=["GptOssForCausalLM"], hidden_size=2880, intermediate_size=2880, num_attention_heads=64, num_key_value_heads=8,
    head_dim=64, num_local_experts=32, num_experts_per_tok=4, vocab_size=32000, rms_norm_eps=1e-5, sliding_window=128,
    rope_scaling={"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "original_max_position_embeddings": 4096,
                  "truncate": False},
    rope_theta=150000.0, max_position_embeddings=131072, attention_bias=True, tie_word_embeddings=False, bos_token_id=1,
    eos_token_id=2, torch_dtype="bfloat16", quantization_config={"quant_method": "mxfp4"},
)


def make_gpt_oss_checkpoint(directory: Path, layers: int) -> int:
    """gpt-oss-20b's layer shapes (32 experts of 2880, 64 / 8 heads of 64) with a 32K vocabulary, experts in the released
    MXFP4 layout (`*_blocks` + `*_scales`, random codes, e8m0 scales near 2^-6); written tensor by tensor."""
    from dflash_trt.safetensors_io import SafetensorsWriter

    directory.mkdir(parents=True, exist_ok=True)
    cfg = dict(GPT_OSS, num_hidden_layers=layers)
    (directory / "config.json").write_text(json.dumps(cfg, indent=2))
    H, I, E, V = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_local_experts"], cfg["vocab_size"]
    q, kv = cfg["num_attention_heads"] * cfg["head_dim"], cfg["num_key_value_heads"] * cfg["head_dim"]
    shapes = {"model.embed_tokens.weight": (torch.bfloat16, (V, H)), "model.norm.weight": (torch.bfloat16, (H,)),
              "lm_head.weight": (torch.bfloat16, (V, H))}
    for i in range(layers):
        p = f"model.layers.{i}"
        a, m = f"{p}.self_attn", f"{p}.mlp"
        shapes.update({f"{p}.input_layernorm.weight": (torch.bfloat16, (H,)), f"{p}.post_attention_layernorm.weight": (torch.bfloat16, (H,)),
                       f"{a}.q_proj.weight": (torch.bfloat16, (q, H)), f"{a}.q_proj.bias": (torch.bfloat16, (q,)),
                       f"{a}.k_proj.weight": (torch.bfloat16, (kv, H)), f"{a}.k_proj.bias": (torch.bfloat16, (kv,)),
                       f"{a}.v_proj.weight": (torch.bfloat16, (kv, H)), f"{a}.v_proj.bias": (torch.bfloat16, (kv,)),
                       f"{a}.o_proj.weight": (torch.bfloat16, (H, q)), f"{a}.o_proj.bias": (torch.bfloat16, (H,)),
                       f"{a}.sinks": (torch.bfloat16, (cfg["num_attention_heads"],)),
                       f"{m}.router.weight": (torch.bfloat16, (E, H)), f"{m}.router.bias": (torch.bfloat16, (E,)),
                       f"{m}.experts.gate_up_proj_blocks": (torch.uint8, (E, 2 * I, H // 32, 16)),
                       f"{m}.experts.gate_up_proj_scales": (torch.uint8, (E, 2 * I, H // 32)),
                       f"{m}.experts.gate_up_proj_bias": (torch.bfloat16, (E, 2 * I)),
                       f"{m}.experts.down_proj_blocks": (torch.uint8, (E, H, I // 32, 16)),
                       f"{m}.experts.down_proj_scales": (torch.uint8, (E, H, I // 32)),
                       f"{m}.experts.down_proj_bias": (torch.bfloat16, (E, H))})
    writer = SafetensorsWriter(directory / "model.safetensors", dict(shapes))
    gen = torch.Generator().manual_seed(0)
    for name, (dtype, shape) in shapes.items():
        row = math.prod(shape[1:]) if len(shape) > 1 else 1
        step = max(1, (32 << 20) // (4 * row))
        for a in range(0, shape[0], step):
            n = min(shape[0], a + step) - a
            if dtype == torch.uint8 and name.endswith("_scales"):
                t = torch.randint(118, 124, (n, *shape[1:]), dtype=torch.uint8, generator=gen)
            elif dtype == torch.uint8:
                t = torch.randint(0, 256, (n, *shape[1:]), dtype=torch.uint8, generator=gen)
            elif name.endswith("norm.weight"):
                t = (1 + 0.1 * torch.randn(n, generator=gen)).to(dtype)
            else:
                t = (0.02 * torch.randn(n, *shape[1:], generator=gen)).to(dtype)
            writer.write_rows(name, a, t)
    writer.finish()
    return (directory / "model.safetensors").stat().st_size


def largest_tensor(directory: Path) -> int:
    from dflash_trt.safetensors_io import SafetensorsFile

    f = SafetensorsFile(directory / "model.safetensors")
    return max(i.end - i.start for i in f.tensors.values())


def child(src: str, out: str, quant: str, tp: int, threads: int) -> None:
    """One conversion in this process; prints a JSON line with seconds, bytes and peak RSS."""
    from dflash_trt.config import load_target_config
    from dflash_trt.convert import convert

    torch.set_num_threads(threads)
    cfg = load_target_config(src)
    linears = ("mlp.experts.up", "mlp.experts.gate", "mlp.experts.down") if cfg.num_experts else ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    names = {f"model.layers.{i}.{m}": 4.0 for i in range(cfg.num_layers)
             for m in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", *linears)}
    names.update({f"layers.{i}.{k}_cache": 8.0 for i in range(cfg.num_layers) for k in ("k", "v")})
    stats = convert(src, None, out, dtype="bf16", quant=quant, kv_cache_quant="fp8" if quant != "none" else "none", tp=tp,
                    amax={"target": names}, progress=False, log=lambda m: None)
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(json.dumps({"seconds": stats.seconds, "read": stats.bytes_read, "written": stats.bytes_written, "peak_rss": rss}))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workdir", default="/tmp/convert-bench")
    ap.add_argument("--arch", choices=("llama", "gpt-oss"), default="llama",
                    help="llama: Llama-3-8B layers in bf16; gpt-oss: gpt-oss-20b layers, experts in MXFP4")
    ap.add_argument("--layers", type=int, default=9, help="9 layers of Llama-3-8B shape = 4.45 GB in bf16; 8 of gpt-oss-20b = 3.9 GB")
    ap.add_argument("--modes", default="none,fp8,nvfp4")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--keep", action="store_true", help="keep the synthetic checkpoint for the next run")
    ap.add_argument("--child", nargs=4, metavar=("SRC", "OUT", "QUANT", "TP"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        child(args.child[0], args.child[1], args.child[2], int(args.child[3]), args.threads)
        return
    work = Path(args.workdir)
    src = work / "synthetic"
    if not (src / "model.safetensors").is_file():
        t = time.perf_counter()
        size = (make_gpt_oss_checkpoint if args.arch == "gpt-oss" else make_checkpoint)(src, args.layers)
        print(f"synthetic checkpoint: {size / 1e9:.2f} GB in {time.perf_counter() - t:.0f}s", flush=True)
    size = (src / "model.safetensors").stat().st_size
    big = largest_tensor(src)
    goal_rss = 2 * big + (1 << 30)

    def copy_rate(in_kernel: bool) -> float:
        """MB/s of copying the source file: in the kernel (shutil.copyfile: sendfile, no user-space buffer), or
        through user space in 64 MiB reads and writes (what any program that looks at the bytes pays)."""
        dst = work / "copy.safetensors"
        t = time.perf_counter()
        if in_kernel:
            shutil.copyfile(src / "model.safetensors", dst)
        else:
            with open(src / "model.safetensors", "rb") as f, open(dst, "wb") as g:
                while chunk := f.read(64 << 20):
                    g.write(chunk)
        os.sync()
        s = time.perf_counter() - t
        dst.unlink()
        return size / s / 1e6

    print(f"source {size / 1e9:.2f} GB, largest tensor {big / 1e6:.0f} MB, RSS goal {goal_rss / 2**30:.2f} GiB, threads {args.threads}")
    print("| mode | tp | seconds | MB/s | copy MB/s (kernel) | ratio | copy MB/s (read+write) | ratio | peak RSS GiB | RSS goal met | written GB |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    results = []
    for quant in args.modes.split(","):
        copy, user_copy = copy_rate(in_kernel=True), copy_rate(in_kernel=False)
        out = work / f"out-{quant}"
        shutil.rmtree(out, ignore_errors=True)
        t = time.perf_counter()
        proc = subprocess.run([sys.executable, __file__, "--threads", str(args.threads), "--child", str(src), str(out), quant, str(args.tp)],
                              capture_output=True, text=True)
        if proc.returncode:
            sys.exit(proc.stderr)
        os.sync()
        wall = time.perf_counter() - t
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        rate = size / wall / 1e6
        row = dict(mode=quant, tp=args.tp, seconds=wall, mb_s=rate, copy_mb_s=copy, ratio=rate / copy, user_copy_mb_s=user_copy,
                   user_ratio=rate / user_copy, peak_rss=r["peak_rss"], goal=goal_rss, written=r["written"])
        results.append(row)
        print(f"| {quant} | {args.tp} | {wall:.1f} | {rate:.0f} | {copy:.0f} | {rate / copy:.2f} | {user_copy:.0f} | {rate / user_copy:.2f} | "
              f"{r['peak_rss'] / 2**30:.2f} | "
              f"{'yes' if r['peak_rss'] <= goal_rss else 'NO'} | {r['written'] / 1e9:.2f} |", flush=True)
        shutil.rmtree(out, ignore_errors=True)
    (work / "results.json").write_text(json.dumps(results, indent=2))
    if not args.keep:
        shutil.rmtree(src)


if __name__ == "__main__":
    main()
