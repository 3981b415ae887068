"""Weight-only int8 (models.packed, --cpu-weights int8): the quantization against a per-element reading of its
definition, both kernels against dequantized math, the packed target against a dense target holding the
independently dequantized weights, and greedy decoding with drafts against plain decoding on the same int8 target."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import write_drafter, write_target

from dflash_trt.errors import ConfigError
from dflash_trt.loading import load_drafter, load_target
from dflash_trt.models.packed import OnednnWeight, PackedLinear, Int8Weight, pack_int8_target, pack_onednn_target, quantize_int8_pow2
from dflash_trt.runtime import Generator
from dflash_trt.sampling import SamplingParams
from dflash_trt.torch_backend import TorchBackend


def naive_quantize(w: torch.Tensor) -> tuple[list[list[int]], list[float]]:
    """Per row: the smallest power of two s with max|w| / s <= 127, then q = round-half-even(w / s), element by element."""
    qs, scales = [], []
    for row in w.float().tolist():
        amax = max(abs(v) for v in row)
        s = 1.0
        if amax > 0:
            s = 2.0 ** math.ceil(math.log2(amax / 127))
            while amax / (s / 2) <= 127:  # guard log2 rounding: s is the smallest such power
                s /= 2
            while amax / s > 127:
                s *= 2
        qs.append([max(-127, min(127, round(v / s))) for v in row])  # Python's round is half to even
        scales.append(s)
    return qs, scales


def test_quantization_is_the_per_element_definition_and_the_dense_copy_is_exact():
    g = torch.Generator().manual_seed(0)
    w = (torch.randn(24, 40, generator=g) * torch.logspace(-3, 1, 24)[:, None]).to(torch.bfloat16)
    w[3] = 0  # a zero row: scale 1, q 0
    w[5, 7] = 2.0 ** -8 * 127.5  # a tie on the boundary of the scale choice
    q, scale = quantize_int8_pow2(w)
    ref_q, ref_s = naive_quantize(w)
    assert q.dtype == torch.int8 and q.tolist() == ref_q and scale.tolist() == ref_s
    dense = w.clone()
    packed = Int8Weight(dense, crossover=4)
    assert torch.equal(dense.float(), q.float() * scale[:, None])  # q * 2^e is exact in bf16
    assert (w.float() - dense.float()).abs().le(scale[:, None] / 2).all()  # within half a step of the original
    q2, scale2 = quantize_int8_pow2(dense)  # idempotent: the dense copy quantizes to itself
    assert torch.equal(q2, q) and torch.equal(scale2, scale)
    assert packed.nbytes == q.numel() + 2 * q.shape[0]


def test_both_kernels_compute_the_dequantized_matmul():
    """Packed up to the crossover, dense above it; both equal x · (q·s)ᵀ in fp32 up to bf16 rounding of the result."""
    g = torch.Generator().manual_seed(1)
    w = torch.randn(96, 64, generator=g).to(torch.bfloat16)
    packed = Int8Weight(w, crossover=2)
    deq = packed.q.float() * packed.scales.float()[:, None]
    bias = torch.randn(96, generator=g).to(torch.bfloat16)
    for rows in (1, 2, 3, 16):
        x = torch.randn(rows, 64, generator=g).to(torch.bfloat16)
        ref = x.float() @ deq.T + bias.float()
        y = packed.linear(x, bias)
        assert y.shape == (rows, 96) and y.dtype == torch.bfloat16
        assert (y.float() - ref).abs().max() <= 2 ** -7 * ref.abs().max() + 2 ** -7
        if rows > 2:
            assert torch.equal(y, F.linear(x, w, bias))  # dense: the very matmul of the dense copy
    with pytest.raises(TypeError, match="bf16 or fp32"):
        Int8Weight(torch.randn(4, 4).half())


def test_fp32_weights_take_and_give_bf16_rounded_activations_on_both_paths():
    """An fp32 weight: both paths compute bf16(bf16(x) · (q·s)ᵀ) (computed here in float64, rounded once), so they
    agree with it and with each other to one bf16 step of the result, and the dense path is the fp32 matmul of the
    fp32 copy; the rest of the model stays fp32 (output dtype fp32)."""
    g = torch.Generator().manual_seed(2)
    w = torch.randn(96, 64, generator=g)
    packed = Int8Weight(w, crossover=2)
    assert w.dtype == torch.float32 and torch.equal(w, packed.q.float() * packed.scales.float()[:, None])
    deq = packed.q.double() * packed.scales.double()[:, None]
    bias = torch.randn(96, generator=g)
    for rows in (1, 2, 3, 16):
        x = torch.randn(rows, 64, generator=g)
        exact = (x.to(torch.bfloat16).double() @ deq.T).to(torch.bfloat16)  # the product rounded once to bf16
        y = packed.linear(x, bias)
        assert y.shape == (rows, 96) and y.dtype == torch.float32
        got = (y - bias).to(torch.bfloat16)  # y = that bf16 value + bias in fp32: undo the bias, exactly up to fp32 rounding
        assert ((got.double() - exact.double()).abs() <= exact.double().abs() * 2 ** -7).all()  # one bf16 step at most
        assert (got != exact).float().mean() < 0.05  # nearly always the very same rounding
        if rows > 2:  # dense: bf16(fp32 matmul of bf16(x) with the fp32 copy)
            assert torch.equal(y, F.linear(x.to(torch.bfloat16).float(), w).to(torch.bfloat16).float() + bias)


@pytest.mark.parametrize("tie", [False, True])
def test_packed_target_equals_a_dense_target_holding_the_dequantized_weights(tmp_path, tie):
    path = write_target(tmp_path / "t", "llama", seed=3, tie=tie)
    reference = load_target(path, dtype=torch.bfloat16)
    for _, mod in reference.named_modules():  # independent: every matmul weight replaced by its naive quantization
        weights = [mod.weight] if isinstance(mod, torch.nn.Linear) else []
        for w in weights:
            qs, scales = naive_quantize(w)
            w.data = (torch.tensor(qs, dtype=torch.float32) * torch.tensor(scales)[:, None]).to(torch.bfloat16)
    if tie:
        w = reference.model.embed_tokens.weight
        qs, scales = naive_quantize(w)
        w.data = (torch.tensor(qs, dtype=torch.float32) * torch.tensor(scales)[:, None]).to(torch.bfloat16)
    tokens = torch.tensor([5, 9, 14, 2, 33, 7])
    for crossover in (0, 16):  # 0: every call dense (bit-equal); 16: every call packed (equal up to bf16 rounding)
        model = load_target(path, dtype=torch.bfloat16)
        backend = TorchBackend(model, None, 8, 16)  # fused, then int8 below
        added = pack_int8_target(model, crossover=crossover)
        assert any(isinstance(m, PackedLinear) for m in model.modules()) and added > 0
        assert (model.lm_head is None) == tie and model.lm_head_packed is not None
        for ours, ref in zip(model.state_dict().values(), reference.state_dict().values()):
            assert torch.equal(ours, ref)  # the model's Parameters hold the quantized weights
        got, want = [], []
        for m, out in ((model, got), (reference, want)):
            cache = m.new_cache(8, 16)
            cache.add_sequence(0)
            with torch.inference_mode():
                out.append(m(tokens, cache.prepare([0], [len(tokens)]), cache)[0])
        if crossover == 0:
            assert torch.equal(got[0], want[0])
        else:
            assert (got[0] - want[0]).abs().max() < 0.05 * want[0].abs().max()
        del backend


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_greedy_with_drafts_equals_plain_decoding_on_the_same_int8_target(tmp_path, dtype):
    """Lossless against the target as run: DFlash (oracle drafts, so long blocks are accepted) and plain decoding
    on one int8 target (packed kernel up to 2 rows, dense above, so verify blocks take the other kernel) agree;
    where bf16 rounding makes them part, the target's two logits there are a near-tie."""
    from test_lossless import OracleDrafts

    from dflash_trt.bench import flip_logit_gap

    target_dir = write_target(tmp_path / "t", "llama", seed=5)
    drafter_dir = write_drafter(tmp_path / "d", target_dir, num_layers=2, block_size=8)
    target = load_target(target_dir, dtype=dtype)
    ar = TorchBackend(target, None, 128, 4, cpu_weights="int8")
    pack_int8_target(target, crossover=2)  # force the crossover (the backend measured one)
    drafter = load_drafter(drafter_dir, target.cfg, dtype=dtype)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [20, 30, 40]]
    params = SamplingParams(max_new_tokens=24)
    plain = [o.output_ids for o in Generator(ar, eos_token_ids=set(), max_batch=4).generate(prompts, params)]
    flips = 0
    for batch, block in ((1, 8), (3, 4)):
        dflash = TorchBackend(target, drafter, 128, 4, block_size=block, cpu_weights="int8")  # re-fuses and re-packs (idempotent)
        pack_int8_target(target, crossover=2)
        spec = Generator(OracleDrafts(dflash, prompts, plain, seed=block), eos_token_ids=set(), max_batch=batch).generate(prompts, params)
        assert max(n for o in spec for n in o.accepted_lengths) >= block - 1  # long blocks were verified and kept
        for p, a, o in zip(prompts, plain, spec):
            if a != o.output_ids:
                flips += 1
                assert abs(flip_logit_gap(ar, p, a, o.output_ids)) < 0.1, p
    assert flips <= 2


def test_int8_refuses_a_target_that_is_neither_bf16_nor_fp32(tmp_path):
    target = load_target(write_target(tmp_path / "t", "llama"), dtype=torch.float16)
    with pytest.raises(ConfigError, match="--dtype bf16 or fp32") as err:
        TorchBackend(target, None, 8, 16, cpu_weights="int8")
    assert err.value.key == "--cpu-weights"
    with pytest.raises(ConfigError, match="cpu_weights"):
        TorchBackend(target, None, 8, 16, cpu_weights="int4")


def test_the_measured_crossover_is_a_probe_row_count_cached_per_shape():
    from dflash_trt.models import packed

    w = torch.randn(40, 32).to(torch.bfloat16)
    first = Int8Weight(w.clone()).crossover
    assert first in (0, *packed.PROBE_ROWS[:-1], packed.ALWAYS)
    key = (40, 32, torch.bfloat16, torch.get_num_threads())
    assert key in packed._crossovers
    packed._crossovers[key] = 3  # a cached value is what later weights of that shape and dtype get
    assert Int8Weight(w.clone()).crossover == 3
    assert Int8Weight(w.float()).crossover in (0, *packed.PROBE_ROWS[:-1], packed.ALWAYS)  # fp32: its own probe
    assert (40, 32, torch.float32, torch.get_num_threads()) in packed._crossovers
    del packed._crossovers[key]


def test_generate_takes_cpu_weights_int8_on_bf16_and_fp32_and_refuses_fp16_in_one_line(tiny_dirs, capsys, tmp_path, monkeypatch):
    from dflash_trt.cli import main

    monkeypatch.setenv("DFLASH_TRT_CALIBRATION", str(tmp_path / "cal"))
    target, drafter = tiny_dirs
    common = ["generate", "--target", str(target), "--prompt", "def add(a, b):", "--max-new-tokens", "12", "--ignore-eos", "--block-size", "4"]
    for dtype in ("bf16", "fp32"):
        assert main([*common, "--drafter", str(drafter), "--dtype", dtype, "--cpu-weights", "int8"]) == 0
        out = capsys.readouterr()
        assert out.out.strip() and "tau=" in out.err
    assert main([*common, "--no-drafter", "--dtype", "fp16", "--cpu-weights", "int8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--cpu-weights" in err[0] and "bf16 or fp32" in err[0]
    if torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported():
        assert main([*common, "--drafter", str(drafter), "--dtype", "bf16", "--cpu-weights", "onednn"]) == 0
        assert "tau=" in capsys.readouterr().err
        assert main([*common, "--no-drafter", "--dtype", "fp32", "--cpu-weights", "onednn"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--cpu-weights onednn prepacks bf16" in err[0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_the_floor_counts_the_packed_bytes_a_one_token_step_reads(tmp_path, dtype):
    """Closed form from transformers' modules: each matmul weight [N, K] is N·K int8 bytes + N bf16 scales; norms
    stay in the target's dtype; the tied embedding table is the lm_head (packed too)."""
    import transformers

    from dflash_trt.bench import weight_bytes

    path = write_target(tmp_path / "t", "llama", tie=True)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    matmuls = [m.weight for m in hf.modules() if isinstance(m, torch.nn.Linear) and m is not hf.lm_head]
    matmuls.append(hf.model.embed_tokens.weight)
    norms = [p for n, p in hf.named_parameters() if "norm" in n]
    expected = sum(w.shape[0] * w.shape[1] + 2 * w.shape[0] for w in matmuls) + sum(p.nbytes for p in norms)
    target = load_target(path, dtype=dtype)
    TorchBackend(target, None, 8, 16)
    pack_int8_target(target, crossover=1)  # packed for 1-token steps whatever this machine measures
    assert weight_bytes(target) == expected
    pack_int8_target(target, crossover=0)  # never packed: the step reads the dense weights
    assert weight_bytes(target) == sum(p.nbytes for p in hf.parameters())


def test_a_dense_backend_on_a_target_packed_before_is_refused(tmp_path):
    target = load_target(write_target(tmp_path / "t", "llama"), dtype=torch.bfloat16)
    TorchBackend(target, None, 8, 16, cpu_weights="int8")
    TorchBackend(target, None, 8, 16, cpu_weights="int8")  # the same weights again: fine (packing is idempotent)
    with pytest.raises(ConfigError, match="already holds int8 weights.*--cpu-weights onednn"):
        TorchBackend(target, None, 8, 16, cpu_weights="onednn")
    with pytest.raises(ConfigError, match="already holds int8"):
        TorchBackend(target, None, 8, 16)


# ---- --cpu-weights onednn: the same bf16 weights, prepacked for oneDNN ----------------------------------------------

needs_onednn = pytest.mark.skipif(not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()),
                                  reason="torch's oneDNN has no bf16 on this CPU")


@needs_onednn
@pytest.mark.parametrize("rows", [1, 2, 5, 16, 70])
def test_onednn_weight_is_the_bf16_product_of_the_same_weight(rows):
    """Against float64 math on the same bf16 values: within bf16 rounding of the output, as F.linear is; the bias is
    added; under autograd it is F.linear itself."""
    g = torch.Generator().manual_seed(rows)
    w = (torch.randn(96, 64, generator=g) / 8).bfloat16()
    b = torch.randn(96, generator=g).bfloat16()
    x = torch.randn(rows, 64, generator=g).bfloat16()
    packed = OnednnWeight(w)
    with torch.no_grad():
        got = packed.linear(x, b)
        dense = F.linear(x, w, b)
    ref = x.double() @ w.double().t() + b.double()
    tol = 2 ** -7 * ref.abs().amax().item() * 2  # two bf16 ulps of the largest output
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 96)
    assert (got.double() - ref).abs().max().item() <= tol and (dense.double() - ref).abs().max().item() <= tol
    assert packed.nbytes == w.nbytes
    with torch.enable_grad():
        xg = x.clone().requires_grad_(True)
        packed.linear(xg, b).float().sum().backward()  # the dense path: gradients flow
        assert xg.grad is not None
    with pytest.raises(TypeError, match="bf16"):
        OnednnWeight(w.float())


@needs_onednn
def test_onednn_target_runs_the_same_weights_and_refuses_other_dtypes(tmp_path):
    """A prepacked target keeps its Parameters as they are (no quantization) and its logits equal the dense target's
    to bf16 rounding; an fp32 target is refused with one error naming --cpu-weights."""
    path = write_target(tmp_path / "t", "llama", seed=4)
    dense, model = load_target(path, dtype=torch.bfloat16), load_target(path, dtype=torch.bfloat16)
    backend = TorchBackend(model, None, 8, 16, cpu_weights="onednn")
    assert backend.packed_bytes > 0 and model.lm_head_packed is not None
    for ours, ref in zip(model.state_dict().values(), dense.state_dict().values()):
        assert torch.equal(ours, ref)
    tokens = torch.tensor([5, 9, 14, 2, 33, 7])
    out = []
    for m in (model, dense):
        cache = m.new_cache(8, 16)
        cache.add_sequence(0)
        with torch.inference_mode():
            out.append(m(tokens, cache.prepare([0], [len(tokens)]), cache)[0])
    assert (out[0] - out[1]).abs().max() <= 0.05 * out[1].abs().max()
    with pytest.raises(ConfigError, match="--cpu-weights.*bf16"):
        TorchBackend(load_target(path, dtype=torch.float32), None, 8, 16, cpu_weights="onednn")


@needs_onednn
def test_greedy_with_drafts_equals_plain_decoding_on_the_same_onednn_target(tmp_path):
    """Lossless against the target as run (bf16, prepacked): DFlash with oracle drafts and plain decoding agree at
    batch 1 and 3, blocks 8 and 4; where bf16 rounding of a verify block parts them, the target's logits are a near-tie."""
    from test_lossless import OracleDrafts

    from dflash_trt.bench import flip_logit_gap

    target_dir = write_target(tmp_path / "t", "llama", seed=5)
    drafter_dir = write_drafter(tmp_path / "d", target_dir, num_layers=2, block_size=8)
    target = load_target(target_dir, dtype=torch.bfloat16)
    ar = TorchBackend(target, None, 128, 4, cpu_weights="onednn")
    drafter = load_drafter(drafter_dir, target.cfg, dtype=torch.bfloat16)
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16], [20, 30, 40]]
    params = SamplingParams(max_new_tokens=24)
    plain = [o.output_ids for o in Generator(ar, eos_token_ids=set(), max_batch=4).generate(prompts, params)]
    flips = 0
    for batch, block in ((1, 8), (3, 4)):
        dflash = TorchBackend(target, drafter, 128, 4, block_size=block, cpu_weights="onednn")  # re-fuses and re-packs
        spec = Generator(OracleDrafts(dflash, prompts, plain, seed=block), eos_token_ids=set(), max_batch=batch).generate(prompts, params)
        assert max(n for o in spec for n in o.accepted_lengths) >= block - 1
        for p, a, o in zip(prompts, plain, spec):
            if a != o.output_ids:
                flips += 1
                assert abs(flip_logit_gap(ar, p, a, o.output_ids)) < 0.1, p
    assert flips <= 2


@needs_onednn
@pytest.mark.parametrize("draft_vocab", [None, 40], ids=["full-head", "d2t-head"])
def test_onednn_backend_prepacks_the_drafter_and_its_head_and_drafts_the_dense_scores(tmp_path, draft_vocab):
    """Under --cpu-weights onednn a bf16 drafter's matmuls run prepacked too (every nn.Linear a PackedLinear, the fused
    q/k/v and gate/up packed) and so does its draft head (the target's packed lm_head when the head is the whole
    vocabulary); its block scores equal the dense drafter's to bf16 rounding, and its real drafts keep the output
    equal to plain decoding on the same target."""
    target_dir = write_target(tmp_path / "t", "llama", seed=5)
    drafter_dir = write_drafter(tmp_path / "d", target_dir, num_layers=2, block_size=8, draft_vocab_size=draft_vocab)
    target = load_target(target_dir, dtype=torch.bfloat16)
    dense_target = load_target(target_dir, dtype=torch.bfloat16)
    packed = TorchBackend(target, load_drafter(drafter_dir, target.cfg, dtype=torch.bfloat16), 64, 4, cpu_weights="onednn")
    dense = TorchBackend(dense_target, load_drafter(drafter_dir, target.cfg, dtype=torch.bfloat16), 64, 4)
    fused = {id(m) for layer in packed.drafter.layers for f in (layer.self_attn._fused, layer.mlp._fused) for m in f.linears}
    apart = [m for m in packed.drafter.modules() if isinstance(m, torch.nn.Linear) and id(m) not in fused]  # o, down, fc
    assert len(apart) == 2 * len(packed.drafter.layers) + 1 and all(isinstance(m, PackedLinear) for m in apart)
    assert all(layer.self_attn._fused.packed is not None and layer.mlp._fused.packed is not None for layer in packed.drafter.layers)
    assert isinstance(packed._draft_head_packed, OnednnWeight)
    assert (packed._draft_head_packed is target.lm_head_packed) == (draft_vocab is None)
    prompt = [5, 6, 7, 8, 9, 10, 11]
    scores = []
    for be in (packed, dense):
        be.add_sequence(0)
        be.prefill([0], [prompt], [False])
        scores.append(be._draft_scores(be._draft_dflash([0], [12], [7])).float())
    ref = scores[1]
    assert (scores[0] - ref).abs().max() <= 0.05 * ref.abs().max() + 0.05  # a few bf16 steps through two layers
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]
    params = SamplingParams(max_new_tokens=20)
    ar = TorchBackend(target, None, 128, 4, cpu_weights="onednn")
    plain = [o.output_ids for o in Generator(ar, eos_token_ids=set(), max_batch=3).generate(prompts, params)]
    spec_backend = TorchBackend(target, load_drafter(drafter_dir, target.cfg, dtype=torch.bfloat16), 128, 4, cpu_weights="onednn")
    spec = Generator(spec_backend, eos_token_ids=set(), max_batch=3).generate(prompts, params)
    from dflash_trt.bench import flip_logit_gap

    for p, a, o in zip(prompts, plain, spec):
        if a != o.output_ids:  # bf16: a verify block may round a near-tie the other way (see the test above)
            assert abs(flip_logit_gap(ar, p, a, o.output_ids)) < 0.1, p


def test_native_cpu_bf16_reads_the_cpu_flags_linux_reports():
    """The independent reference: the kernel's own CPU flags (AVX512-BF16 or AMX tiles) and torch's oneDNN."""
    from dflash_trt.loading import native_cpu_bf16

    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.exists():
        pytest.skip("no /proc/cpuinfo on this OS")
    flags = set(next(line for line in cpuinfo.read_text().splitlines() if line.startswith("flags")).split(":", 1)[1].split())
    onednn = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert native_cpu_bf16() == (onednn and bool(flags & {"avx512_bf16", "amx_tile", "amx_bf16"}))


@pytest.mark.parametrize("native", [True, False])
def test_dtype_auto_picks_bf16_onednn_only_on_native_bf16_and_decodes_as_that_setting(tiny_dirs, capsys, tmp_path, monkeypatch, native):
    """`--dtype auto` is exactly the setting it names: the same tokens as that setting spelled out (fp32 where the CPU
    has no native bf16; bf16 + onednn where it has), an explicit --cpu-weights kept, dense under tensor parallelism."""
    import argparse

    from dflash_trt import loading
    from dflash_trt.cli import main

    if native and not (torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()):
        pytest.skip("torch's oneDNN has no bf16 here")
    monkeypatch.setattr(loading, "native_cpu_bf16", lambda: native)
    monkeypatch.setenv("DFLASH_TRT_CALIBRATION", str(tmp_path / "cal"))
    target, drafter = tiny_dirs
    common = ["generate", "--target", str(target), "--drafter", str(drafter), "--prompt", "def add(a, b):", "--max-new-tokens", "12",
              "--ignore-eos", "--block-size", "4"]
    assert main([*common, "--dtype", "auto"]) == 0
    auto = capsys.readouterr()
    chosen = ["--dtype", "bf16", "--cpu-weights", "onednn"] if native else ["--dtype", "fp32"]
    assert f"--dtype auto: {'bf16+onednn' if native else 'fp32'} (" in auto.err
    assert main([*common, *chosen]) == 0
    assert capsys.readouterr().out == auto.out

    def resolved(*flags, world=None):
        if world:
            monkeypatch.setenv("WORLD_SIZE", world)
        p = argparse.ArgumentParser()
        loading.add_model_flags(p, "generate", cpu_weights=True)
        args = p.parse_args(list(flags))
        loading.resolve_auto_dtype(args)
        monkeypatch.delenv("WORLD_SIZE", raising=False)
        return args.dtype, args.cpu_weights

    bf16 = "bf16" if native else "fp32"
    assert resolved("--dtype", "auto", "--cpu-weights", "int8") == (bf16, "int8")
    assert resolved("--dtype", "auto", world="2") == (bf16, "dense")
    assert resolved() == ("fp32", "dense") and resolved("--dtype", "bf16") == ("bf16", "dense")
