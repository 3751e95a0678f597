"""Process-wide switches: the configuration read at install time and whether patches are live.

A process forked by a rank (a ``DataLoader`` or ``multiprocessing`` worker under the fork start
method) is not a rank of the job: it inherits the rank's variables, process group object and
call counts, but it is none of the job's processes. Its patched calls pass straight through, as
without patchload, silently: it would otherwise claim calls as the rank it copied (a rank
"following itself") and use store connections its parent owns. A forked child that becomes a rank
of its own (a launcher that forks its ranks and gives each its own ``RANK``) is coordinated as
usual.
"""

from __future__ import annotations

import os

from . import _runtime
from ._config import Config, load_config

__all__ = ["active", "config", "forked_worker", "installed", "set_active"]

# The rank this process was forked from (None: not forked from a rank): a fact about the
# process, not about an install.
_FORKED_FROM_RANK: int | None = None


class _Switches:
    """The runtime's configuration and whether its patches are live."""

    def __init__(self) -> None:
        self.config: Config | None = None
        self.active = False


def _switches() -> _Switches:
    return _runtime.current().part(_Switches)


def config() -> Config:
    """The configuration read by :func:`patchload.install` (read now if not installed)."""
    switches = _switches()
    if switches.config is None:
        switches.config = load_config()
    return switches.config


def active() -> bool:
    """True while patchload's patches are installed, in a process that is a rank of the job (not
    a worker forked by one: :func:`forked_worker`); wrappers pass straight through otherwise."""
    return _switches().active and not forked_worker()


def installed() -> bool:
    """True while patchload's patches are installed (in a forked worker too)."""
    return _switches().active


def forked_worker() -> bool:
    """True in a process forked by a rank of a distributed job that is still that rank by its
    topology (it did not become a rank of its own): a worker of the rank, not a rank."""
    if _FORKED_FROM_RANK is None:
        return False
    from ._topology import current_topology

    topology = current_topology()
    return topology.distributed and topology.rank == _FORKED_FROM_RANK


def _after_fork_in_child() -> None:
    global _FORKED_FROM_RANK
    if _FORKED_FROM_RANK is not None:
        return  # a worker's worker: forked from the same rank
    from ._topology import current_topology

    try:
        topology = current_topology()
    except Exception:  # noqa: BLE001 - never fail a fork; an unreadable topology is no rank
        return
    if topology.distributed:
        _FORKED_FROM_RANK = topology.rank


os.register_at_fork(after_in_child=_after_fork_in_child)


def set_active(value: bool, cfg: Config | None = None) -> None:
    """Record whether patches are live and the configuration they run with."""
    switches = _switches()
    switches.active = value
    if cfg is not None:
        switches.config = cfg
