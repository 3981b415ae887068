"""The PyTorch backend: target + optional drafter over paged caches. The reference for every other backend.

Per sequence it keeps, besides the caches, the target features (and token ids) of tokens that
are in the target cache but not yet in the drafter's context cache (`_pending`): they are
injected at the start of the next draft, batched over all sequences.

Drafters: DFlash (one block forward, `_draft_dflash`) and the EAGLE-3-style baseline (a chain
of single-token steps, `_draft_eagle`). Both leave the drafter cache holding exactly the
target-derived context [0, target length): draft-time entries are scratch and dropped.
"""

from __future__ import annotations

import torch

from .errors import ConfigError
from .models.drafter import DFlashDrafter
from .models.eagle import Eagle3Drafter
from .models.layers import LocalVocab, fuse_projections
from .models.packed import CPU_WEIGHTS, OnednnWeight, pack_int8_target, pack_onednn_drafter, pack_onednn_target, packed_kind
from .models.target import TargetModel
from .speculative import Scores
from .tree import slot_candidates


class TorchBackend:
    def __init__(
        self,
        target: TargetModel,
        drafter: DFlashDrafter | Eagle3Drafter | None = None,
        num_pages: int = 256,
        page_size: int = 16,
        block_size: int | None = None,
        capture_layers: tuple[int, ...] | None = None,
        fuse: bool = True,
        cpu_weights: str = "dense",
    ):
        """`capture_layers` without a drafter keeps target features anyway (training-data extraction:
        `pending_features` then holds them for every token in the target cache).
        `fuse`: one q/k/v and one gate/up matmul per layer (layers.FusedLinear) in the target and the drafter;
        False runs every projection apart, as the checkpoint names them.
        `cpu_weights` "int8": the target's weights become weight-only int8 (models.packed: packed kernels for
        steps of few rows, dense matmuls of the same weights for wider ones; a bf16 or fp32 target); "onednn": a bf16
        target's matmul weights also held prepacked for oneDNN (the same weights), and a bf16 drafter's too, with the
        draft head's rows (the drafts round differently, the output cannot: the target verifies)."""
        self.target, self.drafter = target, drafter
        for model in (target, drafter):
            if model is not None:
                fuse_projections(model, on=fuse)
        self.packed_bytes = 0  # what the packed copies (int8, oneDNN) add to the weights
        if cpu_weights not in CPU_WEIGHTS:
            raise ConfigError(f"cpu_weights must be one of {', '.join(CPU_WEIGHTS)}, got {cpu_weights!r}", key="--cpu-weights")
        held = packed_kind(target)
        if held is not None and held != cpu_weights:
            # int8 rewrote the Parameters with their quantized values; and re-fusing above dropped the fused packed
            # copies (half the model would run without them): either way not what was asked for
            raise ConfigError(f"this target already holds {held} weights (an earlier backend packed it); load it again for "
                              f"--cpu-weights {cpu_weights}", key="--cpu-weights")
        if cpu_weights == "int8":
            self.packed_bytes = pack_int8_target(target)
        elif cpu_weights == "onednn":
            self.packed_bytes = pack_onednn_target(target)
        self.vocab_size = target.cfg.vocab_size
        self.page_size, self.num_pages = page_size, num_pages
        self.target_cache = target.new_cache(num_pages, page_size)
        self.vocab = target.vocab  # logits → tokens / scores (vocabulary-parallel under TP: tp.ShardedVocab)
        if drafter is None:
            self.block_size = 1
            self.capture_layers: tuple[int, ...] = tuple(capture_layers or ())
            self.drafter_cache = None
        else:
            self.block_size = drafter.cfg.block_size if block_size is None else block_size
            if not 2 <= self.block_size <= drafter.cfg.block_size:
                raise ConfigError(
                    f"requested block size {self.block_size} must be in [2, {drafter.cfg.block_size}] (the drafter's block_size)",
                    file=drafter.cfg.path,
                    key="block_size",
                )
            self.capture_layers = tuple(drafter.cfg.target_layer_ids)
            self.drafter_cache = drafter.new_cache(num_pages, page_size)
            self._draft_head, self._draft_ids, self._best_draft_row = self.vocab.draft_head(target.lm_head_weight, drafter.d2t)
            self._draft_head_packed = None  # an OnednnWeight of _draft_head under --cpu-weights onednn
            if cpu_weights == "onednn":
                drafter_bytes = pack_onednn_drafter(drafter)
                if drafter_bytes and self._draft_head is target.lm_head_weight:  # the full head: the target's packed copy
                    self._draft_head_packed = target.lm_head_packed
                elif drafter_bytes:
                    self._draft_head_packed = OnednnWeight(self._draft_head)
                    drafter_bytes += self._draft_head_packed.nbytes
                self.packed_bytes += drafter_bytes
        self.max_drafts = self.block_size - 1
        self._pending: dict[int, list[torch.Tensor]] = {}
        self._pending_tokens: dict[int, list[int]] = {}
        self._last_pass: dict[int, tuple[list[int], torch.Tensor | None]] = {}  # tokens, features of the last target pass

    # -- sequences ---------------------------------------------------------------------------

    def pages_needed(self, num_tokens: int) -> int:
        """Worst-case pages one sequence of `num_tokens` tokens (prompt + output) takes in each cache."""
        return self.target_cache.pages_for(num_tokens + self.block_size)

    def add_sequence(self, seq_id: int) -> None:
        self.target_cache.add_sequence(seq_id)
        if self.drafter_cache is not None:
            self.drafter_cache.add_sequence(seq_id)
        self._pending[seq_id] = []
        self._pending_tokens[seq_id] = []

    def pending_features(self, seq_id: int) -> torch.Tensor:
        """Target features not yet injected into the drafter, [n, len(capture_layers) * H]."""
        return torch.cat(self._pending[seq_id])

    def release(self, seq_id: int) -> None:
        self.target_cache.free(seq_id)
        if self.drafter_cache is not None:
            self.drafter_cache.free(seq_id)
        self._pending.pop(seq_id)
        self._pending_tokens.pop(seq_id)

    # -- target passes ------------------------------------------------------------------------

    def _run_target(self, seq_ids: list[int], token_lists: list[list[int]], last_only: bool, parents: list[list[int]] | None = None):
        batch = self.target_cache.prepare(seq_ids, [len(t) for t in token_lists])
        if parents is not None:
            batch = batch.as_tree(parents)
        tokens = torch.tensor([t for ts in token_lists for t in ts], dtype=torch.long, device=batch.positions.device)
        rows = torch.tensor(batch.q_lens).cumsum(0) - 1 if last_only else None
        logits, features = self.target(tokens, batch, self.target_cache, self.capture_layers, rows)
        split = features.split(batch.q_lens) if features is not None else [None] * len(seq_ids)
        self._last_pass = {s: (t, f) for s, t, f in zip(seq_ids, token_lists, split)}
        return logits, batch.q_lens

    def _scores(self, logits: torch.Tensor, rows: list[int], need_logits: list[bool] | None) -> list[Scores]:
        """logits [sum(rows), V] (under TP: this rank's vocab columns) → Scores per sequence."""
        need = need_logits if need_logits is not None else [True] * len(rows)
        tokens, per_seq = self.vocab.greedy(logits), self.vocab.full_logits(logits, rows, need)
        return [Scores(t, f) for t, f in zip(tokens.split(rows), per_seq)]

    @torch.inference_mode()
    def prefill(self, seq_ids: list[int], prompts: list[list[int]], need_logits: list[bool] | None = None) -> list[Scores]:
        logits, lens = self._run_target(seq_ids, prompts, last_only=True)
        self.commit(seq_ids, lens)
        return self._scores(logits, [1] * len(seq_ids), need_logits)

    @torch.inference_mode()
    def verify(self, seq_ids: list[int], blocks: list[list[int]], need_logits: list[bool] | None = None) -> list[Scores]:
        logits, lens = self._run_target(seq_ids, blocks, last_only=False)
        return self._scores(logits, lens, need_logits)

    @torch.inference_mode()
    def verify_tree(self, seq_ids: list[int], blocks: list[list[int]], parents: list[list[int]], need_logits: list[bool] | None = None) -> list[Scores]:
        """`verify` over trees (tree.py): blocks[i] = [last token, node tokens...], parents[i] its parents (root
        first); row j of a sequence's Scores is the target's distribution after node j's path."""
        logits, lens = self._run_target(seq_ids, blocks, last_only=False, parents=parents)
        return self._scores(logits, lens, need_logits)

    def commit(self, seq_ids: list[int], num_kept: list[int]) -> None:
        """Keep the first `num_kept` tokens of the last target pass per sequence; roll back the rest."""
        self.commit_paths(seq_ids, [list(range(n)) for n in num_kept])

    def commit_paths(self, seq_ids: list[int], paths: list[list[int]]) -> None:
        """Keep, per sequence, the tokens of the last target pass at `paths[i]` (increasing indices into the
        pass, from 0), as the next tokens of the sequence; roll back the rest. A kept token's K/V moves to the
        slot of its place in the sequence (a tree's kept path is not contiguous in the pass; its K/V were
        computed at the right positions, so moving them is exact)."""
        cache = self.target_cache
        for s, path in zip(seq_ids, paths):
            start, n = cache.lengths[s], len(path)
            if path != list(range(n)):
                if any(b <= a for a, b in zip(path, path[1:])) or path[0] < 0:
                    raise ValueError(f"sequence {s}: a kept path must be increasing from 0 or more, got {path}")
                src = cache.slots(s, start, start + path[-1] + 1)[torch.tensor(path)].to(cache.k.device)
                dst = cache.slots(s, start, start + n).to(cache.k.device)
                cache.k[:, dst] = cache.k[:, src]  # the right side is gathered (copied) before the write
                cache.v[:, dst] = cache.v[:, src]
            cache.set_length(s, start + n)
            tokens, features = self._last_pass[s]
            if features is not None:
                rows = torch.tensor(path, device=features.device)
                self._pending[s].append(features[rows] if path != list(range(n)) else features[:n])
                self._pending_tokens[s].extend(tokens[i] for i in path)
        self._last_pass = {}

    # -- drafting -----------------------------------------------------------------------------

    @torch.inference_mode()
    def draft(self, seq_ids: list[int], last_tokens: list[int], num_drafts: list[int]) -> list[list[int]]:
        if isinstance(self.drafter, Eagle3Drafter):
            drafted = self._draft_eagle(seq_ids, last_tokens, num_drafts)
        else:
            hidden = self._draft_dflash(seq_ids, last_tokens, num_drafts)
            drafted = self._per_sequence(self._draft_tokens(hidden).tolist(), num_drafts)
        for s in seq_ids:  # drop draft-time scratch K/V: the cache holds the verified context only
            self.drafter_cache.set_length(s, self.target_cache.lengths[s])
        return drafted

    def _draft_tokens(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final-normed drafter hidden [n, H] → greedy draft token ids [n] (over the draft vocabulary)."""
        best = self._best_draft_row(self._draft_scores(hidden))
        return best if self._draft_ids is None else self._draft_ids[best]

    def _draft_scores(self, hidden: torch.Tensor) -> torch.Tensor:
        """Drafter hidden [n, H] → scores over the draft head's rows [n, V_d]."""
        if self._draft_head_packed is not None:
            return self._draft_head_packed.linear(hidden)
        return torch.nn.functional.linear(hidden, self._draft_head)

    def _take_pending(self, seq_ids: list[int]):
        """(lengths, features [T, F], token ids at those positions) of every pending context token, batched."""
        lens = [len(self._pending_tokens[s]) for s in seq_ids]
        features = torch.cat([f for s in seq_ids for f in self._pending[s]]) if sum(lens) else None
        tokens = [self._pending_tokens[s] for s in seq_ids]
        for s in seq_ids:
            self._pending[s], self._pending_tokens[s] = [], []
        return lens, features, tokens

    def _advance(self, seq_ids: list[int], lens: list[int]) -> None:
        for s, n in zip(seq_ids, lens):
            self.drafter_cache.set_length(s, self.drafter_cache.lengths[s] + n)

    def _draft_dflash(self, seq_ids, last_tokens, num_drafts) -> torch.Tensor:
        """The drafter's final hidden state at every drafted slot, [sum(num_drafts), H], sequences in order."""
        drafter, cache = self.drafter, self.drafter_cache
        # 1. KV injection: the target features of all newly verified tokens, whole batch, one GEMM.
        lens, features, _ = self._take_pending(seq_ids)
        if features is not None:
            ctx = cache.prepare(seq_ids, lens)
            drafter.inject_context(features, ctx.positions, ctx.write_slots, cache)
            self._advance(seq_ids, lens)
        # 2. The block [last, mask × K] attends to the context and to itself.
        sizes = [k + 1 for k in num_drafts]
        batch = cache.prepare(seq_ids, sizes)
        mask = drafter.cfg.mask_token_id
        tokens = torch.tensor([t for last, k in zip(last_tokens, num_drafts) for t in [last] + [mask] * k], device=batch.positions.device)
        hidden = drafter(self.target.embed(tokens), batch, cache)
        # Slot j of a block predicts the token at position start + j; slot 0 predicts nothing.
        starts = torch.tensor(sizes).cumsum(0) - torch.tensor(sizes)
        rows = torch.cat([torch.arange(s + 1, s + n) for s, n in zip(starts.tolist(), sizes)])
        return hidden[rows]

    @staticmethod
    def _per_sequence(values: list, num_drafts: list[int]) -> list[list]:
        out, i = [], 0
        for k in num_drafts:
            out.append(values[i : i + k])
            i += k
        return out

    @torch.inference_mode()
    def draft_candidates(self, seq_ids: list[int], last_tokens: list[int], num_drafts: list[int], top_k: int):
        """One DFlash pass, keeping each slot's `top_k` best tokens → per sequence (tokens [K][k], log-probs
        [K][k]) over the draft vocabulary, best first: the input of tree.build_tree."""
        if not isinstance(self.drafter, DFlashDrafter):
            raise ConfigError("tree verification needs a DFlash drafter (one pass scores every slot of the block)", key="--tree")
        if not isinstance(self.vocab, LocalVocab):
            raise ConfigError("tree verification is not available under tensor parallelism yet (the draft head is vocabulary-parallel)",
                              key="--tree")
        if any(num_drafts):
            tokens, logprobs = slot_candidates(self._draft_scores(self._draft_dflash(seq_ids, last_tokens, num_drafts)), self._draft_ids, top_k)
        else:
            tokens, logprobs = [], []
        for s in seq_ids:
            self.drafter_cache.set_length(s, self.target_cache.lengths[s])
        return list(zip(self._per_sequence(tokens, num_drafts), self._per_sequence(logprobs, num_drafts)))

    def _draft_eagle(self, seq_ids, last_tokens, num_drafts) -> list[list[int]]:
        drafter, cache, embed = self.drafter, self.drafter_cache, self.target.embed
        # 1. Pairs (fused features at p, token at p + 1) for every pending p; the token after the
        #    newest context position is `last_token`. The last pair's output is the first draft.
        lens, features, tokens = self._take_pending(seq_ids)
        next_tokens = torch.tensor([t for ts, last in zip(tokens, last_tokens) for t in ts[1:] + [last]])
        batch = cache.prepare(seq_ids, lens)
        hidden = drafter(embed(next_tokens), drafter.fuse(features), batch, cache)
        self._advance(seq_ids, lens)
        last_rows = torch.tensor(lens).cumsum(0) - 1
        h = hidden[last_rows].clone()  # [B, H]
        token = self._draft_tokens(drafter.norm(h))
        out = [[int(t)] if k else [] for t, k in zip(token, num_drafts)]
        # 2. The chain: (own hidden, own token) one position further, for sequences still drafting.
        for step in range(1, max(num_drafts)):
            live = [i for i, k in enumerate(num_drafts) if k > step]
            ids = [seq_ids[i] for i in live]
            batch = cache.prepare(ids, [1] * len(ids))
            h[live] = drafter(embed(token[live]), h[live], batch, cache)
            self._advance(ids, [1] * len(ids))
            token[live] = self._draft_tokens(drafter.norm(h[live]))
            for i in live:
                out[i].append(int(token[i]))
        return out
