"""The engine's I/O on TensorRT-LLM 1.2.1's EAGLE contract: names, dtypes and shapes, in one table.

One engine (`speculative_decoding_mode eagle`, the executor's `DecodingMode::Eagle`) runs, per call:
the target over every scheduled token, our accept op over the previous step's drafts, KV injection of
the kept tokens' target features into the drafter's layers (extra layers of the same paged KV pool),
then one DFlash block pass that proposes the next drafts as a one-path tree. The C++ runtime fills the
inputs and consumes the outputs listed here; docs/engine-path.md cites where it does so.

The CPU emulation (`trtllm/emulation.py`) takes its names, dtypes and shapes from this module only; the
TensorRT-LLM model class (`trtllm/model.py`, built by trtllm-build) is to do the same once its network is written.

Shapes use K = max_draft_len (block_size - 1), D = K + 1 (max_decoding_tokens), P = num_eagle_layers + 1
(max_path_len; a one-path tree of K drafts plus its root needs num_eagle_layers = K), W = ceil(D / 32)
(packed-mask words), M = blocks per sequence, V = vocabulary; the per-call sizes are described at INPUTS.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..tree import ancestors, chain, depths

# Request types of `host_request_types` (runtime/common.h RequestType: context 0, generation 1).
CONTEXT, GENERATION = 0, 1


@dataclass(frozen=True)
class Io:
    name: str
    dtype: str  # "int32" | "float32"
    shape: str
    host: bool = False


# The inputs our engine reads, as the runtime fills them (docs/engine-path.md, "What the runtime feeds the engine").
# B requests, context rows first; G of them generation requests; N tokens in input_ids (a context row's prompt, a
# generation row's [last token, drafts]); Q = context tokens + G (a generation row has ONE position id, N - 1:
# the engine adds spec_decoding_position_offsets); R = logits rows (1 per context row, 1 + drafts per generation row).
INPUTS: tuple[Io, ...] = (
    Io("input_ids", "int32", "[N]"),
    Io("position_ids", "int32", "[Q]"),
    Io("last_token_ids", "int32", "[R]"),
    Io("host_request_types", "int32", "[B]", host=True),
    Io("host_context_lengths", "int32", "[B]", host=True),
    Io("host_past_key_value_lengths", "int32", "[B]", host=True),
    Io("sequence_length", "int32", "[B]"),
    Io("kv_cache_block_offsets", "int32", "[1, B, 2, M]"),
    Io("spec_decoding_generation_lengths", "int32", "[G]"),
    Io("spec_decoding_position_offsets", "int32", "[G, D]"),
    Io("spec_decoding_packed_mask", "int32", "[GD, W]"),
    Io("draft_tokens", "int32", "[B, K]"),
    Io("draft_lens", "int32", "[B]"),
    Io("draft_paths", "int32", "[B, D, P]"),
    Io("greedy_sampling", "int32", "[1]", host=True),
    Io("eagle_temperature", "float32", "[B]"),
    Io("rand_data_sample", "float32", "[B]"),
    Io("rand_data_validation", "float32", "[B, D]"),
)

# Every tensor the runtime binds for an EAGLE engine (EagleBuffers::insertInputTensors); an engine input outside
# this set and the base model's standard inputs makes TllmRuntime throw "Input tensor ... not found". Our
# engine declares only what it reads.
EAGLE_RUNTIME_INPUTS: frozenset[str] = frozenset((
    "greedy_sampling", "eagle_temperature", "posterior_alpha", "posterior_threshold", "spec_decoding_generation_lengths",
    "spec_decoding_position_offsets", "spec_decoding_packed_mask", "rand_data_sample", "rand_data_validation",
    "draft_tokens", "draft_lens", "draft_paths",
    "host_ctx_eagle_net_request_types", "host_ctx_eagle_net_context_lengths", "host_ctx_eagle_net_past_key_value_lengths",
    "host_gen_eagle_net_request_types", "host_gen_eagle_net_context_lengths", "host_gen_eagle_net_past_key_value_lengths",
    "input_gen_tokens", "chunked_context_next_tokens", "use_dynamic_tree", "spec_decoding_use", "dynamic_tree_max_topK",
    "prev_scores", "current_expand_indices", "all_layers_scores", "all_layers_draft_token_ids",
    "all_layers_draft_token_ids_predecessor",
))
# The base decoder's inputs we read (tensorrt_llm's prepare_inputs declares them for every paged-KV engine).
BASE_INPUTS: frozenset[str] = frozenset((
    "input_ids", "position_ids", "last_token_ids", "host_request_types", "host_context_lengths",
    "host_past_key_value_lengths", "sequence_length", "kv_cache_block_offsets",
))

OUTPUTS: tuple[Io, ...] = (
    Io("logits", "float32", "[R, V]"),  # bound and dtype-read by the runtime; the Eagle decoder never reads it
    Io("accepted_tokens", "int32", "[B, P]"),
    Io("num_accepted_tokens", "int32", "[B]"),  # bonus included: 1 for a context row, 1..drafts+1 otherwise
    Io("accepted_paths", "int32", "[B]"),
    Io("next_draft_tokens", "int32", "[B, K]"),
    Io("next_draft_lens", "int32", "[B]"),
    Io("next_draft_paths", "int32", "[B, D, P]"),
)

INPUT_NAMES = tuple(io.name for io in INPUTS)
OUTPUT_NAMES = tuple(io.name for io in OUTPUTS)
TORCH_DTYPES = {"int32": torch.int32, "float32": torch.float32}


@dataclass(frozen=True)
class Dims:
    """The build-time sizes of the contract for a drafter of `block_size`: K = block_size - 1 drafts as a chain,
    `num_eagle_layers` = K (the path length of a K-draft chain is K + 1 = num_eagle_layers + 1)."""

    block_size: int

    @property
    def max_draft_len(self) -> int:  # K
        return self.block_size - 1

    @property
    def num_eagle_layers(self) -> int:
        return self.max_draft_len

    @property
    def max_decoding_tokens(self) -> int:  # D
        return self.max_draft_len + 1

    @property
    def max_path_len(self) -> int:  # P
        return self.num_eagle_layers + 1

    @property
    def packed_mask_words(self) -> int:  # W
        return -(-self.max_decoding_tokens // 32)

    @property
    def kv_tokens_per_step(self) -> int:
        """Tokens of KV blocks the runtime adds to a request before each call (maxPathLen + maxDecodingTokens)."""
        return self.max_path_len + self.max_decoding_tokens

    def sizes(self, batch: int, generation: int, tokens: int, max_blocks: int, vocab: int, drafts: int) -> dict[str, int]:
        """`drafts`: the sum of the generation rows' draft lengths."""
        context = batch - generation
        return {"B": batch, "G": generation, "N": tokens, "Q": tokens - drafts, "R": context + generation + drafts,
                "K": self.max_draft_len, "D": self.max_decoding_tokens, "P": self.max_path_len, "W": self.packed_mask_words,
                "GD": generation * self.max_decoding_tokens, "M": max_blocks, "V": vocab}


def shape_of(io: Io, sizes: dict[str, int]) -> tuple[int, ...]:
    return tuple(int(d) if d.isdigit() else sizes[d] for d in io.shape.strip("[]").split(", "))


def check_io(tensors: dict[str, torch.Tensor], table: tuple[Io, ...], sizes: dict[str, int], side: str) -> None:
    """Every tensor of `table` is present with exactly its shape and dtype (what TensorRT checks at bind time)."""
    for io in table:
        if io.name not in tensors:
            raise ValueError(f"{side}: missing engine tensor {io.name!r}")
        t = tensors[io.name]
        want = (TORCH_DTYPES[io.dtype], shape_of(io, sizes))
        if (t.dtype, tuple(t.shape)) != want:
            raise ValueError(f"{side}: {io.name} is {t.dtype} {tuple(t.shape)}, the contract says {want[0]} {want[1]}")


def chain_paths(dims: Dims, batch: int) -> torch.Tensor:
    """The one-path tree of K drafts, [B, D, P] int32: path 0 = [0, 1, ..., K] (token indices within the
    verify block, 0 = the root, the last accepted token); every other path is -1 (unused)."""
    paths = torch.full((batch, dims.max_decoding_tokens, dims.max_path_len), -1, dtype=torch.int32)
    paths[:, 0] = torch.arange(dims.max_path_len, dtype=torch.int32)
    return paths


def chain_packed_mask(dims: Dims, batch: int) -> torch.Tensor:
    """[B, D, W] int32: bit j of row i set when verify token i may attend verify token j; a chain is causal.
    (The runtime passes the generation rows' masks flattened, [G·D, W].)"""
    return tree_packed_mask(dims, chain(dims.max_draft_len)).expand(batch, -1, -1).contiguous()


def tree_paths(dims: Dims, parents: list[int]) -> torch.Tensor:
    """A draft tree (tree.py: node 0 the root, parents[0] == -1) as EAGLE's `draft_paths` row, [D, P] int32: one
    path per leaf, root first, in leaf order; unused entries -1. A chain gives chain_paths' row."""
    paths = torch.full((dims.max_decoding_tokens, dims.max_path_len), -1, dtype=torch.int32)
    has_child = set(parents[1:])
    leaves = [i for i in range(len(parents)) if i not in has_child]
    for row, leaf in enumerate(leaves):
        path = [leaf]
        while parents[path[0]] >= 0:
            path.insert(0, parents[path[0]])
        paths[row, : len(path)] = torch.tensor(path, dtype=torch.int32)
    return paths


def parents_of_paths(paths: torch.Tensor, num_tokens: int) -> list[int]:
    """The inverse of tree_paths for a block of `num_tokens` tokens (root + drafts): each token's parent. Raises
    ValueError unless the paths form one tree over exactly tokens 0..num_tokens-1, rooted at 0."""
    parents: dict[int, int] = {0: -1}
    for path in paths.tolist():
        nodes = [i for i in path if i >= 0]
        if not nodes:
            continue
        if nodes[0] != 0 or any(i >= num_tokens for i in nodes) or nodes != path[: len(nodes)]:
            raise ValueError(f"draft path {path} does not start at the root or names a token outside [0, {num_tokens})")
        for parent, child in zip(nodes, nodes[1:]):
            if parents.setdefault(child, parent) != parent:
                raise ValueError(f"token {child} has two parents in the draft paths")
    if sorted(parents) != list(range(num_tokens)):
        raise ValueError(f"the draft paths cover tokens {sorted(parents)}, not 0..{num_tokens - 1}")
    out = [parents[i] for i in range(num_tokens)]
    if any(p >= i for i, p in enumerate(out) if i):
        raise ValueError("a draft token comes before its parent in the block")
    return out


def tree_position_offsets(dims: Dims, parents: list[int]) -> torch.Tensor:
    """[D]: each block token's depth (0 for the root); entries past the block 0."""
    out = torch.zeros(dims.max_decoding_tokens, dtype=torch.int32)
    out[: len(parents)] = torch.tensor(depths(parents), dtype=torch.int32)
    return out


def tree_packed_mask(dims: Dims, parents: list[int]) -> torch.Tensor:
    """[D, W] int32: bit j of row i set when token j is token i or one of its ancestors (rows past the block 0)."""
    return pack_mask(dims, ancestors(parents).tolist())


def pack_mask(dims: Dims, rows: list[list[bool]]) -> torch.Tensor:
    """[D, W] int32: bit j of row i set when rows[i][j] (token i may attend token j); rows past `rows` 0."""
    mask = torch.zeros(dims.max_decoding_tokens, dims.packed_mask_words, dtype=torch.int64)
    for i, row in enumerate(rows):
        for j, seen in enumerate(row):
            if seen:
                mask[i, j // 32] |= 1 << (j % 32)
    return torch.where(mask >= 2**31, mask - 2**32, mask).to(torch.int32)
