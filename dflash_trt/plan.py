"""dflash-trt plan: tokens/s per user and in total for AR, EAGLE-style and DFlash (chain and tree) over TP degrees
and batch sizes, from the cost model (cost_model.py), a hardware preset and an acceptance profile; the best draft
length per configuration, the KV memory head-room and the largest batch that fits. Writes plan.json, plan.md and
plan.png (per-user against total tokens/s per GPU, the published charts' axes).

Also fits the cost model's free parameters to timings of this machine (`fit_hardware`) and predicts measured
decoding runs with them (`validate_measured`, `dflash-trt plan --validate-cpu FILE`): benchmarks/plan_measure.py
makes the file.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from .cost_model import (
    BYTES, COMPUTE, Acceptance, Cost, Hardware, Pass, Quant, Shape, ar_step, dflash_step, eagle_step, elementwise_max, kv_bytes_per_sequence,
    pass_overhead_s, pass_roofline_s, resident_bytes, step_overhead_s, tree_expected_tokens,
)
from .errors import ConfigError
from .presets import HARDWARE, MODELS

KV_MEMORY_FRACTION = 0.9  # of what the weights leave: TensorRT-LLM's KvCacheConfig.free_gpu_memory_fraction default
TREE_NODES = (4, 8, 16, 24, 32, 48, 64)  # verify widths a tree may take (per sequence)


@dataclass(frozen=True)
class Setup:
    """What one plan is about: models, hardware, formats and how often the drafters are right."""

    target: Shape
    drafter: Shape | None
    block_size: int  # the DFlash drafter's block: up to block_size − 1 drafts
    eagle: Shape | None
    hardware: Hardware
    quant: Quant
    acceptance: Acceptance | None  # DFlash's
    eagle_acceptance: Acceptance | None
    eagle_depth: int = 7  # drafts an EAGLE chain may take at most
    drafter_replicated: bool = False


@dataclass
class Row:
    tp: int
    batch: int
    method: str  # ar | eagle | dflash | dflash-tree
    drafts: int  # per sequence (the tree: its depth)
    verify_tokens: int  # per sequence
    tokens_per_step: float
    step_ms: float
    per_user_tokens_per_s: float
    total_tokens_per_s: float
    per_gpu_tokens_per_s: float
    speedup_vs_ar: float = 1.0
    fits: bool = True
    terms: dict | None = None


def _row(tp: int, batch: int, method: str, drafts: int, nodes: int, tokens: float, cost: Cost) -> Row:
    per_user = tokens / cost.seconds
    return Row(tp, batch, method, drafts, nodes, round(tokens, 3), round(cost.seconds * 1e3, 4), round(per_user, 2),
               round(per_user * batch, 2), round(per_user * batch / tp, 2),
               terms={k: round(v, 9) for k, v in cost.terms().items()} | {"collectives": cost.collectives})


def best_rows(setup: Setup, tp: int, batch: int, context: float, second_choice: float | None, tree_budget: int) -> list[Row]:
    """One row per method: AR, and for each speculative method the draft length (tree size) that maximises
    tokens/s at this (tp, batch); a method that cannot beat AR there still shows its best."""
    hw, q = setup.hardware, setup.quant
    ar = _row(tp, batch, "ar", 0, 1, 1.0, ar_step(setup.target, hw, q, tp, batch, context))
    rows = [ar]
    candidates: dict[str, list[Row]] = {}
    if setup.drafter is not None and setup.acceptance is not None:
        for k in range(1, setup.block_size):
            cost = dflash_step(setup.target, setup.drafter, hw, q, tp, batch, context, k, drafter_replicated=setup.drafter_replicated)
            candidates.setdefault("dflash", []).append(_row(tp, batch, "dflash", k, k + 1, setup.acceptance.expected(k), cost))
        if second_choice is not None:
            tree = replace(setup.acceptance, second_choice=second_choice)
            depth = setup.block_size - 1
            for nodes in (n for n in TREE_NODES if n <= tree_budget):
                cost = dflash_step(setup.target, setup.drafter, hw, q, tp, batch, context, depth, verify_nodes=nodes + 1,
                                   drafter_replicated=setup.drafter_replicated)
                tokens = tree_expected_tokens(tree, depth, nodes)
                candidates.setdefault("dflash-tree", []).append(_row(tp, batch, "dflash-tree", depth, nodes + 1, tokens, cost))
    if setup.eagle is not None and setup.eagle_acceptance is not None:
        for k in range(1, setup.eagle_depth + 1):
            cost = eagle_step(setup.target, setup.eagle, hw, q, tp, batch, context, k)
            candidates.setdefault("eagle", []).append(_row(tp, batch, "eagle", k, k + 1, setup.eagle_acceptance.expected(k), cost))
    for method in ("eagle", "dflash", "dflash-tree"):
        if method in candidates:
            rows.append(max(candidates[method], key=lambda r: r.per_user_tokens_per_s))
    for r in rows:
        r.speedup_vs_ar = round(r.per_user_tokens_per_s / ar.per_user_tokens_per_s, 3)
    return rows


@dataclass
class Memory:
    tp: int
    weights_gb: float  # per GPU: target + drafters
    kv_per_sequence_mb: float  # per GPU at the planned context: target + DFlash drafter
    kv_budget_gb: float
    max_batch: int


def memory(setup: Setup, tp: int, context: float) -> Memory:
    """Weights resident per GPU, KV per sequence, and the largest batch whose KV fits in the fraction of the rest
    TensorRT-LLM gives its KV pool."""
    weights = resident_bytes(setup.target, setup.quant, tp)
    kv = kv_bytes_per_sequence(setup.target, setup.quant, tp, context)
    if setup.drafter is not None:
        weights += resident_bytes(setup.drafter, setup.quant, 1 if setup.drafter_replicated else tp)
        kv += kv_bytes_per_sequence(setup.drafter, setup.quant, 1 if setup.drafter_replicated else tp, context)
    budget = max(0.0, setup.hardware.memory_gb * 1e9 - weights) * KV_MEMORY_FRACTION
    return Memory(tp, round(weights / 1e9, 2), round(kv / 1e6, 2), round(budget / 1e9, 2), int(budget // kv) if kv else 0)


def plan(setup: Setup, tps: list[int], batches: list[int], context: float, second_choice: float | None = None,
         tree_budget: int = 64) -> dict:
    """Every (tp, batch) row, the memory per tp, and the configurations that do not fit marked."""
    for tp in tps:
        if setup.target.kv_heads % tp and tp % setup.target.kv_heads:
            raise ConfigError(f"tp {tp} splits neither the target's {setup.target.kv_heads} KV heads nor replicates them evenly", key="--tp")
    mem = {tp: memory(setup, tp, context) for tp in tps}
    rows = []
    for tp in tps:
        for b in batches:
            for r in best_rows(setup, tp, b, context, second_choice, tree_budget):
                r.fits = b <= mem[tp].max_batch
                rows.append(r)
    return {"setup": describe(setup, context, second_choice), "memory": [asdict(m) for m in mem.values()],
            "rows": [asdict(r) for r in rows]}


def describe(setup: Setup, context: float, second_choice: float | None) -> dict:
    acc = setup.acceptance
    return {
        "target": setup.target.name, "drafter": setup.drafter.name if setup.drafter else None,
        "eagle": setup.eagle.name if setup.eagle else None, "hardware": setup.hardware.name,
        "hardware_source": setup.hardware.source, "quant": asdict(setup.quant), "context": context,
        "block_size": setup.block_size, "dflash_acceptance": list(acc.rates) if acc else None,
        "dflash_acceptance_source": acc.source if acc else None,
        "dflash_tau_at_block": round(acc.expected(setup.block_size - 1), 3) if acc else None,
        "eagle_acceptance": list(setup.eagle_acceptance.rates) if setup.eagle_acceptance else None,
        "eagle_acceptance_source": setup.eagle_acceptance.source if setup.eagle_acceptance else None,
        "second_choice": second_choice, "drafter_replicated": setup.drafter_replicated,
    }


def frontier(rows: list[dict], method: str) -> list[tuple[float, float]]:
    """(per-user, per-GPU) points of `method` that fit and that no other point beats on both axes, by per-user."""
    pts = sorted(((r["per_user_tokens_per_s"], r["per_gpu_tokens_per_s"]) for r in rows if r["method"] == method and r["fits"]), reverse=True)
    out, best = [], -1.0
    for u, g in pts:
        if g > best:
            out.append((u, g))
            best = g
    return sorted(out)


def throughput_at(rows: list[dict], method: str, per_user: float) -> float | None:
    """The most tokens/s per GPU `method` reaches while giving each user at least `per_user` tokens/s."""
    ok = [g for u, g in frontier(rows, method) if u >= per_user]
    return max(ok) if ok else None


# -- reports ---------------------------------------------------------------------------------------------------

METHOD_NAMES = {"ar": "AR", "eagle": "EAGLE-style", "dflash": "DFlash", "dflash-tree": "DFlash tree"}


def markdown(result: dict) -> str:
    s = result["setup"]
    q = s["quant"]
    lines = [f"# Plan: {s['target']} + {s['drafter'] or 'no drafter'} on {s['hardware']}", "",
             f"Weights {q['weights']}, KV {q['kv']}, lm_head {q['lm_head']}; mean context {s['context']:.0f} tokens; "
             f"DFlash block {s['block_size']} (τ {s['dflash_tau_at_block']} at the full block; acceptance: {s['dflash_acceptance_source']})"
             + (f"; EAGLE-style: {s['eagle_acceptance_source']}" if s["eagle_acceptance"] else "; no EAGLE-style acceptance given")
             + (f"; tree: second-choice rate {s['second_choice']} (assumed)" if s["second_choice"] is not None else "") + ".", "",
             "| TP | weights / GPU | KV / sequence | KV budget / GPU | max batch |", "|---|---|---|---|---|"]
    for m in result["memory"]:
        lines.append(f"| {m['tp']} | {m['weights_gb']} GB | {m['kv_per_sequence_mb']} MB | {m['kv_budget_gb']} GB | {m['max_batch']} |")
    methods = [m for m in METHOD_NAMES if any(r["method"] == m for r in result["rows"])]
    lines += ["", "Per configuration: tokens/s per user · total tokens/s (× AR), best draft length k (tree: verify nodes n). "
              "Rows past the KV budget are marked ✗.", "",
              "| TP | batch | " + " | ".join(METHOD_NAMES[m] for m in methods) + " |", "|---|---|" + "---|" * len(methods)]
    by_config: dict[tuple, dict] = {}
    for r in result["rows"]:
        by_config.setdefault((r["tp"], r["batch"]), {})[r["method"]] = r
    for (tp, b), cells in by_config.items():
        out = []
        for m in methods:
            r = cells.get(m)
            if r is None:
                out.append("–")
                continue
            what = "" if m == "ar" else (f", n={r['verify_tokens']}" if m == "dflash-tree" else f", k={r['drafts']}")
            out.append(f"{r['per_user_tokens_per_s']:.0f} · {r['total_tokens_per_s']:.0f} ({r['speedup_vs_ar']:.2f}×{what})")
        lines.append(f"| {tp} | {b}{'' if cells['ar']['fits'] else ' ✗'} | " + " | ".join(out) + " |")
    return "\n".join(lines) + "\n"


def plot(result: dict, path: Path) -> bool:
    """Per-user tokens/s against total tokens/s per GPU, the Pareto frontier of each method; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7.5, 5))
    colors = {"ar": "tab:gray", "eagle": "tab:orange", "dflash": "tab:blue", "dflash-tree": "tab:green"}
    for m, name in METHOD_NAMES.items():
        pts = [(r["per_user_tokens_per_s"], r["per_gpu_tokens_per_s"]) for r in result["rows"] if r["method"] == m and r["fits"]]
        if not pts:
            continue
        ax.scatter(*zip(*pts), s=10, color=colors[m], alpha=0.35)
        ax.plot(*zip(*frontier(result["rows"], m)), marker="o", ms=4, color=colors[m], label=name)
    s = result["setup"]
    ax.set_xlabel("tokens/s per user (interactivity)")
    ax.set_ylabel("tokens/s per GPU (throughput)")
    ax.set_yscale("log")
    ax.set_title(f"{s['target']} on {s['hardware']} ({s['quant']['weights']}), context {s['context']:.0f}: modelled", fontsize=10)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# -- acceptance inputs ---------------------------------------------------------------------------------------------


def acceptance_from_bench(path: str | Path, method: str, domain: str | None, drafts: int) -> Acceptance:
    """Per-position acceptance from a `dflash-trt bench` JSON: the method's histograms, summed over `domain` or
    every domain; `drafts`: how many drafts each step offered (block − 1 for fixed-width runs)."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
        domains = raw["domains"]
    except (OSError, ValueError, KeyError) as e:
        raise ConfigError(f"not a dflash-trt bench JSON ({e})", path=str(path), key="domains") from None
    names = [domain] if domain else sorted(domains)
    hist: dict[int, int] = {}
    for d in names:
        if d not in domains or method not in domains[d]:
            raise ConfigError(f"no {method!r} results for domain {d!r}", path=str(path), key=f"domains.{d}.{method}")
        for n, c in domains[d][method]["acceptance_histogram"].items():
            hist[int(n)] = hist.get(int(n), 0) + int(c)
    return Acceptance.from_histogram(hist, drafts, source=f"{path.name}: {method}, {domain or 'all domains'}")


# -- fitting this machine ----------------------------------------------------------------------------------------

FIT_FIELDS = ("bandwidth_gbs", "peak", "pass_overhead_us", "layer_overhead_us", "sequence_overhead_us",
              "step_overhead_us", "step_sequence_overhead_us")


def step_cost(target: Shape, drafter: Shape | None, hw: Hardware, quant: Quant, batch: int, drafts: int, context: float) -> Cost:
    return dflash_step(target, drafter, hw, quant, 1, batch, context, drafts) if drafts else ar_step(target, hw, quant, 1, batch, context)


def fit_hardware(cells: list[dict], target: Shape, drafter: Shape | None, dtype: str, name: str = "this CPU", iters: int = 600) -> Hardware:
    """The Hardware whose cost model best matches measured step times (least squares on log time): memory
    bandwidth, compute peak for `dtype`, and the five overheads, efficiencies fixed at 1. cells: [{batch, drafts,
    context, seconds, weight (default 1)}]. The model's own formulas run on tensors (cost_model.pass_roofline_s / pass_overhead_s)."""
    import torch

    quant = Quant(weights=dtype, kv=dtype, lm_head=dtype, activations=dtype)
    unit = Hardware(name, 0, 1.0, {COMPUTE[dtype]: 1e-12}, bandwidth_efficiency=1.0, compute_efficiency=1.0)
    passes, owner, step_batches = [], [], []
    for i, c in enumerate(cells):
        cost = step_cost(target, drafter, unit, quant, c["batch"], c["drafts"], c["context"])
        passes += cost.passes
        owner += [i] * len(cost.passes)
        step_batches.append(float(c["batch"]))
    measured = torch.tensor([c["seconds"] for c in cells], dtype=torch.float64)
    weights = torch.tensor([c.get("weight", 1.0) for c in cells], dtype=torch.float64)
    # one Pass whose fields are tensors over every pass of every cell: the cost model's formulas run on them as on floats
    stacked = Pass(*(torch.tensor([getattr(p, f) for p in passes], dtype=torch.float64) for f in ("bytes", "flops", "layers", "seqs")), dtype)
    owner_t, batch_t = torch.tensor(owner), torch.tensor(step_batches, dtype=torch.float64)
    # start: 20 GB/s, 0.2 TFLOP/s, 10 µs per pass / layer / sequence-layer / step
    log_params = torch.log(torch.tensor([20.0, 0.2, 10.0, 10.0, 10.0, 10.0, 10.0], dtype=torch.float64)).requires_grad_()
    opt = torch.optim.Adam([log_params], lr=0.05)

    def predicted(params):
        hw = _hardware(name, dtype, params)
        memory_s, compute_s = pass_roofline_s(stacked, hw)
        per_pass = elementwise_max(memory_s, compute_s) + pass_overhead_s(stacked, hw)
        return torch.zeros(len(cells), dtype=torch.float64).index_add(0, owner_t, per_pass) + step_overhead_s(batch_t, hw)

    for _ in range(iters):
        opt.zero_grad()
        loss = (weights * (predicted(log_params.exp()).log() - measured.log()) ** 2).sum() / weights.sum()
        loss.backward()
        opt.step()
    return _hardware(name, dtype, [float(v) for v in log_params.detach().exp()])


def _hardware(name: str, dtype: str, params) -> Hardware:
    bandwidth, peak, *overheads = params
    return Hardware(name, 0, bandwidth, {COMPUTE[dtype]: peak}, bandwidth_efficiency=1.0, compute_efficiency=1.0,
                    **dict(zip(FIT_FIELDS[2:], overheads)), source="fitted to measured step times")


def _run_tokens(run: dict) -> tuple[int, float]:
    """(drafts offered per step, expected tokens per step from the run's acceptance distribution)."""
    drafts = run["drafts"] if run["method"] != "ar" else 0
    return drafts, Acceptance.from_histogram(run["acceptance_histogram"], drafts).expected(drafts) if drafts else 1.0


def validate_measured(measured: dict, target: Shape, drafter: Shape, fit_batches: tuple[int, ...] = (1, 16)) -> dict:
    """Fit on measured['fit'] (synthetic steps through the backend) and on the decoding runs at `fit_batches`
    (they carry what the Generator adds per step: sampling, stop rules, bookkeeping); predict every run
    (decode tokens/s per user and in total, from its own acceptance histogram and mean context). Returns the fit
    and the per-run errors, the runs at other batches marked held out."""
    dtype = measured["dtype"]
    cells = list(measured["fit"])
    for run in measured["runs"]:
        if run["batch"] in fit_batches:
            drafts, tokens = _run_tokens(run)
            cells.append({"batch": run["batch"], "drafts": drafts, "context": run["mean_context"],
                          "seconds": tokens / run["per_user_tokens_per_s"], "weight": len(measured["fit"]) / (2 * len(fit_batches))})
    hw = fit_hardware(cells, target, drafter, dtype)
    quant = Quant(weights=dtype, kv=dtype, lm_head=dtype, activations=dtype)
    out = []
    for run in measured["runs"]:
        drafts, tokens = _run_tokens(run)
        cost = step_cost(target, drafter if drafts else None, hw, quant, run["batch"], drafts, run["mean_context"])
        per_user = tokens / cost.seconds
        out.append({"method": run["method"], "batch": run["batch"], "measured_per_user": round(run["per_user_tokens_per_s"], 2),
                    "predicted_per_user": round(per_user, 2),
                    "measured_total": round(run["total_decode_tokens_per_s"], 2), "predicted_total": round(per_user * run["batch"], 2),
                    "error": round(per_user / run["per_user_tokens_per_s"] - 1, 3), "held_out": run["batch"] not in fit_batches})
    fitted = {f: round(getattr(hw, f) if f != "peak" else hw.peak_tflops[COMPUTE[dtype]], 4) for f in FIT_FIELDS}
    held = [abs(r["error"]) for r in out if r["held_out"]]
    return {"hardware": fitted, "fit_batches": list(fit_batches), "runs": out, "max_abs_error": max(abs(r["error"]) for r in out),
            "max_abs_error_held_out": max(held) if held else None}


def validation_markdown(v: dict) -> str:
    h = v["hardware"]
    lines = [f"Fitted: {h['bandwidth_gbs']:.1f} GB/s, {h['peak']:.3f} TFLOP/s; overheads per pass {h['pass_overhead_us']:.0f} µs, "
             f"per layer {h['layer_overhead_us']:.1f} µs, per sequence-layer {h['sequence_overhead_us']:.1f} µs, "
             f"per step {h['step_overhead_us']:.0f} µs + {h['step_sequence_overhead_us']:.0f} µs per sequence.", "",
             f"Fitted on the synthetic step timings and the runs at batch {', '.join(map(str, v['fit_batches']))}; the other runs are held out.", "",
             "| method | batch | measured tok/s per user | predicted | measured total | predicted total | error | held out |",
             "|---|---|---|---|---|---|---|---|"]
    for r in v["runs"]:
        lines.append(f"| {r['method']} | {r['batch']} | {r['measured_per_user']} | {r['predicted_per_user']} | {r['measured_total']} | "
                     f"{r['predicted_total']} | {100 * r['error']:+.1f}% | {'yes' if r['held_out'] else ''} |")
    held = v["max_abs_error_held_out"]
    lines.append(f"\nLargest error: {100 * v['max_abs_error']:.1f}% (held out: {'–' if held is None else f'{100 * held:.1f}%'}).")
    return "\n".join(lines) + "\n"


# -- command line ---------------------------------------------------------------------------------------------------


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values or min(values) < 1:
        raise ConfigError(f"{text!r}: expected positive integers separated by commas", key=flag)
    return values


def setup_from_args(args) -> Setup:
    from .config import load_drafter_config, load_eagle_config, load_target_config
    from .loading import check_dir
    from .presets import drafter_shape, target_shape

    if args.preset and (args.target or args.drafter or args.eagle):
        raise ConfigError("--preset names the models: leave out --target / --drafter / --eagle, or the preset", key="--preset")
    if args.preset:
        preset = MODELS[args.preset]
        target, drafter, block, eagle = preset.target, preset.drafter, preset.block_size, preset.eagle
        weights = args.quant or preset.weights
    else:
        if not args.target:
            raise ConfigError("pass --preset NAME, or --target DIR (with --drafter DIR)", key="--target")
        check_dir(args.target, "--target")
        target = target_shape(load_target_config(args.target))
        drafter = eagle = None
        block = 1
        if args.drafter:
            check_dir(args.drafter, "--drafter")
            d_cfg = load_drafter_config(args.drafter)
            drafter, block = drafter_shape(d_cfg), d_cfg.block_size
        if args.eagle:
            check_dir(args.eagle, "--eagle")
            eagle = drafter_shape(load_eagle_config(args.eagle), eagle=True)
        weights = args.quant or "bf16"
    kv = args.kv_quant or ("fp8" if weights in ("fp8", "nvfp4") else "bf16")
    lm_head = weights if weights in ("fp32", "bf16", "fp16") else "bf16"  # ModelOpt leaves the lm_head unquantized
    quant = Quant(weights=weights, kv=kv, lm_head=lm_head, activations="bf16")
    block = args.block_size or block
    acceptance = eagle_acceptance = None
    if args.acceptance:
        acceptance = acceptance_from_bench(args.acceptance, "dflash", args.domain, block - 1)
        if eagle is not None and args.eagle_tau is None:
            eagle_acceptance = acceptance_from_bench(args.acceptance, "eagle3", args.domain, args.eagle_depth)
    elif args.tau is not None:
        acceptance = Acceptance.from_tau(args.tau, args.tau_block or block, source=f"τ {args.tau} at block {args.tau_block or block}, constant α")
    elif args.preset:
        acceptance = PUBLISHED_TAU[args.preset]
    if args.eagle_tau is not None:
        eagle_acceptance = Acceptance.from_tau(args.eagle_tau, args.eagle_depth + 1,
                                               source=f"τ {args.eagle_tau} at {args.eagle_depth} drafts, constant α")
    elif args.preset and args.preset in PUBLISHED_EAGLE_TAU and not args.acceptance:
        eagle_acceptance = PUBLISHED_EAGLE_TAU[args.preset]
    if acceptance is not None and len(acceptance.rates) < block - 1:
        acceptance = replace(acceptance, rates=acceptance.rates + (acceptance.rates[-1],) * (block - 1 - len(acceptance.rates)))
    return Setup(target, drafter, block, eagle, HARDWARE[args.hardware], quant, acceptance, eagle_acceptance,
                 eagle_depth=args.eagle_depth, drafter_replicated=args.drafter_tp == "replicated")


# Published acceptance for the presets (shared/reference/released-drafters.md, dflash-peers.md §7), constant α:
PUBLISHED_TAU = {
    "llama-3.1-8b": Acceptance.from_tau(4.91, 10, "HumanEval τ 4.91 at block 10 (z-lab, SGLang, B200)"),
    "qwen3-8b": Acceptance.from_tau(6.36, 16, "GSM8K τ 6.36 at block 16 (z-lab #119, SGLang, concurrency 1)"),
    "gpt-oss-120b": Acceptance.from_tau(4.4, 10, "HumanEval τ 4.4 at block 10 (z-lab gpt-oss-120b-DFlash card, SGLang, H200)"),
}
PUBLISHED_EAGLE_TAU = {
    "qwen3-8b": Acceptance.from_tau(4.82, 8, "GSM8K τ 4.82 (AngelSlim EAGLE-3, z-lab #119; 7 drafts assumed)"),
}


def cmd_plan(args) -> int:
    if args.validate_cpu:
        return cmd_validate(args)
    setup = setup_from_args(args)
    result = plan(setup, _ints(args.tp, "--tp"), _ints(args.batch, "--batch"), args.context, args.second_choice, args.tree_budget)
    text = markdown(result)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "plan.json").write_text(json.dumps(result, indent=1) + "\n")
        (out / "plan.md").write_text(text)
        drew = plot(result, out / "plan.png")
        print(f"wrote {out / 'plan.json'}, {out / 'plan.md'}" + (f", {out / 'plan.png'}" if drew else " (no matplotlib: no PNG)"))
    print(text)
    return 0


def cmd_validate(args) -> int:
    path = Path(args.validate_cpu)
    try:
        measured = json.loads(path.read_text())
        target = Shape(**{k: tuple(v) if isinstance(v, list) else v for k, v in measured["target_shape"].items()})
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"not a plan_measure.py file ({e})", path=str(path), key="target_shape") from None
    drafter = Shape(**{k: tuple(v) if isinstance(v, list) else v for k, v in measured["drafter_shape"].items()})
    v = validate_measured(measured, target, drafter)
    print(validation_markdown(v))
    return 0


def register_cli(sub) -> None:
    from .flags import HELP_FORMAT

    p = sub.add_parser("plan", formatter_class=HELP_FORMAT, help="model tokens/s per user and in total for AR / EAGLE / DFlash on a GPU preset",
                       description="Deployment planner: a roofline cost model (weight and KV bytes, FLOPs, all-reduces, overheads) "
                                   "over TP degrees and batch sizes, with the acceptance distribution of a bench run or a published τ. "
                                   "Prints a markdown table; --out also writes plan.json and plan.png (per-user vs per-GPU tokens/s).")
    p.add_argument("--preset", choices=sorted(MODELS), help="a named target + z-lab drafter + EAGLE-3 head (shapes of the released configs)")
    p.add_argument("--target", help="a target config directory (instead of --preset)")
    p.add_argument("--drafter", help="a DFlash drafter config directory")
    p.add_argument("--eagle", help="an EAGLE-3-style drafter config directory")
    p.add_argument("--hardware", choices=sorted(HARDWARE), default="B300", help="one GPU's figures (cited in presets.py)")
    p.add_argument("--quant", choices=sorted(set(BYTES) - {"fp32"}), help="weight format (default: the preset's release format, else bf16)")
    p.add_argument("--kv-quant", choices=["bf16", "fp8", "nvfp4"], help="KV cache format (default: fp8 with fp8 / nvfp4 weights, else bf16)")
    p.add_argument("--tp", default="1,2,4,8", help="TP degrees, comma-separated")
    p.add_argument("--batch", default="1,2,4,8,16,32,64,128,256", help="batch sizes (concurrent sequences), comma-separated")
    p.add_argument("--context", type=float, default=2048, help="mean tokens each sequence attends while decoding")
    p.add_argument("--block-size", type=int, help="the DFlash drafter's block (default: its config's)")
    p.add_argument("--acceptance", help="a dflash-trt bench JSON: per-position acceptance of its dflash (and eagle3) runs")
    p.add_argument("--domain", help="with --acceptance: one domain (default: all)")
    p.add_argument("--tau", type=float, help="DFlash τ (tokens per step, bonus included) at --tau-block, when no bench JSON")
    p.add_argument("--tau-block", type=int, help="the block --tau was measured at (default: --block-size)")
    p.add_argument("--eagle-tau", type=float, help="EAGLE-style τ at --eagle-depth drafts")
    p.add_argument("--eagle-depth", type=int, default=7, help="the longest EAGLE chain")
    p.add_argument("--second-choice", type=float,
                   help="tree: P(the drafter's 2nd choice is right | its 1st is wrong); without it no tree is modelled")
    p.add_argument("--tree-budget", type=int, default=64, help="tree: most verify nodes per sequence")
    p.add_argument("--drafter-tp", choices=["sharded", "replicated"], default="sharded", help="shard the drafter like the target, or run it whole")
    p.add_argument("--out", help="directory for plan.json, plan.md, plan.png")
    p.add_argument("--validate-cpu", metavar="FILE", help="fit this machine's parameters on a benchmarks/plan_measure.py file's step "
                                                          "timings and predict its decoding runs")
    p.set_defaults(func=cmd_plan)
