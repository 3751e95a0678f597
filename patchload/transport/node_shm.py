"""The ``"shm"`` transport: one sealed memfd blob per load, mapped copy-on-write by the node.

The node leader's tensors end in one blob (:func:`patchload.transport.shm.share`): a converting
load writes them there as it converts (:meth:`ShmWeights.prepare` makes the arena,
:mod:`patchload.patches.transformers.materialize` fills it), and so does a node leader receiving a
broadcast from another node; any other tensor is copied in, each of the leader's tensors re-pointed
at the blob as soon as it is there (so it never holds two copies). The leader keeps the blob's fd
open for its followers (:class:`patchload.transport.shares.OpenShares`).
Followers map it (:func:`patchload.transport.shm.attach`). Every model mapping a blob is tracked
(:class:`patchload.transport.mapped_models.MappedModels`) so that its weights leave the shared
copy before they are written.
"""

from __future__ import annotations

import ctypes
from typing import TYPE_CHECKING, Any, Callable, Final

from .._logging import get_logger
from . import TransportError
from .mapped_models import MappedModels
from .shares import OpenShares
from .tensors import Repoint, entries_of

if TYPE_CHECKING:
    import torch

    from ..coordination.load_state import LoadState
    from ..coordination.protocol import Call

__all__ = ["ShmWeights"]

logger = get_logger(__name__)

_TRIM_EVERY_BYTES: Final = 16 * 2**20


class ShmWeights:
    """The ``"shm"`` :class:`~patchload.transport.base.WeightTransport` (see the module
    docstring). Holds this process's open blobs and mapped models."""

    name = "shm"
    scope = "node"
    verb = "mapped"
    collective = False

    def __init__(self) -> None:
        self.shares = OpenShares()
        self.mapped = MappedModels()

    def close(self) -> None:
        """End the install's shares (each blob closed once the followers that arrived took it,
        at most ``PATCHLOAD_EXIT_WAIT`` seconds in all) and stop the mapped-model watcher."""
        self.shares.release_at_exit()
        self.mapped.stop_at_exit()

    def prepare(self, call: Call, model: torch.nn.Module, state: LoadState) -> None:
        """Leader: see :func:`prepare_arena`."""
        prepare_arena(model, state)

    def discard(self, model: torch.nn.Module, state: LoadState) -> None:
        """Leader: see :func:`discard_arena`."""
        discard_arena(model, state)

    def share(self, call: Call, model: torch.nn.Module, entries: list[list[Any]],
              tensors: list[torch.Tensor], state: LoadState
              ) -> tuple[dict[str, Any], Callable[[], None] | None]:
        """Leader: write ``tensors`` into one blob (the arena of :meth:`prepare`, where the
        converted ones already are), re-pointing the model's tensors at it one at a time.
        ``tensors`` is emptied first: from then on this holds the only extra reference to each
        private original, freed as soon as its copy is in the blob (peak: the model plus about
        one tensor)."""
        from . import shm

        self.shares.make_room()
        shared_bytes = sum(t.numel() * t.element_size() for t in tensors)
        pending = [t.detach() for t in tensors]
        tensors.clear()
        repoint = Repoint(model, entries)
        untrimmed_bytes = 0  # freed since the last trim
        freed_any = False

        def on_shared(index: int, replacement: torch.Tensor) -> None:
            nonlocal untrimmed_bytes, freed_any
            if replacement is pending[index]:  # shared in place (a file mapping): nothing freed
                return
            repoint(index, replacement)
            pending[index] = replacement  # the private original is freed here, one at a time
            freed_any = True
            untrimmed_bytes += replacement.numel() * replacement.element_size()
            if untrimmed_bytes >= _TRIM_EVERY_BYTES:  # hand freed heap back as we go: lower peak
                _trim_heap()
                untrimmed_bytes = 0

        # The arena stays in the state until the share succeeded: discard() needs it otherwise.
        descriptor, _ = shm.share(pending, on_shared=on_shared, arena=state.arena)
        state.arena = None
        if freed_any:
            _trim_heap()
        if descriptor.get("fd") is not None:  # followers open the blob through this process
            storages = _blob_storages(descriptor, pending)
            self.shares.add(call, descriptor, storages)
            self.mapped.add(model, storages, f"{call.prefix()} {call.what}")
            del storages
        logger.info("%s: shared %d tensors (%d bytes) with this node's ranks (%d bytes copied "
                    "into shared memory)", call.prefix(), len(entries), shared_bytes,
                    descriptor["copied_bytes"])
        return {"descriptor": descriptor}, None

    def receive(self, call: Call, weights: dict[str, Any],
                state: LoadState) -> list[torch.Tensor] | None:
        """Follower: map the leader's blob (None, with a warning, when it cannot be)."""
        from . import shm

        try:
            return shm.attach(weights["descriptor"])
        except TransportError as err:
            logger.warning("%s: cannot map the leader's shared weights (%s): loading this rank's "
                           "weights from the checkpoint", call.prefix(), err)
            return None

    def abandon(self, call: Call, weights: dict[str, Any], state: LoadState) -> None:
        """Nothing: the leader never waits for a follower's mapping."""

    def settle(self, call: Call, model: torch.nn.Module, weights: dict[str, Any],
               tensors: list[torch.Tensor | None]) -> None:
        """Track the model while it maps the blob (its weights leave it before being written)."""
        storages = _blob_storages(weights["descriptor"], tensors)
        if storages:
            self.mapped.add(model, storages, f"{call.prefix()} {call.what}")


def prepare_arena(model: torch.nn.Module, state: LoadState) -> None:
    """Leader: ``state.arena``, an arena the size of ``model``'s tensors (their skeleton
    dtypes), which a converting load writes into
    (:mod:`patchload.patches.transformers.materialize`): sharing then copies nothing. The memfd is
    made on the first conversion; a load that converts nothing makes none."""
    from .arena import BlobArena, capacity_for

    state.arena = BlobArena(capacity_for(t.numel() * t.element_size()
                                         for t in entries_of(model)[1]))


def discard_arena(model: torch.nn.Module, state: LoadState) -> None:
    """Leader: move ``model``'s tensors out of ``state.arena`` into private memory (a
    writable shared mapping would be shared with a forked child, where a plain load's memory is
    copy-on-write), then close it."""
    arena, state.arena = state.arena, None
    if arena is None or arena.base is None:  # never opened: nothing was converted into it
        return
    entries, unique = entries_of(model)
    repoint = Repoint(model, entries)
    for index, tensor in enumerate(unique):
        if arena.owns(tensor):
            repoint(index, tensor.detach().clone())
    del unique
    arena.close()


def _blob_storages(descriptor: dict[str, Any], tensors: list[torch.Tensor | None]
                   ) -> list[torch.UntypedStorage]:
    """The storages of those of ``tensors`` (in the order of the descriptor's entries; None
    where this rank holds its own) that view this rank's mapping of the blob: it lives while
    any of them does."""
    return [tensor.untyped_storage() for entry, tensor in zip(descriptor["tensors"], tensors)
            if entry["kind"] == "blob" and tensor is not None]


def _trim_heap() -> None:
    """Give freed heap pages back to the OS (glibc keeps freed tensor memory otherwise, and the
    leader would hold its private copy and the blob at once)."""
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: nothing to trim
        pass
