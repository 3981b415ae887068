"""gpt-oss in its released layout (issue 19 item 1): MXFP4 experts (`*_blocks` + `*_scales`) dequantized as the OCP
MX format defines them, checked against a per-element reading of the spec and against transformers (its own MXFP4
dequantization, and its GptOssForCausalLM loading the same checkpoint); the DFlash loop lossless on it."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
import transformers
from conftest import assert_equals_transformers, write_drafter
from safetensors.torch import load_file, save_file
from test_gpt_oss import write_gpt_oss

from dflash_trt.errors import CheckpointError
from dflash_trt.loading import load_drafter, load_target
from dflash_trt.quant.mxfp4 import dequantize_mxfp4
from dflash_trt.runtime import Generator
from dflash_trt.sampling import SamplingParams
from dflash_trt.torch_backend import TorchBackend

RELEASED_QUANT_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}


def e2m1_by_the_spec(code: int) -> float:
    """OCP MX v1.0 FP4 (E2M1): sign bit 3, exponent bits 2..1 (bias 1), mantissa bit 0; exponent 0 is subnormal."""
    sign, exponent, mantissa = code >> 3, (code >> 1) & 3, code & 1
    value = mantissa * 0.5 if exponent == 0 else 2.0 ** (exponent - 1) * (1 + mantissa / 2)
    return -value if sign else value


def test_dequantize_mxfp4_is_the_spec_and_transformers_dequantization():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 5, 2, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(100, 150, (3, 5, 2), dtype=torch.uint8, generator=g)
    ours = dequantize_mxfp4(blocks, scales)
    naive = torch.empty(3, 5, 64)
    for e in range(3):
        for r in range(5):
            for grp in range(2):
                for i in range(16):  # byte i holds element 2i in its low nibble, 2i + 1 in its high nibble
                    byte, scale = int(blocks[e, r, grp, i]), 2.0 ** (int(scales[e, r, grp]) - 127)
                    naive[e, r, grp * 32 + 2 * i] = e2m1_by_the_spec(byte & 0xF) * scale
                    naive[e, r, grp * 32 + 2 * i + 1] = e2m1_by_the_spec(byte >> 4) * scale
    assert torch.equal(ours, naive)
    assert torch.equal(ours.transpose(1, 2), convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.bfloat16).float(), ours)  # exact in bf16 too
    with pytest.raises(ValueError, match="NaN"):
        dequantize_mxfp4(blocks, torch.full_like(scales, 255))


def write_released_layout(root, seed: int = 3):
    """A random gpt-oss in the released layout (experts as MXFP4 blocks + scales, config with quantization_config),
    and its twin with the same experts dequantized (plain fp32 tensors, no quantization_config)."""
    twin = write_gpt_oss(root / "dequantized", seed=seed, intermediate_size=64)  # MX blocks of 32 divide every width
    file = next(twin.glob("*.safetensors"))
    tensors = load_file(str(file))
    g = torch.Generator().manual_seed(seed)
    packed = {}
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        experts, cols, rows = tensors[name].shape  # the module's [E, in, out]; stored as [E, out, in / 32, 16]
        blocks = torch.randint(0, 256, (experts, rows, cols // 32, 16), dtype=torch.uint8, generator=g)
        scales = torch.randint(118, 124, (experts, rows, cols // 32), dtype=torch.uint8, generator=g)
        packed[name + "_blocks"], packed[name + "_scales"] = blocks, scales
        tensors[name] = dequantize_mxfp4(blocks, scales).transpose(1, 2).contiguous()
    save_file(tensors, str(file), metadata={"format": "pt"})
    released = root / "released"
    shutil.copytree(twin, released)
    save_file({n: t for n, t in tensors.items() if n + "_blocks" not in packed} | packed, str(released / file.name),
              metadata={"format": "pt"})
    config = json.loads((released / "config.json").read_text())
    (released / "config.json").write_text(json.dumps({**config, "quantization_config": RELEASED_QUANT_CONFIG}))
    return released, twin


def test_released_mxfp4_gpt_oss_equals_transformers_loading_it(tmp_path):
    released, twin = write_released_layout(tmp_path)
    stored = load_file(str(next(released.glob("*.safetensors"))))
    assert stored["model.layers.0.mlp.experts.gate_up_proj_blocks"].dtype == torch.uint8 and "model.layers.0.mlp.experts.gate_up_proj" not in stored
    hf = transformers.AutoModelForCausalLM.from_pretrained(released, dtype=torch.float32,
                                                           quantization_config=transformers.Mxfp4Config(dequantize=True)).eval()
    ours = load_target(released)
    gen = torch.Generator().manual_seed(0)
    seqs = [torch.randint(0, 96, (n,), generator=gen) for n in (7, 23, 14)]
    assert_equals_transformers(hf, ours, seqs, cuts=[3, 13, 12], capture=(0, 1, 3))
    twin_model = load_target(twin)
    for (name, a), b in zip(ours.state_dict().items(), twin_model.state_dict().values()):
        assert torch.equal(a, b), name


def test_the_dflash_loop_is_lossless_on_a_released_layout_target(tmp_path):
    released, twin = write_released_layout(tmp_path, seed=5)
    drafter_dir = write_drafter(tmp_path / "drafter", twin, num_layers=2, block_size=8, seed=6, target_layer_ids=[1, 2])
    rng = random.Random(0)
    prompts = [[rng.randrange(5, 96) for _ in range(rng.randrange(3, 15))] for _ in range(3)]
    target = load_target(released)
    params = SamplingParams(max_new_tokens=16)
    plain = Generator(TorchBackend(target, None, num_pages=128, page_size=4), max_batch=3).generate(prompts, params)
    spec = Generator(TorchBackend(target, load_drafter(drafter_dir, target.cfg), num_pages=128, page_size=4), max_batch=3).generate(prompts, params)
    assert [o.output_ids for o in spec] == [o.output_ids for o in plain]


@pytest.mark.parametrize("damage", ["scales_missing", "blocks_missing", "shape_mismatch", "nan_scale"])
def test_a_damaged_mxfp4_pair_is_one_checkpoint_error_naming_the_tensor(tmp_path, damage):
    released, _ = write_released_layout(tmp_path)
    file = next(released.glob("*.safetensors"))
    tensors = load_file(str(file))
    name = "model.layers.1.mlp.experts.down_proj"
    if damage == "scales_missing":
        del tensors[name + "_scales"]
    elif damage == "blocks_missing":
        del tensors[name + "_blocks"]
    elif damage == "shape_mismatch":
        tensors[name + "_scales"] = tensors[name + "_scales"][:, :-1].contiguous()
    else:
        tensors[name + "_scales"] = torch.full_like(tensors[name + "_scales"], 255)
    save_file(tensors, str(file), metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as e:
        load_target(released)
    assert e.value.key.startswith(name) and str(file.name) in str(e.value)


@pytest.mark.parametrize("quant", ["none", "nvfp4"])
def test_a_released_layout_target_converts_and_its_nvfp4_experts_are_modelopts_mxfp4_cast(tmp_path, quant):
    """MXFP4 in, TensorRT-LLM out (issue 19 item 2). none: the checkpoint reads back to the dequantized twin exactly.
    nvfp4: each layer's experts are byte for byte what ModelOpt's `quantize_mxfp4_to_nvfp4` makes of the released
    blocks + scales (global scale from the tensor's amax, FP8 block scales, packed E2M1), rows in TensorRT-LLM's fc
    order (per expert: up rows, then gate rows; the released rows interleave gate, up)."""
    from safetensors import safe_open

    from dflash_trt.checkpoint_formats import read_rank
    from dflash_trt.convert import convert

    export = pytest.importorskip("modelopt.torch.export.shard_cast_utils")
    released, twin = write_released_layout(tmp_path, seed=7)
    drafter_dir = write_drafter(tmp_path / "drafter", twin, num_layers=1, block_size=8, seed=8, target_layer_ids=[2])
    out = tmp_path / "out"
    convert(released, drafter_dir, out, dtype="fp32", quant=quant, calib_prompts=[[5, 9, 14, 3, 77, 41]], calib_max_new_tokens=4,
            progress=False, log=lambda *_: None)
    if quant == "none":
        got = read_rank(out / "target", 0, torch.float32)[1]
        for name, want in load_target(twin).state_dict().items():
            assert torch.equal(got[name], want), name
        return
    stored = load_file(str(next(released.glob("*.safetensors"))))
    with safe_open(out / "target" / "rank0.safetensors", "pt") as f:
        for layer in range(4):
            for ours, theirs in (("fc", "gate_up_proj"), ("proj", "down_proj")):
                x = f"model.layers.{layer}.mlp.experts.{theirs}"
                blocks = stored[x + "_blocks"].flatten(-2)  # ModelOpt takes the bytes of a row as one axis
                packed, block, scale_2, _ = export.quantize_mxfp4_to_nvfp4(blocks, stored[x + "_scales"], None, "cpu")
                block = block.view(torch.uint8)
                if ours == "fc":  # released rows: gate, up, gate, up ...; TensorRT-LLM's fc: up rows, then gate rows
                    packed, block = (torch.cat([t[:, 1::2], t[:, 0::2]], dim=1) for t in (packed, block))
                o = f"transformer.layers.{layer}.mlp.{ours}"
                assert torch.equal(f.get_tensor(o + ".weight"), packed.view(torch.uint8)), o
                assert torch.equal(f.get_tensor(o + ".weights_scaling_factor").view(torch.uint8), block), o
                assert torch.equal(f.get_tensor(o + ".weights_scaling_factor_2").reshape(()), scale_2.float().reshape(())), o


@pytest.mark.parametrize("quant", ["fp8", "nvfp4"])
def test_a_released_layout_target_exports_to_modelopts_quantized_hf_and_reads_back(tmp_path, quant):
    """MXFP4 in, ModelOpt's unified HF format out (`--format hf`, issue 19 item 2): the experts stay fused and
    input-major as ModelOpt keeps them. nvfp4: each stack is byte for byte ModelOpt's `quantize_mxfp4_to_nvfp4` of the
    released blocks + scales, stored [E, in/2, out] (its transpose); fp8: e4m3 of the dequantized stack over one scale
    amax/448. The released `quantization_config` (mxfp4) is replaced by ModelOpt's, the routers are excluded, and
    the runtime reads the export back to the stacks dequantized by the formats' definitions."""
    from dflash_trt.convert import convert
    from dflash_trt.quant import dequantize_fp8, dequantize_nvfp4

    export = pytest.importorskip("modelopt.torch.export.shard_cast_utils")
    released, twin = write_released_layout(tmp_path, seed=11)
    out = tmp_path / "out"
    convert(released, None, out, dtype="bf16", quant=quant, fmt="hf", calib_prompts=[[5, 9, 14, 3, 77, 41]], calib_max_new_tokens=4,
            progress=False, log=lambda *_: None)
    config = json.loads((out / "target" / "config.json").read_text())
    assert config["quantization_config"]["quant_method"] == "modelopt"
    hf_quant = json.loads((out / "target" / "hf_quant_config.json").read_text())["quantization"]
    assert hf_quant["exclude_modules"] == ["lm_head", "model.embed_tokens"] + [f"model.layers.{i}.mlp.router" for i in range(4)]
    ours = load_file(str(out / "target" / "model.safetensors"))
    stored = load_file(str(next(released.glob("*.safetensors"))))
    twin_state = load_target(twin).state_dict()
    back = load_target(out / "target", dtype=torch.float32).state_dict()
    for layer in range(4):
        for t in ("gate_up_proj", "down_proj"):
            x = f"model.layers.{layer}.mlp.experts.{t}"
            assert x + "_blocks" not in ours and ours[x + "_bias"].dtype == torch.bfloat16
            w = twin_state[x]  # [E, in, out], the released stack dequantized
            if quant == "nvfp4":
                packed, block, scale_2, _ = export.quantize_mxfp4_to_nvfp4(stored[x + "_blocks"].flatten(-2), stored[x + "_scales"], None, "cpu")
                assert torch.equal(ours[x], packed.view(torch.uint8).transpose(1, 2)), x
                assert torch.equal(ours[x + "_weight_scale"].view(torch.uint8), block.view(torch.uint8).transpose(1, 2)), x
                assert torch.equal(ours[x + "_weight_scale_2"], scale_2.float().reshape(())), x
                want = dequantize_nvfp4(packed.view(torch.uint8), block, scale_2.float().reshape(())).transpose(1, 2)
            else:
                scale = w.abs().max() / 448
                assert torch.equal(ours[x + "_weight_scale"], scale.reshape(())), x
                q = (w / scale).clamp(-448, 448).to(torch.float8_e4m3fn)
                assert torch.equal(ours[x].view(torch.uint8), q.view(torch.uint8)), x
                want = dequantize_fp8(q, scale)
            assert ours[x + "_input_scale"].shape == () and ours[x + "_input_scale"] > 0
            assert torch.equal(back[x], want), x


def test_an_unquantized_hf_export_of_a_released_layout_drops_its_mxfp4_config(tmp_path):
    """`--format hf --quant none` writes the experts dequantized: the released `quantization_config` (mxfp4) must not
    travel with them, or transformers reads the bf16 stacks as MXFP4 blocks. transformers loads the export to the twin."""
    from dflash_trt.convert import convert

    released, twin = write_released_layout(tmp_path, seed=1)
    convert(released, None, tmp_path / "out", dtype="fp32", quant="none", fmt="hf", progress=False, log=lambda *_: None)
    assert "quantization_config" not in json.loads((tmp_path / "out" / "target" / "config.json").read_text())
    ours = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "target", dtype=torch.float32).state_dict()
    want = transformers.AutoModelForCausalLM.from_pretrained(twin, dtype=torch.float32).state_dict()
    assert ours.keys() == want.keys()
    for name in want:
        assert torch.equal(ours[name], want[name]), name
