"""A CPU emulation of the engine path's contract (contract.py), so that the engine's logic runs and is tested here.

- `KVBlockPool`: TensorRT-LLM's paged KV pool, in its block layout `[blocks, layers, 2 (K|V), kv_heads,
  tokens_per_block, head_dim]`, addressed by `kv_cache_block_offsets` values `(block * layers + 0) * 2 + kv`
  — the target's layers first, then the drafter's (EAGLE's `layer_idx_offset`).
- `DFlashEngine`: the engine's per-call function, in torch over exactly the contract's I/O names, shapes and
  dtypes: target pass (our TargetModel over the pool), accept of the previous drafts (greedy via the
  accept kernel's reference, or exact rejection sampling from `rand_data_*` at `eagle_temperature`), KV
  injection of the kept tokens' features into the drafter layers (DFlashDrafter.inject_context; on CPU the
  kv_inject kernel's torch reference, so run this emulation off CUDA), one block pass
  (DFlashDrafter), next drafts out as a one-path tree.
- `EagleRuntime`: the C++ runtime's side of `DecodingMode::Eagle` as docs/engine-path.md cites it: it
  schedules context requests before generation requests (in-flight joins), fills the inputs (the last
  accepted token + the previous drafts as the generation tokens, the chain's position offsets and packed
  mask, per-request temperature and uniforms), appends `accepted_tokens[:num_accepted_tokens]` with the
  stop rules, feeds `next_draft_*` back, and rewinds the target layers' KV to the kept length (the
  drafter layers' KV is the engine's own: it writes kept positions only).

The loop's rules are reused, not copied: greedy acceptance is kernels.reference.accept_reference, the sampled
distribution sampling.target_probs, the stop rules speculative.Sequence.append, the models the torch reference
models. Rejection sampling (speculative.rejection_accept) is re-expressed once, in `DFlashEngine._accept`,
because the contract hands the engine uniforms (`rand_data_*`) instead of a generator.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from ..errors import ConfigError
from ..kernels.reference import accept_reference
from ..kv_cache import AttentionBatch
from ..models.drafter import DFlashDrafter
from ..models.layers import draft_vocab_head
from ..models.target import TargetModel
from ..sampling import SamplingParams, target_probs
from ..speculative import Sequence
from ..tree import TreeSpec, accept_tree, build_tree, chain, depths, slot_candidates
from . import contract
from .contract import CONTEXT, GENERATION, Dims


class KVBlockPool:
    """TensorRT-LLM's KV pool: `data[block, layer, kv, head, token_in_block, dim]`; a free list of blocks."""

    def __init__(self, num_blocks: int, num_layers: int, num_kv_heads: int, tokens_per_block: int, head_dim: int, dtype=torch.float32):
        self.num_blocks, self.num_layers, self.tokens_per_block = num_blocks, num_layers, tokens_per_block
        self.data = torch.zeros(num_blocks, num_layers, 2, num_kv_heads, tokens_per_block, head_dim, dtype=dtype)
        self.free: list[int] = list(range(num_blocks - 1, -1, -1))

    def offset(self, block: int, kv: int) -> int:
        """The value `kv_cache_block_offsets` holds for (block, K=0 | V=1)."""
        return (block * self.num_layers) * 2 + kv

    def block_of(self, offset: int) -> int:
        return offset // (2 * self.num_layers)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.tokens_per_block)


class _LayerSlots:
    """One layer's K or V of the pool, indexed as the torch models index a cache: flat slot = block *
    tokens_per_block + offset in the block."""

    def __init__(self, pool: KVBlockPool, layer: int, kv: int):
        self.blocks = pool.data[:, layer, kv]  # [blocks, heads, tokens, dim], a view
        self.tpb = pool.tokens_per_block
        self.shape = (pool.num_blocks * self.tpb, self.blocks.shape[1], self.blocks.shape[3])
        self.dtype = pool.data.dtype

    def __getitem__(self, slots: torch.Tensor | slice) -> torch.Tensor:
        if isinstance(slots, slice):  # paged_attention reads a run of consecutive slots as pool[first:end]
            slots = torch.arange(*slots.indices(self.shape[0]))
        return self.blocks[slots // self.tpb, :, slots % self.tpb]

    def __setitem__(self, slots: torch.Tensor, value: torch.Tensor) -> None:
        self.blocks[slots // self.tpb, :, slots % self.tpb] = value.to(self.dtype)

    def index_select(self, dim: int, slots: torch.Tensor) -> torch.Tensor:
        """`pool.index_select(0, slots)`, the gather models.layers.paged_attention runs: the same rows as [slots]."""
        if dim != 0:
            raise ValueError("a layer's slots are gathered along dim 0")
        return self[slots]


class _Layers:
    """Consecutive layers' `_LayerSlots`, indexed like a `[layers, slots, heads, dim]` cache (kv_inject's `k_cache`)."""

    def __init__(self, layers: list[_LayerSlots]):
        self.layers = layers
        self.shape = (len(layers), *layers[0].shape)
        self.dtype = layers[0].dtype

    def __getitem__(self, index):
        return self.layers[index]

    def __setitem__(self, index, value: torch.Tensor) -> None:
        every, slots = index
        assert every == slice(None)
        for layer, v in zip(self.layers, value):
            layer[slots] = v


@dataclass
class _PoolCache:
    """What TargetModel / DFlashDrafter read as `cache.k` / `cache.v`: layers [first, first + count) of the pool."""

    k: _Layers
    v: _Layers

    @staticmethod
    def of(pool: KVBlockPool, first: int, count: int) -> "_PoolCache":
        return _PoolCache(*(_Layers([_LayerSlots(pool, layer, kv) for layer in range(first, first + count)]) for kv in (0, 1)))


def sample_inverse_cdf(probs: torch.Tensor, u: float) -> int:
    """One token from a [V] distribution (not necessarily normalized) with one uniform u ∈ [0, 1)."""
    cdf = probs.double().cumsum(0)
    return int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=torch.float64), right=True).clamp(max=len(probs) - 1))


class DFlashEngine:
    """The engine's per-call function. `draft_filter(row, block_start, drafts) -> drafts`, a test seam, replaces
    a row's proposals after the drafter ran (the oracle drafters of the lossless tests); with a tree it gets and
    returns the row's per-slot candidate lists instead."""

    def __init__(self, target: TargetModel, drafter: DFlashDrafter, pool: KVBlockPool, draft_filter=None, tree: TreeSpec | None = None):
        """`tree` (greedy only): the next drafts are a best-first tree of `tree.nodes` tokens from each slot's top-k
        (tree.build_tree, as TorchBackend + Generator(tree=...) build it), carried in `next_draft_paths`; the block
        pass then drafts min(K, nodes) slots. None: a K-token chain, the one path."""
        for key, ours, theirs in (("num_key_value_heads", drafter.cfg.num_kv_heads, target.cfg.num_kv_heads), ("head_dim", drafter.cfg.head_dim, target.cfg.head_dim)):
            if ours != theirs:  # one pool, no variable GQA (trtGptModelInflightBatching's start-up checks)
                raise ConfigError(f"the drafter's layers live in the target's KV pool: {key} {ours} != the target's {theirs}", file=drafter.cfg.path, key=key)
        self.target, self.drafter, self.pool = target, drafter, pool
        self.dims = Dims(drafter.cfg.block_size)
        self.num_target_layers = target.cfg.num_layers
        if pool.num_layers != self.num_target_layers + drafter.cfg.num_layers:
            raise ValueError(f"the pool has {pool.num_layers} layers; target {self.num_target_layers} + drafter {drafter.cfg.num_layers} needed")
        self.draft_head, self.draft_ids = draft_vocab_head(target.lm_head_weight, drafter.d2t)
        self.draft_filter = draft_filter
        if tree is not None and not 1 <= tree.nodes <= self.dims.max_draft_len:
            raise ConfigError(f"a verification tree of {tree.nodes} nodes does not fit the engine's {self.dims.max_draft_len} draft slots", key="--tree")
        self.tree = tree
        self._target_cache = _PoolCache.of(pool, 0, self.num_target_layers)
        self._drafter_cache = _PoolCache.of(pool, self.num_target_layers, drafter.cfg.num_layers)

    def _slots(self, offsets: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Flat slots of positions [start, end) of one request, from its row of kv_cache_block_offsets (K half).
        A position past the request's blocks is an error: the engine may only write what the runtime allocated."""
        blocks = [self.pool.block_of(int(o)) for o in offsets[0] if int(o) >= 0]
        tpb = self.pool.tokens_per_block
        if end > len(blocks) * tpb:
            raise IndexError(f"position {end - 1} is past the {len(blocks) * tpb} KV slots the runtime allocated")
        pos = torch.arange(start, end)
        return torch.tensor(blocks, dtype=torch.long)[pos // tpb] * tpb + pos % tpb

    @torch.inference_mode()
    def __call__(self, io: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        dims, K = self.dims, self.dims.max_draft_len
        types = io["host_request_types"].tolist()
        batch, gen = len(types), types.count(GENERATION)
        context = batch - gen
        if types != [CONTEXT] * context + [GENERATION] * gen:
            raise ValueError("engine input: context rows must come before generation rows")
        drafts_in = io["draft_lens"].tolist()
        sizes = dims.sizes(batch, gen, len(io["input_ids"]), io["kv_cache_block_offsets"].shape[-1], self.target.cfg.vocab_size, sum(drafts_in[context:]))
        contract.check_io(io, contract.INPUTS, sizes, "engine input")
        offsets = io["kv_cache_block_offsets"][0]
        past = io["host_past_key_value_lengths"].tolist()
        position_ids = io["position_ids"].tolist()
        # Rows: a context row's chunk starts at past − chunk; a generation row's tokens are [last, drafts] at the
        # position N − 1 the runtime gives, plus each token's depth in the tree (spec_decoding_position_offsets).
        starts, lens, positions, parents, q = [], [], [], [], 0
        for b in range(batch):
            if b < context:
                n = int(io["host_context_lengths"][b])
                start, row_positions = past[b] - n, position_ids[q : q + n]
                row_parents = chain(n - 1)
                q += n
            else:
                g = b - context
                n = int(io["spec_decoding_generation_lengths"][g])
                row_parents = self._check_tree(io, b, g, n)
                start = past[b]
                row_positions = [position_ids[q] + int(d) for d in io["spec_decoding_position_offsets"][g, :n]]
                q += 1
            if row_positions != [start + d for d in depths(row_parents)]:
                raise ValueError(f"engine input: row {b}'s positions {row_positions} are not its tokens' depths after {start}")
            starts.append(start)
            lens.append(n)
            positions += row_positions
            parents.append(row_parents)
        if sum(lens) != sizes["N"]:
            raise ValueError(f"engine input: input_ids has {sizes['N']} tokens, the rows' lengths sum to {sum(lens)}")

        # 1. Target over every scheduled token; K/V into the target layers of the pool.
        kv_slots = [self._slots(offsets[b], 0, starts[b] + lens[b]) for b in range(batch)]
        attn = AttentionBatch.build(starts, lens, kv_slots, torch.cat([s[p:] for s, p in zip(kv_slots, starts)]), "cpu").as_tree(parents)
        logits, features = self.target(io["input_ids"].long(), attn, self._target_cache, tuple(self.drafter.cfg.target_layer_ids))
        rows = torch.tensor([0] + lens).cumsum(0).tolist()

        # 2. Accept the previous drafts (generation rows) or take the first token (context rows).
        accepted = torch.zeros(batch, dims.max_path_len, dtype=torch.int32)
        num_accepted = torch.zeros(batch, dtype=torch.int32)
        accepted_paths = torch.zeros(batch, dtype=torch.int32)
        kept = []  # per row, this call's tokens (indices in the row) whose target K/V stay: their features go to the drafter
        for b in range(batch):
            scores = logits[rows[b] : rows[b + 1]]
            greedy = bool(io["greedy_sampling"][0]) or float(io["eagle_temperature"][b]) == 0.0
            if b < context:
                new = [self._first_token(scores[-1], greedy, io, b)]
                kept.append(list(range(lens[b])))
            elif self.tree is not None:
                if not greedy:
                    raise ValueError(f"engine input: row {b} samples (eagle_temperature > 0); this engine's draft trees are greedy only")
                block = [int(io["input_ids"][rows[b]])] + io["draft_tokens"][b, : lens[b] - 1].tolist()
                path, bonus = accept_tree(block, parents[b], scores.argmax(-1).tolist())
                new = [block[i] for i in path[1:]] + [bonus]
                kept.append(path)  # the root and the accepted drafts, at their tree indices
                accepted_paths[b] = self._path_index(io["draft_paths"][b], path)
            else:
                new = self._accept(scores, io, b, greedy)
                kept.append(list(range(len(new))))  # the root and the accepted drafts
            accepted[b, : len(new)] = torch.tensor(new, dtype=torch.int32)
            num_accepted[b] = len(new)

        # 3. KV injection: the kept tokens' target features → every drafter layer's K/V at their positions (a kept
        #    path's tokens sit at consecutive positions from the row's start, whatever their tree indices).
        keep_rows = torch.cat([rows[b] + torch.tensor(kept[b]) for b in range(batch)])
        write = torch.cat([self._slots(offsets[b], starts[b], starts[b] + len(kept[b])) for b in range(batch)])
        cache = self._drafter_cache
        self.drafter.inject_context(features[keep_rows], torch.tensor(positions)[keep_rows], write, cache)

        # 4. One block pass: [last accepted, mask × K] right after the kept tokens. Its own K/V go to the drafter
        #    layers at those positions (scratch: the next call's injection overwrites what it keeps).
        slots = K if self.tree is None else min(K, self.tree.nodes)  # a tree of N nodes is at most N deep
        block = slots + 1
        block_starts = [starts[b] + len(kept[b]) for b in range(batch)]
        block_kv = [self._slots(offsets[b], 0, block_starts[b] + block) for b in range(batch)]
        block_batch = AttentionBatch.build(block_starts, [block] * batch, block_kv, torch.cat([s[p:] for s, p in zip(block_kv, block_starts)]), "cpu")
        mask = self.drafter.cfg.mask_token_id
        block_ids = torch.tensor([t for b in range(batch) for t in [int(accepted[b, num_accepted[b] - 1])] + [mask] * slots])
        hidden = self.drafter(self.target.embed(block_ids), block_batch, cache)
        slot_rows = torch.cat([torch.arange(b * block + 1, (b + 1) * block) for b in range(batch)])
        if self.tree is None:
            best = torch.nn.functional.linear(hidden[slot_rows], self.draft_head).argmax(-1)
            drafts = (best if self.draft_ids is None else self.draft_ids[best]).view(batch, K)
            if self.draft_filter is not None:
                drafts = torch.stack([torch.tensor(self.draft_filter(b, block_starts[b], drafts[b].tolist()), dtype=torch.long) for b in range(batch)])
            draft_lens = torch.full((batch,), K, dtype=torch.int32)
            draft_paths = contract.chain_paths(dims, batch)
        else:
            tokens, logprobs = slot_candidates(torch.nn.functional.linear(hidden[slot_rows], self.draft_head), self.draft_ids, self.tree.top_k)
            if self.draft_filter is not None:  # the seam, per row: (row, block start, slot candidates) -> slot candidates
                tokens = [t for b in range(batch) for t in self.draft_filter(b, block_starts[b], tokens[b * slots : (b + 1) * slots])]
            drafts = torch.full((batch, K), -1, dtype=torch.long)
            draft_lens = torch.zeros(batch, dtype=torch.int32)
            draft_paths = torch.empty(batch, dims.max_decoding_tokens, dims.max_path_len, dtype=torch.int32)
            for b in range(batch):
                nodes, tree_parents = build_tree(tokens[b * slots : (b + 1) * slots], logprobs[b * slots : (b + 1) * slots], self.tree.nodes)
                drafts[b, : len(nodes)] = torch.tensor(nodes, dtype=torch.long)
                draft_lens[b] = len(nodes)
                draft_paths[b] = contract.tree_paths(dims, tree_parents)

        logit_rows = torch.cat([torch.tensor([rows[b + 1] - 1]) if b < context else torch.arange(rows[b], rows[b + 1]) for b in range(batch)])
        out = {
            "logits": logits[logit_rows].float(),
            "accepted_tokens": accepted,
            "num_accepted_tokens": num_accepted,
            "accepted_paths": accepted_paths,  # a path of draft_paths whose prefix is the kept one (0 for a chain)
            "next_draft_tokens": drafts.to(torch.int32),
            "next_draft_lens": draft_lens,
            "next_draft_paths": draft_paths,
        }
        contract.check_io(out, contract.OUTPUTS, sizes, "engine output")
        return out

    def _check_tree(self, io, b: int, g: int, n: int) -> list[int]:
        """A generation row's draft tree from its `draft_paths`, checked against the lengths, the depths
        (`spec_decoding_position_offsets`) and the ancestor mask (`spec_decoding_packed_mask`) the runtime
        derived from the same paths; a chain engine takes its one path only. Returns the tokens' parents."""
        dims = self.dims
        drafts = int(io["draft_lens"][b])
        if n != drafts + 1:
            raise ValueError(f"engine input: row {b} has {drafts} drafts but spec_decoding_generation_lengths {n}")
        if self.tree is None:
            if not torch.equal(io["draft_paths"][b], contract.chain_paths(dims, 1)[0]):
                raise ValueError(f"engine input: draft_paths of row {b} is not the one-path tree this engine proposes")
            parents = chain(drafts)
        else:
            parents = contract.parents_of_paths(io["draft_paths"][b], n)
        offsets = io["spec_decoding_position_offsets"][g, :n].tolist()
        if offsets != depths(parents):
            raise ValueError(f"engine input: spec_decoding_position_offsets of row {b} are not its draft tree's depths")
        mask = io["spec_decoding_packed_mask"].view(-1, dims.max_decoding_tokens, dims.packed_mask_words)[g]
        if not torch.equal(mask[:n], contract.tree_packed_mask(dims, parents)[:n]):
            raise ValueError(f"engine input: spec_decoding_packed_mask of row {b} is not its draft tree's ancestor mask")
        return parents

    @staticmethod
    def _path_index(paths: torch.Tensor, kept: list[int]) -> int:
        """The first of the row's draft paths that starts with the kept path (the runtime moves K/V along it)."""
        for i, path in enumerate(paths.tolist()):
            if path[: len(kept)] == kept:
                return i
        raise ValueError(f"no draft path starts with the kept path {kept}")

    def _first_token(self, logits: torch.Tensor, greedy: bool, io, b: int) -> int:
        if greedy:
            return int(logits.argmax())
        probs = target_probs(logits[None], SamplingParams(temperature=float(io["eagle_temperature"][b])))[0]
        return sample_inverse_cdf(probs, float(io["rand_data_sample"][b]))

    def _accept(self, logits: torch.Tensor, io, b: int, greedy: bool) -> list[int]:
        """logits [n+1, V] of [root, d_1..d_n] → the accepted drafts plus the target's own next token."""
        n = int(io["draft_lens"][b])
        drafts = io["draft_tokens"][b, :n].long()
        if greedy:
            acc, bonus, _ = accept_reference(drafts[None], torch.tensor([n]), logits.argmax(-1)[None])
            a = int(acc[0])
            return drafts[:a].tolist() + [int(bonus[0])]
        # Exact rejection sampling with point-mass drafts (speculative.rejection_accept), driven by the
        # runtime's uniforms: accept d_j iff u_j < p_j(d_j); else sample max(p_j − δ_dj, 0); else the bonus.
        probs = target_probs(logits, SamplingParams(temperature=float(io["eagle_temperature"][b])))
        u = io["rand_data_validation"][b]
        for j in range(n):
            d = int(drafts[j])
            if float(u[j]) < float(probs[j, d]):
                continue
            residual = probs[j].clone()
            residual[d] = 0.0
            return drafts[:j].tolist() + [sample_inverse_cdf(residual, float(io["rand_data_sample"][b]))]
        return drafts.tolist() + [sample_inverse_cdf(probs[n], float(io["rand_data_sample"][b]))]


@dataclass
class _Request:
    seq: Sequence  # prompt, output and the stop rules (Sequence.append), as in the reference loop
    temperature: float
    blocks: list[int] = field(default_factory=list)
    kv_tokens: int = 0  # what the KV manager counts for the request (addToken / removeToken)
    drafts: list[int] = field(default_factory=list)  # the previous call's next_draft_tokens[:next_draft_lens]
    paths: torch.Tensor | None = None  # the previous call's next_draft_paths[row]
    paths_in: torch.Tensor | None = None  # the draft_paths this call was fed (the KV move reads them)
    rand_sample: float = 0.0
    rand_validation: torch.Tensor | None = None
    drafts_fed: list[list[int]] = field(default_factory=list)  # per generation step (the tests' record)

    @property
    def request_id(self) -> int:
        return self.seq.seq_id

    @property
    def prompt(self) -> list[int]:
        return self.seq.prompt

    @property
    def output(self) -> list[int]:
        return self.seq.output

    @property
    def curand(self) -> torch.Generator:  # the slot's curand state, seeded by the request's random seed
        return self.seq.generator

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)


@dataclass
class Response:
    request_id: int
    output_ids: list[int]
    finish_reason: str
    accepted_lengths: list[int]
    drafts_fed: list[list[int]]


class EagleRuntime:
    """The C++ runtime's side of DecodingMode::Eagle, one fused engine call per iteration (docs/engine-path.md):

    - a request joins (context) when a batch slot and its worst-case KV blocks are free; its slot state is set up
      before the call: temperature, a curand state from its seed, `rand_data_sample` (not `rand_data_validation`);
    - KV: the first call adds prompt + P + D tokens, every generation call P + D more; after the call the target
      layers' accepted drafts are moved along the best path next to the root (a no-op for a chain: they are in
      place), then (D + P − 1) − (accepted − 1) tokens are removed; the drafter layers' KV is the engine's;
    - the outputs: `accepted_tokens[:num_accepted_tokens]` are appended (1 ≤ n ≤ drafts + 1, exactly 1 for a context
      row), stop rules apply, `next_draft_*` become the next call's `draft_*` and generation tokens, and fresh
      uniforms are drawn (`rand_data_sample`, D of `rand_data_validation`).
    `greedy_sampling` is one flag for the executor (EagleConfig.greedy_sampling)."""

    def __init__(self, engine: DFlashEngine, max_batch: int = 8, greedy: bool = True):
        self.engine, self.pool, self.dims = engine, engine.pool, engine.dims
        self.max_batch, self.greedy = max_batch, greedy
        self.waiting: deque[_Request] = deque()
        self.active: list[_Request] = []
        self.done: dict[int, Response] = {}
        self.reserved = 0
        self.batch_request_ids: list[int] = []  # the rows of the current call (for test seams)
        self._next_id = 0

    def enqueue_request(self, prompt: list[int], max_new_tokens: int, end_ids=(), temperature: float = 1.0, seed: int = 0) -> int:
        rid = self._next_id
        self._next_id += 1
        seq = Sequence(rid, list(prompt), SamplingParams(max_new_tokens=max_new_tokens), frozenset(end_ids), torch.Generator().manual_seed(seed))
        self.waiting.append(_Request(seq, temperature))
        return rid

    def _worst_case_blocks(self, r: _Request) -> int:
        return self.pool.blocks_for(len(r.prompt) + r.seq.params.max_new_tokens + self.dims.kv_tokens_per_step)

    def _set_kv_tokens(self, r: _Request, count: int) -> None:
        """addToken / removeToken until the request counts `count` tokens; blocks follow (last one released
        when a removal crosses a block boundary)."""
        r.kv_tokens = count
        need = self.pool.blocks_for(count)
        while len(r.blocks) < need:
            r.blocks.append(self.pool.free.pop())
        while len(r.blocks) > need:
            self.pool.free.append(r.blocks.pop())

    def step(self) -> None:
        new: list[_Request] = []
        while self.waiting and len(self.active) + len(new) < self.max_batch:
            worst = self._worst_case_blocks(self.waiting[0])
            if self.reserved + worst > self.pool.num_blocks:
                break
            self.reserved += worst
            r = self.waiting.popleft()
            r.rand_sample = float(torch.rand((), generator=r.curand))  # decoder setup: rand_data_sample only
            r.rand_validation = torch.zeros(self.dims.max_decoding_tokens)  # stale slot contents
            self._set_kv_tokens(r, len(r.prompt) + self.dims.kv_tokens_per_step)
            new.append(r)
        if not new and not self.active:
            if self.waiting:
                raise RuntimeError("the KV pool cannot hold the next request")
            return
        for r in self.active:
            self._set_kv_tokens(r, r.kv_tokens + self.dims.kv_tokens_per_step)
        batch = new + self.active  # context rows first
        self.batch_request_ids = [r.request_id for r in batch]
        io = self._inputs(new, self.active)
        out = self.engine(io)
        for b, r in enumerate(batch):
            n = int(out["num_accepted_tokens"][b])
            drafts_in = 0 if b < len(new) else len(r.drafts)
            if not 1 <= n <= drafts_in + 1:
                raise RuntimeError(f"num_accepted_tokens {n} of request {r.request_id} is outside [1, {drafts_in + 1}]")
            tokens = out["accepted_tokens"][b, :n].tolist()
            if b >= len(new):
                self._move_accepted_kv(r, int(out["accepted_paths"][b]), n)
                r.seq.accepted_lengths.append(r.seq.append(tokens))
            else:
                r.seq.append(tokens)
            self._set_kv_tokens(r, r.kv_tokens - ((self.dims.max_decoding_tokens + self.dims.max_path_len - 1) - (n - 1)))
            r.drafts = out["next_draft_tokens"][b, : int(out["next_draft_lens"][b])].tolist()
            r.paths = out["next_draft_paths"][b].clone()
            r.rand_sample = float(torch.rand((), generator=r.curand))
            r.rand_validation = torch.rand(self.dims.max_decoding_tokens, generator=r.curand)
        self.active = batch
        for r in [r for r in self.active if r.seq.finish_reason is not None]:
            self.active.remove(r)
            self._set_kv_tokens(r, 0)
            self.reserved -= self._worst_case_blocks(r)
            self.done[r.request_id] = Response(r.request_id, r.output, r.seq.finish_reason, r.seq.accepted_lengths, r.drafts_fed)

    def _move_accepted_kv(self, r: _Request, best_path: int, n: int) -> None:
        """invokeUpdateKVBlockArrayDraftTokenLocation on the target layers: accepted draft i (tree index
        paths[best][i + 1]) moves from position N − 1 + tree index to N + i (N = tokens before the call)."""
        N = r.num_tokens
        path = r.paths_in[best_path]
        layers = self.engine.num_target_layers
        tpb = self.pool.tokens_per_block
        for i in range(n - 1):
            src, dst = N - 1 + int(path[i + 1]), N + i
            if src != dst:
                for kv in (0, 1):
                    self.pool.data[r.blocks[dst // tpb], :layers, kv, :, dst % tpb] = self.pool.data[r.blocks[src // tpb], :layers, kv, :, src % tpb]

    def _inputs(self, context: list[_Request], generation: list[_Request]) -> dict[str, torch.Tensor]:
        dims, K, D = self.dims, self.dims.max_draft_len, self.dims.max_decoding_tokens
        batch = context + generation
        i32 = torch.int32
        ids, positions, ctx_lens, past, seq_lens, gen_lens, logits_per_row = [], [], [], [], [], [], []
        drafts = torch.full((len(batch), K), -1, dtype=i32)  # context rows: -1
        draft_lens = torch.zeros(len(batch), dtype=i32)
        paths = contract.chain_paths(dims, len(batch))  # a new request's tree: the engine's one path (eagle_choices)
        offsets_in, masks = [], []  # per generation row, from its draft paths (eagleDecodingKernels.cu, docs/engine-path.md)
        for b, r in enumerate(batch):
            if b < len(context):
                ids += r.prompt
                positions += list(range(len(r.prompt)))
                ctx_lens.append(len(r.prompt))
                past.append(len(r.prompt))  # begin + chunk
                seq_lens.append(len(r.prompt))
                logits_per_row.append(1)
            else:
                N = r.num_tokens
                ids += [r.output[-1]] + r.drafts
                positions.append(N - 1)  # one position per generation row
                ctx_lens.append(len(r.prompt) + len(r.drafts))
                past.append(N - 1)
                seq_lens.append(N + len(r.drafts))
                gen_lens.append(len(r.drafts) + 1)
                logits_per_row.append(len(r.drafts) + 1)
                drafts[b, : len(r.drafts)] = torch.tensor(r.drafts, dtype=i32)
                draft_lens[b] = len(r.drafts)
                paths[b] = r.paths
                r.paths_in = r.paths
                tree_parents = contract.parents_of_paths(r.paths, len(r.drafts) + 1)
                offsets_in.append(contract.tree_position_offsets(dims, tree_parents))
                masks.append(contract.tree_packed_mask(dims, tree_parents))
                r.drafts_fed.append(list(r.drafts))
        max_blocks = max(len(r.blocks) for r in batch)
        offsets = torch.full((1, len(batch), 2, max_blocks), -1, dtype=i32)
        for b, r in enumerate(batch):
            for kv in (0, 1):
                offsets[0, b, kv, : len(r.blocks)] = torch.tensor([self.pool.offset(blk, kv) for blk in r.blocks], dtype=i32)
        g = len(generation)
        return {
            "input_ids": torch.tensor(ids, dtype=i32),
            "position_ids": torch.tensor(positions, dtype=i32),
            "last_token_ids": torch.arange(1, sum(logits_per_row) + 1, dtype=i32),  # every logit row's token (1-based)
            "host_request_types": torch.tensor([CONTEXT] * len(context) + [GENERATION] * g, dtype=i32),
            "host_context_lengths": torch.tensor(ctx_lens, dtype=i32),
            "host_past_key_value_lengths": torch.tensor(past, dtype=i32),
            "sequence_length": torch.tensor(seq_lens, dtype=i32),
            "kv_cache_block_offsets": offsets,
            "spec_decoding_generation_lengths": torch.tensor(gen_lens, dtype=i32),
            "spec_decoding_position_offsets": torch.stack(offsets_in) if g else torch.zeros(0, D, dtype=i32),
            "spec_decoding_packed_mask": (torch.stack(masks) if g else torch.zeros(0, D, dims.packed_mask_words, dtype=i32)).view(g * D, dims.packed_mask_words),
            "draft_tokens": drafts,
            "draft_lens": draft_lens,
            "draft_paths": paths,
            "greedy_sampling": torch.tensor([int(self.greedy)], dtype=i32),
            "eagle_temperature": torch.tensor([r.temperature for r in batch], dtype=torch.float32),
            "rand_data_sample": torch.tensor([r.rand_sample for r in batch], dtype=torch.float32),
            "rand_data_validation": torch.stack([r.rand_validation for r in batch]).float(),
        }

    def run(self) -> dict[int, Response]:
        while self.waiting or self.active:
            self.step()
        return self.done
