"""One helper for patchload's background threads: started when there is work, ended when there is none.

The heartbeat, the leader watch, the node leader's blob watcher and the mapped-model watcher
share one life cycle: a daemon thread that starts with the first piece of work, repeats one step
every period while work is left, ends by itself when none is, and is stopped and joined when
the install ends (``uninstall()``, interpreter exit: :mod:`patchload._runtime`). Rank 0's
collective sampler always has work: it runs from the import of torch.distributed until then.
A daemon thread still inside a store request when the interpreter finalizes is killed while
unwinding C++ frames, which aborts the whole process ("terminate called without an active
exception"): hence the join.
"""

from __future__ import annotations

import threading
from typing import Callable, Final

from ._logging import get_logger

__all__ = ["JOIN_AT_EXIT_S", "Loop"]

logger = get_logger(__name__)

# Seconds the exit waits for each background thread to leave what it is doing (its store
# request, its blob close).
JOIN_AT_EXIT_S: Final = 2.0


class Loop:
    """A daemon thread named ``name`` that runs ``step()`` every ``period_s`` seconds while
    ``busy()`` is true.

    ``busy()`` is asked under ``lock``, the lock the owner holds while it adds work and calls
    :meth:`ensure`: so the thread either sees the new work or has ended, and ``ensure`` starts a
    new one. ``step()`` runs without ``lock``, and holds nothing of the owner's between periods
    (a store kept past ``destroy_process_group`` would keep rank 0's server socket, and a new
    group on the same port would hang). An exception from ``step`` ends the thread, logged at
    DEBUG (the owner's next :meth:`ensure` starts another).
    """

    def __init__(self, name: str, *, period_s: float, busy: Callable[[], bool],
                 step: Callable[[], None], lock: threading.Lock | threading.RLock) -> None:
        self.name, self._period_s, self._busy, self._step, self._lock = (
            name, period_s, busy, step, lock)
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    @property
    def stopping(self) -> bool:
        """:meth:`stop` was called: no thread starts again."""
        return self._stopping.is_set()

    def ensure(self) -> None:
        """Start the thread unless it runs or the loop is stopping. The caller holds ``lock``."""
        if self._stopping.is_set():
            return
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name=self.name, daemon=True)
            self._thread.start()

    def stop(self, timeout_s: float = JOIN_AT_EXIT_S) -> None:
        """Stop the thread and wait for it, at most ``timeout_s`` seconds (when the install ends:
        uninstall, interpreter exit)."""
        self._stopping.set()
        with self._lock:
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                with self._lock:
                    if not self._busy():
                        self._thread = None  # under the lock: the next ensure() starts one
                        return
                self._step()
                self._stopping.wait(self._period_s)
        except Exception as err:  # noqa: BLE001 - the owner's next ensure() starts another
            logger.debug("%s: %s: %s", self.name, type(err).__name__, err)
        with self._lock:
            if self._thread is threading.current_thread():
                self._thread = None
