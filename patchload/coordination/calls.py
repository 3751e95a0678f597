"""The value types of one coordinated call: the call as matched across ranks, where it sits in
this process's sequence of calls, and this rank's role in it. No I/O; imported by every
coordination module that handles a call (``protocol``, ``beats``, ``rank0``), so none of them
imports another only for its types.
"""

from __future__ import annotations

from dataclasses import dataclass

from .._config import Config
from .._topology import Topology
from .keys import AttemptKeys
from .store import JobStore

__all__ = ["Call", "Placement", "Role"]


@dataclass(frozen=True)
class Placement:
    """Where a call sits in this process's sequence of coordinated calls.

    Attributes:
        sequence: ``<namespace>/top``, ``<namespace>/nested`` or ``<namespace>/metadata``
            (user code's hub metadata calls; namespace: ``job`` or the node's).
        position: 1-based count of this process's calls of that sequence, this one included.
        facts: the process-level parts (:data:`FACTS`) the call's key holds, as in the key.
    """

    sequence: str
    position: int
    facts: tuple[tuple[str, str], ...] = ()


@dataclass(frozen=True)
class Call:
    """One patched call, as matched across ranks.

    Attributes:
        key: store key prefix unique to this call in this job and scope; after :func:`claim`,
            to one attempt of it (``.../a<n>/``).
        what: human-readable description for messages, e.g. ``hf_hub_download('org/m', 'a.json')``.
        scope: ``node`` or ``job``: which ranks share the leader.
        topology: this rank's topology when the call was made.
        config: the configuration in force.
        store: the job store.
        watch: a directory whose growth shows the leader's progress (the repo's folder in the
            hub cache), or None.
        attempt: after :func:`claim`, the attempt ``key`` is narrowed to; None before.
        expected: how many ranks make the call; None: every rank of ``scope``.
        placement: where the call sits in this process's sequence of calls, which the scope's
            rank 0 publishes (:mod:`.rank0`); None: not placed (it waits for rank 0's claim).
        cache_only: the call reads the cache only (``local_files_only=True``, offline mode):
            it makes no request, so it never waits for rank 0 (:func:`.protocol.claim`), which
            would let rank 0's downloads decide what it finds.
    """

    key: str
    what: str
    scope: str
    topology: Topology
    config: Config
    store: JobStore
    watch: str | None = None
    attempt: int | None = None
    expected: int | None = None
    placement: Placement | None = None
    cache_only: bool = False

    @property
    def keys(self) -> AttemptKeys:
        """The store keys under ``key`` (one attempt's, after :func:`claim`)."""
        return AttemptKeys(self.key)

    @property
    def base(self) -> str:
        """The call's key before :func:`claim` narrowed it to an attempt."""
        return self.key if self.attempt is None else self.key[:-len(f"a{self.attempt}/")]

    def scope_size(self) -> int:
        """How many ranks make this call (see ``expected``)."""
        if self.expected is not None:
            return self.expected
        return (len(self.topology.node_ranks()) if self.scope == "node"
                else self.topology.world_size)

    def prefix(self, leader_rank: int | None = None) -> str:
        """``[rank r/n]`` (and the leader) for log lines and error messages."""
        head = f"[rank {self.topology.rank}/{self.topology.world_size}]"
        return head if leader_rank is None else f"{head} {self.what} (leader rank {leader_rank})"


@dataclass(frozen=True)
class Role:
    """This rank's part in a call: lead it, or follow ``leader_rank``."""

    lead: bool
    leader_rank: int
    leader_pid: int
    leader_node: str
    leader_credentials: str | None = None
    """The digest of the leader's default hub credentials when it claimed
    (:func:`.key.credentials_digest`; None: its claim did not say)."""
