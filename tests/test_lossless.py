"""Lossless: speculative greedy output == the target's own greedy output (transformers' generate), token for token.

Random drafters rarely guess right, so the accept/rollback paths are also driven by an
oracle drafter: the real drafter runs (its caches and KV injection included), then its
proposals are replaced by the true continuation, corrupted at a random point.
"""

from __future__ import annotations

import random

import pytest
import torch
import transformers
from conftest import write_drafter, write_target

from dflash_trt.loading import load_drafter
from dflash_trt.loading import load_target
from dflash_trt.runtime import Generator
from dflash_trt.sampling import SamplingParams
from dflash_trt.torch_backend import TorchBackend

NUM_PROMPTS = 20
MAX_NEW = 24


def _prompts(seed: int, n: int = NUM_PROMPTS) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 96) for _ in range(rng.randrange(3, 21))] for _ in range(n)]


def _hf_greedy(target_dir, prompts, max_new) -> list[list[int]]:
    hf = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            ids = hf.generate(torch.tensor([p]), max_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0)
            out.append(ids[0, len(p):].tolist())
    return out


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lossless")
    targets = {"llama": write_target(root / "llama", "llama", seed=5), "qwen3": write_target(root / "qwen3", "qwen3", seed=6, tie=True)}
    drafters = {
        "full": write_drafter(root / "d-full", targets["llama"], num_layers=2, block_size=16, seed=7),
        "sliding": write_drafter(root / "d-swa", targets["qwen3"], num_layers=2, block_size=16, seed=8,
                                 layer_types=["sliding_attention", "full_attention"], sliding_window=6),
    }
    prompts = _prompts(0)
    refs = {name: _hf_greedy(d, prompts, MAX_NEW) for name, d in targets.items()}
    models = {name: load_target(d) for name, d in targets.items()}
    return targets, drafters, prompts, refs, models


def _backend(models, drafters, name, block, target="llama", pages=512):
    target_model = models[target]
    drafter = load_drafter(drafters[name], target_model.cfg) if name else None
    return TorchBackend(target_model, drafter, num_pages=pages, page_size=4, block_size=block)


@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("block", [2, 4, 16])
def test_speculative_greedy_equals_target_greedy(setup, batch, block):
    targets, drafters, prompts, refs, models = setup
    gen = Generator(_backend(models, drafters, "full", block), max_batch=batch)
    outs = gen.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW))
    assert [o.output_ids for o in outs] == refs["llama"]
    assert all(o.finish_reason == "length" for o in outs)
    assert gen.backend.target_cache.num_free_pages == gen.backend.target_cache.num_pages  # everything freed


@pytest.mark.parametrize("block", [4, 16])
def test_sliding_window_drafter_is_lossless_on_qwen3(setup, block):
    targets, drafters, prompts, refs, models = setup
    gen = Generator(_backend(models, drafters, "sliding", block, target="qwen3"), max_batch=3)
    outs = gen.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW))
    assert [o.output_ids for o in outs] == refs["qwen3"]


def test_plain_decoding_through_the_same_loop_equals_target_greedy(setup):
    targets, drafters, prompts, refs, models = setup
    gen = Generator(_backend(models, drafters, None, None), max_batch=8)
    outs = gen.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW))
    assert [o.output_ids for o in outs] == refs["llama"]
    assert all(set(o.accepted_lengths) == {1} for o in outs)


class OracleDrafts:
    """Wraps a TorchBackend: runs the real drafter, then proposes the reference continuation,
    right for a random number of tokens and wrong after that."""

    def __init__(self, inner: TorchBackend, prompts, refs, seed: int):
        self.inner, self.prompts, self.refs = inner, prompts, refs
        self.rng = random.Random(seed)

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def draft(self, seq_ids, last_tokens, num_drafts):
        real = self.inner.draft(seq_ids, last_tokens, num_drafts)
        out = []
        for s, k, r in zip(seq_ids, num_drafts, real):
            done = self.inner.target_cache.lengths[s] - len(self.prompts[s]) + 1  # tokens committed so far
            truth = (self.refs[s] + [0] * 64)[done : done + k]
            right = self.rng.choice([k, k, self.rng.randrange(k + 1)])  # often fully right
            wrong = [(t + 1 + self.rng.randrange(90)) % 96 for t in truth[right:]]
            out.append(truth[:right] + wrong if self.rng.random() < 0.9 else r)
        return out


@pytest.mark.parametrize("block", [2, 4, 16])
@pytest.mark.parametrize("batch", [1, 3, 8])
def test_lossless_with_long_acceptances_and_stops_inside_blocks(setup, batch, block):
    """EOS and max_new_tokens land inside accepted blocks; output is still exactly the reference."""
    targets, drafters, prompts, refs, models = setup
    ref = refs["llama"]
    rng = random.Random(batch * 100 + block)
    eos = {ref[i][rng.randrange(2, MAX_NEW)] for i in range(0, NUM_PROMPTS, 4)}  # some tokens the target does emit
    max_new = [rng.randrange(1, MAX_NEW + 1) for _ in prompts]
    want = []
    for r, m in zip(ref, max_new):
        r = r[:m]
        stop = next((i for i, t in enumerate(r) if t in eos), None)
        want.append((r[: stop + 1], "stop") if stop is not None else (r, "length"))
    backend = OracleDrafts(_backend(models, drafters, "full", block), prompts, ref, seed=block)
    gen = Generator(backend, eos_token_ids=eos, max_batch=batch)
    outs = gen.generate(prompts, [SamplingParams(max_new_tokens=m) for m in max_new])
    assert [(o.output_ids, o.finish_reason) for o in outs] == want
    steps = [n for o in outs for n in o.accepted_lengths]
    if block > 2:
        assert max(steps) >= block - 1  # long acceptances really happened
    assert sum(o.finish_reason == "stop" for o in outs) >= 3
    assert backend.target_cache.num_free_pages == backend.target_cache.num_pages
    assert backend.drafter_cache.num_free_pages == backend.drafter_cache.num_pages


def test_requests_joining_a_running_batch_stay_lossless(setup):
    """Continuous batching: prompts submitted while others are mid-generation."""
    targets, drafters, prompts, refs, models = setup
    backend = OracleDrafts(_backend(models, drafters, "full", 8), prompts, refs["llama"], seed=1)
    gen = Generator(backend, max_batch=4)
    ids, done = [], {}
    for p in prompts:
        ids.append(gen.submit(p, SamplingParams(max_new_tokens=MAX_NEW)))
        for out in gen.step():
            done[out.seq_id] = out.output_ids
    while gen.has_work:
        for out in gen.step():
            done[out.seq_id] = out.output_ids
    assert [done[i] for i in ids] == refs["llama"]


def test_verify_budget_shrinks_blocks_with_the_batch_and_stays_lossless(setup):
    """max_verify_tokens=24 over 16-token blocks: 1 request drafts 15, 3 draft 7, 8 draft 2, 12 decode plainly."""
    targets, drafters, prompts, refs, models = setup
    backend = OracleDrafts(_backend(models, drafters, "full", 16), prompts, refs["llama"], seed=2)
    passes: list[tuple[int, int, int]] = []  # (batch, tokens verified, longest block)
    verify = backend.inner.verify

    def counting_verify(seq_ids, blocks, need_logits=None):
        passes.append((len(blocks), sum(map(len, blocks)), max(map(len, blocks))))
        return verify(seq_ids, blocks, need_logits)

    backend.inner.verify = counting_verify
    for batch in (1, 3, 8, 12):
        gen = Generator(backend, max_batch=batch, max_verify_tokens=24)
        passes.clear()
        outs = gen.generate(prompts[:12], SamplingParams(max_new_tokens=MAX_NEW))
        assert [o.output_ids for o in outs] == refs["llama"][:12]
        assert all(tokens <= 24 and longest <= 1 + gen.drafts_per_request(b) for b, tokens, longest in passes)
        assert max(longest for b, _, longest in passes if b == batch) == 1 + gen.drafts_per_request(batch)  # and uses it
    assert [Generator(backend, max_verify_tokens=24).drafts_per_request(b) for b in (1, 3, 8, 12, 24)] == [15, 7, 2, 1, 0]


def test_small_pool_queues_requests_instead_of_failing(setup):
    targets, drafters, prompts, refs, models = setup
    # 24 pages of 4 tokens: each request reserves up to ceil((20 + 24 + 4) / 4) = 12, so one or two run at a time
    backend = _backend(models, drafters, "full", 4, pages=24)
    gen = Generator(backend, max_batch=8)
    outs = gen.generate(prompts[:6], SamplingParams(max_new_tokens=MAX_NEW))
    assert [o.output_ids for o in outs] == refs["llama"][:6]


def test_drafts_inside_the_loop_equal_naive_drafts_recomputed_from_scratch(setup):
    """The drafter's incremental context (KV injected step by step, rejected tokens rolled back)
    gives the same proposals as the naive drafter fed the whole committed prefix at once."""
    from naive_dflash import naive_block_logits

    targets, drafters, prompts, refs, models = setup
    target = models["llama"]
    backend = OracleDrafts(_backend(models, drafters, "full", 8), prompts, refs["llama"], seed=3)
    calls = []
    real_draft = backend.inner.draft

    def recording_draft(seq_ids, last_tokens, num_drafts):
        lengths = [backend.inner.target_cache.lengths[s] for s in seq_ids]
        out = real_draft(seq_ids, last_tokens, num_drafts)
        calls.extend(zip(seq_ids, lengths, last_tokens, num_drafts, out))
        return out

    backend.inner.draft = recording_draft
    Generator(backend, max_batch=3).generate(prompts[:3], SamplingParams(max_new_tokens=MAX_NEW))
    assert len(calls) > 6
    ids = backend.inner.drafter.cfg.target_layer_ids
    for seq, length, last, k, drafted in calls[::3]:
        committed = (prompts[seq] + refs["llama"][seq])[:length]
        cache = target.new_cache(32, 4)
        cache.add_sequence(0)
        with torch.no_grad():
            features = target(torch.tensor(committed), cache.prepare([0], [length]), cache, ids)[1]
        logits = naive_block_logits(drafters["full"], target.model.embed_tokens.weight, target.lm_head_weight, features, [last] + [3] * k, start=length)
        assert logits.argmax(-1).tolist() == drafted


@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("block", [2, 4, 8])
def test_eagle_baseline_is_lossless_with_long_acceptances(setup, tmp_path, batch, block):
    from conftest import write_eagle

    from dflash_trt.loading import load_eagle_drafter

    targets, drafters, prompts, refs, models = setup
    eagle = load_eagle_drafter(write_eagle(tmp_path / "eagle", targets["llama"], block_size=8), models["llama"].cfg)
    inner = TorchBackend(models["llama"], eagle, num_pages=512, page_size=4, block_size=block)
    backend = OracleDrafts(inner, prompts, refs["llama"], seed=block + batch)
    outs = Generator(backend, max_batch=batch).generate(prompts, SamplingParams(max_new_tokens=MAX_NEW))
    assert [o.output_ids for o in outs] == refs["llama"]
    assert inner.drafter_cache.num_free_pages == inner.drafter_cache.num_pages


def test_eagle_chain_drafts_equal_a_full_recompute(setup, tmp_path):
    """The cached chain (context pairs injected step by step, scratch dropped) proposes what a
    from-scratch causal recompute over [true pairs ; own chain] proposes."""
    import torch.nn.functional as F
    from conftest import write_eagle

    from dflash_trt.loading import load_eagle_drafter

    targets, drafters, prompts, refs, models = setup
    target = models["llama"]
    eagle = load_eagle_drafter(write_eagle(tmp_path / "eagle", targets["llama"], block_size=6), target.cfg)
    backend = OracleDrafts(TorchBackend(target, eagle, num_pages=512, page_size=4), prompts, refs["llama"], seed=9)
    calls, real_draft = [], backend.inner.draft

    def recording_draft(seq_ids, last_tokens, num_drafts):
        lengths = [backend.inner.target_cache.lengths[s] for s in seq_ids]
        out = real_draft(seq_ids, last_tokens, num_drafts)
        calls.extend(zip(seq_ids, lengths, last_tokens, out))
        return out

    backend.inner.draft = recording_draft
    Generator(backend, max_batch=3).generate(prompts[:3], SamplingParams(max_new_tokens=MAX_NEW))
    cfg, embed = eagle.cfg, target.model.embed_tokens.weight
    for seq, length, last, drafted in calls[::2]:
        committed = (prompts[seq] + refs["llama"][seq])[:length]
        cache = target.new_cache(32, 4)
        cache.add_sequence(0)
        with torch.no_grad():
            feats = target(torch.tensor(committed), cache.prepare([0], [length]), cache, cfg.target_layer_ids)[1]
            hidden = eagle.fuse(feats)  # [length, H] for pairs at positions 0..length-1
            tokens = committed[1:] + [last]
            want = []
            for _ in drafted:  # recompute every pair from scratch, causal attention over all of them
                n = len(tokens)
                cos, sin = eagle.rotary(torch.arange(n), hidden.dtype)

                def attend(q, k, v):
                    out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True, enable_gqa=True)
                    return out.transpose(0, 1).reshape(n, -1)

                h = eagle.layer(embed[torch.tensor(tokens)], hidden, cos, sin, attend)
                nxt = int(target.logits(eagle.norm(h[-1:])).argmax())
                want.append(nxt)
                hidden = torch.cat([hidden, h[-1:]])
                tokens = tokens + [nxt]
        assert want == drafted


@pytest.mark.parametrize("batch", [1, 3, 8])
def test_draft_length_chosen_per_step_stays_lossless(setup, batch):
    """A policy whose cost curve makes drafting pay at small batches only: widths change from step to step as
    the batch fills and drains and as the acceptance estimates move; the output is still the target's."""
    from dflash_trt.draft_length import DraftLengthPolicy, StepCost

    targets, drafters, prompts, refs, models = setup
    backend = OracleDrafts(_backend(models, drafters, "full", 16), prompts, refs["llama"], seed=batch)
    cost = StepCost([1, 4, 8], [0, 3, 15], [[1.0, 1.1, 1.6], [1.5, 2.4, 6.0], [2.0, 5.0, 16.0]])
    policy = DraftLengthPolicy(cost, backend.max_drafts)
    chosen = []
    choose = policy.choose
    policy.choose = lambda b: chosen.append(choose(b)) or chosen[-1]
    outs = Generator(backend, max_batch=batch, draft_policy=policy).generate(prompts, SamplingParams(max_new_tokens=MAX_NEW))
    assert [o.output_ids for o in outs] == refs["llama"]
    assert len(set(chosen)) >= 2  # the width really changed
