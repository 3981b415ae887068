"""`python -m dflash_trt.trtllm.emulation_check (--target DIR --drafter DIR | --checkpoint DIR)`: the engine contract's
CPU emulation on real models (the shipped SmolLM2 pair in scripts/gpu_engine_check.sh --dry-run) against the reference
runtime. With `--checkpoint`, both models come from the one-engine checkpoint (`dflash-trt convert --format engine`,
what trtllm-build reads), and the KV pool has the layer count the C++ runtime gives it: `num_hidden_layers` +
`eagle_net_config.num_hidden_layers` of that config.json (docs/engine-path.md).

Prints whether the emulated executor + engine give the reference loop's tokens and drafts, and τ; exit 1 if not.
With `--engine DIR` (a GPU machine with TensorRT-LLM 1.2.x: scripts/gpu_engine_check.sh), the built DFlashForCausalLM
engine behind the real executor (executor.EngineGenerator) runs the same prompts, and its tokens are compared too.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from ..kv_cache import pool_pages
from ..loading import encode_prompt, generation_eos_ids, load_drafter, load_target, load_tokenizer
from ..runtime import Generator
from ..sampling import SamplingParams
from ..torch_backend import TorchBackend
from .emulation import DFlashEngine, EagleRuntime, KVBlockPool

PAGE_SIZE = 16  # tokens per KV page, in the reference backend's pool and the emulated block pool alike

PROMPTS = ("Write a Python function that reverses a string.", "What is 17 * 23? Explain briefly.", "Name three uses of a hash map.")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", help="Hugging Face target directory (with --drafter)")
    ap.add_argument("--drafter", help="DFlash drafter directory")
    ap.add_argument("--checkpoint", help="instead: the one-engine checkpoint (convert --format engine), holding both and the tokenizer")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--engine", help="also run this built engine through TensorRT-LLM's executor and compare its tokens")
    args = ap.parse_args(argv)
    if bool(args.checkpoint) == bool(args.target and args.drafter):
        ap.error("pass --target and --drafter, or --checkpoint")
    torch.set_num_threads(args.threads)

    target_dir = drafter_dir = args.checkpoint
    if not args.checkpoint:
        target_dir, drafter_dir = args.target, args.drafter
    tok = load_tokenizer(target_dir)
    prompts = [encode_prompt(tok, p, chat=True) for p in PROMPTS]
    eos = sorted(generation_eos_ids(target_dir, tok))
    target = load_target(target_dir)
    drafter = load_drafter(drafter_dir, target.cfg)
    K = drafter.cfg.block_size - 1

    pages = pool_pages(len(prompts), max(map(len, prompts)) + args.max_new_tokens, PAGE_SIZE, drafter.cfg.block_size)
    backend = TorchBackend(target, drafter, num_pages=pages, page_size=PAGE_SIZE)
    ref_drafts: dict[int, list[list[int]]] = {i: [] for i in range(len(prompts))}
    real_draft = backend.draft

    def recording_draft(seq_ids, last_tokens, num_drafts):
        out = real_draft(seq_ids, last_tokens, num_drafts)
        for s, d in zip(seq_ids, out):
            ref_drafts[s].append(d)
        return out

    backend.draft = recording_draft
    start = time.perf_counter()
    ref = Generator(backend, eos_token_ids=eos, max_batch=len(prompts)).generate(prompts, SamplingParams(max_new_tokens=args.max_new_tokens))
    ref_s = time.perf_counter() - start

    layers = target.cfg.num_layers + drafter.cfg.num_layers
    if args.checkpoint:  # the pool's layers as the C++ runtime reads them from the engine's config (gptJsonConfig, Eagle)
        raw = json.loads((Path(args.checkpoint) / "config.json").read_text())
        layers = raw["num_hidden_layers"] + raw["eagle_net_config"]["num_hidden_layers"]
    # the executor sizes its pool from free GPU memory, not per request: a generous fixed pool stands for it
    pool = KVBlockPool(512, layers, target.cfg.num_kv_heads, PAGE_SIZE, target.cfg.head_dim)
    runtime = EagleRuntime(DFlashEngine(target, drafter, pool), max_batch=len(prompts))
    ids = [runtime.enqueue_request(p, args.max_new_tokens, end_ids=eos) for p in prompts]
    start = time.perf_counter()
    done = runtime.run()
    emu_s = time.perf_counter() - start
    emu = [done[i] for i in ids]

    same_tokens = [e.output_ids for e in emu] == [r.output_ids for r in ref]
    same_drafts = all(e.drafts_fed[: len(full)] == full for e, full in ((e, [d for d in ref_drafts[i] if len(d) == K]) for i, e in enumerate(emu)))
    steps = [n for e in emu for n in e.accepted_lengths]
    print(f"engine contract emulation on {args.checkpoint or args.target + ' + ' + args.drafter} (fp32, {len(prompts)} prompts, {args.max_new_tokens} tokens):")
    print(f"  tokens equal to the reference runtime: {same_tokens}; drafts equal: {same_drafts}")
    print(f"  tau = {sum(steps) / len(steps):.2f} tokens/step over {len(steps)} steps; reference {ref_s:.1f} s, emulation {emu_s:.1f} s (CPU, not a speed figure)")
    ok = same_tokens and same_drafts
    if args.engine:
        from .executor import EngineGenerator

        engine = EngineGenerator(args.engine, max_batch=len(prompts))
        try:
            outs = engine.generate(prompts, SamplingParams(max_new_tokens=args.max_new_tokens), eos)
        finally:
            engine.shutdown()
        equal = sum(o.output_ids == r.output_ids for o, r in zip(outs, ref))
        print(f"  engine {args.engine} behind the executor: {equal}/{len(prompts)} outputs equal to the reference runtime's")
        ok = ok and equal == len(prompts)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
