"""The TensorRT-LLM engine path, checked on CPU: the upstream API we use is the one we read (snapshot),
build configs validate with one clear error, `build --dry-run` emits the converter's and trtllm-build's
real flags, plain-TensorRT network parts build with TensorRT-RTX, the drafter network calls our plugins
exactly as kernels/plugin_spec.py says, and the backend meets the Backend protocol and fails clearly
without tensorrt_llm."""

from __future__ import annotations

import argparse
import ast
import importlib.util
import re
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import yaml

from dflash_trt import cli, convert
from dflash_trt.errors import ConfigError
from dflash_trt.trtllm import api, build_config, network

PKG = Path(api.__file__).parent
CONFIGS = sorted((Path(__file__).parents[1] / "build_configs").glob("*.yaml"))


def _api_get_literals() -> set[str]:
    found = set()
    for path in PKG.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "api":
                assert isinstance(node.args[0], ast.Constant), f"{path.name}:{node.lineno}: api.get needs a literal name"
                found.add(node.args[0].value)
    return found


def test_every_upstream_name_used_is_listed_and_snapshotted():
    used = _api_get_literals()
    assert used, "the scan found no api.get calls"
    assert used <= set(api.NAMES), sorted(used - set(api.NAMES))
    snap = api.snapshot()["names"]
    for short, dotted in api.NAMES.items():
        assert dotted in snap, f"{short} ({dotted}) is not in api_snapshot.json"


def _uncited(entry: dict) -> list[str]:
    """What a snapshot entry lacks of repo, file, line and a full commit."""
    missing = [key for key in ("repo", "file") if not entry.get(key)]
    if not (isinstance(entry.get("line"), int) and entry["line"] >= 1):
        missing.append("line")
    if not (isinstance(entry.get("commit"), str) and re.fullmatch(r"[0-9a-f]{40}", entry["commit"])):
        missing.append("commit")
    return missing


def test_every_snapshot_entry_names_file_line_and_commit():
    snap = api.snapshot()
    entries = {**snap["names"], "trtllm_build_flags": snap["trtllm_build_flags"], "speculative_config": snap["speculative_config"]}
    assert len(entries) > 40
    assert {name: _uncited(e) for name, e in entries.items() if _uncited(e)} == {}
    assert all(e.get("signature") or e.get("flags") or e.get("keys") for e in entries.values())


def test_an_entry_without_line_or_commit_is_noticed():
    good = {"repo": "NVIDIA/TensorRT-LLM", "file": "f.py", "line": 3, "commit": "a" * 40}
    assert _uncited(good) == []
    assert _uncited({**good, "line": None}) == ["line"]
    assert _uncited({**good, "commit": "b35ac1b6"}) == ["commit"]  # a short hash is not a citation
    assert _uncited({"signature": "x"}) == ["repo", "file", "line", "commit"]


def test_tensorrt_names_are_reached_only_through_api_get():
    """`trt.X` written directly would bypass NAMES: the module object is only passed around."""
    for path in PKG.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "trt":
                raise AssertionError(f"{path.name}:{node.lineno}: trt.{node.attr}; use api.get('trt.{node.attr}', trt)")


def test_no_direct_tensorrt_imports_in_the_package():
    root = PKG.parent
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            for name in names:
                assert name.split(".")[0] not in ("tensorrt", "tensorrt_llm", "tensorrt_rtx"), f"{path}:{node.lineno} imports {name}"


def test_plugin_names_are_the_plugin_specs():
    from dflash_trt.kernels import plugin_spec

    assert network.PLUGIN_NAMESPACE == plugin_spec.NAMESPACE and network.PLUGIN_VERSION == plugin_spec.VERSION
    assert network.plugin_names() == tuple(plugin_spec.PLUGINS)


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_shipped_build_configs_validate(path):
    cfg = build_config.load_build_config(path)
    assert cfg.max_draft_len >= 1 and cfg.tp in build_config.TP_SIZES


def test_required_deployments_are_shipped():
    got = {(c.target_architecture, c.quant, c.tp) for c in map(build_config.load_build_config, CONFIGS)}
    assert {("LlamaForCausalLM", "nvfp4", 1), ("Qwen3ForCausalLM", "fp8", 1), ("GptOssForCausalLM", "nvfp4", 8)} <= got


@pytest.mark.parametrize("mutate, key", [
    (lambda r: r["speculative_config"].update(decoding_type="Eagle"), "speculative_config.decoding_type"),
    (lambda r: r["speculative_config"].pop("max_draft_len"), "speculative_config.max_draft_len"),
    (lambda r: r["speculative_config"].update(max_draft_len="15"), "speculative_config.max_draft_len"),
    (lambda r: r["build"].update(max_batch_sizee=8), "build.max_batch_sizee"),
    (lambda r: r["build"].update(speculative_decoding_mode="eagle"), "build.speculative_decoding_mode"),
    (lambda r: r["convert"].update(tp=3), "convert.tp"),
    (lambda r: r["convert"].update(quant="int4"), "convert.quant"),
    (lambda r: r.update(colour="blue"), "colour"),
])
def test_bad_config_names_file_and_key_and_exits_2(tmp_path, capsys, mutate, key):
    raw = yaml.safe_load(CONFIGS[0].read_text())
    mutate(raw)
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError) as e:
        build_config.load_build_config(bad)
    assert e.value.file == str(bad) and e.value.key == key
    assert cli.main(["build", "--config", str(bad), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{bad}: {key}:" in err[0]


def test_dry_run_prints_convert_and_the_one_engine_build_with_real_flags(capsys):
    qwen = next(p for p in CONFIGS if p.stem.startswith("qwen3"))
    assert cli.main(["build", "--config", str(qwen), "--dry-run", "--out", "OUT"]) == 0
    lines = [l[2:].split() for l in capsys.readouterr().out.splitlines() if l.startswith("+ ")]
    assert len(lines) == 2
    conv, trtllm_build = lines
    # the converter's own parser accepts the convert command, and it writes the one-engine checkpoint
    parser = argparse.ArgumentParser()
    convert.register_cli(parser.add_subparsers(dest="c"))
    args = parser.parse_args(conv[1:])
    assert (args.quant, args.tp, args.out, args.format) == ("fp8", 1, "OUT/checkpoint", "engine")
    # every trtllm-build flag is one trtllm-build has (snapshot of tensorrt_llm/commands/build.py)
    real = set(api.snapshot()["trtllm_build_flags"]["flags"])
    assert trtllm_build[1:3] == ["-m", "dflash_trt.trtllm.engine_build"]
    flags = {a for a in trtllm_build if a.startswith("--") and not a.startswith("--dflash_")}
    assert flags <= real, flags - real
    mode = trtllm_build[trtllm_build.index("--speculative_decoding_mode") + 1]
    assert mode == "eagle" and mode in api.snapshot()["trtllm_build_flags"]["speculative_decoding_mode_choices"]
    assert trtllm_build[trtllm_build.index("--max_draft_len") + 1] == "15"
    assert trtllm_build[trtllm_build.index("--checkpoint_dir") + 1] == "OUT/checkpoint"


def test_a_real_build_refuses_what_the_network_does_not_wire_and_needs_tensorrt_llm(capsys):
    """DFlashForCausalLM wires Llama targets (engine_network.py): a Qwen3 deployment is refused naming that, a Llama
    one needs TensorRT-LLM 1.2.x before anything runs; one line each, exit 2, no command started."""
    qwen = next(p for p in CONFIGS if p.stem.startswith("qwen3"))
    assert cli.main(["build", "--config", str(qwen), "--out", "OUT"]) == 2
    captured = capsys.readouterr()
    assert "wires LlamaForCausalLM targets only, not Qwen3ForCausalLM" in captured.err and "+ " not in captured.out
    llama = next(p for p in CONFIGS if p.stem.startswith("llama"))
    assert cli.main(["build", "--config", str(llama), "--out", "OUT"]) == 2
    captured = capsys.readouterr()
    assert "cannot import tensorrt_llm" in captured.err and "+ " not in captured.out


RELEASED = Path(__file__).parents[1] / "examples" / "configs"


def test_the_gpt_oss_120b_deployment_checks_against_the_released_configs(capsys, tmp_path):
    """The headline deployment (gpt-oss-120b, NVFP4, tp 8, FP8 KV) passes every check the converter makes from configs
    (each expert's 360 columns per rank are padded to whole NVFP4 blocks; one KV pool of 8 KV heads of 64), and the
    commands it prints are the converter's and trtllm-build's. A max_draft_len other than the drafter's block - 1 is refused."""
    path = next(p for p in CONFIGS if p.stem.startswith("gpt-oss"))
    dirs = ["--target-dir", str(RELEASED / "gpt-oss-120b"), "--drafter-dir", str(RELEASED / "gpt-oss-120b-DFlash")]
    assert cli.main(["build", "--config", str(path), "--dry-run", "--out", "OUT", *dirs]) == 0
    out = capsys.readouterr().out
    assert "# checked against" in out and "one KV pool of 36 + 8 layers, 9 drafts per step" in out
    conv = next(l[2:].split() for l in out.splitlines() if l.startswith("+ dflash-trt convert"))
    parser = argparse.ArgumentParser()
    convert.register_cli(parser.add_subparsers(dest="c"))
    args = parser.parse_args(conv[1:])
    assert (args.quant, args.tp, args.format, args.kv_cache_quant, args.target) == ("nvfp4", 8, "engine", "fp8", dirs[1])
    raw = yaml.safe_load(path.read_text())
    raw["speculative_config"]["max_draft_len"] = 15
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(raw))
    assert cli.main(["build", "--config", str(bad), "--dry-run", *dirs]) == 2
    assert f"{bad}: speculative_config.max_draft_len: 15 > the drafter's block_size - 1 = 9" in capsys.readouterr().err
    raw["speculative_config"]["max_draft_len"] = 4  # shorter than the block the engine's checkpoint drafts
    bad.write_text(yaml.safe_dump(raw))
    assert cli.main(["build", "--config", str(bad), "--dry-run", *dirs]) == 2
    assert f"{bad}: speculative_config.max_draft_len: 4 < the drafter's block_size - 1 = 9" in capsys.readouterr().err
    # without the models' configs the dry run says what it could not check
    assert cli.main(["build", "--config", str(path), "--dry-run", "--target-dir", str(tmp_path / "absent")]) == 0
    assert "# not checked against the models: no config.json in" in capsys.readouterr().out


@pytest.mark.skipif(importlib.util.find_spec("tensorrt_rtx") is None, reason="tensorrt_rtx not installed (pip install tensorrt-rtx)")
def test_plain_tensorrt_parts_build_with_tensorrt_rtx():
    import tensorrt_rtx as trt

    builder = trt.Builder(trt.Logger(trt.Logger.ERROR))
    net = builder.create_network(0)
    hidden = [net.add_input(f"h{i}", trt.float32, (-1, 8)) for i in range(3)]
    features = network.add_context_features(net, trt, hidden)
    ids = network.add_draft_token_ids(net, trt, net.add_input("logits", trt.float32, (-1, 32)))
    assert tuple(features.shape) == (-1, 24) and features.name == network.CONTEXT_FEATURES
    assert tuple(ids.shape) == (-1,) and ids.dtype == trt.int32 and ids.name == network.DRAFT_TOKEN_IDS
    config, profile = builder.create_builder_config(), builder.create_optimization_profile()
    for name, width in [("h0", 8), ("h1", 8), ("h2", 8), ("logits", 32)]:
        profile.set_shape(name, (1, width), (4, width), (16, width))
    config.add_optimization_profile(profile)
    engine = builder.build_serialized_network(net, config)
    assert engine is not None and engine.nbytes > 0
    assert [net.get_output(i).name for i in range(net.num_outputs)] == [network.CONTEXT_FEATURES, network.DRAFT_TOKEN_IDS]


@pytest.mark.skipif(importlib.util.find_spec("tensorrt_llm") is not None, reason="tensorrt_llm is installed")
def test_engine_generator_without_tensorrt_llm_fails_clearly(tmp_path):
    from dflash_trt.trtllm.executor import EngineGenerator

    with pytest.raises(api.TensorRTUnavailable, match="tensorrt_llm.*NGC TensorRT-LLM image"):
        EngineGenerator(tmp_path / "no-engine")
    assert issubclass(api.TensorRTUnavailable, cli.DFlashError)  # the CLI reports it in one line, exit 2


def test_engine_path_refuses_sampling_until_an_exact_accept_op_exists():
    """Stock EAGLE acceptance at T > 0 is typical acceptance, not an exact sample of the target: the engine path
    decodes greedily or not at all, and refuses a sampling executor before it loads anything."""
    from dflash_trt.sampling import RequestError, SamplingParams
    from dflash_trt.trtllm.executor import EngineGenerator, check_params

    check_params(SamplingParams())
    check_params(SamplingParams(top_p=0.5, top_k=3))  # greedy: top_k / top_p are moot
    for bad in (SamplingParams(temperature=0.7), SamplingParams(temperature=1e-3, top_p=0.9)):
        with pytest.raises(RequestError, match="typical acceptance.*exact-rejection"):
            check_params(bad)
    with pytest.raises(RequestError, match="temperature > 0 is not available on the engine path"):
        EngineGenerator("/nonexistent-engine", sampling=True)  # refused before tensorrt_llm or the engine is looked for


def test_eagle_choices_of_a_chain_are_the_one_path_the_engine_proposes():
    """The runtime builds a new request's draft_paths from eagle_choices; they must be the engine's chain."""
    from dflash_trt.trtllm import contract
    from dflash_trt.trtllm.executor import chain_choices

    dims = contract.Dims(6)
    choices = chain_choices(dims.max_draft_len)
    assert max(map(len, choices)) == dims.num_eagle_layers  # the runtime checks tree depth == num_eagle_layers
    # Node i (1-based, 0 = root) of a Medusa/EAGLE choice tree has path [root, ancestors..., i].
    nodes = {tuple(c): i + 1 for i, c in enumerate(choices)}
    path = [0] + [nodes[tuple(choices[-1][:d])] for d in range(1, len(choices[-1]) + 1)]
    assert path == contract.chain_paths(dims, 1)[0, 0].tolist()


def test_build_without_pyyaml_is_one_clear_error(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "yaml", None)  # `import yaml` raises ImportError
    assert cli.main(["build", "--config", str(CONFIGS[0]), "--dry-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "PyYAML" in err[0] and str(CONFIGS[0]) in err[0]


# -- the drafter network against the plugin contract (TensorRT-RTX's builder; plugins recorded) ------------

needs_rtx = pytest.mark.skipif(importlib.util.find_spec("tensorrt_rtx") is None, reason="tensorrt_rtx not installed (pip install tensorrt-rtx)")
L, NH, NKV, HD, BLOCK = 2, 4, 2, 8, 4
QKV = (NH + 2 * NKV) * HD
INPUT_SHAPES = {  # DRAFTER_INPUTS with this test's sizes (-1: dynamic)
    "context_features": (-1, 3 * 16), "context_cos": (-1, HD), "context_sin": (-1, HD), "context_write_slots": (-1,),
    "block_ids": (-1,), "block_cos": (-1, HD), "block_sin": (-1, HD), "block_write_slots": (-1,), "kv_slots": (-1, -1),
    "q_starts": (-1,), "q_lens": (-1,), "kv_lens": (-1,), "k_cache": (L, -1, NKV, HD), "v_cache": (L, -1, NKV, HD),
}


class RecordingNetwork:
    """TensorRT-RTX's network, except add_plugin_v3 (which it lacks): each call is recorded and its outputs
    stand in as identity layers of the spec's output shapes, so the layers after it are real RTX layers."""

    def __init__(self, trt, net):
        self.trt, self.net, self.calls = trt, net, []

    def __getattr__(self, name):
        return getattr(self.net, name)

    def add_plugin_v3(self, inputs, shape_inputs, plugin):
        from dflash_trt.kernels import plugin_spec

        spec = plugin_spec.PLUGINS[plugin.name]
        shapes = plugin_spec.output_shapes(spec, [tuple(t.shape) for t in inputs])
        outs = [self.net.add_identity(self.net.add_input(f"{spec.name}{len(self.calls)}_{k}", inputs[0 if len(shapes) == 1 else 5].dtype, shape)).get_output(0)
                for k, shape in enumerate(shapes)]
        self.calls.append(SimpleNamespace(spec=spec, inputs=list(inputs), shape_inputs=shape_inputs, attrs=plugin.attrs, outputs=outs))
        return SimpleNamespace(get_output=lambda k: outs[k])


class TrtWithRecordingRegistry:
    """tensorrt_rtx, with a plugin registry whose creators record the attributes they are given."""

    def __init__(self, trt):
        self._trt = trt

    def __getattr__(self, name):
        return getattr(self._trt, name)

    def get_plugin_registry(self):
        trt = self._trt

        def create_plugin(name, fields, phase):
            assert phase == trt.TensorRTPhase.BUILD
            kinds = {trt.PluginFieldType.INT32: "int32", trt.PluginFieldType.FLOAT32: "float32"}
            packed = [(f.name, np.array(f.data).tobytes(), kinds[f.type], 1) for f in fields]
            return SimpleNamespace(name=name, attrs=packed)

        return SimpleNamespace(get_creator=lambda name, version, namespace: SimpleNamespace(create_plugin=create_plugin)
                               if (version, namespace) == (network.PLUGIN_VERSION, network.PLUGIN_NAMESPACE) else None)


def _drafter_network(causal=(False, True)):
    import tensorrt_rtx as trt

    net = RecordingNetwork(trt, trt.Builder(trt.Logger(trt.Logger.ERROR)).create_network(0))
    dtype = {"int32": trt.int32, "dtype": trt.float16}
    inputs = {n: net.add_input(n, dtype[network.DRAFTER_INPUTS[n][1]], shape) for n, shape in INPUT_SHAPES.items()}
    weight = lambda: net.add_constant((HD,), np.ones(HD, np.float16)).get_output(0)
    graph = network.DrafterAttention(net, TrtWithRecordingRegistry(trt), inputs, [weight() for _ in range(L)],
                                     num_heads=NH, num_kv_heads=NKV, head_dim=HD, block_size=BLOCK, eps=1e-6)
    graph.inject_context([net.add_input(f"context_qkv{i}", trt.float16, (-1, QKV)) for i in range(L)])
    outs = [graph.layer(i, net.add_input(f"block_qkv{i}", trt.float16, (-1, QKV)), weight(), causal=causal[i], window=None).get_output(0)
            for i in range(L)]
    graph.mark_caches()
    return trt, net, inputs, outs


def test_drafter_engine_input_shapes_are_the_ones_this_test_builds():
    assert set(INPUT_SHAPES) == set(network.DRAFTER_INPUTS)
    for name, (shape, _) in network.DRAFTER_INPUTS.items():
        assert len(shape.strip("[]").split(", ")) == len(INPUT_SHAPES[name]), name


@needs_rtx
def test_drafter_network_calls_the_plugins_with_the_specs_inputs_and_attributes():
    from dflash_trt.kernels.plugin_spec import BLOCK_ATTENTION, KV_INJECT

    trt, net, inputs, outs = _drafter_network(causal=(False, True))
    # inject_context, then per layer: the block's K/V, then its attention (models/drafter.py's order)
    assert [c.spec for c in net.calls] == [KV_INJECT] + [KV_INJECT, BLOCK_ATTENTION] * L
    for c in net.calls:
        assert len(c.inputs) == len(c.spec.inputs) and c.shape_inputs == []
    index = {spec: {t.name: i for i, t in enumerate(spec.inputs)} for spec in (KV_INJECT, BLOCK_ATTENTION)}
    kv_inj, attn = index[KV_INJECT], index[BLOCK_ATTENTION]
    shape = lambda c, name: tuple(c.inputs[index[c.spec][name]].shape)
    name = lambda c, n: c.inputs[index[c.spec][n]].name
    ctx, blocks = net.calls[0], net.calls[1::2]
    for c in [ctx] + blocks:  # [T, L*2*nkv*hd], [L, hd], [T, hd] x2, [T], [L, S, nkv, hd] x2
        assert shape(c, "kv") == (-1, L * 2 * NKV * HD) and shape(c, "k_norm_weight") == (L, HD)
        assert shape(c, "k_cache") == shape(c, "v_cache") == (L, -1, NKV, HD)
        assert c.spec.unpack(c.attrs) == pytest.approx(dict(num_layers=L, num_kv_heads=NKV, head_dim=HD, eps=1e-6, k_scale=1.0, v_scale=1.0))
    assert [name(ctx, n) for n in ("cos", "sin", "write_slots", "k_cache", "v_cache")] == \
        ["context_cos", "context_sin", "context_write_slots", "k_cache", "v_cache"]
    for c in blocks:
        assert [name(c, n) for n in ("cos", "sin", "write_slots")] == ["block_cos", "block_sin", "block_write_slots"]
    # the aliasing chain: every KVInject updates the previous one's outputs (spec.aliases: out 0 ← in 5, out 1 ← in 6)
    assert KV_INJECT.aliases == ((0, kv_inj["k_cache"]), (1, kv_inj["v_cache"]))
    injects = [ctx] + blocks
    for before, after in zip(injects, injects[1:]):
        assert (name(after, "k_cache"), name(after, "v_cache")) == tuple(t.name for t in before.outputs)
    for layer, c in enumerate(net.calls[2::2]):
        assert shape(c, "q") == (-1, NH, HD) and shape(c, "k_pool") == shape(c, "v_pool") == (-1, NKV, HD)
        assert len(shape(c, "kv_slots")) == 2 and [name(c, n) for n in ("q_starts", "q_lens", "kv_lens")] == ["q_starts", "q_lens", "kv_lens"]
        assert (name(c, "kv_slots") == "kv_slots") == (layer == 0)  # layer i reads slots + i·S of the flattened caches
        assert c.spec.unpack(c.attrs) == pytest.approx(dict(num_heads=NH, num_kv_heads=NKV, head_dim=HD, max_q=BLOCK,
                                                             causal=int(layer == 1), window=0, k_scale=1.0, v_scale=1.0))
        assert tuple(outs[layer].shape) == (-1, NH * HD)
    marked = [net.get_output(i).name for i in range(net.num_outputs)]
    assert marked == list(network.CACHE_OUTPUTS.values()) == [t.name for t in injects[-1].outputs]


def test_plugin_inputs_must_be_exactly_the_specs():
    from dflash_trt.kernels.plugin_spec import BLOCK_ATTENTION

    with pytest.raises(ValueError, match="DFlashBlockAttention"):
        network.add_plugin(None, None, BLOCK_ATTENTION, {"q": 0, "k_pool": 1})


@needs_rtx
def test_drafter_plain_layers_build_with_tensorrt_rtx():
    """q split + q_norm + RoPE, the per-layer slot offset and the pool view: real layers, a real engine."""
    import tensorrt_rtx as trt

    builder = trt.Builder(trt.Logger(trt.Logger.ERROR))
    net = builder.create_network(0)
    qkv = net.add_input("qkv", trt.float16, (-1, QKV))
    cos, sin = (net.add_input(n, trt.float16, (-1, HD)) for n in ("cos", "sin"))
    slots = net.add_input("kv_slots", trt.int32, (-1, -1))
    cache = net.add_input("k_cache", trt.float16, (L, -1, NKV, HD))
    q, kv = network.split_qkv(net, qkv, NH, NKV, HD)
    weight = net.add_constant((HD,), np.ones(HD, np.float16)).get_output(0)
    q = network.add_rope(net, trt, network.add_rms_norm(net, trt, q, weight, 1e-6), cos, sin)
    shifted = network.layer_slots(net, trt, slots, cache, 1)
    pool = net.add_shuffle(cache)
    pool.reshape_dims = (-1, NKV, HD)
    assert tuple(q.shape) == (-1, NH, HD) and q.dtype == trt.float16 and tuple(kv.shape) == (-1, 2 * NKV * HD)
    assert shifted.dtype == trt.int32 and tuple(pool.get_output(0).shape) == (-1, NKV, HD)
    for t in (q, kv, shifted, pool.get_output(0)):
        net.mark_output(t)
    config, profile = builder.create_builder_config(), builder.create_optimization_profile()
    for name, lo, hi in [("qkv", (1, QKV), (16, QKV)), ("cos", (1, HD), (16, HD)), ("sin", (1, HD), (16, HD)),
                         ("kv_slots", (1, 1), (4, 64)), ("k_cache", (L, 1, NKV, HD), (L, 256, NKV, HD))]:
        profile.set_shape(name, lo, hi, hi)
    config.add_optimization_profile(profile)
    engine = builder.build_serialized_network(net, config)
    assert engine is not None and engine.nbytes > 0


@needs_rtx
def test_plugin_fields_are_the_specs_packed_attributes():
    import tensorrt_rtx as trt
    from dflash_trt.kernels.plugin_spec import KV_INJECT

    fields, arrays = network.plugin_fields(trt, KV_INJECT, num_layers=5, eps=1e-5)
    kinds = {trt.PluginFieldType.INT32: "int32", trt.PluginFieldType.FLOAT32: "float32"}
    got = [(f.name, a.tobytes(), kinds[f.type], 1) for f, a in zip(fields, arrays)]
    assert got == KV_INJECT.pack(num_layers=5, eps=1e-5)


def test_captured_feature_is_the_residual_stream_whatever_the_layer_returns():
    """A TensorRT-LLM decoder layer returns the residual stream, or (it, presents) with the KV cache on; with
    reduce_fusion / norm_quant_fusion the stream comes second, after the next layer's normed input."""
    from dflash_trt.trtllm.model import decoder_layer_feature

    stream, normed, fp4, scale, presents = object(), object(), object(), object(), object()
    cases = [
        (stream, False),
        ((stream, presents), True),
        ((normed, stream), False),  # reduce_fusion, no cache
        (((normed, stream), presents), True),  # reduce_fusion
        ((((fp4, scale), stream), presents), True),  # norm_quant_fusion (NVFP4)
    ]
    for output, use_cache in cases:
        assert decoder_layer_feature(output, use_cache) is stream
