"""Which ranks share a download: each node (``node``) or the whole job (``job``).

``PATCHLOAD_DOWNLOAD_SCOPE=auto`` picks ``job`` when every node sees the same hub cache directory
(a shared filesystem) and ``node`` otherwise. On one node the two are the same and ``node`` is
used. With several nodes, rank 0 writes a marker file named after the job into its cache and
announces it in the store; every other rank looks for that file in its own cache.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import time
from pathlib import Path
from typing import Final

from .._config import Config
from .store import JobStore
from .._topology import Topology

__all__ = ["download_scope"]

logger = logging.getLogger(__name__)

_MARKER_WAIT_S: Final = 60.0
_DECIDED: dict[str, str] = {}


def _hub_cache() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def _remove(path: Path) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def _detect(topology: Topology, store: JobStore, timeout_s: float | None) -> str:
    name = f".patchload-scope-{os.environ.get('TORCHELASTIC_RUN_ID', '')}-" \
           f"{os.environ.get('MASTER_ADDR', '')}-{os.environ.get('MASTER_PORT', '')}"
    marker = _hub_cache() / name
    if topology.rank == 0:
        marker.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
        os.close(fd)
        atexit.register(_remove, marker)
        with store.lock:
            store.store.set("scope/marker", "1")
        return "job"
    wait_s = _MARKER_WAIT_S if timeout_s is None else min(timeout_s, _MARKER_WAIT_S)
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        with store.lock:
            if store.store.check(["scope/marker"]):
                return "job" if marker.exists() else "node"
        time.sleep(0.05)
    logger.warning("[rank %d] rank 0 did not announce its cache within %.0f s: assuming "
                   "node-local caches (PATCHLOAD_DOWNLOAD_SCOPE=node)", topology.rank,
                   wait_s)
    return "node"


def download_scope(config: Config, topology: Topology, store: JobStore) -> str:
    """The download scope for this rank: ``node`` or ``job``.

    Args:
        config: ``config.download_scope`` is ``auto``, ``node`` or ``job``.
        topology: this rank's topology.
        store: the job store.

    Returns:
        ``config.download_scope`` unless ``auto``; with ``auto``: ``node`` on one node or with a
        node-local store, else the detected one (decided once per process). Detection waits at most
        60 s for rank 0's marker.
    """
    if config.download_scope != "auto":
        return config.download_scope
    if topology.num_nodes == 1 or store.node_local:
        return "node"
    key = str(_hub_cache())
    if key not in _DECIDED:
        _DECIDED[key] = _detect(topology, store, config.timeout_s)
        logger.info("[rank %d] download scope %s (auto: the hub cache %s %s shared by the nodes)",
                    topology.rank, _DECIDED[key], key,
                    "is" if _DECIDED[key] == "job" else "is not")
    return _DECIDED[key]
