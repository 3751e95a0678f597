"""Rank 0 blocked in a ``torch.distributed`` collective that patchload does not wrap, seen by
sampling its main thread.

A rank waiting for rank 0's claim of a call stops waiting once rank 0's published state shows
it blocked in one of the user's collectives (:mod:`.rank0`): rank 0 cannot make the call before
the waiting rank joins that collective. The collectives patchload wraps announce themselves.
Those it leaves unwrapped (``all_reduce``, ``all_gather``, ``all_gather_into_tensor``,
``reduce_scatter_tensor``, ``all_to_all_single``: dynamo maps them by identity) and what DDP's
constructor does from C++ (its parameter check and first broadcast) are seen here instead:
every 0.05 s a thread reads the main thread's innermost Python frame; while that is a function
of torch.distributed's collective modules, the state holds an entry named after it, published
after 0.2 s as a wrapped collective's is. patchload's own broadcasts never show: they call the
process group's backend from patchload's frames.

Not seen: ``Work.wait()`` of an async collective called from user code and a collective inside
a compiled graph (the innermost Python frame is the caller's). A rank 0 blocked there is waited
for as a rank 0 that is behind, at most ``PATCHLOAD_CLAIM_GRACE``.
"""

from __future__ import annotations

import sys
import threading
from types import FrameType
from typing import Callable, Final

from .._background import Loop

__all__ = ["CollectiveSampler", "collective_of"]

SAMPLE_S: Final = 0.05
# The modules whose functions, innermost on a thread, wait for the other ranks of a group.
_COLLECTIVE_MODULES: Final = frozenset({
    "torch.distributed.distributed_c10d",  # the collectives, init_process_group, new_group
    "torch.distributed.utils",  # DDP's _verify_param_shape_across_processes, _sync_module_states
    "torch.distributed._functional_collectives",  # wait_tensor of an eager functional one
})


def collective_of(frame: FrameType | None) -> str | None:
    """The name of the ``torch.distributed`` function that ``frame`` (a thread's innermost
    Python frame) runs, or None where it runs something else."""
    if frame is None or frame.f_globals.get("__name__") not in _COLLECTIVE_MODULES:
        return None
    return frame.f_code.co_name


class CollectiveSampler:
    """A daemon thread that samples the main thread every :data:`SAMPLE_S` seconds (see the
    module docstring) and keeps one entry, through ``enter(name)`` (returns a token) and
    ``leave(token)``, while the main thread is in that ``torch.distributed`` function. Runs
    from :meth:`start` until :meth:`stop` (the install ends); never does I/O. Functions named
    in ``wrapped`` are left to their wrappers, which report them with their count among the
    default group's collectives (a sampled entry, uncounted, could outlive the wrapper's by a
    sample and show rank 0 blocked in a collective the other ranks have left)."""

    def __init__(self, enter: Callable[[str], int], leave: Callable[[int], None],
                 wrapped: frozenset[str] = frozenset()) -> None:
        self._enter, self._leave, self._wrapped = enter, leave, wrapped
        self._lock = threading.Lock()
        self._token: int | None = None
        self._seen: str | None = None
        self._loop = Loop("patchload-collective-sampler", period_s=SAMPLE_S,
                          busy=lambda: True, step=self._sample, lock=self._lock)

    def start(self) -> None:
        with self._lock:
            self._loop.ensure()

    def stop(self) -> None:
        self._loop.stop()
        self._show(None)

    def _sample(self) -> None:
        # Calls of one collective back to back read as one long call (a sample cannot tell
        # them apart): at worst a waiting rank stops waiting for a rank 0 that was not blocked,
        # and leads the call itself.
        seen = collective_of(sys._current_frames().get(threading.main_thread().ident or -1))
        self._show(None if seen in self._wrapped else seen)

    def _show(self, seen: str | None) -> None:
        if seen == self._seen:
            return
        if self._token is not None:
            self._leave(self._token)
            self._token = None
        if seen is not None:
            self._token = self._enter(seen)
        self._seen = seen
