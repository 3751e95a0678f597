"""The job -> node leaders -> local ranks hierarchy of a node-scoped model load
(:class:`NodeLeadersLoad`)."""

from __future__ import annotations

from typing import Any, Callable

from .. import _state
from .._logging import get_logger
from ..coordination.call import Hooks, Mode, coordinated, current_mode
from ..coordination.protocol import Call, node_leaders_call
from ..coordination.scope import download_scope
from .receive import abandon_weights, settle_weights
from .share import share_weights

__all__ = ["NodeLeadersLoad"]

logger = get_logger(__name__)


class NodeLeadersLoad:
    """What a node leader runs in place of the plain load (:attr:`Hooks.lead_with` of a
    node-scoped model load): the job -> node leaders -> local ranks hierarchy.

    With several nodes on one shared hub cache (download scope ``job``) and
    ``PATCHLOAD_TRANSPORT=auto``, the node leaders make the load among themselves, as a
    job-scoped coordinated call of its own (:func:`.coordination.protocol.node_leaders_call`):
    one of them reads the checkpoint and broadcasts it to the others, and each then shares it in
    its node. Otherwise the original call, reading this node's files.

    Either way the node's followers compare and initialise what the *reading* leader did: a
    node leader relays its headers, loading info, conversions and dtype plan into its node's
    :class:`~.coordination.load_state.LoadState` (:meth:`relay`), and hands over the arena the
    weights are in (:meth:`share`, :meth:`settle`), so that the node's share copies nothing.
    One instance per ``from_pretrained`` call; called at most once, on a node leader.
    """

    node_mode: Mode
    """The mode of the node's call, set when a node leader runs this."""

    def __init__(self, name: str, wrapped: Callable[..., Any], what: str) -> None:
        self.name, self.wrapped, self.what = name, wrapped, what

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        self.node_mode = node_mode = current_mode()
        node_call = node_mode.call
        topology = node_call.topology
        if (topology.num_nodes == 1 or _state.config().transport != "auto"
                or download_scope(_state.config(), topology, node_call.store) != "job"):
            return self.wrapped(*args, **kwargs)
        logger.info("%s: the nodes share one hub cache: one rank reads the checkpoint and "
                    "broadcasts it to the other nodes' leaders", node_call.prefix())
        return coordinated(self.name, self.wrapped, args, kwargs, Hooks(
            self.what, share=self.share, settle=self.settle, abandon=abandon_weights,
            call=node_leaders_call(node_call)))

    def relay(self, headers: dict[str, Any], **described: Any) -> None:
        """Put what the reading leader did (``headers``; ``loading_info``, ``conversions``,
        ``dtype_plan``) into the node's load state: its followers compare with it."""
        self.node_mode.load.headers.update(headers)
        self.node_mode.load.describe(**described)

    def share(self, result: Any, call: Call, mode: Mode
              ) -> tuple[dict[str, Any], Callable[[], None] | None]:
        """The node leader that read the checkpoint: share it with the other node leaders."""
        self.relay(mode.load.headers, loading_info=mode.load.loading_info,
                   conversions=mode.load.conversions, dtype_plan=mode.load.dtype_plan)
        try:
            return share_weights(result, call, mode)
        finally:
            # What the load converted into (its transport's prepare), sealed by the node's
            # share: the node's share copies none of it.
            if mode.load.arena is not None:
                self.node_mode.load.arena, mode.load.arena = mode.load.arena, None

    def settle(self, result: Any, mode: Mode) -> Any:
        """A node leader that received the weights from the reading one."""
        weights = mode.payload.get("weights") or {}
        self.relay(weights.get("headers", {}), loading_info=weights.get("loading_info"),
                   conversions=weights.get("conversions"), dtype_plan=weights.get("dtype_plan"))
        result = settle_weights(result, mode)
        arena, mode.load.arena = mode.load.arena, None
        joined, mode.load.joined = mode.load.joined, None
        if arena is not None and joined is not None:
            # Received into it (the model holds the tensors now, nothing else may): the
            # node's share copies nothing.
            self.node_mode.load.arena = arena
        elif arena is not None:  # the broadcast failed: this rank loaded plainly
            arena.close()
        return result
