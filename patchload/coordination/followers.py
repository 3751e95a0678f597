"""Follower bookkeeping: which ranks arrived at a call, which are done with it, which are gone.

A follower marks ``arrived/<rank>`` (its pid and node) when it starts waiting for an attempt and
``done/<rank>`` when it is finished with it (see :func:`.protocol.leader_first`). A leader that
holds something only its process can give (a shared-memory blob) asks here who still needs it;
a broadcast member whose peer broke asks who is gone. Liveness is :mod:`.identity`'s: a rank on
another node cannot be watched and counts as alive.
"""

from __future__ import annotations

import json
import time
from collections.abc import Collection

from .._logging import get_logger
from .._topology import Topology
from .identity import node_id, process_alive
from .keys import AttemptKeys
from .protocol import Call
from .store import JobStore

__all__ = ["followers_seen", "gone_ranks", "pending_followers", "wait_followers_done"]

logger = get_logger(__name__)


def pending_followers(call: Call, *, arrived_only: bool = True,
                      expected: Collection[int] = ()) -> list[int]:
    """Leader: the followers of ``call`` that may still need something only its process holds.

    Not collective; never waits. A follower counts until it is done with the call (its
    ``done`` key is set) or, on this node, its process is gone (a zombie counts as gone).

    Args:
        call: a call this rank leads.
        arrived_only: True: only followers that already announced they wait for the outcome
            (a rank that never makes the call is not counted). False: also the ranks of the
            call's scope that have not arrived yet.
        expected: ranks counted even before they arrive (with ``arrived_only``), as ranks
            that took part in the leader's earlier loads of the same thing.

    Returns:
        Their global ranks, ascending.
    """
    topology, keys = call.topology, call.keys
    ranks = topology.node_ranks() if call.scope == "node" else range(topology.world_size)
    pending = []
    with call.store.lock:
        if not call.store.store.check([keys.leader]):
            return []  # the call's keys are deleted: every rank of its scope finished with it
        for r in ranks:
            if r == topology.rank or call.store.store.check([keys.done(r)]):
                continue
            if not call.store.store.check([keys.arrived(r)]):
                if not arrived_only or r in expected:
                    pending.append(r)
                continue
            arrived = json.loads(call.store.store.get(keys.arrived(r)))
            if not process_alive(arrived["node"], int(arrived["pid"])):
                continue
            pending.append(r)
    return pending


def followers_seen(call: Call) -> list[int]:
    """Leader: the ranks of this node that took part in ``call`` as followers (arrived at it,
    or every rank of its scope when its keys are already deleted). Not collective; never waits.

    Returns:
        Their global ranks, ascending (this rank excluded).
    """
    topology, keys = call.topology, call.keys
    ranks = [r for r in topology.node_ranks() if r != topology.rank]
    with call.store.lock:
        if not call.store.store.check([keys.leader]):
            # Deleted by the last rank of the scope to finish: all of them made the call.
            return ranks if call.expected is None else []
        return [r for r in ranks if call.store.store.check([keys.arrived(r)])]


def gone_ranks(store: JobStore, key: str, ranks: list[int], topology: Topology, *,
               settle_s: float = 1.0) -> list[int]:
    """The ranks among ``ranks`` that took part in the attempt ``key`` (its keys' prefix; its
    leader, or a follower that arrived) and whose process on this node has exited. Not collective.

    Ranks on other nodes cannot be watched and are never counted. Waits up to ``settle_s``
    seconds for one to be found: a peer's broken connection is seen a moment before its
    process is gone.

    Returns:
        Their global ranks, ascending (empty when none is known to be gone).
    """
    here, keys = node_id(), AttemptKeys(key)
    pids: dict[int, int] = {}
    with store.lock:
        if store.store.check([keys.leader]):
            leader = json.loads(store.store.get(keys.leader))
            if leader["node"] == here:
                pids[int(leader["rank"])] = int(leader["pid"])
        for r in ranks:
            if r not in pids and store.store.check([keys.arrived(r)]):
                arrived = json.loads(store.store.get(keys.arrived(r)))
                if arrived["node"] == here:
                    pids[r] = int(arrived["pid"])
    deadline = time.monotonic() + settle_s
    while True:
        gone = sorted(r for r in ranks if r in pids and not process_alive(here, pids[r]))
        if gone or time.monotonic() > deadline:
            return gone
        time.sleep(0.05)


def wait_followers_done(call: Call, timeout_s: float, *, before: str,
                        expected: Collection[int] = ()) -> None:
    """Leader: wait until every follower that arrived at ``call``, and every rank of
    ``expected`` whether it arrived or not, is done with it (or dead).

    Bounded by ``timeout_s`` seconds; logs what it waits for. Used before a leader exits while
    followers may still need something only its process holds (a shared-memory blob).

    Args:
        call: a call this rank leads.
        timeout_s: the most this waits, in seconds.
        before: what the leader does next, for the log (``"exiting"``).
        expected: see :func:`pending_followers`.
    """
    deadline = time.monotonic() + timeout_s
    logged = False
    while time.monotonic() < deadline:
        pending = pending_followers(call, expected=expected)
        if not pending:
            return
        if not logged:
            logger.info("%s: before %s, waiting up to %.0f s for ranks %s to take the "
                        "shared weights", call.prefix(), before, deadline - time.monotonic(),
                        pending)
            logged = True
        time.sleep(0.05)
