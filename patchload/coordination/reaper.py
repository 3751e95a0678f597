"""Deleting a finished call's store keys, off the calling thread.

The last rank of a call's scope to finish it deletes the call's keys (:func:`.protocol.finish`),
so that the store stays bounded over a job's calls. That is about nine store requests (one
``delete_key`` per key), which on the calling thread made every call of a warm loop wait for the
previous call's clean-up: the rank that happened to finish last paid it before its next call.
:class:`KeyReaper` does it on a daemon thread with a store client of its own while it deletes, so that no
caller's request queues behind a deletion.

No rank ever reads a finished call's keys again (every rank of its scope counted itself out,
and a later call of the same function has another occurrence count, so another base), so
deleting them later changes nothing that a rank sees. Deletions still pending at interpreter
exit are dropped: the keys stay until the store goes (torchrun's agent store ends with the job,
the last process out removes a node-local one), as for a store that fails.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Final

from .._background import Loop
from .._logging import get_logger
from .beats import KEEP_BEAT_KEYS
from .keys import AttemptKeys, finished_key

if TYPE_CHECKING:
    from torch.distributed import Store

    from .calls import Call

__all__ = ["KeyReaper", "delete_keys"]

logger = get_logger(__name__)


def delete_keys(client: Store, call: Call, *, followers: bool = True) -> None:
    """Delete every key of every attempt of ``call`` through ``client``; with ``followers``
    False, not the bookkeeping keys that only a model load writes (see
    :func:`.protocol.finish`): each deletion is a request. Not collective.

    Raises:
        RuntimeError: the store failed (keys are left).
    """
    topology = call.topology
    ranks = topology.node_ranks() if call.scope == "node" else range(topology.world_size)
    attempt = 0
    # Attempt 0 exists: every rank that finishes claimed it first.
    while attempt == 0 or client.check([AttemptKeys(f"{call.base}a{attempt}/").leader]):
        keys = AttemptKeys(f"{call.base}a{attempt}/")
        beats = int(client.add(keys.beats, 0))
        for name in keys.written(beats=range(max(1, beats - KEEP_BEAT_KEYS), beats + 2),
                                 ranks=ranks, followers=followers):
            client.delete_key(name)
        attempt += 1
    client.delete_key(finished_key(call.base))


class KeyReaper:
    """One daemon thread per process that deletes the keys of the calls handed to it
    (:meth:`add`), in the order given, on a store client no other thread uses meanwhile
    (:meth:`~patchload.coordination.store.JobStore.spare_client`). It runs while deletions are
    pending (:class:`patchload._background.Loop`) and is stopped when the install ends, before
    the stores close (:mod:`patchload._runtime`); what is still pending then is dropped at
    interpreter exit (the keys stay) and deleted at ``uninstall()``."""

    _PERIOD_S: Final = 0.05

    def __init__(self) -> None:
        self._pending: list[tuple[Call, bool]] = []
        self._lock = threading.Lock()
        self._loop = Loop("patchload-key-reaper", period_s=self._PERIOD_S,
                          busy=lambda: bool(self._pending), step=self._reap, lock=self._lock)

    def add(self, call: Call, *, followers: bool) -> None:
        """Delete the keys of ``call`` soon (see :func:`delete_keys`). Never waits."""
        with self._lock:
            self._pending.append((call, followers))
            self._loop.ensure()

    def stop(self, *, drain: bool = False) -> None:
        """Stop the thread and wait for its current deletion, at most ``JOIN_AT_EXIT_S``; with
        ``drain`` (at uninstall), then delete what is still pending, on the calling thread."""
        self._loop.stop()
        if drain:
            with self._lock:
                pending, self._pending = self._pending, []
            for call, followers in pending:
                self._delete(call, followers)

    def _reap(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for i, (call, followers) in enumerate(pending):
            if self._loop.stopping:
                with self._lock:  # at exit the rest stay in the store; at uninstall, stop()
                    self._pending[:0] = pending[i:]  # deletes them
                return
            self._delete(call, followers)

    @staticmethod
    def _delete(call: Call, followers: bool) -> None:
        try:
            with call.store.spare_client() as client:
                delete_keys(client, call, followers=followers)
        except Exception as err:  # noqa: BLE001 - cleanup only: the keys stay
            logger.debug("%s: deleting the store keys of %s failed: %s", call.prefix(),
                         call.key, err)
