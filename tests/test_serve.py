"""The OpenAI-compatible server, over a real uvicorn on loopback with the tiny random models.

References are independent of the server: plain greedy decoding (no drafter) on a separately
loaded backend, and the tokenizer's own encode / decode / chat template."""

from __future__ import annotations

import asyncio
import json
import re

import httpx
import pytest

pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")

from dflash_trt.loading import encode_prompt
from dflash_trt.runtime import Generator
from dflash_trt.sampling import SamplingParams
from dflash_trt.serve.engine import load_model
from dflash_trt.serve.loopback import LoopbackServer as LiveServer
from dflash_trt.serve.server import Server
from dflash_trt.loading import load_torch_backend

PROMPTS = ["def add(a, b):", "The quick brown fox", "hello world", "The lazy dog", "return a + b", "quick fox jumps"]
MAX_MODEL_LEN = 320
TIMEOUT = httpx.Timeout(60.0)


def start(tiny_dirs, max_batch=8, max_queue=64, drafter=True) -> LiveServer:
    target, drafter_dir = tiny_dirs
    model = load_model(str(target), str(drafter_dir) if drafter else None, max_batch=max_batch, max_model_len=MAX_MODEL_LEN)
    return LiveServer(Server(model, "tiny", max_queue=max_queue, default_max_tokens=32))


@pytest.fixture(scope="module")
def live(tiny_dirs):
    with start(tiny_dirs) as s:
        yield s


@pytest.fixture(scope="module")
def tokenizer(live):
    return live.server.tokenizer


@pytest.fixture(scope="module")
def reference(tiny_dirs):
    """prompt ids → plain greedy continuation (target only, its own backend, ignore_eos)."""
    target, _ = tiny_dirs
    gen = Generator(load_torch_backend(str(target), None, num_pages=256), eos_token_ids=[2], max_batch=8, use_drafter=False)
    cache: dict[tuple, list[int]] = {}

    def run(prompt_ids: list[int], max_tokens: int) -> list[int]:
        key = tuple(prompt_ids)
        if key not in cache or len(cache[key]) < max_tokens:
            cache[key] = gen.generate([list(prompt_ids)], SamplingParams(max_new_tokens=max(max_tokens, 48), ignore_eos=True))[0].output_ids
        return cache[key][:max_tokens]

    return run


def sse_events(lines: list[str]) -> list:
    """`data: ...` lines → parsed JSON events; the stream must end with [DONE]."""
    data = [line[len("data: "):] for line in lines if line.startswith("data: ")]
    assert data and data[-1] == "[DONE]", data[-3:]
    return [json.loads(d) for d in data[:-1]]


async def stream_post(client: httpx.AsyncClient, url: str, body: dict) -> list:
    async with client.stream("POST", url, json=body) as r:
        assert r.status_code == 200, await r.aread()
        assert r.headers["content-type"].startswith("text/event-stream")
        return sse_events([line async for line in r.aiter_lines()])


def metric(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name)}{re.escape(labels)} (\S+)$", text, re.MULTILINE)
    assert m, f"{name}{labels} not in /metrics"
    return float(m.group(1))


GREEDY = {"model": "tiny", "temperature": 0, "ignore_eos": True, "return_token_ids": True}


def test_completion_equals_plain_greedy_decoding(live, tokenizer, reference):
    with httpx.Client(base_url=live.url, timeout=TIMEOUT) as c:
        for prompt, n in zip(PROMPTS[:3], (24, 7, 40)):
            r = c.post("/v1/completions", json={**GREEDY, "prompt": prompt, "max_tokens": n})
            assert r.status_code == 200, r.text
            body = r.json()
            ids = tokenizer.encode(prompt)
            want = reference(ids, n)
            choice = body["choices"][0]
            assert choice["token_ids"] == want
            assert choice["text"] == tokenizer.decode(want, skip_special_tokens=True)
            assert choice["finish_reason"] == "length"
            assert body["object"] == "text_completion" and body["model"] == "tiny"
            assert body["usage"] == {"prompt_tokens": len(ids), "completion_tokens": n, "total_tokens": len(ids) + n}
            stats = body["dflash"]
            # the first token comes from prefill; every later one from a verify step
            assert sum(int(k) * v for k, v in stats["acceptance_histogram"].items()) == n - 1
            assert stats["tau"] == pytest.approx((n - 1) / stats["verify_steps"], abs=1e-3)
            assert stats["block_size"] == 8


def test_streamed_completion_equals_plain_greedy_decoding(live, tokenizer, reference):
    async def go():
        async with httpx.AsyncClient(base_url=live.url, timeout=TIMEOUT) as c:
            body = {**GREEDY, "prompt": PROMPTS[1], "max_tokens": 30, "stream": True, "stream_options": {"include_usage": True}}
            return await stream_post(c, "/v1/completions", body)

    events = asyncio.run(go())
    want = reference(tokenizer.encode(PROMPTS[1]), 30)
    *chunks, usage = events
    assert [t for e in chunks for t in e["choices"][0]["token_ids"]] == want
    assert "".join(e["choices"][0]["text"] for e in chunks) == tokenizer.decode(want, skip_special_tokens=True)
    assert [e["choices"][0]["finish_reason"] for e in chunks] == [None] * (len(chunks) - 1) + ["length"]
    assert all(e["usage"] is None and e["object"] == "text_completion" for e in chunks)
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 30
    assert usage["dflash"]["verify_steps"] >= 1


def test_chat_applies_the_chat_template(live, tokenizer, reference):
    question = "hello world"
    prompt_ids = encode_prompt(tokenizer, question, chat=True)  # the generate CLI's encoding
    want = reference(prompt_ids, 20)
    msg = {**GREEDY, "messages": [{"role": "user", "content": question}], "max_completion_tokens": 20}
    with httpx.Client(base_url=live.url, timeout=TIMEOUT) as c:
        body = c.post("/v1/chat/completions", json=msg).json()
    assert body["object"] == "chat.completion"
    assert body["choices"][0]["token_ids"] == want
    assert body["choices"][0]["message"] == {"role": "assistant", "content": tokenizer.decode(want, skip_special_tokens=True)}
    assert body["usage"]["prompt_tokens"] == len(prompt_ids)

    async def go():
        async with httpx.AsyncClient(base_url=live.url, timeout=TIMEOUT) as c:
            return await stream_post(c, "/v1/chat/completions", {**msg, "stream": True})

    events = asyncio.run(go())
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(e["object"] == "chat.completion.chunk" for e in events)
    assert "".join(e["choices"][0]["delta"].get("content", "") for e in events) == body["choices"][0]["message"]["content"]
    assert events[-1]["choices"][0]["finish_reason"] == "length"


def test_stop_string_cuts_the_text_before_it(live, tokenizer, reference):
    ids = tokenizer.encode(PROMPTS[0])
    full = tokenizer.decode(reference(ids, 40), skip_special_tokens=True)
    stop = full[len(full) // 2 : len(full) // 2 + 3]
    assert stop.strip(), full
    with httpx.Client(base_url=live.url, timeout=TIMEOUT) as c:
        body = c.post("/v1/completions", json={**GREEDY, "prompt": PROMPTS[0], "max_tokens": 40, "stop": [stop]}).json()
    assert body["choices"][0]["text"] == full[: full.find(stop)]
    assert body["choices"][0]["finish_reason"] == "stop"
    assert body["usage"]["completion_tokens"] < 40


def test_64_concurrent_streams_deliver_every_token_in_order(live, tokenizer, reference):
    jobs = [(PROMPTS[i % len(PROMPTS)], 8 + (i * 7) % 33) for i in range(64)]
    wants = [reference(tokenizer.encode(p), n) for p, n in jobs]

    async def one(c, prompt, n):
        return await stream_post(c, "/v1/completions", {**GREEDY, "prompt": prompt, "max_tokens": n, "stream": True})

    async def go():
        limits = httpx.Limits(max_connections=80, max_keepalive_connections=80)
        async with httpx.AsyncClient(base_url=live.url, timeout=TIMEOUT, limits=limits) as c:
            return await asyncio.wait_for(asyncio.gather(*(one(c, p, n) for p, n in jobs)), 90)

    live.wait_idle()
    steps_before = metric(httpx.get(live.url + "/metrics").text, "dflash_engine_steps_total")
    results = asyncio.run(go())
    for (prompt, n), want, events in zip(jobs, wants, results):
        assert [t for e in events for t in e["choices"][0]["token_ids"]] == want, prompt
        assert "".join(e["choices"][0]["text"] for e in events) == tokenizer.decode(want, skip_special_tokens=True)
    live.wait_idle()
    # continuous batching: requests shared engine steps (one at a time would need a step per verify step each)
    engine_steps = metric(httpx.get(live.url + "/metrics").text, "dflash_engine_steps_total") - steps_before
    verify_steps = sum(events[-1]["dflash"]["verify_steps"] for events in results)
    assert engine_steps < verify_steps / 4, (engine_steps, verify_steps)


def test_per_request_sampling_parameters(live, tokenizer, reference):
    def complete(c, **params):
        r = c.post("/v1/completions", json={**GREEDY, "prompt": PROMPTS[4], "max_tokens": 20, **params})
        assert r.status_code == 200, r.text
        return r.json()["choices"][0]["token_ids"]

    with httpx.Client(base_url=live.url, timeout=TIMEOUT) as c:
        first = complete(c, temperature=1.0, seed=11)
        assert complete(c, temperature=1.0, seed=11) == first  # a seed makes sampling reproducible
        others = [complete(c, temperature=1.0, seed=s) for s in (12, 13, 14)]
        assert any(o != first for o in others)
        # top_p → 0 keeps only the most likely token: sampling then equals greedy decoding
        assert complete(c, temperature=1.0, top_p=1e-6, seed=5) == reference(tokenizer.encode(PROMPTS[4]), 20)
        assert complete(c, temperature=0.7, top_k=1, seed=6) == reference(tokenizer.encode(PROMPTS[4]), 20)


def test_disconnected_clients_are_cancelled_and_free_their_kv_pages(live):
    backend = live.server.model.generator.backend
    live.wait_idle()
    free_before = (backend.target_cache.num_free_pages, backend.drafter_cache.num_free_pages)
    with httpx.Client(base_url=live.url, timeout=TIMEOUT) as c:
        before = c.get("/metrics").text
    max_tokens = 280  # far more than the few chunks each client reads

    async def read_then_leave(c, i):
        body = {**GREEDY, "prompt": PROMPTS[i % len(PROMPTS)], "max_tokens": max_tokens, "stream": True}
        async with c.stream("POST", "/v1/completions", json=body) as r:
            got = 0
            async for line in r.aiter_lines():
                got += line.startswith("data: ")
                if got == 2:
                    return got  # leaving the block closes the connection mid-stream

    async def go():
        limits = httpx.Limits(max_connections=40)
        async with httpx.AsyncClient(base_url=live.url, timeout=TIMEOUT, limits=limits) as c:
            return await asyncio.wait_for(asyncio.gather(*(read_then_leave(c, i) for i in range(20))), 60)

    assert asyncio.run(go()) == [2] * 20
    live.wait_idle()
    assert (backend.target_cache.num_free_pages, backend.drafter_cache.num_free_pages) == free_before
    assert backend.target_cache.num_free_pages == backend.num_pages
    with httpx.Client(base_url=live.url, timeout=TIMEOUT) as c:
        after = c.get("/metrics").text
    cancelled = '{endpoint="completions",finish_reason="cancelled"}'
    assert metric(after, "dflash_requests_total", cancelled) - (metric(before, "dflash_requests_total", cancelled) if cancelled in before else 0) == 20
    generated = metric(after, "dflash_generation_tokens_total") - metric(before, "dflash_generation_tokens_total")
    assert generated < 20 * max_tokens / 2  # cancelled early, not run to the end
    assert metric(after, "dflash_kv_free_pages") == backend.num_pages


def test_bad_requests_get_400_with_an_openai_error_body(live):
    cases = [
        ("not json", b'{"model": "tiny", "prompt": ', None),
        ("not an object", b"[1, 2]", None),
        ("no prompt", {"model": "tiny"}, "prompt"),
        ("bad temperature", {"model": "tiny", "prompt": "hi", "temperature": -1}, "temperature"),
        ("bad top_p", {"model": "tiny", "prompt": "hi", "top_p": 0}, "top_p"),
        ("zero max_tokens", {"model": "tiny", "prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ("string max_tokens", {"model": "tiny", "prompt": "hi", "max_tokens": "ten"}, "max_tokens"),
        ("n > 1", {"model": "tiny", "prompt": "hi", "n": 2}, None),
        ("logprobs", {"model": "tiny", "prompt": "hi", "logprobs": 3}, None),
        ("five stops", {"model": "tiny", "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, None),
        ("token id outside the vocabulary", {"model": "tiny", "prompt": [5, 96]}, "prompt"),
        ("empty messages", {"model": "tiny", "messages": []}, "messages"),
        ("bad role", {"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ]
    with httpx.Client(base_url=live.url, timeout=TIMEOUT) as c:
        for name, body, param in cases:
            url = "/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions"
            r = c.post(url, content=body, headers={"content-type": "application/json"}) if isinstance(body, bytes) else c.post(url, json=body)
            assert r.status_code == 400, (name, r.status_code, r.text)
            err = r.json()["error"]
            assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error", name
            assert err["message"] and err["param"] == param, (name, err)
        r = c.post("/v1/completions", json={"model": "other", "prompt": "hi"})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        assert c.get("/health").status_code == 200
        r = c.post("/v1/completions", json={**GREEDY, "prompt": "hi", "max_tokens": 3})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_oversize_prompts_get_400_context_length_exceeded(live):
    with httpx.Client(base_url=live.url, timeout=TIMEOUT) as c:
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": [5] * MAX_MODEL_LEN})
        assert r.status_code == 400
        assert r.json()["error"]["code"] == "context_length_exceeded" and r.json()["error"]["param"] == "prompt"
        r = c.post("/v1/completions", json={"model": "tiny", "prompt": [5] * 300, "max_tokens": MAX_MODEL_LEN - 299})
        assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
        r = c.post("/v1/chat/completions", json={"model": "tiny", "messages": [{"role": "user", "content": "hello world " * 200}]})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
        # exactly at the limit is fine
        r = c.post("/v1/completions", json={**GREEDY, "prompt": [5] * 300, "max_tokens": MAX_MODEL_LEN - 300})
        assert r.status_code == 200 and r.json()["usage"]["total_tokens"] == MAX_MODEL_LEN


def test_full_queue_gets_429_with_retry_after(tiny_dirs):
    with start(tiny_dirs, max_batch=1, max_queue=1) as live:

        async def go():
            async with httpx.AsyncClient(base_url=live.url, timeout=TIMEOUT) as c:
                body = {**GREEDY, "prompt": "hello", "max_tokens": 280, "stream": True}
                async with c.stream("POST", "/v1/completions", json=body) as r1, c.stream("POST", "/v1/completions", json=body) as r2:
                    assert r1.status_code == r2.status_code == 200  # one running, one waiting
                    full = await c.post("/v1/completions", json={**GREEDY, "prompt": "hi", "max_tokens": 2})
                return full

        full = asyncio.run(go())
        assert full.status_code == 429
        assert int(full.headers["retry-after"]) >= 1
        assert full.json()["error"]["type"] == "rate_limit_error" and full.json()["error"]["message"]
        live.wait_idle()
        r = httpx.post(live.url + "/v1/completions", json={**GREEDY, "prompt": "hi", "max_tokens": 2}, timeout=TIMEOUT)
        assert r.status_code == 200  # the slots came back


def test_metrics_count_dflash_steps_like_the_responses(live):
    with httpx.Client(base_url=live.url, timeout=TIMEOUT) as c:
        live.wait_idle()
        before = c.get("/metrics").text
        body = c.post("/v1/completions", json={**GREEDY, "prompt": PROMPTS[2], "max_tokens": 33}).json()
        live.wait_idle()
        after = c.get("/metrics").text
        models = c.get("/v1/models").json()
    assert models["data"][0]["id"] == "tiny" and models["data"][0]["max_model_len"] == MAX_MODEL_LEN

    def delta(name):
        return metric(after, name) - metric(before, name)

    assert delta("dflash_verify_steps_total") == body["dflash"]["verify_steps"]
    assert delta("dflash_committed_tokens_total") == 32
    assert delta("dflash_accepted_length_count") == body["dflash"]["verify_steps"]
    assert metric(after, "dflash_tau") == pytest.approx(metric(after, "dflash_committed_tokens_total") / metric(after, "dflash_verify_steps_total"))
    assert metric(after, "dflash_block_size") == 8


def test_openai_client_reads_the_server(live, tokenizer, reference):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=live.url + "/v1", api_key="unused", timeout=60, max_retries=0)
    want = tokenizer.decode(reference(tokenizer.encode(PROMPTS[3]), 16), skip_special_tokens=True)
    extra = {"ignore_eos": True}
    done = client.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=16, temperature=0, extra_body=extra)
    assert done.choices[0].text == want and done.usage.completion_tokens == 16
    chunks = list(client.completions.create(model="tiny", prompt=PROMPTS[3], max_tokens=16, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body=extra))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == want
    assert chunks[-1].usage.completion_tokens == 16
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5, temperature=0,
                                          extra_body=extra)
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 5
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="tiny", prompt="hi", temperature=5)


@pytest.mark.parametrize("failing", ["prefill", "verify"])
def test_a_failing_step_answers_500_and_the_server_keeps_serving(tiny_dirs, failing):
    with start(tiny_dirs) as live:
        generator = live.server.model.generator
        backend = generator.backend
        method = getattr(backend, failing)
        calls = []

        def broken_once(*args):
            calls.append(1)
            if len(calls) == 1:
                raise RuntimeError("injected backend failure")
            return method(*args)

        setattr(backend, failing, broken_once)
        with httpx.Client(base_url=live.url, timeout=TIMEOUT) as c:
            r = c.post("/v1/completions", json={**GREEDY, "prompt": "hello", "max_tokens": 10})
            assert r.status_code == 500 and r.json()["error"]["type"] == "internal_error"
            assert "injected backend failure" in r.json()["error"]["message"]
            live.wait_idle()
            # every page is back: in the backend's pools and in the Generator's admission budget
            assert backend.target_cache.num_free_pages == backend.num_pages
            assert backend.drafter_cache.num_free_pages == backend.num_pages
            assert generator.pages_reserved == 0
            assert c.get("/health").status_code == 200
            r = c.post("/v1/completions", json={**GREEDY, "prompt": "hello", "max_tokens": 10})
            assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 10


def test_serve_cli_rejects_bad_arguments_with_exit_code_2(tiny_dirs, tmp_path, capsys):
    from dflash_trt.cli import main

    target, _ = tiny_dirs
    assert main(["serve", "--target", str(target)]) == 2 and "--drafter" in capsys.readouterr().err
    assert main(["serve", "--target", str(tmp_path / "missing"), "--no-drafter"]) == 2
    with pytest.raises(SystemExit) as e:  # the parser refuses counts below 1, naming the flag
        main(["serve", "--target", str(target), "--no-drafter", "--max-batch", "0"])
    assert e.value.code == 2 and "argument --max-batch: must be >= 1" in capsys.readouterr().err


def test_a_converted_checkpoint_serves_the_same_tokens(tiny_dirs, tmp_path, reference, capsys):
    """--checkpoint DIR (dflash-trt convert --tp 1, fp32: exact) serves what the original target decodes."""
    import argparse

    from dflash_trt.cli import main
    from dflash_trt.convert import convert
    from dflash_trt.serve import _model_args, _resolve_dirs

    target, drafter = tiny_dirs
    ckpt = tmp_path / "ckpt"
    convert(target, drafter, ckpt, dtype="fp32", progress=False, log=lambda m: None)
    parser = argparse.ArgumentParser()
    _model_args(parser)
    args = parser.parse_args(["--checkpoint", str(ckpt)])
    _resolve_dirs(args)
    assert (args.target, args.drafter, args.tokenizer, args.model_name) == (str(ckpt / "target"), str(ckpt / "drafter"), str(ckpt), "ckpt")
    model = load_model(args.target, args.drafter, tokenizer_dir=args.tokenizer, max_model_len=MAX_MODEL_LEN)
    with LiveServer(Server(model, "tiny", default_max_tokens=32)) as live, httpx.Client(base_url=live.url, timeout=TIMEOUT) as c:
        ids = live.server.tokenizer.encode(PROMPTS[0])
        r = c.post("/v1/completions", json={**GREEDY, "prompt": PROMPTS[0], "max_tokens": 20})
        assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == reference(ids, 20)
    assert main(["serve", "--checkpoint", str(ckpt), "--target", str(target)]) == 2 and "--checkpoint" in capsys.readouterr().err
    assert main(["serve", "--no-drafter"]) == 2 and "--target" in capsys.readouterr().err
