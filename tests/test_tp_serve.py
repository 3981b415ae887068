"""`mpirun -n 2 dflash-trt serve --checkpoint DIR` (a tiny random Llama + drafter converted with --tp 2, fp32):
rank 0 serves HTTP, rank 1 follows its engine. Completions (plain, streamed, a concurrent batch, after an idle
longer than the group's timeout, beside seedless sampled and abandoned requests) equal TP=1 plain greedy decoding
of the original model; SIGTERM to rank 0 ends every rank with exit code 0; a follower killed mid-request fails
the requests in flight with 500 and ends the job, never hangs.
"""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from conftest import write_drafter, write_target, write_tokenizer
from test_serve import GREEDY, sse_events
from test_tp import MPIRUN, QUIET

from dflash_trt.convert import convert
from dflash_trt.runtime import Generator
from dflash_trt.sampling import SamplingParams
from dflash_trt.loading import load_torch_backend

PROMPTS = ["def add(a, b):", "The quick brown fox", "hello world", "return a + b"]
TP_TIMEOUT_S = 4.0  # small, so the test can idle past it: heartbeats every 1 s keep the group alive
TIMEOUT = httpx.Timeout(30.0)


@pytest.fixture(scope="module")
def tp_checkpoint(tmp_path_factory):
    """The tp=2 checkpoint and prompt ids → TP=1 plain greedy continuation of the original target (ignore_eos)."""
    root = tmp_path_factory.mktemp("tp_serve")
    target = write_target(root / "target", "llama", seed=5, vocab_size=99)  # 99 pads to 100: a padded vocab shard
    write_tokenizer(target, 99)
    drafter = write_drafter(root / "drafter", target, num_layers=2, block_size=8)
    convert(target, drafter, root / "tp2", dtype="fp32", tp=2, **QUIET)
    gen = Generator(load_torch_backend(str(target), None, num_pages=256), max_batch=8, use_drafter=False)

    def reference(prompt_ids: list[int], max_tokens: int) -> list[int]:
        return gen.generate([prompt_ids], SamplingParams(max_new_tokens=max_tokens, ignore_eos=True))[0].output_ids

    return root / "tp2", reference


class MpiServer:
    """`mpirun -n 2 dflash-trt serve` on a free loopback port; output to files (read them on failure)."""

    def __init__(self, checkpoint: Path, tmp: Path):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        self.out, self.err = open(tmp / "stdout", "w+"), open(tmp / "stderr", "w+")
        cmd = [*MPIRUN, "-n", "2", sys.executable, "-m", "dflash_trt.cli", "serve", "--checkpoint", str(checkpoint),
               "--port", str(port), "--model-name", "tiny", "--max-model-len", "256", "--page-size", "4", "--threads", "1",
               "--tp-timeout", str(TP_TIMEOUT_S), "--log-level", "warning"]
        self.proc = subprocess.Popen(cmd, stdout=self.out, stderr=self.err, env=dict(os.environ, OMP_NUM_THREADS="1"))

    def logs(self) -> str:
        self.out.flush(), self.err.flush()
        return Path(self.out.name).read_text()[-2000:] + Path(self.err.name).read_text()[-4000:]

    def wait_healthy(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while True:
            assert self.proc.poll() is None, f"mpirun exited with {self.proc.returncode}:\n{self.logs()}"
            assert time.monotonic() < deadline, f"/health never answered:\n{self.logs()}"
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)

    def rank_pids(self) -> dict[int, int]:
        """Rank → pid of mpirun's children (Open MPI starts the ranks of a single-node job itself)."""
        pids = {}
        for entry in Path("/proc").iterdir():
            try:
                if entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == self.proc.pid:
                    env = dict(kv.split("=", 1) for kv in (entry / "environ").read_text().split("\0") if "=" in kv)
                    pids[int(env["OMPI_COMM_WORLD_RANK"])] = int(entry.name)
            except (OSError, KeyError, IndexError, ValueError):
                continue  # exited meanwhile, or not a rank
        assert sorted(pids) == [0, 1], pids
        return pids

    def wait(self, timeout: float) -> tuple[int, float]:
        start = time.monotonic()
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            pytest.fail(f"mpirun still running {timeout} s later:\n{self.logs()}")
        return code, time.monotonic() - start

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.out.close(), self.err.close()


@pytest.fixture
def mpi_server(tp_checkpoint, tmp_path):
    server = MpiServer(tp_checkpoint[0], tmp_path)
    try:
        server.wait_healthy()
        yield server
    finally:
        server.close()


async def _completion(c: httpx.AsyncClient, prompt: str, max_tokens: int, stream: bool) -> list[int]:
    body = {**GREEDY, "prompt": prompt, "max_tokens": max_tokens, "stream": stream}
    if not stream:
        r = await c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]
    async with c.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        events = sse_events([line async for line in r.aiter_lines()])
    return [t for e in events for t in e["choices"][0]["token_ids"]]


def test_tp2_server_returns_tp1_greedy_tokens_and_every_rank_exits_0_on_sigterm(tp_checkpoint, mpi_server):
    checkpoint, reference = tp_checkpoint
    from dflash_trt.loading import load_tokenizer

    tokenizer = load_tokenizer(checkpoint)
    jobs = [(p, n, stream) for (p, n), stream in zip(zip(PROMPTS * 2, (24, 9, 40, 17, 5, 31, 12, 28)), [False, True] * 4)]

    async def sampled(c):  # no seed: rank 0 draws it and sends it, or the ranks' samples (and shapes) would part
        r = await c.post("/v1/completions", json={**GREEDY, "prompt": PROMPTS[3], "max_tokens": 20, "temperature": 1.0})
        assert r.status_code == 200, r.text
        return len(r.json()["choices"][0]["token_ids"])

    async def abandoned(c):  # a client that leaves mid-stream: rank 0 cancels it, and rank 1 must too
        async with c.stream("POST", "/v1/completions", json={**GREEDY, "prompt": PROMPTS[0], "max_tokens": 200, "stream": True}) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    return 0

    async def batch():  # concurrent: requests join and leave the running batch at step boundaries, on both ranks
        async with httpx.AsyncClient(base_url=mpi_server.url, timeout=TIMEOUT) as c:
            others = asyncio.gather(sampled(c), sampled(c), abandoned(c))
            results = await asyncio.gather(*(_completion(c, p, n, s) for p, n, s in jobs))
            assert await others == [20, 20, 0]
            return results

    async def one(prompt, n, stream):
        async with httpx.AsyncClient(base_url=mpi_server.url, timeout=TIMEOUT) as c:
            return await _completion(c, prompt, n, stream)

    assert asyncio.run(one(PROMPTS[0], 24, False)) == reference(tokenizer.encode(PROMPTS[0]), 24)
    assert asyncio.run(one(PROMPTS[1], 30, True)) == reference(tokenizer.encode(PROMPTS[1]), 30)
    for (prompt, n, _), got in zip(jobs, asyncio.run(batch())):
        assert got == reference(tokenizer.encode(prompt), n), prompt
    time.sleep(TP_TIMEOUT_S + 1)  # idle past the group's timeout: rank 0's heartbeats keep rank 1 waiting
    assert httpx.get(mpi_server.url + "/health").status_code == 200
    assert asyncio.run(one(PROMPTS[2], 16, True)) == reference(tokenizer.encode(PROMPTS[2]), 16)

    os.kill(mpi_server.rank_pids()[0], signal.SIGTERM)  # the server's shutdown: rank 0 tells rank 1 to stop
    code, seconds = mpi_server.wait(timeout=20)
    assert code == 0, mpi_server.logs()  # mpirun exits 0 only when every rank did
    assert seconds < 10


def test_a_follower_killed_mid_request_fails_its_requests_with_500_and_ends_the_job(mpi_server):
    async def go():
        async with httpx.AsyncClient(base_url=mpi_server.url, timeout=TIMEOUT) as c:
            body = {**GREEDY, "prompt": PROMPTS[0], "max_tokens": 200}
            plain = asyncio.create_task(c.post("/v1/completions", json={**body, "prompt": PROMPTS[1]}))
            lines = []
            async with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                assert r.status_code == 200
                async for line in r.aiter_lines():
                    lines.append(line)
                    if len(lines) == 1:  # both requests are running: kill rank 1 between two collectives
                        os.kill(mpi_server.rank_pids()[1], signal.SIGKILL)
            try:  # rank 0 may already be stopping (mpirun signals it too); if it answers, it is unhealthy
                health = (await c.get("/health")).status_code
            except httpx.TransportError:
                health = None
            return lines, await plain, health

    start = time.monotonic()
    lines, plain, health = asyncio.run(asyncio.wait_for(go(), 30))
    events = sse_events(lines)
    assert events[-1]["error"]["type"] == "internal_error", events[-1]  # EngineStepError: the stream's 500
    assert "another rank died or timed out" in events[-1]["error"]["message"]
    assert plain.status_code == 500 and plain.json()["error"]["type"] == "internal_error", plain.text
    assert health in (503, None)
    code, _ = mpi_server.wait(timeout=20)
    assert code != 0
    assert time.monotonic() - start < 20
    assert "error: [rank 0/2] the engine stopped" in mpi_server.logs()
