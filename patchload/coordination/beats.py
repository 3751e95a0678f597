"""Beats: how a leader shows it is alive and wakes its followers, and how followers block.

Each attempt of a call has a beat counter ``<key>beat``. The leader bumps it, and sets the
key ``<key>beat/<n>`` for the new value ``n``, once every ``PATCHLOAD_HEARTBEAT`` seconds
(:class:`Heartbeat`) and whenever it changes what followers wait for (its files are in the
cache, its outcome is published: :func:`beat`). A follower that read the counter as ``n``
blocks in the store (a server-side ``wait``) for ``beat/<n+1>``: it wakes at the leader's next
beat or change, and sends about three store requests per heartbeat period instead of polling.

A follower on the leader's node also learns of the leader's death at once: one thread per
process (:class:`LeaderWatch`) checks the pids of the local leaders it waits on every 50 ms
(no store request) and, when one is gone, sets the beat key its followers wait for.
"""

from __future__ import annotations

import itertools
import threading
import time
from typing import TYPE_CHECKING, Final

from .._background import Loop
from .._logging import get_logger
from .identity import node_id, process_alive

if TYPE_CHECKING:
    from torch.distributed import Store

    from .calls import Call, Role

__all__ = ["KEEP_BEAT_KEYS", "Heartbeat", "LeaderWatch", "beat", "read_beat",
           "wait_beat"]

logger = get_logger(__name__)

# Beat keys kept: a follower slow between reading the counter and waiting still finds its key,
# even after a burst of beats (a model load's leader beats for each hub call it pins).
KEEP_BEAT_KEYS: Final = 32


def beat(call: Call, *, heartbeat: bool = False) -> None:
    """Leader: bump the beat counter of ``call`` and set the key of its new value (waking the
    followers blocked on it); drop an old beat key, so the keys stay bounded. Not collective.

    ``heartbeat``: the caller is the :class:`Heartbeat` thread, which beats on a client of its
    own (:meth:`~patchload.coordination.store.JobStore.heartbeat_client`), never one that
    another thread's request may hold up; else the shared client, under ``call.store.lock``."""
    if heartbeat:
        _beat_on(call.store.heartbeat_client(), call)
        return
    with call.store.lock:
        _beat_on(call.store.store, call)


def _beat_on(client: Store, call: Call) -> None:
    keys = call.keys
    n = client.add(keys.beats, 1)
    client.set(keys.beat(n), "")
    if n > KEEP_BEAT_KEYS:
        client.delete_key(keys.beat(n - KEEP_BEAT_KEYS))


def read_beat(call: Call) -> int:
    """The beat counter of ``call`` now (the caller holds ``call.store.lock``)."""
    return int(call.store.store.add(call.keys.beats, 0))


def wait_beat(call: Call, seen: int, timeout_s: float) -> None:
    """Follower: block until the beat after ``seen`` (the leader's next heartbeat or change),
    at most ``timeout_s`` seconds. One store request; does not hold ``call.store.lock`` while
    blocked (its own store client). Returns on timeout too; the caller decides what it means.

    Interruptible (see :meth:`.store.JobStore.wait_for`): a signal handler's exception
    (``KeyboardInterrupt``, ``SystemExit``) leaves the wait within 0.25 s and propagates
    unchanged. Its store wait is then ended by a beat of this follower's own (the one way to
    wake a store wait: set its key): the call's other followers wake once too and wait again,
    counting it as a sign of the leader's life (their silence clock restarts once)."""
    call.store.wait_for(call.keys.beat(seen + 1), timeout_s, wake=lambda: beat(call))


class Heartbeat:
    """One daemon thread per process that beats (:func:`beat`) every call it leads, once per
    ``PATCHLOAD_HEARTBEAT`` period, on a store client of its own: no other thread's request
    (a wait in the store above all) can delay a beat past the followers' patience. It runs
    while the process leads a call (:class:`patchload._background.Loop`) and is stopped and
    joined when its runtime closes (uninstall, interpreter exit).
    """

    def __init__(self) -> None:
        self._calls: dict[str, Call] = {}
        self._due: dict[str, float] = {}  # call key -> when its next beat is due (the thread's)
        self._lock = threading.Lock()
        self._beating = threading.Lock()  # held by the thread while it beats a call
        self._loop = Loop("patchload-heartbeat", period_s=0.1, busy=lambda: bool(self._calls),
                          step=self._beat_due, lock=self._lock)

    def add(self, call: Call) -> None:
        with self._lock:
            self._calls[call.key] = call
            self._loop.ensure()

    def remove(self, call: Call) -> None:
        """Stop beating ``call``; waits for a beat under way (one store request)."""
        with self._beating, self._lock:
            self._calls.pop(call.key, None)

    def stop(self) -> None:
        """Stop beating and wait for the thread, at most ``JOIN_AT_EXIT_S`` (2 s; called when
        the runtime closes: uninstall, interpreter exit)."""
        self._loop.stop()

    def _beat_due(self) -> None:
        """Beat the calls that are due."""
        with self._lock:
            calls = list(self._calls.values())
        due = self._due
        for key in [key for key in due if key not in {call.key for call in calls}]:
            del due[key]  # calls no longer led: bounded over a long stream of calls
        now = time.monotonic()
        for call in calls:
            # A call's first beat is one period after the thread first sees it, not at once:
            # its followers count silence from their own start (two periods and a second), and
            # the beats of its claim-to-outcome changes come from beat(); a warm loop's call
            # ends before its first period, with no heartbeat request at all.
            due.setdefault(call.key, now + call.config.heartbeat_s)
            if due[call.key] <= now:
                due[call.key] = now + call.config.heartbeat_s
                # Only while still led, and remove() waits for it: no beat comes after the
                # call's keys were deleted (it would leave two behind).
                with self._beating:
                    with self._lock:
                        if call.key not in self._calls:
                            continue
                    try:
                        beat(call, heartbeat=True)
                    except Exception as err:  # noqa: BLE001 - a store hiccup must not kill it
                        logger.warning("heartbeat for %s failed: %s", call.key, err)


class LeaderWatch:
    """One daemon thread per process that watches the pids of the leaders on this node that
    its followers wait on, and wakes those followers (sets the beat key they wait for) as soon
    as a leader's process is gone. Leaders on other nodes are not watched: their beats stop.
    It runs while a follower waits (:class:`patchload._background.Loop`)."""

    _PERIOD_S: Final = 0.05

    def __init__(self) -> None:
        self._waits: dict[int, tuple[Call, Role, int]] = {}
        self._tokens = itertools.count()
        self._lock = threading.Lock()
        self._loop = Loop("patchload-leader-watch", period_s=self._PERIOD_S,
                          busy=lambda: bool(self._waits), step=self._check, lock=self._lock)

    def watch(self, call: Call, role: Role, seen: int) -> int | None:
        """Watch ``role``'s leader while this thread waits for the beat after ``seen``.
        Returns a token for :meth:`unwatch`, or None when the leader is not on this node."""
        if role.leader_node != node_id():
            return None
        with self._lock:
            token = next(self._tokens)
            self._waits[token] = (call, role, seen)
            self._loop.ensure()
        return token

    def unwatch(self, token: int | None) -> None:
        if token is not None:
            with self._lock:
                self._waits.pop(token, None)

    def stop(self) -> None:
        self._loop.stop()

    def _check(self) -> None:
        """Wake the waits whose leader is gone."""
        with self._lock:
            waits = list(self._waits.items())
        alive: dict[int, bool] = {}
        for token, (call, role, seen) in waits:
            pid = role.leader_pid
            if pid not in alive:
                alive[pid] = process_alive(role.leader_node, pid)
            if alive[pid]:
                continue
            self.unwatch(token)
            try:
                with call.store.lock:
                    call.store.store.set(call.keys.beat(seen + 1), "")
            except Exception as err:  # noqa: BLE001 - the waiter then wakes at its bound
                logger.debug("waking the followers of %s failed: %s", call.key, err)
