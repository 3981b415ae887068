"""Tree verification of one DFlash pass (greedy): more than one candidate per block slot, verified at once.

A DFlash drafter scores every slot of its block in one forward pass; the chain keeps each slot's best token.
The tree keeps the top-k of each slot: node tokens at depth j come from slot j's top-k, and a node's score is
the sum of its path's draft log-probabilities. `build_tree` grows the tree best first within a node budget
(the likeliest paths; the greedy chain is its spine as far as the drafter trusts it); the target then
runs the root (the sequence's last committed token) and every node in one pass, each node attending to the
cache and to its own ancestors only (`ancestors`), at position start + depth. `accept_tree` walks from the
root down the child whose token is the target's argmax at the current node: every kept token is the target's
own greedy token after the kept prefix, so the output is plain greedy decoding's (the proof is the chain's:
each node's logits are those of its path, by the mask). The backend then moves the kept path's K/V to
consecutive slots (`TorchBackend.commit_paths`).

Node 0 is the root; `parents[0] == -1`; every parent precedes its children (so node i's depth ≤ i).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import torch

from .errors import ConfigError


@dataclass(frozen=True)
class TreeSpec:
    """`nodes`: draft tokens per sequence per step (the root not counted; the verify pass runs nodes + 1 rows);
    `top_k`: candidates kept per block slot."""

    nodes: int
    top_k: int = 4

    def __post_init__(self):
        if self.nodes < 1:
            raise ConfigError(f"a verification tree needs at least 1 node, got {self.nodes}", key="--tree")
        if self.top_k < 1:
            raise ConfigError(f"--tree-top-k must be >= 1, got {self.top_k}", key="--tree-top-k")


def chain(num_drafts: int) -> list[int]:
    """The parents of a plain chain [root, d_1..d_K]: each node's parent is the one before."""
    return list(range(-1, num_drafts))


def depths(parents: list[int]) -> list[int]:
    out: list[int] = []
    for i, p in enumerate(parents):
        if (p < 0) != (i == 0) or p >= i:
            raise ValueError(f"parents must name an earlier node (root first): node {i} has parent {p}")
        out.append(0 if p < 0 else out[p] + 1)
    return out


def ancestors(parents: list[int]) -> torch.Tensor:
    """[n, n] bool: entry (i, j) is True where node j is node i or one of its ancestors."""
    n = len(parents)
    anc = torch.zeros(n, n, dtype=torch.bool)
    for i, p in enumerate(parents):
        if p >= 0:
            anc[i] = anc[p]
        anc[i, i] = True
    return anc


def slot_candidates(scores: torch.Tensor, ids: torch.Tensor | None, top_k: int) -> tuple[list[list[int]], list[list[float]]]:
    """A drafter's scores at its block slots over the draft head's rows [n, V_d] (its final hidden states times the
    head) and the rows' token ids (None: row = token) → per slot the `top_k` best tokens and their log-probabilities,
    best first (what build_tree takes). The one place the torch backend and the engine emulation score draft slots."""
    logp = scores.float().log_softmax(dim=-1)
    best, rows = logp.topk(min(top_k, logp.shape[-1]), dim=-1)
    return (rows if ids is None else ids[rows]).tolist(), best.tolist()


def build_tree(top_tokens: list[list[int]], top_logprobs: list[list[float]], budget: int) -> tuple[list[int], list[int]]:
    """Best-first tree over the drafter's per-slot candidates → (node tokens, parents), root excluded from the
    tokens (the caller puts the last committed token first) but included in `parents` (parents[0] == -1).

    top_tokens[j], top_logprobs[j]: slot j+1's candidates, best first (distinct tokens). At most `budget` nodes,
    depth at most len(top_tokens). Best first from the root: repeatedly the candidate child (any node's next-best
    unused token of the slot below it) with the highest path log-probability, so the tree holds the `budget`
    likeliest paths (the drafter's estimate of each node's chance to be reached, so of the tokens it adds in
    expectation). The greedy chain is the tree's spine as far as its nodes are among those: each node's best
    child is its likeliest, and a chain node's path beats any path through a lower-ranked sibling."""
    depth_max = len(top_tokens)
    tokens: list[int] = []
    parents: list[int] = [-1]
    score: list[float] = [0.0]
    level: list[int] = [0]
    used: list[int] = [0]  # per node: how many of the slot below it its children already take (ranks 0..used-1)
    heap: list[tuple[float, int, int]] = []  # (-path log-prob, parent, rank)

    def add(parent: int, rank: int) -> None:
        d = level[parent]
        tokens.append(top_tokens[d][rank])
        parents.append(parent)
        score.append(score[parent] + top_logprobs[d][rank])
        level.append(d + 1)
        used.append(0)
        used[parent] = rank + 1

    def offer(parent: int) -> None:
        d, rank = level[parent], used[parent]
        if d < depth_max and rank < len(top_tokens[d]):
            heapq.heappush(heap, (-(score[parent] + top_logprobs[d][rank]), parent, rank))

    offer(0)
    while heap and len(tokens) < budget:
        _, parent, rank = heapq.heappop(heap)
        if rank != used[parent]:
            continue  # stale: this parent's next candidate was already taken
        add(parent, rank)
        offer(parent)
        offer(len(parents) - 1)
    return tokens, parents


def accept_tree(tokens: list[int], parents: list[int], argmax: list[int]) -> tuple[list[int], int]:
    """Node tokens (root first), parents, the target's argmax at every node → (the kept path as node indices,
    root first; the bonus token: the target's argmax at the path's last node)."""
    children: dict[int, dict[int, int]] = {}
    for i in range(1, len(parents)):
        children.setdefault(parents[i], {}).setdefault(tokens[i], i)
    path = [0]
    while True:
        nxt = children.get(path[-1], {}).get(argmax[path[-1]])
        if nxt is None:
            return path, argmax[path[-1]]
        path.append(nxt)


def add_tree_flags(parser) -> None:
    parser.add_argument("--tree", type=int, metavar="N", default=None,
                        help="tree verification (greedy, DFlash drafter): verify a best-first tree of N draft tokens built from "
                             "each block slot's top-k candidates (the N likeliest paths; the greedy chain as far as its nodes are among "
                             "them) instead of the chain; N <= block_size - 1; with --draft-length auto (the default) each step verifies the "
                             "tree of n <= N nodes, or none (plain decoding), that the measured step cost says pays best")
    parser.add_argument("--tree-top-k", type=int, default=4, metavar="K", help="candidates kept per block slot for --tree")


def tree_from_args(args) -> TreeSpec | None:
    return None if getattr(args, "tree", None) is None else TreeSpec(args.tree, args.tree_top_k)
