"""Generator: requests in, tokens out. Continuous batching over one backend and one speculative loop.

Requests wait in a queue, join the running batch at a step boundary when a batch slot and
enough KV pages (worst case: prompt + max_new_tokens + one block) are free, and leave it
when they stop. Plain autoregressive decoding is the same loop with `use_drafter=False`.
"""

from __future__ import annotations

import itertools
import time
from collections import deque
from collections import Counter
from dataclasses import dataclass, replace
from typing import Callable, Iterable

import torch

from .errors import ConfigError, KVCacheFullError
from .sampling import RequestError, SamplingParams, sample, target_probs
from .speculative import Backend, Sequence, speculative_step


@dataclass
class RequestOutput:
    seq_id: int
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: str
    accepted_lengths: list[int]  # tokens committed per decode step, bonus included
    prefill_s: float
    decode_s: float

    @property
    def tau(self) -> float:
        """Mean tokens committed per target verify step (bonus included; 1.0 for plain decoding)."""
        return sum(self.accepted_lengths) / len(self.accepted_lengths) if self.accepted_lengths else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """Tokens after the first (which comes from prefill) per second of decoding."""
        n = len(self.output_ids) - 1
        return n / self.decode_s if self.decode_s > 0 and n > 0 else 0.0

    def histogram(self) -> dict[int, int]:
        return dict(sorted(Counter(self.accepted_lengths).items()))


@dataclass
class _Running:
    seq: Sequence
    prefill_s: float
    decode_start: float


class Generator:
    def __init__(
        self,
        backend: Backend,
        eos_token_ids: Iterable[int] = (),
        max_batch: int = 8,
        use_drafter: bool = True,
        max_seq_len: int | None = None,
        max_verify_tokens: int | None = None,
        draft_policy=None,
        tree=None,
    ):
        """`max_verify_tokens`: at most this many tokens in one verify pass over the batch. Each request then
        drafts min(block_size − 1, budget / batch − 1) tokens: full blocks at low concurrency, shorter ones
        (down to plain decoding) as the batch grows and the target's pass stops being memory-bound."""
        # `draft_policy` (draft_length.DraftLengthPolicy): each step's draft length from the measured step cost and
        # the running acceptance rates, within max_drafts and the verify budget (with `tree`, draft_length.TreePolicy:
        # each step's tree size, 0 = plain decoding). None: always max_drafts.
        self.draft_policy = draft_policy if use_drafter else None
        # `tree` (tree.TreeSpec): greedy requests verify a best-first tree of the drafter's per-slot top-k instead
        # of the chain, as wide as the chain would be (≤ block_size − 1 nodes, within max_verify_tokens).
        self.tree = tree if use_drafter else None
        if self.tree is not None:
            if not 1 <= self.tree.nodes <= backend.max_drafts:
                raise ConfigError(f"a verification tree of {self.tree.nodes} nodes does not fit the verify block: at most "
                                  f"{backend.max_drafts} (block_size - 1)", key="--tree")
        if max_verify_tokens is not None and max_verify_tokens < 1:
            raise RequestError(f"max_verify_tokens must be >= 1, got {max_verify_tokens}")
        self.max_verify_tokens = max_verify_tokens
        self.backend = backend
        self.eos_token_ids = frozenset(eos_token_ids)
        self.max_batch = max_batch
        self.max_drafts = backend.max_drafts if use_drafter else 0
        self.max_seq_len = max_seq_len
        self._ids = itertools.count()
        self._waiting: deque[Sequence] = deque()
        self._running: dict[int, _Running] = {}
        self._pages_reserved: dict[int, int] = {}

    # -- requests -----------------------------------------------------------------------------

    def submit(
        self,
        prompt_ids: list[int],
        params: SamplingParams = SamplingParams(),
        on_token: Callable[[int, int], None] | None = None,
    ) -> int:
        self.check(prompt_ids, params)
        seq_id = next(self._ids)
        params = params.seeded()
        stop = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.eos_token_ids))
        self._waiting.append(
            Sequence(seq_id, list(prompt_ids), params, frozenset(stop), torch.Generator().manual_seed(params.seed), on_token)
        )
        return seq_id

    def check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestError / KVCacheFullError if `submit` would refuse this request. Reads no queue
        state, so a server may call it from another thread than the one that steps."""
        params.validate()
        if not prompt_ids:
            raise RequestError("the prompt is empty")
        vocab = self.backend.vocab_size
        if any(not 0 <= t < vocab for t in prompt_ids):
            raise RequestError(f"prompt has token ids outside [0, {vocab})")
        total = len(prompt_ids) + params.max_new_tokens
        if self.max_seq_len is not None and total > self.max_seq_len:
            raise RequestError(f"prompt ({len(prompt_ids)}) + max_new_tokens ({params.max_new_tokens}) = {total} > max sequence length {self.max_seq_len}")
        pages = self.backend.pages_needed(total)
        if pages > self.backend.num_pages:
            raise KVCacheFullError(
                f"a request of {total} tokens needs {pages} KV pages, the pool has {self.backend.num_pages} in total; "
                "raise --kv-pages or lower max_new_tokens"
            )

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def running_ids(self) -> list[int]:
        """Sequence ids in the running batch, in admission order."""
        return list(self._running)

    @property
    def pages_reserved(self) -> int:
        """KV pages the admission budget holds for the running requests (0 when idle)."""
        return sum(self._pages_reserved.values())

    @property
    def has_work(self) -> bool:
        return bool(self._waiting or self._running)

    def cancel(self, seq_id: int) -> RequestOutput | None:
        """Drop a request (e.g. its client went away) and free its KV pages; returns its output so far
        (finish_reason "cancelled") if it was running."""
        self._waiting = deque(s for s in self._waiting if s.seq_id != seq_id)
        if seq_id in self._running:
            return self._finish(seq_id)
        return None

    # -- steps --------------------------------------------------------------------------------

    def _admit(self) -> list[Sequence]:
        admitted = []
        free = self.backend.num_pages - sum(self._pages_reserved.values())
        while self._waiting and len(self._running) + len(admitted) < self.max_batch:
            seq = self._waiting[0]
            pages = self.backend.pages_needed(len(seq.prompt) + seq.params.max_new_tokens)
            if pages > free:
                break  # waits for running requests to finish and free their pages
            self._waiting.popleft()
            free -= pages
            self._pages_reserved[seq.seq_id] = pages
            admitted.append(seq)
        return admitted

    def _prefill(self, seqs: list[Sequence]) -> list[RequestOutput]:
        start = time.perf_counter()
        ids = [s.seq_id for s in seqs]
        added = []
        try:
            for s in ids:
                self.backend.add_sequence(s)
                added.append(s)
            scores = self.backend.prefill(ids, [s.prompt for s in seqs], [not s.params.greedy for s in seqs])
        except BaseException:
            # These requests are neither waiting nor running: give their pages back before the error goes up,
            # or a server that survives the failure would lose that much of its KV pool for good.
            for s in ids:
                self._pages_reserved.pop(s, None)
            for s in added:
                self.backend.release(s)
            raise
        for s, last in zip(seqs, scores):
            first = int(last.tokens[-1]) if s.params.greedy else sample(target_probs(last.logits[-1:], s.params)[0], s.generator)
            s.append([first])
        now = time.perf_counter()
        finished = []
        for s in seqs:
            self._running[s.seq_id] = _Running(s, now - start, now)
            if s.finish_reason is not None:
                finished.append(self._finish(s.seq_id))
        return finished

    def drafts_per_request(self, batch: int) -> int:
        """Drafts each of `batch` decoding requests gets this step (the same on every TP rank)."""
        k = self.max_drafts if self.draft_policy is None else min(self.max_drafts, self.draft_policy.choose(batch))
        if self.max_verify_tokens is None:
            return k
        return max(0, min(k, self.max_verify_tokens // batch - 1))

    def _finish(self, seq_id: int) -> RequestOutput:
        run = self._running.pop(seq_id)
        self._pages_reserved.pop(seq_id, None)
        self.backend.release(seq_id)
        s = run.seq
        return RequestOutput(
            seq_id=s.seq_id,
            prompt_ids=s.prompt,
            output_ids=list(s.output),
            finish_reason=s.finish_reason or "cancelled",
            accepted_lengths=list(s.accepted_lengths),
            prefill_s=run.prefill_s,
            decode_s=time.perf_counter() - run.decode_start,
        )

    def step(self) -> list[RequestOutput]:
        """Admit waiting requests (prefill), then one speculative step for the rest; returns those that finished."""
        finished = []
        admitted = self._admit()
        if admitted:
            finished += self._prefill(admitted)
        just_prefilled = {s.seq_id for s in admitted}
        decoding = [r.seq for r in self._running.values() if r.seq.seq_id not in just_prefilled]
        if decoding:
            k = self.drafts_per_request(len(decoding))
            tree = None if self.tree is None or k == 0 else replace(self.tree, nodes=min(self.tree.nodes, k))
            started = time.perf_counter()
            offered, kept = speculative_step(self.backend, decoding, k, tree)
            if self.draft_policy is not None:
                self.draft_policy.observe_time(len(decoding), k, time.perf_counter() - started)
                for s, n, path in zip(decoding, offered, kept):
                    if s.finish_reason is None:  # observe only steps the stop rules did not cut
                        self.draft_policy.observe_path(n, path)
            finished += [self._finish(s.seq_id) for s in decoding if s.finish_reason is not None]
        if not admitted and not decoding and self._waiting:
            raise KVCacheFullError("no request can be admitted: the KV pool is too small for the next request")
        return finished

    def generate(
        self,
        prompts: list[list[int]],
        params: SamplingParams | list[SamplingParams] = SamplingParams(),
        on_token: Callable[[int, int], None] | None = None,
    ) -> list[RequestOutput]:
        """Run prompts to completion; outputs in prompt order."""
        all_params = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.submit(p, sp, on_token) for p, sp in zip(prompts, all_params)]
        done: dict[int, RequestOutput] = {}
        while self.has_work:
            for out in self.step():
                done[out.seq_id] = out
        return [done[i] for i in ids]
