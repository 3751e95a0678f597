"""``main_process_first``: leader-first for user code, with the leader's error passed on.

Like ``accelerate``'s ``main_process_first``, but built on the store instead of a barrier: if the
leader's block raises, every other rank of the scope raises the same class within seconds
instead of waiting at a barrier until the process group times out.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Iterator

from . import _state
from .coordination import protocol as _coordinate
from .coordination import rank0 as _rank0
from ._errors import PatchloadError
from ._topology import current_topology
from .coordination.store import job_store

__all__ = ["main_process_first"]

_SCOPES = ("node", "job")


@contextlib.contextmanager
def main_process_first(scope: str = "node") -> Iterator[bool]:
    """Run the block on the leader of ``scope`` first, then on the other ranks.

    Not collective: ranks match blocks by call site and occurrence count, through the job store.
    Without a distributed job the block just runs.

    Args:
        scope: ``node`` (local rank order: one leader per node, e.g. for node-local caches) or
            ``job`` (one leader for the whole job, e.g. for a shared filesystem).

    Yields:
        True on the leader, False on followers.

    Raises:
        ValueError: ``scope`` is not ``node`` or ``job``.
        PatchloadError: ``scope="job"`` across nodes with no job-wide store (a node-local one:
            not under torchrun, before ``init_process_group``).
        LeaderFailedError / the leader's exception class: on followers, when the leader's block
            raised (its message; a note names the leader rank), or its process died.
        PatchloadTimeout: on followers, after ``PATCHLOAD_TIMEOUT`` seconds without an outcome.
    """
    if scope not in _SCOPES:
        raise ValueError(f"scope={scope!r} is not valid: accepted values are {_SCOPES}")
    topology = current_topology()
    if not topology.distributed:
        yield True
        return
    if scope == "job" and topology.num_nodes > 1 and job_store().node_local:
        raise PatchloadError(
            f"[rank {topology.rank}/{topology.world_size}] main_process_first(scope='job'): no "
            f"job-wide store to coordinate {topology.num_nodes} nodes through (not under torchrun "
            "and no process group yet): each node would run its own leader at once. Call "
            "torch.distributed.init_process_group() first, launch with torchrun, or use "
            "scope='node'", rank=topology.rank)
    # The user's `with` line (past contextlib's __enter__): the call site matched across ranks.
    frame = inspect.currentframe().f_back.f_back  # type: ignore[union-attr]
    site = f"{frame.f_code.co_filename}:{frame.f_lineno}"  # type: ignore[union-attr]
    call = _coordinate.call_key("main_process_first", {"site": site}, scope=scope,
                                topology=topology, config=_state.config(),
                                what=f"main_process_first at {site}")
    call, role = _coordinate.claim(_rank0.place(call, nested=False), retry_failed=False)
    if role.lead:
        try:
            with _coordinate.leading(call):
                yield True
        finally:
            _coordinate.finish(call)
        return
    try:
        with _rank0.following(call):
            outcome = _coordinate.wait_outcome(call, role)
    finally:
        _coordinate.finish(call)
    if outcome is None or not outcome.get("ok"):
        _coordinate.raise_failure(call, role, outcome)
    yield False
