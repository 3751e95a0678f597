"""Leader-first execution of one call across the ranks of a scope, through the job store.

For one *call key* (function, deciding arguments, occurrence count), the first rank of the scope
to claim the key in the store (``compare_set``) is the leader: it runs the call and publishes the
*outcome* as JSON: success with a payload, or its exception (class, message, rank), or that it
was interrupted (``KeyboardInterrupt``, ``SystemExit``: never passed on as the call's error). The
other ranks (followers) wait for the outcome, bounded by ``PATCHLOAD_TIMEOUT``, while watching
the leader's heartbeat and, on the same node, its pid; then they act on the payload, raise the
leader's exception, or (interrupted) make the call plainly. Nothing read from the store is ever
unpickled or executed. A follower's own interrupt leaves its wait at once, unchanged.

The scope's rank 0 leads every call it makes, however late it comes; a rank that calls out of
step, alone, or with other arguments never waits for a rank 0 that shows it will not come (it
made another call at that point, is blocked in a collective of the user's, exited, or holds
another cache or token): see :mod:`.rank0`. A late rank finds the outcome already published.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import os
import threading
import time
from typing import Any, Callable, Final, Iterator, TypeVar

from .. import _runtime
from .._config import Config
from .._errors import (
    LeaderFailedError,
    LeaderInterruptedError,
    PatchloadTimeout,
    describe_exception,
    follower_exception,
)
from .._logging import get_logger
from .._topology import Topology
from . import rank0 as _rank0
from .beats import Heartbeat, LeaderWatch, beat, read_beat, wait_beat
from .identity import kernel_id, node_id, process_alive
from .calls import Call, Role
from .key import credentials_digest, digest
from .keys import finished_key
from .reaper import KeyReaper, delete_keys
from .store import job_store

__all__ = ["Call", "LeaderView", "Role", "announcement", "call_key", "claim", "files_ready",
           "finish", "key_with", "leader_first", "leading", "node_leaders_call", "publish",
           "publish_pins", "raise_failure", "wait_outcome"]

logger = get_logger(__name__)

T = TypeVar("T")


class _Calls:
    """The runtime's call counters (one per call base: the n-th call of the same thing on every
    rank is one call) and the threads that serve its calls: the heartbeat of the calls it
    leads, the watch over the leaders its followers wait on, and the reaper of finished calls'
    keys."""

    CLOSE_PHASE: Final = _runtime.STOP_THREADS

    def __init__(self) -> None:
        self.counts: collections.Counter[str] = collections.Counter()
        self.lock = threading.Lock()
        self.heartbeat = Heartbeat()
        self.leader_watch = LeaderWatch()
        self.reaper = KeyReaper()

    def close(self) -> None:
        """Stop the heartbeat, the leader watch and the key reaper (each joined, at most
        ``JOIN_AT_EXIT_S``). At uninstall the reaper first deletes what is still pending: a
        next install counts its calls from 1 again, so it would meet those keys."""
        self.heartbeat.stop()
        self.leader_watch.stop()
        self.reaper.stop(drain=not _runtime.current().exiting)


def _calls() -> _Calls:
    return _runtime.current().part(_Calls)


def call_key(name: str, deciding: dict[str, Any], *, scope: str, topology: Topology,
             config: Config, what: str, watch: str | None = None) -> Call:
    """Build the :class:`Call` for this process's next call of ``name`` with ``deciding`` arguments.

    Args:
        name: the patched function, e.g. ``hf_hub_download``.
        deciding: the arguments that decide the call's result; rendered with ``repr`` (sorted), so
            equal arguments on two ranks give equal keys.
        scope: ``node`` or ``job``.
        topology: this rank's topology.
        config: the configuration in force.
        what: human-readable description of the call.
        watch: see :attr:`Call.watch`.

    Returns:
        The call, whose key also counts how many times this process made a call with the same
        name and arguments (so the n-th call on one rank meets the n-th call on the others).
    """
    # A node's calls are the launcher's node index on one kernel (identity.kernel_id): ranks the
    # launcher calls one node may sit on two hosts (srun + mp.spawn with a hand-made group), and
    # two PID namespaces of one host share its files (their liveness is the heartbeat's).
    where = ("node-" + digest("node", {"kernel": kernel_id(), "index": str(topology.node)})
             if scope == "node" else "job")
    base = _base(where, name, deciding)
    calls = _calls()
    with calls.lock:
        count = calls.counts[base]
        calls.counts[base] += 1
    return Call(f"{base}/{count}/", what, scope, topology, config, job_store(), watch)


def _base(where: str, name: str, deciding: dict[str, Any]) -> str:
    """A call's key without its count: its namespace, function and arguments' digest."""
    return f"{where}/{name}/{digest(name, deciding)}"


def key_with(call: Call, name: str, deciding: dict[str, Any]) -> str:
    """The key (before any attempt) that ``call`` would have with ``deciding`` in place of its
    own arguments, at the same count: where a rank 0 that made the call with those arguments
    (one count per distinct key, as :func:`call_key` counts) placed its counterpart."""
    where = call.key.split("/", 1)[0]
    count = call.key.rstrip("/").rsplit("/", 1)[1]
    return f"{_base(where, name, deciding)}/{count}/"


def node_leaders_call(call: Call) -> Call:
    """The job-scoped call that the node leaders of a node-scoped ``call`` make among themselves.

    Its key is derived from ``call``'s (same function, arguments and occurrence), not counted
    anew: a different rank may lead each node from one call to the next, and their counters of
    job-scoped calls would disagree.
    """
    if call.scope != "node":
        raise ValueError(f"{call.prefix()}: node_leaders_call needs a node-scoped call, got "
                         f"scope {call.scope!r} for {call.what}")
    key = "job/leaders/" + call.key.split("/", 1)[1]
    return Call(key, call.what, "job", call.topology, call.config, call.store, call.watch,
                expected=call.topology.num_nodes)


def claim(call: Call, *, retry_failed: bool = True) -> tuple[Call, Role]:
    """Claim the leadership of ``call``'s current attempt, or learn who holds it. Not
    collective.

    The scope's rank 0 leads every call it makes, however late: a rank other than rank 0 first
    waits (attempt 0 only) until rank 0 claimed the call or showed that it will not make it
    (rank 0 made another call at this point of its sequence, is blocked in a collective of the
    user's, exited, or the call's key holds a cache, token or endpoint that differs from rank
    0's), at most ``PATCHLOAD_CLAIM_GRACE`` seconds for a rank 0 that is alive, behind and not
    blocked (0: no wait; the first rank to claim leads). See :mod:`.rank0`.

    An **attempt** is one run of the call by one leader. A rank that arrives after an attempt
    failed (its error outcome is published) was not waiting on it: it starts the next attempt
    instead of inheriting that error (a rank-0-only probe, a transient error before a retry).
    A rank that was waiting for rank 0 before rank 0 claimed the attempt follows it to its end,
    a failure included, however soon it comes. A call that reads the cache only
    (``call.cache_only``) never waits for rank 0: the first rank to claim it leads (it makes no
    request), and no download of rank 0's lands in the cache while it waits.

    Args:
        call: the call, from :func:`call_key` (placed by :func:`.rank0.place`).
        retry_failed: False: a late rank follows the failed attempt too, inheriting its error
            (``main_process_first``: the block is the job's, not a request of the rank's own).

    Returns:
        The attempt (``call`` with its key narrowed to ``.../a<n>/``) and this rank's role in it:
        ``lead=True`` if this rank is the first of its scope to claim it.
    """
    narrowed, role, _ = _claim(call, retry_failed=retry_failed)
    return narrowed, role


def _claim(call: Call, *, retry_failed: bool = True
           ) -> tuple[Call, Role, dict[str, Any] | None]:
    """:func:`claim`, and the attempt's outcome where a follower found it already published
    (None: not read, or not there yet): a late follower then needs no second read of it."""
    # The claim carries the leader's credentials digest: a follower compares its own with it
    # without reading every rank's reports (.credentials). A placed call holds it already.
    placed = dict(call.placement.facts) if call.placement is not None else {}
    me = json.dumps({"rank": call.topology.rank, "pid": os.getpid(), "node": node_id(),
                     "credentials": placed.get("__credentials__") or credentials_digest()})
    attempt = 0
    while True:
        narrowed = dataclasses.replace(call, key=f"{call.key}a{attempt}/", attempt=attempt)
        holder, waited = None, False
        if attempt == 0 and not call.cache_only and call.topology.rank != _rank0.scope_rank0(call):
            holder, waited = _rank0.await_rank0(narrowed)
        outcome = None
        with call.store.lock:
            if holder is None:  # await_rank0 saw no claim: make one (or learn who holds it)
                holder = call.store.store.compare_set(narrowed.keys.leader, "", me).decode()
            # A rank that was there before the claim waited for this attempt: its failure is
            # this rank's too, however soon after the claim it came (not a matter of timing).
            if retry_failed and holder != me and not waited:
                outcome = _published(narrowed)
        if outcome is None or outcome.get("ok"):
            info = json.loads(holder)
            return narrowed, Role(holder == me, int(info["rank"]), int(info["pid"]),
                                  str(info["node"]), info.get("credentials")), outcome
        attempt += 1


def publish(call: Call, outcome: dict[str, Any]) -> None:
    """Publish the leader's outcome for ``call`` (JSON-able dict). Not collective."""
    with call.store.lock:
        call.store.store.set(call.keys.outcome, json.dumps(outcome))
    beat(call)


def _leader_alive(role: Role) -> bool:
    return process_alive(role.leader_node, role.leader_pid)


def files_ready(call: Call, announced: dict[str, Any] | None = None) -> None:
    """Leader: announce that every file of ``call`` is in the cache (its load is under way), so
    that followers can start their own part of the call before the outcome, with what they need
    to check before it (JSON-able ``announced``, see :func:`announcement`). Not collective."""
    with call.store.lock:
        call.store.store.set(call.keys.files, json.dumps(announced or {}))
    beat(call)


def publish_pins(call: Call, pins: dict[str, Any]) -> None:
    """Leader: publish the pins of the hub calls its call made so far (JSON-able, see
    :attr:`patchload.coordination.call.Mode.pins`), each time one returns, so that followers that
    started at once make each of those calls from the cache as soon as it is there
    (:meth:`LeaderView.wait_pin`). Not collective."""
    with call.store.lock:
        call.store.store.set(call.keys.pins, json.dumps(pins))
    beat(call)


def announcement(call: Call) -> dict[str, Any] | None:
    """Follower: what the leader announced with its files (:func:`files_ready`), or None (none
    announced, or not yet). Not collective; does not wait."""
    with call.store.lock:
        if not call.store.store.check([call.keys.files]):
            return None
        return json.loads(call.store.store.get(call.keys.files))


def wait_outcome(call: Call, role: Role, *,
                 until: Callable[[], bool] | None = None,
                 since: float | None = None, unread: bool = False) -> dict[str, Any] | None:
    """Wait for the leader's outcome of ``call``. Not collective; bounded.

    Args:
        call: a call this rank follows.
        role: the leader's role, from :func:`claim`.
        until: also return (None) as soon as this holds (asked with ``call.store.lock`` held,
            each time the leader beats), e.g. the leader announced its files.
        since: where this wait continues earlier ones, ``time.monotonic()`` less the seconds
            they waited: ``PATCHLOAD_TIMEOUT`` bounds them all together.
        unread: the caller has just found no outcome (its claim read it): the first look reads
            the beat counter before the outcome, one request fewer.

    Returns:
        The outcome dict the leader published, or None (``until`` only).

    Raises:
        LeaderFailedError: the leader's process is gone (same node), or its heartbeat stopped for
            two ``PATCHLOAD_HEARTBEAT`` periods.
        PatchloadTimeout: no outcome within ``PATCHLOAD_TIMEOUT`` seconds.
    """
    cfg, store = call.config, call.store
    last_beat_at = last_progress = time.monotonic()
    start = last_beat_at if since is None else since
    # The bytes in the leader's repo folder, for the progress warning's rate: first counted
    # when the wait blocks a second time (a walk of the folder; a warm call's wait ends at its
    # first wake).
    last_present: int | None = None
    counted_at = last_progress
    blocked = 0
    last_beat = None
    silent_s = 2 * cfg.heartbeat_s + 1.0
    while True:
        with store.lock:
            # Woken by a change: two requests. Else the counter before the outcome's second
            # check: a beat that comes after this read ends the wait below.
            found, outcome = (False, None) if unread and until is None else \
                _outcome_or(call, until)
            unread = False
            if not found:
                seen = read_beat(call)
                found, outcome = _outcome_or(call, until)
            if found:
                return outcome
        now = time.monotonic()
        if seen != last_beat:
            last_beat, last_beat_at = seen, now
        waited = now - start
        cause = None
        if not _leader_alive(role):
            cause = f"its process (pid {role.leader_pid}) is gone"
        elif now - last_beat_at > silent_s:
            cause = f"no heartbeat for {now - last_beat_at:.0f} s"
        if cause is not None:
            with store.lock:  # it may have published just before dying
                outcome = _published(call)
            if outcome is not None:
                return outcome
            raise LeaderFailedError(
                f"{call.prefix(role.leader_rank)}: the leader failed: {cause}",
                rank=call.topology.rank, leader_rank=role.leader_rank, cause=cause)
        if cfg.timeout_s is not None and waited > cfg.timeout_s:
            raise PatchloadTimeout(
                f"{call.prefix(role.leader_rank)}: waited for the leader's outcome: timed out "
                f"after {cfg.timeout_s:.0f} s (PATCHLOAD_TIMEOUT)",
                rank=call.topology.rank, leader_rank=role.leader_rank, waited_s=waited)
        if cfg.progress_warning_s is not None and waited > cfg.progress_warning_s \
                and now - last_progress > cfg.progress_warning_s:
            present = _bytes_under(call.watch)
            rate = (present - (present if last_present is None else last_present)) / \
                max(1e-9, now - counted_at)
            last_progress, last_present, counted_at = now, present, now
            logger.warning("%s: still waiting for the leader, alive and beating (%.0f s so far; "
                           "%s); %s", call.prefix(role.leader_rank), waited,
                           "no bound on the total wait" if cfg.timeout_s is None
                           else f"PATCHLOAD_TIMEOUT {cfg.timeout_s:.0f} s",
                           "its progress is not visible here" if call.watch is None else
                           f"{present / 2**20:.1f} MiB of its files in the cache, "
                           f"{rate / 2**20:.1f} MiB/s")
        # Block until the leader's next beat: at most until it counts as silent, the timeout,
        # or the next progress warning.
        bound = silent_s - (now - last_beat_at)
        if cfg.timeout_s is not None:
            bound = min(bound, cfg.timeout_s - waited)
        if cfg.progress_warning_s is not None:
            bound = min(bound, last_progress + cfg.progress_warning_s - now)
        bound = max(bound, 0.0) + 0.01
        blocked += 1
        if blocked == 2 and last_present is None:
            last_present, counted_at = _bytes_under(call.watch), now
        token = _calls().leader_watch.watch(call, role, seen)
        try:
            wait_beat(call, seen, bound)
        finally:
            _calls().leader_watch.unwatch(token)


_ABSENT: Final = "\x00absent"  # never a published value (JSON has no NUL outside strings)


def _published(call: Call, key: str | None = None) -> Any:
    """What the leader of ``call`` published under ``key`` (None: its outcome), or None (the
    caller holds the lock).

    One request: ``compare_set`` with an expected value no key holds writes nothing and returns
    the value, or the expected value when the key is absent."""
    value = call.store.store.compare_set(key or call.keys.outcome, _ABSENT,
                                         _ABSENT + "-never-written")
    return None if value == _ABSENT.encode() else json.loads(value)


def _outcome_or(call: Call, until: Callable[[], bool] | None
                ) -> tuple[bool, dict[str, Any] | None]:
    """(True, the published outcome), (True, None) if ``until()`` holds, else (False, None).
    The caller holds the lock."""
    outcome = _published(call)
    if outcome is not None:
        return True, outcome
    return until is not None and until(), None


def _announced(call: Call) -> bool:
    """Whether the leader announced its files (:func:`files_ready`)."""
    with call.store.lock:
        return bool(call.store.store.check([call.keys.files]))


def _bytes_under(path: str | None) -> int:
    """Bytes of the files under ``path`` (partial downloads included); 0 when absent."""
    if path is None:
        return 0
    total = 0
    for root, _, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def raise_failure(call: Call, role: Role, outcome: dict[str, Any]) -> None:
    """Raise the leader's published error on a follower (see :func:`follower_exception`), or
    :class:`LeaderInterruptedError` where the leader's call was interrupted (see
    :func:`leading`)."""
    if "interrupted" in outcome:
        what = outcome["interrupted"]
        cause = f"its call was interrupted ({what}), so it has no outcome"
        raise LeaderInterruptedError(f"{call.prefix(role.leader_rank)}: the leader failed: {cause}",
                                     rank=call.topology.rank, leader_rank=role.leader_rank,
                                     cause=cause, interrupted=what)
    error = outcome["error"]
    raise follower_exception(error, rank=call.topology.rank, leader_rank=role.leader_rank,
                             note=f"{call.prefix(role.leader_rank)} failed on the leader; "
                                  "this is its error, raised again on this rank")


class LeaderView:
    """A follower's view of the leader of one attempt: its outcome, the announcement of its
    files and the pins of its hub calls, each waited for as :func:`wait_outcome` waits (bounded
    by ``PATCHLOAD_TIMEOUT``, watching the leader's liveness). Not collective.

    ``idle`` (or None) runs once, before the first wait that blocks. ``PATCHLOAD_TIMEOUT``
    bounds the time spent in all of a view's waits together. Once one of them ended without an
    outcome (the leader died or went silent, or the timeout passed), every later one raises that
    same error at once unless the outcome is published by then: a caller that went on after it
    (transformers falls back on the cache when a hub call raises) never waits for that leader
    again.

    Attributes:
        raised: the leader's failure (or its death, its interrupted call, or the timeout) this
            view raised, if any; never this rank's own interrupt.
    """

    def __init__(self, call: Call, role: Role, idle: Callable[[], None] | None = None, *,
                 outcome: dict[str, Any] | None = None, unread: bool = False) -> None:
        self.call = call
        self.role = role
        self._idle = idle
        self._outcome: dict[str, Any] | None = outcome  # already read (by the claim), or None
        self._unread = unread
        self._waited = 0.0  # seconds spent blocked in this view's waits
        self._gone: LeaderFailedError | PatchloadTimeout | None = None
        self.raised: BaseException | None = None

    def payload(self) -> dict[str, Any]:
        """The leader's success payload, once published.

        Raises:
            The leader's failure (:func:`raise_failure`; :class:`LeaderInterruptedError` where
            its call was interrupted), :class:`LeaderFailedError`, :class:`PatchloadTimeout`.
            An interrupt of this rank's own (``KeyboardInterrupt``, a signal handler's
            ``SystemExit``) leaves the wait within 0.25 s, unchanged, and is not recorded in
            ``raised``.
        """
        try:
            if self._outcome is None:
                self._outcome = self._wait(None)
            if not self._outcome.get("ok"):
                raise_failure(self.call, self.role, self._outcome)
        except Exception as err:
            self.raised = err
            raise
        return self._outcome.get("payload") or {}

    def announcement(self) -> dict[str, Any] | None:
        """What the leader announced with its files, once it did or published its outcome
        (None: it never announced them). Raises as :meth:`wait_pin` with ``raising`` False."""
        self.wait_pin(None, raising=False)
        return announcement(self.call)

    def wait_pin(self, key: str | None, *, raising: bool = True) -> None:
        """Wait until the leader's call resolved the hub file ``key`` (its pin is published:
        :func:`publish_pins`) or published its outcome; with ``key`` None, until it announced
        its files or published its outcome.

        Raises:
            The leader's failure where it failed before announcing its files (a follower that
            waited for it raises the same: see :meth:`failed_early`), unless ``raising`` is
            False; :class:`LeaderFailedError`, :class:`PatchloadTimeout`.
        """
        def ready() -> bool:
            if key is None:
                return _announced(self.call)
            return key in (_published(self.call, self.call.keys.pins) or {})

        if self._outcome is None:
            try:
                self._outcome = self._wait(ready)
            except Exception as err:  # the leader's; this rank's own interrupt is not
                self.raised = err
                raise
        if raising and self._outcome is not None and self.failed_early():
            self.payload()

    def pin(self, key: str, default: Any = None) -> Any:
        """The leader's pin ``key`` (:func:`publish_pins`; in its success outcome once that is
        published), or ``default`` where it has published none under ``key`` so far. Does not
        wait; one store request until the outcome is known."""
        outcome = self._outcome
        if outcome is not None and outcome.get("ok"):
            return ((outcome.get("payload") or {}).get("pins") or {}).get(key, default)
        with self.call.store.lock:
            published = _published(self.call, self.call.keys.pins) or {}
            if outcome is None and key not in published:  # published since? (the last pins
                outcome = _published(self.call)           # are in the outcome only)
        if key in published:
            return published[key]
        if outcome is not None and outcome.get("ok"):
            return ((outcome.get("payload") or {}).get("pins") or {}).get(key, default)
        return default

    def failed(self) -> bool:
        """Whether the leader published a failure of its own (an error outcome; does not wait).
        Its death, its silence and this view's timeout publish none: False."""
        if self._outcome is None:
            with self.call.store.lock:
                self._outcome = _published(self.call)
        return self._outcome is not None and not self._outcome.get("ok")

    def failed_early(self) -> bool:
        """Whether the leader published a failure before announcing its files (does not wait):
        a follower that started at once then ends with the leader's error, whatever its own
        part did, as if it had waited for the leader before starting."""
        return self.failed() and not _announced(self.call)

    def _wait(self, until: Callable[[], bool] | None) -> dict[str, Any] | None:
        if self._idle is not None or self._gone is not None:
            with self.call.store.lock:
                found, outcome = _outcome_or(self.call, until)
            if found:
                return outcome
            if self._gone is not None:
                raise self._gone
            idle, self._idle = self._idle, None
            idle()
        begun = time.monotonic()
        unread, self._unread = self._unread, False
        try:
            return wait_outcome(self.call, self.role, until=until, since=begun - self._waited,
                                unread=unread)
        except (LeaderFailedError, PatchloadTimeout) as err:
            self._gone = err
            raise
        finally:
            self._waited += time.monotonic() - begun


@contextlib.contextmanager
def leading(call: Call) -> Iterator[Callable[[dict[str, Any]], None]]:
    """Leader: keep the heartbeat going for the block; publish its failure if it raises.

    Yields a function the block calls with its success payload to publish it (followers start
    then, even if the block goes on). An exception leaving the block is published as the failure
    outcome (unless success was already published) and re-raised. A ``BaseException`` that is
    not an ``Exception`` (``KeyboardInterrupt``, ``SystemExit``, ``GeneratorExit``) is no
    error of the call but this process stopping: it is published as ``{"ok": False,
    "interrupted": <class name>}``, never as the call's error, so no follower raises it (a plain
    rank would not see the leader's Ctrl-C or SIGTERM): followers then make the call plainly
    (:func:`leader_first`'s ``interrupted``), and a rank arriving later starts a new attempt
    (:func:`claim`). It is re-raised here unchanged.
    """
    published = False

    def done(payload: dict[str, Any]) -> None:
        nonlocal published
        publish(call, {"ok": True, "payload": payload})
        published = True

    _calls().heartbeat.add(call)
    try:
        yield done
        if not published:
            done({})
    except BaseException as err:
        if not published:
            if isinstance(err, Exception):
                publish(call, {"ok": False, "error": describe_exception(err),
                               "rank": call.topology.rank})
            else:
                publish(call, {"ok": False, "interrupted": type(err).__name__,
                               "rank": call.topology.rank})
        raise
    finally:
        _calls().heartbeat.remove(call)


def finish(call: Call, *, followers: bool = True) -> None:
    """This rank is done with ``call`` (with every attempt of it): count it out. The last rank
    of the call's scope to do so deletes the call's keys, so that the store stays bounded over a
    job's calls (a call that loads no model has them deleted on the key reaper's thread:
    :mod:`.reaper`). Not collective; never waits; never raises (a store failure only leaves
    keys).

    Keys of a call that some rank of its scope never makes stay until the job's store goes:
    torchrun's agent store ends with the job, and the last process out removes a node-local one.

    ``followers``: the call may have written the followers' bookkeeping (``arrived/<r>``,
    ``done/<r>``, ``arrivals``) and a model load's ``files`` and ``pins``, which are then
    deleted too (False for a call that loads no model: :func:`leader_first` writes none there).
    """
    store = call.store
    try:
        with store.lock:
            if store.store.add(finished_key(call.base), 1) < call.scope_size():
                return
            if followers:  # a model load: seconds long, its deletions are not felt
                delete_keys(store.store, call)
                return
        # A small call (a config, a warm download: a few ms) leaves them to the reaper's
        # thread: the rank that finished last does not pay about nine requests before its
        # next call.
        _calls().reaper.add(call, followers=False)
    except Exception as err:  # noqa: BLE001 - cleanup only
        logger.debug("%s: deleting the store keys of %s failed: %s", call.prefix(), call.key,
                     err)


def leader_first(call: Call,
                 lead: Callable[[Call], tuple[T, dict[str, Any], Callable[[], None] | None]],
                 follow: Callable[[Call, Role, LeaderView], T], *,
                 early: bool = False, idle: Callable[[], None] | None = None,
                 interrupted: Callable[[Call, Role, LeaderInterruptedError], T] | None = None
                 ) -> T:
    """Run ``lead`` on the call's leader and ``follow`` on every other rank of its scope.

    Not collective: each rank returns as soon as its own part is done; the leader never waits for
    followers.

    Args:
        call: the call, from :func:`call_key`.
        lead: run by the leader with the attempt it leads; returns (result, payload, after).
            The payload (JSON-able) is published with the success outcome; ``after`` (or None) runs once it is published
            (e.g. a broadcast the followers join after reading the payload). An exception from
            ``after`` is logged, not raised: the leader's own result is already good.
        follow: run by a follower with the attempt, the leader's role and its
            :class:`LeaderView`: once the leader succeeded, or, with ``early``, at once.
        early: let followers start at once: their part waits for the leader where it needs it
            (:meth:`LeaderView.wait_pin`, :meth:`LeaderView.payload`), and decides how a failed
            leader ends it (see :meth:`LeaderView.failed_early`).
        idle: run by a follower before it first blocks on the leader: work its own part does
            anyway, done while the leader downloads (an exception from it is raised).
        interrupted: run by a follower in place of ``follow`` when the leader's call was
            interrupted (:func:`leading`) before ``follow`` started (None: raise the
            :class:`LeaderInterruptedError`); with ``early``, ``follow`` sees it itself, in
            :attr:`LeaderView.raised`. A follower's own interrupt leaves its wait within 0.25 s
            and propagates unchanged, after its ``done`` and ``finished`` marks.

    Returns:
        What ``lead`` or ``follow`` returned on this rank.

    Raises:
        Whatever ``lead`` raised, on the leader; on followers, the same class rebuilt from the
        leader's outcome (the leader's message; a note names the ranks), or
        :class:`LeaderFailedError` / :class:`PatchloadTimeout` from :func:`wait_outcome`.
    """
    call, role, seen = _claim(call)
    if role.lead:
        try:
            with leading(call) as done:
                result, payload, after = lead(call)
                done(payload)
                if after is not None:
                    try:
                        after()
                    except Exception as err:  # noqa: BLE001 - a private group; the result stands
                        logger.warning("%s: sharing with the followers failed: %s",
                                       call.prefix(), err)
        finally:
            finish(call, followers=early)
        return result
    logger.debug("%s: following", call.prefix(role.leader_rank))
    if early:  # a model load's leader shares with the followers that wait (its only reader)
        with call.store.lock:
            call.store.store.set(call.keys.arrived(call.topology.rank),
                                 json.dumps({"pid": os.getpid(), "node": node_id()}))
            if call.store.store.add(call.keys.arrivals, 1) >= call.scope_size() - 1:
                call.store.store.set(call.keys.arrivals_all, "")  # wakes a leader waiting
    # The claim read the outcome (a follower's always does): absent, the first wait skips it.
    leader = LeaderView(call, role, idle, outcome=seen, unread=seen is None and not idle)
    try:
        with _rank0.following(call):  # a rank waiting for this one's nested call goes on
            if early:
                return follow(call, role, leader)
            try:
                leader.payload()  # waits for the outcome; raises the leader's failure
                stopped = None
            except LeaderInterruptedError as err:
                if interrupted is None:
                    raise
                stopped = err
            if stopped is not None:  # outside the handler: its error has no __context__
                return interrupted(call, role, stopped)
        return follow(call, role, leader)
    finally:
        if early:
            with call.store.lock:
                call.store.store.set(call.keys.done(call.topology.rank), "1")
        finish(call, followers=early)
