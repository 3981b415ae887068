"""At T > 0 every emitted token is a sample of the target's (temperature, top-p, top-k) distribution.

The exact joint distribution of the first three emitted tokens is enumerated from
transformers' logits; speculative samples (drafts accepted and rejected) must fit it.
"""

from __future__ import annotations


import numpy as np
import pytest
import torch
import transformers
from conftest import write_drafter, write_target
from scipy.stats import chisquare

from dflash_trt.loading import load_drafter
from dflash_trt.loading import load_target
from dflash_trt.runtime import Generator
from dflash_trt.sampling import SamplingParams
from dflash_trt.torch_backend import TorchBackend

VOCAB, T, TOP_P, TOP_K = 12, 0.8, 0.9, 0
PROMPT = [5, 9, 4, 11, 7]
N = 6000


def _filtered(logits: np.ndarray, temperature: float, top_p: float, top_k: int) -> np.ndarray:
    """Naive reference, in transformers' order: softmax(logits / T); keep the top-k and renormalize;
    then keep the smallest set of most likely tokens whose mass reaches top_p and renormalize."""
    p = np.exp((logits - logits.max()) / temperature)
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    if top_k:
        p[order[top_k:]] = 0.0
        p /= p.sum()
    keep = np.zeros_like(p, dtype=bool)
    mass = 0.0
    for i in order:
        if mass >= top_p:
            break
        keep[i] = True
        mass += p[i]
    q = np.where(keep, p, 0.0)
    return q / q.sum()


def _exact_joint(target_dir, top_k: int) -> dict[tuple[int, ...], float]:
    hf = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float64).eval()

    def dist(prefix):
        with torch.no_grad():
            return _filtered(hf(torch.tensor([PROMPT + list(prefix)])).logits[0, -1].numpy(), T, TOP_P, top_k)

    joint = {}
    p1 = dist(())
    for a in np.nonzero(p1)[0]:
        p2 = dist((a,))
        for b in np.nonzero(p2)[0]:
            p3 = dist((a, b))
            for c in np.nonzero(p3)[0]:
                joint[(int(a), int(b), int(c))] = p1[a] * p2[b] * p3[c]
    return joint


@pytest.fixture(scope="module")
def small_vocab(tmp_path_factory):
    root = tmp_path_factory.mktemp("sampling")
    target = write_target(root / "t", "llama", seed=11, vocab_size=VOCAB, initializer_range=0.3)
    drafter = write_drafter(root / "d", target, num_layers=1, block_size=4, seed=12)
    return target, drafter


@pytest.mark.parametrize("mode,top_k", [("dflash", 0), ("dflash", 5), ("autoregressive", 0)])
def test_emitted_tokens_follow_the_target_distribution(small_vocab, mode, top_k):
    target_dir, drafter_dir = small_vocab
    target = load_target(target_dir)
    drafter = load_drafter(drafter_dir, target.cfg) if mode == "dflash" else None
    gen = Generator(TorchBackend(target, drafter, num_pages=4000, page_size=4), max_batch=1000)
    params = [SamplingParams(max_new_tokens=3, temperature=T, top_p=TOP_P, top_k=top_k, ignore_eos=True, seed=i) for i in range(N)]
    outs = gen.generate([PROMPT] * N, params)

    joint = _exact_joint(target_dir, top_k)
    counts = {}
    for o in outs:
        key = tuple(o.output_ids)
        assert key in joint, f"emitted {key}, which the target gives probability 0"
        counts[key] = counts.get(key, 0) + 1
    # Chi-square over the joint of (t1, t2, t3), cells with expected count < 5 pooled.
    cells = sorted(joint, key=joint.get, reverse=True)
    big = [c for c in cells if joint[c] * N >= 5]
    small = [c for c in cells if joint[c] * N < 5]
    observed = [counts.get(c, 0) for c in big] + ([sum(counts.get(c, 0) for c in small)] if small else [])
    expected = [joint[c] * N for c in big] + ([sum(joint[c] for c in small) * N] if small else [])
    expected = np.array(expected) * (N / sum(expected))
    assert len(big) >= 10
    assert chisquare(observed, expected).pvalue > 1e-3

    if mode == "dflash":  # both acceptance and rejection paths ran
        lengths = [n for o in outs for n in o.accepted_lengths]
        assert 2 in lengths and 1 in lengths


def test_same_seed_same_output_regardless_of_batch(small_vocab):
    target_dir, drafter_dir = small_vocab
    target = load_target(target_dir)
    drafter = load_drafter(drafter_dir, target.cfg)
    params = [SamplingParams(max_new_tokens=12, temperature=1.0, top_p=0.95, seed=s) for s in (1, 2, 3)]
    alone = [Generator(TorchBackend(target, drafter, 64, 4), max_batch=1).generate([PROMPT], [p])[0].output_ids for p in params]
    together = [o.output_ids for o in Generator(TorchBackend(target, drafter, 64, 4), max_batch=3).generate([PROMPT] * 3, params)]
    assert alone == together and len({tuple(a) for a in alone}) > 1
