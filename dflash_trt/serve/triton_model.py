"""Triton Inference Server Python-backend model running dflash-trt's runtime.

`dflash-trt triton-repo` copies this file as `<model>/1/model.py`. Decoupled transaction
policy: `execute` only parses and submits; the engine thread (the same `EngineCore` the
HTTP server uses, so requests join and leave one running batch at step boundaries) sends
the responses: with `stream` true, one per step with the new text and a last one flagged
FINAL; otherwise one FINAL response with the whole text. A cancelled request (client gone,
`response_sender.is_cancelled()`) is dropped at the next step boundary and its KV pages freed.

Inputs as in the TensorRT-LLM backend's `tensorrt_llm_bls` model: text_input, max_tokens,
stop_words, end_id (an extra stop id), top_k, top_p (0 = off), temperature (default 0:
greedy), random_seed, stream. Outputs: text_output, num_input_tokens, num_output_tokens,
dflash_tau (mean tokens per verify step).
"""

import json
import sys
import threading

import numpy as np
import triton_python_backend_utils as pb_utils

FINAL = pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL


def _scalar(request, name, default=None):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return default
    values = tensor.as_numpy().reshape(-1)
    if values.size != 1:
        raise ValueError(f"{name}: expected one value per request, got {values.size} (send one prompt per request)")
    value = values[0]
    return value.decode("utf-8") if isinstance(value, bytes) else value.item()


def _strings(request, name):
    tensor = pb_utils.get_input_tensor_by_name(request, name)
    if tensor is None:
        return []
    return [v.decode("utf-8") if isinstance(v, bytes) else str(v) for v in tensor.as_numpy().reshape(-1) if v]


class _Stream:
    """Per-request state, touched only on the engine thread once submitted."""

    def __init__(self, sender, detok, stream: bool, num_input_tokens: int):
        self.sender, self.detok, self.stream, self.num_input_tokens = sender, detok, stream, num_input_tokens
        self.cancel_sent = False


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        p = {k: v.get("string_value", "") for k, v in config.get("parameters", {}).items()}
        if p.get("python_path") and p["python_path"] not in sys.path:
            sys.path.append(p["python_path"])
        if not pb_utils.using_decoupled_model_transaction_policy(config):
            raise pb_utils.TritonModelException("this model streams: set model_transaction_policy { decoupled: true }")
        from dflash_trt.sampling import SamplingParams
        from dflash_trt.serve.engine import (
            EngineCore,
            IncrementalDetokenizer,
            Request,
            load_model,
        )

        self._SamplingParams, self._Request, self._Detok = SamplingParams, Request, IncrementalDetokenizer

        def opt_int(key):
            return int(p[key]) if p.get(key) else None

        self.model = load_model(
            p["target_dir"], p.get("drafter_dir") or None, tokenizer_dir=p.get("tokenizer_dir") or None,
            drafter_type=p.get("drafter_type") or "dflash", dtype=p.get("dtype") or "fp32", max_batch=opt_int("max_batch") or 8,
            max_model_len=opt_int("max_model_len"), kv_pages=opt_int("kv_pages"), page_size=opt_int("page_size") or 16,
            block_size=opt_int("block_size"), max_verify_tokens=opt_int("max_verify_tokens"),
        )
        self.default_max_tokens = opt_int("default_max_tokens") or 256
        self._live_lock = threading.Lock()
        self._live = {}  # Request -> _Stream, for the cancellation poll
        self.engine = EngineCore(self.model.generator, sink=self._sink, on_idle=self._poll_cancelled).start()

    # -- Triton's thread --------------------------------------------------------------------

    def execute(self, requests):
        """Decoupled: returns None; every response goes through the request's response sender."""
        for request in requests:
            sender = request.get_response_sender()
            if not self.engine.alive:  # a failure ended the engine thread: answer rather than queue forever
                error = pb_utils.TritonError(f"the dflash engine is not running ({self.engine.fatal!r})")
                sender.send(pb_utils.InferenceResponse(output_tensors=[], error=error), flags=FINAL)
                continue
            try:
                engine_request, state = self._parse(request, sender)
            except Exception as e:  # a bad request gets an error response; the model stays up
                sender.send(pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(e))), flags=FINAL)
                continue
            with self._live_lock:
                self._live[engine_request] = state
            self.engine.submit(engine_request)

    def _parse(self, request, sender):
        text = _scalar(request, "text_input")
        if not isinstance(text, str):
            raise ValueError("text_input: a string is required")
        max_tokens = _scalar(request, "max_tokens")
        if max_tokens is None:
            max_tokens = self.default_max_tokens
        temperature = float(_scalar(request, "temperature", 0.0))
        top_p = float(_scalar(request, "top_p", 1.0))
        end_id = _scalar(request, "end_id")
        seed = _scalar(request, "random_seed")
        params = self._SamplingParams(
            max_new_tokens=int(max_tokens), temperature=temperature, top_p=top_p if top_p > 0 else 1.0,
            top_k=int(_scalar(request, "top_k", 0)), stop_token_ids=(int(end_id),) if end_id is not None else (),
            seed=int(seed) if seed is not None else None,
        )
        ids = self.model.tokenizer.encode(text)
        if len(ids) + params.max_new_tokens > self.model.max_model_len:
            raise ValueError(f"prompt ({len(ids)} tokens) + max_tokens ({params.max_new_tokens}) > maximum context length {self.model.max_model_len}")
        self.engine.check(ids, params)  # RequestError / KVCacheFullError: the message says what to change
        state = _Stream(sender, self._Detok(self.model.tokenizer, _strings(request, "stop_words")),
                        bool(_scalar(request, "stream", False)), len(ids))
        return self._Request(ids, params, context=state), state

    def finalize(self):
        self.engine.shutdown()

    # -- engine thread ----------------------------------------------------------------------

    def _response(self, state, text, output=None):
        tensors = [pb_utils.Tensor("text_output", np.array([[text.encode("utf-8")]], dtype=np.object_))]
        if output is not None:
            n_out = len(state.detok.ids[: state.detok.num_tokens_at_stop])
            tau = output.tau if output.accepted_lengths else 0.0
            tensors += [
                pb_utils.Tensor("num_input_tokens", np.array([[state.num_input_tokens]], dtype=np.int32)),
                pb_utils.Tensor("num_output_tokens", np.array([[n_out]], dtype=np.int32)),
                pb_utils.Tensor("dflash_tau", np.array([[tau]], dtype=np.float32)),
            ]
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def _sink(self, events):
        for request, tokens in events.tokens.items():
            state = request.context
            delta = state.detok.add(tokens)
            if state.detok.stopped and not state.cancel_sent:
                state.cancel_sent = True  # a stop word: generate no further
                self.engine.cancel(request)
            if state.stream and delta:
                self._send(request, state, self._response(state, delta))
        for request, output in events.finished.items():
            state = self._forget(request)
            if output is None or (output.finish_reason == "cancelled" and not state.detok.stopped):
                error = pb_utils.TritonError("request cancelled", getattr(pb_utils.TritonError, "CANCELLED", None))
                self._send(request, state, pb_utils.InferenceResponse(output_tensors=[], error=error), FINAL)
                continue
            rest = state.detok.finish()
            self._send(request, state, self._response(state, rest if state.stream else state.detok.text, output), FINAL)
        for request, error in events.errors.items():
            state = self._forget(request)
            self._send(request, state, pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(str(error))), FINAL)

    def _send(self, request, state, response, flags=0):
        """Send on the engine thread; a send that fails (the client is gone) cancels the request instead of
        raising into the engine, whose thread must outlive any one request."""
        try:
            state.sender.send(response, flags=flags)
        except Exception:
            if not state.cancel_sent:
                state.cancel_sent = True
                self.engine.cancel(request)

    def _forget(self, request):
        with self._live_lock:
            return self._live.pop(request, request.context)

    def _poll_cancelled(self):
        with self._live_lock:
            live = list(self._live.items())
        for request, state in live:
            if not state.cancel_sent and state.sender.is_cancelled():
                state.cancel_sent = True
                self.engine.cancel(request)
