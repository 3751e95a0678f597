"""Weights by collective broadcast: who joins, and the send.

Used for every rank under ``PATCHLOAD_TRANSPORT=collective``, and between node leaders when the
nodes share one hub cache (the job leader reads, the node leaders receive and share in their node).

The leader never blocks in a collective that followers do not join: once it has loaded, it waits
at most ``_ARRIVAL_WINDOW_S`` for the ranks of its scope to arrive at the same call key, publishes
the members it saw, and broadcasts to exactly those over a private gloo group built from the store
(never the user's process group). A rank that arrives later is not a member: it loads plainly from
the cache.
"""

from __future__ import annotations

import json
import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Final

from . import _state
from ._coordinate import Call
from ._store import job_store
from ._topology import current_topology

if TYPE_CHECKING:
    import torch

__all__ = ["share_collective", "receive_collective"]

logger = logging.getLogger(__name__)

_ARRIVAL_WINDOW_S: Final = 5.0
_GROUP_TIMEOUT_S: Final = 300.0


def _arrived(call: Call, expected: int) -> list[int]:
    """The ranks that arrived at ``call`` within the window (fewer if ``expected`` did not)."""
    ranks = [r for r in range(call.topology.world_size) if r != call.topology.rank]
    deadline = time.monotonic() + _ARRIVAL_WINDOW_S
    while True:
        with call.store.lock:
            present = [r for r in ranks if call.store.store.check([call.key + f"arrived/{r}"])]
        if len(present) >= expected or time.monotonic() > deadline:
            return present
        time.sleep(0.02)


def share_collective(call: Call, tensors: list[torch.Tensor]
                     ) -> tuple[dict[str, Any], Callable[[], None]]:
    """Leader: choose the members and return (payload, the broadcast to run once published).

    Args:
        call: the load call (scope ``job``): made by every rank (``PATCHLOAD_TRANSPORT=
            collective``), or only by the node leaders (one per node, the hierarchy).
        tensors: the unique CPU tensors to send, in order.

    Returns:
        The payload (``members``: global ranks, leader first; ``metas``; ``key``) and the send.
    """
    from .transport import meta_of

    topology = call.topology
    expected = (topology.world_size if _state.config().transport == "collective"
                else topology.num_nodes) - 1
    members = [topology.rank] + _arrived(call, expected)
    payload = {"members": members, "metas": [meta_of(t).to_json() for t in tensors],
               "key": call.key}

    def send() -> None:
        from .transport.collective import broadcast, private_group

        if len(members) == 1:
            return
        group = private_group(call.store.store, group_rank=0, group_size=len(members),
                              tag=call.key, timeout_s=_GROUP_TIMEOUT_S)
        try:
            broadcast(group, [t.detach() for t in tensors], src_group_rank=0, is_src=True,
                      bucket_bytes=_state.config().bucket_bytes)
        finally:
            group.close()
        logger.info("%s: broadcast %d tensors to ranks %s", call.prefix(), len(tensors),
                    json.dumps(members[1:]))

    return payload, send


def receive_collective(weights: dict[str, Any]) -> list[torch.Tensor] | None:
    """Follower: receive the leader's tensors, or None when this rank is not a member.

    Collective over the members the leader published. Raises the transport's error (naming the
    group and rank) when the leader or a member fails mid-way.
    """
    from .transport import TensorMeta
    from .transport.collective import broadcast, private_group

    rank = current_topology().rank
    members = weights["members"]
    if rank not in members:
        logger.info("[rank %d] arrived after the leader's broadcast started: loading plainly",
                    rank)
        return None
    metas = [TensorMeta.from_json(m) for m in weights["metas"]]
    group = private_group(job_store().store, group_rank=members.index(rank),
                          group_size=len(members), tag=weights["key"],
                          timeout_s=_GROUP_TIMEOUT_S)
    try:
        return broadcast(group, metas, src_group_rank=0, is_src=False,
                         bucket_bytes=_state.config().bucket_bytes)
    finally:
        group.close()
