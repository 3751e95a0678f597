"""Rank 0 leads every call it makes, however late it comes: what it publishes, what others wait on.

Each scope's **rank 0** (global rank 0 for ``job``, the node's lowest rank for ``node``) leads
every coordinated call it makes. No wall-clock grace decides that on the common path; instead:

1. **Its call sequence.** Every process counts its coordinated calls per *sequence*: the call
   key's namespace (``job`` or the node's) and whether the call is top-level (made outside any
   coordinated call; ``main_process_first`` counts) or nested (inside one, the node leaders'
   calls among them). At its i-th call of a sequence, before claiming it, rank 0 publishes
   ``seq/<sequence>/<i>`` = the call's key and ``seqkey/<key>`` = i. (User code's hub metadata
   calls, :mod:`patchload.patches.hub_api`, are a sequence of their own.)
2. **A rank that is not rank 0** at its j-th call with key K first looks for ``seqkey/K``:
   there, rank 0 makes the call (now or already): it waits for rank 0's claim (which comes right
   after). Otherwise it reads the entry rank 0 publishes at the position where K belongs: its
   last call that rank 0 also made, at rank 0's position a and its own b, puts K at rank 0's
   ``a + (j - b)`` (so calls one rank makes alone shift nothing after the next shared call).
   An entry with another key there (past the keys this process calls too, from other threads
   or in another order, and rank 0's calls it passed by before): rank 0 passed that position
   with another call, it claims at once (results are equal whoever leads). No entry yet: rank
   0 is behind, and it waits, unless rank 0's latest entry below that position is a call this
   process neither made nor passed by (it counted calls rank 0 never made, such as one that
   another rank led, and looks too far ahead): then rank 0 passed this call by too. Neither
   scan takes for such a call rank 0's ``hf_hub_download`` entries when this call is no
   download itself (library code downloads at top level only when the cache lacks the file,
   so rank 0, filling the cache first, makes some a follower skips: a pipeline's
   ``adapter_config.json`` probe). A download of a rank's own file (``shard_<rank>``) still
   shows that rank 0 made another call there. A call of this process that reads the cache only
   (``local_files_only=True``, which never waits) counts as rank 0's same call made online, at
   the same count: the hand-made pattern "rank 0 loads, the others read the cache" leaves rank
   0's entry of that load no sign of a call passed by.
3. **Rank 0 shows it will not come.** Rank 0 also publishes ``ranks/<r>/state``: its pid and
   node, its process-level key parts (hub endpoint, offline mode, credentials digest, default
   hub cache), and while it lasts more than 0.2 s that it is blocked in one of the user's
   ``torch.distributed`` collectives (``barrier``, ``broadcast``, the object collectives, ...;
   written by a watcher thread, so the user's thread never does store I/O) with its position
   among the default group's collectives this process entered (``seq``, the outer call's for
   an object collective; none for another group's or a point-to-point one), or (for nested
   calls) that it waits as a follower of another rank's call, and at exit that it exited. A
   waiting rank claims at once when rank 0 is blocked, following (nested calls), exited or gone
   (same node: its pid; a rank 0 that never published its state, because it made no call
   before it exited or died, is looked for among the processes its launcher started on this
   node, :func:`.identity.launched_rank_alive`), or when its own key holds a process-level
   part that differs from rank 0's (another cache or endpoint: rank 0 can never make that key;
   credentials are not part of a key, see :mod:`.credentials`). A waiting rank reads that
   state every 0.5 s and the key it waits for (rank 0's entry, or its claim) after 0.5 ms,
   then 1.5 times as long each time, at most every 0.25 s (and after 0.5 ms again once rank
   0's entry for the call is there: its claim follows within a ms): about 6 store requests per
   second per waiting rank, only while rank 0 is behind. Reads, not a store wait: a store
   wait that times out prints c10d warnings on stderr.
4. **Fallback.** A rank 0 that is alive, behind and not blocked is waited for at most
   ``PATCHLOAD_CLAIM_GRACE`` seconds (120), with a WARNING every ``PATCHLOAD_PROGRESS_WARNING``
   seconds saying what it waits for. ``PATCHLOAD_CLAIM_GRACE=0``: nobody waits; the first rank
   to claim a call leads it.

Global rank 0 also logs one WARNING per job naming the ranks whose hub credentials differ from
its own (each rank appends its credentials digest, never the token, to one store key, which
:mod:`.credentials` reads to decide what a rank may take from a leader with other credentials).

Collectives that torch.compile traces (``all_reduce``, ``all_gather``, ``all_gather_into_tensor``,
``reduce_scatter_tensor``, ``all_to_all_single``, the p2p ``isend``/``irecv``) are left
unpatched: dynamo maps them by identity. Rank 0 blocked in one of those called eagerly, or in
DDP's constructor, is seen by sampling its main thread (:mod:`.sampler`); inside a compiled
graph or in an async collective's ``wait()`` it is waited for as a rank 0 that is behind.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import inspect
import json
import math
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Final, Iterator

from .identity import launched_rank_alive, node_id, process_alive
from .calls import Call, Placement
from .sampler import CollectiveSampler
from .. import _runtime
from .._logging import get_logger
from .._topology import process_group_initialized
from .store import JobStore

if TYPE_CHECKING:
    from .._patching import Patch
    from .._topology import Topology

__all__ = ["Placement", "await_rank0", "collective_patches", "following", "place",
           "sample_collectives_when_imported", "scope_rank0", "world_collectives"]

logger = get_logger(__name__)

_SHOW_AFTER_S: Final = 0.2  # a collective shorter than this is never published
_SLICE_S: Final = 0.5  # a waiting rank reads rank 0's state this often
# A waiting rank reads the key it waits for after 0.5 ms, then 1.5 times as long each time, at
# most every 0.25 s (see _poll): it notices rank 0 at most a third of its wait late.
_FIRST_POLL_S: Final = 0.0005
_POLL_GROWTH: Final = 1.5
_MAX_POLL_S: Final = 0.25
_RECENT: Final = 2  # a rank's latest calls rank 0 has not made (yet), to anchor on later
_PASSED_SCAN: Final = 16  # positions below the expected one a waiting rank looks at
_CACHE_DEPENDENT: Final = frozenset({"hf_hub_download"})  # see _cache_dependent()
_CREDENTIAL_CHECKS: Final = 8  # rank 0's calls at which it looks at the other ranks' credentials
# Process-level key parts (coordination.key.process_state, and the default hub cache).
FACTS: Final = ("__endpoint__", "__offline__", "__credentials__", "__cache__")
# torch.distributed collectives a user blocks in (not those dynamo traces: see the docstring).
_COLLECTIVES: Final = ("barrier", "monitored_barrier", "broadcast", "reduce", "gather",
                       "scatter", "reduce_scatter", "all_to_all", "all_gather_object",
                       "gather_object", "broadcast_object_list", "scatter_object_list", "send",
                       "recv")


def scope_rank0(call: Call) -> int:
    """The rank that leads every call of the scope it makes: global rank 0 (job), the node's
    lowest rank (node)."""
    return 0 if call.scope == "job" else call.topology.node_ranks()[0]


def _is_some_rank0(topology: Topology) -> bool:
    return topology.rank == 0 or topology.rank == topology.node_ranks()[0]


def _read(store: JobStore, key: str) -> str | None:
    """The value of ``key`` or None, in one request (the caller holds the lock): a
    ``compare_set`` whose expected value no key holds writes nothing."""
    absent = "\x00absent"
    value = store.store.compare_set(key, absent, absent + "-never-written").decode()
    return None if value == absent else value


# --- what rank 0 publishes ------------------------------------------------------------------------

class _State:
    """This process's published state (``ranks/<r>/state``), written by one watcher thread (and
    by the caller's thread when its facts change)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._write_lock = threading.Lock()
        # token -> (what, since, its position among this process's world collectives or None)
        self._entries: dict[int, tuple[str, float, int | None]] = {}
        self._next = 0
        self._world = 0  # blocking collectives of the default group entered so far
        self._world_left = 0  # ... and returned from (every rank counts these)
        self._facts: dict[str, str] | None = None
        self._exited = False
        self._rank: int | None = None
        self._stores: list[JobStore] = []
        self._shown: dict[int, dict[str, Any]] = {}  # id(store) -> what it holds
        self._thread: threading.Thread | None = None

    def enter(self, what: str, *, world: bool = False) -> int:
        """Start an entry (``following`` or a collective's name; ``world``: a collective every
        rank of the default group makes, counted); never does I/O."""
        with self._cond:
            self._next += 1
            if world:
                self._world += 1
            self._entries[self._next] = (what, time.monotonic(), self._world if world else None)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="patchload-rank0",
                                                daemon=True)
                self._thread.start()
            self._cond.notify()
            return self._next

    def world_collectives(self) -> int:
        """How many blocking collectives of the default group this process has entered."""
        with self._cond:
            return self._world

    def leave(self, token: int) -> None:
        with self._cond:
            self._entries.pop(token, None)
            self._cond.notify()

    def left_world(self, n: int | None = None) -> int:
        """How many blocking collectives of the default group this process has returned from;
        with ``n``, first count ``n`` more."""
        with self._cond:
            self._world_left += n or 0
            return self._world_left

    def facts(self, store: JobStore, rank: int, facts: dict[str, str] | None) -> None:
        """Publish (now, on the caller's thread) this rank's facts into ``store`` too."""
        with self._cond:
            self._rank = rank
            if facts is not None:
                self._facts = facts
            if all(s is not store for s in self._stores):
                self._stores.append(store)
        self._write()

    def knows(self, store: JobStore) -> bool:
        """Whether this process's state is published into ``store``."""
        with self._cond:
            return any(store is known for known in self._stores)

    def exit(self) -> None:
        with self._cond:
            self._exited = True
            self._entries.clear()
        self._write()

    def _compose(self, now: float) -> dict[str, Any]:
        due = [(what, seq) for what, since, seq in self._entries.values()
               if now - since >= _SHOW_AFTER_S]
        blocked, seq = next(((w, s) for w, s in due if w != "following"), (None, None))
        return {"pid": os.getpid(), "node": node_id(), "facts": self._facts,
                "blocked": blocked, "seq": seq, "following": any(w == "following" for w, _ in due),
                "exited": self._exited}

    def _targets(self) -> list[JobStore]:
        """The stores to write into: those this process published its facts into, else those
        it already opened, else (it blocks in a collective before any call) the job's store
        once the process group exists. At exit no store is opened: one whose server is gone
        would hold the exit up for its connect timeout."""
        with self._cond:
            if self._stores:
                return list(self._stores)
            exited = self._exited
        from .._topology import current_topology

        topology = current_topology()
        if not _is_some_rank0(topology) or not topology.distributed:
            return []
        opened = _opened_stores()
        if not opened and not exited and process_group_initialized():
            from .store import job_store

            opened = [job_store()]
        with self._cond:
            self._rank = topology.rank if self._rank is None else self._rank
            for store in opened:
                if all(store is not known for known in self._stores):
                    self._stores.append(store)
        return opened

    def _write(self) -> None:
        with self._write_lock:
            try:
                stores = self._targets()
            except Exception as err:  # noqa: BLE001 - no store: nobody can wait on this rank
                logger.debug("no store to publish rank state into: %s", err)
                return
            with self._cond:
                state = self._compose(time.monotonic())
                rank = self._rank
            for store in stores:
                if self._shown.get(id(store)) == state:
                    continue
                try:
                    with store.lock:
                        store.store.set(f"ranks/{rank}/state", json.dumps(state))
                    self._shown[id(store)] = state
                except Exception as err:  # noqa: BLE001 - others then wait out the fallback
                    logger.debug("[rank %s] publishing its state failed: %s", rank, err)

    def _run(self) -> None:
        while True:
            with self._cond:
                now = time.monotonic()
                pending = [since + _SHOW_AFTER_S - now for _, since, _ in self._entries.values()
                           if now - since < _SHOW_AFTER_S]
                state = self._compose(now)
                showing = state["blocked"] is not None or state["following"]
                if (all(shown == state for shown in self._shown.values())
                        and (self._shown or not showing)):
                    if not self._entries:  # nothing to time: the thread ends (enter restarts it)
                        self._thread = None
                        return
                    self._cond.wait(timeout=min(pending) + 0.005 if pending else None)
                    continue
            self._write()
            time.sleep(0.01)  # bounded: at most ~100 writes/s while states flip


def _opened_stores() -> list[JobStore]:
    """The job stores this process has opened (it never opens one here)."""
    from .store import opened_stores

    return opened_stores()




@contextlib.contextmanager
def following(call: Call) -> Iterator[None]:
    """Mark the block as this rank waiting for another rank's outcome of ``call`` (published
    after 0.2 s, by the watcher): a rank waiting for this one's nested call stops waiting. No
    store I/O here; a no-op on ranks that are no scope's rank 0."""
    if not _is_some_rank0(call.topology):
        yield
        return
    token = _rank0().state.enter("following")
    try:
        yield
    finally:
        _rank0().state.leave(token)


def _collective(name: str) -> Callable[..., Any]:
    def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> Any:
        from .._topology import current_topology

        topology = current_topology()
        if kwargs.get("async_op") or not topology.distributed:
            return wrapped(*args, **kwargs)
        state = _rank0().state
        world = _on_world_group(name, wrapped, args, kwargs)
        token = state.enter(name, world=world) if _is_some_rank0(topology) else None
        try:
            result = wrapped(*args, **kwargs)
        finally:
            if token is not None:
                state.leave(token)
        # Every rank counts the default group's collectives it returned from: a rank that has
        # left rank 0's published one knows that state is stale (see _stop).
        state.left_world(int(world))
        return result

    return wrapper


def _on_world_group(name: str, wrapped: Callable[..., Any], args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> bool:
    """Whether the collective is one that every rank of the default group makes, in the same
    order on each (torch.distributed's rule): not point-to-point, ``group`` None or WORLD."""
    if name in ("send", "recv"):
        return False
    try:
        group = inspect.signature(wrapped).bind(*args, **kwargs).arguments.get("group")
    except (TypeError, ValueError):  # arguments the call itself rejects: not counted
        return False
    if group is None:
        return True
    from torch.distributed import GroupMember

    return group is GroupMember.WORLD


def world_collectives() -> int | None:
    """How many blocking collectives of the default group this process has entered while
    patchload is installed (an object collective counts the ``broadcast``/``scatter``/
    ``gather`` calls torch makes inside it too, the same on every rank: each rank makes them in
    the same order), or None where it does not count them (no scope's rank 0). A count that
    differs between ranks (one counted from later on) costs only a wait or a broadcast
    receiver (``job_collective._await_arrivals``), never a result."""
    from .._topology import current_topology

    if not _is_some_rank0(current_topology()):
        return None
    return _rank0().state.world_collectives()


def collective_patches() -> list[Patch]:
    """Wrap the user's blocking ``torch.distributed`` collectives: on a scope's rank 0, one
    lasting over 0.2 s is published (see the module docstring). Arguments and results pass
    through untouched."""
    from .._patching import Patch

    return [Patch("torch.distributed.distributed_c10d", name, _collective(name),
                  rebind_aliases=True) for name in _COLLECTIVES]


def sample_collectives_when_imported() -> None:
    """On a scope's rank 0 of a job of several processes, sample its main thread for the
    collectives that are not wrapped (:mod:`.sampler`) from the import of torch.distributed
    on (a rank 0 that only its process group names, as under ``torch.multiprocessing.spawn``:
    from its first call on), until the install ends. Not collective; never raises."""
    import wrapt

    def hook(module: object) -> None:
        from .._topology import current_topology

        try:
            topology = current_topology()
            if topology.distributed and _is_some_rank0(topology):
                _rank0().sampler.start()
        except Exception as err:  # noqa: BLE001 - then only wrapped collectives show
            logger.debug("sampling the main thread for collectives failed: %s", err)

    name = "torch.distributed.distributed_c10d"
    if name in sys.modules:
        hook(sys.modules[name])
    else:
        wrapt.register_post_import_hook(hook, name)


# --- placing a call -------------------------------------------------------------------------------

@dataclass
class _Anchor:
    """A non-rank-0 process's alignment with rank 0's sequence: its call at its own position
    ``mine`` is rank 0's at ``theirs``; ``recent``: its later calls rank 0 had not made."""

    theirs: int = 0
    mine: int = 0
    recent: list[tuple[int, str]] = dataclasses.field(default_factory=list)


_PLACED_MAX: Final = 256


class _Rank0:
    """The runtime's side of this module: its published rank state, its place in each call
    sequence and its credentials reports. Closing it is rank 0's last word in the store: the
    final credentials check and its exit (before the threads stop and the stores close)."""

    CLOSE_PHASE: Final = _runtime.ANNOUNCE_EXIT

    def __init__(self) -> None:
        self.state = _State()
        self.positions: collections.Counter[str] = collections.Counter()
        self.lock = threading.Lock()
        self.anchors: dict[str, _Anchor] = collections.defaultdict(_Anchor)
        # Per sequence, the keys of this process's latest calls: rank 0's entry holding one of
        # them is a call this process makes too, from another thread or in another order, not a
        # call passed by.
        self.placed: dict[str, collections.OrderedDict[str, None]] = collections.defaultdict(
            collections.OrderedDict)
        self.credentials: dict[str, Any] = {"reported": {}, "checks": 0, "warned": False,
                                            "call": None}
        # id(store) -> (store, the sequence entries this process published there as rank 0)
        self.published: dict[int, tuple[JobStore, list[str]]] = {}
        self.sampler = CollectiveSampler(self.state.enter, self.state.leave,
                                         frozenset(_COLLECTIVES))

    def close(self) -> None:
        self.sampler.stop()
        try:
            _check_credentials(final=True)
            self.state.exit()
        except Exception as err:  # noqa: BLE001 - at exit: others then see its pid gone
            logger.debug("publishing this rank's exit failed: %s", err)
        if not _runtime.current().exiting:
            self._forget_sequence()

    def _forget_sequence(self) -> None:
        """At uninstall (not at exit, where nothing restarts): delete the sequence entries this
        rank published, one request each. A new install counts its calls from 1 again, and its
        followers would take the old entries for rank 0's new calls."""
        with self.lock:
            published, self.published = list(self.published.values()), {}
        for store, keys in published:
            try:
                with store.lock:
                    for key in keys:
                        store.store.delete_key(key)
            except Exception as err:  # noqa: BLE001 - others then see rank 0's exit
                logger.debug("deleting rank 0's sequence entries failed: %s", err)


def _rank0() -> _Rank0:
    return _runtime.current().part(_Rank0)


def place(call: Call, *, nested: bool, facts: dict[str, str] | None = None,
          metadata: bool = False, stands_for: tuple[str, ...] = ()) -> Call:
    """Count ``call`` in this process's sequence; on the scope's rank 0, publish it (before it
    claims). Not collective; never waits; a store failure only costs the others their wait.

    Args:
        call: the call, from :func:`.protocol.call_key` (or the node leaders' call).
        nested: the call is made inside another coordinated call.
        facts: the process-level parts (:data:`FACTS`) its key holds.
        metadata: a hub metadata call of user code (:mod:`patchload.patches.hub_api`), counted
            in a sequence of its own (``<namespace>/metadata``): a listing that one rank makes
            alone never shifts where the others look for rank 0's loads.
        stands_for: the keys of rank 0's call that this one takes the place of (a call that
            reads the cache only, where rank 0 makes the same call online: the hand-made
            pattern "rank 0 loads, the others read the cache"): a later wait takes rank 0's
            entry of one for this process's own call, not for a call rank 0 made in place of
            the one waited for.

    Returns:
        ``call`` with its :class:`Placement`.
    """
    kind = "nested" if nested else "metadata" if metadata else "top"
    sequence = f"{call.key.split('/', 1)[0]}/{kind}"
    mine = _rank0()
    with mine.lock:
        mine.positions[sequence] += 1
        position = mine.positions[sequence]
    for key in (call.key, *stands_for):
        _account(sequence, key)
    facts = facts or {}
    call = dataclasses.replace(call, placement=Placement(
        sequence, position, tuple(sorted(facts.items()))))
    try:
        # Reported whatever the claim grace: what a follower may take from a leader with other
        # credentials is decided from these reports (.credentials).
        if "__credentials__" in facts:
            _report_credentials(call, facts["__credentials__"])
        if call.config.claim_grace_s > 0 and call.topology.rank == scope_rank0(call):
            _publish(call, facts)
            mine.sampler.start()  # a group built by hand (spawn): known to be rank 0 only now
    except Exception as err:  # noqa: BLE001 - see the docstring
        logger.debug("%s: publishing call %d of %s failed: %s", call.prefix(), position,
                     sequence, err)
    return call


def _publish(call: Call, facts: dict[str, str]) -> None:
    complete = facts if all(part in facts for part in FACTS) else None
    state = _rank0().state
    if complete is not None or not state.knows(call.store):
        state.facts(call.store, call.topology.rank, complete)
    placement = call.placement
    keys = [f"seqkey/{call.key}", f"seq/{placement.sequence}/{placement.position}"]
    with call.store.lock:  # one request for both entries
        call.store.store.multi_set(keys, [str(placement.position), call.key])
    mine = _rank0()
    with mine.lock:
        mine.published.setdefault(id(call.store), (call.store, []))[1].extend(keys)


def _report_credentials(call: Call, digest: str) -> None:
    """Each rank appends ``<rank>:<digest>`` to ``ranks/credentials`` once per store, and again
    when its digest changes (its last entry counts); global rank 0 looks at them."""
    mine = _rank0()
    credentials = mine.credentials
    with mine.lock:
        first = credentials["reported"].get(id(call.store)) != digest
        credentials["reported"][id(call.store)] = digest
        if call.topology.rank == 0:
            credentials["call"], credentials["mine"] = call, digest
    if first:
        with call.store.lock:
            call.store.store.append("ranks/credentials", f"{call.topology.rank}:{digest},")
    if call.topology.rank == 0:
        _check_credentials(final=False)


def _check_credentials(*, final: bool) -> None:
    """Global rank 0: one WARNING per job naming the ranks whose credentials differ from its
    own, once every rank reported (or at its last look: its 8th call, or exit). Never waits."""
    mine = _rank0()
    credentials = mine.credentials
    with mine.lock:
        call = credentials["call"]
        if call is None or credentials["warned"] or credentials["checks"] >= _CREDENTIAL_CHECKS:
            return
        credentials["checks"] += 1
        last = final or credentials["checks"] >= _CREDENTIAL_CHECKS
    with call.store.lock:
        text = _read(call.store, "ranks/credentials") or ""
    seen = dict(entry.split(":", 1) for entry in text.split(",") if ":" in entry)
    if len(seen) < call.topology.world_size and not last:
        return
    other = sorted(int(rank) for rank, digest in seen.items()
                   if digest != credentials["mine"])
    with mine.lock:
        credentials["warned"] = True
    if other:
        logger.warning("%s: ranks %s use other hub credentials (HF_TOKEN or the token file) "
                       "than this rank: they share with it only what any credentials can fetch "
                       "(repos neither gated nor private, which one anonymous metadata request "
                       "per repo shows); a gated or private repo each group of ranks with the "
                       "same credentials fetches for itself", call.prefix(), other)


# --- waiting for rank 0 ---------------------------------------------------------------------------

def await_rank0(call: Call) -> tuple[str | None, bool]:
    """Wait until the scope's rank 0 claimed attempt ``call`` or showed that it will not make
    it (see the module docstring); then the caller claims. Not collective; bounded by
    ``PATCHLOAD_CLAIM_GRACE`` seconds; returns at once when that is 0. Never raises (a store
    failure ends the wait).

    Returns:
        The claim it saw (the ``leader`` key's value: the caller follows that one without
        claiming), or None (the caller claims); and whether the caller was there before that
        claim (the claim was not there at its first look): it waited for that attempt, so the
        attempt's outcome is its own, a failure included, however soon the leader failed."""
    cfg = call.config
    if cfg.claim_grace_s <= 0:
        return None, False
    try:
        return _await(call, cfg.claim_grace_s, cfg.progress_warning_s)
    except Exception as err:  # noqa: BLE001 - the caller's claim reports a broken store
        logger.debug("%s: waiting for rank 0 failed: %s", call.prefix(), err)
        return None, False


def _await(call: Call, bound_s: float, warning_s: float | None
           ) -> tuple[str | None, bool]:
    store, placement, base = call.store, call.placement, call.base
    rank0 = scope_rank0(call)
    leader = call.keys.leader
    # The common case of a warm loop, rank 0 ahead: its claim is there, one request. (The
    # anchor is not moved then: its offset changes only at a call rank 0 does not make, whose
    # next shared call finds rank 0's seqkey entry again below.)
    with store.lock:
        holder = _read(store, leader)
    if holder is not None:
        return holder, False
    start = time.monotonic()
    warn_at = start + warning_s if warning_s is not None else math.inf
    matched = placement is None
    fresh = False  # just matched: rank 0 published this call
    at_key = ""
    if placement is not None:
        anchor = _reanchor(store, placement.sequence)
        expected = anchor.theirs + (placement.position - anchor.mine)
    poll_s = _FIRST_POLL_S
    steps_over_downloads = not _cache_dependent(base)  # see the module docstring, item 2
    while True:
        if matched:
            with store.lock:
                holder = _read(store, leader)
            if holder is not None:
                return holder, True
        else:
            with store.lock:
                found = _read(store, f"seqkey/{base}")
                # Another rank that gave up on rank 0 claimed it: follow that one.
                holder = None if found is not None else _read(store, leader)
            if holder is not None:
                return holder, True
            if found is not None:
                _matched(placement, int(found))
                matched = fresh = True
                poll_s = _FIRST_POLL_S  # its claim follows within a ms: read soon again
                continue
            # Rank 0's entries from where this call belongs, past this process's own calls
            # (other threads): the first other one shows that rank 0 passed this call by.
            while True:
                at_key = f"seq/{placement.sequence}/{expected}"
                with store.lock:
                    at = _read(store, at_key)
                if at is None or at == base:
                    break
                if not _placed_here(placement.sequence, at):
                    if not (steps_over_downloads and _cache_dependent(at)):
                        break
                    _account(placement.sequence, at)  # rank 0's own download: step over it
                expected += 1
            if at == base:
                _matched(placement, expected)
                matched = fresh = True
                poll_s = _FIRST_POLL_S
                continue
            if at is None:
                # Nothing there yet: rank 0 is behind, unless this process counted calls rank 0
                # never made (its own alone, or led by another rank) and looks too far ahead,
                # past where rank 0 already made another call.
                at = _passed_below(store, placement.sequence, expected, anchor.theirs,
                                   downloads=steps_over_downloads)
            if at is not None:
                _account(placement.sequence, at)
                _gave_up(call, placement, f"rank {rank0} made another call at that point "
                         f"({at})", remember=True)
                return None, False
        if fresh:
            # Rank 0 has just published this very call and claims it right after: its state
            # is read only once the first slice of the wait for that claim ends without it.
            fresh, state = False, None
        else:
            with store.lock:
                raw = _read(store, f"ranks/{rank0}/state")
            state = json.loads(raw) if raw else None
        differs = _differs(state, placement, rank0)
        if differs is not None:  # rank 0 never makes this key: not worth anchoring on
            _gave_up(call, placement, differs, remember=False)
            return None, False
        reason = _stop(state, placement, rank0)
        if state is None and reason is None and rank0 in call.topology.node_ranks() \
                and launched_rank_alive(rank0, call.topology.rank) is False:
            reason = f"rank {rank0}'s process is gone (it published no state: no call of its own)"
        if reason is not None:
            _gave_up(call, placement, reason, remember=not matched)
            return None, False
        now = time.monotonic()
        if now - start >= bound_s:
            logger.warning("%s: rank %d, alive and not in a collective, has not %s within "
                           "PATCHLOAD_CLAIM_GRACE (%.0f s): claiming it here", call.prefix(),
                           rank0, "claimed this call" if matched else "reached this call",
                           bound_s)
            _gave_up(call, placement, "PATCHLOAD_CLAIM_GRACE", remember=not matched)
            return None, False
        if now >= warn_at:
            logger.warning("%s: waiting for rank %d to %s %s (%.0f s so far; it is alive and "
                           "not in a collective); claiming it here after PATCHLOAD_CLAIM_GRACE "
                           "(%.0f s)", call.prefix(), rank0, "claim" if matched else "reach",
                           call.what, now - start, bound_s)
            warn_at = now + (warning_s or math.inf)
        poll_s = _poll(store, leader if matched else at_key,
                       max(0.01, min(_SLICE_S, start + bound_s - now, warn_at - now)), poll_s)


def _placed_here(sequence: str, key: str) -> bool:
    mine = _rank0()
    with mine.lock:
        return key in mine.placed[sequence]


def _account(sequence: str, key: str) -> None:
    """Count ``key`` as known to this process in ``sequence``: a call it makes, or rank 0's
    call it passed by with one of its own. A later wait steps over rank 0's entries of such
    keys instead of taking them for a call passed by (the latest :data:`_PLACED_MAX` kept)."""
    mine = _rank0()
    with mine.lock:
        placed = mine.placed[sequence]
        placed[key] = None
        while len(placed) > _PLACED_MAX:
            placed.popitem(last=False)


def _passed_below(store: JobStore, sequence: str, expected: int, floor: int, *,
                  downloads: bool) -> str | None:
    """Rank 0's latest published entry below ``expected`` (down to ``floor + 1``, the position
    this process last matched) when it is a call this process has neither made nor passed by:
    rank 0 made it where this call belongs, so it passed this call by. None when rank 0's
    latest entry there is one this process knows (rank 0 is behind) or it has none there.
    With ``downloads`` (this call is no download), rank 0's downloads are no evidence
    (:func:`_cache_dependent`; one rank's own file, ``shard_<rank>``, is no download made in
    place of another). One store request per position rank 0 has not published yet, at most
    :data:`_PASSED_SCAN`."""
    for position in range(expected - 1, max(floor, expected - 1 - _PASSED_SCAN), -1):
        with store.lock:
            at = _read(store, f"seq/{sequence}/{position}")
        if at is not None and not (downloads and _cache_dependent(at)):
            return None if _placed_here(sequence, at) else at
    return None


def _cache_dependent(key: str) -> bool:
    """Whether ``key`` (a call's base) is a call that library code makes at top level only
    when the cache lacks its file: transformers' ``cached_file`` calls ``hf_hub_download``
    unless the file, or the 404 marker of an earlier try, is in the cache. Rank 0, which fills
    the node's cache first, makes some such calls that a follower then skips (a pipeline's
    ``adapter_config.json`` probe), so one of rank 0's entries of such a call never shows that
    it passed a call by: it is stepped over."""
    parts = key.split("/")
    return len(parts) > 1 and parts[1] in _CACHE_DEPENDENT


def _stop(state: dict[str, Any] | None, placement: Placement | None, rank0: int) -> str | None:
    """Why rank 0, as its state shows, will not make the call (None: it may)."""
    if state is None:
        return None
    if state.get("exited"):
        return f"rank {rank0} exited"
    if not process_alive(str(state["node"]), int(state["pid"])):
        return f"rank {rank0}'s process (pid {state['pid']}) is gone"
    # A collective of the default group that this rank has returned from too is one rank 0
    # is leaving: its state says so only once its watcher thread has written it (found by a
    # break test: a rank coming out of a barrier took rank 0 for blocked and led the next call).
    if state.get("blocked") and (state.get("seq") is None
                                 or _rank0().state.left_world() < int(state["seq"])):
        return f"rank {rank0} is blocked in torch.distributed.{state['blocked']}"
    nested = placement is None or placement.sequence.endswith("/nested")
    if nested and state.get("following"):
        return f"rank {rank0} is following another rank's call"
    return None


def _differs(state: dict[str, Any] | None, placement: Placement | None,
             rank0: int) -> str | None:
    """Which process-level part of the call's key differs from rank 0's (None: none does)."""
    theirs = (state or {}).get("facts") or {}
    for part, mine in placement.facts if placement is not None else ():
        # Credentials are not part of a call's key: rank 0 makes the same key with other ones.
        if part != "__credentials__" and part in theirs and theirs[part] != mine:
            return f"its {part.strip('_')} and rank {rank0}'s differ"
    return None


def _reanchor(store: JobStore, sequence: str) -> _Anchor:
    """This process's anchor in ``sequence``, moved to its latest call rank 0 has made since."""
    here = _rank0()
    with here.lock:
        anchor = here.anchors[sequence]
        recent = list(anchor.recent)
    for mine, key in reversed(recent):
        with store.lock:
            theirs = _read(store, f"seqkey/{key}")
        if theirs is not None:
            with here.lock:
                if mine > anchor.mine:
                    anchor.theirs, anchor.mine = int(theirs), mine
                anchor.recent = [(m, k) for m, k in anchor.recent if m > mine]
            break
    return anchor


def _matched(placement: Placement | None, theirs: int) -> None:
    if placement is None:
        return
    here = _rank0()
    with here.lock:
        anchor = here.anchors[placement.sequence]
        if placement.position > anchor.mine:
            anchor.theirs, anchor.mine = theirs, placement.position
        anchor.recent = [(m, k) for m, k in anchor.recent if m > placement.position]


def _poll(store: JobStore, key: str, timeout_s: float, poll_s: float) -> float:
    """Return once ``key`` exists or after ``timeout_s`` seconds, reading it after ``poll_s``
    seconds, then 1.5 times as long each time (at most :data:`_MAX_POLL_S`); returns the
    interval to go on with. Reads, not a store ``wait``: a store wait that times out makes c10d
    print two ``waitForInput ... timed out`` warnings on stderr, which a plain rank never shows,
    and rank 0 may be behind for many slices. About 15 reads in the first 0.5 s, then 4 a second
    (6 with the state reads); rank 0's claim is seen at most a third of the wait, and 0.25 s,
    after it came."""
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return poll_s
        time.sleep(min(poll_s, left))
        poll_s = min(poll_s * _POLL_GROWTH, _MAX_POLL_S)
        with store.lock:
            if _read(store, key) is not None:
                return poll_s


def _gave_up(call: Call, placement: Placement | None, reason: str, *, remember: bool) -> None:
    logger.debug("%s: not waiting for rank %d any longer: %s", call.prefix(), scope_rank0(call),
                 reason)
    if remember and placement is not None:
        here = _rank0()
        with here.lock:
            anchor = here.anchors[placement.sequence]
            anchor.recent = [*anchor.recent, (placement.position, call.base)][-_RECENT:]
