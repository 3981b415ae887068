"""Measure what the planner's CPU validation needs (issue 18, validation (a)), on this machine, in one run:

1. the fit set: `calibrate`'s step timings (draft + verify + commit, draft_length.measure_step) at a few
   (batch, drafts, context) cells, for the target alone and with the DFlash drafter;
2. the prediction set: real decoding runs at batch 1, 2, 4, 8 and 16 (one wave of that many requests, greedy,
   `ignore_eos` so the batch stays full), AR and DFlash, with each run's decode tokens/s per user and in total,
   its acceptance histogram and its mean context length.

    python benchmarks/plan_measure.py --target $(dflash-trt fetch-models --quiet) \\
        --drafter examples/drafters/smollm2-dflash-b16 --out examples/plan/cpu-measured.json

`dflash-trt plan --validate-cpu examples/plan/cpu-measured.json` (and tests/test_plan.py) fits the cost model's
CPU parameters on (1) alone and predicts (2).
"""

from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import asdict
from pathlib import Path

import torch

from dflash_trt.draft_length import measure_step
from dflash_trt.kv_cache import pool_pages
from dflash_trt.loading import DTYPES, encode_prompt, load_drafter, load_target, load_tokenizer
from dflash_trt.presets import drafter_shape, target_shape
from dflash_trt.progress import progress_bar
from dflash_trt.prompts import load_eval_prompts
from dflash_trt.runtime import Generator
from dflash_trt.sampling import SamplingParams
from dflash_trt.torch_backend import TorchBackend

FIT_CELLS = [(b, k, c) for c in (48, 192) for b in (1, 4, 16) for k in (0, 15)]  # (batch, drafts, context)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", required=True)
    p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    p.add_argument("--batches", default="1,2,4,8,16")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    batches = [int(b) for b in args.batches.split(",")]
    tok = load_tokenizer(args.target)
    target = load_target(args.target, dtype=DTYPES[args.dtype])
    drafter = load_drafter(args.drafter, target.cfg, dtype=DTYPES[args.dtype])
    texts = [p.text for d in ("code", "math") for p in load_eval_prompts(d, limit=8)]
    prompts = [encode_prompt(tok, t, chat=True) for t in texts]
    pages = pool_pages(max(batches), max(len(q) for q in prompts) + args.max_new_tokens + 200, 16, drafter.cfg.block_size)
    backends = {"ar": TorchBackend(target, None, num_pages=pages), "dflash": TorchBackend(target, drafter, num_pages=pages)}
    bar = progress_bar(total=len(FIT_CELLS) + 2 * len(batches), desc="plan measurements", unit="run")
    fit = []
    for b, k, c in FIT_CELLS:
        backend = backends["dflash" if k else "ar"]
        fit.append({"batch": b, "drafts": k, "context": c, "seconds": measure_step(backend, b, k, context=c, reps=3)})
        bar.update()
    runs = []
    for b in batches:
        wave = (prompts * (1 + b // len(prompts)))[:b]
        for name, backend in backends.items():
            gen = Generator(backend, max_batch=b)
            start = time.perf_counter()
            outs = gen.generate(wave, SamplingParams(max_new_tokens=args.max_new_tokens, ignore_eos=True))
            wall = time.perf_counter() - start
            hist: dict[int, int] = {}
            for o in outs:
                for n, count in o.histogram().items():
                    hist[n] = hist.get(n, 0) + count
            decoded = sum(len(o.output_ids) - 1 for o in outs)
            runs.append({"method": name, "batch": b, "drafts": backend.max_drafts, "wall_s": round(wall, 3),
                         "per_user_tokens_per_s": sum(o.decode_tokens_per_s for o in outs) / len(outs),
                         "total_decode_tokens_per_s": decoded / max(o.decode_s for o in outs),
                         "mean_context": sum(len(q) for q in wave) / b + args.max_new_tokens / 2,
                         "acceptance_histogram": dict(sorted(hist.items()))})
            bar.update()
    bar.close()
    report = {"machine": {"cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads(), "torch": torch.__version__},
              "target": Path(args.target).name, "drafter": Path(args.drafter).name, "dtype": args.dtype,
              "target_shape": asdict(target_shape(target.cfg)), "drafter_shape": asdict(drafter_shape(drafter.cfg)),
              "max_new_tokens": args.max_new_tokens, "fit": fit, "runs": runs}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
