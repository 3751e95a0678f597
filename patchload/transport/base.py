"""The transport Protocol: how a leader's loaded tensors reach the followers of one load call.

:mod:`patchload.weights` decides who leads and what is verified; a transport only moves the
tensors and owns what keeps them alive. One backend per module, each an object holding its own
state:

- :class:`patchload.transport.node_shm.ShmWeights` (``"shm"``): inside one node, one sealed
  memfd blob mapped copy-on-write by every rank (bytes: :mod:`patchload.transport.shm`).
- :class:`patchload.transport.job_collective.CollectiveWeights` (``"collective"``): a broadcast
  over a private gloo group to the ranks that arrived (bytes:
  :mod:`patchload.transport.collective`).

A new transport (CUDA IPC, say) is one package implementing :class:`WeightTransport` plus one
registry line (:mod:`patchload.transport.registry`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Protocol

if TYPE_CHECKING:
    import torch

    from patchload.coordination.load_state import LoadState
    from patchload.coordination.protocol import Call

__all__ = ["WeightTransport"]


class WeightTransport(Protocol):
    """What :mod:`patchload.weights` needs of a transport.

    Attributes:
        name: published with the weights (``weights["transport"]``); followers pick the backend
            by it.
        verb: how a follower got the bytes, for its INFO line (``"mapped"``, ``"received"``).
        collective: True when :meth:`receive` is collective over the members the leader chose:
            a member must call it (or :meth:`abandon`) even when it will not use the tensors,
            and before anything that may make it give up (verification).
        scope: ``"node"``: it moves bytes among the ranks of one node (its leader reads, or gets
            the weights from another node's leader by broadcast); ``"job"``: one leader for the
            whole job, every rank a receiver.
    """

    name: str
    verb: str
    collective: bool
    scope: str

    def prepare(self, call: Call, model: torch.nn.Module, state: LoadState) -> None:
        """Leader, before it reads the checkpoint into ``model`` (its skeleton, parameters on
        the meta device): set up, in ``state`` (the load's :class:`LoadState`), where the load
        may write its tensors so that :meth:`share` copies less."""
        ...

    def discard(self, model: torch.nn.Module, state: LoadState) -> None:
        """Leader that prepared and will not share (a reason not to, or :meth:`share` raised):
        give ``model`` back what a plain load gives it, and release what :meth:`prepare` set
        up."""
        ...

    def share(self, call: Call, model: torch.nn.Module, entries: list[list[Any]],
              tensors: list[torch.Tensor], state: LoadState
              ) -> tuple[dict[str, Any], Callable[[], None] | None]:
        """Leader, after its load: make ``tensors`` (the model's unique CPU tensors, in the
        order of ``entries``: ``[name, kind, index, requires_grad]``) available to the
        followers. May re-point the leader's own tensors at the shared bytes (equal values).
        ``tensors`` is handed over: the transport may empty the list (so that each private
        original can be freed as soon as its shared copy exists). ``state`` holds what
        :meth:`prepare` set up.

        Returns:
            A JSON-able payload published with the weights, and a step to run once they are
            published (the broadcast's send), or None.

        Raises:
            OSError, TransportError: the tensors cannot be shared; the leader keeps its model
                (its values unchanged) and publishes no weights: followers load their own.
        """
        ...

    def receive(self, call: Call, weights: dict[str, Any],
                state: LoadState) -> list[torch.Tensor] | None:
        """Follower: the leader's tensors, in order, with their shapes, dtypes and bytes; None
        (and a logged reason) when this rank must load them itself. ``state`` is the load's
        :class:`LoadState` (a collective receive runs once per call)."""
        ...

    def abandon(self, call: Call, weights: dict[str, Any], state: LoadState) -> None:
        """Follower giving up on the leader's result: whatever it still owes the others."""
        ...

    def settle(self, call: Call, model: torch.nn.Module, weights: dict[str, Any],
               tensors: list[torch.Tensor | None]) -> None:
        """Follower, once ``model`` holds ``tensors`` for good (the call returned); ``tensors``
        in the order of the leader's entries, None where the model holds a tensor of this
        rank's own instead (one it initialises itself, as a plain load does)."""
        ...
