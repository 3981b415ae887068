"""z-lab's own package as the oracle (issue 17 item 2): `dflash==0.1.0`'s `dflash_generate` (their drafter class,
transformers' target, their loop) against our runtime on the same random checkpoints in the released format, batch 1,
greedy, fp32: the same tokens and the same tokens per step. And z-lab's DFlash 2 drafters, which the runtime does not
run, are refused by name."""

from __future__ import annotations

import json
import random

import pytest
import torch
import transformers
from conftest import write_drafter, write_target

from dflash_trt.config import load_drafter_config
from dflash_trt.errors import ConfigError
from dflash_trt.loading import load_drafter, load_target
from dflash_trt.runtime import Generator
from dflash_trt.sampling import SamplingParams
from dflash_trt.torch_backend import TorchBackend

zlab = pytest.importorskip("dflash.model", reason="z-lab's dflash==0.1.0 is in the dev extra (pip install -e '.[dev]')")

MAX_NEW = 40
PAIRS = {
    # target arch, target kwargs, drafter kwargs
    "llama": ("llama", {}, dict(num_layers=2, block_size=8, target_layer_ids=[0, 2])),
    "qwen3-tied": ("qwen3", dict(tie=True), dict(num_layers=3, block_size=6, head_dim=24)),
    "llama-sliding-drafter": ("llama", {}, dict(num_layers=2, block_size=8, layer_types=["sliding_attention", "full_attention"],
                                               sliding_window=5, target_layer_ids=[1, 3])),
}


def _zlab_generate(draft, target, prompt: list[int], max_new: int, monkeypatch):
    # dflash_generate times its steps with torch.cuda.synchronize(); on a CPU build the clock is all that changes
    monkeypatch.setattr(zlab, "_cuda_time", lambda: 0.0)
    out = zlab.dflash_generate(draft, target, torch.tensor([prompt]), max_new, None, return_stats=True)
    return out.output_ids[0, len(prompt):].tolist(), list(out.acceptance_lengths)


class _Oracle:
    """The true continuation proposed in place of the drafter's own drafts, wrong from a point that varies with the
    position: on both sides, so that long acceptances (which random drafters never reach) are compared too."""

    def __init__(self, truth: list[int], prompt_len: int, vocab: int):
        self.truth, self.prompt_len, self.vocab = truth, prompt_len, vocab

    def drafts(self, start: int, k: int) -> list[int]:
        done = start - self.prompt_len + 1  # tokens committed so far (the last one is the block's first)
        tail = (self.truth + [0] * 64)[done : done + k]
        right = (5 * done + 3) % (k + 1)
        return tail[:right] + [(t + 1) % self.vocab for t in tail[right:]]


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    root = tmp_path_factory.mktemp("zlab")
    out = {}
    for i, (name, (arch, t_kwargs, d_kwargs)) in enumerate(PAIRS.items()):
        t = write_target(root / name / "target", arch, seed=40 + i, **t_kwargs)
        d = write_drafter(root / name / "drafter", t, seed=50 + i, **d_kwargs)
        out[name] = (t, d)
    return out


def _ours(target_dir, drafter_dir, prompt, oracle=None):
    target = load_target(target_dir)
    drafter = load_drafter(drafter_dir, target.cfg)
    backend = TorchBackend(target, drafter, num_pages=128, page_size=4)
    if oracle is not None:
        real = backend.draft

        def draft(seq_ids, last_tokens, num_drafts):
            real(seq_ids, last_tokens, num_drafts)
            return [oracle.drafts(backend.target_cache.lengths[s], k) for s, k in zip(seq_ids, num_drafts)]

        backend.draft = draft
    out = Generator(backend, eos_token_ids=(), max_batch=1).generate([prompt], SamplingParams(max_new_tokens=MAX_NEW, ignore_eos=True))[0]
    return out.output_ids, out.accepted_lengths


@pytest.mark.parametrize("name", list(PAIRS))
@pytest.mark.parametrize("drafts", ["drafter", "oracle"])
def test_our_runtime_equals_zlab_dflash_generate(pairs, name, drafts, monkeypatch):
    target_dir, drafter_dir = pairs[name]
    hf = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    draft = zlab.DFlashDraftModel.from_pretrained(drafter_dir, dtype=torch.float32).eval()
    rng = random.Random(len(name))
    for prompt in ([rng.randrange(5, 96) for _ in range(n)] for n in (4, 13)):
        oracle = None
        if drafts == "oracle":
            truth, _ = _zlab_generate(draft, hf, prompt, MAX_NEW, monkeypatch)  # a random drafter rejects: plain greedy
            oracle = _Oracle(truth, len(prompt), hf.config.vocab_size)
            real_logits = draft.compute_logits

            def compute_logits(hidden, head, _real=real_logits):  # their drafts → the oracle's, through the argmax
                logits = _real(hidden, head)
                start = zlab_state["start"]
                forced = torch.full_like(logits, -1e9)
                for j, t in enumerate(oracle.drafts(start, logits.shape[1])):
                    forced[0, j, t] = 0.0
                return forced

            zlab_state = {}
            real_forward = draft.forward

            def forward(*args, _real=real_forward, **kwargs):  # the block's first position is the last committed token
                zlab_state["start"] = int(kwargs["position_ids"][0, -1]) - (kwargs["noise_embedding"].shape[1] - 1)
                return _real(*args, **kwargs)

            monkeypatch.setattr(draft, "compute_logits", compute_logits)
            monkeypatch.setattr(draft, "forward", forward)
        theirs, their_steps = _zlab_generate(draft, hf, prompt, MAX_NEW, monkeypatch)
        ours, our_steps = _ours(target_dir, drafter_dir, prompt, oracle)
        assert ours == theirs, (name, drafts, prompt)
        assert our_steps == their_steps, (name, drafts, prompt)
        if drafts == "oracle":
            assert max(their_steps) >= 4  # long acceptances were compared
        monkeypatch.undo()


@pytest.mark.parametrize("keys", [
    {"architectures": ["DFlash2DraftModel"]},
    {"dflash_config": {"conv_kernel_size": 4, "conv_group_size": 16}},
    {"selector_rank": 64, "selector_top_k": 8},
    {"dflash_config": {"input_embedding_scale": 2.0}},
    {"output_multiplier": -1.0},
])
def test_dflash2_and_unsupported_zlab_keys_are_refused_by_name(pairs, tmp_path, keys):
    """z-lab's DFlash 2 (a grouped causal conv in each layer and a candidate selector, `DFlash2DraftModel`) is not
    run here, and neither is a scaled block embedding: one ConfigError naming the key. A positive output multiplier
    or a logit soft-cap leave every draft's argmax as it is, so they load."""
    _, drafter_dir = pairs["llama"]
    raw = json.loads((drafter_dir / "config.json").read_text())
    for key, value in keys.items():
        raw[key] = {**raw.get(key, {}), **value} if isinstance(value, dict) else value
    bad = tmp_path / "drafter"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError) as e:
        load_drafter_config(bad)
    named = e.value.key
    assert named and any(named.split(".")[-1] == k or named == k for k in _flat_keys(keys)), named
    ok = {**json.loads((drafter_dir / "config.json").read_text()), "output_multiplier": 0.5, "final_logit_softcapping": 30.0}
    (bad / "config.json").write_text(json.dumps(ok))
    assert load_drafter_config(bad).num_layers == 2


def _flat_keys(keys: dict) -> list[str]:
    return [k for key, v in keys.items() for k in ([key] if not isinstance(v, dict) else list(v))]
