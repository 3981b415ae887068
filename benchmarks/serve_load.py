"""Bounded load run against `dflash-trt serve`: requests/s and tokens/s at several concurrencies,
plain autoregressive decoding vs DFlash, on the same target.

For each mode it starts a server subprocess, waits for /health, then for each concurrency C
keeps C streamed chat requests in flight until `--requests-per-level` (default 2·C, at least 4)
have completed or `--level-time-limit` seconds have passed (then the rest are cancelled and
not counted). Greedy, ignore_eos, fixed max_tokens, so both modes generate the same tokens.

    python benchmarks/serve_load.py --target ~/.cache/dflash-trt/SmolLM2-135M-Instruct \
        --drafter examples/drafters/smollm2-dflash-b16 --concurrency 1,8,32 --out serve-load.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

PROMPTS = [
    "Write a Python function that reverses a string.",
    "What is 17 * 23? Show your steps.",
    "Write a Python function that checks whether a number is prime.",
    "A train travels 60 km in 45 minutes. What is its average speed in km/h?",
    "Explain what a hash map is in two sentences.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "If a shirt costs $20 after a 20% discount, what was the original price?",
    "Write a function that merges two sorted lists into one sorted list.",
]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(args, drafter: str | None, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "dflash_trt.cli", "serve", "--target", args.target, "--port", str(port),
           "--max-batch", str(args.max_batch), "--max-queue", str(max(args.levels) * 2), "--max-model-len", str(args.max_model_len),
           "--dtype", args.dtype, "--threads", str(args.threads), "--model-name", "bench", "--log-level", "warning"]
    cmd += ["--drafter", drafter] if drafter else ["--no-drafter"]
    if drafter and args.max_verify_tokens:
        cmd += ["--max-verify-tokens", str(args.max_verify_tokens)]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=None)


def wait_healthy(url: str, proc: subprocess.Popen, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the server exited with code {proc.returncode}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise SystemExit("the server did not become healthy")


async def one_request(client: httpx.AsyncClient, prompt: str, max_tokens: int) -> dict:
    body = {"model": "bench", "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    start = time.perf_counter()
    ttft = None
    usage = stats = None
    async with client.stream("POST", "/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            if ttft is None and event["choices"] and event["choices"][0]["delta"].get("content"):
                ttft = time.perf_counter() - start
            if event.get("usage"):
                usage, stats = event["usage"], event.get("dflash")
    return {"latency_s": time.perf_counter() - start, "ttft_s": ttft, "tokens": usage["completion_tokens"], "dflash": stats}


async def run_level(url: str, concurrency: int, num_requests: int, max_tokens: int, time_limit: float) -> dict:
    done: list[dict] = []
    next_prompt = 0
    deadline = time.monotonic() + time_limit
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(base_url=url, timeout=httpx.Timeout(time_limit + 60), limits=limits) as client:

        async def worker():
            nonlocal next_prompt
            while next_prompt < num_requests and time.monotonic() < deadline:
                prompt = PROMPTS[next_prompt % len(PROMPTS)]
                next_prompt += 1
                done.append(await one_request(client, prompt, max_tokens))

        start = time.perf_counter()
        tasks = [asyncio.create_task(worker()) for _ in range(concurrency)]
        try:
            await asyncio.wait_for(asyncio.gather(*tasks), time_limit + 30)
        except TimeoutError:
            pass  # cancelled; the requests that did complete are counted
        wall = time.perf_counter() - start
    tokens = sum(d["tokens"] for d in done)
    steps = sum(d["dflash"]["verify_steps"] for d in done if d["dflash"])
    committed = sum(d["tokens"] - 1 for d in done)
    ttfts = sorted(d["ttft_s"] for d in done if d["ttft_s"] is not None)
    return {
        "concurrency": concurrency, "requests": len(done), "wall_s": round(wall, 2),
        "requests_per_s": round(len(done) / wall, 3), "tokens_per_s": round(tokens / wall, 1),
        "tokens_per_s_per_user": round(sum(d["tokens"] / d["latency_s"] for d in done) / len(done), 1) if done else 0.0,
        "median_ttft_s": round(ttfts[len(ttfts) // 2], 3) if ttfts else None,
        "tau": round(committed / steps, 3) if steps else None,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--target", required=True)
    p.add_argument("--drafter", required=True)
    p.add_argument("--concurrency", default="1,8,32")
    p.add_argument("--requests-per-level", type=int, help="default: 2 x concurrency, at least 4")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--max-batch", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--level-time-limit", type=float, default=120.0, help="seconds per (mode, concurrency) level")
    p.add_argument("--dtype", default="fp32")
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--modes", default="ar,dflash")
    p.add_argument("--max-verify-tokens", type=int, help="DFlash server's verify budget per step (serve --max-verify-tokens)")
    p.add_argument("--out", default="serve-load.json")
    args = p.parse_args()
    args.levels = [int(c) for c in args.concurrency.split(",")]

    results = []
    for mode in args.modes.split(","):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = start_server(args, args.drafter if mode == "dflash" else None, port)
        try:
            wait_healthy(url, proc)
            asyncio.run(run_level(url, 1, 1, 8, args.level_time_limit))  # warm-up, not counted
            for c in args.levels:
                n = args.requests_per_level or max(4, 2 * c)
                row = {"mode": mode, **asyncio.run(run_level(url, c, n, args.max_tokens, args.level_time_limit))}
                print(json.dumps(row), flush=True)
                results.append(row)
        finally:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    Path(args.out).write_text(json.dumps({"max_tokens": args.max_tokens, "dtype": args.dtype, "threads": args.threads,
                                          "results": results}, indent=2))
    print("\n| mode | concurrency | requests | requests/s | tokens/s | tokens/s per user | median TTFT s | τ |")
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['mode']} | {r['concurrency']} | {r['requests']} | {r['requests_per_s']} | {r['tokens_per_s']} | "
              f"{r['tokens_per_s_per_user']} | {r['median_ttft_s']} | {r['tau'] if r['tau'] is not None else '-'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
