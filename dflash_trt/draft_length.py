"""How many tokens to draft each step: the one that maximises expected committed tokens per second.

A verify pass over k + 1 tokens is not free on a CPU or at a large batch, so a fixed block wastes time when
drafts are rarely accepted. Two measurements decide instead:

- `StepCost`: the wall time of one speculative step (draft + verify + commit) of a batch of B sequences with k
  drafts each, measured once per machine, model pair, dtype and thread count (`calibrate`, cached as JSON),
  and interpolated between the measured (B, k).
- `AcceptanceStats`: running per-position acceptance rates, α_j = P(draft j accepted | drafts 1..j−1 were),
  from every step's (drafts offered, drafts accepted), with exponential forgetting.

`DraftLengthPolicy.choose(B)` returns the k ∈ [0, max_drafts] maximising B · E[tokens | k] / cost(B, k) with
E[tokens | k] = 1 + Σ_{j ≤ k} Π_{i ≤ j} α_i (the bonus token always comes). k = 0 is plain decoding (no drafter
pass). Any k keeps the output exactly the target's (the loop is lossless for every block size).

Two corrections from what the run itself measures (`PolicyFeedback`, both policies):
- the calibration's steps run at a short synthetic context with one pending context row; real steps run at longer
  contexts and, after a stretch of plain decoding, inject every row the drafter has not seen yet. So each step's wall
  time is compared with the calibration's prediction, separately for plain (k = 0) and drafting steps, and the
  drafting cost is scaled by the ratio of the two running (geometric-mean) ratios;
- a policy that has fallen back to k = 0 observes no acceptance any more, so it would never notice that drafting
  pays again (a code block in a chat answer): after `probe_after` plain steps in a row it drafts once (the best
  k ≥ 1), and the interval doubles after each probe that gets no draft accepted (so while nothing is accepted, N
  plain steps hold at most log2(N / probe_after + 1) probes).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

BATCHES = (1, 2, 4, 8, 16)
DRAFTS = (0, 1, 3, 7, 15)


def _interp(xs: list[int], ys: list[float], x: float) -> float:
    """Piecewise-linear in x, extended flat beyond the ends."""
    if x <= xs[0]:
        return ys[0]
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return ys[-1] * x / xs[-1] if xs[-1] else ys[-1]  # past the largest batch: linear in B


@dataclass
class StepCost:
    """seconds[b][k]: one step of batch BATCHES[b] with DRAFTS[k] drafts per sequence."""

    batches: list[int]
    drafts: list[int]
    seconds: list[list[float]]

    def __call__(self, batch: int, num_drafts: int) -> float:
        per_batch = [_interp(self.drafts, row, num_drafts) for row in self.seconds]
        return _interp(self.batches, per_batch, batch)

    def to_json(self) -> dict:
        return {"batches": self.batches, "drafts": self.drafts, "seconds": self.seconds}

    @staticmethod
    def from_json(raw: dict) -> "StepCost":
        return StepCost(list(raw["batches"]), list(raw["drafts"]), [list(map(float, r)) for r in raw["seconds"]])


def measure_step(backend, batch: int, num_drafts: int, context: int = 48, reps: int = 3, seed: int = 0, random_drafts: bool = False) -> float:
    """Median seconds of one draft + verify + commit step for `batch` synthetic sequences of `context` tokens.
    random_drafts: the drafts are random tokens and no drafter runs (what a verify of num_drafts + 1 tokens
    costs the target alone; works on a backend without a drafter)."""
    gen = torch.Generator().manual_seed(seed)
    ids = [-(10_000 + i) for i in range(batch)]  # ids the Generator never hands out
    prompts = [torch.randint(0, backend.vocab_size, (context,), generator=gen).tolist() for _ in ids]
    for s in ids:
        backend.add_sequence(s)
    try:
        scores = backend.prefill(ids, prompts, [False] * batch)
        last = [int(s.tokens[-1]) for s in scores]
        times = []
        for _ in range(reps + 1):  # the first is warm-up
            start = time.perf_counter()
            if random_drafts:
                drafts = torch.randint(0, backend.vocab_size, (batch, num_drafts), generator=gen).tolist()
            else:
                drafts = backend.draft(ids, last, [num_drafts] * batch) if num_drafts else [[] for _ in ids]
            backend.verify(ids, [[t] + d for t, d in zip(last, drafts)], [False] * batch)
            backend.commit(ids, [1] * batch)
            times.append(time.perf_counter() - start)
        return statistics.median(times[1:])
    finally:
        for s in ids:
            backend.release(s)


CONTEXT = 48  # tokens of each synthetic sequence the calibration steps


def calibrate(backend, max_batch: int = 16, progress=None) -> StepCost | None:
    """Step cost over the batches up to max_batch that the backend's KV pool can hold (synthetic sequences of up
    to CONTEXT tokens, fewer in a small pool); None when not even one sequence fits."""

    def fits(batch: int, context: int) -> bool:
        return batch * backend.pages_needed(context + backend.max_drafts + 2) <= backend.num_pages

    context = CONTEXT
    while context > 1 and not fits(1, context):
        context //= 2
    batches = [b for b in BATCHES if b <= max(1, max_batch) and fits(b, context)]
    if not batches:
        return None
    drafts = [k for k in DRAFTS if k <= backend.max_drafts]
    if drafts[-1] != backend.max_drafts:
        drafts.append(backend.max_drafts)
    seconds = []
    for b in batches:
        row = []
        for k in drafts:
            row.append(measure_step(backend, b, k, context=context))
            if progress is not None:
                progress()
        seconds.append(row)
    return StepCost(batches, drafts, seconds)


# Part of every calibration's key: bump it when a change to the runtime moves step costs (e.g. 2: one-row fp32 matmuls
# run as two rows; 3: grouped-query attention, ~2x cheaper decode attention, far cheaper at batch 16), so a table
# cached by an older runtime is measured again instead of steering the policy wrongly.
COST_REVISION = "3"


def cache_key(*parts: str) -> str:
    """A calibration's identity: the models, dtype and thread count given, plus this machine, torch and COST_REVISION."""
    machine = [platform.machine(), platform.processor() or "", str(os.cpu_count()), torch.__version__, str(torch.get_num_threads()),
               f"cost-revision-{COST_REVISION}"]
    return hashlib.sha256("\0".join([*parts, *machine]).encode()).hexdigest()[:16]


def step_cost_path(cache_dir: Path, key: str) -> Path:
    """Where the step-cost table of `key` (cache_key of a calibration identity) is cached."""
    return cache_dir / f"step-cost-{key}.json"


def load_or_calibrate(backend, key: str, cache_dir: Path, max_batch: int = 16, progress=None) -> StepCost | None:
    path = step_cost_path(cache_dir, key)
    if path.is_file():
        return StepCost.from_json(json.loads(path.read_text()))
    cost = calibrate(backend, max_batch, progress)
    if cost is None:
        return None
    cache_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(cost.to_json(), indent=1))
    tmp.replace(path)  # atomic: a killed run leaves no half file
    return cost


@dataclass
class AcceptanceStats:
    """Per-position acceptance with a Beta(prior) start and exponential forgetting (`decay` per observation)."""

    max_drafts: int
    prior: float = 0.5
    prior_weight: float = 2.0
    decay: float = 0.995
    accepted: list[float] = field(default_factory=list)
    offered: list[float] = field(default_factory=list)

    def __post_init__(self):
        self.accepted = [self.prior * self.prior_weight] * self.max_drafts
        self.offered = [self.prior_weight] * self.max_drafts

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        """Drafts 1..num_accepted passed; draft num_accepted + 1 (if offered) was rejected; later ones were not tried."""
        for j in range(min(num_drafts, num_accepted + 1)):
            self.accepted[j] = self.accepted[j] * self.decay + (1.0 if j < num_accepted else 0.0)
            self.offered[j] = self.offered[j] * self.decay + 1.0

    def rates(self) -> list[float]:
        return [a / o for a, o in zip(self.accepted, self.offered)]

    def expected_tokens(self, num_drafts: int) -> float:
        """1 (the bonus) + Σ_{j ≤ k} P(drafts 1..j all accepted)."""
        total, alive = 1.0, 1.0
        for alpha in self.rates()[:num_drafts]:
            alive *= alpha
            total += alive
        return total


class PolicyFeedback:
    """The run's own measurements on top of the calibration (module docstring): the cost of drafting steps relative
    to plain ones, and re-probing after a fallback to plain decoding. Subclasses give `expected_tokens(k)` and
    `max_drafts`, and call `_pick(batch)`.

    The choice depends on wall time, so it is for one process: under tensor parallelism every rank must take the
    same k, and the runtime there uses fixed widths (no policy)."""

    def __init__(self, cost: StepCost, probe_after: int = 32, cost_decay: float = 0.9):
        self.cost, self.probe_after, self.cost_decay = cost, probe_after, cost_decay
        # running mean of log(measured / predicted) for plain (False) and drafting (True) steps, prior 0 (weight 2)
        self._log_ratio = {False: 0.0, True: 0.0}
        self._ratio_weight = {False: 2.0, True: 2.0}
        self._plain_run, self._interval, self._probing, self._probe_hit = 0, probe_after, False, False

    def drafting_cost_scale(self) -> float:
        """Measured cost of drafting steps over plain ones, each relative to the calibration's prediction."""
        return math.exp(self._log_ratio[True] - self._log_ratio[False])

    def observe_time(self, batch: int, num_drafts: int, seconds: float) -> None:
        """One step's wall time (draft + verify + commit of `batch` sequences, `num_drafts` each)."""
        predicted = self.cost(batch, num_drafts)
        if seconds <= 0 or predicted <= 0:
            return
        key = num_drafts > 0
        w = self._ratio_weight[key] * self.cost_decay
        self._log_ratio[key] = (self._log_ratio[key] * w + math.log(seconds / predicted)) / (w + 1.0)
        self._ratio_weight[key] = w + 1.0

    def _rate(self, batch: int, k: int) -> float:
        scale = self.drafting_cost_scale() if k else 1.0
        return batch * self.expected_tokens(k) / (self.cost(batch, k) * scale)

    def _pick(self, batch: int) -> int:
        if self._probing:  # the last step was a probe: a probe that got a draft accepted keeps the interval short
            self._interval = self.probe_after if self._probe_hit else self._interval * 2
            self._probing = False
        best = max(range(self.max_drafts + 1), key=lambda k: (self._rate(batch, k), -k))
        if best:
            self._plain_run, self._interval = 0, self.probe_after
            return best
        self._plain_run += 1
        if self.probe_after and self._plain_run > self._interval:
            self._plain_run, self._probing, self._probe_hit = 0, True, False
            return max(range(1, self.max_drafts + 1), key=lambda k: (self._rate(batch, k), -k))
        return 0

    def _observed(self, num_accepted: int) -> None:
        if self._probing and num_accepted > 0:
            self._probe_hit = True


class DraftLengthPolicy(PolicyFeedback):
    def __init__(self, cost: StepCost, max_drafts: int, probe_after: int = 32):
        super().__init__(cost, probe_after)
        self.max_drafts = max_drafts
        self.stats = AcceptanceStats(max_drafts)

    def expected_tokens(self, k: int) -> float:
        return self.stats.expected_tokens(k)

    def choose(self, batch: int) -> int:
        return self._pick(batch)

    def observe(self, num_drafts: int, num_accepted: int) -> None:
        if num_drafts:
            self.stats.observe(num_drafts, num_accepted)
            self._observed(num_accepted)

    def observe_path(self, num_drafts: int, kept: list[int]) -> None:
        """A step's kept path (node indices, root first): the chain's is 0..accepted."""
        self.observe(num_drafts, len(kept) - 1)


class TreePolicy(PolicyFeedback):
    """`--tree N` with `--draft-length auto`: each step verifies the best-first tree of the n ≤ N nodes (n = 0: plain
    decoding, no drafter pass) that maximises B · E[tokens | n] / cost(B, n), cost from the same calibration as the
    chain's (a tree of n nodes drafts ≤ n slots and verifies n + 1 rows, as a chain of n does).

    tree.build_tree adds nodes best first, so the tree of n nodes is the first n nodes of the tree of N (node
    indices in the order added), and one verified tree tells what each smaller one would have committed: 1 + the
    kept path's nodes among the first n. E[tokens | n] is the running mean of that over steps that offered ≥ n
    nodes, with a prior of the chain policy's (2 − 0.5ⁿ, weight 2) and the same forgetting. (An estimate: a smaller
    tree's block pass drafts fewer slots, which can move the drafter's scores of the slots it keeps.)"""

    def __init__(self, cost: StepCost, nodes: int, prior_weight: float = 2.0, decay: float = 0.995, probe_after: int = 32):
        super().__init__(cost, probe_after)
        self.nodes, self.max_drafts, self.decay = nodes, nodes, decay
        self.tokens = [(2.0 - 0.5**n) * prior_weight for n in range(nodes + 1)]
        self.steps = [prior_weight] * (nodes + 1)

    def expected_tokens(self, n: int) -> float:
        return self.tokens[n] / self.steps[n]

    def choose(self, batch: int) -> int:
        return self._pick(batch)

    def observe_path(self, num_drafts: int, kept: list[int]) -> None:
        if num_drafts:
            self._observed(len(kept) - 1)
        for n in range(1, min(num_drafts, self.nodes) + 1):
            self.tokens[n] = self.tokens[n] * self.decay + 1 + sum(1 for i in kept[1:] if i <= n)
            self.steps[n] = self.steps[n] * self.decay + 1


def calibration_dir() -> Path:
    """Where step costs are cached: $DFLASH_TRT_CALIBRATION, else calibration/ under the package cache."""
    from .fetch import default_cache_dir

    env = os.environ.get("DFLASH_TRT_CALIBRATION")
    return Path(env) if env else default_cache_dir() / "calibration"


def calibration_identity(target, drafter, dtype: str, drafter_type: str, block_size: int) -> list[str]:
    """What makes one calibration differ from another; generate, bench and calibrate use the same, so they share it."""
    return [str(target), str(drafter), dtype, drafter_type, str(block_size)]


def auto_policy(backend, identity: list[str], max_batch: int, cache_dir: Path | None = None, progress: bool = True,
                tree_nodes: int | None = None) -> DraftLengthPolicy | TreePolicy | None:
    """The default policy of a drafting backend (None without a drafter, or when the KV pool cannot hold one
    calibration sequence: fixed blocks then): its step cost from the cache in
    `cache_dir` (default: $DFLASH_TRT_CALIBRATION, else calibration/ under $DFLASH_TRT_CACHE or ~/.cache/dflash-trt),
    measured there first if absent.
    `identity`: what makes one calibration differ from another (model directories, dtype, block size).
    `tree_nodes`: the policy of `--tree N` (TreePolicy) instead of the chain's."""
    if backend.max_drafts == 0:
        return None
    from .progress import progress_bar

    directory = cache_dir or calibration_dir()
    bar = progress_bar(desc="calibrating step cost (once per machine and model)", unit="cell", disable=not progress, leave=False)
    try:
        cost = load_or_calibrate(backend, cache_key(*identity), directory, max_batch, progress=bar.update)
    finally:
        bar.close()
    if cost is None:
        return None
    return DraftLengthPolicy(cost, backend.max_drafts) if tree_nodes is None else TreePolicy(cost, tree_nodes)
