#!/usr/bin/env python3
"""Re-read the vLLM and SGLang definitions `dflash-trt deploy` relies on from their released wheels and print the
snapshot entries (file, 1-based line, the line's text) that dflash_trt/deploy_snapshot.json holds.

    pip download --no-deps vllm==0.34.0 sglang==0.5.23 --python-version 3.11 --only-binary :all: -d /tmp/wheels
    python scripts/deploy_snapshot.py /tmp/wheels/vllm-0.34.0-*.whl /tmp/wheels/sglang-0.5.23-*.whl

Each entry is found by a pattern (an anchor on the definition line), so a later release's line numbers come out of
the same run; an anchor that no longer matches is an error, not a silent omission. TensorRT-LLM has no wheel on the
registries reachable here (its PyPI sdist is a stub), so its entries were read from the source index by commit and
are not refreshed by this script."""

from __future__ import annotations

import json
import re
import sys
import zipfile
from pathlib import Path

# (name, file inside the wheel, regex anchored on the definition line)
VLLM = [
    ("SpeculativeConfig", "vllm/config/speculative.py", r"^class SpeculativeConfig\b"),
    ("method=dflash", "vllm/config/speculative.py", r'^DFlashModelTypes = Literal\["dflash"\]'),
    ("speculative_config.method", "vllm/config/speculative.py", r"^    method: "),
    ("speculative_config.model", "vllm/config/speculative.py", r"^    model: "),
    ("speculative_config.num_speculative_tokens", "vllm/config/speculative.py", r"^    num_speculative_tokens: int = Field"),
    ("<positional model>", "vllm/entrypoints/common/cli_args.py", r'^\s+"model_tag",'),
    ("--speculative-config", "vllm/engine/arg_utils.py", r'"--speculative-config"'),
    ("--tensor-parallel-size", "vllm/engine/arg_utils.py", r'"--tensor-parallel-size"'),
    ("--host", "vllm/entrypoints/common/cli_args.py", r"^    host: "),
    ("--port", "vllm/entrypoints/common/cli_args.py", r"^    port: "),
    ("speculators dflash", "vllm/transformers_utils/configs/speculators/algos.py", r'^@register_speculator\("dflash"\)'),
    ("speculators target_layer_ids = aux - 1", "vllm/transformers_utils/configs/speculators/algos.py", r'"target_layer_ids": \[i - 1 for i in aux_layer_ids\]'),
    ("speculators verifier must be remote", "vllm/transformers_utils/config.py", r'"Speculators verifier must name a remote model repository. "'),
]
SGLANG = [
    ("--model-path", "sglang/srt/arg_groups/fields/model.py", r"^    model_path: "),
    ("--speculative-algorithm", "sglang/srt/arg_groups/fields/spec.py", r"^    speculative_algorithm: "),
    ("DFLASH", "sglang/srt/arg_groups/fields/spec.py", r"Builtins: .*\bDFLASH\b"),
    ("--speculative-draft-model-path", "sglang/srt/arg_groups/fields/spec.py", r"^    speculative_draft_model_path: "),
    ("--speculative-num-draft-tokens", "sglang/srt/arg_groups/fields/spec.py", r"^    speculative_num_draft_tokens: "),
    ("--speculative-dflash-block-size", "sglang/srt/arg_groups/fields/spec.py", r"^    speculative_dflash_block_size: "),
    ("--tp-size", "sglang/srt/arg_groups/fields/parallel.py", r"^    tp_size: "),
    ("--host", "sglang/srt/arg_groups/fields/serving.py", r"^    host: "),
    ("--port", "sglang/srt/arg_groups/fields/serving.py", r"^    port: "),
    ("field name -> flag", "sglang/srt/arg_groups/arg_utils.py", r'return "--" \+ name\.replace\("_", "-"\)'),
    ("DFLASH block = num_draft_tokens", "sglang/srt/arg_groups/speculative_hook.py", r"speculative_num_draft_tokens=int\(cfg\.speculative_dflash_block_size\)"),
    ("sglang.launch_server", "sglang/launch_server.py", r'^if __name__ == "__main__":'),
]


def read(wheel: Path, name: str) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        return z.read(name).decode().splitlines()


def entries(wheel: Path, table) -> list[dict]:
    out = []
    for name, file, pattern in table:
        lines = read(wheel, file)
        hits = [i for i, line in enumerate(lines) if re.search(pattern, line)]
        if not hits:
            sys.exit(f"{wheel.name}: {file}: no line matches {pattern!r} (for {name})")
        i = hits[0]
        out.append({"name": name, "file": file, "line": i + 1, "text": lines[i].strip()})
    return out


def version(wheel: Path) -> tuple[str, str | None]:
    pkg = wheel.name.split("-")[0]
    text = "\n".join(read(wheel, f"{pkg}/_version.py"))
    ver = re.search(r"__version__ = version = '([^']+)'", text).group(1)
    commit = re.search(r"__commit_id__ = commit_id = '?([^'\n]+)'?", text)
    c = commit.group(1) if commit else None
    return ver, (c[1:] if c and c.startswith("g") else (None if c == "None" else c))


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        sys.exit(__doc__)
    snap = {}
    for wheel, table in zip(map(Path, argv), (VLLM, SGLANG)):
        ver, commit = version(wheel)
        pkg = wheel.name.split("-")[0]
        snap[pkg] = {"package": f"{pkg}=={ver}", "wheel": wheel.name, "commit": commit, "entries": entries(wheel, table)}
    print(json.dumps(snap, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
