"""Packed CPU weights: weight-only int8 (`--cpu-weights int8`) and oneDNN-prepacked bf16 (`--cpu-weights onednn`).

`onednn`: each bf16 matmul weight is also held in oneDNN's blocked layout (`torch.ops.mkldnn._reorder_linear_weight`,
what inductor's CPU freezing pass uses) and run by `mkldnn._linear_pointwise`. Same weights, same dtype, no
quantization: its products agree with F.linear's (tests/test_packed.py; on the AVX512-bf16 EPYC of this project
bit for bit at every shape measured). The prepacked kernel skips the per-call reorder of the plain layout: measured
on that 2-core machine, 1 thread, cache-hot, interleaved (notes of issue 21): 576×3072 at 1 row 71 µs vs 143 µs, at
16 rows 279 vs 383 µs, at 200 rows 3.4 vs 7.8 ms; the 576×49152 head at 1 row 5.5 vs 7.8 ms. Memory: one more copy
of every matmul weight (+100% of the linears' bytes; the tied embedding table stays as it is, its head copy is
added). bf16 targets only: for an fp32 target the whole 1-token step ran slower prepacked (41.3 vs 31.6 ms, weights
from DRAM: dense_linear's two-row GEMM streams them faster), though a 16-token verify ran faster (78.8 vs 85.4 ms).

Weight-only int8: packed int8 matmuls where they are faster, dense matmuls of the very same weights where they are not.

On a CPU without AMX a matmul of one token is a GEMV bound by its kernel or by the bytes it reads; torch's packed
int8 kernel (`aten._weight_int8pack_mm`: bf16 activations, int8 weights [N, K], one scale per output row) reads a
half (bf16) or a quarter (fp32) of the bytes and runs a 1-token step about twice as fast, but loses to the dense
matmul for wide verify blocks. So each weight is held twice and each call picks by its row count M: packed int8 up
to a crossover measured once per weight shape and process, dense above it.

Both forms hold *the same weights*. Scales are powers of two, so q · s (|q| ≤ 127, a 7-bit integer) is exact in
bf16 and fp32: the dense copy is exactly q · s, and the model's own Parameters are overwritten with it in place
(state_dict, tied embeddings and the drafter's draft head see the weights the target runs with). The two kernels
then differ only in how they round their sums, as a bf16 verify block already differs from a 1-token step, so
greedy decoding with or without drafts is lossless against the target *as run* in the same sense as bf16 itself is
(near-ties can flip; `bench` reports the match rate and the logit gaps). An fp32 target keeps fp32 everywhere but at
its int8 matmuls, which take bf16-rounded inputs and give bf16-rounded outputs on both paths (Int8Weight): the two
paths then differ only in fp32 summation order before the same rounding. Against the original weights the
quantization is a real change: `bench --cpu-weights int8` reports its greedy agreement with them.

Memory: the packed copy adds 1 byte per weight (plus 2 per row) to the 2 (bf16) or 4 (fp32) bytes of the weights.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from .layers import MLP, AttentionProjections, dense_linear

INT8_MAX = 127
# --cpu-weights: the weights in --dtype, weight-only int8 (bf16 or fp32 targets), or bf16 prepacked for oneDNN
CPU_WEIGHTS = ("dense", "int8", "onednn")
PROBE_ROWS = (1, 2, 4, 8, 16)  # row counts at which the crossover is measured

_crossovers: dict[tuple, int] = {}  # (N, K, dense dtype, threads) → largest M where the packed kernel is faster


def quantize_int8_pow2(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [N, K] → (q int8 [N, K], scale fp32 [N]) with scale a power of two per row, the smallest with
    max|w| / scale ≤ 127, and q = round(w / scale) (round half to even); rows of zeros get scale 1."""
    w = weight.detach().float()
    amax = w.abs().amax(dim=1)
    scale = torch.where(amax > 0, torch.exp2(torch.ceil(torch.log2(amax / INT8_MAX))), torch.ones_like(amax))
    q = torch.round(w / scale[:, None]).clamp_(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def _median_s(fn, reps: int = 3) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


ALWAYS = 1 << 62  # a crossover above any row count: the packed kernel for every call


def measure_crossover(q: torch.Tensor, scales: torch.Tensor, dense: torch.Tensor) -> int:
    """The largest M of PROBE_ROWS at which the packed int8 matmul beats the dense one on this machine, over the
    probe rows in order (0: never); ALWAYS when it still wins at the last probe (both kernels are compute-bound
    there, their costs linear in M, so the order holds for wider calls too: on an AVX2-only CPU, where a bf16
    matmul costs in proportion to its rows, a 200-token prefill then runs packed as well). Cached per
    (N, K, dtype, torch threads) for the process."""
    key = (*q.shape, dense.dtype, torch.get_num_threads())
    if key not in _crossovers:
        best = 0
        with torch.no_grad():  # dense_linear's fast path is the one decoding takes (no grad)
            for m in PROBE_ROWS:
                x = torch.randn(m, q.shape[1], dtype=dense.dtype)
                packed = _median_s(lambda: torch.ops.aten._weight_int8pack_mm(x.to(torch.bfloat16), q, scales))
                if packed >= _median_s(lambda: dense_linear(x, dense)):
                    break
                best = m
        _crossovers[key] = ALWAYS if best == PROBE_ROWS[-1] else best
    return _crossovers[key]


class Int8Weight:
    """One weight [N, K] (a bf16 or fp32 tensor, overwritten in place with its quantized value q · scale) and its
    packed int8 form; `linear(x)` = x · weightᵀ by the packed kernel for at most `crossover` rows, else densely.

    The packed kernel takes bf16 activations (with fp32 ones it runs at a tenth of the speed) and returns bf16. For an
    fp32 weight both paths therefore compute bf16(bf16(x) · weightᵀ) in fp32 arithmetic: the packed one by casting x
    and its result, the dense one by rounding x to bf16 and its fp32 result to bf16. Products of a bf16 value and
    q · 2^e are exact in fp32, so the two differ only in fp32 summation order before the same final rounding, and
    the rest of the model (norms, RoPE, attention, residuals) stays fp32."""

    def __init__(self, weight: torch.Tensor, crossover: int | None = None):
        if weight.dtype not in (torch.bfloat16, torch.float32):
            raise TypeError(f"int8 weights replace bf16 or fp32 weights; this weight is {weight.dtype}")
        q, scale = quantize_int8_pow2(weight)
        with torch.no_grad():
            weight.copy_(q.to(weight.dtype) * scale[:, None].to(weight.dtype))  # exact: a 7-bit integer times 2^e
        self.q, self.scales, self.dense = q, scale.to(torch.bfloat16), weight
        self.crossover = measure_crossover(self.q, self.scales, weight) if crossover is None else crossover

    @property
    def nbytes(self) -> int:
        """What the packed form adds to the dense weight."""
        return self.q.nbytes + self.scales.nbytes

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        rows = x.numel() // x.shape[-1]
        fp32 = self.dense.dtype == torch.float32
        if rows > self.crossover:
            if fp32:  # the packed kernel's function: bf16 in, bf16 out (see the class docstring)
                y = dense_linear(x.to(torch.bfloat16).float(), self.dense).to(torch.bfloat16).float()
                return y if bias is None else y + bias
            return F.linear(x, self.dense, bias)
        y = torch.ops.aten._weight_int8pack_mm(x.reshape(rows, x.shape[-1]).to(torch.bfloat16), self.q, self.scales)
        y = y.to(x.dtype).reshape(*x.shape[:-1], self.q.shape[0])
        return y if bias is None else y + bias


class OnednnWeight:
    """One bf16 weight [N, K] and its oneDNN-prepacked copy; `linear(x)` = x · weightᵀ by the prepacked kernel
    (F.linear of the dense weight under autograd, which the prepacked op does not carry)."""

    crossover = ALWAYS  # the prepacked copy serves every row count

    def __init__(self, weight: torch.Tensor):
        if weight.dtype != torch.bfloat16:
            raise TypeError(f"oneDNN-prepacked weights are bf16; this weight is {weight.dtype}")
        self.dense = weight
        self.prepacked = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), 1)  # batch-size hint: decode steps

    @property
    def nbytes(self) -> int:
        """What the prepacked copy adds (the same bytes as the dense weight)."""
        return self.dense.nbytes

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        if torch.is_grad_enabled() or x.dtype != torch.bfloat16:
            return F.linear(x, self.dense, bias)
        rows = x.numel() // x.shape[-1]
        y = torch.ops.mkldnn._linear_pointwise(x.reshape(rows, x.shape[-1]), self.prepacked, bias, "none", [], "")
        return y.reshape(*x.shape[:-1], self.dense.shape[0])


class PackedLinear(nn.Linear):
    """An nn.Linear (same Parameters, same names) whose forward is its packed weight's (Int8Weight, OnednnWeight)."""

    def __init__(self, linear: nn.Linear, packed):
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        self.weight, self.bias = linear.weight, linear.bias
        self.packed = packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.packed.linear(x, self.bias)


def pack_weights(model: nn.Module, make) -> int:
    """Packed copies (`make(weight)` → Int8Weight or OnednnWeight) for the matmuls of a target (after
    `fuse_projections`): each live fused q/k/v and gate/up weight, every other nn.Linear (a MoE router too;
    gpt-oss's expert stacks are no nn.Linear and stay dense), and the lm_head (the tied embedding table when it is
    one). Packing again replaces the copies. Returns the bytes the packed copies add."""
    added, skip = 0, set()
    if hasattr(model, "lm_head_packed"):  # a TargetModel: its logits use lm_head_packed (the lm_head or the tied embedding table)
        model.lm_head_packed = make(model.lm_head_weight.data)
        added += model.lm_head_packed.nbytes
        if model.lm_head is not None:
            skip.add(id(model.lm_head))
    for module in model.modules():
        if isinstance(module, (AttentionProjections, MLP)) and module._fused is not None and module._fused.intact(module):
            module._fused.packed = make(module._fused.weight)
            added += module._fused.packed.nbytes
            skip.update(id(m) for m in module._fused.linears)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if id(child) in skip:
                continue
            if type(child) is nn.Linear:
                child = PackedLinear(child, make(child.weight.data))
                setattr(parent, name, child)
                added += child.packed.nbytes
            elif isinstance(child, PackedLinear):
                child.packed = make(child.weight.data)
                added += child.packed.nbytes
    return added


def packed_kind(target: nn.Module) -> str | None:
    """The --cpu-weights a target was packed with ("int8", "onednn"), or None while its weights are dense."""
    packed = getattr(target, "lm_head_packed", None)
    return None if packed is None else "int8" if isinstance(packed, Int8Weight) else "onednn"


def pack_int8(model: nn.Module, crossover: int | None = None) -> int:
    """Weight-only int8 (pack_weights with Int8Weight). `crossover` forces the row count up to which the packed
    kernel runs (default: measured per shape). Idempotent: packing weights that already hold q · scale gives the
    same q and scale. Returns the bytes the packed copies add."""
    return pack_weights(model, lambda w: Int8Weight(w, crossover))


def onednn_bf16_available() -> bool:
    """Whether torch's oneDNN runs bf16 matmuls on this CPU (natively or emulated): what --cpu-weights onednn needs."""
    return bool(torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_onednn_target(target: nn.Module) -> int:
    """oneDNN-prepacked copies of a bf16 target's matmul weights, with one clear error for any other dtype or a
    torch without oneDNN bf16 on this CPU. Returns the bytes they add."""
    dtype = target.lm_head_weight.dtype
    if dtype != torch.bfloat16:
        raise ConfigError(f"--cpu-weights onednn prepacks bf16 weights; this target is {dtype} (use --dtype bf16)", key="--cpu-weights")
    if not onednn_bf16_available():
        raise ConfigError("--cpu-weights onednn needs torch's oneDNN with bf16 support on this CPU (torch.backends.mkldnn)", key="--cpu-weights")
    return pack_weights(target, OnednnWeight)


def pack_onednn_drafter(drafter: nn.Module) -> int:
    """oneDNN-prepacked copies of a bf16 drafter's matmul weights (its fused q/k/v and gate/up, o/down, fc): the
    drafter's pass is a few rows through small matrices, where the prepacked kernel's lower per-call cost shows
    (measured: a 4-slot DFlash pass with its draft head 4.6 → 3.1 ms, 1 thread). A drafter in another dtype stays dense (returns 0).
    Only drafts change rounding, never the output: verification is the target's. Returns the bytes they add."""
    first = next(drafter.parameters())
    if first.dtype != torch.bfloat16 or first.device.type != "cpu":
        return 0
    return pack_weights(drafter, OnednnWeight)


def pack_int8_target(target: nn.Module, crossover: int | None = None) -> int:
    """pack_int8 for a bf16 or fp32 target (an fp32 one keeps fp32 everywhere but at its matmuls' inputs and outputs,
    see Int8Weight), with one clear error for any other dtype."""
    dtype = target.lm_head_weight.dtype
    if dtype not in (torch.bfloat16, torch.float32):
        raise ConfigError(f"--cpu-weights int8 needs a bf16 or fp32 target; this one is {dtype} (use --dtype bf16 or fp32)", key="--cpu-weights")
    return pack_int8(target, crossover)
