"""A model load's state on one rank for one coordinated call, shared by the wrappers nested in it.

``from_pretrained`` of a model is one coordinated call (:mod:`.call`); inside it transformers
calls the functions that :mod:`patchload.patches.transformers.modeling`,
:mod:`patchload.patches.transformers.materialize` and :mod:`patchload.patches.diffusers` wrap
(with the steps of :mod:`patchload.weights`),
and the transport (:mod:`patchload.transport`) is handed the same object. Each of them finds
here what an earlier one decided or recorded for this call: a field per fact, so that a reader
can find every writer of one with grep. No I/O.

It sits in the coordination layer because :class:`patchload.coordination.call.Mode` holds it;
the types it holds of higher layers (a transport's arena) are named in comments only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["LoadState"]


@dataclass(kw_only=True)
class LoadState:
    """One model load on this rank (see the module docstring). Mutable; one per
    :class:`~patchload.coordination.call.Mode`, never shared between threads.

    Attributes:
        alongside: the call's first load maps its checkpoint files on followers
            (:mod:`patchload.transport.mapped_files`); None until that load decided it (an
            adapter's load inside the same call then keeps the decision).
        materialise_here: the mapped tensors a dtype conversion would copy are copied on this
            thread (:func:`patchload.patches.transformers.materialize.state_of_a_new_thread`),
            as a plain load's are.
        arena: leader: a transport's ``BlobArena`` (:mod:`patchload.transport.arena`) the load
            converts into, set by the transport's ``prepare`` and taken by its ``share`` (or
            closed by ``discard``); a job-collective follower: the arena it received into,
            handed to its node's share. None when there is none.
        broadcast_joined: collective followers: the transport's ``receive`` joined the call's
            broadcast (once per call: its rendezvous keys are spent after one join).
        joined: what that join gave this rank: the leader's tensors, or None (the broadcast
            failed); a node leader's settle hands them on and clears it (never a second join:
            ``broadcast_joined`` stays set).
        headers: leader: ``{file base name: {tensor key: [dtype, shape]}}`` of each checkpoint
            file it read (published with the weights; followers answer ``load_state_dict``
            from it).
        layout_known: ``layout`` is set (a follower reads its leader's announcement once).
        layout: the checkpoint layout the node leader announced with its files
            (:func:`patchload.transport.mapped_files.describe`), or None (none, or job scope).
        described: ``loading_info``, ``conversions`` and ``dtype_plan`` are set: the call's
            first load finished on the leader, or a node leader got them from the reading
            leader (:class:`patchload.weights.hierarchy.NodeLeadersLoad`).
        loading_info: transformers' loading info of the leader's load (missing, unexpected,
            mismatched keys), as :func:`patchload._compat.describe_loading_info` gives it.
        conversions: the indices of the key conversions the leader's load applied
            (transformers 5), or None.
        dtype_plan: which modules the leader's load keeps in float32, as
            :func:`patchload._compat.dtype_plan` gives it.
        files_announced: leader: it announced its files (:func:`.protocol.files_ready`), once
            per call.
        weights_received: follower: it took the leader's weights in this call (an adapter's load
            after it loads its own).
        received: follower: ``(entries, tensors, skip)`` it assembled the model from, until the
            call returned and its tensors were re-pointed (then None).
        received_bytes: follower: bytes of weights it got from the leader (or mapped), for its
            INFO line; None: none.
        received_how: how it got them (the transport's verb, or "mapped from the checkpoint
            files").
        answered: diffusers: the state dict a follower's ``load_state_dict`` answered with
            meta-device tensors, which its load must not take as weights.
    """

    alongside: bool | None = None
    materialise_here: bool = False
    arena: Any = None
    broadcast_joined: bool = False
    joined: list[Any] | None = None
    headers: dict[str, dict[str, list[Any]]] = field(default_factory=dict)
    layout_known: bool = False
    layout: dict[str, Any] | None = None
    described: bool = False
    loading_info: dict[str, Any] | None = None
    conversions: list[int] | None = None
    dtype_plan: Any = None
    files_announced: bool = False
    weights_received: bool = False
    received: tuple[Any, Any, Any] | None = None
    received_bytes: int | None = None
    received_how: str | None = None
    answered: Any = None

    def describe(self, *, loading_info: dict[str, Any] | None, conversions: list[int] | None,
                 dtype_plan: Any) -> None:
        """Set what followers compare and initialise as the reading leader did (its loading
        info, key conversions and float32 modules): the leader's own, or a node leader's copy
        of the reading leader's (from its state, or from its published weights)."""
        self.loading_info, self.conversions, self.dtype_plan = (loading_info, conversions,
                                                                dtype_plan)
        self.described = True
