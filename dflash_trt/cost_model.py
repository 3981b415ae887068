"""What one decode step costs, term by term: AR, EAGLE-style chains and DFlash blocks (chain and tree) on one
tensor-parallel group. `dflash-trt plan` sweeps it; the validation fits it to this CPU (docs/planning.md).

One forward pass over T tokens of B sequences (each attending C context tokens) on one TP rank costs

    t_pass = max(memory_s, compute_s) + all_reduce_s + overhead_s

- `weight_bytes`: every weight the pass reads once, divided over the ranks: attention and dense MLPs whole; for
  MoE the router plus the experts the T tokens touch, E·(1 − (1 − k/E)^T) of E under uniform top-k routing, each
  expert split along its intermediate dimension across ranks (so every rank reads 1/tp of every touched expert);
  the lm_head (the target's, which DFlash drafts through too) in `Quant.lm_head`.
- `kv_bytes`: each sequence's cached K and V, min(C, window) tokens per layer, ⌈kv_heads / tp⌉ heads per rank.
- `flops`: 2 · T · (active parameters) for the matmuls plus 4 · T · min(C, window) · heads · head_dim per layer for
  attention, divided over the ranks.
- memory_s = (weight_bytes + kv_bytes) / (bandwidth · bandwidth_efficiency); compute_s = flops / (peak of the
  weights' compute dtype · compute_efficiency): the roofline, the slower one binds.
- `all_reduce`: 2 per layer (after attention's o_proj and after the MLP's down projection, Megatron row
  parallel) of a [T, hidden] activation, plus one all-gather of each row's (max, index) pair per lm_head use (the
  runtime's vocab-parallel argmax, tp.ShardedVocab). All-reduce: 2(tp−1)/tp · bytes / link bandwidth (ring) + one
  fixed latency per collective (one-shot kernels on NVSwitch take a few µs whatever tp: measured figures in
  presets.py). `collective_payload` gives the bytes one rank hands each collective, as tp.TPGroup counts
  them, so the TP runtime checks this term exactly (tests/test_tp.py).
- `overhead_s`: pass_overhead + layer_overhead · layers + sequence_overhead · B · layers (launches, the host's
  per-layer and per-sequence work); on GPUs the first only (CUDA graphs), fitted on this CPU.

A step adds `step_overhead + step_sequence_overhead · B` (sampling, acceptance, scheduling) to its passes, and a
drafting step `draft_step_overhead` more (what a serving stack's speculative path adds: syncs, extra launches):

- AR: one target pass, T = B.
- DFlash, K drafts: one drafter pass over the B·(K+1)-row block (its K/V from the accepted tokens' target
  features, written once per accepted token) with the lm_head over the B·K drafted rows, then one target verify
  pass over T = B·(K+1).
- EAGLE-style chain, K drafts: K sequential drafter passes of B rows each (one token deeper per pass, through
  its own, usually reduced, draft vocabulary), then the same verify.
- DFlash tree of N nodes: one drafter pass (as the chain's), a verify over T = B·N, accepted tokens from the
  tree the drafter's per-position marginals build best (see `tree_expected_tokens`).

Committed tokens per step come from the acceptance distribution: E[tokens | K] = 1 + Σ_{j ≤ K} Π_{i ≤ j} α_i with
α_j = P(draft j accepted | drafts before it were), not from τ alone.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field, replace

from .quant.nvfp4 import BLOCK as NVFP4_BLOCK

MXFP4_BLOCK = 32  # OCP MX: one e8m0 scale per 32 fp4 values (gpt-oss releases store their experts so)
# bytes per value; nvfp4: one fp8 scale per quant.nvfp4.BLOCK values
BYTES = {"fp32": 4.0, "bf16": 2.0, "fp16": 2.0, "fp8": 1.0, "nvfp4": 0.5 + 1 / NVFP4_BLOCK, "mxfp4": 0.5 + 1 / MXFP4_BLOCK}
COMPUTE = {"fp32": "fp32", "bf16": "bf16", "fp16": "bf16", "fp8": "fp8", "nvfp4": "fp4", "mxfp4": "fp4"}  # tensor-core dtype per weight format
ARGMAX_PAIR_BYTES = 16  # tp.ShardedVocab.greedy: one (max, index) fp64 pair per row and rank


@dataclass(frozen=True)
class Hardware:
    """One accelerator (or this CPU): spec-sheet figures plus the efficiencies and overheads we assume or fit."""

    name: str
    memory_gb: float  # per device
    bandwidth_gbs: float  # memory bandwidth per device
    peak_tflops: dict[str, float]  # dense tensor peak per compute dtype (bf16, fp8, fp4; fp32 on a CPU)
    link_gbs: float = 0.0  # NVLink per device, one direction (an all-reduce's bandwidth)
    collective_latency_us: float = 0.0  # per all-reduce / all-gather call at tp > 1
    bandwidth_efficiency: float = 0.8  # fraction of bandwidth_gbs a weight-streaming GEMM reaches
    compute_efficiency: float = 0.6  # fraction of the peak a large GEMM reaches
    link_efficiency: float = 0.7
    pass_overhead_us: float = 0.0  # per forward pass
    layer_overhead_us: float = 0.0  # per layer per pass
    sequence_overhead_us: float = 0.0  # per sequence per layer per pass
    step_overhead_us: float = 0.0  # per decode step (sampling, acceptance, scheduling)
    step_sequence_overhead_us: float = 0.0  # per sequence per decode step
    draft_step_overhead_us: float = 0.0  # more per step that drafts (a serving stack's speculative path: syncs, launches)
    source: str = ""

    def peak(self, dtype: str) -> float:
        """FLOP/s for weights stored as `dtype`: the fastest compute dtype this device has that holds them."""
        want = COMPUTE[dtype]
        for c in (want, "fp8", "bf16", "fp32"):
            if c in self.peak_tflops and _ORDER.index(c) >= _ORDER.index(want):
                return self.peak_tflops[c] * 1e12
        raise KeyError(f"{self.name} has no peak for {want}")


_ORDER = ["fp4", "fp8", "bf16", "fp32"]  # narrow to wide: a weight format runs on its own compute dtype or a wider one


@dataclass(frozen=True)
class Shape:
    """The parts of a transformer the cost depends on (a target, or a drafter without embedding / lm_head)."""

    name: str
    layers: int
    hidden: int
    intermediate: int  # dense MLP width, or each expert's
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int = 0  # lm_head rows (0: the model has none of its own)
    experts: int = 0
    experts_per_token: int = 0
    windows: tuple[int | None, ...] = ()  # per layer: sliding window, None = full attention; () = all full
    feature_inputs: int = 0  # a drafter's fused target features (fc: feature_inputs · hidden → hidden)
    draft_vocab: int = 0  # an EAGLE-style drafter's own lm_head rows
    qkv_inputs: int = 1  # q/k/v read qkv_inputs · hidden (EAGLE-3: 2, [embedding ; hidden])

    def window(self, layer: int) -> int | None:
        return self.windows[layer] if self.windows else None

    @property
    def attention_params(self) -> int:
        q, width = self.heads * self.head_dim, self.qkv_inputs * self.hidden
        return width * q + q * self.hidden + 2 * width * self.kv_heads * self.head_dim

    @property
    def expert_params(self) -> int:
        return 3 * self.hidden * self.intermediate  # gate, up, down

    @property
    def total_params(self) -> int:
        mlp = self.experts * self.expert_params + self.hidden * self.experts if self.experts else self.expert_params
        head = self.vocab * self.hidden + self.draft_vocab * self.hidden + self.feature_inputs * self.hidden * self.hidden
        return self.layers * (self.attention_params + mlp) + head


@dataclass(frozen=True)
class Quant:
    weights: str = "bf16"
    kv: str = "bf16"
    lm_head: str = "bf16"  # ModelOpt keeps the lm_head unquantized in FP8 and NVFP4 exports
    activations: str = "bf16"  # what the all-reduces carry

    def __post_init__(self):
        for name in ("weights", "kv", "lm_head", "activations"):
            if getattr(self, name) not in BYTES:
                raise ValueError(f"quantization {name}={getattr(self, name)!r}: expected one of {', '.join(BYTES)}")


@dataclass
class Cost:
    """One pass or a sequence of passes, term by term (seconds; bytes and FLOPs per rank). Passes run one after
    another: each binds on its own roofline, so `seconds` adds up per pass, not max(Σ memory, Σ compute)."""

    seconds: float = 0.0
    weight_bytes: float = 0.0
    kv_bytes: float = 0.0
    flops: float = 0.0
    memory_s: float = 0.0
    compute_s: float = 0.0
    all_reduce_s: float = 0.0
    overhead_s: float = 0.0
    collectives: dict[str, float] = field(default_factory=dict)  # kind → payload bytes one rank hands them
    calls: dict[str, int] = field(default_factory=dict)  # kind → collective calls
    passes: tuple["Pass", ...] = ()  # what each forward pass did, before any hardware figure (for fitting)
    step_seqs: tuple[int, ...] = ()  # per decode step: its batch (the step overhead's count)

    def __add__(self, other: "Cost") -> "Cost":
        def merged(a: dict, b: dict) -> dict:
            return {k: a.get(k, 0) + b.get(k, 0) for k in {**a, **b}}

        sums = {f: getattr(self, f) + getattr(other, f) for f in TERMS}
        return Cost(**sums, collectives=merged(self.collectives, other.collectives), calls=merged(self.calls, other.calls),
                    passes=self.passes + other.passes, step_seqs=self.step_seqs + other.step_seqs)

    def terms(self) -> dict[str, float]:
        return {f: getattr(self, f) for f in TERMS}


TERMS = ("seconds", "weight_bytes", "kv_bytes", "flops", "memory_s", "compute_s", "all_reduce_s", "overhead_s")


@dataclass(frozen=True)
class Pass:
    """One forward pass on one rank, before any hardware figure: what the roofline and the overhead count."""

    bytes: float  # weights + KV read
    flops: float
    layers: int
    seqs: int
    dtype: str  # the weights' format: which compute peak applies


def elementwise_max(a, b):
    """max for floats, and elementwise for the tensors the CPU fit passes (plan.fit_hardware)."""
    return a.maximum(b) if hasattr(a, "maximum") else max(a, b)


def pass_roofline_s(p: Pass, hw: Hardware):
    """(memory_s, compute_s) of one pass."""
    return p.bytes / (hw.bandwidth_gbs * 1e9 * hw.bandwidth_efficiency), p.flops / (hw.peak(p.dtype) * hw.compute_efficiency)


def pass_overhead_s(p: Pass, hw: Hardware):
    return (hw.pass_overhead_us + hw.layer_overhead_us * p.layers + hw.sequence_overhead_us * p.seqs * p.layers) * 1e-6


def step_overhead_s(batch, hw: Hardware):
    return (hw.step_overhead_us + hw.step_sequence_overhead_us * batch) * 1e-6


def experts_touched(tokens: float, experts: int, per_token: int) -> float:
    """Expected distinct experts T tokens route to, each picking `per_token` of `experts` uniformly."""
    if not experts:
        return 0.0
    return experts * (1.0 - (1.0 - per_token / experts) ** tokens)


def ring_all_reduce_s(nbytes: float, tp: int, hw: Hardware) -> float:
    if tp <= 1:
        return 0.0
    bw = hw.link_gbs * 1e9 * hw.link_efficiency
    return 2 * (tp - 1) / tp * nbytes / bw + hw.collective_latency_us * 1e-6


def all_gather_s(nbytes_per_rank: float, tp: int, hw: Hardware) -> float:
    if tp <= 1:
        return 0.0
    return (tp - 1) * nbytes_per_rank / (hw.link_gbs * 1e9 * hw.link_efficiency) + hw.collective_latency_us * 1e-6


def collective_payload(layers: int, hidden: int, rows: int, head_rows: int, act_bytes: float, tp: int) -> tuple[dict[str, float], dict[str, int]]:
    """(bytes, calls) of one rank's collectives in one pass: 2 all-reduces of [rows, hidden] per sharded layer,
    one all-gather of (max, index) pairs over `head_rows` lm_head rows. Nothing at tp = 1."""
    nbytes, calls = {}, {}
    if tp <= 1:
        return nbytes, calls
    if layers:
        nbytes["all_reduce"], calls["all_reduce"] = 2.0 * layers * rows * hidden * act_bytes, 2 * layers
    if head_rows:
        nbytes["all_gather"], calls["all_gather"] = float(head_rows * ARGMAX_PAIR_BYTES), 1
    return nbytes, calls


def forward(shape: Shape, hw: Hardware, quant: Quant, tp: int, tokens: int, seqs: int, context: float,
            head_rows: int | None = None, head_vocab: int | None = None, replicated: bool = False) -> Cost:
    """One pass of `shape` over `tokens` rows of `seqs` sequences that attend `context` cached tokens each.
    head_rows: rows through the lm_head (default all); head_vocab: its rows (default shape.vocab or draft_vocab).
    replicated: every rank runs the layers whole (no all-reduce); the lm_head stays vocab-parallel."""
    wb, kvb, lmb = BYTES[quant.weights], BYTES[quant.kv], BYTES[quant.lm_head]
    head_tp, tp = tp, (1 if replicated else tp)
    head_rows = tokens if head_rows is None else head_rows
    head_vocab = (shape.vocab or shape.draft_vocab) if head_vocab is None else head_vocab
    kv_per_rank = math.ceil(shape.kv_heads / tp)
    weights = flops = kv = 0.0
    for layer in range(shape.layers):
        attended = context if shape.window(layer) is None else min(context, shape.window(layer))
        if shape.experts:
            touched = experts_touched(tokens, shape.experts, shape.experts_per_token)
            weights += (shape.attention_params + touched * shape.expert_params) * wb / tp + shape.hidden * shape.experts * wb
            active = shape.attention_params + shape.experts_per_token * shape.expert_params
        else:
            weights += (shape.attention_params + shape.expert_params) * wb / tp
            active = shape.attention_params + shape.expert_params
        flops += 2.0 * tokens * active / tp + 4.0 * tokens * attended * shape.heads * shape.head_dim / tp
        kv += seqs * attended * 2 * kv_per_rank * shape.head_dim * kvb
    if shape.feature_inputs:  # fc over the fused target features of the rows being injected
        weights += shape.feature_inputs * shape.hidden * shape.hidden * wb / tp
    if head_rows and head_vocab:
        weights += head_vocab * shape.hidden * lmb / head_tp
        flops += 2.0 * head_rows * head_vocab * shape.hidden / head_tp
    one = Pass(weights + kv, flops, shape.layers, seqs, quant.weights)
    memory_s, compute_s = pass_roofline_s(one, hw)
    nbytes, calls = collective_payload(0 if tp == 1 else shape.layers, shape.hidden, tokens, head_rows if head_vocab else 0,
                                       BYTES[quant.activations], head_tp)
    reduce_s = 2 * shape.layers * ring_all_reduce_s(tokens * shape.hidden * BYTES[quant.activations], tp, hw)
    reduce_s += all_gather_s(nbytes.get("all_gather", 0.0), head_tp, hw)
    overhead_s = pass_overhead_s(one, hw)
    seconds = elementwise_max(memory_s, compute_s) + reduce_s + overhead_s
    return Cost(seconds, weights, kv, flops, memory_s, compute_s, reduce_s, overhead_s, nbytes, calls, passes=(one,))


def resident_bytes(shape: Shape, quant: Quant, tp: int) -> float:
    """Weights one rank holds: the layers (every expert) split over the ranks, the router whole, the embedding and
    lm_head vocab-parallel in the lm_head's format, a drafter's fc and own lm_head."""
    wb, lmb = BYTES[quant.weights], BYTES[quant.lm_head]
    mlp = shape.experts * shape.expert_params if shape.experts else shape.expert_params
    layers = shape.layers * ((shape.attention_params + mlp) * wb / tp + shape.hidden * shape.experts * wb)
    vocab = (2 * shape.vocab + shape.draft_vocab) * shape.hidden * lmb / tp  # embedding + lm_head (tied models: counted twice)
    return layers + vocab + shape.feature_inputs * shape.hidden * shape.hidden * wb / tp


def kv_bytes_per_sequence(shape: Shape, quant: Quant, tp: int, context: float) -> float:
    """K and V one rank caches for one sequence of `context` tokens (sliding layers keep their window)."""
    per_token = 2 * math.ceil(shape.kv_heads / tp) * shape.head_dim * BYTES[quant.kv]
    return sum(context if shape.window(i) is None else min(context, shape.window(i)) for i in range(shape.layers)) * per_token


def _step(cost: Cost, hw: Hardware, batch: int, drafting: bool = False) -> Cost:
    extra = step_overhead_s(batch, hw) + (hw.draft_step_overhead_us * 1e-6 if drafting else 0.0)
    return cost + Cost(seconds=extra, overhead_s=extra, step_seqs=(batch,))


def ar_step(target: Shape, hw: Hardware, quant: Quant, tp: int, batch: int, context: float) -> Cost:
    return _step(forward(target, hw, quant, tp, batch, batch, context), hw, batch)


def dflash_step(target: Shape, drafter: Shape, hw: Hardware, quant: Quant, tp: int, batch: int, context: float,
                drafts: int, verify_nodes: int | None = None, drafter_replicated: bool = False) -> Cost:
    """Draft a block of `drafts` + 1 rows per sequence in one pass, verify `verify_nodes` (default drafts + 1)."""
    if drafts == 0:
        return ar_step(target, hw, quant, tp, batch, context)
    nodes = drafts + 1 if verify_nodes is None else verify_nodes
    draft = forward(drafter, hw, quant, tp, batch * (drafts + 1), batch, context, head_rows=batch * drafts,
                    head_vocab=drafter.draft_vocab or target.vocab, replicated=drafter_replicated)
    verify = forward(target, hw, quant, tp, batch * nodes, batch, context)
    return _step(draft + verify, hw, batch, drafting=True)


def eagle_step(target: Shape, drafter: Shape, hw: Hardware, quant: Quant, tp: int, batch: int, context: float, drafts: int) -> Cost:
    """K sequential one-token drafter passes (each through the drafter's own lm_head), then one verify."""
    if drafts == 0:
        return ar_step(target, hw, quant, tp, batch, context)
    cost = forward(target, hw, quant, tp, batch * (drafts + 1), batch, context)
    for j in range(drafts):
        cost = forward(drafter, hw, quant, tp, batch, batch, context + j, head_vocab=drafter.draft_vocab or target.vocab) + cost
    return _step(cost, hw, batch, drafting=True)


# -- acceptance --------------------------------------------------------------------------------------------


def expected_tokens(rates: list[float], drafts: int) -> float:
    """1 (the bonus) + Σ_{j ≤ drafts} P(drafts 1..j all accepted), rates[j-1] = α_j; past the list, its last rate."""
    total, alive = 1.0, 1.0
    for j in range(drafts):
        alive *= rates[min(j, len(rates) - 1)] if rates else 0.0
        total += alive
    return total


@dataclass(frozen=True)
class Acceptance:
    """Per-position conditional acceptance α_1..α_K of a drafter (K = how many positions were measured), and
    for trees the rate at which the drafter's second choice is right where its first was not."""

    rates: tuple[float, ...]
    second_choice: float | None = None
    source: str = ""

    @staticmethod
    def from_histogram(hist: dict[int, int], drafts: int, source: str = "") -> "Acceptance":
        """From {tokens committed per step: steps}, every step offered `drafts` drafts (so n ≤ drafts + 1)."""
        counts = {int(k): int(v) for k, v in hist.items()}
        total = sum(counts.values())
        if not total:
            raise ValueError("empty acceptance histogram")
        rates, reach = [], 1.0
        for j in range(1, drafts + 1):
            at_least = sum(c for n, c in counts.items() if n >= j + 1) / total  # draft j accepted
            rates.append(at_least / reach if reach > 0 else 0.0)
            reach = at_least
        return Acceptance(tuple(rates), source=source)

    @staticmethod
    def from_tau(tau: float, block: int, source: str = "") -> "Acceptance":
        """A constant α whose block of `block` tokens (block − 1 drafts) commits τ per step on average: all one
        knows from τ alone (the planner says so wherever it used one)."""
        if not 1.0 <= tau <= block:
            raise ValueError(f"tau {tau} outside [1, block {block}]")
        lo, hi = 0.0, 1.0
        for _ in range(60):
            mid = (lo + hi) / 2
            if expected_tokens([mid], block - 1) < tau:
                lo = mid
            else:
                hi = mid
        return Acceptance(((lo + hi) / 2,) * (block - 1), source=source or f"constant α from τ {tau} at block {block}")

    def expected(self, drafts: int) -> float:
        return expected_tokens(list(self.rates), drafts)

    def with_second_choice(self, rate: float | None) -> "Acceptance":
        return replace(self, second_choice=rate)


def tree_expected_tokens(acc: Acceptance, depth: int, nodes: int, branching: int = 2) -> float:
    """Expected committed tokens of the best `nodes`-node draft tree (root excluded) of at most `depth` levels,
    each node one of the drafter's top-`branching` candidates at its position: a node at depth j holding the
    r-th choice is right with p_j(1) = α_j, p_j(2) = (1 − α_j)·s, (the second-choice rate s), a path is accepted
    when all its nodes are, and the tree takes the `nodes` likeliest paths' nodes (EAGLE-2 / Sequoia style).
    DFlash's block gives per-position marginals, so the candidates at depth j do not depend on the path."""
    second = acc.second_choice or 0.0
    def p(j: int, r: int) -> float:
        a = acc.rates[min(j, len(acc.rates) - 1)]
        return a if r == 0 else (1 - a) * second * (1 - second) ** (r - 1)

    total, heap = 1.0, [(-p(0, r), 0, r, p(0, r)) for r in range(branching)]
    heapq.heapify(heap)
    taken = 0
    while heap and taken < nodes:
        _, j, r, prob = heapq.heappop(heap)
        total += prob
        taken += 1
        if j + 1 < depth:
            for r2 in range(branching):
                child = prob * p(j + 1, r2)
                heapq.heappush(heap, (-child, j + 1, r2, child))
    return total
