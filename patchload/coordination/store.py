"""The job-wide key-value store patchload coordinates through, and node-local file locations.

Coordination never uses collectives on the user's process group: it goes through a
``torch.distributed.Store``, picked in this order:

1. under torchrun (``TORCHELASTIC_USE_AGENT_STORE=True``), a ``TCPStore`` client of the agent's
   store at ``MASTER_ADDR:MASTER_PORT``: there before and after the user's ``init_process_group``;
2. the default process group's store, once ``init_process_group`` ran;
3. a ``FileStore`` in a node-local, per-user directory: downloads are then coordinated inside one
   node only. Every process that opens it counts itself in; at exit (or uninstall), once its
   own clients of the file are closed, it counts itself out, and the last one out removes the
   file, as does one that finds every other process that used it gone (killed). A
   ``FileStore`` writes to its file even when destroyed, so a client destroyed after the
   removal would recreate the file, and one still holding a read position in the old file
   would read garbage from the new one.

Every key is namespaced with a ``PrefixStore`` naming the job (run id and restart count), so a
restarted job never sees the keys of the attempt before.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import tempfile
import threading
import time
import weakref
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Final, Iterator

from .. import _runtime
from .._logging import get_logger
from .identity import job_id, node_id, process_alive

if TYPE_CHECKING:
    from torch.distributed import Store

__all__ = ["JobStore", "job_store", "private_dir"]

logger = get_logger(__name__)

_STORE_OP_TIMEOUT: Final = timedelta(seconds=60)


class _ClosedStore:
    """Stands in for a store this process closed at exit: any use raises."""

    def __getattr__(self, name: str) -> None:
        raise RuntimeError(f"patchload's job store was closed at interpreter exit ({name})")


@dataclass(eq=False)
class JobStore:
    """A namespaced store shared by the ranks of one job.

    Attributes:
        store: the ``PrefixStore``-wrapped store; keys are patchload's own.
        kind: ``agent`` (torchrun's TCPStore), ``process_group`` (the default group's store) or
            ``file`` (node-local ``FileStore``; coordinates one node only).
        lock: serialises this process's use of ``store`` across threads. Only short,
            non-blocking requests go through ``store``: every blocking wait has a client of its
            own (:meth:`wait_for`; a private group's rendezvous, see
            :func:`patchload.transport.collective.private_group`), and so has the heartbeat
            (:meth:`heartbeat_client`).
        file: the node-local store's file (kind ``file`` only).
        same_credentials: ``(ranks, digest)`` pairs where every one of ``ranks`` reported the
            credentials ``digest`` (:mod:`.credentials`): a leader with that digest then reads
            no reports for a call of those ranks.
    """

    store: Store
    kind: str
    lock: threading.RLock
    file: Path | None = None
    same_credentials: set[tuple[frozenset[int], str]] = field(default_factory=set, repr=False)
    _idle: list[Store] = field(default_factory=list, repr=False)
    _heartbeat: Store | None = field(default=None, repr=False)
    _guard: threading.Lock = field(default_factory=threading.Lock, repr=False)  # _idle, _heartbeat

    @property
    def node_local(self) -> bool:
        """True when only the ranks of this node share the store."""
        return self.kind == "file"

    def wait_for(self, key: str, timeout_s: float, *,
                 wake: Callable[[], None] | None = None) -> bool:
        """Block until ``key`` exists, at most ``timeout_s`` seconds: one server-side ``wait``
        (``torch.distributed.Store.wait``), not a poll. Not collective.

        Runs on a client of its own (a ``clone()`` of ``store``, kept for the next wait), not
        under ``lock``: a blocked wait on the shared client would hold up this process's other
        threads (the heartbeat among them).

        Interruptible on the main thread: a thread blocked in the store's C++ wait runs no
        Python signal handler until the wait returns (a Ctrl-C, or a SIGTERM handler raising
        ``SystemExit``, would wait for the leader's next beat or the bound). There the wait
        runs on a helper thread while the caller waits for it on a ``threading.Event`` in
        slices of at most ``_SLICE_S`` (0.25 s; no store request), so a pending handler runs
        within one slice. An exception raised meanwhile (``KeyboardInterrupt``,
        ``SystemExit``, whatever a handler raises) propagates unchanged, after ``wake`` (if
        given: it makes the store wait return, e.g. by setting ``key``) and a join of the
        helper of at most ``_WAKE_JOIN_S`` (1 s). A helper still waiting then (no ``wake``) is
        joined when the install ends (uninstall, interpreter exit), at most until its own bound: a thread still inside a store
        request when the interpreter finalizes aborts the process.

        Returns:
            Whether the key exists (False: the wait timed out, or the store failed; a store that
            fails at once is not retried sooner than the bound or 1 s, so callers never spin).
        """
        if threading.current_thread() is not threading.main_thread():
            return self._wait_for(key, timeout_s)  # signal handlers run on the main thread only
        found = [False]
        finished = threading.Event()
        stores = _stores()

        def run() -> None:
            try:
                found[0] = self._wait_for(key, timeout_s)
            finally:
                finished.set()
                with stores.lock:
                    stores.waiters.pop(threading.current_thread(), None)

        helper = threading.Thread(target=run, name="patchload-store-wait", daemon=True)
        with stores.lock:
            stores.waiters[helper] = time.monotonic() + timeout_s
        helper.start()
        try:
            while not finished.wait(_SLICE_S):
                pass
        except BaseException:
            if wake is not None:
                try:
                    wake()
                except Exception as err:  # noqa: BLE001 - the helper then ends at its bound
                    logger.debug("waking the wait for store key %s failed: %s", key, err)
            helper.join(_WAKE_JOIN_S)
            raise
        return found[0]

    def _wait_for(self, key: str, timeout_s: float) -> bool:
        """:meth:`wait_for` on the calling thread (blocks signal handlers while it waits)."""
        from datetime import timedelta

        client = self._idle_client()
        start = time.monotonic()
        try:
            client.wait([key], timedelta(seconds=max(0.001, timeout_s)))
            found = True
        except RuntimeError as err:  # DistStoreError (TCPStore) or RuntimeError (FileStore)
            found = False
            left = timeout_s - (time.monotonic() - start)
            if left > 0.1:  # not a timeout: the store failed; the caller's next request says how
                logger.debug("waiting for store key %s failed: %s", key, err)
                time.sleep(min(left, 1.0))
                return False  # and the client is not reused
        with self._guard:
            self._idle.append(client)
        return found

    def heartbeat_client(self) -> Store:
        """The client of the store that the heartbeat thread alone uses (a ``clone()`` of
        ``store``, made at its first use), not under ``lock``: a beat never queues behind
        another thread's request. Not collective.

        Raises:
            RuntimeError: the store was closed, or cannot be reached.
        """
        with self._guard:
            if self._heartbeat is None:
                self._heartbeat = self.store.clone()
            return self._heartbeat

    @contextlib.contextmanager
    def spare_client(self) -> Iterator[Store]:
        """A client of the store for the caller's thread alone while the block runs: an idle
        one of :meth:`wait_for`'s (a ``clone()`` of ``store``, made if none is idle), given
        back after the block, so that it adds no connection to the store in the steady state.
        Not under ``lock``: for requests that must not queue other threads' behind them (the
        key reaper's deletions, :class:`.reaper.KeyReaper`). Not collective.

        Raises:
            RuntimeError: the store was closed, or cannot be reached.
        """
        client = self._idle_client()
        yield client  # a request that raised leaves the client out, as a failed wait does
        with self._guard:
            self._idle.append(client)

    def _idle_client(self) -> Store:
        with self._guard:
            client = self._idle.pop() if self._idle else None
        return client if client is not None else self.store.clone()

    def close(self) -> None:
        """Destroy this process's clients of the store (uninstall, exit); any later use raises
        ``RuntimeError``. Not collective."""
        with self.lock, self._guard:
            self._idle.clear()
            self._heartbeat = None
            self.store = _ClosedStore()  # type: ignore[assignment]


_SLICE_S: Final = 0.25
_WAKE_JOIN_S: Final = 1.0


class _Stores:
    """The runtime's job stores and the helpers of its interrupted store waits."""

    CLOSE_PHASE: Final = _runtime.CLOSE_STORES

    def __init__(self) -> None:
        self.cache: dict[tuple[str, int], JobStore] = {}
        # The default process group's store -> its JobStore, for as long as the group holds that
        # store: holding it past destroy_process_group would keep rank 0's server socket, and a
        # new group on the same port would hang.
        self.pg_cache: weakref.WeakKeyDictionary[Store, JobStore] = weakref.WeakKeyDictionary()
        self.lock = threading.Lock()
        self.pg_lock = threading.RLock()  # the lock of every process group's JobStore
        # Helper threads of interrupted store waits (JobStore.wait_for) -> when their wait ends
        # (time.monotonic()): joined before the stores close.
        self.waiters: dict[threading.Thread, float] = {}

    def opened(self) -> list[JobStore]:
        """The job stores this process opened (not those of the process it was forked from)."""
        with self.lock:
            return ([job for (_, pid), job in self.cache.items() if pid == os.getpid()]
                    + list(self.pg_cache.values()))

    def close(self) -> None:
        """Close the store clients while the interpreter is whole, not during its finalization,
        where destroying torch's C++ objects in an arbitrary order can abort the process. Last
        of the runtime's parts (:mod:`patchload._runtime`): the threads that use the stores have
        stopped. First the helpers of interrupted waits still in theirs
        (:meth:`JobStore.wait_for`), each until its own bound."""
        with self.lock:
            waiters = list(self.waiters.items())
        for helper, until in waiters:
            helper.join(max(0.0, until - time.monotonic()) + 0.5)
        with self.lock:
            mine = [job for (_, pid), job in self.cache.items() if pid == os.getpid()]
            self.cache.clear()
            self.pg_cache.clear()
        for job in mine:
            job.close()
            if job.file is not None:
                _leave_file_store(job.file)


def _stores() -> _Stores:
    return _runtime.current().part(_Stores)


def opened_stores() -> list[JobStore]:
    """The job stores this process has opened in this install (it opens none here)."""
    return _stores().opened()


_FALLBACK_DIR: Path | None = None  # this process's private directory, when the usual one is unfit
_FALLBACK_LOCK: Final = threading.Lock()


def private_dir() -> Path:
    """A directory only this user can read, for patchload's node-local files (mode ``0700``).

    ``<tempdir>/patchload-<uid>``, created if missing, shared by this user's processes on the
    node. If that path is unfit (owned by another user, open to others, not a directory, or a
    symlink: someone may have planted it), it is not used: this process warns once and uses a
    fresh ``<tempdir>/patchload-<uid>-XXXXXXXX`` of its own (mode ``0700``, removed at exit if
    empty) for the rest of its life. A node-local store made there is this process's alone.

    Returns:
        The directory's path.

    Raises:
        OSError: neither directory could be created.
    """
    from stat import S_IMODE, S_ISDIR, S_ISLNK

    global _FALLBACK_DIR
    if _FALLBACK_DIR is not None:
        return _FALLBACK_DIR
    uid = os.getuid()
    path = Path(tempfile.gettempdir()) / f"patchload-{uid}"
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if S_ISDIR(st.st_mode) and st.st_uid == uid and not st.st_mode & 0o077:
        return path
    with _FALLBACK_LOCK:
        if _FALLBACK_DIR is None:
            fallback = Path(tempfile.mkdtemp(prefix=f"patchload-{uid}-", dir=path.parent))
            atexit.register(_remove_empty_dir, fallback)
            kind = "a symlink" if S_ISLNK(st.st_mode) else \
                "a directory" if S_ISDIR(st.st_mode) else "not a directory"
            logger.warning("patchload's private directory %s is unfit (%s owned by uid %d, mode "
                           "%s; it must be a directory owned by uid %d with mode 0700): not "
                           "using it; this process uses %s instead, so a node-local store is "
                           "not shared with the other ranks of this node", path, kind,
                           st.st_uid, oct(S_IMODE(st.st_mode)), uid, fallback)
            _FALLBACK_DIR = fallback
    return _FALLBACK_DIR


def _remove_empty_dir(path: Path) -> None:
    try:
        path.rmdir()
    except OSError:  # not empty (a file someone still uses) or already gone: leave it
        pass


def _namespace() -> str:
    return job_id()


_USERS_KEY: Final = "patchload-users"
_PIDS_KEY: Final = "patchload-pids"
_EXITED_KEY: Final = "patchload-exited"


def _leave_file_store(path: Path) -> None:
    """At exit, once this process's clients of it are closed: count this process out of the
    node-local store; the last one out removes its file, and so does one that finds every other
    process that used it gone (killed processes never count themselves out). Under the
    directory's lock, so that no other process's client writes to the file in between."""
    import torch.distributed as dist

    try:
        with _directory_locked(path.parent):
            if not path.exists():  # dropped by a process that found this one gone
                return
            store = dist.FileStore(str(path), -1)
            last = store.add(_EXITED_KEY, 1) >= store.add(_USERS_KEY, 0)
            pids = {int(pid) for pid in store.get(_PIDS_KEY).decode().split(",") if pid}
            del store  # its destructor writes to the file: before the removal
            here = node_id()
            if last or all(pid == os.getpid() or not process_alive(here, pid) for pid in pids):
                path.unlink()
    except Exception as err:  # noqa: BLE001 - at exit; the file is only left behind
        logger.debug("leaving the node-local store %s failed: %s", path, err)


@contextlib.contextmanager
def _directory_locked(directory: Path) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``directory`` itself: the node's processes open or drop a
    store file in it one at a time. (A ``filelock.FileLock`` would leave a lock file behind in
    the private directory; a directory needs none.)"""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # releases the lock


def _drop_if_abandoned(path: Path) -> None:
    """Remove a node-local store file whose every user is gone (a job stopped by SIGTERM or
    SIGKILL never counts itself out): a later job of the same name must not read its claims."""
    if not path.exists():
        return
    import torch.distributed as dist

    try:
        old = dist.FileStore(str(path), -1)
        pids = {int(pid) for pid in old.get(_PIDS_KEY).decode().split(",") if pid} \
            if old.check([_PIDS_KEY]) else set()
        del old
    except Exception as err:  # noqa: BLE001 - unreadable: a file no live process can use either
        logger.debug("node-local store %s unreadable (%s): removing it", path, err)
        pids = set()
    here = node_id()
    if not any(process_alive(here, pid) for pid in pids):
        logger.info("removing the node-local store %s of a job whose processes are all gone "
                    "(pids %s)", path, sorted(pids))
        path.unlink(missing_ok=True)


def _make(kind: str, base: Store | None = None) -> JobStore:
    import torch.distributed as dist

    path = None
    if kind == "agent":
        base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                             is_master=False, timeout=_STORE_OP_TIMEOUT)
    elif kind == "process_group":
        assert base is not None
    else:
        path = private_dir() / f"store-{_namespace()}"
        with _directory_locked(path.parent):
            _drop_if_abandoned(path)
            base = dist.FileStore(str(path), -1)
            base.add(_USERS_KEY, 1)
            base.append(_PIDS_KEY, f"{os.getpid()},")
        logger.warning("no job-wide store (not under torchrun and no process group yet): "
                       "coordinating downloads inside this node only, through %s", path)
    lock = _stores().pg_lock if kind == "process_group" else threading.RLock()
    return JobStore(dist.PrefixStore(f"patchload/{_namespace()}/", base), kind, lock, path)


def _kind() -> str:
    import torch.distributed as dist

    env = os.environ
    if (env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and env.get("MASTER_ADDR")
            and env.get("MASTER_PORT")):
        return "agent"
    if dist.is_available() and dist.is_initialized():
        return "process_group"
    return "file"


def job_store() -> JobStore:
    """The store this process coordinates through now (see the module docstring for the order).

    Not collective: no rank waits for another here. Cached per process and kind; the process
    group's for as long as the current default group holds its store.

    Raises:
        RuntimeError: torch.distributed is unavailable, or the agent store cannot be reached
            within 60 s.
    """
    kind = _kind()
    stores = _stores()
    with stores.lock:
        if kind == "process_group":
            import torch.distributed as dist

            default = dist.distributed_c10d._get_default_store()
            if default not in stores.pg_cache:
                stores.pg_cache[default] = _make(kind, default)
            return stores.pg_cache[default]
        key = (kind, os.getpid())
        if key not in stores.cache:
            stores.cache[key] = _make(kind)
        return stores.cache[key]
