"""The engine thread: one thread owns the Generator (and so the backend), the rest talk to it by messages.

torch is not safe under concurrent forward calls, and the Generator's queues are not locked, so
every call into them happens on one thread. It loops: take new requests and cancellations
from a thread-safe inbox, run one `Generator.step()`, hand the tokens each request gained in
that step (and the requests that finished) to a sink. Requests therefore join and leave the
running batch at step boundaries (continuous batching), and a cancelled request's KV pages
are freed at the next boundary.

The sink is called on the engine thread once per step. The HTTP server's sink forwards the
events to its asyncio loop (`loop.call_soon_threadsafe`); the Triton model's sink sends
responses directly. Text is produced by `IncrementalDetokenizer`, which also applies `stop`
strings; it runs wherever the sink's consumer runs.

Under tensor parallelism (`mpirun -n N dflash-trt serve --checkpoint DIR`) rank 0's EngineCore
also publishes, at each step boundary, the submissions and cancellations it applied and whether
it steps; the other ranks replay them on their own Generators (followers.py).
"""

from __future__ import annotations

import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from ..errors import DFlashError
from ..runtime import Generator, RequestOutput
from ..sampling import SamplingParams

if TYPE_CHECKING:
    from ..tp import TPGroup
    from .followers import StepBroadcast


class EngineStepError(DFlashError):
    """A step failed (a bug or a backend failure, not the request's fault); its requests were cancelled."""


@dataclass(eq=False)
class Request:
    """One request as the engine sees it. `context` is the caller's (the engine never reads it)."""

    prompt_ids: list[int]
    params: SamplingParams
    context: Any = None
    seq_id: int | None = None  # set on the engine thread at submission
    submitted_at: float = field(default_factory=time.perf_counter)


@dataclass
class StepEvents:
    """What one step produced. `tokens`: new token ids per request, in order; `finished`: the runtime's
    output per request that ended (finish_reason "stop" | "length" | "cancelled"; None: cancelled
    before it was admitted); `errors`: requests the engine could not run: the runtime's RequestError /
    KVCacheFullError at submission, EngineStepError when a step failed."""

    tokens: dict[Request, list[int]] = field(default_factory=dict)
    finished: dict[Request, RequestOutput | None] = field(default_factory=dict)
    errors: dict[Request, Exception] = field(default_factory=dict)
    num_waiting: int = 0
    num_running: int = 0
    free_kv_pages: int | None = None  # pages free in the target's KV pool after the step (None: backend does not say)
    step_s: float = 0.0

    def __bool__(self) -> bool:
        return bool(self.tokens or self.finished or self.errors)


class EngineCore:
    """Runs `generator` on a daemon thread; `submit` / `cancel` are safe from any thread."""

    def __init__(self, generator: Generator, sink: Callable[[StepEvents], None], idle_poll_s: float = 0.05,
                 on_idle: Callable[[], None] | None = None, broadcast: StepBroadcast | None = None):
        self.generator = generator
        self.broadcast = broadcast  # TP rank 0: the followers replay what this engine applies
        self._ops: list[tuple] = []  # applied since the last publish (engine thread only)
        self.sink = sink
        self.idle_poll_s = idle_poll_s
        self.on_idle = on_idle  # called on the engine thread about every idle_poll_s while there is work or not
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[int, Request] = {}  # seq_id -> request, engine thread only
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="dflash-engine", daemon=True)
        self._events = StepEvents()
        self.fatal: BaseException | None = None
        self.steps = 0

    # -- any thread ---------------------------------------------------------------------------

    def start(self) -> EngineCore:
        self._thread.start()
        return self

    def check(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Validate now (raises RequestError / KVCacheFullError), so callers can answer 400 at once."""
        self.generator.check(prompt_ids, params)

    def submit(self, request: Request) -> Request:
        self._inbox.put(("submit", request))
        return request

    def cancel(self, request: Request) -> None:
        """Stop a request at the next step boundary and free its KV pages; a finished one is left alone."""
        self._inbox.put(("cancel", request))

    def shutdown(self, timeout: float = 10.0) -> None:
        self._stop.set()
        self._inbox.put(("wake", None))
        if self._thread.is_alive():
            self._thread.join(timeout)

    @property
    def alive(self) -> bool:
        # fatal is set before the failed step's errors reach the sink, so a client that saw its 500 and then asks
        # /health finds the engine dead even while its thread is still on its way out
        return self.fatal is None and self._thread.is_alive() and not self._stop.is_set()

    # -- engine thread ------------------------------------------------------------------------

    def _drain(self, events: StepEvents, block: bool) -> None:
        try:
            msg = self._inbox.get(timeout=self.idle_poll_s) if block else self._inbox.get_nowait()
        except queue.Empty:
            return
        while True:
            self._handle(msg, events)
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return

    def _handle(self, msg, events: StepEvents) -> None:
        kind, request = msg
        gen = self.generator
        if kind == "submit":
            # under TP the seed Generator.submit would draw is drawn here, once, and sent to every rank
            params = request.params.seeded() if self.broadcast is not None else request.params
            try:
                request.seq_id = gen.submit(request.prompt_ids, params, on_token=self._on_token)
            except DFlashError as e:  # refused by a check every rank would make alike: nothing to replay
                events.errors[request] = e
                return
            self._live[request.seq_id] = request
            if self.broadcast is not None:
                self._ops.append(("submit", request.seq_id, request.prompt_ids, params))
        elif kind == "cancel":
            if request.seq_id is not None and self._live.get(request.seq_id) is request:
                del self._live[request.seq_id]
                events.finished[request] = gen.cancel(request.seq_id)  # None if it was still waiting
                if self.broadcast is not None:
                    self._ops.append(("cancel", request.seq_id))

    def _on_token(self, seq_id: int, token: int) -> None:
        request = self._live.get(seq_id)
        if request is not None:  # self._events: the StepEvents of the step in progress
            self._events.tokens.setdefault(request, []).append(token)

    def _run(self) -> None:
        gen = self.generator
        try:
            while not self._stop.is_set():
                self._events = events = StepEvents()
                self._drain(events, block=not gen.has_work)
                if self._stop.is_set():
                    break
                if self.broadcast is not None and not self._publish(events):
                    break
                if gen.has_work:
                    start = time.perf_counter()
                    try:
                        outputs = gen.step()
                    except Exception as e:  # never let one bad step kill the server: fail what was in flight
                        traceback.print_exc()
                        outputs = []
                        self._fail_all(events, e)
                        if self.broadcast is not None:  # the ranks may have stopped at different collectives: no retry
                            self.fatal = e
                            self.sink(events)
                            break
                    events.step_s = time.perf_counter() - start
                    self.steps += 1
                    for out in outputs:
                        request = self._live.pop(out.seq_id, None)
                        if request is not None:
                            events.finished[request] = out
                events.num_waiting, events.num_running = gen.num_waiting, gen.num_running
                events.free_kv_pages = free_kv_pages(gen.backend)
                if events or events.step_s:
                    self.sink(events)
                if self.on_idle is not None:
                    self.on_idle()
        except BaseException as e:  # a broken sink: record it, /health reports it
            self.fatal = e
            traceback.print_exc()
            raise
        finally:
            if self.broadcast is not None and self.fatal is None:
                self.broadcast.shutdown()

    def _publish(self, events: StepEvents) -> bool:
        """TP rank 0: send this boundary's operations to the followers (when there are any, when it steps, or
        as a heartbeat while idle). False when a follower is gone: its requests have failed, the engine stops."""
        gen = self.generator
        if not (self._ops or gen.has_work or self.broadcast.heartbeat_due()):
            return True
        ops, self._ops = self._ops, []
        try:
            self.broadcast.publish(ops, step=gen.has_work)
        except DFlashError as e:
            traceback.print_exc()
            self._fail_all(events, e)
            self.fatal = e
            self.sink(events)
            return False
        return True

    def _fail_all(self, events: StepEvents, error: Exception) -> None:
        for seq_id, request in list(self._live.items()):
            try:
                self.generator.cancel(seq_id)
            except Exception:
                traceback.print_exc()
            events.errors[request] = EngineStepError(f"the engine step failed ({type(error).__name__}: {error})")
            events.tokens.pop(request, None)
        self._live.clear()


@dataclass
class LoadedModel:
    """A Generator over the torch backend, with what a server needs to know about it."""

    generator: Generator
    tokenizer: Any
    max_model_len: int  # prompt + output tokens per request
    block_size: int  # verify block size (1 without a drafter)
    drafter: str | None
    broadcast: StepBroadcast | None = None  # TP rank 0: where its engine publishes each step for the other ranks


def load_model(
    target_dir: str, drafter_dir: str | None, *, tokenizer_dir: str | None = None, drafter_type: str = "dflash",
    dtype: str = "fp32", max_batch: int = 8, max_model_len: int | None = 2048, kv_pages: int | None = None,
    page_size: int = 16, block_size: int | None = None, max_verify_tokens: int | None = None,
    tp: TPGroup | None = None, tp_drafter: str = "sharded", cpu_weights: str = "dense", tree=None,
) -> LoadedModel:
    """Load target (+ drafter) and tokenizer the way `dflash-trt generate` does. Without `kv_pages`
    the pool holds `max_batch` requests of `max_model_len` tokens each. With `tp` (target_dir and
    drafter_dir inside one `dflash-trt convert --tp N` directory) each rank loads its own shards; rank 0
    alone reads the tokenizer (None on the others) and sends the EOS ids."""
    from ..loading import DTYPES, checkpoint_root, generation_eos_ids, load_tokenizer, load_torch_backend, load_tp_backend, prepare_on_rank_0
    from ..config import load_target_config

    target_cfg = load_target_config(target_dir)  # fail on the config before touching weights
    limit = target_cfg.max_position_embeddings
    max_model_len = min(max_model_len or limit, limit)
    if kv_pages is None:
        from ..kv_cache import pool_pages

        kv_pages = pool_pages(max_batch, max_model_len, page_size, block_size)
    if tp is None:
        tokenizer = load_tokenizer(tokenizer_dir or target_dir)
        backend = load_torch_backend(target_dir, drafter_dir, DTYPES[dtype], "cpu", kv_pages, page_size, block_size, drafter_type, cpu_weights)
        eos = generation_eos_ids(target_dir, tokenizer, tokenizer_dir)
    else:
        if cpu_weights != "dense":
            from ..errors import ConfigError

            raise ConfigError("--cpu-weights int8 runs in one process only (not under tensor parallelism)", key="--cpu-weights")

        def prepare():
            tok = load_tokenizer(tokenizer_dir or target_dir)
            return sorted(generation_eos_ids(target_dir, tok, tokenizer_dir)), tok

        eos, tokenizer = prepare_on_rank_0(tp, prepare)
        backend = load_tp_backend(checkpoint_root(target_dir), tp, DTYPES[dtype], drafter_dir is not None, tp_drafter, kv_pages,
                                  page_size, block_size)
    gen = Generator(backend, eos_token_ids=eos, max_batch=max_batch, use_drafter=drafter_dir is not None, max_seq_len=max_model_len,
                    max_verify_tokens=max_verify_tokens, tree=tree)  # tree (tree.TreeSpec): tree verification for greedy requests
    return LoadedModel(gen, tokenizer, max_model_len, backend.block_size, drafter_dir)


def free_kv_pages(backend) -> int | None:
    """Free pages in the backend's target KV pool (the torch backend's allocator), or None."""
    cache = getattr(backend, "target_cache", None)
    return cache.num_free_pages if cache is not None else None


class IncrementalDetokenizer:
    """Token ids in, text deltas out; applies stop strings.

    Decodes the whole output each time and emits the new suffix, so multi-byte characters split
    across tokens come out whole: a trailing U+FFFD (an incomplete UTF-8 sequence) is held back
    until the next token completes it. Text that could be the start of a stop string is held
    back too; when a stop string appears, the text is cut just before it and `stopped` is set.
    """

    def __init__(self, tokenizer, stop: list[str] | tuple[str, ...] = (), skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.text = ""  # the final text so far (after a stop: the text before the stop string)
        self.emitted = 0  # characters of self.text already returned
        self.stopped = False
        self.num_tokens_at_stop: int | None = None

    def _held_back(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        best = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, len(text)), best, -1):
                if text.endswith(s[:n]):
                    best = n
                    break
        return best

    def add(self, ids: list[int]) -> str:
        """Add tokens; return the text that is now final. After a stop string, returns '' forever."""
        if self.stopped or not ids:
            return ""
        self.ids.extend(ids)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=self.skip_special_tokens)
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if hits:
            self.stopped = True
            self.num_tokens_at_stop = len(self.ids)
            self.text = text[: min(hits)]
            return self._emit(len(self.text))
        self.text = text
        end = len(text.rstrip("\ufffd"))
        end -= self._held_back(text[:end])
        return self._emit(end)

    def finish(self) -> str:
        """The request ended: return everything still held back (but never a stop string)."""
        return self._emit(len(self.text))

    def _emit(self, end: int) -> str:
        if end <= self.emitted:
            return ""
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta
