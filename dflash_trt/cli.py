"""`dflash-trt` command line. Errors print one line and exit with code 2."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from . import __version__, bench, convert, deploy, fetch, plan
from .errors import ConfigError, DFlashError
from .flags import HELP_FORMAT, positive_int
from .tree import add_tree_flags, tree_from_args
from .loading import (
    DTYPES, add_model_flags, add_tp_flags, check_model_dirs, checkpoint_parts, encode_prompt, generation_eos_ids, load_tokenizer,
    load_torch_backend, load_tp_backend, prepare_on_rank_0, read_prompts, requested_drafter, resolve_auto_dtype, weights_label,
)


def cmd_generate(args) -> int:
    from .config import load_target_config

    if args.threads:
        torch.set_num_threads(args.threads)
    check_model_dirs(args)
    if args.checkpoint:
        return generate_checkpoint(args)
    target_cfg = load_target_config(args.target)  # fail on the config before touching weights
    tokenizer = load_tokenizer(args.tokenizer or args.target)
    prompts = [encode_prompt(tokenizer, p, chat=not args.no_chat_template) for p in read_prompts(args.prompt, args.prompts)]
    drafter_dir = requested_drafter(args)
    pages = kv_pages(args, prompts)
    backend = load_torch_backend(args.target, drafter_dir, DTYPES[args.dtype], args.device, pages, args.page_size, args.block_size, args.drafter_type,
                                 args.cpu_weights)
    eos = generation_eos_ids(args.target, tokenizer)
    mode = "autoregressive" if drafter_dir is None else f"{args.drafter_type} block={backend.block_size}"
    policy = draft_policy(args, backend, str(args.target), drafter_dir, len(prompts))
    return run_generation(args, backend, tokenizer, prompts, eos, target_cfg.max_position_embeddings, mode, policy=policy)


def draft_policy(args, backend, target, drafter, num_prompts: int):
    """`--draft-length auto` (the default with a drafter, unless --block-size forces a width): each step's draft
    length from the measured step cost and the running acceptance (draft_length.py). Single process only: under
    TP every rank must draft the same, and timings differ between ranks."""
    from .draft_length import auto_policy, calibration_identity

    if args.draft_length != "auto" or args.block_size or backend.max_drafts == 0:
        return None
    tree = getattr(args, "tree", None)  # --tree N: each step a tree of n ≤ N nodes or plain decoding (TreePolicy)
    identity = calibration_identity(target, drafter, weights_label(args.dtype, args.cpu_weights), getattr(args, "drafter_type", "dflash"),
                                    backend.block_size)
    return auto_policy(backend, identity, min(args.max_batch, num_prompts), progress=not args.quiet, tree_nodes=tree)


def kv_pages(args, prompts: list[list[int]]) -> int:
    from .kv_cache import pool_pages

    longest = max(len(p) for p in prompts) + args.max_new_tokens
    return args.kv_pages or pool_pages(min(args.max_batch, len(prompts)), longest, args.page_size, args.block_size)


def generate_checkpoint(args) -> int:
    """`generate --checkpoint DIR` (DIR/target, DIR/drafter from `dflash-trt convert --tp N`): under
    `mpirun -n N` (or torchrun) each rank loads only its rank{r}.safetensors and runs the same loop on
    its shards; rank 0 tokenizes, then streams and prints. A tp=1 checkpoint also runs without a launcher."""
    from .config import load_target_config
    from .tp import init_tp, launched_world_size

    ckpt = Path(args.checkpoint)
    target_dir, drafter_dir = checkpoint_parts(ckpt)
    target_cfg = load_target_config(target_dir)
    mode = "autoregressive" if args.no_drafter else "dflash"
    tokenizers: list = []

    def prepare():
        tokenizers.append(load_tokenizer(args.tokenizer or ckpt))
        prompts = [encode_prompt(tokenizers[0], p, chat=not args.no_chat_template) for p in read_prompts(args.prompt, args.prompts)]
        return prompts, sorted(generation_eos_ids(target_dir, tokenizers[0], ckpt))

    if launched_world_size() == 1:  # in this process; a sharded checkpoint is refused with "run it with mpirun -n N"
        prompts, eos = prepare()
        drafter = None if args.no_drafter else drafter_dir
        backend = load_torch_backend(target_dir, drafter, DTYPES[args.dtype], args.device, kv_pages(args, prompts), args.page_size, args.block_size,
                                     cpu_weights=args.cpu_weights)
        mode += "" if args.no_drafter else f" block={backend.block_size}"
        policy = draft_policy(args, backend, str(ckpt), drafter, len(prompts))
        return run_generation(args, backend, tokenizers[0], prompts, eos, target_cfg.max_position_embeddings, mode, policy=policy)
    if args.cpu_weights != "dense":
        raise ConfigError(f"--cpu-weights {args.cpu_weights} runs in one process only (not under tensor parallelism)", key="--cpu-weights")
    tp = init_tp(args.device, args.tp_timeout)
    try:
        # Rank 0 tokenizes and the others receive token ids; from there every rank runs the same loop on the
        # same inputs, and all derive the same accepted lengths (tp.py says why they agree bit for bit).
        (prompts, eos), _ = prepare_on_rank_0(tp, lambda: (prepare(), None))
        backend = load_tp_backend(ckpt, tp, DTYPES[args.dtype], not args.no_drafter, args.tp_drafter, kv_pages(args, prompts), args.page_size, args.block_size)
        mode += f", tp={tp.world_size}" if args.no_drafter else f" block={backend.block_size}, tp={tp.world_size}, {args.tp_drafter} drafter"
        return run_generation(args, backend, tokenizers[0] if tokenizers else None, prompts, eos, target_cfg.max_position_embeddings, mode, tp)
    finally:
        tp.close()  # also on errors: exiting with a live gloo group aborts the process


def run_generation(args, backend, tokenizer, prompts: list[list[int]], eos, max_seq_len: int, mode: str, tp=None, policy=None) -> int:
    """Generate and print the outputs and statistics (on rank 0 only under TP: the others hold no tokenizer)."""
    from .runtime import Generator
    from .sampling import SamplingParams

    printer = tp is None or tp.rank == 0
    tree = tree_from_args(args) if backend.max_drafts else None
    if tree is not None and tp is not None:
        raise ConfigError("--tree runs in one process only (not under tensor parallelism yet)", key="--tree")
    if tree is not None and getattr(args, "drafter_type", "dflash") != "dflash":
        raise ConfigError("--tree needs a DFlash drafter (one pass scores every slot of the block); the eagle3 baseline drafts a chain",
                          key="--tree")
    gen = Generator(backend, eos_token_ids=eos, max_batch=min(args.max_batch, len(prompts)), max_seq_len=max_seq_len,
                    max_verify_tokens=args.max_verify_tokens, draft_policy=policy, tree=tree)
    if policy is not None:
        mode += ", draft length auto"
    if tree is not None:
        mode += f", tree {tree.nodes} nodes top-{tree.top_k}"
    params = SamplingParams(
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        seed=args.seed, ignore_eos=args.ignore_eos,
    )

    stream = len(prompts) == 1 and not args.quiet and printer
    streamed: list[int] = []
    printed = [0]

    def on_token(_seq_id: int, token: int) -> None:
        # Decode the whole output each time so multi-byte characters print only when complete.
        streamed.append(token)
        text = tokenizer.decode(streamed, skip_special_tokens=True)
        if not text.endswith("\ufffd"):
            sys.stdout.write(text[printed[0]:])
            sys.stdout.flush()
            printed[0] = len(text)

    start = time.perf_counter()
    outputs = gen.generate(prompts, params, on_token=on_token if stream else None)
    wall = time.perf_counter() - start
    if not printer:
        return 0
    for i, out in enumerate(outputs):
        if stream:
            sys.stdout.write("\n")
        elif not args.quiet:
            print(f"--- [{i}] ({out.finish_reason}, {len(out.output_ids)} tokens)")
            print(tokenizer.decode(out.output_ids, skip_special_tokens=True))
    steps = sum(len(o.accepted_lengths) for o in outputs)
    decoded = sum(len(o.output_ids) - 1 for o in outputs)
    decode_s = max((o.decode_s for o in outputs), default=0.0)
    tau = sum(sum(o.accepted_lengths) for o in outputs) / steps if steps else 0.0
    total = sum(len(o.output_ids) for o in outputs)
    hist: dict[int, int] = {}
    for o in outputs:
        for k, v in o.histogram().items():
            hist[k] = hist.get(k, 0) + v
    collectives = ""
    if tp is not None:
        calls, sent = tp.calls, tp.bytes
        collectives = (f"; rank 0 sent {calls['all_reduce']} all-reduces ({sent['all_reduce'] / 2**20:.2f} MiB), "
                       f"{calls['all_gather']} all-gathers ({sent['all_gather'] / 2**20:.2f} MiB)")
    print(
        f"[{mode}] {len(outputs)} request(s), {total} tokens in {wall:.2f}s; "
        f"tau={tau:.2f} tokens/step; decode {decoded / decode_s if decode_s else 0:.1f} tokens/s; "
        f"acceptance histogram {dict(sorted(hist.items()))}{collectives}; finish={finish_summary(outputs)}",
        file=sys.stderr,
    )
    return 0


def cmd_calibrate(args) -> int:
    """Measure (or, cached, show) the step cost that `--draft-length auto` chooses draft lengths from."""
    from .draft_length import CONTEXT, cache_key, calibration_dir, calibration_identity, load_or_calibrate, step_cost_path
    from .kv_cache import pool_pages
    from .progress import progress_bar

    if args.threads:
        torch.set_num_threads(args.threads)
    check_model_dirs(args)
    target_dir, drafter_dir = checkpoint_parts(args.checkpoint) if args.checkpoint else (args.target, requested_drafter(args))
    if drafter_dir is None:
        raise ConfigError("the step cost is a drafting backend's: pass --drafter (or --checkpoint)", key="--drafter")
    pages = args.kv_pages or pool_pages(args.max_batch, CONTEXT, args.page_size, args.block_size)
    backend = load_torch_backend(target_dir, drafter_dir, DTYPES[args.dtype], "cpu", num_pages=pages,
                                 page_size=args.page_size, block_size=args.block_size, drafter_type=args.drafter_type, cpu_weights=args.cpu_weights)
    key = cache_key(*calibration_identity(args.checkpoint or target_dir, drafter_dir, weights_label(args.dtype, args.cpu_weights), args.drafter_type,
                                          backend.block_size))
    directory = calibration_dir()
    path = step_cost_path(directory, key)
    if args.force and path.exists():
        path.unlink()
    cached = path.is_file()
    start = time.perf_counter()
    bar = progress_bar(desc="calibrating step cost", unit="cell", disable=args.quiet)
    try:
        cost = load_or_calibrate(backend, key, directory, args.max_batch, progress=bar.update)
    finally:
        bar.close()
    if cost is None:
        raise ConfigError("the KV pool cannot hold one calibration sequence; raise it", key="--kv-pages")
    print(f"# step cost, seconds per draft + verify step ({'cached' if cached else f'measured in {time.perf_counter() - start:.1f} s'}): {path}")
    print("| batch | " + " | ".join(f"{k} drafts" for k in cost.drafts) + " |")
    print("|---|" + "---|" * len(cost.drafts))
    for b, row in zip(cost.batches, cost.seconds):
        print(f"| {b} | " + " | ".join(f"{t * 1e3:.1f} ms ({t / row[0]:.2f}×)" for t in row) + " |")
    return 0


def finish_summary(outputs) -> str:
    """Why the requests ended: "stop" (an EOS token) or "length" (--max-new-tokens), with counts when they differ."""
    counts: dict[str, int] = {}
    for o in outputs:
        counts[o.finish_reason] = counts.get(o.finish_reason, 0) + 1
    if len(counts) == 1:
        return next(iter(counts))
    return ",".join(f"{reason}:{n}" for reason, n in sorted(counts.items()))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dflash-trt", description="DFlash block-diffusion speculative decoding")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate text with the PyTorch reference runtime", formatter_class=HELP_FORMAT,
                       description="Generate with the PyTorch reference runtime: DFlash (or the EAGLE-3-style baseline) against the "
                                   "target's own greedy output, or plain decoding with --no-drafter. Text streams to stdout; one "
                                   "statistics line (mode, tau, tokens/s, acceptance, finish reasons) goes to stderr.")
    add_model_flags(g, "generate", cpu_weights=True)
    add_tp_flags(g)
    g.add_argument("--device", choices=["cpu", "cuda"], default="cpu", help="cuda: one GPU per rank (NCCL)")
    g.add_argument("--prompt", action="append", help="prompt text (repeatable)")
    g.add_argument("--prompts", help="file with one prompt per line, or .jsonl with 'prompt' / 'turns'")
    g.add_argument("--max-new-tokens", type=positive_int, default=128, help="tokens generated per prompt at most")
    g.add_argument("--temperature", type=float, default=0.0, help="0: greedy (lossless: the target's own greedy output)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass at T > 0 (1: off)")
    g.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens at T > 0 (0: off)")
    g.add_argument("--seed", type=int, default=0, help="sampling seed (T > 0)")
    g.add_argument("--draft-length", choices=["auto", "fixed"], default="auto",
                   help="auto: each step drafts the count that maximises expected tokens/s, from a step-cost calibration "
                        "(measured once, cached) and the running acceptance, down to plain decoding; fixed: always block_size - 1")
    add_tree_flags(g)
    g.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence tokens (generate --max-new-tokens each)")
    g.add_argument("--no-chat-template", action="store_true", help="encode prompts as plain text, without the tokenizer's chat template")
    g.add_argument("--quiet", action="store_true", help="print only the final statistics")
    g.set_defaults(func=cmd_generate)

    c = sub.add_parser("calibrate", formatter_class=HELP_FORMAT, help="measure the step cost --draft-length auto uses (cached per machine and model)",
                       description="Time one draft + verify step for each batch size and draft count once, on this machine, for this "
                                   "model pair, dtype and block size, and cache it where generate / bench / serve find it "
                                   "($DFLASH_TRT_CALIBRATION, else calibration/ under the package cache). Prints the table.")
    add_model_flags(c, "calibrate", cpu_weights=True)
    c.set_defaults(max_batch=16)
    c.add_argument("--force", action="store_true", help="measure again even if a cached table exists")
    c.add_argument("--quiet", action="store_true", help="no progress bar")
    c.set_defaults(func=cmd_calibrate)

    fetch.register_cli(sub)
    convert.register_cli(sub)
    bench.register_cli(sub)
    plan.register_cli(sub)
    deploy.register_cli(sub)
    from . import serve  # serve, triton-repo (their server dependencies load only when they run)
    from .trtllm import build_config  # dflash-trt build (tensorrt_llm loads only when it runs)

    serve.register_cli(sub)
    build_config.register_cli(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    resolve_auto_dtype(args, log=lambda line: print(line, file=sys.stderr))
    try:
        return args.func(args)
    except DFlashError as e:
        sys.stderr.write(f"error: {e}\n")  # one write: lines from several MPI ranks do not interleave
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
