"""The state of one install: everything :func:`patchload.install` starts and
:func:`patchload.uninstall` (or the interpreter's exit) ends.

A :class:`Runtime` owns every piece of per-install mutable state: the configuration, the call
counters and scope decisions, the job stores, the background threads, the open shares and the
mapped models. Each module keeps its share of that state in a small class of its own (a
*part*), made on first use by :meth:`Runtime.part` and kept by the runtime; a part that holds
something to end (a thread, a blob, a store client) has a ``close()`` and says in
``CLOSE_PHASE`` when it runs. :meth:`Runtime.close` is the one place that orders them:

1. ``RELEASE_SHARES``: open shares are released, after the followers that arrived took their
   blobs (bounded by ``PATCHLOAD_EXIT_WAIT``), and the mapped-model watcher stops;
2. ``ANNOUNCE_EXIT``: rank 0's last word in the store (its credentials check, its exit; at
   uninstall it also deletes the call-sequence entries it published);
3. ``STOP_THREADS``: the heartbeat, the leader watch and the key reaper stop (at uninstall the
   reaper first deletes the keys still pending: a next install counts its calls from 1 again);
4. ``CLOSE_STORES``: last, the helpers of interrupted store waits end (each within its own
   bound), then the store clients close (and a node-local store's file is left).

Module-level state that is not the runtime's (``tests/test_runtime.py`` holds the list):
ContextVars (per context, not per install), the locks guarding :data:`_CURRENT`, ``Final``
constants, and caches of facts about the process that outlive an install (its kernel and node
id, keyed by pid; the rank it was forked from; its fallback private directory; the answers
huggingface_hub's own caches hold, ``coordination.replay.HISTORY``).

Not collective; no I/O of its own.
"""

from __future__ import annotations

import atexit
import threading
from typing import Any, Final, TypeVar

__all__ = ["Runtime", "current", "start", "end", "ANNOUNCE_EXIT", "CLOSE_STORES",
           "RELEASE_SHARES", "STOP_THREADS"]

RELEASE_SHARES: Final = 0
ANNOUNCE_EXIT: Final = 1
STOP_THREADS: Final = 2
CLOSE_STORES: Final = 3
_PHASES: Final = (RELEASE_SHARES, ANNOUNCE_EXIT, STOP_THREADS, CLOSE_STORES)

P = TypeVar("P")


class Runtime:
    """The per-install state of this process (see the module docstring).

    Attributes:
        installed: whether :func:`patchload.install` made this runtime (False: one made for a
            use before any install, e.g. ``main_process_first`` under ``PATCHLOAD=0``).
        closed: :meth:`close` ran.
        exiting: it closes because the interpreter exits (not at ``uninstall()``): nothing
            installs again, so what only a next install would trip over may stay.
    """

    def __init__(self) -> None:
        self.installed = False
        self.closed = False
        self.exiting = False
        self._parts: dict[type, Any] = {}
        self._lock = threading.RLock()

    def part(self, kind: type[P]) -> P:
        """This runtime's instance of ``kind`` (made by ``kind()`` on first use). Thread-safe."""
        part = self._parts.get(kind)
        if part is not None:
            return part
        with self._lock:
            part = self._parts.get(kind)
            if part is None:
                part = self._parts[kind] = kind()
                if hasattr(part, "close"):
                    _hook_exit()
        return part

    def close(self) -> None:
        """End every part, phase by phase (see the module docstring); within a phase, the part
        made last ends first. A part whose close raises is logged at DEBUG and the others
        still close. Idempotent."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            parts = list(self._parts.values())
        for phase in _PHASES:
            for part in reversed(parts):
                if getattr(part, "CLOSE_PHASE", None) == phase:
                    try:
                        part.close()
                    except Exception as err:  # noqa: BLE001 - the next parts must still close
                        from ._logging import get_logger

                        get_logger(__name__).debug("closing %s: %s: %s", type(part).__name__,
                                                   type(err).__name__, err)


# The one per-install global: the runtime in use (install() makes it, uninstall() ends it).
_CURRENT: Runtime | None = None
_LOCK: Final = threading.RLock()


def current() -> Runtime:
    """The runtime in use; one is made (not installed) when there is none."""
    global _CURRENT
    runtime = _CURRENT
    if runtime is not None:
        return runtime
    with _LOCK:
        if _CURRENT is None:
            _CURRENT = Runtime()
        return _CURRENT


def start() -> Runtime:
    """The runtime for :func:`patchload.install`: the one in use (made before any install, or
    by an earlier install: installing twice is one install), marked installed."""
    with _LOCK:
        runtime = current()
        runtime.installed = True
        return runtime


def end(*, exiting: bool = False) -> None:
    """Close the runtime in use, if any (:func:`patchload.uninstall`; ``exiting``: at
    interpreter exit); the next use makes a new one."""
    global _CURRENT
    with _LOCK:
        runtime = _CURRENT
    if runtime is None:
        return
    runtime.exiting = exiting
    runtime.close()  # still current while it closes: its parts find each other
    with _LOCK:
        if _CURRENT is runtime:
            _CURRENT = None


def _hook_exit() -> None:
    # Registered again by every part that holds something to end, so that the runtime closes
    # before the exit hooks registered up to then (atexit runs the last registered first): as
    # early as each part's own hook ran when each registered one at its first use.
    atexit.unregister(_end_at_exit)
    atexit.register(_end_at_exit)


def _end_at_exit() -> None:
    end(exiting=True)
