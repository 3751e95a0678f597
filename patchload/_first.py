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
from ._topology import current_topology

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
        LeaderFailedError / the leader's exception class: on followers, when the leader's block
            raised (message names the leader rank), or its process died.
        PatchloadTimeout: on followers, after ``PATCHLOAD_TIMEOUT`` seconds without an outcome.
    """
    if scope not in _SCOPES:
        raise ValueError(f"scope={scope!r} is not valid: accepted values are {_SCOPES}")
    topology = current_topology()
    if not topology.distributed:
        yield True
        return
    # The user's `with` line (past contextlib's __enter__): the call site matched across ranks.
    frame = inspect.currentframe().f_back.f_back  # type: ignore[union-attr]
    site = f"{frame.f_code.co_filename}:{frame.f_lineno}"  # type: ignore[union-attr]
    call = _coordinate.call_key("main_process_first", {"site": site}, scope=scope,
                                topology=topology, config=_state.config(),
                                what=f"main_process_first at {site}")
    call, role = _coordinate.claim(call)
    if role.lead:
        with _coordinate.leading(call):
            yield True
        return
    outcome = _coordinate.wait_outcome(call, role)
    if outcome is None or not outcome.get("ok"):
        _coordinate.raise_failure(call, role, outcome)
    yield False
