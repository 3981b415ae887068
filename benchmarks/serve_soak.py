"""Soak `dflash-trt serve` on loopback (issue 20 item 1): many concurrent streamed requests of mixed lengths, greedy and
sampled, a third of the clients leaving mid-stream, for a bounded count and time. What it checks and reports:

- every greedy request that completed equals plain greedy decoding (the target alone, its own backend);
- no token lost or duplicated: a stream's token ids are as many as its final usage says, and its text is their decoding;
- no 5xx; at the end the engine is idle, in-flight is 0 and every KV page is back;
- RSS of this process (server and clients) once a second, after warm-up flat (the curve is reported);
- p50 / p99 time to first token and inter-token latency.

    python benchmarks/serve_soak.py --target $(dflash-trt fetch-models --quiet) --drafter examples/drafters/smollm2-dflash-b16 \\
        --requests 200 --concurrency 200 --max-minutes 6 --out examples/bench/serve-soak

tests/test_serve_soak.py runs the short form (40 requests, tiny models) in CI and asserts the same invariants.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from pathlib import Path

import httpx

from dflash_trt.serve.loopback import LoopbackServer

PROMPTS = [
    "Write a Python function that reverses a string.", "What is 17 * 23?", "Name three uses of a hash map.",
    "def fibonacci(n):", "Explain recursion in one paragraph.", "List the planets of the solar system.",
    "Translate 'good morning' into French.", "Sort [5, 2, 9, 1] and explain the steps.",
]


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def plan(n: int, seed: int, model: str, max_tokens: tuple[int, int]) -> list[dict]:
    """The workload: prompt, length, greedy or sampled, and after how many chunks the client leaves (None: stays)."""
    rng = random.Random(seed)
    jobs = []
    for i in range(n):
        sampled = i % 3 == 1
        body = {"model": model, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": rng.randint(*max_tokens), "stream": True,
                "ignore_eos": True, "return_token_ids": True, "temperature": 0.8 if sampled else 0.0}
        if sampled:
            body["seed"] = i
        jobs.append({"i": i, "body": body, "leave_after": rng.randint(1, 3) if i % 3 == 2 else None})
    return jobs


async def _one(client: httpx.AsyncClient, job: dict, deadline: float) -> dict:
    out = {"i": job["i"], "status": None, "token_ids": [], "text": "", "ttft_s": None, "gaps_s": [], "left": False, "usage": None, "error": None}
    start = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", "/v1/completions", json=job["body"]) as r:
            out["status"] = r.status_code
            if r.status_code != 200:
                out["error"] = (await r.aread()).decode(errors="replace")[:300]
                return out
            chunks = 0
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                now = time.perf_counter()
                choice = event["choices"][0]
                ids = choice.get("token_ids") or []
                if ids:
                    if last is None:
                        out["ttft_s"] = now - start
                    else:
                        out["gaps_s"].append((now - last) / len(ids))
                    last = now
                out["token_ids"] += ids
                out["text"] += choice.get("text", "")
                if event.get("usage"):
                    out["usage"] = event["usage"]
                chunks += 1
                if job["leave_after"] is not None and chunks >= job["leave_after"]:
                    out["left"] = True
                    return out  # leaving the block closes the connection mid-stream
                if time.perf_counter() > deadline:
                    out["left"] = True
                    return out
    except httpx.HTTPError as e:
        out["error"] = f"{type(e).__name__}: {e}"
    return out


async def run_clients(url: str, jobs: list[dict], concurrency: int, max_seconds: float, rss: list) -> list[dict]:
    deadline = time.perf_counter() + max_seconds
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 8, max_keepalive_connections=concurrency + 8)
    t0 = time.perf_counter()

    async def sample_rss():
        while True:
            rss.append((round(time.perf_counter() - t0, 1), round(rss_mib(), 1)))
            await asyncio.sleep(1.0)

    async def guarded(c, job):
        async with sem:
            if time.perf_counter() > deadline:
                return {"i": job["i"], "status": None, "skipped": True}
            return await _one(c, job, deadline)

    sampler = asyncio.create_task(sample_rss())
    try:
        async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(max_seconds + 60), limits=limits) as c:
            return await asyncio.gather(*(guarded(c, j) for j in jobs))
    finally:
        sampler.cancel()


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def check(results: list[dict], jobs: list[dict], reference, tokenizer, live: LoopbackServer) -> dict:
    """The invariants; returns the report (with `violations`: a list, empty when all hold)."""
    by_i = {j["i"]: j for j in jobs}
    violations = []
    ran = [r for r in results if not r.get("skipped")]
    completed = [r for r in ran if r["status"] == 200 and not r["left"]]
    greedy_done = [r for r in completed if by_i[r["i"]]["body"]["temperature"] == 0]
    five_xx = [r for r in ran if r["status"] is not None and r["status"] >= 500]
    errors = [r for r in ran if r["error"]]
    violations += [f"request {r['i']}: HTTP {r['status']} {r['error']}" for r in five_xx]
    violations += [f"request {r['i']}: {r['error']}" for r in errors if r not in five_xx]
    wants = reference([tokenizer.encode(by_i[r["i"]]["body"]["prompt"]) for r in greedy_done], [by_i[r["i"]]["body"]["max_tokens"] for r in greedy_done])
    for r, want in zip(greedy_done, wants):
        if r["token_ids"] != want:
            violations.append(f"request {r['i']}: greedy output differs from plain decoding")
    for r in completed:
        n = by_i[r["i"]]["body"]["max_tokens"]
        if len(r["token_ids"]) != n or (r["usage"] and r["usage"]["completion_tokens"] != len(r["token_ids"])):
            violations.append(f"request {r['i']}: {len(r['token_ids'])} tokens streamed, usage {r['usage']}, max_tokens {n} (ignore_eos)")
        if r["text"] != tokenizer.decode(r["token_ids"], skip_special_tokens=True):
            violations.append(f"request {r['i']}: streamed text is not the decoding of its token ids")
    live.wait_idle()
    gen = live.server.model.generator
    backend = gen.backend
    pages_back = backend.target_cache.num_free_pages == backend.num_pages and (
        backend.drafter_cache is None or backend.drafter_cache.num_free_pages == backend.num_pages)
    if not pages_back or gen.pages_reserved or live.server.in_flight:
        violations.append(f"not idle at the end: free pages {backend.target_cache.num_free_pages}/{backend.num_pages}, "
                          f"reserved {gen.pages_reserved}, in flight {live.server.in_flight}")
    ttft = [r["ttft_s"] for r in ran if r.get("ttft_s") is not None]
    gaps = [g for r in ran for g in r.get("gaps_s", [])]
    return {
        "requests": len(jobs), "ran": len(ran), "completed": len(completed), "left_mid_stream": sum(r["left"] for r in ran),
        "greedy_checked": len(greedy_done), "http_5xx": len(five_xx), "client_errors": len(errors),
        "tokens_streamed": sum(len(r["token_ids"]) for r in ran),
        "ttft_s": {"p50": percentile(ttft, 0.5), "p99": percentile(ttft, 0.99)},
        "inter_token_s": {"p50": percentile(gaps, 0.5), "p99": percentile(gaps, 0.99), "mean": statistics.fmean(gaps) if gaps else None},
        "kv_pages_back": pages_back, "violations": violations,
    }


def plain_greedy(target_dir: str, dtype: str = "fp32"):
    """prompts, lengths → the target's own greedy continuations (its own backend, no drafter, batched)."""
    from dflash_trt.loading import DTYPES, load_torch_backend
    from dflash_trt.runtime import Generator
    from dflash_trt.sampling import SamplingParams

    backend = load_torch_backend(target_dir, None, DTYPES[dtype], num_pages=2048)
    gen = Generator(backend, eos_token_ids=[], max_batch=16, use_drafter=False)

    def run(prompts: list[list[int]], lengths: list[int]) -> list[list[int]]:
        if not prompts:
            return []
        outs = gen.generate(prompts, [SamplingParams(max_new_tokens=n, ignore_eos=True) for n in lengths])
        return [o.output_ids for o in outs]

    return run


def soak(target: str, drafter: str | None, requests: int, concurrency: int, max_minutes: float, seed: int = 0, dtype: str = "fp32",
         max_batch: int = 16, max_tokens: tuple[int, int] = (8, 64), max_model_len: int = 512) -> tuple[dict, list]:
    from dflash_trt.serve.engine import load_model
    from dflash_trt.serve.server import Server

    model = load_model(target, drafter, dtype=dtype, max_batch=max_batch, max_model_len=max_model_len)
    server = Server(model, "soak", max_queue=max(requests, 64), default_max_tokens=32)
    jobs = plan(requests, seed, "soak", max_tokens)
    rss: list = []
    with LoopbackServer(server) as live:
        start = time.perf_counter()
        results = asyncio.run(run_clients(live.url, jobs, concurrency, max_minutes * 60, rss))
        wall = time.perf_counter() - start
        report = check(results, jobs, plain_greedy(target, dtype), server.tokenizer, live)
    report.update(wall_s=round(wall, 1), concurrency=concurrency, max_batch=max_batch, dtype=dtype, drafter=drafter,
                  rss_mib={"after_warmup": rss[min(len(rss) - 1, 5)][1] if rss else None, "end": rss[-1][1] if rss else None,
                           "max": max(v for _, v in rss) if rss else None,
                           "slope_after_warmup_mib_per_min": rss_slope(rss[5:])})
    return report, rss


def rss_slope(curve: list) -> float | None:
    """Least-squares slope of [(seconds, MiB)] in MiB per minute: how "flat after warm-up" is judged."""
    if len(curve) < 3:
        return None
    ts, vs = [t for t, _ in curve], [v for _, v in curve]
    t0, v0 = statistics.fmean(ts), statistics.fmean(vs)
    den = sum((t - t0) ** 2 for t in ts)
    return round(60 * sum((t - t0) * (v - v0) for t, v in zip(ts, vs)) / den, 2) if den else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", required=True)
    ap.add_argument("--drafter")
    ap.add_argument("--requests", type=int, default=200)
    ap.add_argument("--concurrency", type=int, default=200)
    ap.add_argument("--max-minutes", type=float, default=6.0, help="clients still streaming then leave (bounded in time)")
    ap.add_argument("--max-batch", type=int, default=16)
    ap.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default="bench-results/serve-soak")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(args.threads)
    report, rss = soak(args.target, args.drafter, args.requests, args.concurrency, args.max_minutes, dtype=args.dtype, max_batch=args.max_batch)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "soak.json").write_text(json.dumps({"report": report, "rss_curve": rss}, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    if report["violations"]:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
