"""The engine path's platform is pinned in one place (dflash_trt.trtllm) and everything else agrees with it:
the Dockerfile's default image, the vendored TensorRT headers, and the runtime check of tensorrt_llm."""

from __future__ import annotations

import re
import sys
import types
from pathlib import Path

import pytest

from dflash_trt import trtllm
from dflash_trt.trtllm import api

ROOT = Path(__file__).resolve().parents[1]


def test_dockerfile_defaults_to_the_pinned_release_image():
    text = (ROOT / "docker" / "Dockerfile").read_text()
    (default,) = re.findall(r"^ARG TRTLLM_IMAGE=(\S+)$", text, re.M)
    assert default == trtllm.RELEASE_IMAGE and not default.endswith(":latest")


def test_vendored_tensorrt_headers_are_the_pinned_tensorrt():
    text = (ROOT / "third_party" / "tensorrt" / "include" / "NvInferVersion.h").read_text()
    version = ".".join(re.search(rf"#define TRT_{part}_ENTERPRISE (\d+)", text).group(1) for part in ("MAJOR", "MINOR", "PATCH"))
    assert version == trtllm.TENSORRT_VERSION


def test_a_tensorrt_llm_without_the_engine_path_is_refused_by_name(monkeypatch):
    fake = types.ModuleType("tensorrt_llm")
    fake.__version__ = "1.3.0rc14"
    bindings, executor = types.ModuleType("tensorrt_llm.bindings"), types.ModuleType("tensorrt_llm.bindings.executor")
    executor.Executor = object
    for name, module in (("tensorrt_llm", fake), ("tensorrt_llm.bindings", bindings), ("tensorrt_llm.bindings.executor", executor)):
        monkeypatch.setitem(sys.modules, name, module)
    with pytest.raises(api.TensorRTUnavailable, match=r"tensorrt_llm 1\.3\.0rc14 .* pinned to 1\.2\.1 .*release:1\.2\.1"):
        api.require_tensorrt_llm()
    fake.__version__ = "1.2.1"
    api.require_tensorrt_llm()  # the pinned line passes


def test_dockerfile_builds_cubins_for_the_shipped_drafter():
    """The image's plugin library embeds kernels per drafter shape (plugins/CMakeLists.txt DFLASH_SHAPES):
    Qwen3-8B's (aot's default) and the shipped drafter's, which scripts/gpu_engine_check.sh runs."""
    import json

    from dflash_trt.kernels.aot import QWEN3_8B_DRAFTER

    text = (ROOT / "docker" / "Dockerfile").read_text()
    (value,) = re.findall(r'-DDFLASH_SHAPES="([^"]+)"', text)
    shapes = {tuple(int(x) for x in s.split(",")) for s in value.split(";")}
    cfg = json.loads((ROOT / "examples" / "drafters" / "smollm2-dflash-b16" / "config.json").read_text())
    shipped = tuple(cfg[k] for k in ("num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim", "block_size"))
    assert shipped == (2, 9, 3, 64, 16)
    assert {QWEN3_8B_DRAFTER, shipped} <= shapes, sorted(shapes)
