"""Fused projections (layers.FusedLinear): one q/k/v and one gate/up matmul per layer, same weights, same names.

The lossless and transformers-equality tests run with fusion on (TorchBackend's default, and the fused
parametrisations of test_models / test_gpt_oss); these check what fusion itself promises."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from conftest import write_drafter, write_target
from torch.overrides import TorchFunctionMode

from dflash_trt.loading import load_drafter, load_target, load_torch_backend
from dflash_trt.models.layers import fuse_projections
from dflash_trt.runtime import Generator
from dflash_trt.sampling import SamplingParams
from dflash_trt.torch_backend import TorchBackend


class CountLinear(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func is F.linear:
            self.shapes.append(tuple(args[1].shape))
        elif func is torch.mm:  # layers.dense_linear: (W · xᵀ)ᵀ for a few fp32 rows
            self.shapes.append(tuple(args[0].shape))
        return func(*args, **(kwargs or {}))


def _step(model, tokens):
    cache = model.new_cache(8, 4)
    cache.add_sequence(0)
    with torch.inference_mode():
        return model(tokens, cache.prepare([0], [len(tokens)]), cache, (0, 2))


def test_one_qkv_and_one_gate_up_matmul_per_layer_with_equal_outputs(tmp_path):
    path = write_target(tmp_path / "t", "qwen3", seed=4)  # q/k norms on the fused q and k
    model = load_target(path)
    tokens = torch.tensor([5, 17, 9, 40])
    with CountLinear() as apart:
        want = _step(model, tokens)
    names = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    fuse_projections(model)
    with CountLinear() as fused:
        got = _step(model, tokens)
    layers, cfg = model.cfg.num_layers, model.cfg
    assert len(apart.shapes) == 7 * layers + 1 and len(fused.shapes) == 4 * layers + 1  # + lm_head
    qkv = (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim
    assert fused.shapes.count((qkv, cfg.hidden_size)) == layers
    assert fused.shapes.count((2 * cfg.intermediate_size, cfg.hidden_size)) == layers
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], want[1], atol=1e-5, rtol=1e-5)
    # names, shapes and storage: the checkpoint's view of the model is unchanged
    assert {k: tuple(v.shape) for k, v in model.state_dict().items()} == names
    attn = model.model.layers[1].self_attn
    assert attn.q_proj.weight.untyped_storage().data_ptr() == attn._fused.weight.untyped_storage().data_ptr()


def test_in_place_updates_reach_the_fused_weight_and_replaced_weights_fall_back(tmp_path):
    path = write_target(tmp_path / "t", "llama", seed=5)
    fused, ref = load_target(path), load_target(path)
    fuse_projections(fused)
    tokens = torch.tensor([3, 8, 60])
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for model in (fused, ref):  # the same in-place edit (what load_state_dict and optimisers do)
            model.model.layers[0].self_attn.k_proj.weight.mul_(1.5)
            model.model.layers[2].mlp.up_proj.weight.add_(0.01)
        delta = torch.randn(ref.model.layers[1].self_attn.v_proj.weight.shape, generator=gen) * 0.1
        for model in (fused, ref):  # a new tensor in place of the weight: the fused copy is stale, so it must not be used
            v = model.model.layers[1].self_attn.v_proj
            v.weight = torch.nn.Parameter(v.weight.detach() + delta)
    assert not fused.model.layers[1].self_attn._fused.live(fused.model.layers[1].self_attn)
    assert fused.model.layers[0].self_attn._fused.live(fused.model.layers[0].self_attn) is False  # grad mode on here
    with torch.no_grad():
        assert fused.model.layers[0].self_attn._fused.live(fused.model.layers[0].self_attn)
    torch.testing.assert_close(_step(fused, tokens)[0], _step(ref, tokens)[0], atol=1e-5, rtol=1e-5)
    # re-cast to bf16 (new storage everywhere): every layer falls back until fused again, and matches the re-cast reference
    fused.to(torch.bfloat16), ref.to(torch.bfloat16)
    torch.testing.assert_close(_step(fused, tokens)[0], _step(ref, tokens)[0], atol=0, rtol=0)
    assert fuse_projections(fused)  # it was fused: re-fuse from the bf16 weights
    assert fused.model.layers[0].mlp._fused.weight.dtype == torch.bfloat16
    torch.testing.assert_close(_step(fused, tokens)[0], _step(ref, tokens)[0], atol=0.1, rtol=0.02)


def test_fused_speculative_output_and_calibration_equal_the_unfused(tmp_path):
    from dflash_trt.quant.calibrate import calibrate

    target = write_target(tmp_path / "t", "llama", seed=6)
    drafter = write_drafter(tmp_path / "d", target, num_layers=2, block_size=6, seed=7)
    prompts = [[5, 9, 33, 2, 71], [40, 41, 42], [7] * 9]
    params = SamplingParams(max_new_tokens=12, ignore_eos=True)
    outs, tables = [], []
    for fuse in (True, False):
        t = load_target(target)
        backend = TorchBackend(t, load_drafter(drafter, t.cfg), fuse=fuse)
        outs.append([r.output_ids for r in Generator(backend, eos_token_ids=(), max_batch=3).generate(prompts, params)])
        tables.append(calibrate(backend, prompts[:2], max_new_tokens=3, progress=False))
        # calibration ran the linears apart (their hooks fire) and gave fusion back
        assert (backend.target.model.layers[0].self_attn._fused is not None) == fuse
    assert outs[0] == outs[1]
    for key in ("target", "drafter"):
        assert tables[0][key].keys() == tables[1][key].keys()
        assert any("q_proj" in k for k in tables[0][key]) and any("gate_proj" in k for k in tables[0][key])
        for name, value in tables[1][key].items():
            assert abs(tables[0][key][name] - value) <= 1e-4 * max(1.0, value), (key, name)
    assert load_torch_backend(target, drafter).target.model.layers[0].mlp._fused is not None  # on by default


def test_dense_linear_is_f_linear_to_rounding_at_every_row_count():
    """layers.dense_linear (W · xᵀ for a few fp32 rows on CPU) vs F.linear computed in float64."""
    from dflash_trt.models.layers import SMALL_ROWS, dense_linear

    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(300, 96, generator=gen), torch.randn(300, generator=gen)
    for rows in range(1, SMALL_ROWS[1] + 4):
        x = torch.randn(rows, 96, generator=gen)
        with torch.inference_mode():
            got = dense_linear(x, w, b)
        assert got.shape == (rows, 300) and got.is_contiguous()
        torch.testing.assert_close(got, F.linear(x.double(), w.double(), b.double()).float(), rtol=1e-5, atol=1e-5)
    x = torch.randn(3, 96, generator=gen)
    with torch.enable_grad():  # training: the plain F.linear (autograd through the usual kernel)
        assert torch.equal(dense_linear(x, w, b), F.linear(x, w, b))
    xb, wb = x.bfloat16(), w.bfloat16()
    with torch.inference_mode():
        assert torch.equal(dense_linear(xb, wb), F.linear(xb, wb))  # only fp32 takes the other form
