"""`dflash-trt build --config FILE [--dry-run]`: one deployment YAML → convert + trtllm-build, end to end.

A build config (build_configs/*.yaml) names the target, the DFlash drafter and everything the build
needs, with keys as TensorRT-LLM spells them: `speculative_config` as in trtllm-serve's config
(decoding_type: DFlash, max_draft_len, speculative_model), `build` as trtllm-build's flags (without
the leading dashes). It is validated before anything runs: an error names the file and the key and
exits 2. `--dry-run` prints the commands; a real run refuses until the one-engine build exists
(docs/engine-path.md, Status).
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from ..config import TARGET_ARCHITECTURES
from ..errors import ConfigError, DFlashError

QUANTS = ("none", "fp8", "nvfp4")
DTYPES = ("bf16", "fp16")
TP_SIZES = (1, 2, 4, 8)
# trtllm-build flags we set ourselves (from the rest of the config): not allowed under `build`.
OWN_FLAGS = {"checkpoint_dir", "model_config", "build_config", "output_dir", "speculative_decoding_mode", "max_draft_len",
             "model_cls_file", "model_cls_name", "gather_context_logits", "gather_all_token_logits"}
TOP_KEYS = {"name", "description", "gpus", "target", "speculative_config", "convert", "build", "output_dir"}


def trtllm_build_flags() -> list[str]:
    from . import api

    return list(api.snapshot()["trtllm_build_flags"]["flags"])


@dataclass(frozen=True)
class BuildConfig:
    path: Path
    name: str
    target_model: str
    target_architecture: str
    drafter_model: str
    max_draft_len: int
    dtype: str
    quant: str
    kv_cache_quant: str
    tp: int
    build_flags: dict[str, Any]
    output_dir: str


def _get(raw: dict, key: str, path: Path, kind: type | tuple, default: Any = ...):
    node: Any = raw
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            if default is not ...:
                return default
            raise ConfigError("required key is missing", file=path, key=key)
        node = node[part]
    if not isinstance(node, kind) or (isinstance(node, bool) and kind is int):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise ConfigError(f"expected {names}, got {type(node).__name__} {node!r}", file=path, key=key)
    return node


def _one_of(value: Any, allowed, path: Path, key: str):
    if value not in allowed:
        raise ConfigError(f"{value!r} is not one of {list(allowed)}", file=path, key=key)
    return value


def load_build_config(path: str | Path) -> BuildConfig:
    path = Path(path)
    try:
        import yaml
    except ImportError:
        raise ConfigError("reading a build config needs PyYAML, which is not installed (pip install pyyaml)", file=path) from None
    if not path.is_file():
        raise ConfigError("build config does not exist", file=path)
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as e:
        raise ConfigError(f"not valid YAML ({str(e).splitlines()[0]})", file=path) from None
    if not isinstance(raw, dict):
        raise ConfigError("expected a mapping at the top level", file=path)
    for key in raw:
        if key not in TOP_KEYS:
            raise ConfigError(f"unknown key (expected some of {sorted(TOP_KEYS)})", file=path, key=str(key))
    spec = "speculative_config"
    _one_of(_get(raw, f"{spec}.decoding_type", path, str), ["DFlash"], path, f"{spec}.decoding_type")
    max_draft_len = _get(raw, f"{spec}.max_draft_len", path, int)
    if not 1 <= max_draft_len <= 63:
        raise ConfigError(f"must be in [1, 63] (drafter block_size - 1 at most), got {max_draft_len}", file=path, key=f"{spec}.max_draft_len")
    for key in _get(raw, spec, path, dict):
        _one_of(key, ["decoding_type", "max_draft_len", "speculative_model", "mask_token_id", "target_layer_ids"], path, f"{spec}.{key}")
    build = _get(raw, "build", path, dict, {})
    allowed = {f.lstrip("-") for f in trtllm_build_flags()} - OWN_FLAGS
    for key, value in build.items():
        if key not in allowed:
            raise ConfigError(f"not a trtllm-build flag we pass through (allowed: {sorted(allowed)})", file=path, key=f"build.{key}")
        if not isinstance(value, (int, str, bool)) or value is None:
            raise ConfigError(f"expected a number, string or boolean, got {value!r}", file=path, key=f"build.{key}")
    return BuildConfig(
        path=path,
        name=_get(raw, "name", path, str),
        target_model=_get(raw, "target.model", path, str),
        target_architecture=_one_of(_get(raw, "target.architecture", path, str), TARGET_ARCHITECTURES, path, "target.architecture"),
        drafter_model=_get(raw, f"{spec}.speculative_model", path, str),
        max_draft_len=max_draft_len,
        dtype=_one_of(_get(raw, "convert.dtype", path, str, "bf16"), DTYPES, path, "convert.dtype"),
        quant=_one_of(_get(raw, "convert.quant", path, str, "none"), QUANTS, path, "convert.quant"),
        kv_cache_quant=_one_of(_get(raw, "convert.kv_cache_quant", path, str, "none"), ("none", "fp8"), path, "convert.kv_cache_quant"),
        tp=_one_of(_get(raw, "convert.tp", path, int, 1), TP_SIZES, path, "convert.tp"),
        build_flags=dict(build),
        output_dir=_get(raw, "output_dir", path, str, f"engines/{raw.get('name', path.stem)}"),
    )


def _flag_args(flags: dict[str, Any]) -> list[str]:
    args: list[str] = []
    for key, value in flags.items():
        if value is True:
            args.append(f"--{key}")
        elif value is not False:
            args += [f"--{key}", str(value)]
    return args


def build_commands(cfg: BuildConfig, out: str | None = None, plugin_lib: str | None = None) -> list[list[str]]:
    """convert to the one-engine checkpoint, then trtllm-build (through our registering wrapper) of the one
    engine on EAGLE's contract: `--speculative_decoding_mode eagle`, `--max_draft_len K` (docs/engine-path.md)."""
    root = Path(out or cfg.output_dir)
    ckpt, engine = root / "checkpoint", root / "engine"
    convert = [
        "dflash-trt", "convert", "--target", cfg.target_model, "--drafter", cfg.drafter_model, "--out", str(ckpt), "--format", "engine",
        "--dtype", cfg.dtype, "--quant", cfg.quant, "--kv-cache-quant", cfg.kv_cache_quant, "--tp", str(cfg.tp), "--force",
    ]
    build = [sys.executable, "-m", "dflash_trt.trtllm.engine_build"]
    if plugin_lib:
        build += ["--dflash_plugin_lib", plugin_lib]
    build += [
        "--checkpoint_dir", str(ckpt), "--output_dir", str(engine),
        "--speculative_decoding_mode", "eagle", "--max_draft_len", str(cfg.max_draft_len), *_flag_args(cfg.build_flags),
    ]
    return [convert, build]


class EngineBuildUnavailable(DFlashError):
    """A deployment the one-engine network (DFlashForCausalLM on the EAGLE contract) does not wire."""


# Targets whose decoder DFlashForCausalLM builds on (engine_network.py subclasses LLaMAForCausalLM; Qwen3's per-head
# q/k norms and gpt-oss's MoE layers are not wired there yet)
WIRED_TARGETS = ("LlamaForCausalLM",)


def check_models(cfg: BuildConfig) -> list[str]:
    """What the dry run can check before anything is converted: when the deployment's model directories hold their
    config.json, everything the converter checks from configs alone (convert.check_conversion: pair, tp, NVFP4 widths,
    one KV pool), that the target is the architecture the config names, and max_draft_len = the drafter's
    block_size - 1. Returns the lines to print; raises ConfigError (naming the build config's key) on a mismatch."""
    from ..convert import check_conversion

    missing = [d for d in (cfg.target_model, cfg.drafter_model) if not (Path(d) / "config.json").is_file()]
    if missing:
        return [f"# not checked against the models: no config.json in {', '.join(missing)}"]
    t_cfg, d_cfg = check_conversion(cfg.target_model, cfg.drafter_model, fmt="engine", quant=cfg.quant, tp=cfg.tp)
    if t_cfg.architecture != cfg.target_architecture:
        raise ConfigError(f"{cfg.target_model} is a {t_cfg.architecture}, not a {cfg.target_architecture}", file=cfg.path, key="target.architecture")
    # The one-engine checkpoint always says max_draft_len = num_eagle_layers = block_size - 1 (engine_config_json), and
    # DFlashForCausalLM builds its block and its inputs from that value (engine_network.py prepare_inputs), so a
    # different --max_draft_len for trtllm-build would size the build's profiles for another draft count.
    if cfg.max_draft_len != d_cfg.block_size - 1:
        rel = ">" if cfg.max_draft_len > d_cfg.block_size - 1 else "<"
        raise ConfigError(f"{cfg.max_draft_len} {rel} the drafter's block_size - 1 = {d_cfg.block_size - 1} ({d_cfg.path}): the one "
                          "engine drafts a whole block per step (its checkpoint's max_draft_len)", file=cfg.path,
                          key="speculative_config.max_draft_len")
    return [f"# checked against {cfg.target_model} and {cfg.drafter_model}: {t_cfg.architecture}, tp {cfg.tp}, {cfg.quant}, "
            f"one KV pool of {t_cfg.num_layers} + {d_cfg.num_layers} layers, {cfg.max_draft_len} drafts per step"]


def cmd_build(args) -> int:
    cfg = load_build_config(args.config)
    cfg = replace(cfg, target_model=args.target_dir or cfg.target_model, drafter_model=args.drafter_dir or cfg.drafter_model)
    commands = build_commands(cfg, args.out, args.plugin_lib)
    checked = check_models(cfg)
    if not args.dry_run:
        if cfg.target_architecture not in WIRED_TARGETS:
            raise EngineBuildUnavailable(
                f"DFlashForCausalLM (trtllm/engine_network.py) wires {', '.join(WIRED_TARGETS)} targets only, not {cfg.target_architecture} "
                "(docs/engine-path.md: Status). --dry-run prints the commands"
            )
        from . import api

        api.require_tensorrt_llm()  # before anything runs: the engine path needs TensorRT-LLM 1.2.x (docker/)
    print("# the one-engine build (docs/engine-path.md); its flags are checked against trtllm-build's; DFlashForCausalLM is "
          "trtllm/engine_network.py", flush=True)
    for line in checked:
        print(line, flush=True)
    for command in commands:
        print("+ " + shlex.join(command), flush=True)
        if not args.dry_run:
            subprocess.run(command, check=True)
    return 0


def register_cli(sub) -> None:
    from ..flags import HELP_FORMAT

    b = sub.add_parser("build", formatter_class=HELP_FORMAT, help="convert + trtllm-build a deployment from a build config (build_configs/*.yaml)")
    b.add_argument("--config", required=True, help="build config YAML")
    b.add_argument("--out", help="output root (default: the config's output_dir): checkpoint/ and engine/")
    b.add_argument("--target-dir", help="the target's directory, instead of the config's target.model")
    b.add_argument("--drafter-dir", help="the drafter's directory, instead of the config's speculative_config.speculative_model")
    b.add_argument("--plugin-lib", help="libdflash_plugins.so, registered in trtllm-build (engine_build --dflash_plugin_lib) before the one engine is built")
    b.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    b.set_defaults(func=cmd_build)
