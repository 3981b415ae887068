"""The drafter trainers: a few steps on a tiny slice lower the loss, and what they export loads and runs losslessly."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from conftest import write_target
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

import train_dflash  # noqa: E402
import train_eagle3  # noqa: E402

from dflash_trt.loading import load_drafter  # noqa: E402
from dflash_trt.loading import load_eagle_drafter  # noqa: E402
from dflash_trt.loading import load_target  # noqa: E402
from dflash_trt.runtime import Generator  # noqa: E402
from dflash_trt.sampling import SamplingParams  # noqa: E402
from dflash_trt.torch_backend import TorchBackend  # noqa: E402

LAYER_IDS = [0, 1, 2]


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    """A target and 6 of its own greedy continuations, with features, in make_training_data's shard format."""
    root = tmp_path_factory.mktemp("train")
    target_dir = write_target(root / "target", "llama", seed=21)
    target = load_target(target_dir)
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(5, 96, (6,), generator=gen).tolist() for _ in range(6)]
    backend = TorchBackend(target, None, num_pages=64, page_size=16, capture_layers=tuple(LAYER_IDS))
    g = Generator(backend, max_batch=6)
    ids = [g.submit(p, SamplingParams(max_new_tokens=40)) for p in prompts]
    outs, feats = {}, {}
    while g.has_work:  # take each sequence's features before the backend releases it
        for s in g.running_ids:
            feats[s] = backend.pending_features(s)
        for o in g.step():
            outs[o.seq_id] = o
    data = root / "data"
    data.mkdir()
    tensors, meta = {}, []
    for k, s in enumerate(ids):
        tokens = outs[s].prompt_ids + outs[s].output_ids
        tensors[f"{k}.tokens"] = torch.tensor(tokens, dtype=torch.int32)
        tensors[f"{k}.features"] = feats[s][: len(tokens) - 1].to(torch.bfloat16).contiguous()
        meta.append({"id": str(k), "domain": "test", "prompt_len": 6, "output_len": 40})
    save_file(tensors, str(data / "shard-0000.safetensors"))
    (data / "shard-0000.json").write_text(json.dumps(meta))
    (data / "info.json").write_text(json.dumps({"layer_ids": LAYER_IDS, "mix": "test=6", "dtype": "fp32", "max_new_tokens": 40,
                                                "sequences": 6, "generated_tokens": 240}))
    return target_dir, data, prompts, [outs[s].output_ids for s in ids]


def _common(target_dir, data, out):
    return ["--target", str(target_dir), "--data", str(data), "--out", str(out), "--epochs", "40", "--seqs-per-step", "2",
            "--lr", "3e-3", "--threads", "1", "--warmup", "0.05", "--draft-vocab", "48"]


def _lossless(target_dir, drafter, prompts, refs, block):
    target = load_target(target_dir)
    outs = Generator(TorchBackend(target, drafter, num_pages=64, page_size=16, block_size=block), max_batch=3).generate(prompts, SamplingParams(max_new_tokens=40))
    assert [o.output_ids for o in outs] == refs
    return sum(sum(o.accepted_lengths) for o in outs) / sum(len(o.accepted_lengths) for o in outs)


def test_dflash_training_lowers_the_loss_and_exports_a_loadable_lossless_drafter(tiny_data, tmp_path):
    target_dir, data, prompts, refs = tiny_data
    run = train_dflash.main(_common(target_dir, data, tmp_path / "dflash") + ["--mask-token-id", "3", "--block-size", "8", "--anchors", "8"])
    assert run["log"][-1]["loss_ema"] < 0.7 * run["log"][0]["loss"]
    drafter = load_drafter(tmp_path / "dflash", load_target(target_dir).cfg)
    assert drafter.cfg.block_size == 8 and list(drafter.cfg.target_layer_ids) == LAYER_IDS
    assert _lossless(target_dir, drafter, prompts, refs, block=8) > 1.5  # it learned these very sequences
    assert "steps" in (tmp_path / "dflash" / "README.md").read_text()


def test_eagle_training_lowers_the_loss_and_exports_a_loadable_lossless_drafter(tiny_data, tmp_path):
    target_dir, data, prompts, refs = tiny_data
    run = train_eagle3.main(_common(target_dir, data, tmp_path / "eagle") + ["--intermediate-size", "64", "--max-chain", "5"])
    assert run["log"][-1]["loss_ema"] < 0.7 * run["log"][0]["loss"]
    eagle = load_eagle_drafter(tmp_path / "eagle", load_target(target_dir).cfg)
    assert _lossless(target_dir, eagle, prompts, refs, block=6) > 1.5
