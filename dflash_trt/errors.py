"""Typed errors. Each names the file and the key it is about, so a user can fix the input."""

from __future__ import annotations

from pathlib import Path


class DFlashError(Exception):
    """Base class: every error the CLI reports as one line with exit code 2."""


class _LocatedError(DFlashError):
    def __init__(self, message: str, file: str | Path | None = None, key: str | None = None):
        self.file = str(file) if file is not None else None
        self.key = key
        where = ""
        if self.file and key:
            where = f"{self.file}: {key}: "
        elif self.file:
            where = f"{self.file}: "
        elif key:
            where = f"{key}: "
        super().__init__(where + message)


class ConfigError(_LocatedError):
    """A config.json is missing, malformed, unsupported, or inconsistent with its partner."""


class CheckpointError(_LocatedError):
    """Weights are missing, extra, of the wrong shape, or in a format we refuse to read."""


class KVCacheFullError(DFlashError):
    """The paged KV pool has no free block for a sequence that needs one."""
