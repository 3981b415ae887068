"""The PyTorch backend: target + optional DFlash drafter over paged caches. The reference for every other backend.

Per sequence it keeps, besides the caches, the target features of tokens that are in the
target cache but not yet in the drafter's context cache (`_pending`): they are injected
at the start of the next draft, in one fused GEMM for the whole batch.
"""

from __future__ import annotations

import torch

from .errors import ConfigError
from .models.drafter import DFlashDrafter
from .models.target import TargetModel


class TorchBackend:
    def __init__(
        self,
        target: TargetModel,
        drafter: DFlashDrafter | None = None,
        num_pages: int = 256,
        page_size: int = 16,
        block_size: int | None = None,
    ):
        self.target, self.drafter = target, drafter
        self.vocab_size = target.cfg.vocab_size
        self.page_size, self.num_pages = page_size, num_pages
        self.target_cache = target.new_cache(num_pages, page_size)
        if drafter is None:
            self.block_size = 1
            self.capture_layers: tuple[int, ...] = ()
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
            self.mask_token_id = drafter.cfg.mask_token_id
        self.max_drafts = self.block_size - 1
        self._pending: dict[int, list[torch.Tensor]] = {}
        self._last_features: dict[int, torch.Tensor] = {}  # from the last target pass, until commit

    # -- sequences ---------------------------------------------------------------------------

    def pages_needed(self, num_tokens: int) -> int:
        """Worst-case pages one sequence of `num_tokens` tokens (prompt + output) takes in each cache."""
        return self.target_cache.pages_for(num_tokens + self.block_size)

    def add_sequence(self, seq_id: int) -> None:
        self.target_cache.add_sequence(seq_id)
        if self.drafter_cache is not None:
            self.drafter_cache.add_sequence(seq_id)
        self._pending[seq_id] = []

    def release(self, seq_id: int) -> None:
        self.target_cache.free(seq_id)
        if self.drafter_cache is not None:
            self.drafter_cache.free(seq_id)
        self._pending.pop(seq_id)

    # -- the three passes ---------------------------------------------------------------------

    def _run_target(self, seq_ids: list[int], token_lists: list[list[int]], last_only: bool):
        batch = self.target_cache.prepare(seq_ids, [len(t) for t in token_lists])
        tokens = torch.tensor([t for ts in token_lists for t in ts], dtype=torch.long, device=batch.positions.device)
        rows = torch.tensor(batch.q_lens).cumsum(0) - 1 if last_only else None
        logits, features = self.target(tokens, batch, self.target_cache, self.capture_layers, rows)
        self._last_features = dict(zip(seq_ids, features.split(batch.q_lens))) if features is not None else {}
        return logits, batch.q_lens

    @torch.inference_mode()
    def prefill(self, seq_ids: list[int], prompts: list[list[int]]) -> torch.Tensor:
        logits, lens = self._run_target(seq_ids, prompts, last_only=True)
        self.commit(seq_ids, lens)
        return logits

    @torch.inference_mode()
    def verify(self, seq_ids: list[int], blocks: list[list[int]]) -> list[torch.Tensor]:
        logits, lens = self._run_target(seq_ids, blocks, last_only=False)
        return list(logits.split(lens))

    def commit(self, seq_ids: list[int], num_kept: list[int]) -> None:
        """Keep the first `num_kept` tokens of the last target pass per sequence; roll back the rest."""
        cache = self.target_cache
        for s, n in zip(seq_ids, num_kept):
            cache.set_length(s, cache.lengths[s] + n)
            if s in self._last_features:
                self._pending[s].append(self._last_features[s][:n])
        self._last_features = {}

    @torch.inference_mode()
    def draft(self, seq_ids: list[int], last_tokens: list[int], num_drafts: list[int]) -> list[list[int]]:
        drafter, cache = self.drafter, self.drafter_cache
        # 1. KV injection: the target features of all newly verified tokens, whole batch, one GEMM.
        ctx_lens = [sum(len(f) for f in self._pending[s]) for s in seq_ids]
        if sum(ctx_lens):
            ctx = cache.prepare(seq_ids, ctx_lens)
            features = torch.cat([f for s in seq_ids for f in self._pending[s]])
            drafter.inject_context(features, ctx.positions, ctx.write_slots, cache)
            for s, n in zip(seq_ids, ctx_lens):
                cache.set_length(s, cache.lengths[s] + n)
                self._pending[s] = []
        # 2. The block [last, mask × K] attends to the context and to itself.
        sizes = [k + 1 for k in num_drafts]
        batch = cache.prepare(seq_ids, sizes)
        tokens = [[t] + [self.mask_token_id] * k for t, k in zip(last_tokens, num_drafts)]
        tokens = torch.tensor([t for ts in tokens for t in ts], dtype=torch.long, device=batch.positions.device)
        hidden = drafter(self.target.embed(tokens), batch, cache)
        # Slot j of a block predicts the token at position start + j; slot 0 predicts nothing.
        starts = torch.tensor(sizes).cumsum(0) - torch.tensor(sizes)
        rows = torch.cat([torch.arange(s + 1, s + n) for s, n in zip(starts.tolist(), sizes)])
        drafted = self.target.logits(hidden[rows]).argmax(dim=-1).tolist()
        # 3. Drop the block's scratch K/V (lengths were never advanced past the context).
        for s in seq_ids:
            cache.set_length(s, cache.lengths[s])
        out, i = [], 0
        for k in num_drafts:
            out.append(drafted[i : i + k])
            i += k
        return out


def load_torch_backend(
    target_dir,
    drafter_dir=None,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    num_pages: int = 256,
    page_size: int = 16,
    block_size: int | None = None,
) -> TorchBackend:
    """Load and validate a target (and drafter) from Hugging Face directories into a backend."""
    from .models.drafter import load_drafter
    from .models.target import load_target

    target = load_target(target_dir, dtype=dtype, device=device)
    drafter = load_drafter(drafter_dir, target.cfg, dtype=dtype, device=device) if drafter_dir is not None else None
    return TorchBackend(target, drafter, num_pages=num_pages, page_size=page_size, block_size=block_size)
