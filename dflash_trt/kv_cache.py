"""Paged KV cache: a pool of fixed-size pages shared by many sequences, one block table each.

Used twice per request: for the target's K/V and for the drafter's context K/V.
A sequence's tokens live at slot `table[pos // page_size] * page_size + pos % page_size`
of a flat pool `[num_layers, num_pages * page_size, num_kv_heads, head_dim]`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch

from .errors import KVCacheFullError


# The block a pool is sized for when the drafter (and so its block) is not known yet: released DFlash drafters
# use 16; 32 covers the larger ones, at most one page more per sequence.
DEFAULT_BLOCK = 32


def pool_pages(sequences: int, max_tokens: int, page_size: int, block_size: int | None = None) -> int:
    """Pages a pool needs for `sequences` concurrent sequences of up to `max_tokens` tokens (prompt + output)
    each: the rule TorchBackend.pages_needed applies per sequence (its tokens plus one verify block, rounded up
    to pages). `block_size` None: DEFAULT_BLOCK; 1 for plain decoding. The one formula every front end uses."""
    block = DEFAULT_BLOCK if block_size is None else block_size
    return sequences * -(-(max_tokens + block) // page_size)


class PagedKVCache:
    def __init__(
        self,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        num_pages: int,
        page_size: int = 16,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        name: str = "kv",
    ):
        if num_pages < 1 or page_size < 1:
            raise ValueError("num_pages and page_size must be >= 1")
        self.name = name
        self.page_size = page_size
        self.num_pages = num_pages
        shape = (num_layers, num_pages * page_size, num_kv_heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self._free: list[int] = list(range(num_pages - 1, -1, -1))  # a stack; pops page 0 first
        self.block_tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}

    # -- bookkeeping -------------------------------------------------------------------------

    @property
    def num_free_pages(self) -> int:
        return len(self._free)

    def shuffle_free_pages(self, generator: torch.Generator) -> None:
        """Hand out the free pages in a random order from now on (tests: kernels must follow block tables, not
        assume pages are consecutive)."""
        order = torch.randperm(len(self._free), generator=generator).tolist()
        self._free = [self._free[i] for i in order]

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def add_sequence(self, seq_id: int) -> None:
        if seq_id in self.block_tables:
            raise ValueError(f"sequence {seq_id} is already in the {self.name} cache")
        self.block_tables[seq_id] = []
        self.lengths[seq_id] = 0

    def reserve(self, seq_id: int, num_tokens: int) -> None:
        """Make room for `num_tokens` tokens in total. All or nothing: on failure nothing changes."""
        table = self.block_tables[seq_id]
        need = self.pages_for(num_tokens) - len(table)
        if need > len(self._free):
            raise KVCacheFullError(
                f"{self.name} cache is full: sequence {seq_id} needs {need} more page(s) of "
                f"{self.page_size} tokens for {num_tokens} tokens, {len(self._free)} of {self.num_pages} free"
            )
        for _ in range(max(need, 0)):
            table.append(self._free.pop())

    def set_length(self, seq_id: int, num_tokens: int) -> None:
        """Mark the first `num_tokens` tokens valid (after a write), or roll back to them.

        Pages wholly beyond the new length go back to the pool.
        """
        table = self.block_tables[seq_id]
        if num_tokens > len(table) * self.page_size:
            raise ValueError(f"sequence {seq_id}: length {num_tokens} exceeds its reserved {len(table) * self.page_size} slots")
        keep = self.pages_for(num_tokens)
        while len(table) > keep:
            self._free.append(table.pop())
        self.lengths[seq_id] = num_tokens

    def free(self, seq_id: int) -> None:
        table = self.block_tables.pop(seq_id)
        self.lengths.pop(seq_id)
        self._free.extend(reversed(table))

    def slots(self, seq_id: int, start: int, end: int) -> torch.Tensor:
        """Flat pool slots of positions [start, end) of a sequence (its pages must be reserved)."""
        table = torch.tensor(self.block_tables[seq_id], dtype=torch.long)
        pos = torch.arange(start, end)
        return table[pos // self.page_size] * self.page_size + pos % self.page_size

    # -- batches -----------------------------------------------------------------------------

    def prepare(self, seq_ids: list[int], num_new: list[int]) -> "AttentionBatch":
        """Reserve room for `num_new` tokens after each sequence's cached tokens and describe the batch.

        The new tokens' queries attend to the cached tokens plus the new tokens themselves.
        Lengths are not advanced: call `set_length` once the new K/V are written and kept.
        """
        starts = [self.lengths[s] for s in seq_ids]
        for s, start, n in zip(seq_ids, starts, num_new):
            self.reserve(s, start + n)
        kv_slots = [self.slots(s, 0, start + n) for s, start, n in zip(seq_ids, starts, num_new)]
        return AttentionBatch.build(
            q_starts=starts,
            q_lens=num_new,
            kv_slots=kv_slots,
            write_slots=torch.cat([slots[start:] for slots, start in zip(kv_slots, starts)]),  # the new tokens' own slots
            device=self.k.device,
        )


@dataclass
class AttentionBatch:
    """Where a batch's new tokens go and what they attend to, padded to [batch, max_len].

    Flat tensors have one row per new token, sequences concatenated in order.
    Every sequence's keys are positions [0, q_start + q_len), its queries [q_start, q_start + q_len).
    """

    positions: torch.Tensor  # [T] position of each new token
    write_slots: torch.Tensor  # [T] pool slot for each new token's K/V
    q_index: torch.Tensor  # [B, Lq] row of the flat tensor (0 where padded)
    q_valid: torch.Tensor  # [B, Lq] bool
    q_pos: torch.Tensor  # [B, Lq]
    kv_slots: torch.Tensor  # [B, Lk] pool slot of each key (0 where padded)
    kv_valid: torch.Tensor  # [B, Lk] bool
    kv_pos: torch.Tensor  # [B, Lk]
    q_lens: list[int]
    tree: torch.Tensor | None = None  # [B, Lq, Lk] bool: which keys each query may see (tree verification), or None
    _masks: dict = field(default_factory=dict)

    @staticmethod
    def build(q_starts: list[int], q_lens: list[int], kv_slots: list[torch.Tensor], write_slots: torch.Tensor, device) -> "AttentionBatch":
        batch = len(q_lens)
        max_q = max(q_lens)
        max_k = max(len(s) for s in kv_slots)
        q_index = torch.zeros(batch, max_q, dtype=torch.long)
        q_valid = torch.zeros(batch, max_q, dtype=torch.bool)
        q_pos = torch.zeros(batch, max_q, dtype=torch.long)
        kv = torch.zeros(batch, max_k, dtype=torch.long)
        kv_valid = torch.zeros(batch, max_k, dtype=torch.bool)
        offset = 0
        for b, (start, n, slots) in enumerate(zip(q_starts, q_lens, kv_slots)):
            q_index[b, :n] = torch.arange(offset, offset + n)
            q_valid[b, :n] = True
            q_pos[b, :n] = torch.arange(start, start + n)
            kv[b, : len(slots)] = slots
            kv_valid[b, : len(slots)] = True
            offset += n
        positions = torch.cat([torch.arange(s, s + n) for s, n in zip(q_starts, q_lens)])
        kv_pos = torch.arange(max_k).expand(batch, max_k)
        return AttentionBatch(
            positions=positions.to(device),
            write_slots=write_slots.to(device),
            q_index=q_index.to(device),
            q_valid=q_valid.to(device),
            q_pos=q_pos.to(device),
            kv_slots=kv.to(device),
            kv_valid=kv_valid.to(device),
            kv_pos=kv_pos.to(device),
            q_lens=list(q_lens),
        )

    def as_tree(self, parents: list[list[int]]) -> "AttentionBatch":
        """This batch with each sequence's new tokens laid out as a tree (tree.py; `parents[b]` has q_lens[b]
        entries, the root first): a node sits at position q_start + its depth (RoPE and windows use it), and
        sees the cached keys and its own ancestors among the new keys, not its siblings or cousins. The K/V
        still go to the new tokens' own slots, in node order."""
        from .tree import ancestors, depths

        positions, q_pos = self.positions.clone(), self.q_pos.clone()
        kv_pos = self.kv_pos.clone(memory_format=torch.contiguous_format)  # build() hands out an expanded view
        visible = self.kv_valid[:, None, :].expand(-1, self.q_pos.shape[1], -1).clone()
        offset = 0
        for b, par in enumerate(parents):
            n = self.q_lens[b]
            if len(par) != n:
                raise ValueError(f"sequence {b} of the batch has {n} new tokens but {len(par)} tree parents")
            start = int(self.q_pos[b, 0])
            at = start + torch.tensor(depths(par), device=positions.device)
            positions[offset : offset + n], q_pos[b, :n], kv_pos[b, start : start + n] = at, at, at
            visible[b, :n, start : start + n] = ancestors(par).to(visible.device)
            offset += n
        return replace(self, positions=positions, q_pos=q_pos, kv_pos=kv_pos, tree=visible, _masks={})

    def valid_rows(self) -> torch.Tensor:
        """[T] the row of each new token in the padded [B * Lq] layout (q_valid's flat nonzeros, in order)."""
        if "valid_rows" not in self._masks:
            self._masks["valid_rows"] = self.q_valid.reshape(-1).nonzero().squeeze(1)
        return self._masks["valid_rows"]

    def unpadded(self) -> bool:
        """Every sequence brings the same number of new tokens: the flat rows are the padded [B, Lq] layout as is
        (q_index is arange, valid_rows all rows), so attention views them instead of gathering."""
        if "unpadded" not in self._masks:
            self._masks["unpadded"] = min(self.q_lens) == max(self.q_lens)
        return self._masks["unpadded"]

    def kv_run(self) -> tuple[int, int] | None:
        """(first, end) when the batch is one sequence whose keys sit in consecutive pool slots (pages handed out in
        order, as a fresh pool does): attention then reads pool[first:end] as a view instead of gathering it."""
        if "kv_run" not in self._masks:
            run = None
            if self.kv_slots.shape[0] == 1:
                slots = self.kv_slots[0]
                first, last = int(slots[0]), int(slots[-1])
                if last - first == len(slots) - 1 and bool((slots[1:] - slots[:-1] == 1).all()):
                    run = (first, last + 1)
            self._masks["kv_run"] = run
        return self._masks["kv_run"]

    def mask_is_full(self, causal: bool, window: int | None) -> bool:
        """Whether mask(causal, window) lets every query see every key (sequences of one length with no window cutting
        in, and one new token each or a non-causal block): attention then runs without a mask, the faster kernel."""
        key = ("full", causal, window)
        if key not in self._masks:
            self._masks[key] = bool(self.mask(causal, window).all())
        return self._masks[key]

    def grouped_additive_mask(self, causal: bool, window: int | None, groups: int, dtype: torch.dtype) -> torch.Tensor:
        """mask(causal, window) for attention over grouped queries (each query row repeated `groups` times, rows
        ordered (group, query)), as the additive mask SDPA turns a bool mask into (0 where visible, -inf elsewhere):
        [B, 1, groups * Lq, Lk] in `dtype`. Built once per batch: every layer would otherwise convert it again."""
        key = ("additive", causal, window, groups, dtype)
        if key not in self._masks:
            visible = self.mask(causal, window)
            B, _, Lq, Lk = visible.shape
            grouped = visible.expand(B, groups, Lq, Lk).reshape(B, 1, groups * Lq, Lk)
            self._masks[key] = torch.zeros(grouped.shape, dtype=dtype, device=grouped.device).masked_fill(~grouped, float("-inf"))
        return self._masks[key]

    def mask(self, causal: bool, window: int | None) -> torch.Tensor:
        """[B, 1, Lq, Lk] bool, True where a query may attend a key.

        Sliding window: |q_pos - k_pos| < window (only the past side when causal).
        Padded query rows may see key 0, so softmax stays finite; their output is discarded.
        """
        key = (causal, window)
        if key not in self._masks:
            q = self.q_pos[:, :, None]
            k = self.kv_pos[:, None, :]
            visible = self.kv_valid[:, None, :].expand(-1, q.shape[1], -1).clone()
            if causal:
                visible &= k <= q
            if window is not None:
                visible &= q - k < window
                if not causal:
                    visible &= k - q < window
            if self.tree is not None:
                visible &= self.tree
            visible[:, :, 0] |= ~self.q_valid
            self._masks[key] = visible[:, None]
        return self._masks[key]
