"""Progress bars for long work (convert, bench, fetch, calibration): tqdm on a terminal, and one plain line per
update when stderr is redirected to a file or a pipe (tqdm's carriage returns would make one long line there)."""

from __future__ import annotations

import sys
from typing import IO, Any

LOG_INTERVAL_S = 10.0  # seconds between lines when not on a terminal


class _Lines:
    """A stream that turns tqdm's "\\r<status>" redraws into one line each."""

    def __init__(self, stream: IO[str]):
        self.stream = stream

    def write(self, text: str) -> int:
        line = text.replace("\r", "").rstrip("\n")
        if line.strip():
            self.stream.write(line + "\n")
        return len(text)

    def flush(self) -> None:
        self.stream.flush()


def progress_bar(*, file: IO[str] | None = None, **kwargs: Any):
    """`tqdm(**kwargs)` writing to `file` (default stderr); line by line, at most every LOG_INTERVAL_S, off a terminal."""
    from tqdm.auto import tqdm

    stream = file if file is not None else sys.stderr
    isatty = getattr(stream, "isatty", None)
    if isatty is not None and isatty():
        return tqdm(file=stream, **kwargs)
    kwargs.setdefault("mininterval", LOG_INTERVAL_S)
    kwargs.setdefault("delay", 2.0)  # work that ends within 2 s (a cached calibration) prints no line at all
    return tqdm(file=_Lines(stream), ascii=True, dynamic_ncols=False, ncols=100, **kwargs)
