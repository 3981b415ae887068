"""The trt backend: the Backend protocol (speculative.py) over two engines, so the one tested loop
(speculative_step / runtime.Generator) drives TensorRT-LLM exactly as it drives the torch reference.

- target: the executor (tensorrt_llm.bindings.executor) over the target engine built with
  `--speculative_decoding_mode draft_tokens_external` and the `dflash_target_features` output. A verify
  pass is one request per sequence: input = committed tokens, drafts as ExternalDraftTokensConfig,
  generation logits + the features returned. KV reuse (enable_block_reuse) keeps the committed prefix,
  so `commit` is bookkeeping: the next request carries exactly the kept tokens, the rest is dropped
  (the executor's own acceptance is ignored; our loop decides, greedy or T > 0).
- drafter: a tensorrt_llm.runtime.Session over the drafter engine. Its context K/V caches
  k_cache/v_cache [L, S, nkv, hd] are engine inputs we allocate once and pass on every call; the
  engine's DFlashKVInject layers update them in place, and the aliased outputs (network.CACHE_OUTPUTS)
  are bound to the same buffers. Sequence slot b owns cache slots [b·max_kv, (b+1)·max_kv): position p
  of its context lives at b·max_kv + p, its draft block right after the context (scratch).

Scores: the target returns generation logits; greedy tokens are their argmax, logits are kept only
for the sequences that asked (need_logits), as fp32.
The plugin library is loaded (ctypes, RTLD_GLOBAL) before any engine is deserialized.
NEVER EXECUTED here (no GPU / TensorRT-LLM on CI machines): see docs/engine-path.md.
"""

from __future__ import annotations

import ctypes
import json
import os
from pathlib import Path

import torch

from ..speculative import Scores
from . import api, network


def load_plugin_library(path: str | os.PathLike | None) -> None:
    path = path or os.environ.get("DFLASH_PLUGIN_LIB")
    if not path or not Path(path).is_file():
        raise api.TensorRTUnavailable(f"plugin library not found ({path!r}): build plugins/ and pass plugin_lib or set DFLASH_PLUGIN_LIB")
    ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)


_TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


class TrtBackend:
    def __init__(self, engine_dir: str | os.PathLike, plugin_lib: str | None = None, max_batch: int | None = None, max_seq_len: int | None = None):
        """max_batch / max_seq_len: the drafter engine's build limits by default (its config.json build_config);
        the caches hold max_batch sequences of max_seq_len + one block, the engine's profile maximum."""
        api.require_tensorrt_llm()  # first: a clear error where tensorrt_llm is missing
        load_plugin_library(plugin_lib)
        from ..models.layers import Rotary
        from ..trtllm_format import parse_trtllm_drafter_config

        engine_dir = Path(engine_dir)
        config_path = engine_dir / "drafter" / "config.json"
        engine_cfg = json.loads(config_path.read_text())
        drafter_cfg = engine_cfg["pretrained_config"]
        max_batch = max_batch or int(engine_cfg["build_config"]["max_batch_size"])
        max_seq_len = max_seq_len or int(engine_cfg["build_config"]["max_seq_len"])
        rules = parse_trtllm_drafter_config(drafter_cfg, config_path)
        self.block_size = rules.block_size
        self.max_drafts = self.block_size - 1
        self.vocab_size = int(drafter_cfg["vocab_size"])
        self.mask_token_id = rules.mask_token_id
        self._dtype = _TORCH_DTYPES[drafter_cfg["dtype"]]
        self._rotary = Rotary(rules.rope, rules.head_dim)  # the torch reference's RoPE tables, one source
        self._feature_size = len(drafter_cfg["target_layer_ids"]) * int(drafter_cfg["target_hidden_size"])
        self._executor = api.get("Executor")(
            engine_dir / "target", api.get("ModelType").DECODER_ONLY,
            api.get("ExecutorConfig")(
                max_beam_width=1,
                kv_cache_config=api.get("KvCacheConfig")(enable_block_reuse=True),
                decoding_config=api.get("DecodingConfig")(decoding_mode=api.get("DecodingMode").ExternalDraftTokens()),
            ),
        )
        rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", "0"))
        tp = int(drafter_cfg.get("mapping", {}).get("tp_size", 1))
        self._drafter = api.get("Session").from_serialized_engine((engine_dir / "drafter" / f"rank{rank}.engine").read_bytes())
        layers = int(drafter_cfg["num_hidden_layers"])
        kv_heads = max(1, int(drafter_cfg["num_key_value_heads"]) // tp)
        self._max_batch, self._max_kv = max_batch, max_seq_len + self.block_size  # prepare_inputs' max_kv
        cache_shape = (layers, max_batch * self._max_kv, kv_heads, rules.head_dim)
        self._k_cache = torch.zeros(cache_shape, dtype=self._dtype, device="cuda")
        self._v_cache = torch.zeros(cache_shape, dtype=self._dtype, device="cuda")
        self._slots: dict[int, int] = {}
        self._tokens: dict[int, list[int]] = {}  # committed tokens in the target's cache (all but `last_token`)
        self._pending: dict[int, list[torch.Tensor]] = {}  # features not yet injected into the caches
        self._injected: dict[int, int] = {}  # context rows in the drafter caches
        self._last_pass: dict[int, tuple[list[int], torch.Tensor]] = {}

    # -- sequences ---------------------------------------------------------------------------
    def add_sequence(self, seq_id: int) -> None:
        self._slots[seq_id] = min(set(range(self._max_batch)) - set(self._slots.values()))
        self._tokens[seq_id], self._pending[seq_id], self._injected[seq_id] = [], [], 0

    def release(self, seq_id: int) -> None:
        for d in (self._slots, self._tokens, self._pending, self._injected):
            d.pop(seq_id)

    # -- target ------------------------------------------------------------------------------
    def _target_pass(self, seq_ids: list[int], blocks: list[list[int]], prefill: bool) -> list[torch.Tensor]:
        """One target pass per sequence over `blocks[b]` after its committed tokens → logits [len(block), V]
        (prefill: [1, V], the last prompt position). Features of the block's rows are kept for `commit`."""
        Request, OutputConfig = api.get("Request"), api.get("OutputConfig")
        features_out = api.get("AdditionalModelOutput")(network.CONTEXT_FEATURES, gather_context=True)
        requests = []
        for s, block in zip(seq_ids, blocks):
            head, drafts = (block, []) if prefill else (block[:1], block[1:])
            requests.append(Request(
                self._tokens[s] + head, 1, streaming=False,
                output_config=OutputConfig(return_generation_logits=not prefill, return_context_logits=prefill,
                                           additional_model_outputs=[features_out]),
                external_draft_tokens_config=api.get("ExternalDraftTokensConfig")(drafts) if drafts else None,
            ))
        ids = self._executor.enqueue_requests(requests)
        results = {rid: self._executor.await_responses(rid)[-1].result for rid in ids}
        logits = []
        for s, block, rid in zip(seq_ids, blocks, ids):
            result, rows = results[rid], len(block)
            source = result.context_logits if prefill else result.generation_logits
            logits.append(torch.as_tensor(source).reshape(-1, self.vocab_size)[-(1 if prefill else rows):].float())
            # Assumed layout (first thing scripts/gpu_engine_check.sh asserts): the context rows, then one per
            # generation-step token; the block's rows are the last len(block).
            feats = torch.cat([torch.as_tensor(result.additional_outputs[network.CONTEXT_FEATURES])]).reshape(-1, self._feature_size)
            self._last_pass[s] = (block, feats[-rows:])
        return logits

    @staticmethod
    def _scores(logits: list[torch.Tensor], need_logits: list[bool] | None) -> list[Scores]:
        need = need_logits if need_logits is not None else [True] * len(logits)  # None: all (the Backend contract)
        return [Scores(tokens=rows.argmax(dim=-1), logits=rows if want else None) for rows, want in zip(logits, need)]

    def prefill(self, seq_ids: list[int], prompts: list[list[int]], need_logits: list[bool] | None = None) -> list[Scores]:
        logits = self._target_pass(seq_ids, prompts, prefill=True)
        self.commit(seq_ids, [len(p) for p in prompts])
        return self._scores(logits, need_logits)

    def verify(self, seq_ids: list[int], blocks: list[list[int]], need_logits: list[bool] | None = None) -> list[Scores]:
        return self._scores(self._target_pass(seq_ids, blocks, prefill=False), need_logits)

    def commit(self, seq_ids: list[int], num_kept: list[int]) -> None:
        for s, n in zip(seq_ids, num_kept):
            block, feats = self._last_pass.pop(s)
            self._tokens[s].extend(block[:n])
            if feats is not None:
                self._pending[s].append(feats[:n])

    # -- drafter -----------------------------------------------------------------------------
    def draft(self, seq_ids: list[int], last_tokens: list[int], num_drafts: list[int]) -> list[list[int]]:
        """One drafter engine call: inject the pending context features, then run the blocks
        [last, mask × k_b] (DFlashDrafter.inject_context + forward; plugin semantics in kernels/reference.py)."""
        i32 = dict(dtype=torch.int32, device="cuda")
        features, positions, write_slots = [], [], []
        for s in seq_ids:
            new = torch.cat(self._pending[s]) if self._pending[s] else None
            self._pending[s] = []
            if new is None:
                continue
            start = self._injected[s]
            features.append(new)
            positions.append(torch.arange(start, start + len(new)))
            write_slots.append(self._slots[s] * self._max_kv + positions[-1])
            self._injected[s] = start + len(new)
        sizes = [k + 1 for k in num_drafts]
        block = [t for last, k in zip(last_tokens, num_drafts) for t in [last] + [self.mask_token_id] * k]
        kv_lens = [self._injected[s] + n for s, n in zip(seq_ids, sizes)]  # context, then the block itself
        block_pos = torch.tensor([p for s, n in zip(seq_ids, sizes) for p in range(self._injected[s], self._injected[s] + n)])
        kv_slots = torch.zeros(len(seq_ids), max(kv_lens), dtype=torch.long)
        for b, (s, n) in enumerate(zip(seq_ids, kv_lens)):
            kv_slots[b, :n] = self._slots[s] * self._max_kv + torch.arange(n)
        block_slots = torch.cat([kv_slots[b, self._injected[s] : n] for b, (s, n) in enumerate(zip(seq_ids, kv_lens))])
        ctx_pos = torch.cat(positions) if positions else torch.zeros(0, dtype=torch.long)
        ctx_cos, ctx_sin = self._rotary(ctx_pos, self._dtype)
        blk_cos, blk_sin = self._rotary(block_pos, self._dtype)
        inputs = {
            "context_features": torch.cat(features).to(self._dtype) if features else torch.zeros(0, self._feature_size, dtype=self._dtype),
            "context_cos": ctx_cos, "context_sin": ctx_sin,
            "context_write_slots": torch.cat(write_slots) if write_slots else torch.zeros(0, dtype=torch.long),
            "block_ids": torch.tensor(block), "block_cos": blk_cos, "block_sin": blk_sin,
            "block_write_slots": block_slots,
            "kv_slots": kv_slots,
            "q_starts": torch.tensor(sizes).cumsum(0) - torch.tensor(sizes),
            "q_lens": torch.tensor(sizes),
            "kv_lens": torch.tensor(kv_lens),
        }
        inputs = {k: v.to(**i32) if not v.is_floating_point() else v.cuda() for k, v in inputs.items()}
        inputs.update(k_cache=self._k_cache, v_cache=self._v_cache)
        assert set(inputs) == set(network.DRAFTER_INPUTS)
        outputs = {
            network.DRAFT_TOKEN_IDS: torch.empty(len(block), **i32),
            # aliased outputs: the same buffers, so the in-place updates persist across calls
            network.CACHE_OUTPUTS["k_cache"]: self._k_cache,
            network.CACHE_OUTPUTS["v_cache"]: self._v_cache,
        }
        stream = torch.cuda.current_stream().cuda_stream
        if not self._drafter.run(inputs, outputs, stream):
            raise RuntimeError("drafter engine execution failed")
        torch.cuda.current_stream().synchronize()
        ids = outputs[network.DRAFT_TOKEN_IDS].tolist()
        drafted, start = [], 0
        for n in sizes:  # slot j of a block predicts position start + j; slot 0 predicts nothing
            drafted.append(ids[start + 1 : start + n])
            start += n
        return drafted
