"""The shared-memory blobs a node leader keeps open for its followers, and when each is closed.

A follower maps the leader's blob through the leader's open fd (``/proc/<pid>/fd``), so the
leader keeps it open while its own model maps the blob (closing it then would free nothing: the
mapping keeps the blob alive) and a rank of its node may still come. Once the leader's tensors
no longer map it (``del model`` and a garbage collection, the model moved to a device or
sharded, its weights copied out before being written: :mod:`patchload.transport.mapped_models`),
the fd is closed as soon as every follower that arrived at the call is done with it (or its
process is gone), and every rank of the node that has not arrived yet is waited for until
``_LATE_S`` seconds after the share; from then on the blob lives only as long as some
follower's tensors map it. A thread of the leader watches its mappings (no store request
while they live). Before it shares a new blob, the leader also waits (at most ``_LATE_S``
seconds) for the followers of the older blobs it left: those that arrived, and those that took
part in its earlier loads of the same thing (``what``) even if they have not arrived yet. In a
loop of loads whose followers lag, the node then keeps about one blob per load they are still
taking, not one per load the leader ran ahead of them (a blob is a model's worth of memory). A
rank that took part before and does not arrive within the wait is no longer waited for (one
wait of at most ``_LATE_S`` seconds when a rank leaves a loop); a rank that never took part in
a load of the same thing is never waited for here. At exit (and at uninstall) the leader waits (at most ``PATCHLOAD_EXIT_WAIT`` seconds in all) for
the followers that arrived, then closes every blob. A rank that reaches the call after its blob
is closed loads from the cache the leader filled (with a warning).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from .._background import Loop
from .._logging import get_logger
from ..coordination.followers import followers_seen, pending_followers, wait_followers_done
from ..coordination.protocol import Call

if TYPE_CHECKING:
    import torch

__all__ = ["OpenShares"]

logger = get_logger(__name__)

_WATCH_S: Final = 0.5  # how often the leader's mappings are looked at (no store request)
_LATE_S: Final = 5.0  # how long after the share a rank that has not arrived is waited for,
# and the most a leader waits for older blobs' followers before it shares another


@dataclass(eq=False)
class _Share:
    call: Call
    descriptor: dict[str, Any]
    mappings: list[Any]  # StorageWeakRef of each leader tensor's storage viewing the blob
    shared_at: float = field(default_factory=time.monotonic)

    def unmapped(self) -> bool:
        """Whether the leader's own tensors no longer view the blob."""
        return all(m.expired() for m in self.mappings)


class OpenShares:
    """This process's open blobs as a node leader (see the module docstring). Thread-safe."""

    def __init__(self) -> None:
        self._shares: list[_Share] = []
        # Per ``what``: the ranks that took part in this leader's earlier loads of it.
        self._regulars: dict[str, set[int]] = {}
        self._lock = threading.RLock()
        self._watcher = Loop("patchload-shares", period_s=_WATCH_S,
                             busy=lambda: bool(self._shares), step=self._watch,
                             lock=self._lock)

    def add(self, call: Call, descriptor: dict[str, Any],
            storages: list[torch.UntypedStorage]) -> None:
        """Keep the blob of ``descriptor`` (shared for ``call``; ``storages`` are those of the
        leader's tensors viewing its own mapping of it) open while a rank of the node may need
        it (see the module docstring). Not collective."""
        from torch.multiprocessing.reductions import StorageWeakRef

        share = _Share(call, descriptor, [StorageWeakRef(s) for s in storages])
        with self._lock:
            self._shares.append(share)
            self._watcher.ensure()

    def make_room(self) -> None:
        """Leader, before it shares a new blob: close each older blob its own tensors left once
        its followers are done with it: those that arrived, and those that took part in earlier
        loads of the same thing whether they arrived or not (waiting at most ``_LATE_S`` seconds
        in all). Not collective."""
        with self._lock:
            shares = [s for s in self._shares if s.unmapped()]
        deadline = time.monotonic() + _LATE_S
        for share in shares:
            what = share.call.what
            regulars = set(self._regulars.get(what, ()))
            try:
                wait_followers_done(share.call, max(0.0, deadline - time.monotonic()),
                                    before="sharing another blob", expected=regulars)
                seen = set(followers_seen(share.call))
            except Exception as err:  # noqa: BLE001 - the watcher closes it later
                logger.debug("%s: waiting for the followers of a shared blob failed: %s",
                             share.call.prefix(), err)
                continue
            if regulars - seen:
                logger.debug("%s: ranks %s did not come to this load of %s: no longer waited "
                             "for", share.call.prefix(), sorted(regulars - seen), what)
            self._close_if_done(share, seen=seen)

    def release_at_exit(self) -> None:
        """Wait (at most ``PATCHLOAD_EXIT_WAIT`` seconds in all) for the followers that arrived
        at each shared call to take the weights, then close every blob.

        Stops and joins the watcher first (at most ``JOIN_AT_EXIT_S``, 2 s): a daemon thread
        still inside a store request when the interpreter finalizes aborts the process."""
        start = time.monotonic()
        self._watcher.stop()
        with self._lock:
            shares = list(self._shares)
        for share in shares:
            elapsed = time.monotonic() - start
            wait_followers_done(share.call, max(0.0, share.call.config.exit_wait_s - elapsed),
                                before="exiting")
            self._release(share)

    def _watch(self) -> None:
        """While a blob is open: notice a leader mapping that went (a model freed, moved to a
        device, sharded) and close its blob once no follower may need it."""
        with self._lock:
            shares = list(self._shares)
        for share in shares:
            if share.unmapped() and not self._watcher.stopping:
                self._close_if_done(share)

    def _close_if_done(self, share: _Share, *, seen: set[int] | None = None) -> None:
        """Close the blob once every follower that arrived is done and, for ``_LATE_S`` seconds
        after the share, every rank of the node (one still on its way gets the blob). Then the
        ranks that took part (``seen`` when the caller read them) are the ones waited for at
        this leader's next load of the same thing."""
        late = time.monotonic() - share.shared_at > _LATE_S
        try:
            pending = pending_followers(share.call, arrived_only=late)
            if not pending and seen is None:
                seen = set(followers_seen(share.call))
        except Exception as err:  # noqa: BLE001 - tried again by the watcher
            logger.debug("%s: checking the followers of a shared blob failed: %s",
                         share.call.prefix(), err)
            return
        if seen is not None:
            with self._lock:
                self._regulars[share.call.what] = seen
        if not pending:
            self._release(share)

    def _release(self, share: _Share) -> None:
        from . import shm

        with self._lock:
            if share not in self._shares:
                return  # another thread released it
            self._shares.remove(share)
        shm.release(share.descriptor)
        logger.debug("%s: closed the shared blob (the leader's tensors left it, followers done)",
                     share.call.prefix())
