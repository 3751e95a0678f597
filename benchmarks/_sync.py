"""File barriers between a benchmark's ranks and its driver (``<sync>/<name>-<rank>`` files):
no store, so plain and patched runs wait the same way."""

from __future__ import annotations

import time
from pathlib import Path

_POLL_S = 0.005


def wait_for(paths: list[Path], timeout_s: float = 900.0) -> None:
    """Wait until every one of ``paths`` exists, polling every 5 ms.

    Raises:
        TimeoutError: after ``timeout_s`` seconds, naming the paths.
    """
    deadline = time.time() + timeout_s
    while not all(p.exists() for p in paths):
        if time.time() > deadline:
            raise TimeoutError(f"waited {timeout_s:.0f} s for {[str(p) for p in paths]}")
        time.sleep(_POLL_S)


def touch(path: Path) -> None:
    """Create ``path`` holding the time (seconds since the epoch) it was written."""
    path.write_text(str(time.time()))
