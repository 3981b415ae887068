"""vLLM's speculators format both ways (issue 17 item 1), against what speculators 0.9.0 itself writes.

tests/fixtures/speculators-dflash/ holds a tiny Llama target, a z-lab-format DFlash drafter for it, and that drafter as
speculators 0.9.0's own converter wrote it (`DFlashConverter().convert(zlab, out, base_model=target)`; its `config.py`,
the source of its config class, removed: code never ships here). speculators cannot be installed with this project's
pins (it requires transformers <= 5.19 and torchaudio / torchvision, which pull a CUDA torch), so CI reads that fixture;
the tests that run speculators' own loader skip unless it is importable (PYTHONPATH with a `pip install --no-deps
--target` copy of it and its small dependencies, as the closing note records).
"""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from conftest import write_drafter, write_target
from safetensors.torch import load_file, save_file
from test_tp import write_draft_vocab

from dflash_trt.checkpoint_formats import read_rank
from dflash_trt.config import load_drafter_config
from dflash_trt.convert import convert
from dflash_trt.errors import CheckpointError, ConfigError
from dflash_trt.loading import load_drafter, load_target
from dflash_trt.runtime import Generator
from dflash_trt.sampling import SamplingParams
from dflash_trt.torch_backend import TorchBackend

FIXTURE = Path(__file__).parent / "fixtures" / "speculators-dflash"
QUIET = dict(progress=False, log=lambda *_: None)
needs_speculators = pytest.mark.skipif(importlib.util.find_spec("speculators") is None,
                                       reason="speculators 0.9.0 is not installable with this project's pins (see the module docstring)")


def _same_drafter(a, b) -> None:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for name in sa:
        assert torch.equal(sa[name], sb[name]), name


def _greedy(target, drafter, prompts, max_new=24):
    backend = TorchBackend(target, drafter, num_pages=128, page_size=4)
    return [o.output_ids for o in Generator(backend, max_batch=len(prompts)).generate(prompts, SamplingParams(max_new_tokens=max_new))]


def test_a_drafter_speculators_wrote_loads_as_the_zlab_drafter_it_came_from():
    """speculators' aux_hidden_state_layer_ids are z-lab's target_layer_ids + 1 (hidden-state indices, embedding = 0):
    read back as the same layers, the same config and the same weights; the DFlash loop with it is lossless."""
    raw = json.loads((FIXTURE / "speculators" / "config.json").read_text())
    assert raw["speculators_model_type"] == "dflash" and raw["aux_hidden_state_layer_ids"] == [1, 3]
    spec, zlab = load_drafter_config(FIXTURE / "speculators"), load_drafter_config(FIXTURE / "zlab")
    assert spec.target_layer_ids == zlab.target_layer_ids == (0, 2)
    for field in ("block_size", "mask_token_id", "num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads",
                  "head_dim", "layer_types", "rope", "rms_norm_eps", "draft_vocab_size", "causal_override"):
        assert getattr(spec, field) == getattr(zlab, field), field
    target = load_target(FIXTURE / "target")
    drafter = load_drafter(FIXTURE / "speculators", target.cfg)
    _same_drafter(drafter, load_drafter(FIXTURE / "zlab", target.cfg))
    prompts = [[5, 17, 33, 8], [40, 41, 2, 9, 77, 12, 60]]
    assert _greedy(target, drafter, prompts) == _greedy(target, None, prompts)


def test_convert_format_speculators_writes_what_speculators_writes(tmp_path):
    """Ours from the z-lab drafter = speculators' own conversion: every top-level key and value (its `auto_map` pointing
    at config.py and transformers' version stamp aside; the verifier path is ours), the draft transformer's config
    parsing to the same drafter, and the same tensors, byte for byte."""
    out = tmp_path / "spec"
    convert(FIXTURE / "target", FIXTURE / "zlab", out, dtype="fp32", fmt="speculators", **QUIET)
    ours, theirs = (json.loads((d / "config.json").read_text()) for d in (out, FIXTURE / "speculators"))
    assert set(theirs) - set(ours) == {"auto_map", "transformers_version"} and set(ours) <= set(theirs)
    ours["speculators_config"]["verifier"]["name_or_path"] = theirs["speculators_config"]["verifier"]["name_or_path"]
    for key in ours:
        if key != "transformer_layer_config":
            assert ours[key] == theirs[key], key
    assert not list(out.glob("*.py"))  # no code written
    mine, speculators = load_drafter_config(out), load_drafter_config(FIXTURE / "speculators")
    assert {**vars(mine), "path": None} == {**vars(speculators), "path": None}
    a, b = load_file(out / "model.safetensors"), load_file(FIXTURE / "speculators" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.fixture(scope="module")
def reduced(tmp_path_factory):
    """A drafter that drafts from 40 of the 96 tokens (d2t), in z-lab's format and converted to speculators'."""
    root = tmp_path_factory.mktemp("spec-reduced")
    target_dir = write_target(root / "target", "qwen3", seed=70, tie=True, num_key_value_heads=1)
    tokens = [t for t in range(96) if t % 5 in (0, 2, 3)][:40]
    drafter_dir = write_drafter(root / "zlab", target_dir, num_layers=2, block_size=6, seed=71, draft_vocab_size=len(tokens),
                                num_key_value_heads=1, layer_types=["sliding_attention", "full_attention"], sliding_window=4,
                                extra={"dflash_config": {"mask_token_id": 3, "causal": False, "target_layer_ids": [1, 3]}})
    write_draft_vocab(drafter_dir, tokens)
    convert(target_dir, drafter_dir, root / "spec", dtype="fp32", fmt="speculators", **QUIET)
    return target_dir, drafter_dir, root / "spec", tokens


def test_a_reduced_vocabulary_round_trips_with_t2d_and_the_targets_rows(reduced):
    target_dir, zlab_dir, spec_dir, tokens = reduced
    raw = json.loads((spec_dir / "config.json").read_text())
    assert raw["draft_vocab_size"] == 40 and raw["sliding_window_non_causal"] is True
    stored = load_file(spec_dir / "model.safetensors")
    assert stored["t2d"].dtype == torch.bool and stored["t2d"].nonzero()[:, 0].tolist() == tokens
    target = load_target(target_dir)
    assert torch.equal(stored["lm_head.weight"], target.model.embed_tokens.weight[tokens])  # tied: the embedding's rows
    drafter = load_drafter(spec_dir, target.cfg)
    _same_drafter(drafter, load_drafter(zlab_dir, target.cfg))
    assert load_drafter_config(spec_dir).causal_override is False
    prompts = [[5, 17, 33, 8], [40, 41, 2, 9, 77, 12, 60]]
    assert _greedy(target, drafter, prompts) == _greedy(target, None, prompts)


def test_a_speculators_drafter_converts_to_trtllm_like_its_zlab_original(reduced, tmp_path):
    target_dir, zlab_dir, spec_dir, _ = reduced
    convert(target_dir, zlab_dir, tmp_path / "a", dtype="fp32", tp=2, **QUIET)
    convert(target_dir, spec_dir, tmp_path / "b", dtype="fp32", tp=2, **QUIET)
    for rank in range(2):
        a, b = (read_rank(tmp_path / d / "drafter", rank)[1] for d in ("a", "b"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_what_the_runtime_cannot_honour_is_refused_by_name(reduced, tmp_path):
    target_dir, _, spec_dir, _ = reduced
    target = load_target(target_dir)

    def variant(name, tensors=None, config=None):
        d = tmp_path / name
        shutil.copytree(spec_dir, d)
        if tensors:
            state = load_file(d / "model.safetensors")
            tensors(state)
            save_file(state, str(d / "model.safetensors"))
        if config:
            raw = json.loads((d / "config.json").read_text())
            config(raw)
            (d / "config.json").write_text(json.dumps(raw))
        return d

    def head(s):  # a head of its own (trained), not the target's rows
        s["lm_head.weight"] = s["lm_head.weight"] + 0.01

    def t2d(s):
        s["t2d"] = s["t2d"].roll(1)

    for d, key in ((variant("head", tensors=head), "lm_head.weight"), (variant("t2d", tensors=t2d), "t2d")):
        with pytest.raises(CheckpointError) as e:
            load_drafter(d, target.cfg)
        assert e.value.key == key
    for name, change, key in (
        ("dspark", lambda r: r.update(sample_from_anchor=True), "sample_from_anchor"),
        ("dflash2", lambda r: r["speculators_config"].update(algorithm="dflash2"), "speculators_config.algorithm"),
        ("eagle3", lambda r: r.update(speculators_model_type="eagle3"), "speculators_model_type"),
        ("ids", lambda r: r.update(aux_hidden_state_layer_ids=[0, 2]), "aux_hidden_state_layer_ids"),
    ):
        with pytest.raises(ConfigError) as e:
            load_drafter_config(variant(name, config=change))
        assert e.value.key == key, name


@needs_speculators
@pytest.mark.parametrize("which", ["full", "reduced"])
def test_speculators_loads_what_we_write(reduced, tmp_path, which):
    from speculators.models.dflash import DFlashDraftModel

    if which == "full":
        convert(FIXTURE / "target", FIXTURE / "zlab", tmp_path / "spec", dtype="fp32", fmt="speculators", **QUIET)
        spec_dir, zlab_dir = tmp_path / "spec", FIXTURE / "zlab"
    else:
        _, zlab_dir, spec_dir, _ = reduced
    model = DFlashDraftModel.from_pretrained(str(spec_dir))
    state = model.state_dict()
    for name, t in load_file(zlab_dir / "model.safetensors").items():
        assert torch.equal(state[name].to(t.dtype), t), name
    assert model.target_layer_ids == [i + 1 for i in load_drafter_config(zlab_dir).target_layer_ids]
