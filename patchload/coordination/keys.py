"""The store keys of one coordinated call: one place that names them.

A call's keys sit under its *base* (``<scope>/<function>/<digest>/<occurrence>/``, built by
:func:`.protocol.call_key`); each attempt's under ``<base>a<n>/``. Every module that reads or
writes one (``protocol``, ``beats``, ``followers``, ``rank0``, ``transport.job_collective``) asks here,
so that the deletion of a finished call (:func:`.protocol.finish`) can list them all.
``tests/golden/wire-*.json`` holds the names one model load writes. No I/O.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

__all__ = ["AttemptKeys", "finished_key"]


def finished_key(base: str) -> str:
    """The counter of the ranks done with every attempt of the call under ``base``; the last
    one deletes the call's keys."""
    return base + "finished"


@dataclass(frozen=True)
class AttemptKeys:
    """The keys of one attempt of a call, under ``prefix`` (``<base>a<n>/``).

    Written by the leader: ``leader`` (its claim: rank, pid, node, JSON), ``outcome`` (JSON),
    ``files`` (its announcement, JSON), ``pins`` (JSON), ``beats`` (the counter, key ``beat``)
    and ``beat(n)`` (empty; set at each beat, which wakes the followers waiting for it).
    Written by a model load's followers: ``arrived(r)`` (pid and node, JSON), ``arrivals`` (a counter),
    ``arrivals_all`` (empty: every follower arrived) and ``done(r)``.
    """

    prefix: str

    @property
    def leader(self) -> str:
        return self.prefix + "leader"

    @property
    def outcome(self) -> str:
        return self.prefix + "outcome"

    @property
    def files(self) -> str:
        return self.prefix + "files"

    @property
    def pins(self) -> str:
        return self.prefix + "pins"

    @property
    def beats(self) -> str:
        """The beat counter."""
        return self.prefix + "beat"

    def beat(self, n: int) -> str:
        """The key set at the ``n``-th beat."""
        return f"{self.prefix}beat/{n}"

    @property
    def arrivals(self) -> str:
        return self.prefix + "arrivals"

    @property
    def arrivals_all(self) -> str:
        return self.prefix + "arrivals/all"

    def arrived(self, rank: int) -> str:
        return f"{self.prefix}arrived/{rank}"

    def done(self, rank: int) -> str:
        return f"{self.prefix}done/{rank}"

    def written(self, *, beats: Iterable[int], ranks: Iterable[int], followers: bool
                ) -> list[str]:
        """Every key the attempt may have written: the leader's, the beat keys ``beats``, and
        with ``followers`` the followers' bookkeeping for ``ranks`` and a model load's
        ``files`` and ``pins`` (a call that loads no model writes none of them)."""
        names = [self.leader, self.outcome, self.beats, *(self.beat(n) for n in beats)]
        if followers:
            names += [self.files, self.pins, self.arrivals, self.arrivals_all]
            names += [key for r in ranks for key in (self.arrived(r), self.done(r))]
        return names
