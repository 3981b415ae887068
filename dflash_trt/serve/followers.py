"""Tensor-parallel serving: `mpirun -n N dflash-trt serve --checkpoint DIR` (DIR from `dflash-trt convert --tp N`).

Rank 0 runs the HTTP server and the EngineCore as with one process. Ranks 1..N-1 run no server: they
follow. At each step boundary rank 0's engine publishes what it applied to its Generator since the last
boundary (submissions with their prompt ids and SamplingParams, the seed resolved on rank 0; cancellations)
and whether it steps, in one `broadcast_object`; a follower applies the same operations to its own Generator
in the same order and steps when rank 0 does. The Generators then hold the same queues, so every step runs
the same collectives on the same inputs, and greedy and seeded tokens agree without more (tp.py says why).

Idle: rank 0 publishes nothing while it has no work; followers wait inside the broadcast. The process group's
timeout (`--tp-timeout`) bounds every wait, so rank 0 sends an empty publish (a heartbeat) every timeout/4
seconds while idle. A heartbeat rather than a wait with no timeout: a follower then still learns within the
timeout that rank 0's engine has hung, and no rank can wait forever.

Ending: rank 0's engine publishes `None` (shutdown) when the server stops (SIGINT / SIGTERM to rank 0), and
every rank exits 0. A follower that dies breaks rank 0's next collective: its requests fail with
EngineStepError (HTTP 500), the engine stops (/health 503), and the server exits shortly after with an error.
Followers ignore SIGINT / SIGTERM: they end when rank 0 tells them or when the group breaks.
"""

from __future__ import annotations

import signal
import sys
import threading
import time

from ..errors import ConfigError
from ..runtime import Generator
from ..tp import DistributedError, TPGroup, init_tp

FATAL_GRACE_S = 1.0  # rank 0 keeps answering (500s, an unhealthy /health) this long after its engine died, then exits


class StepBroadcast:
    """Rank 0's side: publish one step boundary's operations to the followers."""

    def __init__(self, tp: TPGroup, heartbeat_s: float):
        self.tp = tp
        self.heartbeat_s = heartbeat_s
        self.last_sent = time.monotonic()

    def heartbeat_due(self) -> bool:
        return time.monotonic() - self.last_sent >= self.heartbeat_s

    def publish(self, ops: list[tuple], step: bool) -> None:
        """ops: ("submit", seq_id, prompt_ids, params) | ("cancel", seq_id), in the order they were applied."""
        self.tp.broadcast_object((ops, step))
        self.last_sent = time.monotonic()

    def shutdown(self) -> None:
        try:
            self.tp.broadcast_object(None)
        except DistributedError as e:  # a follower is already gone: nobody left to tell
            print(f"warning: {e}", file=sys.stderr, flush=True)


def follow(generator: Generator, tp: TPGroup) -> None:
    """Rank r > 0: replay rank 0's operations on `generator` and step when it steps, until it says shutdown."""
    while (message := tp.broadcast_object(None)) is not None:
        ops, step = message
        for op in ops:
            if op[0] == "submit":
                _, seq_id, prompt_ids, params = op
                if generator.submit(prompt_ids, params) != seq_id:
                    raise DistributedError(f"[rank {tp.rank}/{tp.world_size}] request ids diverged from rank 0's at {seq_id}")
            else:
                generator.cancel(op[1])
        if step != generator.has_work:
            raise DistributedError(f"[rank {tp.rank}/{tp.world_size}] rank 0 {'steps' if step else 'idles'}, this rank would not")
        if step:
            generator.step()


def serve_tp(args) -> int:
    """The `serve` command when launched with more than one rank."""
    from .engine import load_model
    from .server import Server, create_app

    if not args.checkpoint:
        raise ConfigError("tensor-parallel serving loads a converted checkpoint: pass --checkpoint DIR (dflash-trt convert --tp N)",
                          key="--checkpoint")
    tp = init_tp("cpu", args.tp_timeout)
    try:
        model = load_model(
            args.target, None if args.no_drafter else args.drafter, tokenizer_dir=args.tokenizer, dtype=args.dtype,
            max_batch=args.max_batch, max_model_len=args.max_model_len, kv_pages=args.kv_pages, page_size=args.page_size,
            block_size=args.block_size, max_verify_tokens=args.max_verify_tokens, tp=tp, tp_drafter=args.tp_drafter,
            cpu_weights=args.cpu_weights,
        )
        if tp.rank != 0:
            for sig in (signal.SIGINT, signal.SIGTERM):  # launchers signal every rank; rank 0 decides when we stop
                signal.signal(sig, signal.SIG_IGN)
            follow(model.generator, tp)
            return 0
        model.broadcast = StepBroadcast(tp, heartbeat_s=args.tp_timeout / 4)
        server = Server(model, args.model_name, max_queue=args.max_queue, default_max_tokens=args.default_max_tokens)
        mode = ("autoregressive" if model.drafter is None else f"dflash block={model.block_size}") + f", tp={tp.world_size}"
        print(f"serving '{args.model_name}' [{mode}] on http://{args.host}:{args.port}/v1 (max batch {args.max_batch}, "
              f"queue {args.max_queue})", flush=True)
        _run_until_engine_dies(server, create_app(server), args)
        if server.engine.fatal is not None:
            raise DistributedError(f"[rank 0/{tp.world_size}] the engine stopped: {server.engine.fatal}")
        return 0
    finally:
        tp.close()


def _run_until_engine_dies(server, app, args) -> None:
    """uvicorn until SIGINT / SIGTERM, or until FATAL_GRACE_S after the engine has died (a lost rank cannot come back)."""
    import uvicorn

    http = uvicorn.Server(uvicorn.Config(app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=5))

    def watch() -> None:
        while not http.should_exit:
            if server.engine.fatal is not None:
                time.sleep(FATAL_GRACE_S)
                http.should_exit = True
                return
            time.sleep(0.1)

    threading.Thread(target=watch, name="dflash-engine-watch", daemon=True).start()
    # uvicorn re-raises the SIGINT / SIGTERM it shut down on, under the handlers it found: make those no-ops, so the
    # rank exits 0 after its orderly shutdown (and mpirun with it) instead of dying of the signal.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    http.run()
