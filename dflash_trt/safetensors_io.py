"""The safetensors file format, read with explicit positional reads and written tensor by tensor.

The `safetensors` package reads through mmap (touched pages stay resident and count toward RSS until
the whole file is closed) and writes only from a complete in-memory dict, so a converter built on it
holds every tensor at once. The format is small and stable (8-byte little-endian header length, a
JSON header of {name: {dtype, shape, data_offsets}}, then the data); reading rows of one tensor at a
time and writing each rank's file in place keeps memory at one chunk. Files written here are read
back by `safetensors.safe_open` in the tests.
"""

from __future__ import annotations

import json
import math
import os
import struct
from pathlib import Path

import torch

from .errors import CheckpointError

DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
NAMES = {v: k for k, v in DTYPES.items()}
MAX_HEADER = 100 * 1024 * 1024
ROW_CHUNK_BYTES = 64 << 20  # what streaming readers hold of one tensor at a time


class TensorInfo:
    __slots__ = ("name", "dtype", "shape", "start", "end")

    def __init__(self, name: str, dtype: torch.dtype, shape: tuple[int, ...], start: int, end: int):
        self.name, self.dtype, self.shape, self.start, self.end = name, dtype, shape, start, end

    @property
    def row_bytes(self) -> int:
        return math.prod(self.shape[1:]) * self.dtype.itemsize if self.shape else self.dtype.itemsize


class SafetensorsFile:
    """Header of one .safetensors file, checked against the file's size; rows are read on demand."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except OSError as e:
            raise CheckpointError(f"cannot open ({e.strerror})", file=self.path) from None
        size = os.fstat(self._fd).st_size
        head = os.pread(self._fd, 8, 0)
        if len(head) < 8:
            raise CheckpointError("not a safetensors file (shorter than its 8-byte header length)", file=self.path)
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER or 8 + n > size:
            raise CheckpointError(f"not a safetensors file, or truncated (header of {n} bytes, file of {size})", file=self.path)
        try:
            header = json.loads(os.pread(self._fd, n, 8))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"malformed safetensors header ({e})", file=self.path) from None
        if not isinstance(header, dict):
            raise CheckpointError("malformed safetensors header (not a JSON object)", file=self.path)
        self.metadata = header.pop("__metadata__", None) or {}
        self.data_start = 8 + n
        data_size = size - self.data_start
        self.tensors: dict[str, TensorInfo] = {}
        for name, entry in header.items():
            try:
                dtype = DTYPES[entry["dtype"]]
                shape = tuple(int(d) for d in entry["shape"])
                start, end = (int(o) for o in entry["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise CheckpointError(f"malformed header entry {entry!r}", file=self.path, key=name) from None
            if end - start != math.prod(shape) * dtype.itemsize or start < 0:
                raise CheckpointError(f"data_offsets {[start, end]} do not hold shape {list(shape)} of {entry['dtype']}", file=self.path, key=name)
            if end > data_size:
                raise CheckpointError(
                    f"file is truncated: the tensor's data ends at byte {self.data_start + end}, the file has {size}",
                    file=self.path,
                    key=name,
                )
            self.tensors[name] = TensorInfo(name, dtype, shape, start, end)

    def keys(self) -> list[str]:
        return list(self.tensors)

    def read_rows(self, name: str, row_start: int = 0, row_stop: int | None = None) -> torch.Tensor:
        """Rows [row_start, row_stop) of a tensor along dim 0 (the whole tensor by default), as a new tensor."""
        info = self.tensors[name]
        if not info.shape:
            data = os.pread(self._fd, info.end - info.start, self.data_start + info.start)
            return torch.frombuffer(bytearray(data), dtype=info.dtype).reshape(()).clone() if data else torch.empty((), dtype=info.dtype)
        rows = info.shape[0]
        row_stop = rows if row_stop is None else row_stop
        count = (row_stop - row_start) * info.row_bytes
        buf = bytearray(count)
        view = memoryview(buf)
        done = 0
        offset = self.data_start + info.start + row_start * info.row_bytes
        while done < count:
            got = os.preadv(self._fd, [view[done:]], offset + done)
            if got <= 0:
                raise CheckpointError("unexpected end of file while reading", file=self.path, key=name)
            done += got
        shape = (row_stop - row_start, *info.shape[1:])
        if count == 0:
            return torch.empty(shape, dtype=info.dtype)
        return torch.frombuffer(buf, dtype=info.dtype).reshape(shape)

    def row_chunks(self, name: str, max_bytes: int = ROW_CHUNK_BYTES, bytes_per_row: int | None = None):
        """(first row, rows) over tensor `name` in chunks of at most `max_bytes` (rows of `bytes_per_row` each: by
        default as stored; a caller that widens them, e.g. to fp32, passes the wider size). A scalar is one chunk."""
        info = self.tensors[name]
        if not info.shape:
            yield 0, self.read_rows(name)
            return
        step = max(1, max_bytes // max(1, bytes_per_row or info.row_bytes))
        for a in range(0, info.shape[0], step):
            yield a, self.read_rows(name, a, min(info.shape[0], a + step))

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass


class SafetensorsWriter:
    """Writes one .safetensors file whose tensors (name → (dtype, shape)) are declared up front.

    The file is sized at once (unwritten bytes read as zeros, which vocab padding relies on); rows
    of each tensor are then written in any order with `write_rows`, and `finish` checks that every
    tensor got the bytes it was promised."""

    def __init__(self, path: str | Path, tensors: dict[str, tuple[torch.dtype, tuple[int, ...]]], expected_bytes: dict[str, int] | None = None,
                 metadata: dict[str, str] | None = None, stored_shapes: dict[str, tuple[int, ...]] | None = None):
        """`stored_shapes`: the shape the header records for a tensor written as `tensors` declares it (same
        element count; e.g. a stack of experts [E, R, C] written as rows of [E·R, C])."""
        self.path = Path(path)
        header: dict[str, object] = {"__metadata__": {"format": "pt", **(metadata or {})}}
        self.info: dict[str, TensorInfo] = {}
        offset = 0
        stored_shapes = stored_shapes or {}
        for name in sorted(tensors):
            dtype, shape = tensors[name]
            nbytes = math.prod(shape) * dtype.itemsize
            stored = stored_shapes.get(name, shape)
            if math.prod(stored) != math.prod(shape):
                raise ValueError(f"{name}: stored shape {list(stored)} does not hold {list(shape)}")
            header[name] = {"dtype": NAMES[dtype], "shape": list(stored), "data_offsets": [offset, offset + nbytes]}
            self.info[name] = TensorInfo(name, dtype, tuple(shape), offset, offset + nbytes)
            offset += nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned
        self.data_start = 8 + len(raw)
        self.expected = {n: i.end - i.start for n, i in self.info.items()}
        self.expected.update(expected_bytes or {})
        self.written = dict.fromkeys(self.info, 0)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.ftruncate(self._fd, self.data_start + offset)
        os.pwrite(self._fd, struct.pack("<Q", len(raw)) + raw, 0)
        self.bytes_written = 0

    def write_rows(self, name: str, row_start: int, rows: torch.Tensor) -> None:
        info = self.info[name]
        if rows.dtype != info.dtype or tuple(rows.shape[1:]) != info.shape[1:] and info.shape:
            raise ValueError(f"{self.path.name}: {name}: got {rows.dtype} {list(rows.shape)}, declared {info.dtype} {list(info.shape)}")
        data = rows.contiguous().reshape(-1).view(torch.uint8).numpy()
        if info.shape and row_start + rows.shape[0] > info.shape[0]:
            raise ValueError(f"{self.path.name}: {name}: rows beyond {info.shape[0]}")
        offset = self.data_start + info.start + row_start * info.row_bytes
        view = memoryview(data)
        done = 0
        while done < len(view):
            done += os.pwrite(self._fd, view[done:], offset + done)
        self.written[name] += len(view)
        self.bytes_written += len(view)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        self.write_rows(name, 0, tensor)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def finish(self) -> None:
        """Close, checking that every tensor got all its bytes."""
        self.close()
        for name, want in self.expected.items():
            if self.written[name] != want:
                raise RuntimeError(f"{self.path}: {name}: wrote {self.written[name]} of {want} bytes (converter bug)")
