"""vLLM's `speculators` format for DFlash drafters (speculators 0.9.0, Apache-2.0), both ways: its config read as z-lab's
(so config.py parses it like any DFlash drafter) and z-lab's written as its.

A speculators DFlash checkpoint, as `speculators.convert.dflash.DFlashConverter` writes one (read from the 0.9.0 wheel:
`models/dflash/config.py` `DFlashSpeculatorConfig`, `convert/dflash/converter.py`, `model.py` `_init_vocab`):

- config.json: `speculators_model_type: "dflash"`; the draft transformer's Qwen3 config under `transformer_layer_config`
  (z-lab's config.json less `architectures`, `auto_map`, `block_size`, `dflash_config`, `num_target_layers`);
  `block_size`; `mask_token_id`; `draft_vocab_size`; `aux_hidden_state_layer_ids` = z-lab's `target_layer_ids` + 1
  (speculators counts hidden states with the embedding output as 0, z-lab counts layers); `sliding_window_non_causal`
  (sliding layers bidirectional too); `sample_from_anchor` (DSpark's anchor sampling); `speculators_config` (algorithm
  "dflash", a greedy proposal of block_size − 1 tokens, the verifier's path and architectures).
- model.safetensors: z-lab's tensor names (`layers.*`, `fc`, `hidden_norm`, `norm`); with a reduced draft vocabulary
  also `lm_head` [draft_vocab, H] (the verifier's rows where `t2d` is set, in token order), `d2t` (EAGLE-3 offsets:
  draft token i is target token i + d2t[i]) and `t2d` (bool [vocab]).
- speculators also writes `config.py`, the source of its config class (for `auto_map`): code, never read here and
  never written by us.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from .errors import CheckpointError, ConfigError

SPECULATORS_VERSION = "0.9.0"  # the release whose format this follows
# z-lab config keys that are not the draft transformer's (speculators' converter drops the same ones), plus ours
ZLAB_ONLY_KEYS = frozenset({"architectures", "auto_map", "block_size", "dflash_config", "num_target_layers", "draft_vocab_size"})


def is_speculators_config(raw: dict[str, Any]) -> bool:
    return "speculators_model_type" in raw


def speculators_as_zlab(raw: dict[str, Any], path: Path, architecture: str) -> dict[str, Any]:
    """A speculators DFlash config.json as z-lab's config keys (architecture name `architecture`), for the drafter
    parser; anything else speculators holds (DSpark, DFlash 2, another algorithm) is refused by key."""
    kind = raw.get("speculators_model_type")
    if kind != "dflash":
        raise ConfigError(f"speculators model type {kind!r} is not supported (dflash only)", file=path, key="speculators_model_type")
    algorithm = (raw.get("speculators_config") or {}).get("algorithm", "dflash")
    if algorithm != "dflash":
        raise ConfigError(f"algorithm {algorithm!r} is not supported (dflash only)", file=path, key="speculators_config.algorithm")
    if raw.get("sample_from_anchor"):
        raise ConfigError("drafting from the anchor position (DSpark) is not supported: the block's first token is the last "
                          "committed one here", file=path, key="sample_from_anchor")
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ConfigError("expected the draft transformer's config (an object)", file=path, key="transformer_layer_config")
    aux = raw.get("aux_hidden_state_layer_ids")
    if not isinstance(aux, list) or not aux or not all(isinstance(i, int) and not isinstance(i, bool) and i >= 1 for i in aux):
        raise ConfigError(f"expected a non-empty list of hidden-state indices >= 1 (layer i's output is index i + 1), got {aux!r}",
                          file=path, key="aux_hidden_state_layer_ids")
    for key in ("block_size", "mask_token_id"):
        if not isinstance(raw.get(key), int):
            raise ConfigError(f"expected an integer, got {raw.get(key)!r}", file=path, key=key)
    dflash: dict[str, Any] = {"mask_token_id": raw["mask_token_id"], "target_layer_ids": [i - 1 for i in aux]}
    if raw.get("sliding_window_non_causal"):
        dflash["causal"] = False  # full-attention layers are bidirectional anyway; now sliding ones too
    hf = {k: v for k, v in layer.items() if k not in ZLAB_ONLY_KEYS}
    hf.update(architectures=[architecture], block_size=raw["block_size"], dflash_config=dflash)
    draft_vocab = raw.get("draft_vocab_size")
    if draft_vocab is not None and draft_vocab != layer.get("vocab_size"):
        hf["draft_vocab_size"] = draft_vocab
    return hf


def zlab_as_speculators(zlab: dict[str, Any], target_layer_ids: list[int], vocab_size: int, draft_vocab_size: int | None,
                        verifier: str, verifier_architectures: list[str], dtype: str) -> dict[str, Any]:
    """The speculators config.json of a z-lab drafter (its config.json `zlab`, resolved layer ids) for the verifier at
    `verifier`: the keys and values speculators' own converter writes."""
    if len(set(target_layer_ids)) != len(target_layer_ids):
        raise ConfigError(f"layer ids {target_layer_ids} repeat (z-lab's default spacing for a shallow target): speculators' "
                          "aux_hidden_state_layer_ids would read as a list with duplicates; give the drafter distinct ids",
                          key="dflash_config.target_layer_ids")
    block_size = zlab.get("block_size") or zlab["dflash_config"]["block_size"]
    layer = {k: v for k, v in zlab.items() if k not in ZLAB_ONLY_KEYS}
    layer.setdefault("model_type", "qwen3")
    return {
        "architectures": ["DFlashDraftModel"],
        "aux_hidden_state_layer_ids": [i + 1 for i in target_layer_ids],
        "block_size": block_size,
        "draft_vocab_size": draft_vocab_size or vocab_size,
        "dtype": dtype,
        "mask_token_id": zlab["dflash_config"]["mask_token_id"],
        "sample_from_anchor": False,
        "sliding_window_non_causal": zlab.get("dflash_config", {}).get("causal") is False,
        "speculators_config": {
            "algorithm": "dflash",
            "default_proposal_method": "greedy",
            "proposal_methods": [{"accept_tolerance": 0.0, "proposal_type": "greedy", "speculative_tokens": block_size - 1,
                                  "verifier_accept_k": 1}],
            "verifier": {"architectures": verifier_architectures, "name_or_path": verifier},
        },
        "speculators_model_type": "dflash",
        "speculators_version": SPECULATORS_VERSION,
        "target_hidden_size": None,
        "tie_word_embeddings": False,
        "transformer_layer_config": layer,
    }


def draft_vocab_tensors(d2t: torch.Tensor, vocab_size: int) -> dict[str, torch.Tensor]:
    """speculators' t2d (bool [vocab], True for the draft vocabulary's tokens) from d2t offsets."""
    t2d = torch.zeros(vocab_size, dtype=torch.bool)
    t2d[torch.arange(len(d2t)) + d2t] = True
    return {"t2d": t2d}


def check_draft_head(tensors: dict[str, torch.Tensor], target_lm_head: torch.Tensor | None, file: Path) -> None:
    """A speculators drafter's own `lm_head` / `t2d` against what this runtime uses instead (the target's lm_head rows of
    the draft tokens, and d2t): equal, or a CheckpointError naming the tensor. `tensors` holds what the file has."""
    d2t = tensors.get("d2t")
    if "t2d" in tensors:
        if d2t is None:
            raise CheckpointError("t2d without d2t", file=file, key="t2d")
        ids = torch.arange(len(d2t)) + d2t.long()
        want = draft_vocab_tensors(d2t.long(), len(tensors["t2d"]))["t2d"]
        if not torch.equal(tensors["t2d"].bool(), want) or not bool((ids[1:] > ids[:-1]).all()):
            raise CheckpointError("t2d does not mark exactly d2t's tokens, in token order", file=file, key="t2d")
    if "lm_head.weight" in tensors:
        if target_lm_head is None:
            raise CheckpointError("this drafter has its own lm_head, which can be checked only against a Hugging Face target "
                                  "directory's lm_head", file=file, key="lm_head.weight")
        rows = target_lm_head if d2t is None else target_lm_head[torch.arange(len(d2t)) + d2t.long()]
        head = tensors["lm_head.weight"]
        if head.shape != rows.shape or not torch.equal(head.to(rows.dtype), rows):
            raise CheckpointError("the drafter's lm_head is not the target's rows of its draft tokens; drafting from a head of "
                                  "its own is not supported", file=file, key="lm_head.weight")
