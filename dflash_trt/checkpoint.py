"""Lazy safetensors checkpoints (single file or sharded with an index) and an atomic directory writer.

Only safetensors and JSON are read: pickle-based formats (.bin, .pt, .pth, .ckpt, .pkl)
are refused, because loading them can execute code.
"""

from __future__ import annotations

import abc
import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator

import torch
from .errors import CheckpointError
from .safetensors_io import SafetensorsFile

INDEX_NAME = "model.safetensors.index.json"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


class TensorSource(abc.ABC):
    """Named tensors a module is filled from: `keys`, `shape`, `get`, `file_of` (for error messages)."""

    weight_map: dict[str, Path]

    def keys(self) -> list[str]:
        return list(self.weight_map)

    def __contains__(self, name: str) -> bool:
        return name in self.weight_map

    def file_of(self, name: str) -> Path:
        return self.weight_map[name]

    @abc.abstractmethod
    def shape(self, name: str) -> tuple[int, ...]: ...

    @abc.abstractmethod
    def get(self, name: str) -> torch.Tensor: ...

    def load_exact(self, expected: dict[str, tuple[int, ...]], ignore: set[str] = frozenset()) -> dict[str, torch.Tensor]:
        """Read exactly the tensors in `expected` (name → shape): missing, extra or misshapen ones are errors.

        Names in `ignore` are tolerated when present and never read (e.g. a tied lm_head.weight).
        """
        for name in expected:
            if name not in self.weight_map:
                raise CheckpointError("required tensor is missing", file=getattr(self, "directory", None), key=name)
        for name in self.weight_map:
            if name not in expected and name not in ignore:
                raise CheckpointError("unexpected tensor (not part of this architecture)", file=self.file_of(name), key=name)
        tensors = {}
        for name, shape in expected.items():
            got = self.shape(name)
            if got != tuple(shape):
                raise CheckpointError(f"shape {list(got)} != expected {list(shape)}", file=self.file_of(name), key=name)
            tensors[name] = self.get(name)
            check_finite(tensors[name], self.file_of(name), name)
        return tensors


def check_finite(t: torch.Tensor, file, key: str, row_offset: int = 0) -> float:
    """A floating tensor holds no NaN or Inf (one aminmax pass: min and max propagate NaN and show ±Inf, several
    times faster than isfinite); the error names the file, the tensor and the first bad index. Returns max |t|
    from the same pass (0.0 for an integer or empty tensor)."""
    if not t.is_floating_point() or not t.numel():
        return 0.0
    lo, hi = torch.aminmax(t.float() if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t)
    if torch.isfinite(lo) and torch.isfinite(hi):
        return max(-float(lo), float(hi))
    bad = (~torch.isfinite(t.float())).nonzero()[0].tolist()
    if bad:
        bad[0] += row_offset
    raise CheckpointError(f"non-finite value (NaN or Inf) at index {bad}", file=file, key=key)


class InMemorySource(TensorSource):
    """Tensors already in memory (e.g. dequantized from a converted checkpoint); `origin[name]` is the file
    each came from."""

    def __init__(self, tensors: dict[str, torch.Tensor], origin: dict[str, Path], directory: Path | None = None):
        self.tensors, self.weight_map, self.directory = tensors, origin, directory

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def get(self, name: str) -> torch.Tensor:
        return self.tensors[name]


class SafetensorsCheckpoint(TensorSource):
    """Tensor names → files; headers are read (and checked against the file sizes) at once, data on `get`."""

    def __init__(self, directory: str | Path, files: list[str] | None = None):
        """`files`: read only these (e.g. one rank's shard of a TensorRT-LLM checkpoint)."""
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise CheckpointError("checkpoint directory does not exist", file=self.directory)
        self._handles: dict[Path, object] = {}
        self.weight_map: dict[str, Path] = {}
        index = self.directory / INDEX_NAME
        if files is not None:
            paths = [self.directory / f for f in files]
            for path in paths:
                if not path.is_file():
                    raise CheckpointError("missing shard", file=path)
            self._add_files(paths)
        elif index.is_file():
            self._read_index(index)
        else:
            files = sorted(self.directory.glob("*.safetensors"))
            if not files:
                pickles = sorted(p.name for p in self.directory.iterdir() if p.suffix in PICKLE_SUFFIXES)
                if pickles:
                    raise CheckpointError(
                        f"only pickle-based weights found ({', '.join(pickles)}); refusing to load them "
                        "because unpickling can execute code. Convert them to safetensors first.",
                        file=self.directory,
                    )
                raise CheckpointError("no *.safetensors files and no " + INDEX_NAME, file=self.directory)
            self._add_files(files)

    def _add_files(self, files: list[Path]) -> None:
        for file in files:
            for name in self._open(file).keys():
                if name in self.weight_map:
                    raise CheckpointError(f"tensor is stored twice ({self.weight_map[name].name} and {file.name})", file=file, key=name)
                self.weight_map[name] = file

    def _read_index(self, index: Path) -> None:
        try:
            raw = json.loads(index.read_text())
            weight_map = raw["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise CheckpointError(f"malformed index ({e!r})", file=index, key="weight_map") from None
        for name, filename in weight_map.items():
            file = self.directory / filename
            if Path(filename).suffix != ".safetensors":
                raise CheckpointError(f"index points at {filename!r}, which is not a safetensors file", file=index, key=f"weight_map.{name}")
            if not file.is_file():
                raise CheckpointError(f"shard {filename!r} listed in the index does not exist", file=index, key=f"weight_map.{name}")
            self.weight_map[name] = file
        for file in set(self.weight_map.values()):
            stored = set(self._open(file).keys())
            for name, f in self.weight_map.items():
                if f == file and name not in stored:
                    raise CheckpointError(f"index says this tensor is in {file.name}, but it is not", file=index, key=f"weight_map.{name}")

    def _open(self, file: Path) -> SafetensorsFile:
        if file not in self._handles:
            self._handles[file] = SafetensorsFile(file)
        return self._handles[file]

    def shape(self, name: str) -> tuple[int, ...]:
        return self._open(self.weight_map[name]).tensors[name].shape

    def dtype(self, name: str) -> torch.dtype:
        return self._open(self.weight_map[name]).tensors[name].dtype

    def file(self, name: str) -> SafetensorsFile:
        return self._open(self.weight_map[name])

    def get(self, name: str) -> torch.Tensor:
        if name not in self.weight_map:
            raise CheckpointError("tensor not found", file=self.directory, key=name)
        return self._open(self.weight_map[name]).read_rows(name)

    def row_chunks(self, name: str, bytes_per_row: int | None = None):
        """(first row, rows) over tensor `name` in bounded chunks (SafetensorsFile.row_chunks)."""
        yield from self.file(name).row_chunks(name, bytes_per_row=bytes_per_row)

    def nbytes(self, name: str) -> int:
        """Bytes tensor `name` takes on disk."""
        info = self.file(name).tensors[name]
        return info.end - info.start

    def expert_matrix(self, name: str, e: int) -> torch.Tensor:
        """Expert `e` of a stacked [E, in, out] (input-major, `x @ W`) tensor, output-major: [out, in]."""
        return self.file(name).read_rows(name, e, e + 1)[0].transpose(0, 1)


def load_module(build: Callable[[], torch.nn.Module], source: str | Path | TensorSource, dtype: torch.dtype, device, ignore: set[str] = frozenset()):
    """Build a module on the meta device, fill it with exactly the source's tensors (a checkpoint directory
    or a TensorSource), move it to `device`."""
    ckpt = source if isinstance(source, TensorSource) else SafetensorsCheckpoint(source)
    with torch.device("meta"):
        model = build()
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()}
    tensors = ckpt.load_exact(expected, ignore=ignore)
    model.load_state_dict({k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}, assign=True, strict=True)
    # Non-persistent buffers (rotary tables) were built on meta: rebuild them for real.
    for module in model.modules():
        if hasattr(module, "reset_buffers"):
            module.reset_buffers()
    return model.to(device).eval().requires_grad_(False)


@contextlib.contextmanager
def atomic_directory(dest: str | Path, force: bool = False) -> Iterator[Path]:
    """Yield a temporary directory beside `dest`; rename it to `dest` only if the block succeeds.

    On any exception the temporary directory is removed, so no half-written output remains.
    """
    dest = Path(dest)
    if dest.exists() and not force:
        raise FileExistsError(f"{dest} already exists (pass --force to overwrite)")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        yield tmp
        # mkdtemp makes 0700 and safetensors writes 0600: give the output the umask's usual modes.
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)
        for path in tmp.rglob("*"):  # directories and executables (a script written as one) keep their x bits
            executable = path.is_dir() or path.stat().st_mode & 0o111
            os.chmod(path, (0o777 if executable else 0o666) & ~umask)
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
