"""TensorRT plugins, checked without TensorRT or a GPU: the Triton kernels AOT-compile for every target arch,
the plugin library compiles with -Werror against TensorRT's headers, and what it exposes equals plugin_spec."""

from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_trt.kernels import plugin_spec as spec

ROOT = Path(__file__).resolve().parents[1]
TRT_INCLUDE = ROOT / "third_party" / "tensorrt" / "include"  # TensorRT's public headers, vendored (Apache-2.0)
CUDA_INCLUDE = Path("/usr/local/cuda/include")
TINY_SHAPE = (2, 4, 2, 16, 8)  # L, nh, nkv, hd, block size: every variant, compiled fast
CXX_FLAGS = ["-std=c++17", "-fPIC", "-Wall", "-Wextra", "-Werror", "-Wsuggest-override"]
needs_toolchain = pytest.mark.skipif(not (TRT_INCLUDE.is_dir() and CUDA_INCLUDE.is_dir() and shutil.which("g++")), reason="needs g++, CUDA and TensorRT headers")


@pytest.fixture(scope="module")
def aot_header(tmp_path_factory) -> Path:
    pytest.importorskip("triton")
    out = tmp_path_factory.mktemp("aot") / "dflash_kernels_aot.h"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    cmd = [sys.executable, "-m", "dflash_trt.kernels.aot", "--out", str(out), "--shape", ",".join(map(str, TINY_SHAPE)), "--acts", "bf16"]
    subprocess.run(cmd, check=True, cwd=ROOT, env=env, capture_output=True)
    return out


def cubin_table(header: Path) -> list[tuple[str, int, int]]:
    """(key, sm, numParams) of every cubin the header embeds."""
    rows = re.findall(r'\{"([^"]+)", (\d+), "\w+", kDFlashCubin\d+, sizeof\(kDFlashCubin\d+\), (\d+),', header.read_text())
    return [(k, int(sm), int(n)) for k, sm, n in rows]


def test_every_kernel_aot_compiles_for_every_target_arch(aot_header):
    from dflash_trt.kernels.aot import variants_for

    table = cubin_table(aot_header)
    variants = variants_for(TINY_SHAPE, ("bf16",))
    assert {v.kind for v in variants} == {"kv_inject", "block_attention_partial", "block_attention_combine", "accept"}
    for v in variants:
        for arch in spec.TARGET_ARCHS:
            (n,) = [n for k, sm, n in table if k == v.key and sm == arch]
            assert n >= len(v.signature)  # our args first; Triton may append scratch pointers, passed as null
    text = aot_header.read_text()
    first = re.search(r"kDFlashCubin0\[\] = \{(\d+),(\d+),(\d+),(\d+)", text).groups()
    assert bytes(int(b) for b in first) == b"\x7fELF"  # a cubin, not PTX


def compile_plugins(header: Path, out: Path, source: Path = ROOT / "plugins" / "dflash_plugins.cpp", compiler="g++") -> subprocess.CompletedProcess:
    flags = CXX_FLAGS if compiler == "g++" else ["-std=c++17", "-Xcompiler", ",".join(f for f in CXX_FLAGS if f != "-std=c++17")]
    cmd = [compiler, *flags, "-shared", "-x", "c++" if compiler == "g++" else "cu", str(source), "-o", str(out), f"-I{header.parent}", "-isystem", str(TRT_INCLUDE), "-isystem", str(CUDA_INCLUDE)]
    return subprocess.run(cmd, capture_output=True, text=True)


@needs_toolchain
def test_plugin_library_compiles_with_werror_and_exports_the_creators(aot_header, tmp_path):
    lib = tmp_path / "libdflash_plugins.so"
    result = compile_plugins(aot_header, lib)
    assert result.returncode == 0, result.stderr
    exported = subprocess.run(["nm", "-D", "--defined-only", str(lib)], capture_output=True, text=True).stdout
    assert re.search(r" T getCreators$", exported, re.M) and re.search(r" T setLoggerFinder$", exported, re.M)
    if shutil.which("nvcc"):
        result = compile_plugins(aot_header, tmp_path / "nvcc.so", compiler="nvcc")
        assert result.returncode == 0, result.stderr


@needs_toolchain
def test_a_virtual_without_override_fails_the_build(aot_header, tmp_path):
    source = (ROOT / "plugins" / "dflash_plugins.cpp").read_text()
    broken = tmp_path / "broken.cpp"
    broken.write_text(source.replace("int32_t getNbOutputs() const noexcept override", "int32_t getNbOutputs() const noexcept", 1))
    result = compile_plugins(aot_header, tmp_path / "broken.so", source=broken)
    assert result.returncode != 0 and "override" in result.stderr


@pytest.fixture(scope="module")
def probe(aot_header, tmp_path_factory) -> Path:
    """plugins/tests/abi_probe.cpp linked against the plugin library (see its header for the modes)."""
    out = tmp_path_factory.mktemp("probe")
    lib = out / "libdflash_plugins.so"
    result = compile_plugins(aot_header, lib)
    assert result.returncode == 0, result.stderr
    cmd = ["g++", "-std=c++17", "-Wall", "-Wextra", "-Werror", str(ROOT / "plugins" / "tests" / "abi_probe.cpp"), str(lib), "-o", str(out / "probe"),
           "-isystem", str(TRT_INCLUDE), "-isystem", str(CUDA_INCLUDE), f"-Wl,-rpath,{out}", "-Wl,--unresolved-symbols=ignore-in-shared-libs"]
    result = subprocess.run(cmd, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    return out / "probe"


def create_plugin(probe: Path, name: str, **attrs) -> tuple[int | None, str]:
    """(workspace bytes for batch ≤ 64, or None if createPlugin refused the attributes; what it logged)."""
    result = subprocess.run([str(probe), name, *(f"{k}={v}" for k, v in attrs.items())], check=True, capture_output=True, text=True)
    lines = result.stdout.split()
    return (None if lines == ["refused"] else int(lines[lines.index("workspace") + 1])), result.stderr


@needs_toolchain
def test_plugin_abi_equals_plugin_spec(probe):
    lines = subprocess.run([str(probe)], check=True, capture_output=True, text=True).stdout.splitlines()
    plugins, current = {}, None
    for line in lines:
        kind, *rest = line.split()
        if kind == "plugin":
            current = plugins.setdefault(rest[0], {"ns": rest[1], "version": rest[2], "fields": [], "aliases": []})
        elif kind == "field":
            current["fields"].append((rest[0], rest[1], float(rest[2])))
        elif kind == "alias":
            if int(rest[1]) >= 0:
                current["aliases"].append((int(rest[0]), int(rest[1])))
        else:
            current[kind] = rest
    assert set(plugins) == set(spec.PLUGINS)
    for name, got in plugins.items():
        want = spec.PLUGINS[name]
        assert (got["ns"], got["version"]) == (spec.NAMESPACE, spec.VERSION)
        assert [(n, t) for n, t, _ in got["fields"]] == [(f.name, f.type) for f in want.fields]
        assert [d for _, _, d in got["fields"]] == pytest.approx([f.default for f in want.fields], rel=1e-6)
        assert got["serialized"] == [want.fields[0].name, "16"]
        assert int(got["outputs"][0]) == len(want.outputs)
        assert tuple(got["aliases"]) == want.aliases
    # output dtypes: attention follows q (bf16 = DataType 7), KV inject its caches (fp8 = 6), accept is int32 (3)
    assert plugins["DFlashBlockAttention"]["out_dtype0"] == ["7"]
    assert plugins["DFlashKVInject"]["out_dtype0"] == ["6"]
    assert plugins["DFlashAccept"]["out_dtype0"] == ["3"]


@needs_toolchain
@pytest.mark.parametrize("num_heads,num_kv_heads,head_dim,max_q,block_m", [(32, 8, 128, 16, 64), (12, 4, 96, 8, 32)])
def test_block_attention_workspace_and_block_m_equal_plugin_spec(probe, num_heads, num_kv_heads, head_dim, max_q, block_m):
    shape = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, max_q=max_q)
    workspace, _ = create_plugin(probe, "DFlashBlockAttention", **shape)
    assert workspace == spec.block_attention_max_workspace(64, **shape)
    launch = spec.block_attention_launch(64, 8192, **shape)
    assert launch["workspace"] <= workspace  # the largest launch fits what the C++ plugin asks TensorRT for
    # the bound is 4 bytes · max(TARGET_PROGRAMS, B·nkv) · block_m · (next_pow2(hd) + 2): read the C++ blockM() back
    per_row = 4 * max(spec.TARGET_PROGRAMS, 64 * num_kv_heads) * ((1 << (head_dim - 1).bit_length()) + 2)
    assert workspace % per_row == 0 and workspace // per_row == launch["block_m"] == block_m  # max_q · nh/nkv, to a power of 2


INVALID_ATTRIBUTES = [  # (plugin, attributes, what the log names)
    ("DFlashBlockAttention", dict(num_kv_heads=0), "num_kv_heads=0 must be > 0"),
    ("DFlashBlockAttention", dict(num_heads=-32), "num_heads=-32 must be > 0"),
    ("DFlashBlockAttention", dict(num_heads=7), "num_heads=7 is not a multiple of num_kv_heads=8"),
    ("DFlashBlockAttention", dict(head_dim=0), "head_dim=0"),
    ("DFlashBlockAttention", dict(max_q=0), "max_q=0"),
    ("DFlashBlockAttention", dict(window=-1), "window=-1 must be >= 0"),
    ("DFlashBlockAttention", dict(k_scale=0.0), "k_scale="),
    ("DFlashBlockAttention", dict(v_scale=-1.0), "v_scale="),
    ("DFlashKVInject", dict(num_layers=0), "num_layers=0"),
    ("DFlashKVInject", dict(num_kv_heads=-1), "num_kv_heads=-1"),
    ("DFlashKVInject", dict(head_dim=0), "head_dim=0"),
    ("DFlashKVInject", dict(eps=0.0), "eps="),
    ("DFlashKVInject", dict(eps="nan"), "eps=nan"),
    ("DFlashKVInject", dict(k_scale=-0.5), "k_scale="),
    ("DFlashAccept", dict(max_drafts=0), "max_drafts=0"),
    ("DFlashAccept", dict(max_draft=3), "bad attribute max_draft"),
]


@needs_toolchain
def test_invalid_attributes_are_refused_at_creation(probe):
    for name, attrs, logged in INVALID_ATTRIBUTES:
        workspace, log = create_plugin(probe, name, **attrs)
        assert workspace is None, (name, attrs)  # createPlugin returned null: TensorRT fails the build or deserialization
        assert f"dflash: {name}: " in log or "bad attribute" in logged, (name, log)
        assert logged in log, (name, attrs, log)
    for name in spec.PLUGINS:  # the defaults, and a grouped-head attention with a window, are accepted
        assert create_plugin(probe, name)[0] is not None
    assert create_plugin(probe, "DFlashBlockAttention", num_heads=12, num_kv_heads=4, window=4096, k_scale=0.5)[0] is not None


def test_attributes_pack_to_plugin_fields_and_back():
    fields = spec.BLOCK_ATTENTION.pack(num_heads=32, window=4096, k_scale=0.5)
    assert [f[0] for f in fields] == [f.name for f in spec.BLOCK_ATTENTION.fields]
    assert fields[0][1] == struct.pack("<i", 32) and all(f[3] == 1 for f in fields)
    assert spec.BLOCK_ATTENTION.unpack(fields) == {**{f.name: f.default for f in spec.BLOCK_ATTENTION.fields}, "num_heads": 32, "window": 4096, "k_scale": 0.5}
    with pytest.raises(ValueError, match="unknown"):
        spec.ACCEPT.pack(max_draft=3)


def test_output_shape_rules_equal_the_references():
    import torch

    from dflash_trt.kernels.reference import accept_reference, block_attention_reference, kv_inject_reference
    from dflash_trt.kv_cache import PagedKVCache

    cache = PagedKVCache(1, 2, 16, 8, 4)
    for i, n in enumerate([3, 6]):
        cache.add_sequence(i)
    batch = cache.prepare([0, 1], [3, 6])
    q = torch.randn(9, 4, 16)
    out = block_attention_reference(q, cache.k[0], cache.v[0], batch, causal=False)
    shapes = [tuple(q.shape), tuple(cache.k[0].shape), tuple(cache.v[0].shape), tuple(batch.kv_slots.shape), (2,), (2,), (2,)]
    assert spec.output_shapes(spec.BLOCK_ATTENTION, shapes) == [tuple(out.shape)]
    drafts = torch.zeros(3, 5, dtype=torch.long)
    got = accept_reference(drafts, torch.full((3,), 5), torch.zeros(3, 6, dtype=torch.long), torch.ones(3, dtype=torch.long))
    assert spec.output_shapes(spec.ACCEPT, [(3, 5), (3,), (3, 6), (3,)]) == [tuple(t.shape) for t in got]
    kv_cache = PagedKVCache(2, 2, 16, 4, 4)
    kv_inject_reference(torch.randn(3, 2 * 2 * 2 * 16), torch.ones(2, 16), torch.ones(3, 16), torch.zeros(3, 16), torch.tensor([0, 5, 9]), kv_cache.k, kv_cache.v, 1e-6)
    assert spec.output_shapes(spec.KV_INJECT, [(3, 128), (2, 16), (3, 16), (3, 16), (3,), tuple(kv_cache.k.shape), tuple(kv_cache.v.shape)]) == [tuple(kv_cache.k.shape)] * 2


@pytest.mark.parametrize("batch", [1, 3, 16, 64, 200])
@pytest.mark.parametrize("max_kv", [1, 33, 1024, 8192])
def test_block_attention_launch_fits_the_workspace_bound_and_covers_every_key(batch, max_kv):
    launch = spec.block_attention_launch(batch, max_kv, num_heads=32, num_kv_heads=8, head_dim=128, max_q=16)
    assert launch["workspace"] <= spec.block_attention_max_workspace(batch, 32, 8, 128, 16)
    assert launch["splits"] * launch["keys_per_split"] >= max_kv and launch["keys_per_split"] % 32 == 0
    assert batch * 8 * launch["splits"] <= max(spec.TARGET_PROGRAMS, batch * 8)  # ≤ 2 waves, or one program per (request, head)
    assert launch["block_m"] == 64  # 16 queries × 4 heads per kv head


REGISTRATION_CHECK = """
import ctypes, os, shutil, sys
import tensorrt_rtx as trt
from dflash_trt.kernels import plugin_spec
from dflash_trt.trtllm import plugin_library

lib, copy = sys.argv[1], sys.argv[2]
registry = trt.get_plugin_registry()
found = lambda: sorted(n for n in plugin_spec.PLUGINS if registry.get_creator(n, plugin_spec.VERSION, plugin_spec.NAMESPACE))
ctypes.CDLL(copy, mode=ctypes.RTLD_GLOBAL | os.RTLD_LAZY)  # what the loaders did (lazily: no libcuda here): registers nothing
print("after CDLL", found())
plugin_library.register(lib, trt)
print("after register", found())
"""


@needs_toolchain
def test_plugin_library_registers_its_creators_through_tensorrts_registry(aot_header, tmp_path):
    """TensorRT finds our creators only after IPluginRegistry::loadLibrary (plugin_library.register); a plain
    dlopen (ctypes.CDLL) leaves the registry without them. Checked with TensorRT-RTX's registry on CPU."""
    pytest.importorskip("tensorrt_rtx")
    lib = tmp_path / "libdflash_plugins.so"
    assert compile_plugins(aot_header, lib).returncode == 0
    copy = tmp_path / "copy.so"
    shutil.copy(lib, copy)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", REGISTRATION_CHECK, str(lib), str(copy)], capture_output=True, text=True, cwd=ROOT, env=env)
    assert result.returncode == 0, result.stderr
    names = sorted(spec.PLUGINS)
    assert result.stdout.splitlines() == ["after CDLL []", f"after register {names}"]


def test_registering_a_missing_library_is_one_clear_error(tmp_path):
    from dflash_trt.trtllm import api, plugin_library

    with pytest.raises(api.TensorRTUnavailable, match="plugin library not found.*DFLASH_PLUGIN_LIB"):
        plugin_library.register(tmp_path / "absent.so")
