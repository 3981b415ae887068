"""The one-engine checkpoint (`convert --format engine`, DFlashForCausalLM): target + drafter in one
config.json and one rank file per rank, as trtllm-build reads an EagleForCausalLM checkpoint.

Against independent references: every tensor is byte-equal to the two-part conversion (itself checked
against ModelOpt's exporter in test_convert_modelopt.py); the EAGLE keys are the closed-form values of a
K-draft chain; both models read back equal the two-part ones; the reference runtime on it emits the HF
target's own greedy tokens (fp32, several prompts, batch 1 and 3, the drafter's block and 4); and what one engine
cannot hold is refused with the file and key named, leaving nothing written."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from conftest import write_drafter, write_target
from dflash_trt.cli import main
from dflash_trt.convert import convert
from dflash_trt.errors import ConfigError
from dflash_trt.loading import checkpoint_parts
from dflash_trt.runtime import Generator
from dflash_trt.safetensors_io import SafetensorsFile
from dflash_trt.sampling import SamplingParams
from dflash_trt.loading import load_torch_backend
from dflash_trt.trtllm_config import ENGINE_DRAFTER_PREFIX, ENGINE_KEYS
from dflash_trt.checkpoint_formats import read_rank

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14, 15], [20, 21, 22, 23, 24, 25, 26, 27, 28]]
QUIET = dict(progress=False, log=lambda m: None)


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    root = tmp_path_factory.mktemp("engine_ckpt")
    llama = write_target(root / "llama", vocab_size=100)
    qwen = write_target(root / "qwen", arch="qwen3", head_dim=16)
    return root, {"llama": (llama, write_drafter(root / "llama_drafter", llama)), "qwen": (qwen, write_drafter(root / "qwen_drafter", qwen, block_size=8))}


def _bytes(path):
    f = SafetensorsFile(path)
    try:
        return {k: (f.tensors[k].dtype, f.tensors[k].shape, f.read_rows(k).reshape(-1).view(torch.uint8).clone()) for k in f.keys()}
    finally:
        f.close()


def _generate(backend, prompts, max_new_tokens=24):
    gen = Generator(backend, eos_token_ids=set(), max_batch=len(prompts))
    return [o.output_ids for o in gen.generate(prompts, SamplingParams(max_new_tokens=max_new_tokens, ignore_eos=True))]


@pytest.mark.parametrize("arch,quant,kv,tp", [("llama", "none", "none", 1), ("qwen", "none", "none", 2), ("llama", "fp8", "fp8", 2), ("llama", "nvfp4", "none", 1)])
def test_rank_files_are_the_two_parts_byte_for_byte_and_the_config_is_eagles(pairs, tmp_path, arch, quant, kv, tp):
    root, models = pairs
    target, drafter = models[arch]
    kw = dict(dtype="fp32", quant=quant, kv_cache_quant=kv, tp=tp, calib_prompts=PROMPTS, calib_max_new_tokens=4, **QUIET)
    convert(target, drafter, tmp_path / "parts", **kw)
    convert(target, drafter, tmp_path / "engine", fmt="engine", **kw)  # calibration is deterministic: the same amax
    parts, engine = tmp_path / "parts", tmp_path / "engine"
    assert not (engine / "target").exists() and not (engine / "drafter").exists()
    for rank in range(tp):
        merged = _bytes(engine / f"rank{rank}.safetensors")
        want = _bytes(parts / "target" / f"rank{rank}.safetensors")
        want |= {ENGINE_DRAFTER_PREFIX + k: v for k, v in _bytes(parts / "drafter" / f"rank{rank}.safetensors").items()}
        assert merged.keys() == want.keys()
        for name, (dtype, shape, data) in want.items():
            assert merged[name][:2] == (dtype, shape) and torch.equal(merged[name][2], data), name
    raw = json.loads((engine / "config.json").read_text())
    t_raw = json.loads((parts / "target" / "config.json").read_text())
    d_raw = json.loads((parts / "drafter" / "config.json").read_text())
    k = d_raw["block_size"] - 1
    assert raw["architecture"] == "DFlashForCausalLM" and raw["base_architecture"] == t_raw["architecture"]
    assert (raw["max_draft_len"], raw["num_eagle_layers"], raw["max_non_leaves_per_layer"]) == (k, k, 1)
    assert raw["eagle_net_config"] == d_raw
    assert {key: v for key, v in raw.items() if key not in ENGINE_KEYS and key != "architecture"} == {
        key: v for key, v in t_raw.items() if key != "architecture"}
    for rank in range(tp):  # both models read back exactly as from their own directories
        for part, src in (("target", parts / "target"), ("drafter", parts / "drafter")):
            cfg, tensors, _ = read_rank(engine, rank, torch.float32, part)
            cfg_want, tensors_want, _ = read_rank(src, rank, torch.float32)
            assert dataclasses.replace(cfg, path=cfg_want.path) == cfg_want  # equal but for the file they came from
            assert tensors.keys() == tensors_want.keys()
            assert all(torch.equal(tensors[n], tensors_want[n]) for n in tensors)


@pytest.mark.parametrize("arch", ["llama", "qwen"])
def test_reference_runtime_on_the_engine_checkpoint_is_the_targets_greedy(pairs, tmp_path, arch):
    root, models = pairs
    target, drafter = models[arch]
    engine = tmp_path / "engine"
    convert(target, drafter, engine, fmt="engine", dtype="fp32", **QUIET)
    assert checkpoint_parts(engine) == (engine, engine)
    want = _generate(load_torch_backend(target, None), PROMPTS)  # the HF target alone
    for block in (None, 4):  # the drafter's own block (16 / 8), and 4
        spec = load_torch_backend(engine, engine, block_size=block)
        assert _generate(spec, PROMPTS) == want
        assert [_generate(spec, [p])[0] for p in PROMPTS] == want


def test_generate_checkpoint_runs_the_engine_checkpoint(pairs, tmp_path, capsys):
    root, models = pairs
    target, drafter = models["llama"]
    convert(target, drafter, tmp_path / "engine", fmt="engine", dtype="fp32", **QUIET)
    args = ["--prompt", "x", "--max-new-tokens", "12", "--ignore-eos", "--no-chat-template", "--tokenizer", str(root / "tok"),
            "--draft-length", "fixed", "--threads", "1"]
    from conftest import write_tokenizer

    write_tokenizer(root / "tok", 100)
    assert main(["generate", "--target", str(target), "--no-drafter", *args]) == 0
    want = capsys.readouterr().out
    assert main(["generate", "--checkpoint", str(tmp_path / "engine"), *args]) == 0
    got = capsys.readouterr()
    assert got.out == want and "dflash block=" in got.err


def test_what_one_engine_cannot_hold_is_refused_naming_the_drafters_file_and_key(pairs, tmp_path, capsys):
    root, models = pairs
    target, _ = models["llama"]
    # one KV pool: the drafter's KV heads must be the target's
    other = write_drafter(tmp_path / "gqa1", target, num_key_value_heads=1)
    with pytest.raises(ConfigError, match=r"gqa1/config\.json: num_key_value_heads: 1 != the target's 2"):
        convert(target, other, tmp_path / "out", fmt="engine", dtype="fp32", **QUIET)
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out.tmp-*"))
    # one RoPE table, sized from the target's config: the drafter's positions must fit in it
    target_max = json.loads((target / "config.json").read_text())["max_position_embeddings"]
    longer = write_drafter(tmp_path / "long", target, max_position_embeddings=2 * target_max)
    with pytest.raises(ConfigError, match=rf"long/config\.json: max_position_embeddings: {2 * target_max} > the target's {target_max}"):
        convert(target, longer, tmp_path / "out", fmt="engine", dtype="fp32", **QUIET)
    assert not (tmp_path / "out").exists()
    # the engine holds both models
    assert main(["convert", "--target", str(target), "--out", str(tmp_path / "out"), "--format", "engine", "--quiet"]) == 2
    assert "--drafter" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_a_damaged_engine_config_names_its_key(pairs, tmp_path):
    root, models = pairs
    target, drafter = models["llama"]
    engine = tmp_path / "engine"
    convert(target, drafter, engine, fmt="engine", dtype="fp32", **QUIET)
    raw = json.loads((engine / "config.json").read_text())
    for key in ("eagle_net_config", "base_architecture"):
        broken = dict(raw)
        del broken[key]
        (engine / "config.json").write_text(json.dumps(broken))
        part = "drafter" if key == "eagle_net_config" else "target"
        with pytest.raises(ConfigError, match=rf"config\.json: {key}: "):
            read_rank(engine, 0, torch.float32, part)


def test_the_build_wrapper_takes_the_engine_checkpoint_and_then_needs_tensorrt_llm(pairs, tmp_path):
    """`python -m dflash_trt.trtllm.engine_build` reads the checkpoint before anything of tensorrt_llm: the one
    engine's is accepted and registering its network then needs tensorrt_llm (absent here: one clear error); any
    other layout is refused by its architecture."""
    from dflash_trt.trtllm import api, engine_build

    root, models = pairs
    target, drafter = models["llama"]
    convert(target, drafter, tmp_path / "engine", fmt="engine", dtype="fp32", **QUIET)
    convert(target, drafter, tmp_path / "parts", dtype="fp32", **QUIET)
    with pytest.raises(api.TensorRTUnavailable, match="cannot import tensorrt_llm"):
        engine_build.main(["--checkpoint_dir", str(tmp_path / "engine"), "--max_draft_len", "15"])
    with pytest.raises(ConfigError, match=r"target/config\.json: architecture: .*'LlamaForCausalLM'"):
        engine_build.main(["--checkpoint_dir", str(tmp_path / "parts" / "target")])
