"""Which ranks share a download: each node (``node``) or the whole job (``job``), decided once.

``PATCHLOAD_DOWNLOAD_SCOPE=auto`` picks ``job`` when every node sees the same hub cache directory
(a shared filesystem) and ``node`` otherwise. On one node, or with a node-local store, it is
``node``. With several nodes the job decides once per hub cache path, through the store, and
**no rank ever waits for another to decide** (a rank 0 that makes no patched call, or a node
blocked in the user's own collective, costs nobody anything):

1. **Markers.** One rank of each node shows its node's view of the cache: it creates a marker
   file named with a fresh nonce in its cache's lock folder (``.locks/.patchload-scope-<nonce>``,
   removed at its exit; ``scan_cache_dir`` skips that folder, so the cache lists as plain),
   then publishes the nonce under ``scope/<cache>/node/<n>`` (first come: the other
   ranks of the node find it published and write none). It does so as soon as it can: when
   huggingface_hub is imported (under torchrun, whose agent store exists from the start), else
   at its first patched call.
2. **Decision.** The first rank to make a patched call decides at once, from what it can see
   itself: ``job`` when every node has published a nonce and every such marker is in this
   rank's own cache (each node wrote it into its cache, so theirs is this folder); otherwise
   ``node`` (a node that has not shown its cache yet is not known to share it). It publishes
   the decision with ``compare_set`` under ``scope/<cache>/decision``: the first decision
   published is the job's, read by every later rank (one store request, no wait), so the
   ranks that share a call agree on its scope.

``node`` is always correct (each node downloads into its own view of the cache, which a shared
cache only makes cheaper), and ``job`` is only decided on evidence that the nodes share the
folder; a follower's verification would catch a wrong ``job`` anyway (it reruns the leader's
hub calls from its own cache and makes a plain call when they differ). A marker left by an
earlier job never counts: its nonce is not in this job's store.

An explicit ``job`` on a node-local store (no store spans the nodes) falls back to ``node`` with a
warning: each node then downloads once into its own view of the cache.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import json
import os
import threading
import uuid
from pathlib import Path

from .. import _runtime
from .._config import Config
from .._logging import get_logger
from .._topology import Topology
from .store import JobStore

__all__ = ["announce_when_hub_imported", "download_scope"]

logger = get_logger(__name__)

class _Scopes:
    """The runtime's scope decisions: hub cache path -> scope, the cache paths whose node marker
    this process published or found, and the warnings already given."""

    def __init__(self) -> None:
        self.decided: dict[str, str] = {}
        self.shown: set[str] = set()
        self.warned: set[str] = set()
        self.lock = threading.Lock()


def _scopes() -> _Scopes:
    return _runtime.current().part(_Scopes)


def _hub_cache() -> Path:
    from huggingface_hub import constants

    return Path(constants.HF_HUB_CACHE)


def _remove(path: Path) -> None:
    with contextlib.suppress(OSError):
        os.unlink(path)


def _marker(cache: Path, nonce: str) -> Path:
    """Where the marker of ``nonce`` lies in ``cache``: in huggingface_hub's own lock folder,
    which its ``scan_cache_dir`` skips (a file beside the repo folders is reported there as a
    corrupted repo, which a plain rank's scan does not show)."""
    return cache / ".locks" / f".patchload-scope-{nonce}"


def _write_marker(cache: Path, nonce: str) -> Path:
    """Create the marker of ``nonce`` in ``cache`` (:func:`_marker`; mode 0600, never through a
    symlink) and remove it at exit."""
    marker = _marker(cache, nonce)
    marker.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(marker, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
    os.close(fd)
    atexit.register(_remove, marker)
    return marker


def _keys(cache: Path) -> str:
    """The store key prefix of decisions about ``cache`` (by its path: ranks with another path
    never share a call with this one's, whatever the scope)."""
    return f"scope/{hashlib.sha1(str(cache).encode()).hexdigest()[:16]}/"


def _show(topology: Topology, store: JobStore, cache: Path) -> None:
    """Publish this node's marker for ``cache`` unless this process or another rank of its node
    already did. Not collective; never waits (two store requests at most)."""
    shown_here = _scopes().shown
    if str(cache) in shown_here:
        return
    key = _keys(cache) + f"node/{topology.node}"
    with store.lock:
        shown = store.store.check([key])
    if not shown:
        nonce = uuid.uuid4().hex
        marker = _write_marker(cache, nonce)
        with store.lock:
            held = json.loads(store.store.compare_set(key, "", json.dumps(nonce)))
        if held != nonce:  # another rank of this node was first: its marker stands
            _remove(marker)
    shown_here.add(str(cache))


def _decide(topology: Topology, store: JobStore, cache: Path) -> tuple[str, str]:
    """This rank's decision from what it sees now: (scope, why). Not collective; never waits."""
    prefix = _keys(cache)
    unseen, elsewhere = [], []
    with store.lock:
        for node in range(topology.num_nodes):
            key = prefix + f"node/{node}"
            if not store.store.check([key]):
                unseen.append(node)
                continue
            nonce = json.loads(store.store.get(key))
            if not _marker(cache, nonce).exists():
                elsewhere.append(node)
    if elsewhere:
        return "node", (f"{_nodes(elsewhere)} wrote a marker into a hub cache that is not this "
                        "one: the nodes do not share one hub cache")
    if unseen:
        return "node", (f"{_nodes(unseen)} had shown no hub cache yet (no import of "
                        "huggingface_hub or patched call there so far): not known to share this "
                        "one")
    return "job", f"all {topology.num_nodes} nodes showed a marker in this one hub cache"


def _nodes(nodes: list[int]) -> str:
    """``node 1`` or ``nodes 1, 2``."""
    return ("node " if len(nodes) == 1 else "nodes ") + ", ".join(str(n) for n in nodes)


def _detect(topology: Topology, store: JobStore, cache: Path) -> tuple[str, str]:
    """The job's decision for ``cache``: published already, or this rank's, published now."""
    key = _keys(cache) + "decision"
    with store.lock:
        if store.store.check([key]):
            decided = json.loads(store.store.get(key))
            return decided["scope"], f"decided by rank {decided['rank']}: {decided['why']}"
    _show(topology, store, cache)
    scope, why = _decide(topology, store, cache)
    mine = json.dumps({"scope": scope, "why": why, "rank": topology.rank})
    with store.lock:
        decided = json.loads(store.store.compare_set(key, "", mine))
    if decided["rank"] == topology.rank:
        return scope, f"decided by this rank: {why}"
    return decided["scope"], f"decided by rank {decided['rank']}: {decided['why']}"


def download_scope(config: Config, topology: Topology, store: JobStore) -> str:
    """The download scope for this rank: ``node`` or ``job``. Not collective; never waits for
    another rank (at most a few store requests, at this process's first call per hub cache).

    Args:
        config: ``config.download_scope`` is ``auto``, ``node`` or ``job``.
        topology: this rank's topology.
        store: the job store.

    Returns:
        ``node`` on one node and with a node-local store (an explicit ``job`` there warns once);
        else ``config.download_scope`` unless ``auto``; with ``auto``, the job's decision (see
        the module docstring), read or made once per process and hub cache.
    """
    if topology.num_nodes == 1:
        return "node"
    if store.node_local:
        warned = _scopes().warned
        if config.download_scope == "job" and "job" not in warned:
            warned.add("job")
            logger.warning("[rank %d] PATCHLOAD_DOWNLOAD_SCOPE=job, but no store spans the nodes "
                           "(not under torchrun and no process group yet): downloads per node",
                           topology.rank)
        return "node"
    if config.download_scope != "auto":
        return config.download_scope
    cache = _hub_cache()
    scopes = _scopes()
    with scopes.lock:
        if str(cache) not in scopes.decided:
            scope, why = _detect(topology, store, cache)
            scopes.decided[str(cache)] = scope
            logger.info("[rank %d] download scope %s (auto: %s)", topology.rank, scope, why)
        return scopes.decided[str(cache)]


def announce_when_hub_imported() -> None:
    """Show this node's hub cache (step 1 of the module docstring) as soon as huggingface_hub
    is imported, so that the job's first decision, whoever makes it, sees every node that got
    that far. Only under torchrun's agent store (the one job-wide store that exists before any
    call; no store is opened otherwise), with several nodes and ``auto``. Not collective; never
    raises (a failure is a DEBUG line: the rank's first call shows the cache instead)."""
    import sys

    import wrapt

    def hook(module: object) -> None:
        from .. import _state
        from .._topology import current_topology
        from .store import _kind, job_store

        try:
            topology = current_topology()
            if (not _state.active() or _state.config().download_scope != "auto"
                    or topology.num_nodes == 1 or _kind() != "agent"):
                return
            with _scopes().lock:
                _show(topology, job_store(), _hub_cache())
        except Exception as err:  # noqa: BLE001 - an early courtesy; the first call retries
            logger.debug("showing this node's hub cache at import failed: %s", err)

    if "huggingface_hub.constants" in sys.modules:
        hook(sys.modules["huggingface_hub.constants"])
    else:
        wrapt.register_post_import_hook(hook, "huggingface_hub.constants")
