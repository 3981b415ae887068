"""What both drafter trainers share: the data shards, the command line, the optimisation loop, the export."""

from __future__ import annotations

import argparse
import hashlib
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
    ap.add_argument("--data", required=True, help="make_training_data's --out; several, comma-separated, train on all "
                                                    "of them (same target and layer ids)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seqs-per-step", type=int, default=4)
    ap.add_argument("--epochs", type=float, default=2.0)
    ap.add_argument("--max-minutes", type=float, default=None, help="stop (and export) after this much training")
    ap.add_argument("--lr", type=float, default=6e-4)
    ap.add_argument("--warmup", type=float, default=0.04)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--draft-vocab", type=int, default=8192, help="draft only from the N most frequent answer tokens (d2t); 0 = full vocabulary")
    ap.add_argument("--init-from", help="resume from this drafter directory (its config, d2t and weights): training goes on from a "
                    "shipped drafter, and its learning_curve.json, if any, continues")
    ap.add_argument("--optimizer", choices=["adamw", "muon"], default="adamw",
                    help="muon: torch.optim.Muon on the weight matrices (momentum 0.95, weight decay 0.1, RMS matched to AdamW) and "
                         "AdamW (weight decay 0.01) on the rest, as speculators 0.9.0 trains DFlash")
    ap.add_argument("--schedule", choices=["cosine", "linear"], default="cosine", help="learning-rate decay after the warmup")
    ap.add_argument("--heldout", type=float, default=0.0, help="fraction of sequences held out of training for the learning curve, "
                    "chosen by a hash of the prompt id (the same ones in every run, whatever the data's size; 0: no curve)")
    ap.add_argument("--lineage-mix", default=None,
                    help="domain=count,... the prompt mix the --init-from drafter (and its ancestors) trained on, as its card "
                         "states: those prompts are never held out, so a resumed run's curve is measured on prompts its lineage never saw")
    ap.add_argument("--curve-data", default=None,
                    help="make_training_data --split eval output(s), comma-separated: the learning curve is measured on all their "
                         "sequences, per domain (the target's answers to the bench's own prompts, never trained on), beside --heldout's")
    ap.add_argument("--eval-every", type=float, default=5.0, help="minutes between held-out evaluations (each also writes a checkpoint)")
    ap.add_argument("--force", action="store_true")
    return ap


def lineage_prompts(mix: str | None) -> set[tuple[str, str]]:
    """(domain, prompt id) of every training prompt of a mix "domain=count,..." (prompts.load_train_mix, what
    make_training_data's --mix generates from)."""
    from dflash_trt.prompts import load_train_mix

    try:
        return {(p.domain, str(p.id)) for p in load_train_mix(mix or "")}
    except ValueError as e:
        raise SystemExit(f"--lineage-mix: {e}") from None


def split_heldout(seqs: list[dict], fraction: float, seen: set[tuple[str, str]] = frozenset()) -> tuple[list[dict], list[dict]]:
    """(training, held-out): a sequence is held out when a hash of its domain and prompt id falls under `fraction`, so
    the split never changes as data is added, and a resumed run never trains on what an earlier run held out.
    Prompts in `seen` (lineage_prompts: what the drafter a run resumes from trained on) are never held out."""
    def held(s: dict) -> bool:
        if (s.get("domain"), str(s.get("id"))) in seen:
            return False
        digest = hashlib.sha1(f"{s.get('domain')}/{s.get('id')}".encode()).digest()
        return int.from_bytes(digest[:8], "big") / 2**64 < fraction

    return [s for s in seqs if not held(s)], [s for s in seqs if held(s)]


def load_curve_data(dirs: str | None) -> list[dict]:
    """The sequences of --curve-data (make_training_data --split eval outputs; a training split is refused)."""
    seqs = []
    for d in [Path(x) for x in (dirs or "").split(",") if x.strip()]:
        if read_info(d).get("split", "train") != "eval":
            raise SystemExit(f"{d / 'info.json'}: split is not 'eval': --curve-data takes make_training_data --split eval outputs")
        seqs += load_shards(d)
    return seqs


def curve_evaluator(measure: Callable, heldout: list[dict], curve_seqs: list[dict]) -> Callable | None:
    """model → the learning curve's metrics. measure(model, seqs) → {"tau", "accept_rate", ...}. With --curve-data the
    headline `tau` / `accept_rate` are on those sequences (set "eval"), with `by_domain` τ and the hash held-out τ
    beside them (`heldout_tau`); without, on the held-out sequences (set "heldout"). None when there is neither."""
    if not heldout and not curve_seqs:
        return None

    def evaluate(model) -> dict:
        if not curve_seqs:
            return {"set": "heldout", **measure(model, heldout)}
        by_domain: dict[str, list[dict]] = {}
        for s in curve_seqs:
            by_domain.setdefault(s.get("domain", "?"), []).append(s)
        metrics = {"set": "eval", **measure(model, curve_seqs),
                   "by_domain": {d: measure(model, seqs)["tau"] for d, seqs in sorted(by_domain.items())}}
        if heldout:
            metrics["heldout_tau"] = measure(model, heldout)["tau"]
        return metrics

    return evaluate


def draft_coverage(seqs: list[dict], d2t: torch.Tensor | None, vocab_size: int) -> float:
    """The fraction of answer tokens a draft vocabulary (d2t) holds."""
    if d2t is None:
        return 1.0
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for s in seqs:
        counts += torch.bincount(s["tokens"][s["prompt_len"]:], minlength=vocab_size)
    return float(counts[torch.arange(len(d2t)) + d2t].sum() / counts.sum().clamp(min=1))


def previous_curve(init_from: str | None) -> list[dict]:
    """The learning curve of the drafter a run resumes from (empty for a fresh start)."""
    path = Path(init_from) / "learning_curve.json" if init_from else None
    return json.loads(path.read_text())["points"] if path is not None and path.is_file() else []


def load_inputs(args):
    """(data info, sequences, target model) for a trainer's arguments."""
    torch.set_num_threads(args.threads)
    info, seqs = merge_data([Path(d) for d in args.data.split(",") if d.strip()])
    return info, seqs, load_target(args.target)


def read_info(data_dir: Path) -> dict:
    """A make_training_data output's info.json, or one error naming it."""
    path = data_dir / "info.json"
    if not path.is_file():
        raise SystemExit(f"{path}: missing (is {data_dir} a make_training_data --out directory?)")
    return json.loads(path.read_text())


def merge_data(dirs: list[Path]) -> tuple[dict, list[dict]]:
    """(combined info, all sequences) of several make_training_data outputs, which must agree on the target's layer
    ids and generation settings (a sequence's features are only comparable then)."""
    seen: dict[Path, Path] = {}
    infos = []
    for d in dirs:
        if (real := d.resolve()) in seen:
            raise SystemExit(f"{d}: given twice in --data (as {seen[real]} too); each directory is read once, "
                             "or its sequences would count twice in training and in the held-out split")
        seen[real] = d
        infos.append(read_info(d))
        if infos[-1].get("split", "train") != "train":
            raise SystemExit(f"{d / 'info.json'}: split = {infos[-1]['split']!r}: evaluation prompts are never trained on (pass it as --curve-data)")
    first = infos[0]
    for d, info in zip(dirs[1:], infos[1:]):
        for key in ("layer_ids", "max_new_tokens"):
            if info.get(key) != first.get(key):
                raise SystemExit(f"{d / 'info.json'}: {key} = {info.get(key)!r}, {dirs[0] / 'info.json'} has {first.get(key)!r}; "
                                 "data sets trained on together must agree")
    seqs = [s for d in dirs for s in load_shards(d)]
    merged = dict(first, mix=",".join(i["mix"] for i in infos), sequences=sum(i["sequences"] for i in infos),
                  generated_tokens=sum(i["generated_tokens"] for i in infos))
    return merged, seqs


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


def _optimizers(model: torch.nn.Module, args) -> list[torch.optim.Optimizer]:
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    if args.optimizer == "adamw":
        return [torch.optim.AdamW([p for _, p in named], lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)]
    matrices = [p for _, p in named if p.dim() == 2]
    rest = [p for _, p in named if p.dim() != 2]
    opts: list[torch.optim.Optimizer] = [torch.optim.Muon(matrices, lr=args.lr, weight_decay=0.1, momentum=0.95, adjust_lr_fn="match_rms_adamw")]
    if rest:
        opts.append(torch.optim.AdamW(rest, lr=args.lr, betas=(0.9, 0.95), weight_decay=0.01))
    return opts


def fit(model: torch.nn.Module, loss_fn: Callable, seqs: list[dict], args, name: str, evaluate: Callable | None = None,
        checkpoint: Callable | None = None, curve: list[dict] | None = None) -> dict:
    """Warmup then cosine or linear decay, grad clip 1, bf16 autocast; AdamW, or Muon + AdamW (--optimizer).
    loss_fn(seq, rng) → (loss, acc) or None. With `evaluate` (model → metrics dict), the held-out metrics are
    measured at the start, every --eval-every minutes and at the end, appended to `curve` (a learning curve
    whose `train_tokens` go on from its last point), and `checkpoint(run)` is called after each."""
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    n_params = sum(p.numel() for p in params)
    steps = max(1, int(args.epochs * len(seqs) / args.seqs_per_step))
    opts = _optimizers(model, args)
    warm = max(1, int(args.warmup * steps))

    def factor(s: int) -> float:
        decay = 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)) if args.schedule == "cosine" else max(0.0, 1 - s / steps)
        return min(1.0, (s + 1) / warm) * decay

    scheds = [torch.optim.lr_scheduler.LambdaLR(o, factor) for o in opts]
    print(f"{name}: {n_params / 1e6:.2f}M params, {len(seqs)} sequences, {steps} steps planned ({args.optimizer}, {args.schedule})", file=sys.stderr)
    curve = curve if curve is not None else []
    tokens0 = curve[-1]["train_tokens"] if curve else 0
    run = {"steps": 0, "planned_steps": steps, "wall_s": 0.0, "loss_ema": None, "log": [], "n_params": n_params, "curve": curve,
           "train_tokens": 0}

    def measure(step: int) -> None:
        if evaluate is None:
            return
        model.eval()
        with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
            metrics = evaluate(model)
        model.train()
        point = {"train_tokens": tokens0 + run["train_tokens"], "step": step, "elapsed_s": round(time.time() - start, 1), **metrics}
        curve.append(point)
        print(json.dumps({"heldout": point}), file=sys.stderr, flush=True)
        if checkpoint is not None:
            checkpoint(run)

    order: list[int] = []
    start, ema = time.time(), None
    last_eval = start
    measure(0)  # the starting point (for a resumed drafter: itself, on this run's held-out set)
    for step in range(steps):
        if args.max_minutes is not None and time.time() - start > args.max_minutes * 60:
            break
        for o in opts:
            o.zero_grad()
        total, accs = 0.0, []
        for _ in range(args.seqs_per_step):
            if not order:
                order = list(range(len(seqs)))
                rng.shuffle(order)
            seq = seqs[order.pop()]
            with torch.autocast("cpu", dtype=torch.bfloat16):
                res = loss_fn(seq, rng)
            if res is None:
                continue
            loss, acc = res
            (loss / args.seqs_per_step).backward()
            total += loss.item() / args.seqs_per_step
            accs.append(acc)
            run["train_tokens"] += len(seq["tokens"]) - seq["prompt_len"]
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        for o, sc in zip(opts, scheds):
            o.step()
            sc.step()
        run["steps"] = step + 1
        ema = total if ema is None else 0.98 * ema + 0.02 * total
        run["loss_ema"], run["wall_s"] = ema, time.time() - start
        if step % 25 == 0 or step == steps - 1:
            row = {"step": step, "loss": round(total, 4), "loss_ema": round(ema, 4), "acc_first": round(sum(accs) / max(1, len(accs)), 3),
                   "lr": round(scheds[0].get_last_lr()[0], 7), "elapsed_s": round(time.time() - start, 1)}
            run["log"].append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
        if evaluate is not None and time.time() - last_eval > args.eval_every * 60:
            measure(step + 1)
            last_eval = time.time()
    if evaluate is not None and (not curve or curve[-1]["step"] != run["steps"]):
        measure(run["steps"])
    model.eval()
    run["wall_s"] = time.time() - start
    return run


def plot_curve(curve: list[dict], path: Path, title: str) -> bool:
    """Held-out τ (and slot-1 accuracy) against training tokens, as a PNG; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    ax2 = ax.twinx()
    for i, (label, points) in enumerate(curve_segments(curve)):
        x = [p["train_tokens"] / 1e6 for p in points]
        ax.plot(x, [p["tau"] for p in points], "o-", color=f"C{i}", label=f"τ, {label}")
        for j, d in enumerate(sorted(points[-1].get("by_domain", {}))):
            ax.plot(x, [p.get("by_domain", {}).get(d, float("nan")) for p in points], ":", marker=".", color=f"C{i + j + 1}", label=f"τ, {label}: {d}")
        ax2.plot(x, [p["accept_rate"][0] for p in points], "s--", color="gray", alpha=0.6, label=f"slot-1 acceptance, {label}" if i == 0 else None)
    ax.set_xlabel("training tokens (M, answer tokens seen)")
    ax.set_ylabel("τ (tokens per target step, teacher-forced)")
    ax2.set_ylabel("slot-1 acceptance")
    ax.set_title(title, fontsize=9)
    fig.legend(loc="lower right", fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def curve_segments(curve: list[dict]) -> list[tuple[str, list[dict]]]:
    """The curve cut where its measurement set changed (a resumed run measured on another held-out or eval set)."""
    segments: list[tuple[str, list[dict]]] = []
    for p in curve:
        label = "bench prompts (--curve-data)" if p.get("set") == "eval" else "held-out training prompts"
        if not segments or segments[-1][0] != label or (p["step"] == 0 and segments[-1][1]):
            segments.append((label, []))
        segments[-1][1].append(p)
    return segments


def curve_row(p: dict) -> str:
    """One learning-curve point as a row of the model card's table."""
    where = "bench prompts" if p.get("set") == "eval" else "held-out"
    domains = ", ".join(f"{d} {t:.2f}" for d, t in p.get("by_domain", {}).items())
    if "heldout_tau" in p:
        domains += f" (held-out {p['heldout_tau']:.2f})"
    return f"| {p['train_tokens']:,} | {p['step']} | {where} | {p['tau']:.3f} | {p['accept_rate'][0]:.3f} | {domains} |"


def model_card(title: str, script: str, info: dict, run: dict, args, details: list[str]) -> str:
    lines = [
        f"# {title}", "",
        f"Trained by `examples/{script}` on target-generated data: {info['sequences']} sequences, {info['generated_tokens']} answer tokens, "
        f"prompt mix {info['mix']} (greedy, {info.get('dtype', 'fp32')}, max {info['max_new_tokens']} new tokens), features at target layers {info['layer_ids']}.",
        "",
        *[f"- {d}" for d in details],
        f"- {run['n_params'] / 1e6:.2f}M parameters ({run['n_params'] * 2 / 2**20:.1f} MiB in bf16)",
        f"- {run['steps']} steps (of {run['planned_steps']} planned) x {args.seqs_per_step} sequences, lr {args.lr}, warmup {args.warmup}, "
        f"{args.schedule}, {'Muon + AdamW' if args.optimizer == 'muon' else 'AdamW'}, bf16 autocast"
        + (f", resumed from `{args.init_from}`" if args.init_from else ""),
        f"- wall time {run['wall_s'] / 60:.1f} min, {args.threads} CPU thread(s); final loss (EMA) "
        + (f"{run['loss_ema']:.3f}" if run["loss_ema"] is not None else "– (no step yet)"),
    ]
    if run.get("curve"):
        lines += ["", "Learning curve (`learning_curve.json`, `learning_curve.png`): τ teacher-forced at random anchors of the "
                  "target's own answers (what greedy decoding accepts from the same context), on held-out training prompts or, "
                  "with `--curve-data`, on the bench's evaluation prompts (never trained on; per domain), against answer tokens "
                  "trained on in this drafter's lineage:", "",
                  "| training tokens | step | measured on | τ | slot-1 acceptance | per domain |", "|---|---|---|---|---|---|"]
        lines += [curve_row(p) for p in run["curve"]]
    lines += ["", "Training log:", "", "```", *[json.dumps(r) for r in run["log"]], "```", ""]
    return "\n".join(lines)


def finish(model: torch.nn.Module, raw_cfg: dict, args, info: dict, run: dict, title: str, script: str, details: list[str], coverage: float) -> dict:
    """Write the model card and export; returns `run` (the training record).

    `coverage`: the fraction of answer tokens the draft vocabulary holds (from build_drafter)."""
    details = details + [f"draft vocabulary: {args.draft_vocab or 'all'} tokens (d2t), covering {coverage:.1%} of answer tokens"]
    export(model, raw_cfg, Path(args.out), model_card(title, script, info, run, args, details), args.force, run.get("curve"), title)
    print(f"wrote {args.out} after {run['wall_s'] / 60:.1f} min", file=sys.stderr)
    return run


def export(model: torch.nn.Module, raw_cfg: dict, out: Path, card: str, force: bool, curve: list[dict] | None = None, title: str = "") -> None:
    """config.json + bf16 model.safetensors + README.md (+ learning_curve.json / .png), written atomically."""
    with atomic_directory(out, force=force) as tmp:
        if curve:
            (tmp / "learning_curve.json").write_text(json.dumps({"points": curve}, indent=2) + "\n")
            plot_curve(curve, tmp / "learning_curve.png", title)
        (tmp / "config.json").write_text(json.dumps(raw_cfg, indent=2) + "\n")
        state = {k: (v.detach().to(torch.bfloat16) if v.is_floating_point() else v.detach()).contiguous() for k, v in model.state_dict().items()}
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        (tmp / "README.md").write_text(card)
