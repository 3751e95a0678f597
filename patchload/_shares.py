"""The shared-memory blobs a node leader keeps open for its followers, and when each is closed.

A follower maps the leader's blob through the leader's open fd (``/proc/<pid>/fd``), so the
leader keeps it open after its load. It is closed (and its memory goes with the leader's last
mapping of it):

* once the leader's model no longer maps it (``del model`` and a garbage collection, or its
  weights copied out before being written: :mod:`patchload._writes`) and every follower that
  arrived at the call is done with it (or its process is gone; a thread of the leader waits
  for them, at most ``PATCHLOAD_EXIT_WAIT`` seconds);
* at the leader's next ``from_pretrained``, once its followers are done, the ranks of the node
  that have not reached the call counted for ``_LATE_S`` seconds after the share (a follower
  reaches a nested call only after its enclosing call);
* at exit, after waiting (at most ``PATCHLOAD_EXIT_WAIT`` seconds in all) for the followers that
  arrived. A rank that has not reached the call by then never pins the leader's exit: when it
  does, it finds the blob gone and loads from the cache the leader filled (with a warning).
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from dataclasses import dataclass, field
from typing import Any, Final

from .coordination.followers import pending_followers, wait_followers_done
from .coordination.protocol import Call

__all__ = ["OpenShares"]

logger = logging.getLogger(__name__)

_LATE_S: Final = 5.0


@dataclass(eq=False)
class _Share:
    call: Call
    descriptor: dict[str, Any]
    shared_at: float = field(default_factory=time.monotonic)
    unmapped: bool = False  # the leader's model no longer maps the blob (freed or copied)


class OpenShares:
    """This process's open blobs as a node leader (see the module docstring). Thread-safe."""

    def __init__(self) -> None:
        self._shares: list[_Share] = []
        self._lock = threading.RLock()  # a finalizer may run inside a locked block (GC)
        self._exit_hooked = False

    def add(self, call: Call, descriptor: dict[str, Any], model: Any) -> None:
        """Keep the blob of ``descriptor`` (shared for ``call``) open for the followers; it is
        released once ``model`` is freed and they are done (see the module docstring)."""
        share = _Share(call, descriptor)
        with self._lock:
            if not self._exit_hooked:
                atexit.register(self.release_at_exit)
                self._exit_hooked = True
            self._shares.append(share)
        finalizer = weakref.finalize(model, self._unmapped, share)
        finalizer.atexit = False  # at exit, release_at_exit waits for the followers first

    def __bool__(self) -> bool:
        return bool(self._shares)

    def release_finished(self) -> None:
        """Close the blobs whose followers on this node are all done with them (or dead). Not
        collective; never waits."""
        with self._lock:
            shares = list(self._shares)
        now = time.monotonic()
        for share in shares:
            arrived_only = share.unmapped or now - share.shared_at > _LATE_S
            if not pending_followers(share.call, arrived_only=arrived_only):
                self._release(share)

    def release_at_exit(self) -> None:
        """Wait (at most ``PATCHLOAD_EXIT_WAIT`` seconds in all) for the followers that arrived
        at each shared call to take the weights, then close every blob."""
        start = time.monotonic()
        with self._lock:
            shares = list(self._shares)
        for share in shares:
            elapsed = time.monotonic() - start
            wait_followers_done(share.call, max(0.0, share.call.config.exit_wait_s - elapsed))
            self._release(share)

    def unmapped(self, descriptor: dict[str, Any]) -> None:
        """The leader's model no longer maps the blob of ``descriptor`` (its weights were copied
        out before being written): close it once the followers that arrived are done."""
        with self._lock:
            shares = [s for s in self._shares if s.descriptor is descriptor]
        for share in shares:
            self._unmapped(share)

    def _unmapped(self, share: _Share) -> None:
        share.unmapped = True
        try:
            pending = pending_followers(share.call, arrived_only=True)
        except Exception as err:  # noqa: BLE001 - maybe in a finalizer: released later instead
            logger.debug("%s: checking the followers of an unmapped blob failed: %s",
                         share.call.prefix(), err)
            return
        if not pending:
            self._release(share)
            return
        # Followers still attaching: close it once they are done, without holding up this rank.
        threading.Thread(target=self._release_when_done, args=(share,), daemon=True,
                         name="patchload-release").start()

    def _release_when_done(self, share: _Share) -> None:
        try:
            wait_followers_done(share.call, share.call.config.exit_wait_s,
                                before="closing the shared blob")
        except Exception as err:  # noqa: BLE001 - released at the next load or at exit
            logger.debug("%s: waiting for the followers failed: %s", share.call.prefix(), err)
            return
        self._release(share)

    def _release(self, share: _Share) -> None:
        from .transport import shm

        with self._lock:
            if share not in self._shares:
                return  # another thread released it
            self._shares.remove(share)
        shm.release(share.descriptor)
        logger.debug("%s: closed the shared blob (followers done%s)", share.call.prefix(),
                     ", model freed or copied out" if share.unmapped else "")
