"""`dflash-trt deploy` (issue 17 item 3): the recipes for TensorRT-LLM's PyTorch backend, vLLM, SGLang and Triton's
llmapi backend.

What is checked here, since none of the four frameworks installs on this machine (docs: README, closing notes):
- every key and flag a recipe writes is an entry of dflash_trt/deploy_snapshot.json, and every entry names the
  upstream file, its line and the commit (or released wheel) it was read at;
- the scripts run: with the frameworks' commands replaced by stubs that record their argv, each serve.sh hands them
  exactly the argv deploy returned (the JSON of vLLM's --speculative-config survives the shell's quoting);
- YAML, JSON and config.pbtxt parse (the last with Triton's own ModelConfig protobuf);
- the drafters written load: vLLM's speculators copy and the full-vocabulary z-lab copy hold the original's weights
  (z-lab's own DFlashDraftModel loads the latter) and our runtime's greedy output with them is the target's;
- bad input is refused naming the file and key, and leaves no output directory.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
from pathlib import Path

import pytest
import torch
import yaml
from conftest import write_drafter, write_target, write_tokenizer
from safetensors.torch import load_file
from test_tp import write_draft_vocab

from dflash_trt import deploy as dep
from dflash_trt.cli import main as cli_main
from dflash_trt.config import load_drafter_config
from dflash_trt.convert import convert
from dflash_trt.errors import ConfigError
from dflash_trt.loading import is_speculators_drafter, load_drafter, load_target
from dflash_trt.runtime import Generator
from dflash_trt.sampling import SamplingParams
from dflash_trt.torch_backend import TorchBackend

QUIET = dict(progress=False, log=lambda *_: None)
PROMPTS = [[5, 17, 33, 8], [40, 41, 2, 9, 77, 12, 60], [11, 12]]
DRAFT_TOKENS = [t for t in range(96) if t % 3 != 1][:48]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A Llama target with a drafter over a reduced vocabulary of 48 tokens (d2t), like the shipped one."""
    root = tmp_path_factory.mktemp("deploy")
    target = write_target(root / "target", "llama", seed=30)
    write_tokenizer(target, 96)
    drafter = write_drafter(root / "drafter", target, num_layers=2, block_size=6, seed=31, draft_vocab_size=len(DRAFT_TOKENS),
                            extra={"dflash_config": {"mask_token_id": 3, "target_layer_ids": [0, 2]}})
    write_draft_vocab(drafter, DRAFT_TOKENS)
    return target, drafter


@pytest.fixture(scope="module")
def written(pair, tmp_path_factory):
    target, drafter = pair
    out = tmp_path_factory.mktemp("recipes") / "out"
    return out, dep.deploy(target, drafter, out, tp=2, draft_len=4, port=8123, max_batch=4)


def _greedy(target, drafter, prompts=PROMPTS, max_new=20):
    backend = TorchBackend(target, drafter, num_pages=128, page_size=4)
    gen = Generator(backend, max_batch=len(prompts))
    return [o.output_ids for o in gen.generate(prompts, SamplingParams(max_new_tokens=max_new))]


def _same_weights(a, b, skip=()):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() - set(skip) == sb.keys() - set(skip)
    for name in sa.keys() - set(skip):
        assert torch.equal(sa[name], sb[name]), name


def _stub_bin(tmp_path: Path, names: list[str]) -> Path:
    """Executables that write their argv (one per line, NUL-free) to $ARGV_LOG and exit 0."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name in names:
        stub = bin_dir / name
        stub.write_text('#!/usr/bin/env bash\nprintf "%s\\n" "$(basename "$0")" "$@" > "$ARGV_LOG"\n')
        stub.chmod(0o755)
    return bin_dir


def _run_script(script: Path, bin_dir: Path, tmp_path: Path, *args: str, **env) -> list[str]:
    log = tmp_path / "argv.log"
    log.unlink(missing_ok=True)
    run_env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "ARGV_LOG": str(log), **env}
    subprocess.run([str(script), *args], env=run_env, check=True, capture_output=True, text=True)
    return log.read_text().splitlines()


def _flags(argv: list[str]) -> list[str]:
    return [a for a in argv if a.startswith("--")]


def test_the_snapshot_names_file_line_and_commit_for_every_entry():
    snap = dep.snapshot()
    assert set(dep.BACKENDS) <= set(snap)
    for backend in dep.BACKENDS:
        src = snap[backend]
        assert src.get("package") or re.fullmatch(r"[0-9a-f]{40}", src["commit"]), backend
        assert src["entries"], backend
        for entry in src["entries"]:
            assert {"name", "file", "line", "text"} <= set(entry), entry
            assert isinstance(entry["line"], int) and entry["line"] > 0 and entry["text"].strip(), entry
            if "package" not in src:
                assert re.fullmatch(r"[0-9a-f]{40}", entry.get("commit", src["commit"])), entry
    names = [e["name"] for b in dep.BACKENDS for e in snap[b]["entries"]]
    for backend in dep.BACKENDS:
        per = [e["name"] for e in snap[backend]["entries"]]
        assert len(per) == len(set(per)), f"{backend}: a name recorded twice"
    assert names


def test_deploy_writes_all_four_and_every_key_and_flag_is_in_the_snapshot(pair, written):
    target, drafter = pair
    out, dirs = written
    assert set(dirs) == set(dep.BACKENDS) and all(d.parent == out.resolve() for d in dirs.values())
    zlab = out.resolve() / dep.ZLAB_DIR

    # TensorRT-LLM's PyTorch backend: trtllm-serve's YAML and flags
    names = dep.snapshot_names("trtllm-pytorch")
    cfg = yaml.safe_load((out / "trtllm-pytorch" / "config.yml").read_text())
    spec = cfg["speculative_config"]
    assert set(cfg) <= names and {f"speculative_config.{k}" for k in spec} <= names
    assert spec == {"decoding_type": "DFlash", "max_draft_len": 4, "speculative_model": str(zlab), "mask_token_id": 3,
                    "target_layer_ids": [0, 2]}
    argv = dep.trtllm_serve_command(dep.resolve_pair(target, drafter, 2), out.resolve() / "trtllm-pytorch" / "config.yml", 2,
                                    "0.0.0.0", 8123)
    assert argv[0] == "trtllm-serve" and argv[1] == str(target.resolve()) and "<positional model>" in names
    assert set(_flags(argv)) <= names

    # vLLM: the speculators drafter, --speculative-config's JSON keys
    names = dep.snapshot_names("vllm")
    script = (out / "vllm" / "serve.sh").read_text()
    assert "speculators verifier must be remote" in names  # why the JSON names the drafter instead of `vllm serve DRAFTER`
    argv = shlex.split(script.split("set -euo pipefail\n", 1)[1].replace("\\\n", ""))
    assert argv[:3] == ["vllm", "serve", str(target.resolve())] and "<positional model>" in names
    assert set(_flags(argv)) <= names
    spec = json.loads(argv[argv.index("--speculative-config") + 1])
    assert {f"speculative_config.{k}" for k in spec} <= names and "method=dflash" in names
    assert spec == {"method": "dflash", "model": str(out.resolve() / "vllm" / "drafter-speculators"), "num_speculative_tokens": 4}

    # SGLang: launch_server's flags; DFLASH's verify window is the block (anchor + drafts)
    names = dep.snapshot_names("sglang")
    argv = shlex.split((out / "sglang" / "serve.sh").read_text().split("set -euo pipefail\n", 1)[1].replace("\\\n", ""))
    assert argv[:3] == ["python", "-m", "sglang.launch_server"] and set(_flags(argv)) <= names and "DFLASH" in names
    assert argv[argv.index("--speculative-algorithm") + 1] == "DFLASH"
    assert argv[argv.index("--speculative-num-draft-tokens") + 1] == "5"
    assert argv[argv.index("--speculative-draft-model-path") + 1] == str(zlab)

    # Triton's llmapi backend: model.yaml keys, config.pbtxt = the snapshot's inputs and outputs
    names = dep.snapshot_names("triton-llmapi")
    model_yaml = yaml.safe_load((out / "triton-llmapi" / "model_repository" / "tensorrt_llm" / "1" / "model.yaml").read_text())
    keys = {k for k in model_yaml if k != "triton_config"} | {f"triton_config.{k}" for k in model_yaml["triton_config"]}
    assert keys <= names
    assert model_yaml["speculative_config"] == cfg["speculative_config"] and model_yaml["tensor_parallel_size"] == 2
    assert model_yaml["backend"] == "pytorch" and model_yaml["triton_config"] == {"max_batch_size": 0, "decoupled": True}
    assert model_yaml["max_batch_size"] == 4 and "max_batch_size" in names


def test_config_pbtxt_is_triton_model_config_with_the_llmapi_models_inputs_and_outputs(written):
    pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2")
    from google.protobuf import text_format

    out, _ = written
    cfg = text_format.Parse((out / "triton-llmapi" / "model_repository" / "tensorrt_llm" / "config.pbtxt").read_text(),
                            pb2.ModelConfig())
    spec = dep.snapshot()["triton-llmapi"]
    # as upstream ships it: batching and decoupling are model.yaml's (Triton's max_batch_size 0: one request per call)
    assert cfg.name == "tensorrt_llm" and cfg.backend == "python" and cfg.max_batch_size == 0
    assert not cfg.HasField("model_transaction_policy")
    assert [(g.count, pb2.ModelInstanceGroup.Kind.Name(g.kind)) for g in cfg.instance_group] == [(1, "KIND_CPU")]
    dtype = pb2.DataType.Name
    assert [(i.name, dtype(i.data_type), list(i.dims), i.optional) for i in cfg.input] == [tuple(x) for x in spec["inputs"]]
    assert [(o.name, dtype(o.data_type), list(o.dims)) for o in cfg.output] == [tuple(x) for x in spec["outputs"]]


def test_each_serve_script_hands_its_framework_exactly_the_commands_argv(pair, written, tmp_path):
    target, drafter = pair
    out, _ = written
    final = out.resolve()
    p = dep.resolve_pair(target, drafter, 2)
    bin_dir = _stub_bin(tmp_path, ["trtllm-serve", "vllm", "python", "tritonserver"])
    assert _run_script(out / "trtllm-pytorch" / "serve.sh", bin_dir, tmp_path) == dep.trtllm_serve_command(
        p, final / "trtllm-pytorch" / "config.yml", 2, "0.0.0.0", 8123)
    assert _run_script(out / "vllm" / "serve.sh", bin_dir, tmp_path) == dep.vllm_serve_command(
        p, final / "vllm" / "drafter-speculators", 4, 2, "0.0.0.0", 8123)
    got = _run_script(out / "sglang" / "serve.sh", bin_dir, tmp_path)
    assert got == dep.sglang_serve_command(p, final / dep.ZLAB_DIR, 4, 2, "0.0.0.0", 8123)
    # extra arguments pass through to the framework
    assert _run_script(out / "vllm" / "serve.sh", bin_dir, tmp_path, "--max-num-seqs", "4")[-2:] == ["--max-num-seqs", "4"]

    # Triton: serve.sh takes the backend's model.py from a TensorRT-LLM source tree, then starts tritonserver
    model_py = dep.snapshot()["triton-llmapi"]["model_py"]
    src = tmp_path / "TensorRT-LLM"
    (src / model_py).parent.mkdir(parents=True)
    (src / model_py).write_text("# TensorRT-LLM's llmapi model.py\n")
    script = out / "triton-llmapi" / "serve.sh"
    assert _run_script(script, bin_dir, tmp_path, TRTLLM_SRC=str(src)) == ["tritonserver", "--model-repository",
                                                                             str(final / "triton-llmapi" / "model_repository")]
    copied = final / "triton-llmapi" / "model_repository" / "tensorrt_llm" / "1" / "model.py"
    assert copied.read_text() == "# TensorRT-LLM's llmapi model.py\n"
    copied.unlink()
    with pytest.raises(subprocess.CalledProcessError) as err:  # no source tree: says so, starts nothing
        _run_script(script, bin_dir, tmp_path)
    assert "TRTLLM_SRC" in err.value.stderr


def test_the_drafters_written_hold_the_originals_weights_and_stay_lossless(pair, written):
    target_dir, drafter_dir = pair
    out, _ = written
    target = load_target(target_dir)
    original = load_drafter(drafter_dir, target.cfg)
    assert original.d2t is not None
    truth = _greedy(target, None)

    spec_dir = out / "vllm" / "drafter-speculators"
    assert is_speculators_drafter(spec_dir)
    spec = load_drafter(spec_dir, target.cfg)
    _same_weights(spec, original)

    zlab_dir = out / dep.ZLAB_DIR
    raw = json.loads((zlab_dir / "config.json").read_text())
    assert "draft_vocab_size" not in raw and raw["architectures"] == ["DFlashDraftModel"]
    a, b = load_file(zlab_dir / "model.safetensors"), load_file(drafter_dir / "model.safetensors")
    assert set(b) - set(a) == {"d2t"} and all(torch.equal(a[k], b[k]) for k in a)
    full = load_drafter(zlab_dir, target.cfg)
    assert full.d2t is None
    _same_weights(full, original, skip={"d2t"})

    assert _greedy(target, original) == _greedy(target, spec) == _greedy(target, full) == truth


def test_zlab_s_own_drafter_class_loads_the_full_vocabulary_copy(written, pair):
    zlab = pytest.importorskip("dflash.model", reason="z-lab's dflash==0.1.0 (pip install --no-deps dflash==0.1.0)")
    out, _ = written
    model = zlab.DFlashDraftModel.from_pretrained(out / dep.ZLAB_DIR, dtype=torch.float32)
    theirs = model.state_dict()
    ours = load_file(out / dep.ZLAB_DIR / "model.safetensors")
    assert set(ours) <= set(theirs)
    assert all(torch.equal(theirs[k], ours[k]) for k in ours)


def test_a_speculators_drafter_is_used_as_it_is_and_rewritten_for_the_others(pair, tmp_path):
    target, drafter = pair
    spec = tmp_path / "spec"
    convert(target, drafter, spec, dtype="fp32", fmt="speculators", **QUIET)
    dirs = dep.deploy(target, spec, tmp_path / "out", backends=("vllm", "sglang"))
    assert not (dirs["vllm"] / "drafter-speculators").exists()
    script = (dirs["vllm"] / "serve.sh").read_text()
    argv = shlex.split(script.split("set -euo pipefail\n", 1)[1].replace("\\\n", ""))
    assert json.loads(argv[argv.index("--speculative-config") + 1])["model"] == str(spec.resolve())
    assert argv[argv.index("--speculative-config") + 1].count('"num_speculative_tokens": 5')  # default: block - 1
    zlab = tmp_path / "out" / dep.ZLAB_DIR
    assert load_drafter_config(zlab).target_layer_ids == load_drafter_config(drafter).target_layer_ids
    a, b = load_file(zlab / "model.safetensors"), load_file(drafter / "model.safetensors")
    assert set(b) - set(a) == {"d2t"} and all(torch.equal(a[k], b[k]) for k in a)


def test_a_full_vocabulary_zlab_drafter_is_not_copied(tmp_path, tiny_dirs):
    target, drafter = tiny_dirs
    dirs = dep.deploy(target, drafter, tmp_path / "out", backends=("sglang", "trtllm-pytorch"), draft_len=3)
    assert not (tmp_path / "out" / dep.ZLAB_DIR).exists()
    spec = yaml.safe_load((dirs["trtllm-pytorch"] / "config.yml").read_text())["speculative_config"]
    assert spec["speculative_model"] == str(drafter.resolve()) and spec["max_draft_len"] == 3


def test_the_cli_writes_the_recipes(pair, tmp_path, capsys):
    target, drafter = pair
    assert cli_main(["deploy", "--backend", "sglang", "--target", str(target), "--drafter", str(drafter), "--out",
                     str(tmp_path / "o"), "--draft-len", "2"]) == 0
    assert "sglang: " in capsys.readouterr().out
    assert sorted(p.name for p in (tmp_path / "o").iterdir()) == ["README.md", dep.ZLAB_DIR, "sglang"]
    assert os.access(tmp_path / "o" / "sglang" / "serve.sh", os.X_OK)


def _refused(match, key, **kwargs):
    out = kwargs["out"]
    with pytest.raises(ConfigError, match=match) as err:
        dep.deploy(**kwargs)
    assert err.value.key == key
    return err.value, out


def test_bad_input_is_refused_by_file_and_key_and_leaves_nothing(pair, tmp_path):
    target, drafter = pair
    out = tmp_path / "out"
    err, _ = _refused("draft", "--draft-len", target=target, drafter=drafter, out=out, draft_len=6)
    assert str(err.file).endswith("config.json")
    _refused("attention heads", "num_attention_heads", target=target, drafter=drafter, out=out, tp=3)
    _refused("unknown backend", "--backend", target=target, drafter=drafter, out=out, backends=("tensorrt",))
    engine = tmp_path / "engine-ckpt"
    convert(target, drafter, engine, dtype="fp32", **QUIET)
    err, _ = _refused("TensorRT-LLM checkpoint", "architecture", target=engine / "target", drafter=drafter, out=out)
    assert err.file == str((engine / "target").resolve() / "config.json")
    assert not out.exists() and not list(tmp_path.glob(".out*"))  # nothing half-written
    out.mkdir()
    (out / "keep").write_text("x")
    with pytest.raises(ConfigError, match="--force"):
        dep.deploy(target, drafter, out)
    assert [p.name for p in out.iterdir()] == ["keep"]


def test_a_failure_while_writing_leaves_nothing(pair, tmp_path, monkeypatch):
    target, drafter = pair

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("dflash_trt.convert.convert", broken)
    with pytest.raises(OSError, match="disk full"):
        dep.deploy(target, drafter, tmp_path / "out")
    assert list(tmp_path.iterdir()) == []
