"""ModelOpt as the format oracle: for the same tiny Llama / Qwen3 target, our TensorRT-LLM checkpoint and
our quantized-HF export must have ModelOpt's tensor names, shapes and dtypes, the same weight bytes and
weight scales, activation / KV scales from the same calibration prompts within bf16 rounding, and its
config keys (nvidia-modelopt's `export_tensorrt_llm_checkpoint` and `export_hf_checkpoint` on CPU)."""

from __future__ import annotations

import copy
import json
import warnings

import pytest
import torch
from safetensors.torch import load_file

from conftest import write_target
from test_gpt_oss import write_gpt_oss
from dflash_trt.convert import convert
from dflash_trt.quant.calibrate import calibrate
from dflash_trt.loading import load_torch_backend

mtq = pytest.importorskip("modelopt.torch.quantization")
export = pytest.importorskip("modelopt.torch.export")

PROMPTS = [[5, 6, 7, 8, 9, 10, 11, 12], [13, 14, 15, 16, 17], [30, 31, 32, 33, 34, 35]]
# Config keys we write with a different value than ModelOpt, on purpose:
#   producer (us), rank (ModelOpt writes the last rank it exported), logits_dtype (fp32: verification
#   compares argmaxes and fp16 logits turn near-ties into flips).
DIFFERENT_ON_PURPOSE = {"producer", "rank", "logits_dtype"}


def _modelopt_export(hf_dir, quant: str, kv: bool, tp: int, out, fmt: str):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16).eval()
    model.config.architectures = [type(model).__name__]
    if quant != "none" or kv:
        base = {"fp8": mtq.FP8_DEFAULT_CFG, "nvfp4": mtq.NVFP4_DEFAULT_CFG, "none": mtq.FP8_DEFAULT_CFG}[quant]
        cfg = copy.deepcopy(base)
        qc = cfg["quant_cfg"]
        if quant == "none":  # KV cache only: disable the weight / input quantizers
            qc = [{"quantizer_name": "*", "enable": False}] if isinstance(qc, list) else {"*": {"enable": False}}
        kvc = mtq.FP8_KV_CFG["quant_cfg"]
        if kv:
            qc = (list(qc) + list(kvc)) if isinstance(qc, list) else {**qc, **kvc}
        cfg["quant_cfg"] = qc

        def forward(m):
            for ids in PROMPTS:
                m(torch.tensor([ids]))

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = mtq.quantize(model, cfg, forward)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if fmt == "trtllm":
            decoder = "qwen" if "Qwen" in model.config.architectures[0] else "llama"
            export.export_tensorrt_llm_checkpoint(model, decoder, torch.bfloat16, out, inference_tensor_parallel=tp)
        else:
            export.export_hf_checkpoint(model, dtype=torch.bfloat16, export_dir=out)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8) if t.dtype.itemsize == 1 else t


def _is_act_scale(name: str) -> bool:
    return name.endswith(("activation_scaling_factor", "input_scale", "k_scale", "v_scale", "cache_scaling_factor"))


@pytest.fixture(scope="module")
def targets(tmp_path_factory):
    root = tmp_path_factory.mktemp("modelopt")
    llama = write_target(root / "llama", hidden_size=64, intermediate_size=128, torch_dtype="bfloat16")
    qwen = write_target(root / "qwen", arch="qwen3", head_dim=16, hidden_size=64, intermediate_size=128)
    gpt_oss = write_gpt_oss(root / "gpt-oss", seed=3)  # experts fused: gate_up_proj [E, H, 2I], down_proj [E, I, H]
    # the weights as bf16 in both pipelines: ModelOpt quantizes what the bf16 model holds
    for d in (llama, qwen, gpt_oss):
        state = load_file(str(d / "model.safetensors"))
        from safetensors.torch import save_file

        save_file({k: v.to(torch.bfloat16) for k, v in state.items()}, str(d / "model.safetensors"))
    return {"llama": llama, "qwen": qwen, "gpt-oss": gpt_oss}


@pytest.mark.parametrize(
    "arch,quant,kv,tp,fmt",
    [
        ("llama", "none", False, 1, "trtllm"),
        ("llama", "fp8", True, 1, "trtllm"),
        ("llama", "nvfp4", True, 1, "trtllm"),
        ("qwen", "fp8", True, 2, "trtllm"),
        ("qwen", "nvfp4", False, 2, "trtllm"),
        ("llama", "fp8", True, 1, "hf"),
        ("llama", "nvfp4", True, 1, "hf"),
        # gpt-oss: the experts as ModelOpt keeps them (one quantizer per stack), routers excluded, sinks untouched
        ("gpt-oss", "fp8", True, 1, "hf"),
        ("gpt-oss", "nvfp4", False, 1, "hf"),
    ],
)
def test_matches_modelopt(targets, tmp_path, arch, quant, kv, tp, fmt):
    hf_dir = targets[arch]
    theirs = tmp_path / "modelopt"
    _modelopt_export(hf_dir, quant, kv, tp, theirs, fmt)
    amax = None
    if quant != "none" or kv:
        # prefill only (max_new_tokens=1): the same forward passes ModelOpt calibrated on, in bf16 like its model
        amax = calibrate(load_torch_backend(hf_dir, None, dtype=torch.bfloat16), PROMPTS, max_new_tokens=1, progress=False)
    ours = tmp_path / "ours"
    convert(hf_dir, None, ours, dtype="bf16", quant=quant, kv_cache_quant="fp8" if kv else "none", tp=tp, fmt=fmt, amax=amax,
            progress=False, log=lambda m: None)

    files = [f"rank{r}.safetensors" for r in range(tp)] if fmt == "trtllm" else ["model.safetensors"]
    for f in files:
        a, b = load_file(str(theirs / f)), load_file(str(ours / "target" / f))
        assert sorted(a) == sorted(b), (set(a) ^ set(b))
        for name in a:
            ta, tb = a[name], b[name]
            assert (tuple(ta.shape), ta.dtype) == (tuple(tb.shape), tb.dtype), name
            if _is_act_scale(name):
                assert torch.allclose(ta.float(), tb.float(), rtol=2e-2), (name, ta, tb)
            else:
                assert torch.equal(_bytes(ta), _bytes(tb)), name

    if fmt == "trtllm":
        a = json.loads((theirs / "config.json").read_text())
        b = json.loads((ours / "target" / "config.json").read_text())
        missing = set(a) - set(b)
        assert not missing, missing
        for key in set(a) - DIFFERENT_ON_PURPOSE:
            assert a[key] == b[key], (key, a[key], b[key])
    else:
        a = json.loads((theirs / "hf_quant_config.json").read_text())["quantization"]
        b = json.loads((ours / "target" / "hf_quant_config.json").read_text())["quantization"]
        assert a == b
        qa = json.loads((theirs / "config.json").read_text())["quantization_config"]
        qb = json.loads((ours / "target" / "config.json").read_text())["quantization_config"]
        assert {k: v for k, v in qa.items() if k != "producer"} == {k: v for k, v in qb.items() if k != "producer"}
