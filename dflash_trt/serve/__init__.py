"""Serving: `dflash-trt serve` (OpenAI-compatible HTTP server) and `dflash-trt triton-repo`
(a Triton Inference Server model repository). Both run the same `EngineCore` over the runtime.

fastapi / uvicorn / prometheus_client are imported only when `serve` runs (`pip install dflash-trt[serve]`).
"""

from __future__ import annotations

from pathlib import Path


def _model_args(p, launcher: str = "serve", cpu_weights: bool = False) -> None:
    from ..flags import positive_int
    from ..loading import add_model_flags

    add_model_flags(p, launcher, cpu_weights=cpu_weights)
    p.add_argument("--max-model-len", type=positive_int, default=2048, help="prompt + output tokens per request (capped by the target's limit)")
    p.add_argument("--default-max-tokens", type=positive_int, default=256, help="max_tokens when a request does not say")
    p.add_argument("--model-name", help="the model id clients send (default: the target directory's name)")


def _resolve_dirs(args) -> None:
    """--checkpoint DIR stands for --target DIR/target --drafter DIR/drafter --tokenizer DIR."""
    from ..loading import check_model_dirs

    check_model_dirs(args)
    if args.checkpoint:
        from ..loading import checkpoint_parts

        ckpt = Path(args.checkpoint)
        args.target, args.drafter = (str(d) for d in checkpoint_parts(ckpt))
        args.tokenizer = args.tokenizer or str(ckpt)
        args.model_name = args.model_name or ckpt.resolve().name


def cmd_serve(args) -> int:
    import torch

    from ..loading import requested_drafter
    from ..tp import launched_world_size
    from .engine import load_model
    from .server import Server, run

    _resolve_dirs(args)
    if args.max_queue < 0:
        from ..errors import ConfigError

        raise ConfigError(f"must be >= 0, got {args.max_queue}", key="--max-queue")
    if args.threads:
        torch.set_num_threads(args.threads)
    from ..tree import tree_from_args

    tree = tree_from_args(args)
    if tree is not None and (launched_world_size() > 1 or args.drafter_type != "dflash"):
        from ..errors import ConfigError

        raise ConfigError("--tree needs a DFlash drafter in one process (not the eagle3 baseline, not under tensor parallelism yet)",
                          key="--tree")
    if launched_world_size() > 1:
        from .followers import serve_tp

        return serve_tp(args)
    model = load_model(
        args.target, requested_drafter(args), tokenizer_dir=args.tokenizer, drafter_type=args.drafter_type, dtype=args.dtype,
        max_batch=args.max_batch, max_model_len=args.max_model_len, kv_pages=args.kv_pages, page_size=args.page_size,
        block_size=args.block_size, max_verify_tokens=args.max_verify_tokens, cpu_weights=args.cpu_weights, tree=tree,
    )
    name = args.model_name or Path(args.target).resolve().name
    server = Server(model, name, max_queue=args.max_queue, default_max_tokens=args.default_max_tokens)
    mode = "autoregressive" if model.drafter is None else f"{args.drafter_type} block={model.block_size}"
    if model.drafter is not None and tree is not None:
        mode += f", tree {tree.nodes} nodes top-{tree.top_k}"
    print(f"serving '{name}' [{mode}] on http://{args.host}:{args.port}/v1 (max batch {args.max_batch}, queue {args.max_queue})", flush=True)
    run(server, args.host, args.port, args.log_level)
    return 0


def cmd_triton_repo(args) -> int:
    from ..loading import requested_drafter
    from .triton_repo import write_repository

    _resolve_dirs(args)
    out = write_repository(
        args.out, target=args.target, drafter=requested_drafter(args), model_name=args.model_name or "dflash",
        tokenizer=args.tokenizer, drafter_type=args.drafter_type, block_size=args.block_size, dtype=args.dtype,
        max_batch=args.max_batch, max_model_len=args.max_model_len, kv_pages=args.kv_pages, page_size=args.page_size,
        default_max_tokens=args.default_max_tokens, max_verify_tokens=args.max_verify_tokens, force=args.force,
    )
    print(out)
    return 0


def register_cli(sub) -> None:
    from ..flags import HELP_FORMAT
    from ..loading import add_tp_flags
    from ..tree import add_tree_flags

    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server (streaming, continuous batching, Prometheus metrics)", formatter_class=HELP_FORMAT)
    _model_args(s, "serve", cpu_weights=True)
    add_tree_flags(s)
    s.add_argument("--host", default="127.0.0.1", help="address to listen on (loopback by default)")
    s.add_argument("--port", type=int, default=8000, help="TCP port")
    s.add_argument("--max-queue", type=int, default=64, help="requests waiting beyond --max-batch; more get 429")
    s.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"], help="uvicorn's log level")
    add_tp_flags(s)
    s.set_defaults(func=cmd_serve)

    t = sub.add_parser("triton-repo", help="write a Triton Inference Server model repository (Python backend, decoupled streaming)",
                       formatter_class=HELP_FORMAT)
    t.add_argument("--out", required=True, help="repository directory to create")
    _model_args(t, "triton-repo")
    t.add_argument("--force", action="store_true", help="replace --out if it exists")
    t.set_defaults(func=cmd_triton_repo)
