"""Tensor-parallel shard rules, one set for the converter (which writes rank{r}.safetensors) and the
TP runtime (which loads them): Megatron column/row splits as TensorRT-LLM lays them out.

- column-parallel (split the output rows): fused qkv (per Q/K/V part, by heads), mlp fc / gate, the
  drafter's context projection stays replicated (its output is normed over the full hidden size);
- row-parallel (split the input columns, then all-reduce): attention dense, mlp proj;
- vocab-parallel: lm_head and the embedding, rows padded to a multiple of tp
  (`pad_vocab_size` in tensorrt_llm/_utils.py; `use_parallel_embedding`, `embedding_sharding_dim=0`);
- KV heads: rank r holds KV head r // (tp / nkv) when nkv < tp (`dup_kv_weight`,
  tensorrt_llm/models/convert_utils.py), which needs tp % nkv == 0; else nkv / tp heads each.

- gpt-oss: the sinks (one logit per query head) follow their heads; the router stays replicated.
  **Experts**: every rank holds every expert's slice of the intermediate dimension (the fused gate/up
  rows, column-parallel, and the down projection's inputs, row-parallel; one all-reduce per MoE layer, as
  for a dense MLP), not a subset of whole experts (expert parallelism). Why, per decode step: a step reads
  the experts its tokens route to, E·(1 − (1 − k/E)^T) of them (cost_model.py). Split by the
  intermediate dimension, each rank reads 1/tp of each, so the per-rank read is exactly 1/tp of the
  step's. Split by experts, the step waits for the rank whose experts are hit most: for gpt-oss-120b
  (E 128, k 4) at tp 8 and one token, 4 distinct experts over 8 ranks of 16 put two or more on one rank
  with probability 1 − (112·96·80)/(127·126·125) ≈ 0.57, so more than half the time the slowest rank
  reads 2/4 of the step's expert weights (at best 1/4) where the intermediate split reads 1/8;
  for a 16-token verify the touched experts spread wider but a rank still reads ≥ 1/tp of them. Expert
  parallelism pays at large batch, with all-to-all routing, which the engine path's MoE plugin handles
  (`moe_ep_size`), not this runtime.

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
             path: str | None = None, nvfp4: bool = False, experts: bool = False) -> None:
    """Raise ConfigError (naming the config key) when `tp` cannot shard this transformer. `experts`: the MLP is an
    expert stack, whose per-rank width is padded to whole NVFP4 blocks (expert_width)."""

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
        widths = [("num_attention_heads", num_heads * head_dim // tp)]
        if not experts:  # an expert stack's rank width is padded instead
            widths.insert(0, ("intermediate_size", intermediate_size // tp))
        for key, width in widths:
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


EXPERT_ALIGN = NVFP4_BLOCK  # a rank's expert width is padded to a multiple of this (NVFP4 blocks never straddle ranks)


def expert_width(intermediate: int, tp: int) -> int:
    """Columns of the intermediate dimension each rank holds per expert: its I / tp real ones, padded with zeros to a
    multiple of EXPERT_ALIGN. gpt-oss-120b's 2880 at tp 8 is 360 real + 8 zero columns per rank, where an NVFP4 block
    of 16 would otherwise straddle two ranks. A zero gate/up row with zero bias gives (0 + 1) · 0 · σ(0) = 0 into a zero
    down column: the padding is exact."""
    if intermediate % tp:
        raise ValueError(f"{intermediate} does not split into {tp} parts")
    return -(-intermediate // (tp * EXPERT_ALIGN)) * EXPERT_ALIGN


def expert_rows(part: str, experts: int, intermediate: int, tp: int, rank: int) -> list[RowMap]:
    """Where rows of the stacked up / gate projections (`part`; [experts · I, H] each, expert-major) go in rank
    `rank`'s fused `fc` [experts, 2 · width, H]: per expert, this rank's I / tp rows, up first, then gate, each
    padded to expert_width (the padding rows stay zero)."""
    width, real = expert_width(intermediate, tp), intermediate // tp
    offset = {"up": 0, "gate": width}[part]
    return [RowMap(e * intermediate + rank * real, e * 2 * width + offset, real) for e in range(experts)]
