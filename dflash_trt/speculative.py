"""One batched speculative step: draft, verify, accept, commit. Written once for every backend.

State per sequence: every committed token but the last is in the target's KV cache; the
last one (`Sequence.last_token`) is the first token of the next verify block. A step:

1. draft:  the drafter proposes K_b tokens after `last_token` (K_b = 0 without a drafter,
           which makes the step plain autoregressive decoding);
2. verify: the target runs [last_token, d_1..d_K] in one forward → K+1 distributions;
3. accept: greedy keeps the longest prefix where d_j equals the target's argmax after
           d_1..d_{j-1}, then adds the target's own next token (the bonus), so every step
           commits accepted + 1 tokens, the same tokens plain greedy decoding would produce.
           At T > 0, drafts are a point mass q = δ(d) (always greedy, as in z-lab's loop):
           accept d_j with probability min(1, p(d_j)/q(d_j)) = p(d_j); on the first
           rejection resample from max(p − q, 0) ∝ p without d_j; if all pass, sample the
           bonus from the last p. Each emitted token is then an exact sample of p.
4. commit: the backend keeps the K/V (and drafter context features) of the accepted
           tokens and rolls back the rest; stop rules may end a sequence mid-block.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Protocol

import torch

from . import kernels
from .sampling import SamplingParams, sample, target_probs


@dataclass
class Scores:
    """A target pass's result for one sequence, one row per position: the greedy tokens always, the logits
    only where the caller asked (sequences that sample). A vocab-parallel (TP) backend so takes greedy
    tokens from per-rank (max, index) pairs and gathers the full vocabulary only for sampling."""

    tokens: torch.Tensor  # [n] argmax over the vocabulary (first maximum on ties)
    logits: torch.Tensor | None = None  # [n, V] fp32, or None where not asked for


class Backend(Protocol):
    """What a backend (torch now, TensorRT engines later) implements; the loop does the rest.

    `need_logits[i]`: whether sequence i's Scores carry full logits (it samples); None means every sequence.
    `block_size`: the verify block (max_drafts + 1; 1 without a drafter), which the server reports (serve/engine.py)."""

    vocab_size: int
    max_drafts: int  # block_size - 1, or 0 without a drafter
    block_size: int  # tokens per verify block: max_drafts + 1
    num_pages: int  # KV pages in the pool (the Generator admits requests against it)

    def pages_needed(self, num_tokens: int) -> int: ...  # worst-case pages of one sequence of num_tokens tokens
    def add_sequence(self, seq_id: int) -> None: ...
    def release(self, seq_id: int) -> None: ...
    def prefill(self, seq_ids: list[int], prompts: list[list[int]], need_logits: list[bool] | None = None) -> list[Scores]: ...  # last token
    def draft(self, seq_ids: list[int], last_tokens: list[int], num_drafts: list[int]) -> list[list[int]]: ...
    def verify(self, seq_ids: list[int], blocks: list[list[int]], need_logits: list[bool] | None = None) -> list[Scores]: ...  # n_b rows
    def commit(self, seq_ids: list[int], num_kept: list[int]) -> None: ...
    # Tree verification (tree.py; a backend that cannot do it raises ConfigError naming --tree):
    def draft_candidates(self, seq_ids: list[int], last_tokens: list[int], num_drafts: list[int], top_k: int) -> list[tuple[list[list[int]], list[list[float]]]]: ...
    def verify_tree(self, seq_ids: list[int], blocks: list[list[int]], parents: list[list[int]], need_logits: list[bool] | None = None) -> list[Scores]: ...
    def commit_paths(self, seq_ids: list[int], paths: list[list[int]]) -> None: ...  # keep these rows of the last pass


@dataclass
class Sequence:
    seq_id: int
    prompt: list[int]
    params: SamplingParams
    stop_ids: frozenset[int]
    generator: torch.Generator
    on_token: Callable[[int, int], None] | None = None
    output: list[int] = field(default_factory=list)
    finish_reason: str | None = None  # "stop" | "length"
    accepted_lengths: list[int] = field(default_factory=list)  # tokens committed per step, bonus included

    @property
    def last_token(self) -> int:
        return self.output[-1]

    @property
    def remaining(self) -> int:
        return self.params.max_new_tokens - len(self.output)

    def append(self, tokens: list[int]) -> int:
        """Commit tokens in order, stopping at a stop token or the length limit; returns how many were kept."""
        kept = 0
        for token in tokens:
            if self.finish_reason is not None:
                break
            self.output.append(token)
            kept += 1
            if self.on_token is not None:
                self.on_token(self.seq_id, token)
            if token in self.stop_ids:
                self.finish_reason = "stop"
            elif self.remaining == 0:
                self.finish_reason = "length"
        return kept


def greedy_accept(drafts: torch.Tensor, num_drafts: torch.Tensor, target_tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """drafts [B, K] (padding ignored), num_drafts [B], target argmax [B, K+1] → (accepted [B], bonus [B]).

    accepted_b = longest j ≤ num_drafts_b with drafts[b, :j] == target_tokens[b, :j]; the bonus
    is target_tokens[b, accepted_b], the target's token after the accepted prefix.
    """
    accepted, bonus, _ = kernels.greedy_accept(drafts, num_drafts, target_tokens)  # one launch on CUDA
    return accepted, bonus


def rejection_accept(drafts: list[int], probs: torch.Tensor, generator: torch.Generator) -> tuple[int, int]:
    """drafts [K] with point-mass draft distributions, target probs [K+1, V] → (accepted, next token)."""
    for j, d in enumerate(drafts):
        p = probs[j]
        if torch.rand((), generator=generator) < p[d]:
            continue
        residual = p.clone()
        residual[d] = 0.0  # max(p - δ_d, 0), renormalized by multinomial
        return j, sample(residual, generator)
    return len(drafts), sample(probs[len(drafts)], generator)


def speculative_step(backend: Backend, seqs: list[Sequence], max_drafts: int, tree=None) -> tuple[list[int], list[list[int]]]:
    """One draft → verify → accept → commit step for every sequence in `seqs` (none finished); returns, per
    sequence, the drafts offered and the kept path as node indices, root first (0..accepted for a chain; before
    any stop rule).
    `tree` (tree.TreeSpec): greedy sequences verify a tree of up to `tree.nodes` drafts, depth ≤ max_drafts;
    sequences that sample verify the chain of the same pass."""
    ids = [s.seq_id for s in seqs]
    # A step commits at most K+1 tokens; never draft past the length limit.
    num_drafts = [max(0, min(max_drafts, s.remaining - 1)) for s in seqs]
    if tree is not None and any(num_drafts):
        return _tree_step(backend, seqs, num_drafts, tree)
    if any(num_drafts):
        drafts = backend.draft(ids, [s.last_token for s in seqs], num_drafts)
    else:
        drafts = [[] for _ in seqs]
    scores = backend.verify(ids, [[s.last_token] + d for s, d in zip(seqs, drafts)], [not s.params.greedy for s in seqs])

    accepted: list[int] = [0] * len(seqs)
    next_tokens: list[int] = [0] * len(seqs)
    greedy = [i for i, s in enumerate(seqs) if s.params.greedy]
    if greedy:
        K = max(num_drafts[i] for i in greedy)
        device = scores[greedy[0]].tokens.device  # accept where the logits are
        padded = torch.full((len(greedy), K), -1, dtype=torch.long, device=device)
        argmax = torch.zeros(len(greedy), K + 1, dtype=torch.long, device=device)
        for row, i in enumerate(greedy):
            padded[row, : num_drafts[i]] = torch.tensor(drafts[i], dtype=torch.long)
            argmax[row, : num_drafts[i] + 1] = scores[i].tokens
        acc, bonus = greedy_accept(padded, torch.tensor([num_drafts[i] for i in greedy], device=device), argmax)
        for row, i in enumerate(greedy):
            accepted[i], next_tokens[i] = int(acc[row]), int(bonus[row])
    for i, s in enumerate(seqs):
        if not s.params.greedy:
            accepted[i], next_tokens[i] = rejection_accept(drafts[i], target_probs(scores[i].logits, s.params), s.generator)

    # The verify block's first token and the accepted drafts now have K/V in the target cache.
    backend.commit(ids, [a + 1 for a in accepted])
    for s, d, a, t in zip(seqs, drafts, accepted, next_tokens):
        s.accepted_lengths.append(s.append(d[:a] + [t]))
    return num_drafts, [list(range(a + 1)) for a in accepted]


def _tree_step(backend: Backend, seqs: list[Sequence], num_drafts: list[int], spec) -> tuple[list[int], list[list[int]]]:
    from .tree import accept_tree, build_tree, chain

    ids = [s.seq_id for s in seqs]
    # A tree of N nodes is at most N deep: draft no more slots for it (a sampled request keeps its whole chain).
    num_drafts = [min(k, spec.nodes) if s.params.greedy else k for s, k in zip(seqs, num_drafts)]
    candidates = backend.draft_candidates(ids, [s.last_token for s in seqs], num_drafts, spec.top_k)
    blocks, parents = [], []
    for s, (tokens, logprobs) in zip(seqs, candidates):
        if s.params.greedy:
            nodes, par = build_tree(tokens, logprobs, spec.nodes)
        else:  # exact rejection sampling is defined on the chain here
            nodes, par = [t[0] for t in tokens], chain(len(tokens))
        blocks.append([s.last_token] + nodes)
        parents.append(par)
    scores = backend.verify_tree(ids, blocks, parents, [not s.params.greedy for s in seqs])
    offered, kept_paths, emitted = [], [], []
    for s, block, par, sc in zip(seqs, blocks, parents, scores):
        if s.params.greedy:
            path, bonus = accept_tree(block, par, sc.tokens.tolist())
        else:
            a, bonus = rejection_accept(block[1:], target_probs(sc.logits, s.params), s.generator)
            path = list(range(a + 1))
        kept_paths.append(path)
        emitted.append([block[i] for i in path[1:]] + [bonus])
        offered.append(len(block) - 1)
    # The root and the kept path's nodes now have K/V in the target cache, moved to consecutive slots.
    backend.commit_paths(ids, kept_paths)
    for s, tokens in zip(seqs, emitted):
        s.accepted_lengths.append(s.append(tokens))
    return offered, kept_paths
