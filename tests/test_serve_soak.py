"""The soak's short form (benchmarks/serve_soak.py) in CI: 40 concurrent streamed requests on the tiny models, greedy
and sampled, a third of the clients leaving mid-stream. Every completed greedy request equals plain greedy decoding
(the target alone, its own backend), no token is lost or duplicated, no 5xx, and at the end the engine is idle with
every KV page back."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("uvicorn")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import serve_soak  # noqa: E402


def test_40_concurrent_streams_with_a_third_leaving_hold_every_invariant(tiny_dirs, capsys):
    target, drafter = tiny_dirs
    report, rss = serve_soak.soak(str(target), str(drafter), requests=40, concurrency=40, max_minutes=3, max_batch=8,
                                  max_tokens=(4, 40), max_model_len=256)
    print(report)
    assert report["violations"] == []
    assert report["ran"] == 40 and report["http_5xx"] == 0 and report["kv_pages_back"]
    assert report["left_mid_stream"] >= 13 - 1 and report["greedy_checked"] >= 10  # the plan: every third leaves, a third samples
    assert report["completed"] + report["left_mid_stream"] == 40
    assert report["ttft_s"]["p50"] is not None and rss
