"""`dflash-trt bench`: DFlash vs plain autoregressive decoding (and other drafters) side by side, in one run.

Per domain, batch 1: τ (tokens per target step, bonus included), the acceptance
histogram, decode tokens/s (prefill excluded, as z-lab's benchmark does), speedup over AR on
the same backend, and how many outputs equal AR's token for token (all of them in fp32; in bf16, for
each that differs, the target's logit gap between the two tokens where it first differs: near-ties).
Then a concurrency sweep: total tokens/s vs tokens/s per user, for each method.
Writes bench.json, bench.md and (with matplotlib) bench.png.
"""

from __future__ import annotations

import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from .errors import ConfigError
from .peers import PEERS, PLD_TOKENS
from .prompts import EVAL_DOMAINS, load_eval_prompts
from .runtime import Generator
from .sampling import SamplingParams
from .tree import TreeSpec


HF_BASELINE = "hf-greedy"  # peers.TransformersPeer: transformers fp32 greedy, what the peers' speedups are over


@dataclass
class Method:
    name: str  # "ar", "dflash", ...
    backend: object
    max_verify_tokens: int | None = None  # the Generator's verify budget (None: full blocks at any batch)
    step_cost: object = None  # draft_length.StepCost: draft length chosen per step (a fresh policy each run)
    peer: object = None  # peers.TransformersPeer / LlamaCppPeer: someone else's decoder (batch 1 only; backend None)
    tree: object = None  # tree.TreeSpec: tree verification of the DFlash pass instead of the chain


def _run(method: Method, prompts: list[list[int]], eos, max_new: int, concurrency: int):
    if method.peer is not None:
        start = time.perf_counter()
        outs = method.peer.generate(prompts, set(eos), max_new)
        return outs, time.perf_counter() - start
    policy = None
    if method.step_cost is not None:
        from .draft_length import DraftLengthPolicy, TreePolicy

        policy = DraftLengthPolicy(method.step_cost, method.backend.max_drafts) if method.tree is None else TreePolicy(method.step_cost, method.tree.nodes)
    gen = Generator(method.backend, eos_token_ids=eos, max_batch=concurrency, max_verify_tokens=method.max_verify_tokens, draft_policy=policy,
                    tree=method.tree)
    start = time.perf_counter()
    outs = gen.generate(prompts, SamplingParams(max_new_tokens=max_new))
    return outs, time.perf_counter() - start


def _summary(outs, wall: float) -> dict:
    steps = sum(len(o.accepted_lengths) for o in outs)
    # tokens after the first step's (a peer's first step can commit more than one: prompt lookup's first verify)
    decoded = sum(len(o.output_ids) - getattr(o, "first_tokens", 1) for o in outs)
    decode_s = sum(o.decode_s for o in outs)
    hist: dict[int, int] = {}
    for o in outs:
        for k, v in o.histogram().items():
            hist[k] = hist.get(k, 0) + v
    return {
        "requests": len(outs),
        "output_tokens": sum(len(o.output_ids) for o in outs),
        "tau": round(sum(sum(o.accepted_lengths) for o in outs) / steps, 3) if steps else 0.0,
        "decode_tokens_per_s": round(decoded / decode_s, 2) if decode_s else 0.0,
        "per_user_tokens_per_s": round(sum(o.decode_tokens_per_s for o in outs) / len(outs), 2),
        "total_tokens_per_s": round(sum(len(o.output_ids) for o in outs) / wall, 2),
        "acceptance_histogram": dict(sorted(hist.items())),
    }


def flip_logit_gap(backend, prompt: list[int], reference: list[int], output: list[int]) -> float | None:
    """Where `output` first leaves `reference` (plain decoding's output), how far apart the target puts the
    two tokens: logit(reference token) − logit(output token), from one target pass over the common prefix
    (`backend` must have no drafter). None when the outputs agree up to the shorter one's length.

    In bf16 a verify pass over a block rounds differently from a one-token step, so two tokens whose
    logits are within rounding of each other can swap; a gap of a few bf16 ulps of the logits says a
    flip is such a near-tie, a large gap would say the runtime is wrong."""
    i = next((j for j, (a, b) in enumerate(zip(reference, output)) if a != b), None)
    if i is None:
        return None
    seq_id = -1 - i  # not an id the Generator hands out
    backend.add_sequence(seq_id)
    try:
        logits = backend.prefill([seq_id], [list(prompt) + list(reference[:i])], need_logits=[True])[0].logits[-1].float()
    finally:
        backend.release(seq_id)
    return float(logits[reference[i]] - logits[output[i]])


STREAM_BYTES = 512 << 20  # the streaming-read buffer: far larger than any CPU's last-level cache
FLOOR_CONTEXT = 200  # tokens in the KV cache when the floor probe times a step
FLOOR_VERIFY = 16  # tokens of the verify step it times (a full DFlash block)


def stream_bandwidth(nbytes: int = STREAM_BYTES, reps: int = 5) -> float:
    """Bytes/s of a streaming read (a sum over an fp32 buffer of `nbytes`, best of `reps`) on the current threads."""
    buf = torch.ones(max(1, nbytes // 4), dtype=torch.float32)
    buf.sum()  # touch every page once before timing
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - start)
    return buf.nbytes / best


def weight_bytes(model: torch.nn.Module) -> int:
    """Bytes of weights one forward step of the target reads: every parameter once (storage shared by tied or
    fused weights counted once), except an untied input embedding table, of which a step gathers a few rows
    only. For a mixture of experts this counts every expert (a bound above what one token reads)."""
    embed = model.model.embed_tokens.weight
    skip = embed.data_ptr() if embed.data_ptr() != model.lm_head_weight.data_ptr() else None
    seen, total = set(), 0
    for p in model.parameters():
        key = (p.data_ptr(), p.nbytes)
        if p.data_ptr() == skip or key in seen:
            continue
        seen.add(key)
        total += p.nbytes
    for packed in packed_weights(model):  # a 1-token step reads the packed copy instead of the dense weight
        if packed.crossover >= 1:
            total += packed.nbytes - packed.dense.nbytes
    return total


def packed_weights(model: torch.nn.Module) -> list:
    """The models.packed weight (Int8Weight, OnednnWeight) of every packed matmul of `model` (none with dense weights)."""
    found = [model.lm_head_packed] if getattr(model, "lm_head_packed", None) is not None else []
    for m in model.modules():
        for packed in (getattr(getattr(m, "_fused", None), "packed", None), getattr(m, "packed", None)):
            if packed is not None:
                found.append(packed)
    return found


def floor_probe(backend, reps: int = 10) -> dict:
    """How far the target's steps are from the memory floor on this machine: the streaming-read bandwidth, the
    weight-read floor of one step (weight bytes / bandwidth), and the measured median of a 1-token step and a
    FLOOR_VERIFY-token verify at FLOOR_CONTEXT tokens of context (`backend`: the target without a drafter)."""
    from .draft_length import measure_step

    context = FLOOR_CONTEXT
    while context > 1 and backend.pages_needed(context + FLOOR_VERIFY + reps + 1) > backend.num_pages:
        context //= 2  # a small KV pool (a short bench): a shorter context
    bandwidth = stream_bandwidth()
    nbytes = weight_bytes(backend.target)
    step = measure_step(backend, 1, 0, context=context, reps=reps)
    verify = measure_step(backend, 1, FLOOR_VERIFY - 1, context=context, reps=reps, random_drafts=True)
    return {**floor_figures(bandwidth, nbytes, step, verify, context), "cpu": cpu_name()}


def cpu_name() -> str:
    """The CPU and the vector ISA torch's kernels use on it (AVX2 / AVX512 / AMX decide what bf16 and int8 cost)."""
    import platform

    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), name)
    except OSError:
        pass
    return f"{name}, torch CPU kernels {torch.backends.cpu.get_cpu_capability()}"


def floor_figures(bandwidth: float, nbytes: int, step_s: float, verify_s: float, context: int) -> dict:
    floor = nbytes / bandwidth
    return {"bandwidth_gb_per_s": round(bandwidth / 1e9, 2), "weight_mb": round(nbytes / 1e6, 1), "floor_ms": round(floor * 1e3, 2),
            "ar_step_ms": round(step_s * 1e3, 2), "verify_ms": round(verify_s * 1e3, 2), "verify_tokens": FLOOR_VERIFY,
            "context": context, "ar_step_over_floor": round(step_s / floor, 2), "verify_over_ar_step": round(verify_s / step_s, 2)}


def floor_line(f: dict) -> str:
    cpu = f" ({f['cpu']})" if f.get("cpu") else ""
    return (f"Floor{cpu}: streaming read {f['bandwidth_gb_per_s']:.1f} GB/s; the target reads {f['weight_mb']:.0f} MB of weights per "
            f"step, so a step cannot take less than {f['floor_ms']:.1f} ms. Measured at {f['context']} tokens of context: a "
            f"1-token step {f['ar_step_ms']:.1f} ms ({f['ar_step_over_floor']:.1f}× the floor), a {f['verify_tokens']}-token "
            f"verify {f['verify_ms']:.1f} ms ({f['verify_over_ar_step']:.2f}× the 1-token step).")


def run_bench(methods: list[Method], prompt_sets: dict[str, list[list[int]]], eos, max_new: int, concurrency: list[int], progress: bool = True) -> dict:
    """prompt_sets: domain → token id lists. The first method is the AR reference."""
    from .progress import progress_bar

    total = len(prompt_sets) * len(methods) + len(concurrency) * sum(m.peer is None for m in methods)
    bar = progress_bar(total=total, desc="bench", unit="run", disable=not progress)
    results: dict = {"domains": {}, "concurrency": {}}
    warm = [next(iter(prompt_sets.values()))[0]]
    for m in methods:  # one short untimed run each first: the first calls of a process pay for allocation and kernel set-up
        _run(m, warm, eos, min(8, max_new), concurrency=1)
    for domain, prompts in prompt_sets.items():
        row, reference = {}, None
        for m in methods:
            bar.set_postfix_str(f"{domain}/{m.name}")
            outs, wall = _run(m, prompts, eos, max_new, concurrency=1)
            stats = _summary(outs, wall)
            ids = [o.output_ids for o in outs]
            if reference is None:
                reference = ids  # the first method is AR: the reference output
            stats["equal_to_ar"] = sum(a == b for a, b in zip(ids, reference))
            gaps = [flip_logit_gap(methods[0].backend, p, r, o) for p, r, o in zip(prompts, reference, ids) if r != o]
            stats["flip_logit_gaps"] = [round(g, 4) for g in gaps if g is not None]
            row[m.name] = stats
            bar.update()
        base = row[methods[0].name]["decode_tokens_per_s"]
        hf = row.get(HF_BASELINE, {}).get("decode_tokens_per_s")
        for stats in row.values():
            stats["speedup_vs_ar"] = round(stats["decode_tokens_per_s"] / base, 3) if base else 0.0
            if hf:
                stats["speedup_vs_hf"] = round(stats["decode_tokens_per_s"] / hf, 3)
        results["domains"][domain] = row
    mixed = [p for ps in prompt_sets.values() for p in ps]
    for c in concurrency:
        prompts = (mixed * (1 + 2 * c // max(1, len(mixed))))[: 2 * c]  # two waves of requests
        results["concurrency"][c] = {}
        for m in (m for m in methods if m.peer is None):  # peers decode one request at a time
            bar.set_postfix_str(f"concurrency {c}/{m.name}")
            outs, wall = _run(m, prompts, eos, max_new, concurrency=c)
            results["concurrency"][c][m.name] = _summary(outs, wall)
            bar.update()
    bar.close()
    return results


def markdown(results: dict, methods: list[str], header: str) -> str:
    hf = any("speedup_vs_hf" in s for row in results["domains"].values() for s in row.values())
    hf_col = (" vs HF fp32 greedy |", "---|") if hf else ("", "")
    lines = [header, "", "| domain | method | τ | decode tok/s | speedup vs AR |" + hf_col[0] + " = AR output | flips: max logit gap | "
             "acceptance histogram |", "|---|---|---|---|---|" + hf_col[1] + "---|---|---|"]
    for domain, row in results["domains"].items():
        for m in methods:
            s = row[m]
            gaps = s.get("flip_logit_gaps", [])
            flips = f"{max(abs(g) for g in gaps):.3f} ({len(gaps)})" if gaps else "–"
            vs_hf = f" {s['speedup_vs_hf']:.2f}× |" if hf else ""
            lines.append(f"| {domain} | {m} | {s['tau']:.2f} | {s['decode_tokens_per_s']:.1f} | {s['speedup_vs_ar']:.2f}× |{vs_hf} "
                         f"{s['equal_to_ar']}/{s['requests']} | {flips} | {s['acceptance_histogram']} |")
    lines += ["", "| concurrency | method | total tok/s | tok/s per user | τ |", "|---|---|---|---|---|"]
    for c, row in results["concurrency"].items():
        for m in (m for m in methods if m in row):
            s = row[m]
            lines.append(f"| {c} | {m} | {s['total_tokens_per_s']:.1f} | {s['per_user_tokens_per_s']:.1f} | {s['tau']:.2f} |")
    return "\n".join(lines) + "\n\n" + "\n".join(COLUMNS_EXPLAINED) + "\n"


def verdict(results: dict, methods: list[str], dtype: str) -> list[str]:
    """What the table says, in words: per domain the fastest method and its speedup over AR, why DFlash wins or
    loses here (τ against what a drafting step costs, from the step-cost calibration when there is one), and
    whether its outputs equal AR's (exactly, in fp32; in bf16 how many, and how close to a tie each flip was)."""
    lines = []
    cost = results.get("setup", {}).get("step_cost")
    if any("speedup_vs_hf" in s for row in results["domains"].values() for s in row.values()):
        for domain, row in results["domains"].items():
            lines.append(f"- {domain}, over transformers fp32 greedy: " + ", ".join(f"{m} {row[m]['speedup_vs_hf']:.2f}×" for m in methods
                                                                                    if m != HF_BASELINE) + ".")
    for domain, row in results["domains"].items():
        best = max(methods, key=lambda m: row[m]["decode_tokens_per_s"])
        speeds = ", ".join(f"{m} {row[m]['speedup_vs_ar']:.2f}× (τ {row[m]['tau']:.2f})" for m in methods if m != "ar")
        lines.append(f"- {domain}: fastest is `{best}`" + (f" at {row[best]['speedup_vs_ar']:.2f}× AR" if best != "ar" else "")
                     + f"; {speeds or 'AR only'}.")
    if cost:
        batches, drafts, seconds = cost["batches"], cost["drafts"], cost["seconds"]
        b1 = seconds[batches.index(1)] if 1 in batches else seconds[0]
        k = drafts[-1]
        lines.append(f"- Why: on this machine a step drafting {k} tokens costs {b1[-1] / b1[0]:.1f}× a plain step (batch 1, "
                     f"{b1[0] * 1e3:.0f} ms vs {b1[-1] * 1e3:.0f} ms), so drafting pays only where τ is above that; the auto "
                     "policy falls back to plain decoding where it is not.")
    peers = set(results.get("setup", {}).get("peers") or ())
    int8 = results.get("setup", {}).get("cpu_weights") == "int8"
    exact = dtype == "fp32" and not int8  # fp32 int8 matmuls round their inputs and outputs to bf16 (models.packed)
    why = ("the int8 matmuls' bf16 rounding of a multi-token verify, another kernel or summation order than a 1-token step, "
           "rounds the other way" if int8 else f"{dtype}'s different reduction order in a multi-token verify rounds the other way; fp32 is exact")
    for m in methods:
        if m == "ar":
            continue
        equal = sum(row[m]["equal_to_ar"] for row in results["domains"].values())
        total = sum(row[m]["requests"] for row in results["domains"].values())
        gaps = [abs(g) for row in results["domains"].values() for g in row[m].get("flip_logit_gaps", [])]
        if m == "ar-dense" and int8:
            lines.append(f"- `ar-dense` (plain decoding on the {dtype} weights before int8): {equal} of {total} greedy outputs equal "
                         "the int8 target's; int8 changes the model, so every other method is compared with the int8 target as run.")
        elif m == "ar-dense":
            lines.append(f"- `ar-dense` (plain decoding on the same {dtype} weights, not prepacked): {equal} of {total} greedy outputs "
                         "equal the prepacked target's (the same weights; its kernel computes the same products).")
        elif equal == total:
            lines.append(f"- `{m}`'s outputs equal AR's on all {total} prompts" + (" (fp32: exact, as the tests prove)." if exact and m not in peers else "."))
        elif m in peers:
            lines.append(f"- `{m}` (another implementation): {equal} of {total} outputs equal AR's; where one differs first, the "
                         f"target's logits for the two tokens are within {max(gaps, default=0.0):.3f} of each other.")
        else:
            lines.append(f"- `{m}`: {equal} of {total} outputs equal AR's; the others first differ where the target's top two logits "
                         f"are within {max(gaps):.3f} of each other (near-ties that {why}).")
    return lines


# Printed under every table: what each method and column means.
COLUMNS_EXPLAINED = [
    "Methods: `ar` plain greedy decoding (one target step per token); `eagle3` the EAGLE-3-style baseline drafter "
    "(a chain drafted token by token); `dflash` the DFlash drafter, one block per step at the fixed width; `dflash-auto` "
    "DFlash with each step's draft length chosen from the measured step cost and the running acceptance (0 drafts "
    "= plain decoding when drafting cannot pay); `dflash-treeN` (`--tree`) tree verification of up to N drafts per step from each "
    "block slot's top-k, greedy (with `--draft-length auto` each step's tree size, or plain decoding, from the step cost, "
    "as `dflash-auto`). Peers (`--peer`, batch 1 only): `hf-greedy` transformers' `generate` greedy "
    "in fp32 (the baseline of 'vs HF fp32 greedy'), `hf-pld` the same with prompt lookup decoding "
    f"(`prompt_lookup_num_tokens={PLD_TOKENS}`), `llama.cpp` llama-cpp-python greedy on the Q4_1 GGUF the target was "
    "dequantized from. With `--cpu-weights int8` or `onednn`: `ar-dense` plain decoding on the dense weights (before int8: "
    "its = AR output is int8's greedy agreement with them; not prepacked: the same weights and products).",
    "Columns: τ = tokens committed per target step (1.0 for AR); decode tok/s = output tokens after the first, over "
    "decode time, batch 1; speedup vs AR = decode tok/s over AR's on the same prompts; = AR output = requests whose text "
    "equals AR's exactly; flips: max logit gap (n) = for the n requests that differ from AR, the largest gap between "
    "the target's top two logits where they first differ (a small gap is a near-tie that a different reduction "
    "order rounds the other way, e.g. a 16-token bf16 verify vs a 1-token step; exact equality holds in fp32); "
    "acceptance histogram = {tokens committed in a step: steps}.",
    "Concurrency: total tok/s = all output tokens over wall time with that many requests in the batch; per user = "
    "each request's own rate.",
]


def header_line(target: str, dtype: str, block: int | None, forced: bool, num_prompts: int, max_new_tokens: int, threads: int) -> str:
    """The report's first line: what ran, with the DFlash block said in words (the drafter's own, or --block-size)."""
    block_text = "no DFlash drafter" if block is None else f"DFlash block {block}" + (" (--block-size)" if forced else " (the drafter's own)")
    return (f"# dflash-trt bench: {target}, {dtype}, {block_text}, {num_prompts} prompts/domain, max {max_new_tokens} new tokens, "
            f"{threads} CPU threads")


def plot(results: dict, methods: list[str], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    domains = list(results["domains"])
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        ax1.bar([d + i * width for d in range(len(domains))], [results["domains"][d][m]["speedup_vs_ar"] for d in domains], width, label=m)
        conc = {c: row for c, row in results["concurrency"].items() if m in row}
        if conc:
            ax2.plot([conc[c][m]["per_user_tokens_per_s"] for c in conc], [conc[c][m]["total_tokens_per_s"] for c in conc], "o-", label=m)
        for c in conc:
            ax2.annotate(str(c), (conc[c][m]["per_user_tokens_per_s"], conc[c][m]["total_tokens_per_s"]), fontsize=7)
    ax1.set_xticks([d + 0.4 - width / 2 for d in range(len(domains))], domains)
    ax1.set_ylabel("decode speedup vs AR (batch 1)")
    ax1.axhline(1.0, color="gray", lw=0.5)
    ax1.legend()
    ax2.set_xlabel("tokens/s per user")
    ax2.set_ylabel("total tokens/s")
    ax2.set_title("throughput vs interactivity (labels: concurrency)")
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def _tree_sizes(flag: str | None, max_drafts: int) -> list[int]:
    """`--tree 3,7,15` → [3, 7, 15], each checked against the block (one error naming the flag)."""
    if not flag:
        return []
    try:
        sizes = [int(n) for n in flag.split(",") if n]
    except ValueError:
        raise ConfigError(f"--tree takes comma-separated node counts, got {flag!r}", key="--tree") from None
    for n in sizes:
        if not 1 <= n <= max_drafts:
            raise ConfigError(f"a verification tree of {n} nodes does not fit the verify block: 1 to {max_drafts} (block_size - 1)", key="--tree")
    return sizes


def cmd_bench(args) -> int:
    from .loading import DTYPES, check_dir, encode_prompt, generation_eos_ids, load_drafter, load_eagle_drafter, load_target, load_tokenizer, weights_label
    from .config import load_target_config
    from .kv_cache import pool_pages
    from .torch_backend import TorchBackend

    for flag in ("target", "drafter", "eagle", "tokenizer"):
        check_dir(getattr(args, flag), f"--{flag}")
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = load_target_config(args.target)
    tok = load_tokenizer(args.tokenizer or args.target)
    target = load_target(args.target, dtype=DTYPES[args.dtype])
    concurrency = [int(c) for c in args.concurrency.split(",") if c]
    domains = [d for d in args.domains.split(",") if d]
    for d in domains:
        if d not in EVAL_DOMAINS:
            raise ConfigError(f"unknown domain {d!r}; expected some of {','.join(EVAL_DOMAINS)}", key="--domains")
    prompt_sets = {d: [encode_prompt(tok, p.text, chat=True) for p in load_eval_prompts(d, limit=args.num_prompts)] for d in domains}
    longest = max(len(p) for ps in prompt_sets.values() for p in ps)
    pages = pool_pages(max(concurrency + [1]), longest + args.max_new_tokens, 16, args.block_size)
    weights = args.cpu_weights
    methods = [Method("ar", TorchBackend(target, None, num_pages=pages, cpu_weights=weights))]
    if args.eagle:
        eagle = load_eagle_drafter(args.eagle, cfg, dtype=DTYPES[args.dtype])
        methods.append(Method("eagle3", TorchBackend(target, eagle, num_pages=pages, cpu_weights=weights), args.max_verify_tokens))
    if args.drafter:
        drafter = load_drafter(args.drafter, cfg, dtype=DTYPES[args.dtype])
        dflash = TorchBackend(target, drafter, num_pages=pages, block_size=args.block_size, cpu_weights=weights)
        methods.append(Method("dflash", dflash, args.max_verify_tokens))
        cost = None  # the step cost of --draft-length auto: dflash-auto and the trees choose each step's width from it
        if args.draft_length == "auto":
            from .draft_length import auto_policy

            from .draft_length import calibration_identity

            identity = calibration_identity(args.target, args.drafter, weights_label(args.dtype, weights), "dflash", dflash.block_size)
            policy = auto_policy(dflash, identity, max(concurrency + [1]), progress=not args.quiet)
            if policy is not None:
                cost = policy.cost
                methods.append(Method("dflash-auto", dflash, args.max_verify_tokens, cost))
        for nodes in _tree_sizes(args.tree, dflash.max_drafts):
            methods.append(Method(f"dflash-tree{nodes}", dflash, args.max_verify_tokens, cost, tree=TreeSpec(nodes, args.tree_top_k)))
    if weights != "dense":  # the same decoding on the dense weights: how often int8 (or the prepacking) changes the greedy output, and the speed
        methods.append(Method("ar-dense", TorchBackend(load_target(args.target, dtype=DTYPES[args.dtype]), None, num_pages=pages)))
    if args.peer:
        from .peers import make_peers

        methods += [Method(p.name, None, peer=p) for p in make_peers(args.peer, args.target, torch.get_num_threads(), args.gguf)]
    eos = generation_eos_ids(args.target, tok, args.tokenizer)
    results = run_bench(methods, prompt_sets, eos, args.max_new_tokens, concurrency, progress=not args.quiet)
    floor = floor_probe(methods[0].backend)
    results["setup"] = {"target": str(args.target), "tokenizer": args.tokenizer, "drafter": args.drafter, "eagle": args.eagle, "dtype": args.dtype, "cpu_weights": weights,
                        "packed_extra_mb": round(methods[0].backend.packed_bytes / 1e6, 1), "block_size": args.block_size,
                        "step_cost": next((m.step_cost.to_json() for m in methods if m.step_cost is not None), None),
                        "peers": [m.name for m in methods if m.peer is not None],
                        "floor": floor,
                        "num_prompts": args.num_prompts, "max_new_tokens": args.max_new_tokens, "threads": torch.get_num_threads()}
    names = [m.name for m in methods]
    block = args.block_size or next((m.backend.block_size for m in methods if m.name == "dflash"), None)
    header = header_line(Path(args.target).name, weights_label(args.dtype, weights), block, bool(args.block_size), args.num_prompts, args.max_new_tokens,
                         torch.get_num_threads())
    table = markdown(results, names, header + "\n\n" + floor_line(floor)) + "\nIn short:\n\n" + "\n".join(verdict(results, names, args.dtype)) + "\n"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "bench.md").write_text(table)
    plotted = plot(results, names, out / "bench.png")
    print(table)
    print(f"wrote {out / 'bench.json'}, {out / 'bench.md'}" + (f", {out / 'bench.png'}" if plotted else ""), file=sys.stderr)
    return 0


def register_cli(sub) -> None:
    from .flags import HELP_FORMAT, positive_int
    from .loading import add_model_flags

    b = sub.add_parser("bench", help="benchmark DFlash against autoregressive decoding on the shipped prompt sets", formatter_class=HELP_FORMAT,
                       description="AR vs the EAGLE-3-style baseline vs DFlash (and DFlash with the draft length from the step cost) "
                                   "on the shipped prompt sets, one table per run: tau, tokens/s, speedup over AR, how many outputs "
                                   "equal AR's, plus a concurrency sweep. Writes bench.json, bench.md and bench.png to --out.")
    add_model_flags(b, "bench", serving=False, cpu_weights=True)
    b.add_argument("--eagle", help="EAGLE-3-style baseline drafter directory (chain length = its block_size - 1)")
    b.add_argument("--domains", default=",".join(EVAL_DOMAINS), help="comma-separated prompt sets")
    b.add_argument("--num-prompts", type=positive_int, default=8, help="prompts per domain")
    b.add_argument("--max-new-tokens", type=positive_int, default=128, help="tokens generated per prompt at most")
    b.add_argument("--draft-length", choices=["auto", "fixed"], default="auto",
                   help="auto: also run 'dflash-auto', DFlash with each step's draft length from the step-cost calibration (see generate)")
    b.add_argument("--tree", metavar="N[,N...]", help="also run 'dflash-treeN': tree verification (greedy) of N draft tokens from each "
                                                     "slot's top-k (see generate --tree), once per N")
    b.add_argument("--tree-top-k", type=int, default=4, metavar="K", help="candidates kept per block slot for --tree")
    b.add_argument("--concurrency", default="1,2,4,8,16", help="comma-separated batch sizes for the sweep ('' to skip)")
    b.add_argument("--peer", action="append", choices=PEERS, default=[],
                   help="also run a peer at batch 1 (repeatable): transformers (generate, greedy and prompt lookup, fp32) or "
                        "llama.cpp (llama-cpp-python greedy on the GGUF; pip install -e '.[peers]')")
    b.add_argument("--gguf", help="the GGUF for --peer llama.cpp (default: the one `fetch-models` read for --target)")
    b.add_argument("--out", default="bench-results", help="output directory")
    b.add_argument("--quiet", action="store_true", help="no progress bars")
    b.set_defaults(func=cmd_bench)
