"""Tensor-parallel shard rules, one set for the converter (which writes rank{r}.safetensors) and the
TP runtime (which loads them): Megatron column/row splits as TensorRT-LLM lays them out.

- column-parallel (split the output rows): fused qkv (per Q/K/V part, by heads), mlp fc / gate, the
  drafter's context projection stays replicated (its output is normed over the full hidden size);
- row-parallel (split the input columns, then all-reduce): attention dense, mlp proj;
- vocab-parallel: lm_head and the embedding, rows padded to a multiple of tp
  (`pad_vocab_size` in tensorrt_llm/_utils.py; `use_parallel_embedding`, `embedding_sharding_dim=0`);
- KV heads: rank r holds KV head r // (tp / nkv) when nkv < tp (`dup_kv_weight`,
  tensorrt_llm/models/convert_utils.py), which needs tp % nkv == 0; else nkv / tp heads each.

Every rule maps rows of a source tensor to rows of a rank's tensor (`RowMap`), so NVFP4 block scales
(rows × in/16) and packed weights (rows × in/2) split with their weights, and the converter can
stream a tensor in row chunks without materialising the shards.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import ConfigError

NVFP4_BLOCK = 16


@dataclass(frozen=True)
class RowMap:
    """Rows [src_start, src_start + n) of the source go to rows [dst_start, dst_start + n) of the shard;
    with `col_split` the shard keeps only column part `rank` of `tp` (row-parallel)."""

    src_start: int
    dst_start: int
    n: int


def pad_vocab_size(vocab: int, tp: int) -> int:
    return -(-vocab // tp) * tp


def kv_heads_per_rank(num_kv_heads: int, tp: int) -> int:
    return max(num_kv_heads // tp, 1)


def kv_head_ids(num_kv_heads: int, tp: int, rank: int) -> list[int]:
    """The (source) KV heads rank `rank` holds."""
    if num_kv_heads >= tp:
        per = num_kv_heads // tp
        return list(range(rank * per, (rank + 1) * per))
    return [rank // (tp // num_kv_heads)]


def check_tp(tp: int, *, num_heads: int, num_kv_heads: int, intermediate_size: int, hidden_size: int, head_dim: int,
             path: str | None = None, nvfp4: bool = False) -> None:
    """Raise ConfigError (naming the config key) when `tp` cannot shard this transformer."""

    def fail(key: str, msg: str):
        return ConfigError(f"tensor parallelism tp={tp}: {msg}", file=path, key=key)

    if tp < 1 or tp > 64:
        raise ConfigError(f"tp must be in 1..64, got {tp}", file=path, key="tp")
    if num_heads % tp:
        raise fail("num_attention_heads", f"{num_heads} attention heads do not divide among {tp} ranks")
    if num_kv_heads >= tp and num_kv_heads % tp:
        raise fail("num_key_value_heads", f"{num_kv_heads} KV heads do not divide among {tp} ranks")
    if num_kv_heads < tp and tp % num_kv_heads:
        raise fail("num_key_value_heads", f"{num_kv_heads} KV heads cannot be duplicated over {tp} ranks (tp % num_kv_heads != 0)")
    if intermediate_size % tp:
        raise fail("intermediate_size", f"{intermediate_size} does not divide among {tp} ranks")
    if nvfp4:
        for key, width in (("intermediate_size", intermediate_size // tp), ("num_attention_heads", num_heads * head_dim // tp)):
            if width % NVFP4_BLOCK:
                raise fail(key, f"a row-parallel NVFP4 shard's input width {width} is not a multiple of {NVFP4_BLOCK}")
        if hidden_size % NVFP4_BLOCK:
            raise fail("hidden_size", f"NVFP4 needs the input width {hidden_size} to be a multiple of {NVFP4_BLOCK}")


def column_rows(rows: int, tp: int, rank: int) -> list[RowMap]:
    if rows % tp:
        raise ValueError(f"{rows} rows do not split into {tp} parts")
    n = rows // tp
    return [RowMap(rank * n, 0, n)]


def vocab_rows(vocab: int, tp: int, rank: int) -> list[RowMap]:
    """Rows of a vocab-padded, vocab-parallel tensor; the padding rows (beyond `vocab`) stay zero."""
    n = pad_vocab_size(vocab, tp) // tp
    start = rank * n
    real = max(0, min(n, vocab - start))
    return [RowMap(start, 0, real)] if real else []


def qkv_rows(part: str, num_heads: int, num_kv_heads: int, head_dim: int, tp: int, rank: int) -> list[RowMap]:
    """Where rows of q_proj / k_proj / v_proj (`part` in q, k, v) go in rank `rank`'s fused qkv [Q|K|V]."""
    q_per = num_heads // tp
    kv_per = kv_heads_per_rank(num_kv_heads, tp)
    if part == "q":
        return [RowMap(rank * q_per * head_dim, 0, q_per * head_dim)]
    base = (q_per + (0 if part == "k" else kv_per)) * head_dim
    return [RowMap(h * head_dim, base + i * head_dim, head_dim) for i, h in enumerate(kv_head_ids(num_kv_heads, tp, rank))]


def qkv_rows_per_rank(num_heads: int, num_kv_heads: int, head_dim: int, tp: int) -> int:
    return (num_heads // tp + 2 * kv_heads_per_rank(num_kv_heads, tp)) * head_dim


def col_slice(cols: int, tp: int, rank: int, unit: int = 1) -> slice:
    """Column part `rank` of a row-parallel weight with `cols` columns (in units of `unit` source inputs
    per stored column: 2 for packed NVFP4 bytes, 16 for block scales)."""
    if cols % tp:
        raise ValueError(f"{cols} columns do not split into {tp} parts")
    n = cols // tp
    return slice(rank * n, (rank + 1) * n)
