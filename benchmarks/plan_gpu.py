"""The planner's cost model against a real GPU (issue 18): step times of the PyTorch backend on CUDA for a
Llama-3.1-8B-shaped target with z-lab's 5-layer DFlash drafter (random bf16 weights: the time does not depend on
the values), AR and DFlash at several (batch, drafts, context).

    python benchmarks/plan_gpu.py --out DIR          # on the lent H200 (benchmarks/gpu_kernels.sh runs it)
    python benchmarks/plan_gpu.py --dry-run --out DIR  # CPU: tiny shapes, to check the script

Writes DIR/plan-gpu.json in benchmarks/plan_measure.py's layout ("fit" cells, shapes), so
`dflash-trt plan --validate-cpu` style fitting works on it, plus the cost model's prediction for the same cells
from the H200 preset (spec-sheet bandwidth × 0.8, no fitting): what the memory roofline says against what eager
PyTorch (no CUDA graphs: one launch per op) reaches.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path

import torch

from dflash_trt.config import check_pair, parse_drafter_config, parse_target_config
from dflash_trt.cost_model import Quant
from dflash_trt.draft_length import measure_step
from dflash_trt.kv_cache import pool_pages
from dflash_trt.models.drafter import DFlashDrafter
from dflash_trt.models.target import TargetModel
from dflash_trt.plan import step_cost
from dflash_trt.presets import HARDWARE, drafter_shape, target_shape
from dflash_trt.torch_backend import TorchBackend

LLAMA_8B = dict(architectures=["LlamaForCausalLM"], hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=128256, rms_norm_eps=1e-5,
                rope_theta=500000.0, max_position_embeddings=131072, eos_token_id=128001)
DRAFTER = dict(architectures=["DFlashDraftModel"], block_size=16, dflash_config={"mask_token_id": 128002, "target_layer_ids": [1, 8, 15, 22, 29]},
               num_target_layers=32, hidden_size=4096, intermediate_size=12288, num_hidden_layers=5, num_attention_heads=32,
               num_key_value_heads=8, head_dim=128, vocab_size=128256, rms_norm_eps=1e-5, rope_theta=500000.0,
               max_position_embeddings=131072, layer_types=["full_attention"] * 5)
TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512)


def random_module(build, device: str, dtype: torch.dtype):
    """`build()` with N(0, 0.02) matrices and unit norms, made on the device (no host copy of 16 GB)."""
    with torch.device("meta"):
        model = build()
    model = model.to_empty(device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.02, generator=gen)
            else:
                p.fill_(1.0)
    model = model.to(dtype)
    for m in model.modules():  # the rotary tables were made on meta: rebuild them (on the host), then move them
        if hasattr(m, "reset_buffers"):
            m.reset_buffers()
    return model.to(device).eval().requires_grad_(False)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--dry-run", action="store_true")
    args = p.parse_args()
    device = "cpu" if args.dry_run else "cuda"
    t_raw, d_raw = dict(LLAMA_8B), dict(DRAFTER)
    if args.dry_run:
        t_raw.update(TINY, num_hidden_layers=4, eos_token_id=1)
        d_raw.update(TINY, num_hidden_layers=2, num_target_layers=4, layer_types=["full_attention"] * 2,
                     dflash_config={"mask_token_id": 2, "target_layer_ids": [1, 2]})
    t_cfg = parse_target_config(t_raw, "llama-3.1-8b-shaped/config.json")
    d_cfg = check_pair(t_cfg, parse_drafter_config(d_raw, "dflash-5-layer/config.json"))
    start = time.perf_counter()
    target = random_module(lambda: TargetModel(t_cfg), device, torch.bfloat16)
    drafter = random_module(lambda: DFlashDrafter(d_cfg, len(d_cfg.target_layer_ids) * t_cfg.hidden_size), device, torch.bfloat16)
    drafter.fuse_context_projections()
    print(f"random models on {device} in {time.perf_counter() - start:.1f} s", flush=True)
    cells = [(b, k, c) for c in (256, 1024) for b in (1, 8, 32) for k in (0, 3, 9, 15)]
    if args.dry_run:
        cells = [(b, k, c) for c in (16,) for b in (1, 2) for k in (0, 3)]
    pages = pool_pages(max(b for b, _, _ in cells), max(c for _, _, c in cells) + 64, 16, d_cfg.block_size)
    backends = {False: TorchBackend(target, None, num_pages=pages), True: TorchBackend(target, drafter, num_pages=pages)}
    hw, quant = HARDWARE["H200"], Quant()
    t_shape, d_shape = target_shape(t_cfg), drafter_shape(d_cfg)
    fit = []
    for b, k, c in cells:
        seconds = measure_step(backends[k > 0], b, k, context=c, reps=5)
        model = step_cost(t_shape, d_shape if k else None, hw, quant, b, k, c)
        fit.append({"batch": b, "drafts": k, "context": c, "seconds": seconds, "h200_preset_seconds": model.seconds,
                    "memory_floor_seconds": model.memory_s})
        print(f"batch {b:3d} drafts {k:2d} context {c:5d}: {seconds * 1e3:8.2f} ms measured, preset model {model.seconds * 1e3:7.2f} ms "
              f"(memory floor {model.memory_s * 1e3:6.2f} ms, compute {model.compute_s * 1e3:6.2f} ms)", flush=True)
    report = {"machine": {"device": torch.cuda.get_device_name() if device == "cuda" else "cpu (dry run)", "torch": torch.__version__},
              "target": "Llama-3.1-8B-shaped (random bf16)", "drafter": "z-lab-shaped DFlash, 5 layers (random bf16)", "dtype": "bf16",
              "target_shape": asdict(t_shape), "drafter_shape": asdict(d_shape), "fit": fit, "runs": []}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "plan-gpu.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out / 'plan-gpu.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
