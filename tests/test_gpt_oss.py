"""gpt-oss as a target: the torch reference against transformers' GptOssForCausalLM (MoE with top-k softmax
routing, clamped SwiGLU experts, attention sinks, alternating sliding/full layers, yarn RoPE), and the DFlash
loop lossless on it."""

from __future__ import annotations

import json
import random

import pytest
import torch
import transformers
from conftest import _perturb_norms, assert_equals_transformers, write_drafter
from test_lossless import OracleDrafts

from dflash_trt.config import load_target_config
from dflash_trt.convert import convert
from dflash_trt.errors import ConfigError
from dflash_trt.loading import load_target
from dflash_trt.runtime import Generator
from dflash_trt.sampling import SamplingParams
from dflash_trt.torch_backend import TorchBackend

TINY_GPT_OSS = dict(
    hidden_size=64, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    vocab_size=96, num_local_experts=4, num_experts_per_tok=2, sliding_window=8, max_position_embeddings=512,
    rms_norm_eps=1e-5, eos_token_id=2, bos_token_id=1, initializer_range=0.15,
)
# original_max_position_embeddings * factor = max_position_embeddings, as in the released configs
YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "original_max_position_embeddings": 16}


def write_gpt_oss(path, seed: int = 0, **overrides):
    """A random GptOssForCausalLM saved by transformers, with every parameter that init leaves at 0 or 1 (norms,
    expert biases) randomised and a low swiglu_limit, so clamping, sinks and biases all change the output."""
    kwargs = dict(TINY_GPT_OSS, rope_parameters=dict(YARN, truncate=False), swiglu_limit=1.5)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(transformers.GptOssConfig(**kwargs)).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        params = dict(model.named_parameters())
        _perturb_norms(params, gen)
        for name, t in params.items():
            if name.endswith(("_bias", "sinks")):
                t.copy_(torch.randn(t.shape, generator=gen))
    model.save_pretrained(path, safe_serialization=True)
    return path


TARGETS = {
    "released-layout": dict(),  # sliding, full, sliding, full; yarn without truncation (as openai/gpt-oss-*)
    "full-first-truncated-yarn-tied": dict(
        layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"], sliding_window=5,
        rope_parameters=dict(YARN, truncate=True), tie_word_embeddings=True, num_experts_per_tok=3,
    ),
}


@pytest.mark.parametrize("fused", [False, True], ids=["apart", "fused"])
@pytest.mark.parametrize("name", list(TARGETS))
def test_gpt_oss_logits_and_features_equal_transformers_batched_and_paged(tmp_path, name, fused):
    from dflash_trt.models.layers import fuse_projections

    path = write_gpt_oss(tmp_path / name, seed=3, **TARGETS[name])
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ours = load_target(path)
    fuse_projections(ours, on=fused)  # q/k/v with biases in one matmul (the MoE experts are stacked already)
    gen = torch.Generator().manual_seed(0)
    # two sequences longer than the window, so the window and the sinks apply to cached keys as well as new ones
    seqs = [torch.randint(0, 96, (n,), generator=gen) for n in (7, 23, 14)]
    assert_equals_transformers(hf, ours, seqs, cuts=[3, 13, 12], capture=(0, 1, 3))


def test_gpt_oss_features_are_sensitive_to_sinks_window_and_clamp(tmp_path):
    """The reference checks above mean something only if each gpt-oss ingredient changes the output here."""
    path = write_gpt_oss(tmp_path / "t", seed=3)
    base = load_target(path)
    tokens = torch.randint(0, 96, (20,), generator=torch.Generator().manual_seed(0))

    def run(model):
        cache = model.new_cache(8, 4)
        cache.add_sequence(0)
        with torch.no_grad():
            return model(tokens, cache.prepare([0], [20]), cache)[0]

    want = run(base)
    for change in ("sinks", "window", "limit"):
        model = load_target(path)
        for layer in model.model.layers:
            if change == "sinks":
                layer.self_attn.sinks.fill_(-1e4)  # exp(-1e4) = 0: plain softmax
            elif change == "window":
                layer.window = None
            else:
                layer.mlp.experts.limit = 1e4
        assert (run(model) - want).abs().max() > 1e-3, change


def _hf_greedy(target_dir, prompts, max_new) -> list[list[int]]:
    hf = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return [hf.generate(torch.tensor([p]), max_new_tokens=max_new, do_sample=False, eos_token_id=None, pad_token_id=0)[0, len(p):].tolist()
                for p in prompts]


@pytest.fixture(scope="module")
def lossless_setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt_oss")
    target_dir = write_gpt_oss(root / "target", seed=5)
    drafter_dir = write_drafter(root / "drafter", target_dir, num_layers=2, block_size=16, seed=6, target_layer_ids=[1, 2])
    rng = random.Random(0)
    prompts = [[rng.randrange(5, 96) for _ in range(rng.randrange(3, 21))] for _ in range(6)]
    return target_dir, drafter_dir, prompts, _hf_greedy(target_dir, prompts, 24), load_target(target_dir)


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("block", [4, 16])
@pytest.mark.parametrize("drafts", ["random-drafter", "oracle"])
def test_speculative_greedy_equals_transformers_greedy_on_gpt_oss(lossless_setup, batch, block, drafts):
    """24 new tokens past prompts of 3..20: every sliding window moves, also across rolled-back blocks.
    The random drafter rejects almost everything; the oracle (the real drafter runs, then the true
    continuation is proposed, corrupted at a random point) drives long acceptances and partial rollbacks."""
    from dflash_trt.loading import load_drafter

    target_dir, drafter_dir, prompts, refs, target = lossless_setup
    backend = TorchBackend(target, load_drafter(drafter_dir, target.cfg), num_pages=256, page_size=4, block_size=block)
    if drafts == "oracle":
        backend = OracleDrafts(backend, prompts, refs, seed=block + batch)
    outs = Generator(backend, max_batch=batch).generate(prompts, SamplingParams(max_new_tokens=24))
    assert [o.output_ids for o in outs] == refs
    if drafts == "oracle":
        assert max(n for o in outs for n in o.accepted_lengths) >= block - 1
    assert backend.target_cache.num_free_pages == backend.target_cache.num_pages
    assert backend.drafter_cache.num_free_pages == backend.drafter_cache.num_pages


@pytest.mark.parametrize("quant", ["fp8", "nvfp4"])
def test_gpt_oss_quantized_hf_export_loads_like_trtllm_and_runs_lossless(lossless_setup, tmp_path, quant):
    """--format hf keeps the experts fused (ModelOpt's layout; tests/test_convert_modelopt.py checks its bytes against
    ModelOpt's own export), --format trtllm splits them into TensorRT-LLM's fc / proj rows: from the same calibration
    both read back to the very same dequantized weights (one scale per stack in both; FP8's q/k/v aside: TensorRT-LLM's
    fused qkv holds one weight scale, ModelOpt's HF export one per projection), and DFlash on the HF export decodes what
    plain decoding of it does."""
    from dflash_trt.loading import load_drafter, load_torch_backend
    from dflash_trt.quant.calibrate import calibrate

    target_dir, drafter_dir, prompts, _, _ = lossless_setup
    amax = calibrate(load_torch_backend(target_dir, drafter_dir), prompts[:2], max_new_tokens=4, progress=False)
    for fmt in ("trtllm", "hf"):
        convert(target_dir, drafter_dir, tmp_path / fmt, dtype="fp32", quant=quant, fmt=fmt, amax=amax, **QUIET)
    a, b = load_target(tmp_path / "trtllm" / "target"), load_target(tmp_path / "hf" / "target")
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        if not (quant == "fp8" and k.endswith(("q_proj.weight", "k_proj.weight", "v_proj.weight"))):
            assert torch.equal(sa[k], sb[k]), k
    assert not torch.equal(sb["model.layers.0.mlp.experts.gate_up_proj"], load_target(target_dir).state_dict()["model.layers.0.mlp.experts.gate_up_proj"])
    params = SamplingParams(max_new_tokens=16)
    plain = Generator(TorchBackend(b, None, num_pages=128, page_size=4), max_batch=3).generate(prompts[:3], params)
    spec = Generator(TorchBackend(b, load_drafter(tmp_path / "hf" / "drafter", b.cfg), num_pages=128, page_size=4, block_size=8),
                     max_batch=3).generate(prompts[:3], params)
    assert [o.output_ids for o in spec] == [o.output_ids for o in plain]


def test_gpt_oss_unsupported_paths_fail_with_config_errors(tmp_path, lossless_setup):
    target_dir, drafter_dir, _, _, target = lossless_setup
    odd = write_gpt_oss(tmp_path / "odd", seed=2, intermediate_size=40)  # down_proj's 40 inputs: not whole NVFP4 blocks
    with pytest.raises(ConfigError, match="multiple of 16") as e:
        convert(odd, None, tmp_path / "out", fmt="hf", quant="nvfp4", amax={"target": {}, "drafter": {}}, **QUIET)
    assert e.value.key == "intermediate_size" and not (tmp_path / "out").exists()
    raw = json.loads((target_dir / "config.json").read_text())
    quantized = tmp_path / "mxfp4"
    quantized.mkdir()
    (quantized / "config.json").write_text(json.dumps({**raw, "quantization_config": {"quant_method": "gptq"}}))
    with pytest.raises(ConfigError, match="gptq") as e:
        load_target_config(quantized)
    assert e.value.key == "quantization_config"


# ------------------------------------------------------------------------------------------------------------------
# Conversion (issue 19 item 2): TensorRT-LLM checkpoints on TensorRT-LLM's MoE names, read back by the runtime

QUIET = dict(progress=False, log=lambda *_: None)


def _quantized_like_the_converter(w: torch.Tensor, quant: str, columns: slice | None = None, width: int | None = None) -> torch.Tensor:
    """w [E, in, out] (the module's experts) through FP8 / NVFP4 with one scale for the whole stack, computed here on
    the output-major rows directly (no fc / proj layout, no interleave): the independent reference. `columns`: keep only
    these inputs, zero-padded to `width` before quantizing (a rank's slice of a row-parallel stack), padding dropped."""
    from dflash_trt.quant import dequantize_fp8, dequantize_nvfp4, fp8_scale, nvfp4_global_scale, quantize_fp8, quantize_nvfp4

    E, n_in, n_out = w.shape
    rows = w.transpose(1, 2).reshape(E * n_out, n_in)
    amax = float(rows.abs().max())
    if columns is not None:
        rows = torch.nn.functional.pad(rows[:, columns], (0, width - (columns.stop - columns.start)))
    if quant == "fp8":
        scale = fp8_scale(amax)
        back = dequantize_fp8(quantize_fp8(rows, scale), scale, torch.float32)
    elif quant == "nvfp4":
        gs = nvfp4_global_scale(amax)
        back = dequantize_nvfp4(*quantize_nvfp4(rows, gs), gs, torch.float32)
    else:
        back = rows
    if columns is not None:
        back = back[:, : columns.stop - columns.start]
    return back.reshape(E, n_out, -1).transpose(1, 2)


@pytest.mark.parametrize("quant,intermediate", [("none", 48), ("fp8", 64), ("nvfp4", 48)])
def test_gpt_oss_converts_to_trtllm_moe_layout_and_reads_back(lossless_setup, tmp_path, quant, intermediate):
    """tp 2: every expert's rows land where TensorRT-LLM's MoE layer reads them (fc = [up; gate] per expert, 3-D
    stacks), and the runtime reads the checkpoint back to the module's weights: exactly (none), or equal to the
    dequantized FP8 / NVFP4 of the same weights computed independently. I = 48 gives each rank 24 real columns
    padded to 32 (whole NVFP4 blocks per rank, shard_rules.expert_width): the padding is stored as zeros."""
    from safetensors import safe_open

    from dflash_trt.checkpoint_formats import read_rank

    _, _, prompts, _, _ = lossless_setup
    target_dir = write_gpt_oss(tmp_path / "target", seed=8, intermediate_size=intermediate)
    drafter_dir = write_drafter(tmp_path / "drafter", target_dir, num_layers=1, block_size=8, seed=9, target_layer_ids=[2])
    target = load_target(target_dir)
    out = tmp_path / "out"
    convert(target_dir, drafter_dir, out, dtype="fp32", quant=quant, tp=2, calib_prompts=prompts[:2], calib_max_new_tokens=4, **QUIET)
    raw = json.loads((out / "target" / "config.json").read_text())
    assert raw["architecture"] == "GptOssForCausalLM" and raw["moe"] == {"num_experts": 4, "top_k": 2}
    assert raw["layer_types"] == list(target.cfg.layer_types) and raw["rotary_scaling"]["type"] == "yarn"
    cfg = target.cfg
    E, I, H = cfg.num_experts, cfg.intermediate_size, cfg.hidden_size
    n, W = I // 2, 32  # real and padded columns per rank
    with safe_open(out / "target" / "rank1.safetensors", "pt") as f:
        shapes = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
        stored_fc = f.get_tensor("transformer.layers.0.mlp.fc.weight")
        stored_proj = f.get_tensor("transformer.layers.0.mlp.proj.weight")
    packed = 2 if quant == "nvfp4" else 1
    assert shapes["transformer.layers.0.mlp.fc.weight"] == (E, 2 * W, H // packed)
    assert shapes["transformer.layers.0.mlp.proj.weight"] == (E, H, W // packed)
    assert shapes["transformer.layers.0.mlp.router.weight"] == (E, H) and shapes["transformer.layers.0.attention.sinks"] == (cfg.num_heads // 2,)
    if quant == "fp8":  # per expert, as TensorRT-LLM's MoE layer holds it (MOEWeightWrapper)
        assert shapes["transformer.layers.0.mlp.fc.weights_scaling_factor"] == (E, 1)
    zero = torch.zeros((), dtype=stored_fc.dtype)
    assert (stored_fc[:, n:W] == zero).all() and (stored_fc[:, W + n :] == zero).all() and (stored_proj[:, :, n // packed :] == zero).all()
    full = target.state_dict()
    if quant == "none":  # rank 1's fc rows of expert 3: up then gate, the second half of I, from the interleaved HF tensor
        gate_up = full["model.layers.0.mlp.experts.gate_up_proj"][3]  # [H, 2I]: gate = even columns
        assert torch.equal(stored_fc[3, :n], gate_up[:, 1::2][:, n:].T)
        assert torch.equal(stored_fc[3, W : W + n], gate_up[:, 0::2][:, n:].T)
    parts = [read_rank(out / "target", r, torch.float32)[1] for r in range(2)]
    for layer in range(cfg.num_layers):
        x = f"model.layers.{layer}.mlp.experts"
        gate_up = _quantized_like_the_converter(full[f"{x}.gate_up_proj"], quant)
        # rank r holds gate/up column pairs [r·n, (r+1)·n) and down rows likewise; biases and router as they are
        for r, part in enumerate(parts):
            cols = slice(r * n, (r + 1) * n)
            assert torch.equal(part[f"{x}.gate_up_proj"], gate_up.view(E, H, I, 2)[:, :, cols].reshape(E, H, 2 * n)), (layer, r)
            down = _quantized_like_the_converter(full[f"{x}.down_proj"], quant, cols, W)
            assert torch.equal(part[f"{x}.down_proj"], down), (layer, r)
            assert torch.equal(part[f"{x}.down_proj_bias"], full[f"{x}.down_proj_bias"])
            bias = full[f"{x}.gate_up_proj_bias"].view(E, I, 2)[:, cols].reshape(E, 2 * n)
            assert torch.equal(part[f"{x}.gate_up_proj_bias"], bias)
            assert torch.equal(part[f"model.layers.{layer}.mlp.router.weight"], full[f"model.layers.{layer}.mlp.router.weight"])
            heads = cfg.num_heads // 2
            assert torch.equal(part[f"model.layers.{layer}.self_attn.sinks"], full[f"model.layers.{layer}.self_attn.sinks"][r * heads : (r + 1) * heads])


@pytest.mark.parametrize("fmt", ["trtllm", "engine", "hf"])
def test_a_converted_gpt_oss_runs_lossless_and_equals_transformers(lossless_setup, tmp_path, fmt):
    """fp32, tp 1: the converted target (and the drafter) read back to exactly the source weights, and the DFlash loop on
    the converted checkpoint emits transformers' greedy tokens."""
    from dflash_trt.loading import checkpoint_parts, load_torch_backend

    target_dir, drafter_dir, prompts, refs, target = lossless_setup
    out = tmp_path / fmt
    convert(target_dir, drafter_dir, out, dtype="fp32", fmt=fmt, **QUIET)
    backend = load_torch_backend(*checkpoint_parts(out), block_size=8)
    for (name, a), b in zip(backend.target.state_dict().items(), target.state_dict().values()):
        assert torch.equal(a, b), name
    outs = Generator(backend, max_batch=3).generate(prompts, SamplingParams(max_new_tokens=24))
    assert [o.output_ids for o in outs] == refs


def test_bench_on_a_random_gpt_oss_reports_dflash_equal_to_plain_decoding(tmp_path):
    """`dflash-trt bench` end to end on a gpt-oss pair (correctness only: random weights, fp32): every DFlash output
    equals AR's, with the same token counts (issue 19 item 5)."""
    from conftest import write_tokenizer

    from dflash_trt.cli import main

    target_dir = write_gpt_oss(tmp_path / "target", seed=11)
    write_tokenizer(target_dir, TINY_GPT_OSS["vocab_size"])
    drafter_dir = write_drafter(tmp_path / "drafter", target_dir, num_layers=1, block_size=6, seed=12, target_layer_ids=[2])
    out = tmp_path / "bench"
    assert main(["bench", "--target", str(target_dir), "--drafter", str(drafter_dir), "--domains", "code,math", "--num-prompts", "2",
                 "--max-new-tokens", "12", "--concurrency", "", "--draft-length", "fixed", "--threads", "1", "--out", str(out), "--quiet"]) == 0
    results = json.loads((out / "bench.json").read_text())
    for domain in ("code", "math"):
        row = results["domains"][domain]
        assert row["dflash"]["equal_to_ar"] == row["dflash"]["requests"] == 2
        assert row["dflash"]["output_tokens"] == row["ar"]["output_tokens"]
