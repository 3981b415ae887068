"""The planner's presets against published DFlash figures (issue 18, validation (b)): each published point's
setting in the cost model, with the published τ as the acceptance (constant α), the drafter's whole block drafted
as in those runs, decode only. Writes a markdown report.

    python benchmarks/plan_published.py --out examples/plan/published.md

Sources: shared/reference/released-drafters.md and dflash-peers.md (z-lab README and model cards, SGLang PRs,
z-lab #119), the NVIDIA TensorRT-LLM DFlash blog (2026-06-23) as quoted there.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, replace
from pathlib import Path

from dflash_trt.cost_model import Acceptance, Quant, ar_step, dflash_step
from dflash_trt.plan import Setup, plan, throughput_at
from dflash_trt.presets import HARDWARE, MODELS


@dataclass
class Point:
    what: str
    model: str
    hardware: str
    weights: str
    tp: int
    batch: int
    tau: float
    block: int
    published: float  # the speedup over AR
    source: str
    context: float = 1024
    published_ar: float | None = None  # AR tokens/s per user, where given


POINTS = [
    Point("Qwen3-8B, MATH-500, c1", "qwen3-8b", "B200", "bf16", 1, 1, 8.0, 16, 5.1, "SGLang on one B200: 230 → 1175 tok/s", published_ar=230),
    Point("Qwen3-8B, MATH-500, c32", "qwen3-8b", "B200", "bf16", 1, 32, 8.01, 16, 2.8, "SGLang on one B200"),
    Point("Llama-3.1-8B, HumanEval, c1", "llama-3.1-8b", "B200", "bf16", 1, 1, 4.91, 10, 2.8, "z-lab / SGLang, B200 (paper notes)"),
    Point("Llama-3.1-8B, HumanEval, c32", "llama-3.1-8b", "B200", "bf16", 1, 32, 4.91, 10, 1.8, "z-lab / SGLang, B200 (paper notes)"),
    Point("Llama-3.1-8B, GSM8K, c1", "llama-3.1-8b", "B200", "bf16", 1, 1, 4.32, 10, 2.4, "z-lab / SGLang, B200 (paper notes)"),
    Point("Llama-3.1-8B, GSM8K, c32", "llama-3.1-8b", "B200", "bf16", 1, 32, 4.32, 10, 1.6, "z-lab / SGLang, B200 (paper notes)"),
    Point("gpt-oss-120b, GSM8K, block 4, c1", "gpt-oss-120b", "H200", "mxfp4", 1, 1, 3.3, 4, 1.3, "z-lab gpt-oss-120b-DFlash card, SGLang, one H200"),
    Point("gpt-oss-120b, GSM8K, block 10, c1", "gpt-oss-120b", "H200", "mxfp4", 1, 1, 5.3, 10, 1.8, "same card"),
    Point("gpt-oss-120b, GSM8K, block 4, c16", "gpt-oss-120b", "H200", "mxfp4", 1, 16, 3.3, 4, 1.3, "same card"),
    Point("gpt-oss-120b, GSM8K, block 10, c16", "gpt-oss-120b", "H200", "mxfp4", 1, 16, 5.3, 10, 1.6, "same card"),
]


def quant_for(weights: str) -> Quant:
    return Quant(weights=weights, kv="bf16", lm_head="bf16", activations="bf16")


def modelled(p: Point, hw) -> tuple[float, float]:
    """(AR, DFlash) tokens/s per user at the point's setting on `hw`."""
    m, q = MODELS[p.model], quant_for(p.weights)
    acc = Acceptance.from_tau(p.tau, p.block)
    ar = ar_step(m.target, hw, q, p.tp, p.batch, p.context)
    dflash = dflash_step(m.target, m.drafter, hw, q, p.tp, p.batch, p.context, p.block - 1)
    return 1 / ar.seconds, acc.expected(p.block - 1) / dflash.seconds


def stack_overheads(p: Point, published_dflash: float) -> dict:
    """The two step overheads that make the model give a point's published AR and DFlash tokens/s exactly: what the
    serving stack adds to every step, and to every drafting step."""
    hw = HARDWARE[p.hardware]
    ar_tps, dflash_tps = modelled(p, hw)
    step = 1 / p.published_ar - 1 / ar_tps
    tokens = Acceptance.from_tau(p.tau, p.block).expected(p.block - 1)
    draft = tokens / published_dflash - (tokens / dflash_tps + step)
    return {"step_overhead_us": hw.step_overhead_us + step * 1e6, "draft_step_overhead_us": draft * 1e6}


def point_row(p: Point, calibrated: dict) -> str:
    ar_tps, dflash_tps = modelled(p, HARDWARE[p.hardware])
    speedup = dflash_tps / ar_tps
    cal_ar, cal_dflash = modelled(p, replace(HARDWARE[p.hardware], **calibrated))
    cal = cal_dflash / cal_ar
    ar_cell = f"{ar_tps:.0f}" + (f" (published {p.published_ar:.0f}, {ar_tps / p.published_ar - 1:+.0%})" if p.published_ar else "")
    return (f"| {p.what} | {p.hardware} TP{p.tp} {p.weights} | τ {p.tau} at block {p.block} | {ar_cell} | {dflash_tps:.0f} | "
            f"{speedup:.2f}× | {p.published}× | {speedup / p.published - 1:+.0%} | {cal:.2f}× ({cal / p.published - 1:+.0%}) | {p.source} |")


def b300_report() -> list[str]:
    """gpt-oss-120b on an 8-GPU B300 (NVIDIA blog): throughput of DFlash vs AR (and EAGLE-3) at 500–600 tok/s per user."""
    m = MODELS["gpt-oss-120b"]
    lines = ["", "## gpt-oss-120b on one 8-GPU DGX B300 (NVIDIA's TensorRT-LLM blog, SPEED-Bench coding)", "",
             "Published: more than 15× AR's throughput and 1.5× EAGLE-3's at 500–600 tokens/s per user; over 2× interactivity "
             "at batch 1. Not published: TP, quantization, block size, τ. Modelled: NVFP4 weights, FP8 KV, TP 1/2/4/8 (the best "
             "of each method at the interactivity), batch 1–512, context 2048, DFlash τ 4.4 at block 10 (HumanEval on the "
             "drafter's card), EAGLE-3 τ swept (none is published for this model).", "",
             "| EAGLE-3 τ (7 drafts) | DFlash / AR throughput at ≥ 550 tok/s/user | DFlash / EAGLE-3 | DFlash / AR interactivity at batch 1 (TP 8) |",
             "|---|---|---|---|"]
    for eagle_tau in (2.5, 3.0, 3.5):
        setup = Setup(m.target, m.drafter, m.block_size, m.eagle, HARDWARE["B300"], Quant("nvfp4", "fp8", "bf16", "bf16"),
                      Acceptance.from_tau(4.4, 10), Acceptance.from_tau(eagle_tau, 8))
        result = plan(setup, [1, 2, 4, 8], [1, 2, 4, 8, 16, 32, 64, 128, 256, 512], 2048)
        rows = result["rows"]
        ar, df, ea = (throughput_at(rows, k, 550) for k in ("ar", "dflash", "eagle"))
        b1 = {r["method"]: r for r in rows if r["tp"] == 8 and r["batch"] == 1}
        fmt = lambda a, b: f"{a / b:.1f}×" if a and b else "– (not reached)"  # noqa: E731
        lines.append(f"| {eagle_tau} | {fmt(df, ar)} ({df or 0:.0f} vs {ar or 0:.0f} tok/s per GPU) | {fmt(df, ea)} | "
                     f"{b1['dflash']['per_user_tokens_per_s'] / b1['ar']['per_user_tokens_per_s']:.2f}× |")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    lines = ["# The cost model against published DFlash figures", "",
             "Written by `benchmarks/plan_published.py`. Each point: the published setting in the planner's presets "
             "(`dflash_trt/presets.py`: spec-sheet bandwidth × 0.8, 30 µs per layer, 100 µs per step), the published τ as a "
             "constant per-position acceptance, the whole block drafted every step, mean context 1024, decode only (the "
             "gpt-oss card's speedups include prefill). Nothing here is fitted to these figures.", "",
             "| point | setting | acceptance | AR tok/s per user (model) | DFlash tok/s per user (model) | speedup (model) | "
             "published | model vs published | with the stack's overheads | source |", "|---|---|---|---|---|---|---|---|---|---|"]
    calibrated = stack_overheads(POINTS[0], 1175)
    lines += [point_row(pt, calibrated) for pt in POINTS]
    lines += ["", f"'With the stack's overheads': the one point that publishes both absolute rates (Qwen3-8B c1: AR 230, DFlash "
              f"1175 tok/s) gives the serving stack's step overheads the presets leave out: {calibrated['step_overhead_us']:.0f} µs per "
              f"step (the presets' 100 included) and {calibrated['draft_step_overhead_us']:.0f} µs more per drafting step; "
              "the other points are then predictions."]
    lines += ["", "Reading: with spec-sheet figures alone the model is optimistic by 26–104%: it leaves out what the serving stack "
              "adds per step, which the published AR rate shows (230 tok/s on B200 is 4.3 ms per token against a 3.7 ms model step) "
              "and, larger, what its speculative path adds (1.8 ms per drafting step on that point). With those two terms from that "
              "one point, the batch-1 points land within 15% (Llama-3.1-8B +11% / +14%, gpt-oss-120b +8% / −9%). The batched "
              "points stay high (c16/c32: +19% to +65%): there the model's verify of B·block tokens is compute-bound at 0.6 of "
              "the tensor peak, and the published runs pay more for a wide batched verify than that (attention over the block, "
              "GEMM efficiency at M = 320–512, no CUDA graph for the verify in SGLang at that width): the compute term is the one "
              "that explains the gap."]
    lines += b300_report()
    lines += ["", "The model's 39× is above the published 'more than 15×': at ≥ 550 tok/s per user AR only qualifies at batch "
              "1 in the model, so the ratio divides a batched DFlash configuration by an almost idle GPU; the published "
              "curve's exact AR point is not given. DFlash / EAGLE-3 depends on EAGLE-3's τ, which is not published for "
              "gpt-oss-120b: the published 1.5× corresponds to an EAGLE-3 τ between 2.5 and 3.0 at 7 drafts in the model."]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
