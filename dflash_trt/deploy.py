"""`dflash-trt deploy`: what the serving frameworks that kept DFlash need to serve our checkpoints.

    OUT/README.md                      which route for which TensorRT-LLM version, the commands, what was changed
    OUT/trtllm-pytorch/config.yml      trtllm-serve's YAML: speculative_config {decoding_type: DFlash, ...}
    OUT/trtllm-pytorch/serve.sh        trtllm-serve TARGET --backend pytorch --tp_size N --config config.yml
    OUT/vllm/drafter-speculators/      the drafter in vLLM's speculators format (speculators_format.py)
    OUT/vllm/serve.sh                  vllm serve TARGET --speculative-config '{"method": "dflash", ...}'
    OUT/sglang/serve.sh                python -m sglang.launch_server ... --speculative-algorithm DFLASH ...
    OUT/triton-llmapi/model_repository/tensorrt_llm/{config.pbtxt,1/model.yaml}
                                       TensorRT-LLM's `llmapi` Triton backend (the one upstream kept), and
    OUT/triton-llmapi/serve.sh         which copies that backend's 1/model.py from a TensorRT-LLM source tree
    OUT/drafter-zlab/                  only when needed: the drafter in z-lab's format, full vocabulary

Every key and flag written here is an entry of deploy_snapshot.json: the upstream file, the 1-based line of its
definition, and the commit (TensorRT-LLM, read from its sources) or released wheel (vLLM, SGLang;
scripts/deploy_snapshot.py re-reads them). The engine path (`dflash-trt build`) is TensorRT-LLM <= 1.2.x; these routes
are for the releases after it, which dropped `trtllm-build` (docs/engine-path.md).

Targets are Hugging Face directories, original or `dflash-trt convert --format hf` (ModelOpt's quantized-HF layout,
which the three frameworks read from hf_quant_config.json); TensorRT-LLM checkpoints (rank files) are for the engine
path and are refused here. TensorRT-LLM's DFlash and SGLang's DFLASH draft through the target's full lm_head, so a
drafter with a reduced draft vocabulary (`draft_vocab_size` + `d2t`) is written to OUT/drafter-zlab without it: the
same weights drafting over the whole vocabulary (outputs stay the target's; acceptance can differ, README says by how
much where bench measured it). vLLM reads the reduced vocabulary (speculators' d2t / t2d)."""

from __future__ import annotations

import json
import shlex
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .checkpoint import atomic_directory
from .config import DRAFTER_ARCHITECTURE, DrafterConfig, TargetConfig, check_pair, load_drafter_config, load_target_config
from .errors import ConfigError

SNAPSHOT = Path(__file__).with_name("deploy_snapshot.json")
BACKENDS = ("trtllm-pytorch", "vllm", "sglang", "triton-llmapi")
ZLAB_DIR = "drafter-zlab"


def snapshot() -> dict[str, Any]:
    return json.loads(SNAPSHOT.read_text())


def snapshot_names(backend: str) -> set[str]:
    """The names (YAML keys, JSON keys, flags) deploy_snapshot.json records for a backend."""
    return {e["name"] for e in snapshot()[backend]["entries"]}


@dataclass(frozen=True)
class Pair:
    target: Path
    drafter: Path
    target_cfg: TargetConfig
    drafter_cfg: DrafterConfig
    speculators: bool  # the drafter is in vLLM's speculators format
    quant: str | None  # ModelOpt quant_algo of a quantized-HF target, else None


def resolve_pair(target: str | Path, drafter: str | Path, tp: int) -> Pair:
    """Check what the frameworks would refuse later, naming the file and key now: a Hugging Face target (not a
    TensorRT-LLM checkpoint), a DFlash drafter that fits it, attention heads that tp divides."""
    from .checkpoint_formats import is_quantized_hf, is_trtllm_checkpoint
    from .loading import check_dir, is_speculators_drafter

    check_dir(target, "--target")
    check_dir(drafter, "--drafter")
    target, drafter = Path(target).resolve(), Path(drafter).resolve()
    for path, flag in ((target, "--target"), (drafter, "--drafter")):
        if is_trtllm_checkpoint(path):
            raise ConfigError("a TensorRT-LLM checkpoint (rank files) is for the engine path (dflash-trt build); these frameworks "
                              "load Hugging Face directories: convert with --format hf, or pass the original", file=path / "config.json",
                              key="architecture")
    t_cfg = load_target_config(target)
    d_cfg = check_pair(t_cfg, load_drafter_config(drafter))
    if t_cfg.num_heads % tp:
        raise ConfigError(f"{t_cfg.num_heads} attention heads do not split over --tp {tp}", file=t_cfg.path, key="num_attention_heads")
    quant = None
    if is_quantized_hf(target):
        quant = json.loads((target / "hf_quant_config.json").read_text()).get("quantization", {}).get("quant_algo")
    if is_quantized_hf(drafter):
        raise ConfigError("a quantized drafter is not loaded by these frameworks' DFlash paths; convert the drafter with --quant none",
                          file=drafter / "hf_quant_config.json", key="quantization.quant_algo")
    return Pair(target, drafter, t_cfg, d_cfg, is_speculators_drafter(drafter), quant)


def needs_zlab_copy(pair: Pair) -> bool:
    """TensorRT-LLM and SGLang load z-lab's format over the full vocabulary: a speculators drafter, or one with a
    reduced draft vocabulary, is rewritten for them."""
    return pair.speculators or pair.drafter_cfg.draft_vocab_size is not None


def write_zlab_full_vocab(pair: Pair, out: Path) -> None:
    """The drafter in z-lab's released format without a reduced vocabulary: its config.json (from a speculators one:
    speculators_format.speculators_as_zlab) without draft_vocab_size, its tensors without d2t (and speculators' t2d and
    lm_head), byte for byte."""
    from safetensors.torch import save_file

    from .checkpoint import SafetensorsCheckpoint
    from .speculators_format import speculators_as_zlab

    raw = json.loads((pair.drafter / "config.json").read_text())
    if pair.speculators:
        raw = speculators_as_zlab(raw, pair.drafter / "config.json", DRAFTER_ARCHITECTURE)
    raw.pop("draft_vocab_size", None)
    ckpt = SafetensorsCheckpoint(pair.drafter)
    dropped = {"d2t", "t2d", "lm_head.weight"} if pair.speculators else {"d2t"}
    tensors = {n: ckpt.get(n).contiguous() for n in ckpt.keys() if n not in dropped}
    out.mkdir(parents=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")


def trtllm_speculative_config(pair: Pair, drafter: Path, draft_len: int) -> dict[str, Any]:
    """speculative_config of TensorRT-LLM's LLM API / trtllm-serve YAML (DFlashDecodingConfig)."""
    d = pair.drafter_cfg
    return {"decoding_type": snapshot()["trtllm-pytorch"]["decoding_type"], "max_draft_len": draft_len, "speculative_model": str(drafter),
            "mask_token_id": d.mask_token_id, "target_layer_ids": list(d.target_layer_ids)}


def trtllm_serve_command(pair: Pair, config: Path, tp: int, host: str, port: int) -> list[str]:
    # --backend is left at its default (pytorch): the flag is deprecated (deploy_snapshot.json)
    return ["trtllm-serve", str(pair.target), "--tp_size", str(tp), "--host", host, "--port", str(port),
            "--config", str(config)]


def vllm_speculative_config(drafter: Path, draft_len: int) -> dict[str, Any]:
    return {"method": "dflash", "model": str(drafter), "num_speculative_tokens": draft_len}


def vllm_serve_command(pair: Pair, drafter: Path, draft_len: int, tp: int, host: str, port: int) -> list[str]:
    return ["vllm", "serve", str(pair.target), "--speculative-config", json.dumps(vllm_speculative_config(drafter, draft_len)),
            "--tensor-parallel-size", str(tp), "--host", host, "--port", str(port)]


def sglang_serve_command(pair: Pair, drafter: Path, draft_len: int, tp: int, host: str, port: int) -> list[str]:
    # SGLang's DFLASH verify window (--speculative-num-draft-tokens) is the block: the anchor plus the drafts.
    return ["python", "-m", "sglang.launch_server", "--model-path", str(pair.target), "--speculative-algorithm", "DFLASH",
            "--speculative-draft-model-path", str(drafter), "--speculative-num-draft-tokens", str(draft_len + 1),
            "--tp-size", str(tp), "--host", host, "--port", str(port)]


def triton_model_yaml(pair: Pair, drafter: Path, draft_len: int, tp: int, max_batch: int) -> dict[str, Any]:
    """1/model.yaml of the llmapi backend: its own keys (triton_config), the rest handed to LLM(**kwargs). Triton's
    max_batch_size stays 0, as upstream's model.yaml says (its model.py takes one 1-D text_input per request); the
    LLM batches requests itself, up to max_batch_size (an LLM argument)."""
    return {"model": str(pair.target), "backend": "pytorch", "tensor_parallel_size": tp, "pipeline_parallel_size": 1,
            "max_batch_size": max_batch, "speculative_config": trtllm_speculative_config(pair, drafter, draft_len),
            "triton_config": {"max_batch_size": 0, "decoupled": True}}


def triton_config_pbtxt() -> str:
    """config.pbtxt of the llmapi backend's `tensorrt_llm` model as upstream ships it: its inputs and outputs
    (deploy_snapshot.json), one KIND_CPU instance, and no max_batch_size / decoupled (upstream: they belong in
    model.yaml)."""
    from .serve.triton_repo import config_pbtxt

    spec = snapshot()["triton-llmapi"]
    return config_pbtxt("tensorrt_llm", None, {}, inputs=[tuple(i) for i in spec["inputs"]], outputs=[tuple(o) for o in spec["outputs"]],
                        instance_kind="KIND_CPU", decoupled=None)


def _script(lines: list[str]) -> str:
    return "#!/usr/bin/env bash\n# written by dflash-trt deploy\nset -euo pipefail\n" + "\n".join(lines) + "\n"


def _command(argv: list[str]) -> str:
    return " \\\n  ".join(shlex.quote(a) for a in argv) + ' "$@"'


def deploy(target: str | Path, drafter: str | Path, out: str | Path, *, backends: tuple[str, ...] = BACKENDS, tp: int = 1,
           draft_len: int | None = None, host: str = "0.0.0.0", port: int = 8000, max_batch: int = 8, force: bool = False) -> dict[str, Path]:
    """Write the recipes atomically (nothing is left on an error); returns each backend's directory."""
    import yaml

    unknown = [b for b in backends if b not in BACKENDS]
    if unknown:
        raise ConfigError(f"unknown backend {unknown[0]!r}; expected one of {', '.join(BACKENDS)} or all", key="--backend")
    pair = resolve_pair(target, drafter, tp)
    block = pair.drafter_cfg.block_size
    draft_len = block - 1 if draft_len is None else draft_len
    if not 1 <= draft_len <= block - 1:
        raise ConfigError(f"{draft_len} drafts do not fit the drafter's block of {block} (1 .. {block - 1}: the block holds the last "
                          f"committed token and the drafts)", file=pair.drafter_cfg.path, key="--draft-len")
    out = Path(out)
    if out.exists() and not force:
        raise ConfigError("output directory already exists (pass --force to overwrite)", file=out)
    final = out.resolve()
    zlab = final / ZLAB_DIR if needs_zlab_copy(pair) else pair.drafter
    written: dict[str, Path] = {}
    readme = [f"# Serving {pair.target.name} with DFlash ({pair.drafter.name})", "",
              "Written by `dflash-trt deploy`. TensorRT-LLM <= 1.2.x: the engine path (`dflash-trt build`). Later TensorRT-LLM "
              "(its PyTorch backend has DFlash; `trtllm-build` is gone), vLLM and SGLang: the recipes below.", "",
              f"target: `{pair.target}`" + (f" (quantized: {pair.quant})" if pair.quant else ""), f"drafter: `{pair.drafter}`, block "
              f"{block}, {draft_len} drafts per step, tensor parallel {tp}", ""]
    snap = snapshot()
    with atomic_directory(out, force=force) as tmp:
        if needs_zlab_copy(pair):
            write_zlab_full_vocab(pair, tmp / ZLAB_DIR)
            readme += [f"`{ZLAB_DIR}/`: the drafter in z-lab's format over the full vocabulary (TensorRT-LLM's DFlash and SGLang's "
                       "DFLASH draft through the target's whole lm_head" + (f"; its reduced vocabulary of {pair.drafter_cfg.draft_vocab_size} "
                       "tokens is dropped, the weights are the same" if pair.drafter_cfg.draft_vocab_size else "") + ").", ""]
        for backend in backends:
            d = tmp / backend
            d.mkdir()
            src = snap[backend]
            cite = f"{src.get('package') or src['repo'] + '@' + src['commit'][:12]}"
            lines, intro = [], []  # serve.sh's lines before the framework's command; README text before the script
            if backend == "trtllm-pytorch":
                (d / "config.yml").write_text(yaml.safe_dump({"speculative_config": trtllm_speculative_config(pair, zlab, draft_len)},
                                                             sort_keys=False))
                argv = trtllm_serve_command(pair, final / backend / "config.yml", tp, host, port)
            elif backend == "vllm":
                spec = pair.drafter if pair.speculators else final / backend / "drafter-speculators"
                if not pair.speculators:
                    from .convert import convert

                    convert(pair.target, pair.drafter, d / "drafter-speculators", fmt="speculators", dtype=_dtype_of(pair.drafter),
                            progress=False, log=lambda _: None)
                argv = vllm_serve_command(pair, spec, draft_len, tp, host, port)
            elif backend == "sglang":
                argv = sglang_serve_command(pair, zlab, draft_len, tp, host, port)
            else:
                repo = d / "model_repository" / "tensorrt_llm"
                (repo / "1").mkdir(parents=True)
                (repo / "config.pbtxt").write_text(triton_config_pbtxt())
                (repo / "1" / "model.yaml").write_text(yaml.safe_dump(triton_model_yaml(pair, zlab, draft_len, tp, max_batch), sort_keys=False))
                model_py = src["model_py"]
                argv = ["tritonserver", "--model-repository", str(final / backend / "model_repository")]
                lines = [f': "${{TRTLLM_SRC:?set TRTLLM_SRC to a TensorRT-LLM source tree of the release you run}}"',
                         f'cp "$TRTLLM_SRC/{model_py}" {shlex.quote(str(final / backend / "model_repository" / "tensorrt_llm" / "1" / "model.py"))}']
                intro = [f"`{backend}/model_repository/`: its `1/model.py` is TensorRT-LLM's own (`{model_py}`); `serve.sh` "
                         "copies it from `$TRTLLM_SRC` and starts Triton:", ""]
            lines.append(_command(argv))
            (d / "serve.sh").write_text(_script(lines))
            (d / "serve.sh").chmod(0o755)  # atomic_directory keeps the x bits (within the umask)
            readme += [f"## {backend} ({cite})", "", *intro, "```bash", *lines, "```", ""]
            written[backend] = final / backend
        (tmp / "README.md").write_text("\n".join(readme))
    return written


def _dtype_of(drafter: Path) -> str:
    """The convert dtype name of a drafter's floating-point tensors (the speculators copy keeps them as they are)."""
    from .checkpoint import SafetensorsCheckpoint
    from .loading import DTYPES

    ckpt = SafetensorsCheckpoint(drafter)
    dtypes = {ckpt.dtype(n) for n in ckpt.keys() if ckpt.dtype(n).is_floating_point}
    names = {v: k for k, v in DTYPES.items()}
    return names.get(next(iter(dtypes)), "bf16") if len(dtypes) == 1 else "bf16"


def cmd_deploy(args) -> int:
    backends = BACKENDS if args.backend == "all" else (args.backend,)
    written = deploy(args.target, args.drafter, args.out, backends=backends, tp=args.tp, draft_len=args.draft_len, host=args.host,
                     port=args.port, max_batch=args.max_batch, force=args.force)
    for backend, path in written.items():
        print(f"{backend}: {path / 'serve.sh'}")
    print(f"# {Path(args.out) / 'README.md'}")
    return 0


def register_cli(sub) -> None:
    from .flags import HELP_FORMAT, positive_int

    d = sub.add_parser("deploy", formatter_class=HELP_FORMAT,
                       help="write serving recipes for TensorRT-LLM's PyTorch backend, vLLM, SGLang and Triton's llmapi backend",
                       description="Write what each framework needs to serve a target with its DFlash drafter: commands, "
                                   "configs and drafter formats, every key and flag checked against the framework's own "
                                   "definition (deploy_snapshot.json). The engine path is `dflash-trt build` (TensorRT-LLM <= 1.2.x).")
    d.add_argument("--backend", choices=[*BACKENDS, "all"], default="all", help="which recipe (default: all four)")
    d.add_argument("--target", required=True, help="Hugging Face target directory (original, or convert --format hf's OUT/target)")
    d.add_argument("--drafter", required=True, help="DFlash drafter directory (z-lab or speculators format)")
    d.add_argument("--out", required=True, help="output directory")
    d.add_argument("--tp", type=positive_int, default=1, help="tensor-parallel GPUs")
    d.add_argument("--draft-len", type=positive_int, help="drafts per step (default: the drafter's block_size - 1)")
    d.add_argument("--host", default="0.0.0.0", help="address the servers listen on")
    d.add_argument("--port", type=positive_int, default=8000, help="port the servers listen on")
    d.add_argument("--max-batch", type=positive_int, default=8, help="requests the LLM batches (its max_batch_size; Triton's own stays 0)")
    d.add_argument("--force", action="store_true", help="replace an existing --out")
    d.set_defaults(func=cmd_deploy)
