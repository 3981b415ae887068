"""The engine path's contract, emulated on CPU: the emulated C++ runtime (DecodingMode::Eagle) driving the
emulated DFlash engine gives the reference loop's tokens and drafts, request for request.

The reference is runtime.Generator over TorchBackend (itself tested against transformers' greedy output).
Random drafters rarely guess right, so the acceptance paths are also driven by an oracle: the same
deterministic corruption of the true continuation on both sides, applied after the real drafter ran.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from conftest import write_drafter, write_target
from test_gpt_oss import write_gpt_oss
from scipy.stats import chisquare

from dflash_trt.loading import load_drafter, load_target
from dflash_trt.runtime import Generator
from dflash_trt.sampling import SamplingParams
from dflash_trt.torch_backend import TorchBackend
from dflash_trt.trtllm import contract
from dflash_trt.trtllm.emulation import DFlashEngine, EagleRuntime, KVBlockPool, sample_inverse_cdf

MAX_NEW = 20


def _prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(5, 96) for _ in range(rng.randrange(3, 19))] for _ in range(n)]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("contract")
    out = {}
    for arch, seed, tie in (("llama", 21, False), ("qwen3", 22, True)):
        t = write_target(root / arch, arch, seed=seed, tie=tie)
        # The drafter's layers share the target's KV pool: the same KV heads and head_dim.
        head_dim = 24 if arch == "qwen3" else 16
        d = write_drafter(root / f"{arch}-d", t, num_layers=2, block_size=6, seed=seed + 10, head_dim=head_dim)
        target = load_target(t)
        out[arch] = (target, load_drafter(d, target.cfg))
        out[arch + "-dirs"] = (t, d)
    # gpt-oss (issue 19 item 4): MoE, sinks, sliding windows and yarn inside the emulated engine; 2 KV heads of 16
    t = write_gpt_oss(root / "gpt-oss", seed=23)
    d = write_drafter(root / "gpt-oss-d", t, num_layers=2, block_size=6, seed=33, head_dim=16, target_layer_ids=[1, 2])
    target = load_target(t)
    out["gpt-oss"] = (target, load_drafter(d, target.cfg))
    out["gpt-oss-dirs"] = (t, d)
    return out


def _oracle(truth: list[int], done: int, real: list[int], key: tuple) -> list[int]:
    """Deterministic in (request, tokens committed): the continuation right for a random count, then wrong."""
    rng = random.Random(hash(key))
    k = len(real)
    if rng.random() < 0.2:
        return real
    right = rng.choice([k, k, rng.randrange(k + 1)])
    tail = (truth + [0] * 64)[done : done + k]
    return tail[:right] + [(t + 1 + rng.randrange(90)) % 96 for t in tail[right:]]


def _reference(target, drafter, prompts, max_new, max_batch, truth=None, eos=()):
    """Generator + TorchBackend; returns outputs and, per request, the drafts of each step."""
    backend = TorchBackend(target, drafter, num_pages=1024, page_size=4)
    drafts: dict[int, list[list[int]]] = {i: [] for i in range(len(prompts))}
    real_draft = backend.draft

    def draft(seq_ids, last_tokens, num_drafts):
        out = real_draft(seq_ids, last_tokens, num_drafts)
        if truth is not None:
            starts = [backend.target_cache.lengths[s] for s in seq_ids]
            out = [_oracle(truth[s], p - len(prompts[s]) + 1, d, (s, p)) for s, p, d in zip(seq_ids, starts, out)]
        for s, d in zip(seq_ids, out):
            drafts[s].append(d)
        return out

    backend.draft = draft
    gen = Generator(backend, eos_token_ids=eos, max_batch=max_batch)
    outs = gen.generate(prompts, [SamplingParams(max_new_tokens=m) for m in max_new])
    return outs, drafts


def _emulated(target, drafter, prompts, max_new, max_batch, truth=None, eos=(), join_every=None, tokens_per_block=4, layers=None):
    """EagleRuntime + DFlashEngine over a pool of TensorRT-LLM's layout (`layers` layers: by default the target's
    and the drafter's); request i is prompt i."""
    layers = layers or target.cfg.num_layers + drafter.cfg.num_layers
    pool = KVBlockPool(400, layers, target.cfg.num_kv_heads, tokens_per_block, target.cfg.head_dim)
    holder = {}

    def draft_filter(row, start, real):
        rid = holder["runtime"].batch_request_ids[row]
        return _oracle(truth[rid], start - len(prompts[rid]) + 1, real, (rid, start))

    engine = DFlashEngine(target, drafter, pool, draft_filter=draft_filter if truth is not None else None)
    runtime = holder["runtime"] = EagleRuntime(engine, max_batch=max_batch)
    ids = []
    for i, (p, m) in enumerate(zip(prompts, max_new)):
        ids.append(runtime.enqueue_request(p, m, end_ids=eos))
        if join_every and i % join_every == join_every - 1:
            runtime.step()  # later requests join a running batch
    done = runtime.run()
    assert len(pool.free) == pool.num_blocks and runtime.reserved == 0  # every block back
    return [done[i] for i in ids]


def _assert_same_drafts(emu, ref_drafts, K) -> int:
    compared = 0
    for i, e in enumerate(emu):
        full = [d for d in ref_drafts[i] if len(d) == K]  # the reference drafts fewer near max_new_tokens
        assert e.drafts_fed[: len(full)] == full
        compared += len(full)
    return compared


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt-oss"])
@pytest.mark.parametrize("max_batch", [1, 3, 8])
def test_emulated_engine_equals_the_reference_loop(models, arch, max_batch):
    target, drafter = models[arch]
    prompts = _prompts(max_batch, 8)
    rng = random.Random(max_batch)
    max_new = [rng.randrange(1, MAX_NEW + 1) for _ in prompts]
    ref, ref_drafts = _reference(target, drafter, prompts, max_new, max_batch)
    emu = _emulated(target, drafter, prompts, max_new, max_batch, join_every=3)
    assert [e.output_ids for e in emu] == [r.output_ids for r in ref]
    assert [e.finish_reason for e in emu] == [r.finish_reason for r in ref]
    assert _assert_same_drafts(emu, ref_drafts, drafter.cfg.block_size - 1) >= 8


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt-oss"])
@pytest.mark.parametrize("max_batch", [1, 3, 8])
def test_emulated_engine_equals_the_reference_loop_with_long_acceptances_and_stops(models, arch, max_batch):
    """Oracle drafts (right for a random count) on both sides; EOS lands inside accepted blocks."""
    target, drafter = models[arch]
    prompts = _prompts(10 + max_batch, 10)
    plain, _ = _reference(target, None, prompts, [MAX_NEW] * len(prompts), 8)
    truth = [o.output_ids for o in plain]
    rng = random.Random(max_batch)
    eos = {truth[i][rng.randrange(2, MAX_NEW)] for i in range(0, len(prompts), 3)}
    max_new = [rng.randrange(1, MAX_NEW + 1) for _ in prompts]
    ref, ref_drafts = _reference(target, drafter, prompts, max_new, max_batch, truth=truth, eos=eos)
    emu = _emulated(target, drafter, prompts, max_new, max_batch, truth=truth, eos=eos, join_every=2)
    assert [(e.output_ids, e.finish_reason) for e in emu] == [(r.output_ids, r.finish_reason) for r in ref]
    for e, t, m in zip(emu, truth, max_new):  # and both are the target's own greedy output, cut by the stop rules
        assert e.output_ids == t[: len(e.output_ids)]
    K = drafter.cfg.block_size - 1
    for e, r in zip(emu, ref):  # step for step while the reference drafts whole blocks
        full = sum(len(d) == K for d in ref_drafts[r.seq_id])
        assert e.accepted_lengths[:full] == r.accepted_lengths[:full]
    assert max(n for e in emu for n in e.accepted_lengths) == drafter.cfg.block_size  # whole blocks accepted
    assert sum(e.finish_reason == "stop" for e in emu) >= 1
    assert _assert_same_drafts(emu, ref_drafts, K) >= 5


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt-oss"])
def test_the_one_engine_checkpoint_drives_the_emulated_engine_like_the_reference(models, tmp_path, arch):
    """`convert --format engine` is what trtllm-build reads: both models loaded from it, and the KV pool sized as the
    C++ runtime sizes it from that config (num_hidden_layers + eagle_net_config.num_hidden_layers, gptJsonConfig.cpp
    createModelConfig), give the reference loop's tokens and drafts on the original Hugging Face models."""
    import json

    from dflash_trt.convert import convert

    t_dir, d_dir = models[arch + "-dirs"]
    engine = tmp_path / "engine"
    convert(t_dir, d_dir, engine, fmt="engine", dtype="fp32", progress=False, log=lambda m: None)
    raw = json.loads((engine / "config.json").read_text())
    layers = raw["num_hidden_layers"] + raw["eagle_net_config"]["num_hidden_layers"]
    target, drafter = models[arch]
    assert layers == target.cfg.num_layers + drafter.cfg.num_layers
    assert raw["max_draft_len"] == raw["num_eagle_layers"] == drafter.cfg.block_size - 1  # the contract's K
    e_target = load_target(engine)
    e_drafter = load_drafter(engine, e_target.cfg)
    prompts = _prompts(31, 5)
    max_new = [MAX_NEW] * len(prompts)
    ref, ref_drafts = _reference(target, drafter, prompts, max_new, 3)
    emu = _emulated(e_target, e_drafter, prompts, max_new, 3, join_every=2, layers=layers)
    assert [e.output_ids for e in emu] == [r.output_ids for r in ref]
    assert _assert_same_drafts(emu, ref_drafts, raw["max_draft_len"]) >= 5


def test_contract_inputs_are_ones_the_runtime_binds_and_dims_are_known():
    """TllmRuntime throws on an engine input that the runtime does not bind: ours are all EAGLE's or the base's."""
    names = contract.INPUT_NAMES + contract.OUTPUT_NAMES
    assert len(set(names)) == len(names)
    assert set(contract.INPUT_NAMES) <= contract.EAGLE_RUNTIME_INPUTS | contract.BASE_INPUTS
    sizes = contract.Dims(16).sizes(batch=3, generation=2, tokens=33, max_blocks=5, vocab=100, drafts=30)
    for io in contract.INPUTS + contract.OUTPUTS:
        assert all(d in sizes or d.isdigit() for d in io.shape.strip("[]").split(", ")), io


def test_a_fully_accepted_block_needs_every_kv_slot_the_runtime_adds(models, monkeypatch):
    """The runtime adds maxPathLen + maxDecodingTokens = 2K + 2 tokens of KV per call; after a fully accepted step
    the next block's scratch K/V reach the last of them, so num_eagle_layers = K (P = K + 1) is the least that fits."""
    target, drafter = models["llama"]
    prompts = _prompts(5, 2)
    plain, _ = _reference(target, None, prompts, [MAX_NEW] * 2, 2)
    truth = [o.output_ids for o in plain]

    def always_right(row, start, real):
        rid = holder.batch_request_ids[row]
        done = start - len(prompts[rid]) + 1
        return (truth[rid] + [0] * 64)[done : done + len(real)]

    def run(tokens_per_block):
        pool = KVBlockPool(200, target.cfg.num_layers + drafter.cfg.num_layers, target.cfg.num_kv_heads, tokens_per_block, target.cfg.head_dim)
        runtime = EagleRuntime(DFlashEngine(target, drafter, pool, draft_filter=always_right), max_batch=2)
        for p in prompts:
            runtime.enqueue_request(p, MAX_NEW)
        return runtime

    holder = run(1)
    out = holder.run()
    assert [out[i].output_ids for i in range(2)] == truth
    assert max(n for r in out.values() for n in r.accepted_lengths) == drafter.cfg.block_size
    monkeypatch.setattr(contract.Dims, "kv_tokens_per_step", property(lambda self: self.max_path_len + self.max_decoding_tokens - 1))
    holder = run(1)
    with pytest.raises(IndexError, match="past the .* KV slots the runtime allocated"):
        holder.run()


def test_chain_packed_mask_is_causal_bit_for_bit():
    dims = contract.Dims(40)  # D = 40 > 32: two mask words per row
    mask = contract.chain_packed_mask(dims, 2).to(torch.int64) & 0xFFFFFFFF
    for i in range(dims.max_decoding_tokens):
        bits = [(int(mask[1, i, j // 32]) >> (j % 32)) & 1 for j in range(dims.max_decoding_tokens)]
        assert bits == [1] * (i + 1) + [0] * (dims.max_decoding_tokens - i - 1)


def test_inverse_cdf_sampling_follows_the_distribution():
    p = torch.tensor([0.1, 0.0, 0.6, 0.3])
    gen = torch.Generator().manual_seed(0)
    counts = np.bincount([sample_inverse_cdf(p * 3, float(torch.rand((), generator=gen))) for _ in range(4000)], minlength=4)
    assert counts[1] == 0
    assert chisquare(counts[[0, 2, 3]], np.array([0.1, 0.6, 0.3]) * 4000).pvalue > 1e-3


def test_sampling_engine_emits_the_target_distribution(tmp_path):
    """T > 0: the accept op's rejection sampling from the runtime's uniforms (rand_data_validation,
    rand_data_sample) at eagle_temperature emits exact samples: the joint of the first three tokens fits
    the target's, enumerated from transformers' logits in float64."""
    import transformers
    from test_sampling import _filtered

    vocab, temperature, prompt, n = 12, 0.8, [5, 9, 4, 11, 7], 3000
    t = write_target(tmp_path / "t", "llama", seed=11, vocab_size=vocab, initializer_range=0.3)
    d = write_drafter(tmp_path / "d", t, num_layers=1, block_size=4, seed=12)
    target = load_target(t)
    drafter = load_drafter(d, target.cfg)
    pool = KVBlockPool(n * 4, target.cfg.num_layers + 1, target.cfg.num_kv_heads, 4, target.cfg.head_dim)
    runtime = EagleRuntime(DFlashEngine(target, drafter, pool), max_batch=1000, greedy=False)
    ids = [runtime.enqueue_request(prompt, 3, temperature=temperature, seed=i) for i in range(n)]
    done = runtime.run()

    hf = transformers.AutoModelForCausalLM.from_pretrained(t, dtype=torch.float64).eval()

    def dist(prefix):
        with torch.no_grad():
            return _filtered(hf(torch.tensor([prompt + list(prefix)])).logits[0, -1].numpy(), temperature, 1.0, 0)

    joint = {}
    p1 = dist(())
    for a in range(vocab):
        p2 = dist((a,))
        for b in range(vocab):
            p3 = dist((a, b))
            for c in range(vocab):
                joint[(a, b, c)] = p1[a] * p2[b] * p3[c]
    counts: dict[tuple, int] = {}
    for i in ids:
        key = tuple(done[i].output_ids)
        counts[key] = counts.get(key, 0) + 1
    cells = sorted(joint, key=joint.get, reverse=True)
    big = [c for c in cells if joint[c] * n >= 5]
    small = [c for c in cells if joint[c] * n < 5]
    observed = [counts.get(c, 0) for c in big] + [sum(counts.get(c, 0) for c in small)]
    expected = [joint[c] * n for c in big] + [sum(joint[c] for c in small) * n]
    assert len(big) >= 10
    assert chisquare(observed, np.array(expected) * (n / sum(expected))).pvalue > 1e-3
    lengths = [k for i in ids for k in done[i].accepted_lengths]
    assert 1 in lengths and max(lengths) >= 2  # rejections and acceptances both ran


def test_the_engine_check_script_tokenizes_through_the_chat_template_and_matches_the_reference(tiny_dirs, capsys):
    """`python -m dflash_trt.trtllm.emulation_check` (what scripts/gpu_engine_check.sh runs): prompts through the
    target's chat template, stops at the EOS union, a pool sized by kv_cache.pool_pages, the emulated engine equal to
    the reference runtime token for token and draft for draft."""
    from dflash_trt.loading import encode_prompt, load_tokenizer
    from dflash_trt.trtllm import emulation_check

    target_dir, drafter_dir = tiny_dirs
    assert emulation_check.main(["--target", str(target_dir), "--drafter", str(drafter_dir), "--max-new-tokens", "12", "--threads", "1"]) == 0
    assert "tokens equal to the reference runtime: True; drafts equal: True" in capsys.readouterr().out
    tok = load_tokenizer(target_dir)
    chat = encode_prompt(tok, emulation_check.PROMPTS[0], chat=True)
    assert chat[0] == tok.convert_tokens_to_ids("<|im_start|>") and chat != tok.encode(emulation_check.PROMPTS[0])


# -- draft trees on the contract (tree.py): next_draft_paths with several paths, the runtime's K/V move along the
#    accepted one, against the reference loop with Generator(tree=...) ------------------------------------------------

def _oracle_candidates(truth: list[int], done: int, candidates: list[list[int]], key: tuple) -> list[list[int]]:
    """Deterministic in (request, tokens committed): the true continuation put among the slots' candidates at a
    random rank (often not the first, so kept paths leave the chain) for a random number of slots."""
    rng = random.Random(hash(key))
    tail = (truth + [0] * 64)[done : done + len(candidates)]
    right = rng.choice([len(candidates), rng.randrange(len(candidates) + 1)])
    out = []
    for j, row in enumerate(candidates):
        if j < right:
            row = [t for t in row if t != tail[j]]
            row.insert(rng.choice([0, 1, 1, len(row)]), tail[j])
            row = row[: len(candidates[j])]
        out.append(row)
    return out


def _reference_tree(target, drafter, prompts, max_new, max_batch, spec, truth=None):
    """Generator(tree=spec) + TorchBackend; per request, each step's (slots drafted, node tokens, parents)."""
    backend = TorchBackend(target, drafter, num_pages=1024, page_size=4)
    steps: dict[int, list] = {i: [] for i in range(len(prompts))}
    real_candidates, real_verify = backend.draft_candidates, backend.verify_tree
    slots: dict[int, int] = {}

    def draft_candidates(seq_ids, last_tokens, num_drafts, top_k):
        out = real_candidates(seq_ids, last_tokens, num_drafts, top_k)
        for s, k in zip(seq_ids, num_drafts):
            slots[s] = k
        if truth is None:
            return out
        starts = [backend.target_cache.lengths[s] for s in seq_ids]
        return [(_oracle_candidates(truth[s], p - len(prompts[s]) + 1, t, (s, p)), lp) for s, p, (t, lp) in zip(seq_ids, starts, out)]

    def verify_tree(seq_ids, blocks, parents, need_logits=None):
        for s, block, par in zip(seq_ids, blocks, parents):
            steps[s].append((slots[s], block[1:], par))
        return real_verify(seq_ids, blocks, parents, need_logits)

    backend.draft_candidates, backend.verify_tree = draft_candidates, verify_tree
    outs = Generator(backend, max_batch=max_batch, tree=spec).generate(prompts, [SamplingParams(max_new_tokens=m) for m in max_new])
    return outs, steps


def _emulated_tree(target, drafter, prompts, max_new, max_batch, spec, truth=None, join_every=3):
    layers = target.cfg.num_layers + drafter.cfg.num_layers
    pool = KVBlockPool(400, layers, target.cfg.num_kv_heads, 4, target.cfg.head_dim)
    holder, paths_fed = {}, {}

    def draft_filter(row, start, candidates):
        rid = holder["runtime"].batch_request_ids[row]
        return _oracle_candidates(truth[rid], start - len(prompts[rid]) + 1, candidates, (rid, start))

    engine = DFlashEngine(target, drafter, pool, draft_filter=draft_filter if truth is not None else None, tree=spec)
    runtime = holder["runtime"] = EagleRuntime(engine, max_batch=max_batch)
    real_inputs = runtime._inputs

    def inputs(context, generation):  # record the tree each generation row is fed, per request
        io = real_inputs(context, generation)
        for b, r in enumerate(context + generation):
            if b >= len(context):
                paths_fed.setdefault(r.request_id, []).append(contract.parents_of_paths(io["draft_paths"][b], int(io["draft_lens"][b]) + 1))
        return io

    runtime._inputs = inputs
    ids = []
    for i, (p, m) in enumerate(zip(prompts, max_new)):
        ids.append(runtime.enqueue_request(p, m))
        if join_every and i % join_every == join_every - 1:
            runtime.step()
    done = runtime.run()
    assert len(pool.free) == pool.num_blocks and runtime.reserved == 0
    return [done[i] for i in ids], paths_fed


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt-oss"])
@pytest.mark.parametrize("max_batch", [1, 3, 8])
@pytest.mark.parametrize("oracle", [False, True])
def test_emulated_engine_with_draft_trees_equals_the_reference_tree_loop(models, arch, max_batch, oracle):
    from dflash_trt.tree import TreeSpec

    target, drafter = models[arch]
    spec = TreeSpec(nodes=4, top_k=3)  # K = 5 slots, 4 nodes: trees of several paths
    prompts = _prompts(max_batch + 40, 8)
    rng = random.Random(max_batch)
    max_new = [rng.randrange(4, MAX_NEW + 1) for _ in prompts]
    truth = None
    if oracle:
        truth = [o.output_ids for o in _reference(target, None, prompts, [MAX_NEW + 8] * len(prompts), 8)[0]]
    ref, ref_steps = _reference_tree(target, drafter, prompts, max_new, max_batch, spec, truth)
    emu, paths_fed = _emulated_tree(target, drafter, prompts, max_new, max_batch, spec, truth)
    assert [e.output_ids for e in emu] == [r.output_ids for r in ref]
    compared, branched = 0, 0
    for i, (e, r) in enumerate(zip(emu, ref)):
        # The same paths kept, step for step, up to where the reference drafts fewer slots near max_new_tokens (the
        # engine always drafts the whole tree; the runtime drops what passes max_new), which changes the tree's shape.
        full = next((j for j, step in enumerate(ref_steps[i]) if step[0] < spec.nodes), len(ref_steps[i]))
        assert e.accepted_lengths[:full] == r.accepted_lengths[:full]
        for (slots, nodes, parents), fed, fed_parents in zip(ref_steps[i], e.drafts_fed, paths_fed.get(i, [])):
            if slots == spec.nodes:  # the reference drafts fewer slots near max_new_tokens
                assert (fed, fed_parents) == (nodes, parents)
                compared += 1
                branched += parents != list(range(-1, len(nodes)))
    assert compared >= 8 and branched > 0
    if oracle:
        assert max(max(r.accepted_lengths) for r in ref) > 2  # long acceptances ran through the runtime's K/V moves
        assert any(any(a > 1 for a in r.accepted_lengths) for r in ref)


def test_tree_paths_round_trip_and_the_chain_is_the_one_path_tree():
    from dflash_trt.tree import ancestors, chain

    dims = contract.Dims(6)
    for parents in (chain(5), [-1, 0, 1, 0, 3], [-1, 0, 0, 0, 2, 4]):
        paths = contract.tree_paths(dims, parents)
        assert contract.parents_of_paths(paths, len(parents)) == parents
        mask = contract.tree_packed_mask(dims, parents)
        bits = [[bool(int(mask[i, j // 32]) >> (j % 32) & 1) for j in range(len(parents))] for i in range(len(parents))]
        assert bits == ancestors(parents).tolist()
    assert torch.equal(contract.tree_paths(dims, chain(5)), contract.chain_paths(dims, 1)[0])
    with pytest.raises(ValueError):
        contract.parents_of_paths(torch.tensor([[0, 1, -1], [0, 2, 1]], dtype=torch.int32), 3)  # token 1 under two parents
