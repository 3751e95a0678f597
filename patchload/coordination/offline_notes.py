"""The warnings huggingface_hub prints only because a follower's download ran offline.

A follower makes a hub download from the cache its leader filled, with ``local_files_only=True``
(:func:`patchload.coordination.call._offline`). Into a ``local_dir`` that already holds the file,
huggingface_hub then cannot check it against the hub and says so at WARNING ("Couldn't access
the Hub to check for update but local file already exists", ``hf_hub_download``; "Returning
existing local_dir ... as remote repo cannot be accessed", ``snapshot_download``), which a plain
rank, online, never prints. The file is the one the leader's online call checked (the follower
verifies its pins against the leader's), so the line is dropped on that thread for that call.
Where the caller asked offline itself (or ``HF_HUB_OFFLINE`` is set), plain prints it too, and it
is kept.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Final, Iterator

__all__ = ["quiet_offline_fallbacks"]

# huggingface_hub's loggers (``logging.get_logger(__name__)``) and the start of each line.
_NOTES: Final = (
    ("huggingface_hub.file_download",
     "Couldn't access the Hub to check for update but local file already exists"),
    ("huggingface_hub._snapshot_download", "Returning existing local_dir"),
)


class _OnThisThread(logging.Filter):
    """Drops the record if the given thread emits it and its message starts with ``start``."""

    def __init__(self, start: str) -> None:
        super().__init__()
        self._start = start
        self._thread = threading.get_ident()

    def filter(self, record: logging.LogRecord) -> bool:
        if record.thread != self._thread:
            return True
        try:
            return not str(record.getMessage()).startswith(self._start)
        except Exception:  # noqa: BLE001 - a record that does not format is not ours to judge
            return True


@contextlib.contextmanager
def quiet_offline_fallbacks(plain_prints_them: bool) -> Iterator[None]:
    """While the block runs on this thread, drop huggingface_hub's offline-fallback warnings
    (see the module docstring), unless ``plain_prints_them`` (the caller asked offline itself,
    or the block runs as asked, not offline). Other threads' records pass untouched; the
    filters are removed after the block."""
    from huggingface_hub import constants

    if plain_prints_them or constants.HF_HUB_OFFLINE:  # plain is offline too: it prints them
        yield
        return
    added = []
    for name, start in _NOTES:
        logger, note = logging.getLogger(name), _OnThisThread(start)
        logger.addFilter(note)
        added.append((logger, note))
    try:
        yield
    finally:
        for logger, note in added:
            logger.removeFilter(note)
