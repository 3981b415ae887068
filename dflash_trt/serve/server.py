"""The OpenAI-compatible HTTP server: FastAPI routes over one `EngineCore`.

/v1/completions and /v1/chat/completions (JSON or SSE streaming in OpenAI's chunk format),
/v1/models, /health, /metrics (Prometheus). Each HTTP request becomes one engine `Request`
per prompt; the engine thread's per-step events are forwarded to the asyncio loop and from
there to a per-HTTP-request `asyncio.Queue`. Admission is bounded: at most
`max_batch + max_queue` requests in flight, the next gets 429 with Retry-After. Errors
have OpenAI's body `{"error": {"message", "type", "param", "code"}}`; nothing a client
sends can stop the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
import traceback
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from fastapi import FastAPI
from fastapi import Request as HTTPRequest
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from pydantic import ValidationError

from ..errors import DFlashError
from ..runtime import RequestOutput
from ..sampling import SamplingParams
from .engine import (
    EngineCore,
    EngineStepError,
    IncrementalDetokenizer,
    LoadedModel,
    Request,
    StepEvents,
)
from .protocol import APIError, ChatCompletionRequest, CompletionRequest

DISCONNECT_POLL_S = 0.25  # how often a non-streaming request checks that its client is still there


class Metrics:
    """Prometheus metrics on a registry of their own (several servers can live in one process)."""

    def __init__(self, block_size: int, total_kv_pages: int):
        r = self.registry = CollectorRegistry()
        self.requests = Counter("dflash_requests", "Finished requests", ["endpoint", "finish_reason"], registry=r)
        self.errors = Counter("dflash_request_errors", "Requests answered with an error", ["status"], registry=r)
        self.prompt_tokens = Counter("dflash_prompt_tokens", "Prompt tokens of admitted requests", registry=r)
        self.generation_tokens = Counter("dflash_generation_tokens", "Tokens generated (all requests, cancelled included)", registry=r)
        self.verify_steps = Counter("dflash_verify_steps", "Target verify steps, summed over requests", registry=r)
        self.committed_tokens = Counter("dflash_committed_tokens", "Tokens committed by verify steps (bonus included)", registry=r)
        self.tau = Gauge("dflash_tau", "Mean tokens committed per verify step since start (committed / verify steps)", registry=r)
        self.acceptance = Gauge("dflash_draft_acceptance_rate", "Accepted drafts / drafted tokens since start ((tau - 1) / (block_size - 1))", registry=r)
        self.accepted_length = Histogram(
            "dflash_accepted_length", "Tokens committed per verify step", buckets=list(range(1, max(block_size, 1) + 1)), registry=r
        )
        self.block_size = Gauge("dflash_block_size", "Verify block size (1: autoregressive)", registry=r)
        self.block_size.set(block_size)
        self.running = Gauge("dflash_requests_running", "Requests in the running batch", registry=r)
        self.waiting = Gauge("dflash_requests_waiting", "Requests waiting for a batch slot or KV pages", registry=r)
        self.kv_free = Gauge("dflash_kv_free_pages", "Free pages in the target KV pool", registry=r)
        self.kv_total = Gauge("dflash_kv_total_pages", "Pages in the target KV pool", registry=r)
        self.kv_total.set(total_kv_pages)
        self.kv_free.set(total_kv_pages)
        self.steps = Counter("dflash_engine_steps", "Engine steps (prefill and/or one speculative step)", registry=r)
        self.step_s = Histogram("dflash_engine_step_seconds", "Wall time of one engine step", registry=r)
        self.ttft_s = Histogram("dflash_time_to_first_token_seconds", "Request arrival to first token", registry=r)
        self.latency_s = Histogram("dflash_e2e_request_latency_seconds", "Request arrival to last token", registry=r)
        self._block = block_size
        self._steps = self._committed = 0

    def observe_output(self, out: RequestOutput) -> None:
        for n in out.accepted_lengths:
            self.accepted_length.observe(n)
        self.verify_steps.inc(len(out.accepted_lengths))
        self.committed_tokens.inc(sum(out.accepted_lengths))
        self._steps += len(out.accepted_lengths)
        self._committed += sum(out.accepted_lengths)
        if self._steps:
            tau = self._committed / self._steps
            self.tau.set(tau)
            if self._block > 1:
                self.acceptance.set((tau - 1) / (self._block - 1))


def dflash_stats(outputs: list[RequestOutput], block_size: int) -> dict:
    """τ and acceptance over the outputs of one HTTP request (our extension field "dflash")."""
    lengths = [n for o in outputs for n in o.accepted_lengths]
    tau = sum(lengths) / len(lengths) if lengths else 0.0
    hist: dict[str, int] = {}
    for n in sorted(lengths):
        hist[str(n)] = hist.get(str(n), 0) + 1
    return {
        "tau": round(tau, 4),
        "verify_steps": len(lengths),
        "draft_acceptance_rate": round((tau - 1) / (block_size - 1), 4) if block_size > 1 and lengths else None,
        "acceptance_histogram": hist,
        "block_size": block_size,
    }


@dataclass
class Choice:
    """One prompt's generation as the HTTP side sees it."""

    request: Request
    detok: IncrementalDetokenizer
    token_ids: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    output: RequestOutput | None = None
    cancel_sent: bool = False

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)


class Generation:
    """The engine requests of one HTTP request, and the text they have produced so far."""

    def __init__(self, server: Server, prompts: list[list[int]], params: SamplingParams, stop: list[str]):
        self.server = server
        self.queue: asyncio.Queue = asyncio.Queue()
        self.choices = [
            Choice(Request(ids, params, context=(self.queue, i)), IncrementalDetokenizer(server.tokenizer, stop))
            for i, ids in enumerate(prompts)
        ]
        self.arrived = time.perf_counter()
        self.first_token_at: float | None = None
        self.closed = False

    @property
    def prompt_tokens(self) -> int:
        return sum(len(c.request.prompt_ids) for c in self.choices)

    @property
    def completion_tokens(self) -> int:
        return sum(c.completion_tokens for c in self.choices)

    @property
    def done(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    def usage(self) -> dict:
        p, c = self.prompt_tokens, self.completion_tokens
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def stats(self) -> dict:
        return dflash_stats([c.output for c in self.choices if c.output is not None], self.server.block_size)

    def start(self) -> None:
        for c in self.choices:
            self.server.engine.submit(c.request)

    def cancel_unfinished(self) -> None:
        for c in self.choices:
            if c.finish_reason is None and not c.cancel_sent:
                c.cancel_sent = True
                self.server.engine.cancel(c.request)

    async def events(self) -> AsyncIterator[tuple[int, str, str | None]]:
        """(choice index, new text, finish_reason or None) until every choice has finished."""
        while not self.done:
            kind, index, payload = await self.queue.get()
            if kind == "gone":
                raise ClientGone()
            choice = self.choices[index]
            if choice.finish_reason is not None:
                continue
            if kind == "tokens":
                if self.first_token_at is None:
                    self.first_token_at = time.perf_counter()
                    self.server.metrics.ttft_s.observe(self.first_token_at - self.arrived)
                text = choice.detok.add(payload)
                choice.token_ids = choice.detok.ids[: choice.detok.num_tokens_at_stop]
                if choice.detok.stopped and not choice.cancel_sent:
                    choice.cancel_sent = True  # a stop string: no need to generate more
                    self.server.engine.cancel(choice.request)
                if text:
                    yield index, text, None
            elif kind == "finished":
                choice.output = payload
                text = choice.detok.finish()
                if choice.detok.stopped:
                    choice.finish_reason = "stop"
                else:
                    choice.finish_reason = payload.finish_reason if payload is not None else "cancelled"
                yield index, text, choice.finish_reason
            elif kind == "error":
                raise payload


class ClientGone(Exception):
    """The HTTP client disconnected before its response was complete."""


class Server:
    def __init__(self, model: LoadedModel, model_name: str, max_queue: int = 64, default_max_tokens: int = 256):
        self.model = model
        self.tokenizer = model.tokenizer
        self.model_name = model_name
        self.max_model_len = model.max_model_len
        self.block_size = model.block_size
        self.default_max_tokens = default_max_tokens
        gen = model.generator
        self.max_batch = gen.max_batch
        self.capacity = gen.max_batch + max_queue  # requests in flight (running + waiting)
        self.in_flight = 0
        self.metrics = Metrics(self.block_size, gen.backend.num_pages)
        self.engine = EngineCore(gen, sink=self._sink, broadcast=model.broadcast)
        self.loop: asyncio.AbstractEventLoop | None = None
        self.created = int(time.time())
        self._latency_ema_s = 1.0

    # -- engine thread → loop -------------------------------------------------------------------

    def _sink(self, events: StepEvents) -> None:
        try:
            self.loop.call_soon_threadsafe(self._dispatch, events)
        except RuntimeError:  # the loop has closed (shutdown): nobody is listening any more
            pass

    def _dispatch(self, events: StepEvents) -> None:
        m = self.metrics
        m.running.set(events.num_running)
        m.waiting.set(events.num_waiting)
        if events.free_kv_pages is not None:
            m.kv_free.set(events.free_kv_pages)
        if events.step_s:
            m.steps.inc()
            m.step_s.observe(events.step_s)
        for request, tokens in events.tokens.items():
            m.generation_tokens.inc(len(tokens))
            queue, index = request.context
            queue.put_nowait(("tokens", index, tokens))
        for request, out in events.finished.items():
            if out is not None:
                m.observe_output(out)
            queue, index = request.context
            queue.put_nowait(("finished", index, out))
        for request, error in events.errors.items():
            queue, index = request.context
            if isinstance(error, EngineStepError):
                api_error = APIError(500, str(error), "internal_error")
            else:
                api_error = APIError(400, str(error))
            queue.put_nowait(("error", index, api_error))

    # -- requests -----------------------------------------------------------------------------

    def retry_after_s(self) -> int:
        """A guess at when a slot frees: the recent mean request latency, in whole seconds."""
        return max(1, min(60, math.ceil(self._latency_ema_s)))

    def encode_chat(self, body: ChatCompletionRequest) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise APIError(400, "this model's tokenizer has no chat template; use /v1/completions", param="messages")
        from ..loading import encode_chat

        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        try:
            return encode_chat(self.tokenizer, messages, **(body.chat_template_kwargs or {}))
        except Exception as e:  # a template may raise on message orders it does not support
            raise APIError(400, f"the chat template rejected the messages ({type(e).__name__}: {e})", param="messages") from None

    def encode_completion(self, body: CompletionRequest) -> list[list[int]]:
        prompts = body.prompts()
        if not prompts:
            raise APIError(400, "prompt is empty", param="prompt")
        if len(prompts) > self.max_batch:
            raise APIError(400, f"at most {self.max_batch} prompts per request (--max-batch)", param="prompt")
        return [list(p) if isinstance(p, list) else self.tokenizer.encode(p) for p in prompts]

    def sampling_params(self, body, prompts: list[list[int]], param: str) -> SamplingParams:
        longest = max(len(p) for p in prompts)
        if longest >= self.max_model_len:
            raise APIError(400, f"the prompt has {longest} tokens; this server's maximum context length is {self.max_model_len} "
                           "tokens (prompt + output)", param=param, code="context_length_exceeded")
        requested = body.requested_max_tokens if isinstance(body, ChatCompletionRequest) else body.max_tokens
        if requested is None:
            max_tokens = min(self.default_max_tokens, self.max_model_len - longest)
        elif longest + requested > self.max_model_len:
            raise APIError(400, f"prompt ({longest} tokens) + max_tokens ({requested}) > maximum context length "
                           f"{self.max_model_len}", param="max_tokens", code="context_length_exceeded")
        else:
            max_tokens = requested
        params = SamplingParams(
            max_new_tokens=max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
            stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos, seed=body.seed,
        )
        for ids in prompts:
            try:
                self.engine.check(ids, params)
            except DFlashError as e:
                raise APIError(400, str(e), param=param) from None
        return params

    def admit(self, n: int) -> None:
        if not self.engine.alive:
            raise APIError(503, "the engine is not running", "server_error", code="engine_dead")
        if self.in_flight + n > self.capacity:
            raise APIError(429, f"the server is at capacity ({self.capacity} requests in flight); retry later",
                           "rate_limit_error", code="rate_limit_exceeded", headers={"Retry-After": str(self.retry_after_s())})
        self.in_flight += n

    def close(self, gen: Generation, endpoint: str) -> None:
        """The HTTP side is done with `gen` (answered, failed or client gone); idempotent."""
        if gen.closed:
            return
        gen.closed = True
        gen.cancel_unfinished()
        self.in_flight -= len(gen.choices)
        latency = time.perf_counter() - gen.arrived
        if gen.done:
            self.metrics.latency_s.observe(latency)
            self._latency_ema_s = 0.8 * self._latency_ema_s + 0.2 * latency
        for c in gen.choices:
            self.metrics.requests.labels(endpoint, c.finish_reason or "cancelled").inc()

    async def handle(self, http: HTTPRequest, chat: bool) -> Response:
        endpoint = "chat" if chat else "completions"
        try:
            raw = await http.body()
            try:
                data = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as e:
                raise APIError(400, f"the request body is not valid JSON ({e})") from None
            if not isinstance(data, dict):
                raise APIError(400, "the request body must be a JSON object")
            try:
                body = (ChatCompletionRequest if chat else CompletionRequest).model_validate(data)
            except ValidationError as e:
                err = e.errors()[0]
                loc = ".".join(str(x) for x in err["loc"]) or None
                raise APIError(400, f"{loc + ': ' if loc else ''}{err['msg']}", param=loc) from None
            if body.model != self.model_name:
                raise APIError(404, f"the model '{body.model}' does not exist; this server serves '{self.model_name}'",
                               param="model", code="model_not_found")
            if chat:
                prompts, param = [self.encode_chat(body)], "messages"
            else:
                prompts, param = self.encode_completion(body), "prompt"
            params = self.sampling_params(body, prompts, param)
            self.admit(len(prompts))
        except APIError as e:
            return self.error_response(e)
        try:
            gen = Generation(self, prompts, params, body.stop_list())
            gen.start()
        except BaseException:
            self.in_flight -= len(prompts)  # admitted, but never handed to the engine
            raise
        self.metrics.prompt_tokens.inc(sum(len(p) for p in prompts))
        if body.stream:
            return EventStreamResponse(self.stream(gen, body, chat, endpoint), on_close=lambda: self.close(gen, endpoint))
        watcher = asyncio.create_task(self._watch_disconnect(http, gen))
        try:
            async for _ in gen.events():
                pass
        except ClientGone:
            return Response(status_code=499)  # nobody reads it
        except APIError as e:
            return self.error_response(e)
        finally:
            watcher.cancel()
            self.close(gen, endpoint)
        return JSONResponse(self.full_response(gen, body, chat))

    @staticmethod
    async def _watch_disconnect(http: HTTPRequest, gen: Generation) -> None:
        while True:
            await asyncio.sleep(DISCONNECT_POLL_S)
            if await http.is_disconnected():
                gen.queue.put_nowait(("gone", 0, None))
                return

    def error_response(self, e: APIError) -> JSONResponse:
        self.metrics.errors.labels(str(e.status)).inc()
        return JSONResponse(e.body(), status_code=e.status, headers=e.headers)

    def _base(self, gen_id: str, chat: bool, chunk: bool) -> dict:
        obj = ("chat.completion.chunk" if chunk else "chat.completion") if chat else "text_completion"
        return {"id": gen_id, "object": obj, "created": int(time.time()), "model": self.model_name}

    def full_response(self, gen: Generation, body, chat: bool) -> dict:
        gen_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        choices = []
        for i, c in enumerate(gen.choices):
            if chat:
                choice = {"index": i, "message": {"role": "assistant", "content": c.detok.text}, "logprobs": None,
                          "finish_reason": c.finish_reason}
            else:
                choice = {"index": i, "text": c.detok.text, "logprobs": None, "finish_reason": c.finish_reason}
            if body.return_token_ids:
                choice["token_ids"] = c.token_ids
            choices.append(choice)
        return {**self._base(gen_id, chat, False), "choices": choices, "usage": gen.usage(), "dflash": gen.stats()}

    async def stream(self, gen: Generation, body, chat: bool, endpoint: str) -> AsyncIterator[str]:
        gen_id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        base = self._base(gen_id, chat, True)
        usage_field = {"usage": None} if body.include_usage else {}

        def chunk(index: int, text: str, finish_reason: str | None, role: bool = False, token_ids=None) -> str:
            if chat:
                delta = {"role": "assistant", "content": text} if role else ({"content": text} if text or finish_reason is None else {})
                choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            else:
                choice = {"index": index, "text": text, "logprobs": None, "finish_reason": finish_reason}
            if token_ids is not None:
                choice["token_ids"] = token_ids
            payload = {**base, "choices": [choice], **usage_field}
            if finish_reason is not None and not body.include_usage:
                payload["dflash"] = gen.stats()
            return f"data: {json.dumps(payload)}\n\n"

        sent_ids = [0] * len(gen.choices)
        try:
            if chat:
                for i in range(len(gen.choices)):
                    yield chunk(i, "", None, role=True)
            async for index, text, finish_reason in gen.events():
                token_ids = None
                if body.return_token_ids:
                    ids = gen.choices[index].token_ids
                    token_ids, sent_ids[index] = ids[sent_ids[index]:], len(ids)
                if text or finish_reason is not None or token_ids:
                    yield chunk(index, text, finish_reason, token_ids=token_ids)
            if body.include_usage:
                yield f"data: {json.dumps({**base, 'choices': [], 'usage': gen.usage(), 'dflash': gen.stats()})}\n\n"
        except APIError as e:
            self.metrics.errors.labels(str(e.status)).inc()
            yield f"data: {json.dumps(e.body())}\n\n"
        finally:  # also on client disconnect: starlette cancels this generator
            self.close(gen, endpoint)
        yield "data: [DONE]\n\n"


class EventStreamResponse(StreamingResponse):
    """SSE whose `on_close` runs however the response ends, even if the client left before the body
    iterator ever started (then the iterator's own `finally` never runs)."""

    def __init__(self, content, on_close):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def create_app(server: Server) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        server.loop = asyncio.get_running_loop()
        server.engine.start()
        try:
            yield
        finally:
            server.engine.shutdown()

    app = FastAPI(title="dflash-trt", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.state.server = server

    @app.exception_handler(Exception)
    async def _internal(request: HTTPRequest, exc: Exception):  # never let one request take the server down
        traceback.print_exc()
        return server.error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}", "internal_error"))

    @app.post("/v1/completions")
    async def completions(request: HTTPRequest):
        return await server.handle(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: HTTPRequest):
        return await server.handle(request, chat=True)

    @app.get("/v1/models")
    async def models():
        card = {"id": server.model_name, "object": "model", "created": server.created, "owned_by": "dflash-trt",
                "max_model_len": server.max_model_len, "dflash": {"block_size": server.block_size, "drafter": server.model.drafter}}
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health():
        if not server.engine.alive:
            return JSONResponse({"status": "error", "error": repr(server.engine.fatal)}, status_code=503)
        return {"status": "ok", "in_flight": server.in_flight, "capacity": server.capacity}

    @app.get("/metrics")
    async def metrics():
        return Response(generate_latest(server.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app


def run(server: Server, host: str = "127.0.0.1", port: int = 8000, log_level: str = "info") -> None:
    import uvicorn

    uvicorn.run(create_app(server), host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
