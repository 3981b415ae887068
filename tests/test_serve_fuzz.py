"""Fuzzed requests (issue 20 item 2): random bodies against /v1/completions and /v1/chat/completions — wrong types,
huge / negative / zero counts, n > 1, unknown fields, prompts past the context, invalid UTF-8, empty messages, odd
stop lists. Each gets a valid answer (200) or a 4xx with an OpenAI-style error body, never a 5xx, and the server
answers /health after every case. Property-based (Hypothesis); the case count is printed (`-s`)."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from test_serve import TIMEOUT, start

pytestmark = pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")

COUNTS = st.one_of(st.integers(-5, 40), st.sampled_from([0, -1, 10**9, 2**63]), st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=3),
                   st.none(), st.booleans())
SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-(2**70), 2**70), st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=8))
ANY = st.recursive(SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=6), inner, max_size=4)), max_leaves=8)
PROMPTS = st.one_of(st.text(max_size=40), st.just("word " * 400), st.lists(st.integers(-3, 120), max_size=12), st.lists(st.text(max_size=5), max_size=3), ANY)
STOPS = st.one_of(st.none(), st.text(max_size=4), st.lists(st.text(max_size=4), max_size=6), st.lists(ANY, max_size=3), ANY)
MESSAGES = st.one_of(
    st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "robot", ""]), "content": st.one_of(st.text(max_size=30), ANY)}),
             max_size=3),
    ANY,
)
COMMON = {
    "model": st.one_of(st.just("tiny"), st.text(max_size=5)),
    "max_tokens": COUNTS, "temperature": st.one_of(st.floats(-1, 3), ANY), "top_p": st.one_of(st.floats(-0.5, 1.5), ANY),
    "top_k": COUNTS, "n": COUNTS, "stop": STOPS, "stream": st.booleans(), "seed": COUNTS, "ignore_eos": st.booleans(),
    "logprobs": st.one_of(st.none(), COUNTS), "unknown_field": ANY,
}


def body(endpoint_key: str):
    """Anything from the fields above, or a valid request with one or two of them changed (so that many cases
    are answered, not only refused)."""
    fields = dict(COMMON, **({"prompt": PROMPTS} if endpoint_key == "prompt" else {"messages": MESSAGES}))
    valid = {"model": "tiny", "max_tokens": 4, "temperature": 0}
    valid.update({"prompt": "hello"} if endpoint_key == "prompt" else {"messages": [{"role": "user", "content": "hello"}]})
    one_off = st.lists(st.sampled_from(sorted(fields)), min_size=0, max_size=2, unique=True).flatmap(
        lambda keys: st.fixed_dictionaries({k: fields[k] for k in keys}).map(lambda changed: {**valid, **changed}))
    return st.one_of(st.fixed_dictionaries({}, optional=fields), one_off)


RAW = st.one_of(
    st.binary(max_size=40),  # anything, including invalid UTF-8 and truncated JSON
    st.builds(lambda s: json.dumps({"model": "tiny", "prompt": s}).encode().replace(b"\\u", b"\\x"), st.text(max_size=10)),  # bad escapes
    st.just(b'{"model": "tiny", "prompt": "\xff\xfe"}'),  # a JSON body that is not UTF-8
)
CASES = st.one_of(
    st.tuples(st.just("/v1/completions"), body("prompt")),
    st.tuples(st.just("/v1/chat/completions"), body("messages")),
    st.tuples(st.sampled_from(["/v1/completions", "/v1/chat/completions"]), RAW),
)
SEEN = {"cases": 0, "ok": 0, "4xx": 0}


@pytest.fixture(scope="module")
def live(tiny_dirs):
    with start(tiny_dirs, max_batch=4) as s:
        yield s


def _check(client: httpx.Client, url: str, payload) -> None:
    if isinstance(payload, bytes):
        r = client.post(url, content=payload, headers={"content-type": "application/json"})
    elif payload.get("stream") is True:
        with client.stream("POST", url, json=payload) as r:
            r.read()
    else:
        r = client.post(url, json=payload)
    SEEN["cases"] += 1
    assert r.status_code < 500, (url, payload, r.status_code, r.text[:500])
    if r.status_code == 200:
        SEEN["ok"] += 1
        if not (isinstance(payload, dict) and payload.get("stream") is True):
            assert r.json()["choices"], r.text[:300]
    else:
        SEEN["4xx"] += 1
        err = r.json()["error"]
        assert {"message", "type", "param", "code"} <= set(err) and err["message"], r.text[:300]
    assert client.get("/health").status_code == 200


@settings(max_examples=160, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow], derandomize=True)
@given(case=CASES)
def test_random_requests_get_an_answer_or_a_4xx_and_the_server_stays_healthy(live, case):
    url, payload = case
    with httpx.Client(base_url=live.url, timeout=TIMEOUT) as c:
        _check(c, url, payload)


def test_after_the_fuzzing_the_engine_is_idle_and_every_page_is_back(live):
    live.wait_idle()
    backend = live.server.model.generator.backend
    assert backend.target_cache.num_free_pages == backend.num_pages
    assert live.server.model.generator.pages_reserved == 0
    print(f"\nfuzzed requests: {SEEN['cases']} cases, {SEEN['ok']} answered, {SEEN['4xx']} refused with a 4xx")
    assert SEEN["cases"] >= 100 and SEEN["ok"] >= 10 and SEEN["4xx"] >= 10
