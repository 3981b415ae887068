"""`dflash-trt triton-repo`: a Triton Inference Server model repository for our runtime.

    OUT/<model_name>/config.pbtxt   Python backend, decoupled (streaming) transaction policy
    OUT/<model_name>/1/model.py     a copy of dflash_trt/serve/triton_model.py

Inputs and outputs carry the names users of Triton's TensorRT-LLM backend know from its
`tensorrt_llm_bls` / `ensemble` models (text_input, max_tokens, stop_words, end_id, top_k,
top_p, temperature, random_seed, stream → text_output), so their clients keep working;
`num_input_tokens`, `num_output_tokens` and `dflash_tau` are our additions. The model
parameters name the checkpoint directories as absolute paths (the model loads them at
`initialize`, from inside the Triton container: mount them at the same paths).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

from ..config import load_target_config
from ..errors import ConfigError

# (name, Triton data type, dims, optional); with max_batch_size > 0 Triton prepends the batch dim.
INPUTS = [
    ("text_input", "TYPE_STRING", [1], False),
    ("max_tokens", "TYPE_INT32", [1], False),
    ("stop_words", "TYPE_STRING", [-1], True),
    ("end_id", "TYPE_INT32", [1], True),
    ("top_k", "TYPE_INT32", [1], True),
    ("top_p", "TYPE_FP32", [1], True),
    ("temperature", "TYPE_FP32", [1], True),
    ("random_seed", "TYPE_UINT64", [1], True),
    ("stream", "TYPE_BOOL", [1], True),
]
OUTPUTS = [
    ("text_output", "TYPE_STRING", [-1]),
    ("num_input_tokens", "TYPE_INT32", [1]),
    ("num_output_tokens", "TYPE_INT32", [1]),
    ("dflash_tau", "TYPE_FP32", [1]),
]


def _quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


def config_pbtxt(model_name: str, max_batch: int | None, parameters: dict[str, str], *, backend: str = "python",
                 inputs: list[tuple] = INPUTS, outputs: list[tuple] = OUTPUTS, instance_kind: str | None = "KIND_CPU",
                 decoupled: bool | None = True) -> str:
    """A model's config.pbtxt (protobuf text format of Triton's ModelConfig). Inputs and outputs are (name, data type,
    dims[, optional]); one instance of `instance_kind` (None: Triton's default group). `max_batch` / `decoupled` None:
    not written (a backend that takes them from elsewhere, as the llmapi backend does from its model.yaml)."""

    def tensor(name: str, dtype: str, dims: list[int], optional: bool = False) -> str:
        opt = "\n    optional: true" if optional else ""
        return f"  {{\n    name: {_quote(name)}\n    data_type: {dtype}\n    dims: {list(dims)}{opt}\n  }}"

    lines = [f"name: {_quote(model_name)}", f"backend: {_quote(backend)}"]
    lines += [f"max_batch_size: {max_batch}", ""] if max_batch is not None else [""]
    if decoupled is not None:
        lines += ["model_transaction_policy {", f"  decoupled: {str(decoupled).lower()}", "}", ""]
    for section, specs in (("input", inputs), ("output", outputs)):
        lines += [f"{section} [", ",\n".join(tensor(*spec) for spec in specs), "]"]
    lines.append("")
    if instance_kind is not None:
        # One instance: the engine inside it batches requests continuously (Triton's own batcher stays off).
        lines += ["instance_group [", "  {", "    count: 1", f"    kind: {instance_kind}", "  }", "]", ""]
    for key, value in parameters.items():
        lines.append(f"parameters {{\n  key: {_quote(key)}\n  value: {{ string_value: {_quote(value)} }}\n}}")
    return "\n".join(lines) + "\n"


def write_repository(
    out: str | Path, *, target: str, drafter: str | None, model_name: str = "dflash", tokenizer: str | None = None,
    drafter_type: str = "dflash", block_size: int | None = None, dtype: str = "fp32", max_batch: int = 8,
    max_model_len: int = 2048, kv_pages: int | None = None, page_size: int = 16, default_max_tokens: int = 256,
    max_verify_tokens: int | None = None, force: bool = False,
) -> Path:
    """Write the repository atomically (temp dir, then rename); returns its path."""
    out = Path(out)
    load_target_config(target)  # a wrong target fails here, naming its file, not at Triton start-up
    if drafter is not None and not (Path(drafter) / "config.json").is_file():
        raise ConfigError("drafter directory has no config.json", file=drafter)
    if out.exists() and not force:
        raise ConfigError("output directory exists (pass --force to replace it)", file=out)
    if not model_name or "/" in model_name:
        raise ConfigError(f"not a valid Triton model name: {model_name!r}", key="--model-name")
    params = {
        "target_dir": str(Path(target).resolve()),
        "drafter_dir": str(Path(drafter).resolve()) if drafter else "",
        "tokenizer_dir": str(Path(tokenizer).resolve()) if tokenizer else "",
        "drafter_type": drafter_type,
        "block_size": str(block_size or ""),
        "dtype": dtype,
        "max_batch": str(max_batch),
        "max_model_len": str(max_model_len),
        "kv_pages": str(kv_pages or ""),
        "page_size": str(page_size),
        "default_max_tokens": str(default_max_tokens),
        "max_verify_tokens": str(max_verify_tokens or ""),
        # where dflash_trt can be imported from if it is not installed in Triton's Python
        "python_path": str(Path(__file__).resolve().parents[2]),
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        (tmp / model_name / "1").mkdir(parents=True)
        (tmp / model_name / "config.pbtxt").write_text(config_pbtxt(model_name, max_batch, params))
        shutil.copyfile(Path(__file__).with_name("triton_model.py"), tmp / model_name / "1" / "model.py")
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
