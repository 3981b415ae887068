"""Tree verification (tree.py): the best-first tree against a brute-force enumeration, acceptance against a
naive path check, the tree mask against one plain verify per node's path, the K/V move of a kept path against a
plain pass over it, and greedy output with trees == transformers' greedy output (random and oracle drafters,
batch 1/3/8, Llama and Qwen3 with a sliding-window drafter), sampled requests in a tree batch unchanged."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch
from conftest import write_drafter, write_target
from test_lossless import MAX_NEW, _hf_greedy, _prompts

from dflash_trt.errors import ConfigError
from dflash_trt.loading import load_drafter, load_target
from dflash_trt.runtime import Generator
from dflash_trt.sampling import SamplingParams
from dflash_trt.torch_backend import TorchBackend
from dflash_trt.tree import TreeSpec, accept_tree, ancestors, build_tree, chain, depths


def _random_candidates(rng: random.Random, depth: int, k: int):
    tokens = [rng.sample(range(50), k) for _ in range(depth)]
    logprobs = [sorted((math.log(rng.random()) for _ in range(k)), reverse=True) for _ in range(depth)]
    return tokens, logprobs


@pytest.mark.parametrize("seed", range(30))
def test_build_tree_holds_the_likeliest_paths(seed):
    rng = random.Random(seed)
    depth, k = rng.randrange(1, 6), rng.randrange(1, 4)
    budget = rng.randrange(1, 16)
    tokens, logprobs = _random_candidates(rng, depth, k)
    nodes, parents = build_tree(tokens, logprobs, budget)
    dep = depths(parents)
    assert len(nodes) == len(parents) - 1 <= budget
    # each node as its path of ranks from the root
    ranks: list[tuple[int, ...]] = [()]
    for i in range(1, len(parents)):
        r = tokens[dep[i] - 1].index(nodes[i - 1])
        ranks.append(ranks[parents[i]] + (r,))
    assert len(set(ranks)) == len(ranks)  # no node twice (siblings differ)
    # brute force: every rank path up to the depth, best path log-probability first (log-probs < 0, so the
    # best `budget` are closed under taking parents and form a tree)
    score = lambda path: sum(logprobs[d][r] for d, r in enumerate(path))  # noqa: E731
    every = [p for d in range(1, depth + 1) for p in itertools.product(range(k), repeat=d)]
    every.sort(key=score, reverse=True)
    assert set(ranks[1:]) == set(every[:budget])
    chain_nodes = [r for r in ranks if set(r) <= {0}]
    assert chain_nodes == [(0,) * d for d in range(len(chain_nodes))]  # the greedy chain is a prefix of the spine


@pytest.mark.parametrize("seed", range(30))
def test_accept_tree_keeps_the_deepest_node_whose_path_the_target_agrees_with(seed):
    rng = random.Random(seed)
    tokens, logprobs = _random_candidates(rng, rng.randrange(1, 6), rng.randrange(1, 4))
    nodes, parents = build_tree(tokens, logprobs, rng.randrange(1, 14))
    block = [7] + nodes
    argmax = [rng.choice([rng.randrange(50)] + nodes) for _ in block]  # often some node's token
    path, bonus = accept_tree(block, parents, argmax)

    def path_to(i):
        return [i] if i == 0 else path_to(parents[i]) + [i]

    agreeing = [i for i in range(len(block)) if all(block[c] == argmax[p] for p, c in zip(path_to(i), path_to(i)[1:]))]
    deepest = max(agreeing, key=lambda i: len(path_to(i)))
    assert path == path_to(deepest) and bonus == argmax[deepest]


def test_chain_and_ancestors_and_bad_parents():
    assert chain(3) == [-1, 0, 1, 2] and depths(chain(3)) == [0, 1, 2, 3]
    anc = ancestors([-1, 0, 0, 1])
    assert anc.tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 1, 0, 1]]
    with pytest.raises(ValueError):
        depths([-1, 1])
    with pytest.raises(ConfigError):
        TreeSpec(nodes=0)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("tree")
    targets = {"llama": write_target(root / "llama", "llama", seed=5), "qwen3": write_target(root / "qwen3", "qwen3", seed=6, tie=True)}
    drafters = {
        "llama": write_drafter(root / "d-full", targets["llama"], num_layers=2, block_size=16, seed=7),
        "qwen3": write_drafter(root / "d-swa", targets["qwen3"], num_layers=2, block_size=16, seed=8,
                               layer_types=["sliding_attention", "full_attention"], sliding_window=6),
    }
    prompts = _prompts(0, n=12)
    refs = {name: _hf_greedy(d, prompts, MAX_NEW) for name, d in targets.items()}
    models = {name: load_target(d) for name, d in targets.items()}
    return drafters, prompts, refs, models


def _backend(setup, arch, block=16):
    drafters, _, _, models = setup
    target = models[arch]
    return TorchBackend(target, load_drafter(drafters[arch], target.cfg), num_pages=512, page_size=4, block_size=block)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_a_tree_pass_gives_each_node_the_logits_and_features_of_its_own_path(setup, arch):
    """Each node's row of one tree pass vs a plain (chain) verify of [root, ancestors..., node] from the same cache."""
    _, prompts, _, _ = setup
    backend = _backend(setup, arch)
    rng = random.Random(1)
    tokens, logprobs = _random_candidates(rng, 5, 3)
    nodes, parents = build_tree(tokens, logprobs, 11)
    block = [9] + nodes
    ids = [0, 1]
    for s, p in zip(ids, prompts[:2]):
        backend.add_sequence(s)
    backend.prefill(ids, [prompts[0], prompts[1]])
    tree_scores = backend.verify_tree(ids, [block, block[:4]], [parents, parents[:4]])
    _, tree_features = backend._last_pass[0]
    backend.commit(ids, [0, 0])  # roll the pass back: the cache holds the prompts only
    for i in range(len(block)):
        path = [i]
        while parents[path[0]] >= 0:
            path.insert(0, parents[path[0]])
        plain = backend.verify([0], [[block[j] for j in path]])[0]
        _, features = backend._last_pass[0]
        backend.commit([0], [0])
        torch.testing.assert_close(tree_scores[0].logits[i], plain.logits[-1], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(tree_features[i], features[-1], rtol=1e-5, atol=1e-5)
        assert int(tree_scores[0].tokens[i]) == int(plain.tokens[-1])


def test_commit_paths_moves_the_kept_nodes_kv_where_a_plain_pass_writes_it(setup):
    _, prompts, _, _ = setup
    backend = _backend(setup, "llama")
    nodes, parents = [11, 12, 13, 14, 15], [-1, 0, 1, 0, 3, 4]  # two branches: 1-2 and 3-4-5
    backend.add_sequence(0)
    backend.prefill([0], [prompts[0]])
    start = backend.target_cache.lengths[0]
    backend.verify_tree([0], [[9] + nodes], [parents])
    backend.commit_paths([0], [[0, 3, 4]])
    cache = backend.target_cache
    slots = cache.slots(0, start, start + 3)
    tree_k, tree_v = cache.k[:, slots].clone(), cache.v[:, slots].clone()
    assert cache.lengths[0] == start + 3 and backend._pending_tokens[0][-3:] == [9, 13, 14]
    cache.set_length(0, start)
    backend._pending[0], backend._pending_tokens[0] = [], []
    backend.verify([0], [[9, 13, 14]])
    backend.commit([0], [3])
    torch.testing.assert_close(tree_k, cache.k[:, slots], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tree_v, cache.v[:, slots], rtol=1e-5, atol=1e-5)


class OracleCandidates:
    """Runs the real drafter's candidates, then puts the reference continuation into them at a random rank per
    slot (rank ≥ 1 often, so kept paths leave the greedy chain), right for a random number of slots."""

    def __init__(self, inner: TorchBackend, prompts, refs, seed: int):
        self.inner, self.prompts, self.refs = inner, prompts, refs
        self.rng = random.Random(seed)
        self.off_chain = 0  # kept paths that were not the chain

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def draft_candidates(self, seq_ids, last_tokens, num_drafts, top_k):
        real = self.inner.draft_candidates(seq_ids, last_tokens, num_drafts, top_k)
        out = []
        for s, k, (tokens, logprobs) in zip(seq_ids, num_drafts, real):
            done = self.inner.target_cache.lengths[s] - len(self.prompts[s]) + 1  # tokens committed so far
            truth = (self.refs[s] + [0] * 64)[done : done + k]
            right = self.rng.choice([k, self.rng.randrange(k + 1)])
            rows = []
            for j, row in enumerate(tokens):
                if j < right:
                    row = [t for t in row if t != truth[j]]
                    row.insert(self.rng.choice([0, 1, 1, len(row)]), truth[j])
                    row = row[: len(tokens[j])]
                rows.append(row)
            out.append((rows, logprobs))
        return out

    def commit_paths(self, seq_ids, paths):
        self.off_chain += sum(p != list(range(len(p))) for p in paths)
        return self.inner.commit_paths(seq_ids, paths)


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
@pytest.mark.parametrize("batch", [1, 3, 8])
@pytest.mark.parametrize("block,nodes,top_k", [(4, 3, 2), (16, 15, 4)])
def test_tree_verification_output_equals_target_greedy(setup, arch, batch, block, nodes, top_k):
    _, prompts, refs, _ = setup
    backend = _backend(setup, arch, block)
    gen = Generator(backend, max_batch=batch, tree=TreeSpec(nodes, top_k))
    assert [o.output_ids for o in gen.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW))] == refs[arch]
    assert backend.target_cache.num_free_pages == backend.target_cache.num_pages

    oracle = OracleCandidates(_backend(setup, arch, block), prompts, refs[arch], seed=batch * 10 + block)
    gen = Generator(oracle, max_batch=batch, tree=TreeSpec(nodes, top_k))
    outs = gen.generate(prompts, SamplingParams(max_new_tokens=MAX_NEW))
    assert [o.output_ids for o in outs] == refs[arch]
    assert oracle.off_chain > 0  # kept paths left the chain, so the K/V moves ran
    assert max(max(o.accepted_lengths) for o in outs) > 2  # long acceptances happened


def test_sampled_requests_in_a_tree_batch_verify_the_chain_and_sample_as_before(setup):
    """T > 0 requests beside greedy ones: the same samples as without a tree (same seeds), greedy ones exact."""
    _, prompts, refs, _ = setup
    params = [SamplingParams(max_new_tokens=MAX_NEW, temperature=0.8, seed=i) if i % 2 else SamplingParams(max_new_tokens=MAX_NEW)
              for i in range(len(prompts))]
    chain_outs = Generator(_backend(setup, "llama"), max_batch=4).generate(prompts, params)
    tree_outs = Generator(_backend(setup, "llama"), max_batch=4, tree=TreeSpec(8, 3)).generate(prompts, params)
    assert [o.output_ids for o in tree_outs] == [o.output_ids for o in chain_outs]
    assert [o.output_ids for o in tree_outs][::2] == refs["llama"][::2]


def test_a_tree_wider_than_the_block_is_refused(setup):
    backend = _backend(setup, "llama", block=4)
    with pytest.raises(ConfigError, match="at most 3"):
        Generator(backend, tree=TreeSpec(4))


def test_best_first_trees_are_nested_so_one_verify_tells_what_each_smaller_tree_commits():
    """What TreePolicy relies on: the tree of n nodes is the first n nodes of the tree of N, and accepting on it
    keeps the nodes ≤ n of the big tree's kept path."""
    rng = random.Random(3)
    for _ in range(200):
        slots, k = rng.randrange(1, 6), rng.randrange(1, 5)
        tokens = [rng.sample(range(20), k) for _ in range(slots)]
        logprobs = [sorted((-rng.random() * 4 for _ in range(k)), reverse=True) for _ in range(slots)]
        big, big_parents = build_tree(tokens, logprobs, 12)
        argmax = [rng.choice([t for row in tokens for t in row]) for _ in range(len(big) + 1)]
        big_path, _ = accept_tree([0] + big, big_parents, argmax)
        for n in range(1, len(big) + 1):
            small, small_parents = build_tree(tokens, logprobs, n)
            assert (small, small_parents) == (big[:n], big_parents[: n + 1])
            path, _ = accept_tree([0] + small, small_parents, argmax[: n + 1])
            assert path == [i for i in big_path if i <= n]


def test_tree_policy_chooses_the_brute_force_optimum_and_stays_lossless(setup):
    from dflash_trt.draft_length import StepCost, TreePolicy

    cost = StepCost([1, 4, 8], [0, 3, 15], [[1.0, 1.05, 1.6], [1.5, 3.0, 6.0], [2.0, 8.0, 16.0]])
    policy = TreePolicy(cost, 7, decay=1.0)
    rng = random.Random(0)
    for _ in range(300):  # kept paths of a 7-node tree: node 1 right 70%, then node 2 or 3 40% each
        path = [0] + ([1] if rng.random() < 0.7 else [])
        if len(path) == 2 and rng.random() < 0.8:
            path.append(rng.choice([2, 3]))
        policy.observe_path(7, path)
    e = [policy.expected_tokens(n) for n in range(8)]
    assert e[0] == 1.0 and e[1] == pytest.approx(1.7, abs=0.1) and e[3] == pytest.approx(1.7 + 0.56, abs=0.1)
    assert e[2] == pytest.approx(1.7 + 0.28, abs=0.1) and e[7] == pytest.approx(e[3], abs=0.01)  # only the priors differ
    for batch in (1, 4, 8):
        assert policy.choose(batch) == max(range(8), key=lambda n: (batch * e[n] / cost(batch, n), -n))
    assert policy.choose(1) == 3 and policy.choose(8) == 0  # a cheap small tree alone; plain decoding at batch 8

    _, prompts, refs, _ = setup
    oracle = OracleCandidates(_backend(setup, "llama"), prompts, refs["llama"], seed=1)
    chosen = []
    live = TreePolicy(cost, 7)
    choose = live.choose
    live.choose = lambda b: chosen.append(choose(b)) or chosen[-1]
    outs = Generator(oracle, max_batch=4, tree=TreeSpec(7, 3), draft_policy=live).generate(prompts, SamplingParams(max_new_tokens=MAX_NEW))
    assert [o.output_ids for o in outs] == refs["llama"]
    assert len(set(chosen)) >= 2 and oracle.off_chain > 0  # the size changed as the batch drained
