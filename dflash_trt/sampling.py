"""Sampling parameters and the target distribution they define (temperature, top-k, top-p)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .errors import DFlashError


class RequestError(DFlashError):
    """A request's parameters are invalid (the server maps this to HTTP 400)."""


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    stop_token_ids: tuple[int, ...] = ()  # in addition to the model's EOS ids
    ignore_eos: bool = False
    seed: int | None = None

    def seeded(self) -> "SamplingParams":
        """These parameters with a seed: their own, or one drawn from the global RNG now."""
        return self if self.seed is not None else replace(self, seed=int(torch.randint(0, 2**62, ()).item()))

    def validate(self) -> "SamplingParams":
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise RequestError(f"max_new_tokens must be an integer >= 1, got {self.max_new_tokens!r}")
        if not self.temperature >= 0:
            raise RequestError(f"temperature must be >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise RequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise RequestError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """logits [n, V] → the distribution the target samples from, [n, V] fp32.

    top-k keeps the k largest; top-p keeps the smallest prefix of the sorted distribution
    whose mass reaches top_p (the token that crosses the threshold is kept). Computed on the CPU: each
    request's seeded generator is a CPU one, so a sample is the same on any device and any TP rank.
    """
    scores = logits.float().cpu() / params.temperature
    if 0 < params.top_k < scores.shape[-1]:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    if params.top_p < 1:
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        drop = sorted_probs.cumsum(-1) - sorted_probs >= params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def sample(probs: torch.Tensor, generator: torch.Generator) -> int:
    """One token from a [V] distribution."""
    return int(torch.multinomial(probs, 1, generator=generator))
