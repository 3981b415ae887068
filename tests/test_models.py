"""The torch models against independent references: transformers for targets, a naive loop for the drafter."""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import assert_equals_transformers, write_drafter, write_target
from naive_dflash import naive_block_logits

from dflash_trt.loading import load_drafter
from dflash_trt.loading import load_target
from dflash_trt.models.layers import fuse_projections

TARGETS = {
    "llama-untied-gqa": dict(arch="llama"),
    "llama-tied-llama3-rope": dict(
        arch="llama",
        tie=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
        rope_theta=500000.0,
    ),
    "qwen3-head-dim-24": dict(arch="qwen3"),
    "qwen3-tied-mha": dict(arch="qwen3", tie=True, num_key_value_heads=4),
}


@pytest.mark.parametrize("fused", [False, True], ids=["apart", "fused"])
@pytest.mark.parametrize("name", list(TARGETS))
def test_target_logits_and_features_equal_transformers_batched_and_paged(tmp_path, name, fused):
    spec = dict(TARGETS[name])
    path = write_target(tmp_path / name, spec.pop("arch"), seed=3, **spec)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours = load_target(path)
    fuse_projections(ours, on=fused)
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 96, (n,), generator=gen) for n in (7, 19, 12)]
    # 3 is the last layer: HF's hidden_states[-1] is final-normed
    assert_equals_transformers(hf, ours, seqs, cuts=[3, 11, 12], capture=(0, 2, 3))


DRAFTERS = {
    "full-2-layers": dict(num_layers=2),
    "one-layer-default-ids": dict(num_layers=1),
    "sliding-window-causal": dict(num_layers=2, layer_types=["sliding_attention", "full_attention"], sliding_window=5),
    "sliding-window-noncausal": dict(
        num_layers=2, layer_types=["full_attention", "sliding_attention"], sliding_window=4, extra={"dflash_config": {"mask_token_id": 3, "causal": False}}
    ),
    "explicit-ids-block-in-dflash-config": dict(num_layers=2, target_layer_ids=[3, 0, 1], block_size_in_dflash_config=True),
}


@pytest.mark.parametrize("fused", [False, True], ids=["apart", "fused"])
@pytest.mark.parametrize("name", list(DRAFTERS))
def test_drafter_block_logits_equal_naive_recompute(tmp_path, name, fused):
    target_dir = write_target(tmp_path / "t", "qwen3", seed=1)
    drafter_dir = write_drafter(tmp_path / name, target_dir, block_size=8, seed=2, **DRAFTERS[name])
    target = load_target(target_dir)
    drafter = load_drafter(drafter_dir, target.cfg)
    fuse_projections(target, on=fused)
    fuse_projections(drafter, on=fused)
    ids = drafter.cfg.target_layer_ids
    gen = torch.Generator().manual_seed(1)
    contexts = [torch.randint(0, 96, (n,), generator=gen) for n in (9, 14)]
    with torch.no_grad():
        features = []
        for c in contexts:
            tc = target.new_cache(8, 4)
            tc.add_sequence(0)
            features.append(target(c, tc.prepare([0], [len(c)]), tc, ids)[1])
        # Inject each context in two uneven chunks (as successive verify steps would), batched.
        cache = drafter.new_cache(num_pages=16, page_size=4)
        for i in range(2):
            cache.add_sequence(i)
        for lo, hi in (([0, 0], [4, 9]), ([4, 9], [9, 14])):
            batch = cache.prepare([0, 1], [h - l for l, h in zip(lo, hi)])
            drafter.inject_context(torch.cat([f[l:h] for f, l, h in zip(features, lo, hi)]), batch.positions, batch.write_slots, cache)
            for i in range(2):
                cache.set_length(i, hi[i])
        blocks = [[int(contexts[0][-1])] + [3] * 7, [int(contexts[1][-1])] + [3] * 4]  # different block lengths
        batch = cache.prepare([0, 1], [len(b) for b in blocks])
        hidden = drafter(target.embed(torch.tensor(sum(blocks, []))), batch, cache)
        got = target.logits(hidden).split([len(b) for b in blocks])
    for i, (c, f, b) in enumerate(zip(contexts, features, blocks)):
        want = naive_block_logits(drafter_dir, target.model.embed_tokens.weight, target.lm_head_weight, f, b, start=len(c))
        torch.testing.assert_close(got[i][1:], want, atol=1e-4, rtol=1e-4)
