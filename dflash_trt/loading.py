"""Directories and arguments in, what the runtime needs out: the one place every front end (cli, bench, convert,
serve, scripts, examples) takes these facts from, so that no library module imports the CLI.

- models from directories: `load_target`, `load_drafter`, `load_eagle_drafter`, `load_torch_backend`, and
  `load_tp_backend` (each rank its own shards); the decision of what a directory holds (a Hugging Face model, a
  converted TensorRT-LLM part, the one-engine checkpoint, ModelOpt's quantized HF) is made here and in
  config.load_*_config, never in the models;
- the tokenizer of a model directory (local files, never remote code), prompt encoding with the chat template,
  the EOS union, prompt files;
- the flags every front end shares (`add_model_flags`, `add_tp_flags`, `positive_int`) and their checks
  (`check_model_dirs`, `check_dir`).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from .errors import CheckpointError, ConfigError
from .flags import positive_float, positive_int

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def load_tokenizer(directory: str | Path):
    """The tokenizer shipped in a model directory: local files only, never remote code."""
    from transformers import AutoTokenizer

    directory = Path(directory)
    if not any((directory / name).is_file() for name in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise ConfigError("no tokenizer files (tokenizer.json, tokenizer.model or vocab.json); pass --tokenizer DIR", file=directory)
    try:
        return AutoTokenizer.from_pretrained(str(directory), local_files_only=True, trust_remote_code=False)
    except Exception as e:  # transformers raises many types for broken tokenizer files
        raise ConfigError(f"cannot load the tokenizer ({type(e).__name__}: {e})", file=directory) from None


def encode_chat(tokenizer, messages: list[dict], **template_kwargs) -> list[int]:
    """Token ids of `messages` through the tokenizer's chat template, ready for the assistant's turn (thinking off
    unless the caller says otherwise: Qwen3's template reads `enable_thinking`)."""
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, **{"enable_thinking": False, **template_kwargs})
    return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def encode_prompt(tokenizer, text: str, chat: bool) -> list[int]:
    """One user prompt: through the chat template when asked and the tokenizer has one, else plain text."""
    if chat and getattr(tokenizer, "chat_template", None):
        return encode_chat(tokenizer, [{"role": "user", "content": text}])
    return tokenizer.encode(text)


def generation_eos_ids(target_dir: str | Path, tokenizer, tokenizer_dir: str | Path | None = None) -> set[int]:
    """EOS ids from config.json, generation_config.json (beside the target, or beside the tokenizer: a
    converted checkpoint keeps it there) and the tokenizer: generation stops at any of them."""
    from .config import load_target_config

    ids: set[int] = set(load_target_config(target_dir).eos_token_ids)
    for directory in {Path(target_dir), Path(tokenizer_dir or target_dir)}:
        path = directory / "generation_config.json"
        if path.is_file():
            value = json.loads(path.read_text()).get("eos_token_id")
            ids.update(value if isinstance(value, list) else [value] if isinstance(value, int) else [])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


def read_prompts(texts: list[str] | None, prompts_file: str | Path | None) -> list[str]:
    """Prompt texts given inline (--prompt) and from a file (--prompts: one per line, or .jsonl with
    'prompt' / 'turns'); at least one."""
    prompts = list(texts or [])
    if prompts_file:
        path = Path(prompts_file)
        if not path.is_file():
            raise ConfigError("prompts file does not exist", file=path)
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if not line.strip():
                continue
            if path.suffix == ".jsonl":
                try:
                    row = json.loads(line)
                    prompts.append(row["prompt"] if "prompt" in row else row["turns"][0])
                except (json.JSONDecodeError, KeyError, IndexError, TypeError):
                    raise ConfigError("each line must be a JSON object with 'prompt' or 'turns'", file=path, key=f"line {n}") from None
            else:
                prompts.append(line)
    if not prompts:
        raise ConfigError("no prompt given: use --prompt TEXT or --prompts FILE", key="--prompt")
    return prompts


def check_dir(value: str | Path | None, flag: str) -> None:
    """A directory flag's value exists and is a directory; the error names the flag and the path."""
    if value is None:
        return
    path = Path(value)
    if not path.exists():
        raise ConfigError("does not exist", file=path, key=flag)
    if not path.is_dir():
        raise ConfigError("is not a directory (expected a model directory holding config.json)", file=path, key=flag)


def check_model_dirs(args) -> None:
    """--target DIR [--drafter DIR], or --checkpoint DIR (the output of dflash-trt convert, holding both):
    one error when neither or both are given (generate, serve and triton-repo alike), and one naming the
    flag when a directory does not exist or is a file."""
    for flag in ("target", "checkpoint", "drafter", "tokenizer"):
        check_dir(getattr(args, flag, None), f"--{flag}")
    if args.checkpoint:
        if args.target or args.drafter:
            raise ConfigError("--checkpoint holds the target and the drafter: drop --target / --drafter", key="--checkpoint")
        if args.drafter_type != "dflash":
            raise ConfigError("converted checkpoints hold a DFlash drafter", key="--drafter-type")
    elif not args.target:
        raise ConfigError("pass --target DIR (Hugging Face), or --checkpoint DIR (the output of dflash-trt convert)", key="--target")


def requested_drafter(args) -> str | None:
    """The --drafter directory, None with --no-drafter; an error when neither is given."""
    if args.no_drafter:
        return None
    if args.drafter is None:
        raise ConfigError("no drafter given: pass --drafter DIR, or --no-drafter for plain decoding", key="--drafter")
    return args.drafter


def checkpoint_parts(checkpoint: str | Path) -> tuple[Path, Path]:
    """(target, drafter) directories of a `dflash-trt convert` output: DIR/target and DIR/drafter, or DIR
    itself for both when it is the one-engine checkpoint (`--format engine`, DFlashForCausalLM)."""
    from .checkpoint_formats import is_engine_checkpoint

    checkpoint = Path(checkpoint)
    check_dir(checkpoint, "--checkpoint")
    if is_engine_checkpoint(checkpoint):
        return checkpoint, checkpoint
    return checkpoint / "target", checkpoint / "drafter"


def checkpoint_root(part: str | Path) -> Path:
    """The `dflash-trt convert` output a part directory belongs to (checkpoint_parts' inverse): DIR for DIR/target,
    DIR itself for the one-engine checkpoint."""
    from .checkpoint_formats import is_engine_checkpoint

    return Path(part) if is_engine_checkpoint(part) else Path(part).parent


# ----------------------------------------------------------------------------------------------------
# Command-line flags shared by the front ends (generate, serve, triton-repo, bench)

def add_model_flags(p: argparse.ArgumentParser, launcher: str, serving: bool = True, cpu_weights: bool = False) -> None:
    """The model directories and how the runtime holds them: one definition for generate, serve, triton-repo,
    calibrate and bench. `launcher` is the subcommand (for the --checkpoint help); `serving` False (bench) leaves
    out what only a serving front end takes (--checkpoint, --drafter-type, --no-drafter, the KV pool's sizes) and
    makes --target required. `cpu_weights` (the front ends that run the torch backend in this process: generate,
    calibrate, bench, serve) adds --cpu-weights and `--dtype auto` (resolve_auto_dtype)."""
    p.add_argument("--target", required=not serving, help="Hugging Face target model directory (config.json, safetensors, tokenizer)")
    if serving:
        p.add_argument("--checkpoint", help="instead of --target/--drafter: the output of dflash-trt convert (DIR/target and DIR/drafter, "
                       f"or the one-engine DIR; tokenizer in DIR); one sharded for tp N runs as `mpirun -n N dflash-trt {launcher} --checkpoint DIR`")
    p.add_argument("--drafter", help="drafter directory (DFlash: z-lab's released format)")
    if serving:
        p.add_argument("--drafter-type", choices=["dflash", "eagle3"], default="dflash", help="eagle3: the EAGLE-3-style baseline drafter")
        p.add_argument("--no-drafter", action="store_true", help="plain autoregressive decoding (the baseline)")
    p.add_argument("--tokenizer", help="tokenizer directory (default: --target, or --checkpoint's DIR)")
    p.add_argument("--block-size", type=positive_int, help="verify block size, 2..drafter block_size (default: the drafter's); forces this width")
    if cpu_weights:
        p.add_argument("--dtype", choices=[*sorted(DTYPES), "auto"], default="fp32",
                       help="weights and activations; auto: the fastest measured on this machine (bf16 with --cpu-weights onednn "
                            "on a CPU with native bf16 (AVX512-BF16 or AMX), else fp32; bf16 on a GPU)")
        add_cpu_weights_flag(p)
    else:
        p.add_argument("--dtype", choices=sorted(DTYPES), default="fp32", help="weights and activations")
    if serving:
        p.add_argument("--max-batch", type=positive_int, default=8, help="requests in the running batch")
    p.add_argument("--max-verify-tokens", type=positive_int, help="at most this many tokens per verify pass over the batch: blocks shrink "
                   "(down to plain decoding) as the batch grows (default: no limit)")
    if serving:
        p.add_argument("--kv-pages", type=positive_int, help="KV pool size in pages (default: enough for the batch)")
        p.add_argument("--page-size", type=positive_int, default=16, help="tokens per KV page")
    p.add_argument("--threads", type=positive_int, help="torch CPU threads (default: torch's choice)")


def add_cpu_weights_flag(p: argparse.ArgumentParser) -> None:
    """--cpu-weights (generate, calibrate, bench, serve: the single-process torch backend)."""
    from .models.packed import CPU_WEIGHTS

    p.add_argument("--cpu-weights", choices=CPU_WEIGHTS, default=None,
                   help="dense (the default; onednn under --dtype auto where it picks bf16): the target's weights in --dtype; int8: weight-only int8 with power-of-two row scales (--dtype bf16 "
                        "or fp32: packed int8 matmuls for steps of few tokens, dense matmuls of the same weights for wider "
                        "ones; in fp32 the matmuls take and give bf16-rounded activations, all else stays fp32; +25%% weight "
                        "memory in fp32, +50%% in bf16); onednn: a bf16 target's matmul weights also held prepacked in "
                        "oneDNN's layout (the same weights and products, faster kernels; +100%% of the matmul weights' memory); "
                        "a bf16 drafter and its draft head are prepacked too (drafts may round differently; the output is the "
                        "target's). Not under tensor parallelism")


def native_cpu_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively through oneDNN (AVX512-BF16 or AMX tiles). Where it does, bf16 with
    oneDNN-prepacked weights is the fastest setting measured here (README, `--cpu-weights onednn`); without them oneDNN
    emulates bf16 and fp32 is faster."""
    from .models.packed import onednn_bf16_available

    return onednn_bf16_available() and bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def resolve_auto_dtype(args, log=None) -> None:
    """`--dtype auto` and an unset --cpu-weights, resolved in place before a front end reads them: on a GPU bf16;
    on a CPU with native bf16, bf16 with oneDNN-prepacked weights (dense under tensor parallelism, which holds
    dense weights only); elsewhere fp32. An unset --cpu-weights is dense otherwise. `log` gets one line saying
    what auto chose."""
    from .tp import launched_world_size

    if getattr(args, "dtype", None) == "auto":
        cuda = getattr(args, "device", "cpu") == "cuda"
        fast = not cuda and native_cpu_bf16()
        args.dtype = "bf16" if cuda or fast else "fp32"
        if args.cpu_weights is None:
            args.cpu_weights = "onednn" if fast and launched_world_size() == 1 else "dense"
        if log is not None:
            why = ("a GPU" if cuda else "this CPU multiplies bf16 natively" if fast
                   else "this CPU has no native bf16 (AVX512-BF16 / AMX), where fp32 is faster")
            log(f"--dtype auto: {weights_label(args.dtype, args.cpu_weights)} ({why})")
    if getattr(args, "cpu_weights", "dense") is None:
        args.cpu_weights = "dense"


def weights_label(dtype: str, cpu_weights: str) -> str:
    """The dtype as calibrations and reports name it: 'bf16', or 'bf16+int8' for int8 weights."""
    return dtype if cpu_weights == "dense" else f"{dtype}+{cpu_weights}"


def add_tp_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tp-drafter", choices=["sharded", "replicated"], default="sharded",
                   help="sharded --checkpoint: shard the drafter like the target, or run it whole on every rank")
    p.add_argument("--tp-timeout", type=positive_float, default=300.0, help="seconds a rank waits for the others before failing")


# ----------------------------------------------------------------------------------------------------
# Tensor parallelism: each rank loads only its own rank{r}.safetensors of a converted checkpoint (tp.py shards the
# modules; this is where the checkpoint side lives)


def _check_mapping(directory: Path, tp) -> None:
    from .checkpoint_formats import _tp_of, read_trtllm_config

    path, raw = read_trtllm_config(directory)
    tp_size = _tp_of(raw, path)
    if tp_size != tp.world_size:
        raise ConfigError(
            f"the checkpoint is sharded for tp_size={tp_size}, but {tp.world_size} rank(s) were launched: run it with `mpirun -n {tp_size}`",
            file=path, key="mapping.tp_size",
        )


def _unshard(shards: torch.Tensor, split: str, part: str, cfg, tp: int) -> torch.Tensor:
    """shards [tp, rows, cols]: every rank's part of one HF-named tensor (as read_rank returns it) → the whole
    tensor, by the converter's own row maps run backwards."""
    from . import shard_rules

    if split in ("replicated", "vocab") or split == "row" and shards.dim() == 2:  # a row-parallel bias is whole on every rank
        return shards[0]
    if split == "row":
        return torch.cat(list(shards), dim=1)
    if split == "column":
        return torch.cat(list(shards), dim=0)
    maps = [shard_rules.qkv_rows(part, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, tp, r) for r in range(tp)]
    rows = {"q": cfg.num_heads, "k": cfg.num_kv_heads, "v": cfg.num_kv_heads}[part] * cfg.head_dim
    full = shards.new_empty((rows, *shards.shape[2:]))
    for shard, rank_maps in zip(shards, maps):
        base = min(m.dst_start for m in rank_maps)  # where this part starts in the rank's fused qkv
        for m in rank_maps:
            full[m.src_start : m.src_start + m.n] = shard[m.dst_start - base : m.dst_start - base + m.n]
    return full


def _replicate(cfg, tensors: dict[str, torch.Tensor], tp) -> dict[str, torch.Tensor]:
    """Every rank's drafter shard → the whole drafter on every rank (one all-gather per tensor, at load)."""
    from .checkpoint_formats import drafter_units

    units, _ = drafter_units(cfg)
    full: dict[str, torch.Tensor] = {}
    for unit in units:
        for src, part in zip(unit.sources, unit.parts):
            for suffix in ((".weight", ".bias") if unit.bias else (".weight",)) if unit.linear else ("",):
                name = src + suffix
                full[name] = _unshard(tp.all_gather(tensors[name]), unit.split, part, cfg, tp.world_size)
    return full


def prepare_on_rank_0(tp, prepare):
    """Under TP: rank 0 runs `prepare()` (what needs the tokenizer: encoding prompts, the EOS ids), which returns
    (shared, kept); every rank gets `shared`, rank 0 alone keeps `kept` (e.g. the tokenizer, which is not sent).
    A failure on rank 0 stops every rank with its error (tp.agree). Returns (shared, kept or None)."""
    result = tp.agree(prepare if tp.rank == 0 else lambda: (None, None))
    return tp.broadcast_object(result[0]), result[1]


def load_tp_backend(
    checkpoint: str | Path,
    tp,
    dtype: torch.dtype = torch.float32,
    use_drafter: bool = True,
    drafter_mode: str = "sharded",
    num_pages: int = 256,
    page_size: int = 16,
    block_size: int | None = None,
):
    """A TorchBackend over rank `tp.rank`'s shards of a `dflash-trt convert --tp N` directory (target/, drafter/).
    `drafter_mode`: "sharded" like the target, or "replicated" (every rank gathers and runs the whole drafter)."""
    from .checkpoint import InMemorySource, load_module
    from .config import check_pair
    from .models.drafter import DFlashDrafter
    from .models.target import TargetModel
    from .torch_backend import TorchBackend
    from .tp import apply_tp, gather_embedding
    from .checkpoint_formats import read_rank, trtllm_source

    if drafter_mode not in ("sharded", "replicated"):
        raise ConfigError(f"unsupported drafter mode {drafter_mode!r}; expected sharded or replicated", key="--tp-drafter")
    target_dir, drafter_dir = checkpoint_parts(checkpoint)
    device = tp.device

    def load_local():  # reads this rank's files only; no collectives, so a failure cannot strand the others
        _check_mapping(target_dir, tp)
        cfg, source = trtllm_source(target_dir, tp.rank, dtype)
        if cfg.tie_word_embeddings:  # the checkpoint's lm_head shard is the embedding's shard
            source.tensors["lm_head.weight"] = source.tensors["model.embed_tokens.weight"]
            source.weight_map["lm_head.weight"] = source.weight_map["model.embed_tokens.weight"]
        target = load_module(lambda: apply_tp(TargetModel(cfg), tp), source, dtype, device)
        if not use_drafter:
            return target, None
        _check_mapping(drafter_dir, tp)
        d_cfg, tensors, _ = read_rank(drafter_dir, tp.rank, dtype, "drafter")
        d_cfg = check_pair(cfg, d_cfg)
        tensors = {k: v for k, v in tensors.items() if not k.endswith((".input_scale", ".k_scale", ".v_scale"))}
        return target, (d_cfg, tensors)

    target, drafter_part = tp.agree(load_local)
    gather_embedding(target, tp)
    drafter = None
    if drafter_part is not None:
        d_cfg, tensors = drafter_part
        width = len(d_cfg.target_layer_ids) * target.cfg.hidden_size
        shard_file = drafter_dir / f"rank{tp.rank}.safetensors"
        if drafter_mode == "replicated":
            tensors, build = _replicate(d_cfg, tensors, tp), lambda: DFlashDrafter(d_cfg, width)
        else:
            build = lambda: apply_tp(DFlashDrafter(d_cfg, width), tp)  # noqa: E731
        source = InMemorySource(tensors, dict.fromkeys(tensors, shard_file), drafter_dir)
        drafter = tp.agree(lambda: load_module(build, source, dtype, device))
        drafter.fuse_context_projections()
    tp.reset_stats()
    return TorchBackend(target, drafter, num_pages=num_pages, page_size=page_size, block_size=block_size)


# ----------------------------------------------------------------------------------------------------
# Models from directories: the one place that decides what a directory holds (a Hugging Face model, a converted
# TensorRT-LLM checkpoint of one part or of the one engine, ModelOpt's quantized HF) and reads its weights; the
# models themselves take configs and tensors.


def load_target(directory: str | Path, dtype: torch.dtype = torch.float32, device: str = "cpu") :
    """From a Hugging Face directory, or from a converted TensorRT-LLM checkpoint (tp=1; weights dequantized)."""
    from .checkpoint import load_module
    from .config import load_target_config
    from .models.target import TargetModel
    from .checkpoint_formats import (
        Mxfp4Source, is_mxfp4_checkpoint, is_quantized_hf, is_trtllm_checkpoint, quantized_hf_source, single_rank_source,
    )

    if is_trtllm_checkpoint(directory):
        cfg, source = single_rank_source(directory, dtype)
    else:
        cfg = load_target_config(directory)
        if is_quantized_hf(directory):
            source = quantized_hf_source(directory, dtype)
        elif is_mxfp4_checkpoint(directory):  # a released gpt-oss: MXFP4 experts, dequantized as they are read
            source = Mxfp4Source(directory)
        else:
            source = directory
    # A tied checkpoint may still carry lm_head.weight; the embedding is what is used.
    ignore = {"lm_head.weight"} if cfg.tie_word_embeddings else set()
    return load_module(lambda: TargetModel(cfg), source, dtype, device, ignore=ignore)


def load_drafter(directory: str | Path, target_cfg, dtype: torch.dtype = torch.float32, device: str = "cpu") :
    from .checkpoint import SafetensorsCheckpoint, load_module
    from .config import check_pair, load_drafter_config
    from .errors import CheckpointError
    from .models.drafter import DFlashDrafter
    from .checkpoint_formats import is_quantized_hf, is_trtllm_checkpoint, quantized_hf_source, single_rank_source

    cfg = check_pair(target_cfg, load_drafter_config(directory))
    feature_width = len(cfg.target_layer_ids) * target_cfg.hidden_size
    if is_trtllm_checkpoint(directory) or is_quantized_hf(directory):
        source = single_rank_source(directory, dtype, "drafter")[1] if is_trtllm_checkpoint(directory) else quantized_hf_source(directory, dtype)
        model = load_module(lambda: DFlashDrafter(cfg, feature_width), source, dtype, device)
        check_d2t(model, target_cfg.vocab_size, directory)
        model.fuse_context_projections()
        return model
    ckpt = SafetensorsCheckpoint(directory)
    source = speculators_source(ckpt, target_cfg) if is_speculators_drafter(directory) else directory
    if "fc.weight" in ckpt and ckpt.shape("fc.weight") != (cfg.hidden_size, feature_width):
        raise CheckpointError(
            f"fc input width {ckpt.shape('fc.weight')[-1]} != len(target_layer_ids)={len(cfg.target_layer_ids)} "
            f"x target hidden_size={target_cfg.hidden_size} = {feature_width}",
            file=ckpt.file_of("fc.weight"),
            key="fc.weight",
        )
    model = load_module(lambda: DFlashDrafter(cfg, feature_width), source, dtype, device)
    check_d2t(model, target_cfg.vocab_size, directory)
    model.fuse_context_projections()
    return model


def is_speculators_drafter(directory: str | Path) -> bool:
    """A drafter in vLLM's speculators format (speculators_format.py)."""
    from .speculators_format import is_speculators_config

    try:
        return is_speculators_config(json.loads((Path(directory) / "config.json").read_text()))
    except (OSError, ValueError):
        return False


SPECULATORS_ONLY_TENSORS = ("t2d", "lm_head.weight")  # what a speculators drafter holds beyond z-lab's tensors


def speculators_source(ckpt, target_cfg):
    """A speculators drafter's tensors as the runtime takes them: its `t2d` and own `lm_head` (a reduced vocabulary)
    checked against d2t and the target's lm_head rows (speculators_format.check_draft_head), then left out: the runtime
    drafts from the target's rows. The target's lm_head is read from its Hugging Face directory (target_cfg.path)."""
    from .checkpoint import InMemorySource, SafetensorsCheckpoint
    from .speculators_format import check_draft_head

    extras = {n: ckpt.get(n) for n in (*SPECULATORS_ONLY_TENSORS, "d2t") if n in ckpt}
    head = None
    if "lm_head.weight" in extras:
        target_dir = Path(target_cfg.path).parent
        if (target_dir / "config.json").is_file() and not _is_converted(target_dir):
            t_ckpt = SafetensorsCheckpoint(target_dir)
            name = "model.embed_tokens.weight" if target_cfg.tie_word_embeddings else "lm_head.weight"
            head = t_ckpt.get(name) if name in t_ckpt else None
    check_draft_head(extras, head, ckpt.file_of("lm_head.weight") if "lm_head.weight" in ckpt else ckpt.directory / "config.json")
    names = [n for n in ckpt.keys() if n not in SPECULATORS_ONLY_TENSORS]
    return InMemorySource({n: ckpt.get(n) for n in names}, {n: ckpt.file_of(n) for n in names}, ckpt.directory)


def _is_converted(directory: Path) -> bool:
    from .checkpoint_formats import is_quantized_hf, is_trtllm_checkpoint

    return is_trtllm_checkpoint(directory) or is_quantized_hf(directory)


def load_eagle_drafter(directory: str | Path, target_cfg, dtype=torch.float32, device="cpu"):
    """The EAGLE-3-style baseline drafter of `directory`, checked against the target's config."""
    from .checkpoint import load_module
    from .checkpoint_formats import is_quantized_hf, is_trtllm_checkpoint
    from .config import check_pair, load_eagle_config
    from .errors import CheckpointError
    from .models.eagle import Eagle3Drafter

    if is_trtllm_checkpoint(directory) or is_quantized_hf(directory):  # the converter writes DFlash drafters only
        raise CheckpointError("an EAGLE-style drafter loads from its Hugging Face directory; converted checkpoints hold DFlash "
                              "drafters", file=Path(directory) / "config.json", key="architecture")
    cfg = check_pair(target_cfg, load_eagle_config(directory))
    width = len(cfg.target_layer_ids) * target_cfg.hidden_size
    model = load_module(lambda: Eagle3Drafter(cfg, width), directory, dtype, device)
    check_d2t(model, target_cfg.vocab_size, directory)
    return model


def check_d2t(module, vocab_size: int, directory: str | Path) -> None:
    """A loaded drafter's `d2t` (if any) maps every draft token into the target's vocabulary."""
    if getattr(module, "d2t", None) is not None:
        check_d2t_ids(module.d2t, vocab_size, directory)


def check_d2t_ids(d2t, vocab_size: int, directory: str | Path) -> None:
    """Every draft token i maps to a target id i + d2t[i] inside the vocabulary (else drafting would index past the
    lm_head): one error naming the checkpoint and the first bad entry."""
    ids = torch.arange(len(d2t), device=d2t.device) + d2t
    bad = ((ids < 0) | (ids >= vocab_size)).nonzero()
    if bad.numel():
        i = int(bad[0])
        raise CheckpointError(
            f"draft token {i} maps to target id {int(ids[i])} (d2t[{i}] = {int(d2t[i])}), outside the target's vocabulary "
            f"[0, {vocab_size}); {bad.numel()} of {len(d2t)} entries are out of range", file=directory, key="d2t",
        )


def load_torch_backend(
    target_dir,
    drafter_dir=None,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    num_pages: int = 256,
    page_size: int = 16,
    block_size: int | None = None,
    drafter_type: str = "dflash",
    cpu_weights: str = "dense",
):
    """Load and validate a target (and a DFlash or EAGLE-3-style drafter) from their directories."""
    from .torch_backend import TorchBackend

    target = load_target(target_dir, dtype=dtype, device=device)
    drafter = None
    if drafter_dir is not None:
        load = load_eagle_drafter if drafter_type == "eagle3" else load_drafter
        drafter = load(drafter_dir, target.cfg, dtype=dtype, device=device)
    return TorchBackend(target, drafter, num_pages=num_pages, page_size=page_size, block_size=block_size, cpu_weights=cpu_weights)
