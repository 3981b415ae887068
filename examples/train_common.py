"""What both drafter trainers share: the data shards, the command line, the optimisation loop, the export."""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import time
from pathlib import Path
from typing import Callable

import torch
from safetensors.torch import load_file, save_file

from dflash_trt.checkpoint import atomic_directory
from dflash_trt.config import parse_drafter_config
from dflash_trt.models.layers import draft_vocab_head
from dflash_trt.loading import load_target


def load_shards(data_dir: Path) -> list[dict]:
    """[{tokens [L] long, features [L-1, F] bf16, prompt_len, domain}, ...] from every shard."""
    seqs = []
    for shard in sorted(Path(data_dir).glob("shard-*.safetensors")):
        tensors = load_file(str(shard))
        meta = json.loads(shard.with_suffix(".json").read_text())
        for k, m in enumerate(meta):
            seqs.append({"tokens": tensors[f"{k}.tokens"].long(), "features": tensors[f"{k}.features"], **m})
    return seqs


def common_args(description: str) -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--seqs-per-step", type=int, default=4)
    ap.add_argument("--epochs", type=float, default=2.0)
    ap.add_argument("--max-minutes", type=float, default=None, help="stop (and export) after this much training")
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--warmup", type=float, default=0.04)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--draft-vocab", type=int, default=8192, help="draft only from the N most frequent answer tokens (d2t); 0 = full vocabulary")
    ap.add_argument("--force", action="store_true")
    return ap


def load_inputs(args):
    """(data info, sequences, target model) for a trainer's arguments."""
    torch.set_num_threads(args.threads)
    info = json.loads((Path(args.data) / "info.json").read_text())
    return info, load_shards(Path(args.data)), load_target(args.target)


def build_drafter(cls, raw_cfg: dict, args, seqs: list[dict], architecture: str):
    """The untrained drafter for `raw_cfg` (the config.json it will be exported with), with its d2t.

    Returns (model, d2t or None, fraction of answer tokens the draft vocabulary covers)."""
    coverage, d2t = 1.0, None
    if args.draft_vocab:
        d2t, coverage = draft_vocab(seqs, args.draft_vocab, raw_cfg["vocab_size"])
        raw_cfg["draft_vocab_size"] = args.draft_vocab
    cfg = parse_drafter_config(raw_cfg, Path(args.out) / "config.json", architecture)
    model = cls(cfg, len(cfg.target_layer_ids) * cfg.hidden_size)
    if d2t is not None:
        model.d2t.copy_(d2t)
    return model, d2t, coverage


def training_head(lm_head: torch.Tensor, d2t: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(lm_head rows the drafter proposes from, target id → row or -1). Training over the draft
    vocabulary only (as EAGLE-3 does) is what drafting uses, and is ~6x cheaper than the full head."""
    head, ids = draft_vocab_head(lm_head, d2t)
    t2d = torch.arange(lm_head.shape[0])
    if ids is not None:
        t2d = torch.full((lm_head.shape[0],), -1, dtype=torch.long)
        t2d[ids] = torch.arange(len(ids))
    return head, t2d


def draft_vocab(seqs: list[dict], size: int, vocab_size: int) -> tuple[torch.Tensor, float]:
    """EAGLE-3's d2t for the `size` most frequent answer tokens (draft id i → target id i + d2t[i]),
    and the fraction of answer tokens they cover."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in seqs:
        counts += torch.bincount(s["tokens"][s["prompt_len"]:], minlength=vocab_size)
    ids = counts.topk(size).indices.sort().values
    return ids - torch.arange(size), float(counts[ids].sum() / counts.sum())


def fit(model: torch.nn.Module, loss_fn: Callable, seqs: list[dict], args, name: str) -> dict:
    """AdamW, linear warmup + cosine decay, grad clip 1, bf16 autocast. loss_fn(seq, rng) → (loss, acc) or None."""
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    n_params = sum(p.numel() for p in params)
    steps = max(1, int(args.epochs * len(seqs) / args.seqs_per_step))
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    warm = max(1, int(args.warmup * steps))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    print(f"{name}: {n_params / 1e6:.2f}M params, {len(seqs)} sequences, {steps} steps planned", file=sys.stderr)
    order: list[int] = []
    start, log, ema, done = time.time(), [], None, 0
    for step in range(steps):
        if args.max_minutes is not None and time.time() - start > args.max_minutes * 60:
            break
        opt.zero_grad()
        total, accs = 0.0, []
        for _ in range(args.seqs_per_step):
            if not order:
                order = list(range(len(seqs)))
                rng.shuffle(order)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                res = loss_fn(seqs[order.pop()], rng)
            if res is None:
                continue
            loss, acc = res
            (loss / args.seqs_per_step).backward()
            total += loss.item() / args.seqs_per_step
            accs.append(acc)
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        done = step + 1
        ema = total if ema is None else 0.98 * ema + 0.02 * total
        if step % 25 == 0 or step == steps - 1:
            row = {"step": step, "loss": round(total, 4), "loss_ema": round(ema, 4), "acc_first": round(sum(accs) / max(1, len(accs)), 3),
                   "lr": round(sched.get_last_lr()[0], 7), "elapsed_s": round(time.time() - start, 1)}
            log.append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    model.eval()
    return {"steps": done, "planned_steps": steps, "wall_s": time.time() - start, "loss_ema": ema, "log": log, "n_params": n_params}


def model_card(title: str, script: str, info: dict, run: dict, args, details: list[str]) -> str:
    lines = [
        f"# {title}", "",
        f"Trained by `examples/{script}` on target-generated data: {info['sequences']} sequences, {info['generated_tokens']} answer tokens, "
        f"prompt mix {info['mix']} (greedy, {info.get('dtype', 'fp32')}, max {info['max_new_tokens']} new tokens), features at target layers {info['layer_ids']}.",
        "",
        *[f"- {d}" for d in details],
        f"- {run['n_params'] / 1e6:.2f}M parameters ({run['n_params'] * 2 / 2**20:.1f} MiB in bf16)",
        f"- {run['steps']} steps (of {run['planned_steps']} planned) x {args.seqs_per_step} sequences, lr {args.lr}, warmup {args.warmup}, cosine, AdamW, bf16 autocast",
        f"- wall time {run['wall_s'] / 60:.1f} min on 2 CPU cores; final loss (EMA) {run['loss_ema']:.3f}",
        "", "Training log:", "", "```", *[json.dumps(r) for r in run["log"]], "```", "",
    ]
    return "\n".join(lines)


def finish(model: torch.nn.Module, raw_cfg: dict, args, info: dict, run: dict, title: str, script: str, details: list[str], coverage: float) -> dict:
    """Write the model card and export; returns `run` (the training record).

    `coverage`: the fraction of answer tokens the draft vocabulary holds (from build_drafter)."""
    details = details + [f"draft vocabulary: {args.draft_vocab or 'all'} tokens (d2t), covering {coverage:.1%} of answer tokens"]
    export(model, raw_cfg, Path(args.out), model_card(title, script, info, run, args, details), args.force)
    print(f"wrote {args.out} after {run['wall_s'] / 60:.1f} min", file=sys.stderr)
    return run


def export(model: torch.nn.Module, raw_cfg: dict, out: Path, card: str, force: bool) -> None:
    """config.json + bf16 model.safetensors + README.md, written atomically."""
    with atomic_directory(out, force=force) as tmp:
        (tmp / "config.json").write_text(json.dumps(raw_cfg, indent=2) + "\n")
        state = {k: (v.detach().to(torch.bfloat16) if v.is_floating_point() else v.detach()).contiguous() for k, v in model.state_dict().items()}
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "README.md").write_text(card)
