"""A DFlash engine behind TensorRT-LLM 1.2.1's executor: requests in, tokens out; the executor owns the loop.

The engine is on EAGLE's contract (contract.py, docs/engine-path.md), so the stock executor drives it with
`DecodingMode::Eagle`; `emulation.EagleRuntime` is this executor's side, emulated and tested on CPU.
What the contract cannot carry is refused here, before a request reaches the engine:
- T > 0 altogether, for now. With `EagleConfig(greedy_sampling=False)` the stock EAGLE accept plugin runs
  typical acceptance (docs/engine-path.md, the "stock EAGLE acceptance" row), which is not an exact sample of
  the target. An executor may sample only once the engine carries our exact-rejection accept op (the rule that
  `emulation.DFlashEngine` implements and tests/test_engine_contract.py checks), and no network writes it yet
  (`trtllm/model.py`: `DFlashForCausalLM` is unavailable). So `sampling=True` is refused, and every executor
  is built with `greedy_sampling=True`.
- top-k / top-p at T > 0 will stay refused when sampling comes: the engine sees only `eagle_temperature`.

NEVER EXECUTED here (no GPU / TensorRT-LLM on CI machines): see docs/engine-path.md.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from ..sampling import RequestError, SamplingParams
from . import api, plugin_library


@dataclass
class EngineOutput:
    prompt_ids: list[int]
    output_ids: list[int]


def chain_choices(num_drafts: int) -> list[list[int]]:
    """EAGLE's `eagle_choices` for a one-path tree of `num_drafts` drafts: node k is the path [0] * k."""
    return [[0] * depth for depth in range(1, num_drafts + 1)]


SAMPLING_UNAVAILABLE = (
    "temperature > 0 is not available on the engine path yet: TensorRT-LLM's stock EAGLE accept plugin samples by "
    "typical acceptance, which is not an exact sample of the target, and no engine carries DFlash's exact-rejection "
    "accept op yet; decode at temperature 0 here, or sample with the reference runtime (dflash-trt generate / serve)"
)


def check_params(params: SamplingParams) -> None:
    params.validate()
    if not params.greedy:
        raise RequestError(SAMPLING_UNAVAILABLE)


class EngineGenerator:
    def __init__(self, engine_dir: str | os.PathLike, plugin_lib: str | None = None, sampling: bool = False, max_batch: int | None = None):
        if sampling:  # before anything loads: nothing this executor could run samples exactly (module docstring)
            raise RequestError(SAMPLING_UNAVAILABLE)
        api.require_tensorrt_llm()  # first: a clear error where tensorrt_llm is missing or is not the pinned line
        plugin_library.register(plugin_lib)  # before the executor deserializes the engine
        engine_dir = Path(engine_dir)
        config = json.loads((engine_dir / "config.json").read_text())
        num_drafts = int(config["pretrained_config"]["max_draft_len"])
        decoding = api.get("DecodingConfig")(
            decoding_mode=api.get("DecodingMode").Eagle(),
            eagle_config=api.get("EagleConfig")(eagle_choices=chain_choices(num_drafts), greedy_sampling=True),
        )
        kwargs = {"max_batch_size": max_batch} if max_batch else {}
        self._executor = api.get("Executor")(
            engine_dir, api.get("ModelType").DECODER_ONLY,
            api.get("ExecutorConfig")(max_beam_width=1, decoding_config=decoding, **kwargs),
        )

    def generate(self, prompts: list[list[int]], params: SamplingParams, eos_token_ids: list[int]) -> list[EngineOutput]:
        check_params(params)
        Request, SamplingConfig, OutputConfig = api.get("Request"), api.get("SamplingConfig"), api.get("OutputConfig")
        params = params.seeded()
        stop = sorted(set(params.stop_token_ids) | (set() if params.ignore_eos else set(eos_token_ids)))
        requests = [
            Request(
                input_token_ids=p, max_tokens=params.max_new_tokens, streaming=False,
                # greedy only (check_params): top_k=1 is TensorRT-LLM's greedy, and the executor is greedy_sampling=True.
                sampling_config=SamplingConfig(beam_width=1, top_k=1, seed=params.seed + i),
                end_id=stop[0] if stop else None, stop_words=[[t] for t in stop[1:]] or None,
                output_config=OutputConfig(exclude_input_from_output=True),
            )
            for i, p in enumerate(prompts)
        ]
        ids = self._executor.enqueue_requests(requests)
        outputs: dict[int, list[int]] = {}
        while len(outputs) < len(ids):
            for response in self._executor.await_responses():
                if response.has_error():
                    raise RuntimeError(f"executor request {response.request_id}: {response.error_msg}")
                if response.result.is_final:
                    outputs[response.request_id] = list(response.result.output_token_ids[0])
        return [EngineOutput(p, outputs[i]) for p, i in zip(prompts, ids)]

    def shutdown(self) -> None:
        self._executor.shutdown()
