"""Tensor parallelism for the PyTorch runtime, gpt-fast style: `apply_tp` turns a target or DFlash drafter
built for the full config into this rank's shard, one helper per layer kind, and the weights then load from
the rank's own rank{r}.safetensors, which the converter wrote by the same rules (shard_rules.py).

Megatron layout: q/k/v and gate/up column-parallel (heads, intermediate rows), o_proj and down_proj
row-parallel, each followed by one all-reduce: 2 all-reduces per layer and forward. KV heads are
duplicated when nkv < tp, so each rank's paged caches hold only its own heads. The embedding is
all-gathered once at load (its lookup then needs no collective, in the target or in the drafter, for
V·H more memory per rank); lm_head stays vocab-parallel: greedy tokens come from one all-gather of
per-rank (max, index) pairs, and only sequences that sample gather their full logits.

All ranks agree on every accepted length without a broadcast: they run the same loop on the same
inputs, and each decision is a pure function of data every rank holds bit for bit: greedy target and
draft tokens are reduced locally from the same all-gathered (max, index) pairs, sampled sequences read
the same all-gathered logits with the same per-request seed (the global RNG is seeded alike on all ranks
too). A broadcast from rank 0 would add a collective and a sync point per step and carry nothing new.

The drafter is sharded like the target (2 all-reduces per drafter layer per draft) or replicated
(`drafter_mode="replicated"`: each rank all-gathers the drafter's shards once at load and runs it whole;
no all-reduce while drafting, but every rank spends the drafter's full FLOPs and memory).

Ranks come from mpi4py (one process per GPU under mpirun, as TensorRT-LLM launches them) or from
torchrun's environment; the process group is torch.distributed's, gloo on CPU and NCCL on CUDA. A
collective that fails (a peer died: gloo sees its socket close; a peer hangs: the group's timeout)
raises DistributedError on the ranks that wait, so no rank hangs. Under NCCL a dead peer is only seen
when the group's timeout (`--tp-timeout`) expires, and NCCL's watchdog may then abort the process
instead of raising: the job still ends, but with NCCL's message rather than ours.
"""

from __future__ import annotations

import datetime
import os
import socket
from collections import Counter
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from . import shard_rules
from .errors import ConfigError, DFlashError

MPI_ENV = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK")


class DistributedError(DFlashError):
    """A rank failed, died or timed out; raised on every rank that learns of it."""


class TPGroup:
    """This rank's place in the tensor-parallel group and the collectives the runtime uses, each counted
    (calls and bytes this rank sends) so a test can hold a decode step to its closed-form count."""

    def __init__(self, rank: int, world_size: int, device: torch.device):
        self.rank, self.world_size, self.device = rank, world_size, device
        self.calls: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()

    def _run(self, kind: str, nbytes: int, op: Callable[[], Any]) -> Any:
        self.calls[kind] += 1
        self.bytes[kind] += nbytes
        try:
            return op()
        except (RuntimeError, ValueError) as e:  # gloo / NCCL report a lost or hung peer as RuntimeError
            detail = str(e).strip().splitlines()[0][:300] if str(e).strip() else type(e).__name__
            raise DistributedError(f"[rank {self.rank}/{self.world_size}] {kind} failed: another rank died or timed out ({detail})") from None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum over ranks, in place."""
        self._run("all_reduce", x.numel() * x.element_size(), lambda: dist.all_reduce(x))
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """[world_size, *x.shape]: every rank's x, in rank order."""
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        self._run("all_gather", x.numel() * x.element_size(), lambda: dist.all_gather(parts, x))
        return torch.stack(parts)

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        self._run("all_gather_object", 0, lambda: dist.all_gather_object(out, obj))
        return out

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        box = [obj]
        self._run("broadcast_object", 0, lambda: dist.broadcast_object_list(box, src=src))
        return box[0]

    def agree(self, fn: Callable[[], Any]) -> Any:
        """Run `fn` (local work only: no collectives inside) on every rank; if it fails anywhere, raise the
        failures on every rank, so a rank missing its shard stops the others instead of leaving them waiting."""
        try:
            result, error = fn(), None
        except DFlashError as e:
            result, error = None, str(e)
        except Exception as e:  # anything else local (a corrupt file, out of memory) must reach the others too
            result, error = None, f"{type(e).__name__}: {e}"
        ranks_by_error: dict[str, list[str]] = {}
        for r, e in enumerate(self.all_gather_object(error)):
            if e is not None:
                ranks_by_error.setdefault(e, []).append(str(r))
        if ranks_by_error:
            raise DistributedError("; ".join(f"[rank {','.join(r)} of {self.world_size}] {e}" for e, r in ranks_by_error.items()))
        return result

    def argmax(self, scores: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """scores [n, m]: this rank's columns, whose global indices are ids [m] (ascending) → the global argmax [n],
        ties to the smallest index like torch.argmax over whole rows. One all-gather of (max, index) pairs."""
        n = scores.shape[0]
        if scores.shape[1]:
            best, arg = scores.float().max(dim=-1)
            pairs = torch.stack([best.double(), ids[arg].double()], dim=-1)  # fp32 and ids < 2**53 are exact in fp64
        else:  # a rank holding only vocab padding
            pairs = torch.tensor([[float("-inf"), 0.0]], dtype=torch.float64, device=scores.device).expand(n, 2)
        every = self.all_gather(pairs)  # [tp, n, 2]
        values, index = every[..., 0], every[..., 1]
        top = values == values.max(dim=0).values
        return index.masked_fill(~top, float("inf")).min(dim=0).values.long()

    def gather_columns(self, x: torch.Tensor, width: int) -> torch.Tensor:
        """x [n, m] column part `rank` of a [n, tp·m] tensor → its first `width` columns, on every rank."""
        every = self.all_gather(x)  # [tp, n, m]
        return every.permute(1, 0, 2).reshape(x.shape[0], -1)[:, :width]

    def stats(self) -> dict[str, dict[str, int]]:
        return {"calls": dict(self.calls), "bytes": dict(self.bytes)}

    def reset_stats(self) -> None:
        self.calls.clear()
        self.bytes.clear()

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def launched_world_size() -> int:
    """How many ranks the launcher started (1 when run without mpirun / torchrun), without initialising MPI."""
    for key in ("WORLD_SIZE", *MPI_ENV[:2]):
        if os.environ.get(key):
            return int(os.environ[key])
    return 1


def init_tp(device: str = "cpu", timeout_s: float = 300.0) -> TPGroup:
    """Join the group: rank and size from torchrun's environment or mpi4py; gloo on CPU, NCCL on CUDA.
    `timeout_s` bounds every wait on another rank."""
    env = os.environ
    timeout = datetime.timedelta(seconds=timeout_s)
    if all(k in env for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")):  # torchrun
        rank, world, local_rank = int(env["RANK"]), int(env["WORLD_SIZE"]), int(env.get("LOCAL_RANK", 0))
        store = None
    elif any(k in env for k in MPI_ENV):
        try:
            from mpi4py import MPI
        except ImportError:
            raise ConfigError("launched under MPI but mpi4py is not installed: pip install mpi4py", key="mpi4py") from None
        comm = MPI.COMM_WORLD
        rank, world = comm.Get_rank(), comm.Get_size()
        local_rank = comm.Split_type(MPI.COMM_TYPE_SHARED).Get_rank()
        hosts = comm.allgather(socket.gethostname())
        host = "127.0.0.1" if len(set(hosts)) == 1 else hosts[0]
        # Rank 0 serves the rendezvous store on a free port (port 0) and tells the others which one.
        store = dist.TCPStore(host, 0, world, True, timeout=timeout, wait_for_workers=False) if rank == 0 else None
        port = comm.bcast(store.port if rank == 0 else None, root=0)
        if rank != 0:
            store = dist.TCPStore(host, port, world, False, timeout=timeout)
    else:
        rank, world, local_rank, store = 0, 1, 0, dist.HashStore()
    dev = torch.device(device)
    if dev.type == "cuda":
        dev = torch.device("cuda", local_rank)
        torch.cuda.set_device(dev)
    backend = "nccl" if dev.type == "cuda" else "gloo"
    kwargs = {"init_method": "env://"} if store is None else {"store": store}
    try:
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=timeout, **kwargs)
    except (RuntimeError, ValueError) as e:
        raise DistributedError(f"[rank {rank}/{world}] cannot form the {backend} process group: {e}") from None
    tp = TPGroup(rank, world, dev)
    # Requests without a seed draw one from the global RNG: the same draw on every rank.
    torch.manual_seed(tp.broadcast_object(int(torch.randint(0, 2**62, ())) if rank == 0 else None))
    return tp


# ----------------------------------------------------------------------------------------------------
# apply_tp: one helper per layer kind (on a model built on the meta device, before its shard loads)


class RowParallelLinear(nn.Linear):
    """y = all_reduce(x_r · W_rᵀ) + b: rank r holds input columns r of W; the (full) bias is added once, after the sum."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TPGroup, device=None):
        super().__init__(in_features, out_features, bias=bias, device=device)
        self.tp = tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.tp.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


def _apply_tp_linear(parent: nn.Module, name: str, style: str, tp: TPGroup, rows: int | None = None) -> None:
    """colwise: keep `rows` output rows (this rank's heads / intermediate part); rowwise: 1/tp of the inputs."""
    old: nn.Linear = getattr(parent, name)
    bias, device = old.bias is not None, old.weight.device
    if style == "colwise":
        new = nn.Linear(old.in_features, rows, bias=bias, device=device)
    else:
        cols = shard_rules.col_slice(old.in_features, tp.world_size, tp.rank)
        new = RowParallelLinear(cols.stop - cols.start, old.out_features, bias, tp, device=device)
    setattr(parent, name, new)


def _apply_tp_attention(attn: nn.Module, tp: TPGroup) -> None:
    n, r = tp.world_size, tp.rank
    q_rows = shard_rules.qkv_rows("q", attn.num_heads, attn.num_kv_heads, attn.head_dim, n, r)
    kv_rows = shard_rules.qkv_rows("k", attn.num_heads, attn.num_kv_heads, attn.head_dim, n, r)
    _apply_tp_linear(attn, "q_proj", "colwise", tp, sum(m.n for m in q_rows))
    _apply_tp_linear(attn, "k_proj", "colwise", tp, sum(m.n for m in kv_rows))
    _apply_tp_linear(attn, "v_proj", "colwise", tp, sum(m.n for m in kv_rows))
    _apply_tp_linear(attn, "o_proj", "rowwise", tp)
    attn.num_heads = attn.num_heads // n
    attn.num_kv_heads = shard_rules.kv_heads_per_rank(attn.num_kv_heads, n)


def _apply_tp_mlp(mlp: nn.Module, tp: TPGroup) -> None:
    for name in ("gate_proj", "up_proj"):
        rows = shard_rules.column_rows(getattr(mlp, name).out_features, tp.world_size, tp.rank)[0].n
        _apply_tp_linear(mlp, name, "colwise", tp, rows)
    _apply_tp_linear(mlp, "down_proj", "rowwise", tp)


def _apply_tp_vocab(target: nn.Module, tp: TPGroup) -> None:
    """The embedding and lm_head as the checkpoint stores them: vocab rows padded to a multiple of tp, split."""
    cfg = target.cfg
    rows = shard_rules.pad_vocab_size(cfg.vocab_size, tp.world_size) // tp.world_size
    device = target.model.embed_tokens.weight.device
    target.model.embed_tokens = nn.Embedding(rows, cfg.hidden_size, device=device)
    target.lm_head = nn.Linear(cfg.hidden_size, rows, bias=False, device=device)  # a tied model gets its own copy too


def _apply_tp_sinks(attn: nn.Module, tp: TPGroup) -> None:
    """gpt-oss's per-head sink logits follow their query heads (rank r holds heads r·nh/tp ...)."""
    rows = shard_rules.column_rows(attn.sinks.shape[0], tp.world_size, tp.rank)[0].n
    attn.sinks = nn.Parameter(torch.empty(rows, device=attn.sinks.device))


def _apply_tp_experts(moe: nn.Module, tp: TPGroup) -> None:
    """Every expert's intermediate dimension split across ranks (shard_rules.py, "Experts"): gate_up_proj keeps this
    rank's gate/up column pairs, down_proj its rows; the router and down_proj_bias stay whole."""
    ex = moe.experts
    E, H, two_i = ex.gate_up_proj.shape
    part = shard_rules.column_rows(two_i // 2, tp.world_size, tp.rank)[0].n
    device = ex.gate_up_proj.device
    ex.gate_up_proj = nn.Parameter(torch.empty(E, H, 2 * part, device=device))
    ex.gate_up_proj_bias = nn.Parameter(torch.empty(E, 2 * part, device=device))
    ex.down_proj = nn.Parameter(torch.empty(E, part, H, device=device))
    moe.tp = tp


def apply_tp(model: nn.Module, tp: TPGroup) -> nn.Module:
    """Shard a TargetModel or DFlashDrafter (built for the full config) into rank `tp.rank`'s part, in place."""
    from .models.moe import MoE
    from .models.target import TargetModel

    layers = model.model.layers if isinstance(model, TargetModel) else model.layers
    for layer in layers:
        if getattr(layer.self_attn, "sinks", None) is not None:
            _apply_tp_sinks(layer.self_attn, tp)
        _apply_tp_attention(layer.self_attn, tp)
        if isinstance(layer.mlp, MoE):
            _apply_tp_experts(layer.mlp, tp)
        else:
            _apply_tp_mlp(layer.mlp, tp)
    if isinstance(model, TargetModel):
        _apply_tp_vocab(model, tp)
        model.vocab = ShardedVocab(tp, model.cfg.vocab_size, tp.device)
    return model


class ShardedVocab:
    """models.layers.LocalVocab's vocabulary-parallel twin: each rank holds the logits of its lm_head rows only.
    Greedy tokens come from a distributed argmax (one all-gather of (max, index) pairs), full logits from an
    all-gather of the columns, for the sequences that sample only."""

    def __init__(self, tp: TPGroup, vocab_size: int, device):
        self.tp, self.vocab_size, self.device = tp, vocab_size, device
        self._columns: torch.Tensor | None = None

    @property
    def columns(self) -> torch.Tensor:
        """Global ids of this rank's real (non-padding) lm_head rows (made on first use: apply_tp may run while
        the model is being built on the meta device)."""
        if self._columns is None:
            self._columns = vocab_columns(self.tp, self.vocab_size, self.device)
        return self._columns

    def greedy(self, logits: torch.Tensor) -> torch.Tensor:
        return self.tp.argmax(logits[:, : len(self.columns)], self.columns)  # lm_head's vocab padding rows left out

    def full_logits(self, logits: torch.Tensor, rows: list[int], need: list[bool]) -> list[torch.Tensor | None]:
        out: list[torch.Tensor | None] = [None] * len(rows)
        wanted = [i for i, n in enumerate(need) if n]
        if wanted:
            parts = logits.split(rows)
            full = self.tp.gather_columns(torch.cat([parts[i] for i in wanted]), self.vocab_size)
            for i, f in zip(wanted, full.split([rows[i] for i in wanted])):
                out[i] = f
        return out

    def draft_head(self, lm_head: torch.Tensor, d2t: torch.Tensor | None):
        head, columns, ids = draft_vocab_shard(lm_head, self.columns, d2t)  # this rank's rows, their global draft indices
        return head, ids, lambda scores: self.tp.argmax(scores, columns)


def gather_embedding(target: nn.Module, tp: TPGroup) -> None:
    """After loading: every rank gets the whole embedding table (one all-gather, once)."""
    shard = target.model.embed_tokens.weight
    full = tp.all_gather(shard).reshape(-1, shard.shape[1])[: target.cfg.vocab_size]
    target.model.embed_tokens = nn.Embedding.from_pretrained(full, freeze=True)


def vocab_columns(tp: TPGroup, vocab_size: int, device) -> torch.Tensor:
    """Global token ids of this rank's real (non-padding) lm_head rows."""
    maps = shard_rules.vocab_rows(vocab_size, tp.world_size, tp.rank)
    return torch.cat([torch.arange(m.src_start, m.src_start + m.n) for m in maps] or [torch.zeros(0, dtype=torch.long)]).to(device)


def draft_vocab_shard(lm_head_shard: torch.Tensor, columns: torch.Tensor, d2t: torch.Tensor | None):
    """(head rows, their global draft-vocabulary index, draft index → token id or None) on this rank: the
    vocab-parallel `draft_vocab_head`. With d2t a rank keeps the draft rows whose token falls in its slice."""
    if d2t is None:
        return lm_head_shard[: len(columns)], columns, None
    token_ids = torch.arange(len(d2t), device=d2t.device) + d2t
    start = int(columns[0]) if len(columns) else 0
    mine = (token_ids >= start) & (token_ids < start + len(columns))
    return lm_head_shard[token_ids[mine] - start].contiguous(), mine.nonzero()[:, 0], token_ids
