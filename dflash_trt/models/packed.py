"""Weight-only int8 for CPU decoding (`--cpu-weights int8`): packed int8 matmuls where they are faster, dense
matmuls of the very same weights where they are not.

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
CPU_WEIGHTS = ("dense", "int8")  # --cpu-weights: the weights in --dtype, or weight-only int8 (bf16 or fp32 targets)
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


class Int8Linear(nn.Linear):
    """An nn.Linear (same Parameters, same names) whose forward is its Int8Weight's."""

    def __init__(self, linear: nn.Linear, crossover: int | None = None):
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        self.weight, self.bias = linear.weight, linear.bias
        self.int8 = Int8Weight(self.weight.data, crossover)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.int8.linear(x, self.bias)


def pack_int8(model: nn.Module, crossover: int | None = None) -> int:
    """Weight-only int8 for the matmuls of a target (after `fuse_projections`): each live fused q/k/v and gate/up
    weight, every other nn.Linear (a MoE router too; gpt-oss's expert stacks are no nn.Linear and stay dense), and
    the lm_head (the tied embedding table when it is one). `crossover` forces
    the row count up to which the packed kernel runs (default: measured per shape). Idempotent: packing weights
    that already hold q · scale gives the same q and scale. Returns the bytes the packed copies add."""
    added, skip = 0, set()
    if hasattr(model, "lm_head_int8"):  # a TargetModel: its logits use lm_head_int8 (the lm_head or the tied embedding table)
        model.lm_head_int8 = Int8Weight(model.lm_head_weight.data, crossover)
        added += model.lm_head_int8.nbytes
        if model.lm_head is not None:
            skip.add(id(model.lm_head))
    for module in model.modules():
        if isinstance(module, (AttentionProjections, MLP)) and module._fused is not None and module._fused.intact(module):
            module._fused.int8 = Int8Weight(module._fused.weight, crossover)
            added += module._fused.int8.nbytes
            skip.update(id(m) for m in module._fused.linears)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is nn.Linear and id(child) not in skip:
                packed = Int8Linear(child, crossover)
                setattr(parent, name, packed)
                added += packed.int8.nbytes
            elif isinstance(child, Int8Linear) and id(child) not in skip:
                child.int8 = Int8Weight(child.weight.data, crossover)
                added += child.int8.nbytes
    return added


def pack_int8_target(target: nn.Module, crossover: int | None = None) -> int:
    """pack_int8 for a bf16 or fp32 target (an fp32 one keeps fp32 everywhere but at its matmuls' inputs and outputs,
    see Int8Weight), with one clear error for any other dtype."""
    dtype = target.lm_head_weight.dtype
    if dtype not in (torch.bfloat16, torch.float32):
        raise ConfigError(f"--cpu-weights int8 needs a bf16 or fp32 target; this one is {dtype} (use --dtype bf16 or fp32)", key="--cpu-weights")
    return pack_int8(target, crossover)
