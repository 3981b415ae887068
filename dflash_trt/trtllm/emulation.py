"""A CPU emulation of the engine path's contract (contract.py), so that the engine's logic runs and is tested here.

- `KVBlockPool`: TensorRT-LLM's paged KV pool, in its block layout `[blocks, layers, 2 (K|V), kv_heads,
  tokens_per_block, head_dim]`, addressed by `kv_cache_block_offsets` values `(block * layers + 0) * 2 + kv`
  — the target's layers first, then the drafter's (EAGLE's `layer_idx_offset`).
- `DFlashEngine`: the engine's per-call function, in torch over exactly the contract's I/O names, shapes and
  dtypes: target pass (our TargetModel over the pool), accept of the previous drafts (greedy via the
  accept kernel's reference, or exact rejection sampling from `rand_data_*` at `eagle_temperature`), KV
  injection of the kept tokens' features into the drafter layers (the kv_inject reference), one block pass
  (DFlashDrafter), next drafts out as a one-path tree.
- `EagleRuntime`: the C++ runtime's side of `DecodingMode::Eagle` as docs/engine-path.md cites it: it
  schedules context requests before generation requests (in-flight joins), fills the inputs (the last
  accepted token + the previous drafts as the generation tokens, the chain's position offsets and packed
  mask, per-request temperature and uniforms), appends `accepted_tokens[:num_accepted_tokens]` with the
  stop rules, feeds `next_draft_*` back, and rewinds the target layers' KV to the kept length (the
  drafter layers' KV is the engine's own: it writes kept positions only).

Nothing here is a second copy of the loop's rules: acceptance is kernels.reference.accept_reference, the
sampled distribution is sampling.target_probs, the models are the torch reference models.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from ..errors import ConfigError
from ..kernels.reference import accept_reference, kv_inject_reference
from ..kv_cache import AttentionBatch
from ..models.drafter import DFlashDrafter
from ..models.layers import draft_vocab_head
from ..models.target import TargetModel
from ..sampling import SamplingParams, target_probs
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
    """One layer's K or V of the pool, as the torch models index a cache: flat slot = block * tokens_per_block
    + offset; slots from `len(pool slots)` on are dense scratch rows (the draft block's own K/V, which stay in
    the engine's workspace and never touch the pool)."""

    def __init__(self, pool: KVBlockPool, layer: int, kv: int, scratch: torch.Tensor | None = None):
        self.blocks = pool.data[:, layer, kv]  # [blocks, heads, tokens, dim], a view
        self.tpb = pool.tokens_per_block
        self.pool_slots = pool.num_blocks * self.tpb
        self.scratch = scratch
        nkv, hd = self.blocks.shape[1], self.blocks.shape[3]
        self.shape = (self.pool_slots + (0 if scratch is None else scratch.shape[0]), nkv, hd)
        self.dtype = pool.data.dtype

    def __getitem__(self, slots: torch.Tensor) -> torch.Tensor:
        out = torch.empty(len(slots), self.shape[1], self.shape[2], dtype=self.dtype)
        inside = slots < self.pool_slots
        s = slots[inside]
        out[inside] = self.blocks[s // self.tpb, :, s % self.tpb]
        if self.scratch is not None:
            out[~inside] = self.scratch[slots[~inside] - self.pool_slots]
        return out

    def __setitem__(self, slots: torch.Tensor, value: torch.Tensor) -> None:
        inside = slots < self.pool_slots
        s = slots[inside]
        self.blocks[s // self.tpb, :, s % self.tpb] = value[inside].to(self.dtype)
        if self.scratch is not None:
            self.scratch[slots[~inside] - self.pool_slots] = value[~inside].to(self.dtype)


class _Layers:
    """Several layers' `_LayerSlots`, indexed like a `[layers, slots, heads, dim]` cache (kv_inject's `k_cache`)."""

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
    """What TargetModel / DFlashDrafter read as `cache.k` / `cache.v`."""

    k: _Layers
    v: _Layers


def sample_inverse_cdf(probs: torch.Tensor, u: float) -> int:
    """One token from a [V] distribution (not necessarily normalized) with one uniform u ∈ [0, 1)."""
    cdf = probs.double().cumsum(0)
    return int(torch.searchsorted(cdf, torch.tensor([u * float(cdf[-1])], dtype=torch.float64), right=True).clamp(max=len(probs) - 1))


class DFlashEngine:
    """The engine's per-call function. `draft_filter(row, block_start, drafts) -> drafts`, a test seam, replaces
    a row's proposals after the drafter ran (the oracle drafters of the lossless tests)."""

    def __init__(self, target: TargetModel, drafter: DFlashDrafter, pool: KVBlockPool, draft_filter=None):
        self.target, self.drafter, self.pool = target, drafter, pool
        self.dims = Dims(drafter.cfg.block_size)
        self.num_target_layers = target.cfg.num_layers
        for key, ours, theirs in (("num_key_value_heads", drafter.cfg.num_kv_heads, target.cfg.num_kv_heads), ("head_dim", drafter.cfg.head_dim, target.cfg.head_dim)):
            if ours != theirs:
                raise ConfigError(f"the drafter's layers live in the target's KV pool: {key} {ours} != the target's {theirs}", file=drafter.cfg.path, key=key)
        if pool.num_layers != self.num_target_layers + drafter.cfg.num_layers:
            raise ValueError(f"the pool has {pool.num_layers} layers; target {self.num_target_layers} + drafter {drafter.cfg.num_layers} needed")
        self.draft_head, self.draft_ids = draft_vocab_head(target.lm_head_weight, drafter.d2t)
        self.draft_filter = draft_filter

    def _cache(self, first: int, count: int, scratch_rows: int = 0) -> _PoolCache:
        def layers(kv: int) -> _Layers:
            views = []
            for layer in range(first, first + count):
                scratch = torch.zeros(scratch_rows, *self.pool.data.shape[3:4], self.pool.data.shape[5], dtype=self.pool.data.dtype) if scratch_rows else None
                views.append(_LayerSlots(self.pool, layer, kv, scratch))
            return _Layers(views)

        return _PoolCache(layers(0), layers(1))

    def _slots(self, offsets: torch.Tensor, start: int, end: int) -> torch.Tensor:
        """Flat slots of positions [start, end) of one request, from its row of kv_cache_block_offsets (K half)."""
        blocks = torch.tensor([self.pool.block_of(int(o)) for o in offsets[0]], dtype=torch.long)
        pos = torch.arange(start, end)
        tpb = self.pool.tokens_per_block
        return blocks[pos // tpb] * tpb + pos % tpb

    @torch.inference_mode()
    def __call__(self, io: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        dims, K = self.dims, self.dims.max_draft_len
        batch = len(io["host_request_types"])
        sizes = dims.sizes(batch, len(io["input_ids"]), io["kv_cache_block_offsets"].shape[-1])
        contract.check_io(io, contract.INPUTS, sizes, self.target.lm_head_weight.dtype, "engine input")
        types = io["host_request_types"].tolist()
        past = io["host_past_key_value_lengths"].tolist()
        lens = [int(io["host_context_lengths"][b]) if types[b] == CONTEXT else int(io["spec_decoding_generation_lengths"][b]) for b in range(batch)]
        if sum(lens) != sizes["T"]:
            raise ValueError(f"engine input: input_ids has {sizes['T']} tokens, the requests' lengths sum to {sum(lens)}")
        offsets = io["kv_cache_block_offsets"][0]
        for b in range(batch):
            if types[b] == GENERATION:
                self._check_chain(io, b)

        # 1. Target over every scheduled token; K/V into the target layers of the pool.
        tokens = io["input_ids"].long()
        kv_slots = [self._slots(offsets[b], 0, past[b] + lens[b]) for b in range(batch)]
        attn = AttentionBatch.build(past, lens, kv_slots, torch.cat([s[p:] for s, p in zip(kv_slots, past)]), "cpu")
        if not torch.equal(attn.positions, io["position_ids"].long()):
            raise ValueError("engine input: position_ids are not past_key_value_length + [0, n) per request")
        target_cache = self._cache(0, self.num_target_layers)
        logits, features = self.target(tokens, attn, target_cache, tuple(self.drafter.cfg.target_layer_ids))
        rows = torch.tensor([0] + lens).cumsum(0).tolist()

        # 2. Accept the previous drafts (generation) or take the first token (context).
        accepted = torch.zeros(batch, dims.max_path_len, dtype=torch.int32)
        num_accepted = torch.zeros(batch, dtype=torch.int32)
        kept = []  # target-cache tokens of this call whose features the drafter keeps
        greedy = bool(io["greedy_sampling"][0])
        for b in range(batch):
            scores = logits[rows[b] : rows[b + 1]]
            if types[b] == CONTEXT:
                new = [self._first_token(scores[-1], greedy, io, b)]
                kept.append(lens[b])
            else:
                new = self._accept(scores, io, b, greedy)
                kept.append(len(new))  # the root and the accepted drafts have target K/V now
            accepted[b, : len(new)] = torch.tensor(new, dtype=torch.int32)
            num_accepted[b] = len(new)

        # 3. KV injection: the kept tokens' target features → every drafter layer's K/V at their positions.
        n_draft = self.drafter.cfg.num_layers
        keep_rows = torch.cat([torch.arange(rows[b], rows[b] + kept[b]) for b in range(batch)])
        write = torch.cat([self._slots(offsets[b], past[b], past[b] + kept[b]) for b in range(batch)])
        drafter_cache = self._cache(self.num_target_layers, n_draft, scratch_rows=batch * dims.block_size)
        ctx = self.drafter.hidden_norm(self.drafter.fc(features[keep_rows].to(self.drafter.fc.weight.dtype)))
        kv = torch.nn.functional.linear(ctx, self.drafter.ctx_kv_weight, self.drafter.ctx_kv_bias)
        cos, sin = self.drafter.rotary(io["position_ids"].long()[keep_rows], kv.dtype)
        kv_inject_reference(kv, self.drafter.ctx_k_norm, cos, sin, write, drafter_cache.k, drafter_cache.v, self.drafter.cfg.rms_norm_eps)

        # 4. One block pass: [last accepted, mask × K] at the positions after the kept tokens.
        starts = [past[b] + kept[b] for b in range(batch)]
        block = dims.block_size
        scratch = drafter_cache.k[0].pool_slots
        block_kv = [torch.cat([self._slots(offsets[b], 0, starts[b]), scratch + b * block + torch.arange(block)]) for b in range(batch)]
        block_batch = AttentionBatch.build(starts, [block] * batch, block_kv, scratch + torch.arange(batch * block), "cpu")
        mask = self.drafter.cfg.mask_token_id
        block_ids = torch.tensor([t for b in range(batch) for t in [int(accepted[b, num_accepted[b] - 1])] + [mask] * K])
        hidden = self.drafter(self.target.embed(block_ids), block_batch, drafter_cache)
        slot_rows = torch.cat([torch.arange(b * block + 1, (b + 1) * block) for b in range(batch)])
        best = torch.nn.functional.linear(hidden[slot_rows], self.draft_head).argmax(-1)
        drafts = (best if self.draft_ids is None else self.draft_ids[best]).view(batch, K)
        if self.draft_filter is not None:
            drafts = torch.stack([torch.tensor(self.draft_filter(b, starts[b], drafts[b].tolist()), dtype=torch.long) for b in range(batch)])

        out = {
            "accepted_tokens": accepted,
            "num_accepted_tokens": num_accepted,
            "accepted_paths": torch.zeros(batch, dtype=torch.int32),  # the one path
            "next_draft_tokens": drafts.to(torch.int32),
            "next_draft_lens": torch.full((batch,), K, dtype=torch.int32),
            "next_draft_paths": contract.chain_paths(dims, batch),
        }
        contract.check_io(out, contract.OUTPUTS, sizes, self.target.lm_head_weight.dtype, "engine output")
        return out

    def _check_chain(self, io, b: int) -> None:
        dims = self.dims
        n = int(io["draft_lens"][b])
        if int(io["spec_decoding_generation_lengths"][b]) != n + 1:
            raise ValueError(f"engine input: request {b} has {n} drafts but spec_decoding_generation_lengths {int(io['spec_decoding_generation_lengths'][b])}")
        if not torch.equal(io["draft_paths"][b], contract.chain_paths(dims, 1)[0]):
            raise ValueError(f"engine input: draft_paths of request {b} is not the one-path tree this engine proposes")
        if not torch.equal(io["spec_decoding_packed_mask"][b], contract.chain_packed_mask(dims, 1)[0]):
            raise ValueError(f"engine input: spec_decoding_packed_mask of request {b} is not the chain's (causal) mask")

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
    request_id: int
    prompt: list[int]
    max_new_tokens: int
    end_ids: frozenset[int]
    temperature: float
    generator: torch.Generator
    output: list[int] = field(default_factory=list)
    blocks: list[int] = field(default_factory=list)
    drafts: list[int] = field(default_factory=list)  # the previous call's next_draft_tokens[:next_draft_lens]
    drafts_fed: list[list[int]] = field(default_factory=list)  # per generation step (the test's record)
    accepted_lengths: list[int] = field(default_factory=list)
    finish_reason: str | None = None

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
    """The C++ runtime's side of DecodingMode::Eagle with in-flight batching over one engine call per iteration.

    KV: a request reserves the blocks of its worst case (prompt + max_new_tokens + a step's over-allocation)
    when it is scheduled (the GUARANTEED_NO_EVICT policy), and holds exactly the blocks its kept length and the
    next call need; after each call the target layers are rewound to the kept length."""

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
        if not self.greedy and temperature <= 0:
            raise ValueError("a sampling executor needs temperature > 0 (greedy requests go to a greedy_sampling executor)")
        rid = self._next_id
        self._next_id += 1
        self.waiting.append(_Request(rid, list(prompt), max_new_tokens, frozenset(end_ids), temperature, torch.Generator().manual_seed(seed)))
        return rid

    def _worst_case_blocks(self, r: _Request) -> int:
        return self.pool.blocks_for(len(r.prompt) + r.max_new_tokens + self.dims.max_decoding_tokens + self.dims.max_path_len - 1)

    def _hold(self, r: _Request, num_tokens: int) -> None:
        """Blocks for exactly `num_tokens` positions (allocate or give back)."""
        need = self.pool.blocks_for(num_tokens)
        while len(r.blocks) < need:
            r.blocks.append(self.pool.free.pop())
        while len(r.blocks) > need:
            self.pool.free.append(r.blocks.pop())

    def step(self) -> None:
        # Scheduling: running generation requests, plus new context requests while slots and blocks last.
        new: list[_Request] = []
        while self.waiting and len(self.active) + len(new) < self.max_batch:
            worst = self._worst_case_blocks(self.waiting[0])
            if self.reserved + worst > self.pool.num_blocks:
                break
            self.reserved += worst
            new.append(self.waiting.popleft())
        if not new and not self.active:
            if self.waiting:
                raise RuntimeError("the KV pool cannot hold the next request")
            return
        batch = new + self.active  # context requests first
        self.batch_request_ids = [r.request_id for r in batch]
        io = self._inputs(new, self.active)
        out = self.engine(io)
        self.active = batch
        for b, r in enumerate(batch):
            tokens = out["accepted_tokens"][b, : int(out["num_accepted_tokens"][b])].tolist()
            kept = self._append(r, tokens)
            if b >= len(new):
                r.accepted_lengths.append(kept)
            r.drafts = out["next_draft_tokens"][b, : int(out["next_draft_lens"][b])].tolist()
            # Rewind: every committed token but the last has target K/V.
            self._hold(r, r.num_tokens - 1)
        for r in [r for r in self.active if r.finish_reason is not None]:
            self.active.remove(r)
            self._hold(r, 0)
            self.reserved -= self._worst_case_blocks(r)
            self.done[r.request_id] = Response(r.request_id, r.output, r.finish_reason, r.accepted_lengths, r.drafts_fed)

    def _append(self, r: _Request, tokens: list[int]) -> int:
        kept = 0
        for t in tokens:
            r.output.append(t)
            kept += 1
            if t in r.end_ids:
                r.finish_reason = "stop"
            elif len(r.output) == r.max_new_tokens:
                r.finish_reason = "length"
            if r.finish_reason:
                break
        return kept

    def _inputs(self, context: list[_Request], generation: list[_Request]) -> dict[str, torch.Tensor]:
        dims, K = self.dims, self.dims.max_draft_len
        batch = context + generation
        i32 = torch.int32
        ids, positions, types, ctx_lens, past, gen_lens, draft_lens = [], [], [], [], [], [], []
        drafts = torch.zeros(len(batch), K, dtype=i32)
        for b, r in enumerate(batch):
            if b < len(context):
                step_tokens, start = r.prompt, 0
                self._hold(r, len(r.prompt))
                gen_lens.append(0)
                draft_lens.append(0)
            else:
                step_tokens, start = [r.output[-1]] + r.drafts, r.num_tokens - 1
                r.drafts_fed.append(list(r.drafts))
                self._hold(r, start + dims.max_decoding_tokens + dims.max_path_len - 1)  # EAGLE's over-allocation
                gen_lens.append(len(step_tokens))
                draft_lens.append(len(r.drafts))
                drafts[b, : len(r.drafts)] = torch.tensor(r.drafts, dtype=i32)
            ids += step_tokens
            positions += list(range(start, start + len(step_tokens)))
            types.append(CONTEXT if b < len(context) else GENERATION)
            ctx_lens.append(len(r.prompt))
            past.append(start)
        max_blocks = max(len(r.blocks) for r in batch)
        offsets = torch.zeros(1, len(batch), 2, max_blocks, dtype=i32)
        for b, r in enumerate(batch):
            for kv in (0, 1):
                offsets[0, b, kv, : len(r.blocks)] = torch.tensor([self.pool.offset(blk, kv) for blk in r.blocks], dtype=i32)
        rand_validation = torch.stack([torch.rand(dims.max_decoding_tokens, generator=r.generator) for r in batch])
        rand_sample = torch.stack([torch.rand((), generator=r.generator) for r in batch])
        n = len(batch)
        return {
            "input_ids": torch.tensor(ids, dtype=i32),
            "position_ids": torch.tensor(positions, dtype=i32),
            "last_token_ids": torch.tensor(ctx_lens if not generation else [0] * n, dtype=i32).cumsum(0).to(i32) * 0
            + torch.tensor([len(r.prompt) if b < len(context) else gen_lens[b] for b, r in enumerate(batch)], dtype=i32).cumsum(0).to(i32),
            "host_request_types": torch.tensor(types, dtype=i32),
            "host_context_lengths": torch.tensor(ctx_lens, dtype=i32),
            "host_past_key_value_lengths": torch.tensor(past, dtype=i32),
            "sequence_length": torch.tensor([p + (len(r.prompt) if b < len(context) else gen_lens[b]) for b, (p, r) in enumerate(zip(past, batch))], dtype=i32),
            "kv_cache_block_offsets": offsets,
            "spec_decoding_generation_lengths": torch.tensor(gen_lens, dtype=i32),
            "spec_decoding_position_offsets": contract.chain_position_offsets(dims, n),
            "spec_decoding_packed_mask": contract.chain_packed_mask(dims, n),
            "draft_tokens": drafts,
            "draft_lens": torch.tensor(draft_lens, dtype=i32),
            "draft_paths": contract.chain_paths(dims, n),
            "greedy_sampling": torch.tensor([int(self.greedy)], dtype=i32),
            "eagle_temperature": torch.tensor([r.temperature for r in batch], dtype=torch.float32),
            "rand_data_sample": rand_sample.float(),
            "rand_data_validation": rand_validation.float(),
        }

    def run(self) -> dict[int, Response]:
        while self.waiting or self.active:
            self.step()
        return self.done
