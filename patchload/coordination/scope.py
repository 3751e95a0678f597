"""Which ranks share a download: each node (``node``) or the whole job (``job``), decided once.

``PATCHLOAD_DOWNLOAD_SCOPE=auto`` picks ``job`` when every node sees the same hub cache directory
(a shared filesystem) and ``node`` otherwise. On one node, or with a node-local store, it is
``node``. With several nodes the job decides once, through the store:

1. rank 0 writes a marker file named with a fresh per-job nonce into its cache, then publishes
   the nonce (a marker left by an earlier job never counts: its nonce differs);
2. every other rank looks for that file in its own cache and adds its node's answer;
3. rank 0 combines the nodes' answers (waiting at most ``PATCHLOAD_SCOPE_WAIT`` seconds for
   them) into one decision key that every rank reads: ``job`` only when every node saw the marker.

An explicit ``job`` on a node-local store (no store spans the nodes) falls back to ``node`` with a
warning: each node then downloads once into its own view of the cache.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import time
import uuid
from pathlib import Path
from typing import Final

from .._config import Config
from .._logging import get_logger
from .._topology import Topology
from .store import JobStore

__all__ = ["download_scope"]

logger = get_logger(__name__)

_POLL_S: Final = 0.05
_DECIDED: dict[str, str] = {}
_WARNED: set[str] = set()


def _hub_cache() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def _remove(path: Path) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def _write_marker(cache: Path, nonce: str) -> Path:
    """Rank 0: create the marker ``.patchload-scope-<nonce>`` in ``cache`` (mode 0600, never
    through a symlink) and remove it at exit."""
    marker = cache / f".patchload-scope-{nonce}"
    cache.mkdir(parents=True, exist_ok=True)
    fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    os.close(fd)
    atexit.register(_remove, marker)
    return marker


def _wait_key(store: JobStore, key: str, wait_s: float) -> str | None:
    deadline = time.monotonic() + wait_s
    while True:
        with store.lock:
            if store.store.check([key]):
                return str(json.loads(store.store.get(key)))
        if time.monotonic() > deadline:
            return None
        time.sleep(_POLL_S)


def _decide(topology: Topology, store: JobStore, wait_s: float) -> str:
    """Rank 0: wait for every other node's answer, then publish the job's decision."""
    deadline = time.monotonic() + wait_s
    others = [n for n in range(topology.num_nodes) if n != topology.node]
    while True:
        with store.lock:
            answered = [n for n in others if store.store.check([f"scope/answer/{n}"])]
            missing = [n for n in others if store.store.add(f"scope/miss/{n}", 0) > 0]
        if missing or len(answered) == len(others) or time.monotonic() > deadline:
            break
        time.sleep(_POLL_S)
    decision = "job" if len(answered) == len(others) and not missing else "node"
    if len(answered) < len(others) and not missing:
        logger.warning("[rank %d] nodes %s did not report within %.0f s whether they see this "
                       "node's hub cache (PATCHLOAD_SCOPE_WAIT): downloads per node",
                       topology.rank, sorted(set(others) - set(answered)), wait_s)
    with store.lock:
        store.store.set("scope/decision", json.dumps(decision))
    return decision


def _detect(topology: Topology, store: JobStore, config: Config) -> str:
    cache = _hub_cache()
    wait_s = config.scope_wait_s
    if topology.rank == 0:
        nonce = uuid.uuid4().hex
        _write_marker(cache, nonce)
        with store.lock:
            store.store.set("scope/nonce", json.dumps(nonce))
        return _decide(topology, store, wait_s)
    nonce = _wait_key(store, "scope/nonce", wait_s)
    if nonce is None:
        logger.warning("[rank %d] rank 0 did not announce its hub cache within %.0f s "
                       "(PATCHLOAD_SCOPE_WAIT): downloads per node", topology.rank, wait_s)
        with store.lock:  # rank 0 may still decide: not for a job scope this node left
            store.store.add(f"scope/miss/{topology.node}", 1)
        return "node"
    with store.lock:
        if not (cache / f".patchload-scope-{nonce}").exists():
            store.store.add(f"scope/miss/{topology.node}", 1)
        store.store.set(f"scope/answer/{topology.node}", "1")
    decision = _wait_key(store, "scope/decision", wait_s)
    if decision is None:
        logger.warning("[rank %d] rank 0 did not publish the download scope within %.0f s "
                       "(PATCHLOAD_SCOPE_WAIT): downloads per node", topology.rank, wait_s)
        return "node"
    return decision


def download_scope(config: Config, topology: Topology, store: JobStore) -> str:
    """The download scope for this rank: ``node`` or ``job``. Not collective; bounded.

    Args:
        config: ``config.download_scope`` is ``auto``, ``node`` or ``job``.
        topology: this rank's topology.
        store: the job store.

    Returns:
        ``node`` on one node and with a node-local store (an explicit ``job`` there warns once);
        else ``config.download_scope`` unless ``auto``; with ``auto``, the job's decision (made
        once per process and hub cache; see the module docstring), waiting at most
        ``PATCHLOAD_SCOPE_WAIT`` seconds for it.
    """
    if topology.num_nodes == 1:
        return "node"
    if store.node_local:
        if config.download_scope == "job" and "job" not in _WARNED:
            _WARNED.add("job")
            logger.warning("[rank %d] PATCHLOAD_DOWNLOAD_SCOPE=job, but no store spans the nodes "
                           "(not under torchrun and no process group yet): downloads per node",
                           topology.rank)
        return "node"
    if config.download_scope != "auto":
        return config.download_scope
    key = str(_hub_cache())
    if key not in _DECIDED:
        _DECIDED[key] = _detect(topology, store, config)
        logger.info("[rank %d] download scope %s (auto: the job decided that the nodes %s one "
                    "hub cache)", topology.rank, _DECIDED[key],
                    "share" if _DECIDED[key] == "job" else "do not share")
    return _DECIDED[key]
