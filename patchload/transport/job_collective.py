"""Weights by collective broadcast (the ``"collective"`` transport): who joins, and the send.

Used for every rank under ``PATCHLOAD_TRANSPORT=collective``, and between node leaders when the
nodes share one hub cache (the job leader reads, the node leaders receive and share in their node).

The leader never blocks in a collective that followers do not join: once it has loaded, it waits
at most ``PATCHLOAD_ARRIVAL_WINDOW`` seconds for the ranks of its scope to arrive at the same call
key, publishes the members it saw, and broadcasts to exactly those over a private gloo group built from the store
(never the user's process group). A rank that arrives later is not a member: it loads plainly from
the cache. So does a member whose broadcast fails (the leader or another member died mid-way,
which gloo reports at once as a closed connection): the leader published its outcome only after
its load succeeded, so the files are in the cache; the warning names the ranks found gone.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any, Callable, Final

from .. import _state
from .._logging import get_logger
from .._topology import current_topology
from ..coordination.followers import gone_ranks
from ..coordination.identity import process_alive
from ..coordination.protocol import Call
from ..coordination.rank0 import world_collectives
from ..coordination.store import job_store

if TYPE_CHECKING:
    import torch

    from ..coordination.load_state import LoadState
    from . import TensorMeta
    from .arena import BlobArena

__all__ = ["CollectiveWeights", "share_collective", "receive_collective"]

logger = get_logger(__name__)
_BLOCKED_SHOWN_S: Final = 0.3  # a node leader shown blocked this long is not waited for

def _members(call: Call, expected: int) -> list[int]:
    """The followers that arrived at ``call`` within the arrival window (all ``expected`` of
    them, or fewer once it is over), are not done with it already (one interrupted while it
    waited left it) and whose process is alive (one on this node that died while waiting is
    left out: the group would wait for it until its timeout)."""
    if expected > 0:
        _await_arrivals(call)
    ranks = [r for r in range(call.topology.world_size) if r != call.topology.rank]
    with call.store.lock:
        keys = call.keys
        present = {r: json.loads(call.store.store.get(keys.arrived(r)))
                   for r in ranks if call.store.store.check([keys.arrived(r)])
                   and not call.store.store.check([keys.done(r)])}
    return [r for r, who in present.items() if process_alive(who["node"], int(who["pid"]))]


def _await_arrivals(call: Call) -> None:
    """Wait at most ``PATCHLOAD_ARRIVAL_WINDOW`` seconds for every member to arrive, or less:
    between node leaders (the hierarchy), the wait ends once each other node's leader that has
    not arrived is blocked in one of the user's ``torch.distributed`` collectives (its published
    state, :mod:`patchload.coordination.rank0`): it arrives only after this call (rank 0 first,
    the others in ``dist.barrier()``) and loads from the cache. At the first look that shows it,
    as soon as the leader has loaded, where it is blocked in a collective of the default group
    that this rank has not entered yet (a barrier cannot end before this rank enters it, after
    this call; one with a root it is not may: it then arrives late and reads from the cache);
    otherwise (another group, or one this rank has entered: it may be leaving it) once two
    looks 0.3 s apart show it blocked. Under ``PATCHLOAD_TRANSPORT=collective`` the
    full window (other ranks publish no state)."""
    store, topology, window = call.store, call.topology, call.config.arrival_window_s

    def wake() -> None:
        _set(call, call.keys.arrivals_all)

    if call.config.transport == "collective":
        store.wait_for(call.keys.arrivals_all, window, wake=wake)
        return
    mine = topology.node_of(topology.rank)
    leaders = [topology.node_ranks(n)[0] for n in range(topology.num_nodes) if n != mine]
    deadline = time.monotonic() + window
    blocked_since = None
    entered = world_collectives()

    def waits_for_me(state: dict[str, Any]) -> bool:
        return entered is not None and state.get("seq") is not None and state["seq"] > entered

    while True:
        # The first look at once: a rank 0 whose load the others wait for in a barrier goes on
        # at that look (the default group's) or _BLOCKED_SHOWN_S later (another group's).
        now = time.monotonic()
        with store.lock:
            missing = [r for r in leaders if not store.store.check([call.keys.arrived(r)])]
            states = [json.loads(store.store.get(f"ranks/{r}/state"))
                      if store.store.check([f"ranks/{r}/state"]) else None for r in missing]
        if not missing:
            return
        if all(state and state.get("blocked") for state in states):
            blocked_since = now if blocked_since is None else blocked_since
            if all(waits_for_me(state) for state in states) \
                    or now - blocked_since >= _BLOCKED_SHOWN_S:
                logger.debug("%s: ranks %s are blocked in a collective of the user's: not "
                             "waiting for them to arrive", call.prefix(), missing)
                return
        else:
            blocked_since = None
        if now >= deadline or store.wait_for(call.keys.arrivals_all,
                                             min(_BLOCKED_SHOWN_S, deadline - now), wake=wake):
            return


def _set(call: Call, key: str) -> None:
    """Set the store key ``key``, empty (ends a wait for it)."""
    with call.store.lock:
        call.store.store.set(key, "")


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
    from . import meta_of

    topology = call.topology
    expected = (topology.world_size if _state.config().transport == "collective"
                else topology.num_nodes) - 1
    members = [topology.rank] + _members(call, expected)
    payload = {"members": members, "metas": [meta_of(t).to_json() for t in tensors],
               "key": call.key}

    def send() -> None:
        from .collective import broadcast, private_group

        if len(members) == 1:
            return
        group = private_group(call.store.store, group_rank=0, group_size=len(members),
                              tag=call.key, timeout_s=call.config.group_timeout_s)
        try:
            broadcast(group, [t.detach() for t in tensors], src_group_rank=0, is_src=True,
                      bucket_bytes=_state.config().bucket_bytes)
        finally:
            group.close()
        logger.info("%s: broadcast %d tensors to ranks %s", call.prefix(), len(tensors),
                    json.dumps(members[1:]))

    return payload, send


def receive_collective(weights: dict[str, Any], arena: BlobArena | None = None
                       ) -> list[torch.Tensor] | None:
    """Follower: receive the leader's tensors, or None when this rank loads them plainly instead.

    Collective over the members the leader published. None when this rank is not a member, or
    when the broadcast failed (a member died or the connection broke; logged as a WARNING naming
    the ranks found gone): the caller then loads from the cache the leader filled. With an
    ``arena`` (a node leader that shares them in its node next), tensors are received straight
    into it, as far as it has room.
    """
    from . import TensorMeta, TransportError
    from .collective import broadcast, private_group

    topology = current_topology()
    members = weights["members"]
    if topology.rank not in members:
        logger.info("[rank %d] arrived after the leader's broadcast started: loading plainly",
                    topology.rank)
        return None
    metas = [TensorMeta.from_json(m) for m in weights["metas"]]
    store = job_store()
    try:
        group = private_group(store.store, group_rank=members.index(topology.rank),
                              group_size=len(members), tag=weights["key"],
                              timeout_s=_state.config().group_timeout_s)
        try:
            return broadcast(group, metas, src_group_rank=0, is_src=False,
                             bucket_bytes=_state.config().bucket_bytes,
                             allocate=None if arena is None else _into(arena))
        finally:
            group.close()
    except TransportError as err:
        gone = gone_ranks(store, weights["key"], members, topology)
        logger.warning("[rank %d/%d] receiving the weights from leader rank %d failed (%s; "
                       "members: ranks %s): %s; loading this rank's weights from the checkpoint",
                       topology.rank, topology.world_size, members[0],
                       ", ".join(f"rank {r} is gone" for r in gone) or "no member known to be "
                       "gone on this node", json.dumps(members), err)
        return None


def _into(arena: BlobArena) -> Callable[[TensorMeta], torch.Tensor | None]:
    from . import dtype_from_str

    return lambda meta: arena.take(meta.shape, dtype_from_str(meta.dtype))


def _node_share_follows() -> bool:
    """Whether a node leader's broadcast weights are then shared in its node
    (``PATCHLOAD_TRANSPORT=auto``: the node leaders' load of several nodes)."""
    return _state.config().transport != "collective"


class CollectiveWeights:
    """The ``"collective"`` :class:`~patchload.transport.base.WeightTransport`: the leader
    broadcasts to the ranks that arrived within the arrival window; the others load plainly."""

    name = "collective"
    scope = "job"
    verb = "received"
    collective = True

    def prepare(self, call: Call, model: torch.nn.Module, state: LoadState) -> None:
        """Leader: the leader sends from its own tensors. Those of a node leader that will
        then share them in its node (``PATCHLOAD_TRANSPORT=auto``, several nodes) are converted
        straight into that share's arena (:func:`patchload.transport.node_shm.prepare_arena`),
        left in ``state.arena``."""
        if _node_share_follows():
            from .node_shm import prepare_arena

            prepare_arena(model, state)

    def discard(self, model: torch.nn.Module, state: LoadState) -> None:
        """Leader: see :func:`patchload.transport.node_shm.discard_arena`."""
        from .node_shm import discard_arena

        discard_arena(model, state)

    def share(self, call: Call, model: torch.nn.Module, entries: list[list[Any]],
              tensors: list[torch.Tensor], state: LoadState
              ) -> tuple[dict[str, Any], Callable[[], None] | None]:
        """See :func:`share_collective` (the model's own tensors stay as loaded)."""
        return share_collective(call, tensors)

    def receive(self, call: Call, weights: dict[str, Any],
                state: LoadState) -> list[torch.Tensor] | None:
        """See :func:`receive_collective`; joins the broadcast once per call. A node leader
        that will share the tensors in its node (``PATCHLOAD_TRANSPORT=auto``, several nodes)
        receives them into an arena, left in ``state.arena`` for that share."""
        if not state.broadcast_joined:
            # One attempt per call: after a join that raised, the broadcast's rendezvous keys
            # are spent, and joining again (an abandon) would wait for members that left.
            state.broadcast_joined = True
            arena = None
            if _node_share_follows():
                from . import TensorMeta
                from .arena import BlobArena, capacity_for

                arena = state.arena = BlobArena(capacity_for(
                    TensorMeta.from_json(meta).nbytes for meta in weights["metas"]))
            state.joined = receive_collective(weights, arena)
        return state.joined

    def abandon(self, call: Call, weights: dict[str, Any], state: LoadState) -> None:
        """A member still takes part in the broadcast: the leader and the others wait for it."""
        self.receive(call, weights, state)

    def settle(self, call: Call, model: torch.nn.Module, weights: dict[str, Any],
               tensors: list[torch.Tensor | None]) -> None:
        """Nothing: received tensors are this rank's own memory."""
