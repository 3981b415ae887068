"""`dflash-trt triton-repo`: config.pbtxt parsed with Triton's own ModelConfig schema (tritonclient), and
the generated model.py run in-process. Triton's `triton_python_backend_utils` exists only inside the
Triton server (it is not on PyPI), so a minimal fake of the part model.py uses stands in for it."""

from __future__ import annotations

import importlib.util
import json
import sys
import time
import types

import numpy as np
import pytest

from dflash_trt.cli import main
from dflash_trt.runtime import Generator
from dflash_trt.sampling import SamplingParams
from dflash_trt.serve.triton_repo import write_repository
from dflash_trt.loading import load_torch_backend

model_config_pb2 = pytest.importorskip("tritonclient.grpc.model_config_pb2")
from google.protobuf import json_format, text_format

# Names and types of the TensorRT-LLM backend's tensorrt_llm_bls model (all_models/inflight_batcher_llm).
TRTLLM_BLS = {
    "text_input": "TYPE_STRING", "max_tokens": "TYPE_INT32", "stop_words": "TYPE_STRING", "end_id": "TYPE_INT32",
    "top_k": "TYPE_INT32", "top_p": "TYPE_FP32", "temperature": "TYPE_FP32", "random_seed": "TYPE_UINT64",
    "stream": "TYPE_BOOL", "text_output": "TYPE_STRING",
}


def parse_config(path) -> model_config_pb2.ModelConfig:
    return text_format.Parse(path.read_text(), model_config_pb2.ModelConfig())


@pytest.fixture(scope="module")
def repo(tiny_dirs, tmp_path_factory):
    target, drafter = tiny_dirs
    out = tmp_path_factory.mktemp("triton") / "repo"
    write_repository(out, target=str(target), drafter=str(drafter), max_batch=4, max_model_len=256)
    return out


def test_config_parses_with_tritons_schema_and_uses_trtllm_names(repo, tiny_dirs):
    cfg = parse_config(repo / "dflash" / "config.pbtxt")
    assert cfg.name == "dflash" and cfg.backend == "python" and cfg.max_batch_size == 4
    assert cfg.model_transaction_policy.decoupled
    dtype = model_config_pb2.DataType.Name
    tensors = {t.name: dtype(t.data_type) for t in [*cfg.input, *cfg.output]}
    assert {k: tensors.get(k) for k in TRTLLM_BLS} == TRTLLM_BLS
    required = [t.name for t in cfg.input if not t.optional]
    assert required == ["text_input", "max_tokens"]
    assert cfg.parameters["target_dir"].string_value == str(tiny_dirs[0].resolve())
    assert cfg.parameters["drafter_dir"].string_value == str(tiny_dirs[1].resolve())
    assert (repo / "dflash" / "1" / "model.py").is_file()


def test_cli_writes_the_repository_and_refuses_to_overwrite(tiny_dirs, tmp_path, capsys):
    target, drafter = tiny_dirs
    args = ["triton-repo", "--out", str(tmp_path / "r"), "--target", str(target), "--drafter", str(drafter), "--model-name", "ensemble"]
    assert main(args) == 0
    assert parse_config(tmp_path / "r" / "ensemble" / "config.pbtxt").name == "ensemble"
    assert main(args) == 2 and "exists" in capsys.readouterr().err
    assert main([*args, "--force"]) == 0
    assert main(["triton-repo", "--out", str(tmp_path / "x"), "--target", str(tmp_path / "missing"), "--no-drafter"]) == 2
    assert not (tmp_path / "x").exists()


# -- a fake of the part of triton_python_backend_utils that model.py uses --------------------------


class FakeTensor:
    def __init__(self, name, array):
        self._name, self._array = name, np.asarray(array)

    def name(self):
        return self._name

    def as_numpy(self):
        return self._array


class FakeError(Exception):
    CANCELLED = "CANCELLED"

    def __init__(self, message, code=None):
        super().__init__(message)
        self.code = code

    def message(self):
        return str(self)


class FakeResponse:
    def __init__(self, output_tensors=(), error=None):
        self.tensors = {t.name(): t.as_numpy() for t in output_tensors}
        self.error = error


class FakeSender:
    def __init__(self, cancel_after: int | None = None):
        self.responses: list[tuple[FakeResponse, int]] = []
        self.cancel_after = cancel_after

    def send(self, response=None, flags=0):
        assert not self.final, "a response after the FINAL flag"
        self.responses.append((response, flags))

    def is_cancelled(self):
        return self.cancel_after is not None and len(self.responses) >= self.cancel_after

    @property
    def final(self):
        return bool(self.responses) and self.responses[-1][1] == 1

    def text(self):
        return "".join(r.tensors["text_output"][0, 0].decode() for r, _ in self.responses if r.error is None)


class FakeRequest:
    def __init__(self, sender, **inputs):
        self.sender = sender
        self.inputs = {k: FakeTensor(k, v) for k, v in inputs.items()}

    def get_response_sender(self):
        return self.sender


def fake_pb_utils():
    m = types.ModuleType("triton_python_backend_utils")
    m.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1
    m.Tensor, m.InferenceResponse, m.TritonError, m.TritonModelException = FakeTensor, FakeResponse, FakeError, RuntimeError
    m.get_input_tensor_by_name = lambda request, name: request.inputs.get(name)
    m.using_decoupled_model_transaction_policy = lambda config: config["model_transaction_policy"]["decoupled"]
    return m


@pytest.fixture(scope="module")
def triton_model(repo, tmp_path_factory):
    sys.modules["triton_python_backend_utils"] = fake_pb_utils()
    try:
        spec = importlib.util.spec_from_file_location("dflash_triton_model", repo / "dflash" / "1" / "model.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        del sys.modules["triton_python_backend_utils"]
    cfg = parse_config(repo / "dflash" / "config.pbtxt")
    model = module.TritonPythonModel()
    # Triton hands the model its config as JSON with the proto field names
    model.initialize({"model_config": json.dumps(json_format.MessageToDict(cfg, preserving_proto_field_name=True))})
    yield model
    model.finalize()


def wait_final(senders, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not all(s.final for s in senders):
        assert time.monotonic() < deadline, "no FINAL response"
        time.sleep(0.01)


def request(sender, text, max_tokens, stream, **extra):
    inputs = dict(text_input=np.array([[text.encode()]], dtype=np.object_), max_tokens=np.array([[max_tokens]], dtype=np.int32),
                  stream=np.array([[stream]], dtype=bool), **extra)
    return FakeRequest(sender, **inputs)


def test_model_streams_and_returns_plain_greedy_output(triton_model, tiny_dirs):
    target, _ = tiny_dirs
    tok = triton_model.model.tokenizer
    prompts = ["def add(a, b):", "The quick brown fox", "hello world"]
    ref = Generator(load_torch_backend(str(target), None, num_pages=128), eos_token_ids=[2], use_drafter=False)
    # end_id = -1 never matches, so EOS still applies: the reference stops at EOS (id 2) too
    wants = [tok.decode(o.output_ids, skip_special_tokens=True) for o in ref.generate([tok.encode(p) for p in prompts], SamplingParams(max_new_tokens=20))]
    streamed, whole = [FakeSender() for _ in prompts], [FakeSender() for _ in prompts]
    reqs = [request(s, p, 20, True) for s, p in zip(streamed, prompts)] + [request(s, p, 20, False) for s, p in zip(whole, prompts)]
    assert triton_model.execute(reqs) is None  # decoupled: responses go through the senders
    wait_final(streamed + whole)
    assert max(len(s.responses) for s in streamed) >= 5  # streamed in pieces, not all at the end
    for want, s, w in zip(wants, streamed, whole):
        assert s.text() == want and w.text() == want
        assert len(w.responses) == 1 and w.responses[0][1] == 1
        assert all(flags == 0 for _, flags in s.responses[:-1])
        final = s.responses[-1][0].tensors
        assert 1 <= final["num_output_tokens"][0, 0] <= 20 and final["dflash_tau"][0, 0] >= 1.0


def test_model_cancels_and_frees_kv_pages_and_rejects_bad_input(triton_model):
    backend = triton_model.model.generator.backend
    deadline = time.monotonic() + 10
    while triton_model.model.generator.has_work:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    free = backend.target_cache.num_free_pages
    cancelled = FakeSender(cancel_after=2)
    bad = FakeSender()
    triton_model.execute([request(cancelled, "hello world", 200, True, random_seed=np.array([[7]], dtype=np.uint64),
                                  temperature=np.array([[0.8]], dtype=np.float32)),
                          FakeRequest(bad, max_tokens=np.array([[4]], dtype=np.int32))])
    wait_final([cancelled, bad])
    assert bad.responses[0][0].error is not None and "text_input" in str(bad.responses[0][0].error)
    assert cancelled.responses[-1][0].error.code == FakeError.CANCELLED
    assert len(cancelled.responses) < 20  # stopped early, not at max_tokens
    deadline = time.monotonic() + 10
    while triton_model.model.generator.has_work:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert backend.target_cache.num_free_pages == free == backend.num_pages
    # the model still serves
    ok = FakeSender()
    triton_model.execute([request(ok, "hello", 3, False)])
    wait_final([ok])
    assert ok.responses[0][0].error is None and ok.responses[0][0].tensors["num_output_tokens"][0, 0] <= 3


class BrokenSender(FakeSender):
    """A client that went away without Triton noticing: every send raises."""

    def send(self, response=None, flags=0):
        self.responses.append((response, flags))
        raise RuntimeError("the stream is closed")


def test_a_failing_send_cancels_its_request_and_the_engine_keeps_serving(triton_model):
    backend, generator = triton_model.model.generator.backend, triton_model.model.generator
    broken = BrokenSender()
    triton_model.execute([request(broken, "hello world", 200, True)])
    deadline = time.monotonic() + 20
    while generator.has_work or not broken.responses:
        assert time.monotonic() < deadline, "the broken stream's request never ended"
        time.sleep(0.01)
    assert triton_model.engine.alive
    assert len(broken.responses) < 20  # cancelled after the first failed send, not run to max_tokens
    assert backend.target_cache.num_free_pages == backend.num_pages
    ok = FakeSender()
    triton_model.execute([request(ok, "hello", 3, False)])
    wait_final([ok])
    assert ok.responses[0][0].error is None
