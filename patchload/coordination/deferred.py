"""A rank's store writes that need not hold up its caller: made on a thread, in order.

A call that loads no model (a config, a tokenizer file, a warm ``hf_hub_download``: a few ms)
used to pay its store writes on the caller's thread: rank 0's sequence entry before its claim,
then the outcome, the beat that wakes the followers and its ``finished`` count; a follower its
``finished`` count. On a warm loop that was most of patchload's cost per call. Only the claim
must be made before the call runs (it decides who leads); the rest can follow the call's
return, as long as it follows in order. :class:`DeferredWrites` makes those writes on one
daemon thread per process, on a store client of its own (an idle one of the store's:
:meth:`~.store.JobStore.spare_client`), in the order they were handed to it.

What changes for the other ranks: a leader's outcome reaches the store a moment after its call
returned instead of just before. A leader that dies in that moment (SIGKILL, ``os._exit``) is
seen as a leader that died during its call (its pid gone on the node, its heartbeat silent
across nodes: the call stays in the heartbeat until its outcome is written): the followers
start a new attempt. A leader that exits normally writes everything first: the runtime flushes
the queue before anything else at uninstall and at exit (:mod:`patchload._runtime`), at most
``PATCHLOAD_EXIT_WAIT`` seconds.

Writes made on the caller's thread (a model load's outcome, its files and pins, an error
outcome) first wait for the queue (:meth:`DeferredWrites.flush`): a rank's writes reach the
store in the order it made them.
"""

from __future__ import annotations

import collections
import os
import threading
import time
from typing import TYPE_CHECKING, Callable, Final

from .. import _runtime
from .._logging import get_logger

if TYPE_CHECKING:
    from torch.distributed import Store

    from .store import JobStore

__all__ = ["DeferredWrites", "deferred"]

logger = get_logger(__name__)

_IDLE_S: Final = 0.1  # the thread ends after this long without work (the next write starts one)


class DeferredWrites:
    """One daemon thread per process that runs the writes handed to it (:meth:`add`) in order,
    each on a client of its store that no other thread uses meanwhile. Started at the first
    write, it ends after ``_IDLE_S`` without one; the runtime flushes and stops it first when
    the install ends (``CLOSE_PHASE``)."""

    CLOSE_PHASE: Final = _runtime.FLUSH_WRITES

    def __init__(self) -> None:
        self._queue: collections.deque[tuple[JobStore, Callable[[Store], None], str]] = \
            collections.deque()
        self._cond = threading.Condition()
        self._running = False  # a write is under way (taken off the queue, not done)
        self._thread: threading.Thread | None = None
        self._closed = False
        self._pid = os.getpid()

    def _forked(self) -> None:
        """In a child forked from this process (a DataLoader worker): the parent makes what was
        queued, and the parent's thread is not here (its lock may even be held): start afresh,
        without taking that lock."""
        if self._pid != os.getpid():
            self._cond = threading.Condition()
            self._queue = collections.deque()
            self._running, self._thread, self._pid = False, None, os.getpid()

    def add(self, store: JobStore, write: Callable[[Store], None], what: str) -> None:
        """Run ``write(client)`` soon, after every write added before it, with a client of
        ``store``. Never waits; never raises (``write``'s exception is logged at DEBUG: its
        keys stay unwritten, as for a store that fails). After :meth:`close`, runs it here."""
        self._forked()
        with self._cond:
            if not self._closed:
                self._queue.append((store, write, what))
                if self._thread is None:
                    self._thread = threading.Thread(target=self._run, daemon=True,
                                                    name="patchload-deferred-writes")
                    self._thread.start()
                self._cond.notify()
                return
        self._write(store, write, what)

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until every write added so far is made, at most ``timeout_s`` seconds (None:
        no bound; each write is bounded by the store's own timeout). Returns whether it is.
        A no-op (no lock taken) when nothing is pending."""
        self._forked()
        if not self._queue and not self._running:
            return True
        if self._thread is threading.current_thread():
            return False  # a write's own flush would wait for itself
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            while self._queue or self._running:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    return False
                self._cond.wait(left)
        return True

    def close(self) -> None:
        """Make what is pending (at most ``PATCHLOAD_EXIT_WAIT`` seconds; what is left then is
        dropped, its keys unwritten) and stop the thread; later writes run on the caller's
        thread."""
        from .._state import config

        if not self.flush(config().exit_wait_s):
            logger.debug("deferred store writes still pending at the end of the install")
        with self._cond:
            self._closed = True
            self._queue.clear()
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._queue:
                    self._cond.wait_for(lambda: self._queue or self._closed, _IDLE_S)
                if not self._queue:
                    self._thread = None  # under the lock: the next add starts another
                    self._cond.notify_all()
                    return
                self._running = True  # first: an unlocked flush() never sees neither
                store, write, what = self._queue.popleft()
            try:
                self._write(store, write, what)
            finally:
                with self._cond:
                    self._running = False
                    self._cond.notify_all()

    @staticmethod
    def _write(store: JobStore, write: Callable[[Store], None], what: str) -> None:
        try:
            with store.spare_client() as client:
                write(client)
        except Exception as err:  # noqa: BLE001 - as a store that fails: the keys stay unwritten
            logger.debug("deferred store write (%s) failed: %s: %s", what, type(err).__name__,
                         err)


def deferred() -> DeferredWrites:
    """This install's :class:`DeferredWrites`."""
    return _runtime.current().part(DeferredWrites)
