"""Follower: the leader's weights instead of the checkpoint.

A follower runs the same original call from the cache, so the library itself builds the
configuration, dtypes, the meta-device skeleton, tying and ``eval()``; only the step that reads
checkpoint files is replaced by :func:`receive` (verify, assemble the leader's tensors through the
transport it published). At the end :func:`settle_weights` re-points every follower parameter
and buffer at the leader's bytes, so the model equals a plain load bitwise.
:func:`checkpoint_header` answers a checkpoint's header read from the leader's record.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Callable, Iterator

from .._compat import initialize_as_before_loading, initialized_by_follower
from ..coordination.call import Mode, VerificationFailed, verify_so_far
from ..transport.registry import transports
from ..transport.tensors import Owners, named_tensors
from .share import model_of

if TYPE_CHECKING:
    import torch

__all__ = ["abandon_weights", "announced_layout", "checkpoint_header", "receive",
           "settle_weights"]


def _places(model: Any, entries: list[list[Any]], skip: set[str]
            ) -> Iterator[tuple[Any, str, str, int, bool]]:
    """``(module, attribute, kind, index, requires_grad)`` of each of the leader's entries in
    ``model`` but those in ``skip``, each module looked up when its entry is reached."""
    owner = Owners(model)
    for name, kind, index, requires_grad in entries:
        if name in skip:
            continue
        module, attribute = owner(name)
        yield module, attribute, kind, index, requires_grad


def _assemble(model: Any, entries: list[list[Any]], tensors: list[torch.Tensor],
              skip: set[str]) -> None:
    """Follower: put the leader's tensors into ``model`` under every name, ties included, but
    those in ``skip`` (keys the follower initialises itself, as a plain load does)."""
    import torch

    params: dict[int, torch.nn.Parameter] = {}
    for module, attribute, kind, index, requires_grad in _places(model, entries, skip):
        if kind == "param":
            if index not in params:
                # As the leader made it: an inference tensor's only inside inference_mode().
                with torch.inference_mode(tensors[index].is_inference()):
                    params[index] = torch.nn.Parameter(tensors[index],
                                                       requires_grad=requires_grad)
                params[index]._is_hf_initialized = True
            module._parameters[attribute] = params[index]
        else:
            # Marked like a loaded tensor: else transformers' _init_weights (run on what is not
            # marked) overwrites a received persistent buffer in place with its init value.
            tensors[index]._is_hf_initialized = True
            module._buffers[attribute] = tensors[index]


def _non_persistent(model: Any, entries: list[list[Any]]) -> set[str]:
    """The leader's buffers that are non-persistent in ``model``: no checkpoint holds them, and
    a plain load computes each rank's own (from the config, or drawn from the rank's own random
    stream by the model's ``_init_weights``), so a follower keeps what its own call computes."""
    owner = Owners(model)
    names = set()
    for name, kind, _, _ in entries:
        if kind == "buffer":
            module, attribute = owner(name)
            if attribute in getattr(module, "_non_persistent_buffers_set", ()):
                names.add(name)
    return names


def _check_structure(model: Any, entries: list[list[Any]], metas: list[Any],
                     skip: set[str]) -> None:
    """Follower: the leader's tensors must fit this rank's model name by name and shape.

    Not by dtype: the skeleton's is not yet the loaded one (transformers casts ``keep_in_fp32``
    modules while loading); dtypes follow from the call's arguments, which are part of its key,
    from the config, whose file the follower verified, and from the model's float32 modules,
    which :func:`receive` compares.

    Raises:
        VerificationFailed: a name or shape differs.
    """
    mine = dict(named_tensors(model))
    theirs = {e[0] for e in entries}
    if set(mine) != theirs:
        extra = sorted(set(mine) ^ theirs)[:3]
        raise VerificationFailed(f"the leader's model has other tensors than this rank's "
                                 f"{type(model).__name__} (first differing names: {extra})")
    for name, _, index, _ in entries:
        meta, tensor = metas[index], mine[name]
        if name not in skip and tuple(meta.shape) != tuple(tensor.shape):
            raise VerificationFailed(f"{name}: shape {tuple(meta.shape)} on the leader, "
                                     f"{tuple(tensor.shape)} on this rank")


def receive(mode: Mode, model: Any, plan: Any = None) -> bool:
    """Follower, in place of the checkpoint-reading step: put the leader's tensors (through the
    transport the leader published) into ``model``, whose parameters may be on the meta device,
    but those the leader initialised rather than read (missing keys): transformers initialises
    them on this rank afterwards, as in a plain load. ``plan``: this rank's
    :func:`patchload._compat.dtype_plan` (None where the library has none), which must be the
    leader's.

    Returns False (and changes nothing) when there are no weights to receive or they cannot be
    had (a leader that is gone, not a broadcast member, an attach that fails; logged as a
    warning): the caller then reads the checkpoint itself.

    Raises:
        VerificationFailed: this rank's call resolved other files than the leader's, its
            model's tensors differ from the leader's in name or shape, or it keeps other
            modules in float32.
    """
    weights = mode.payload.get("weights")
    if not weights or mode.load.weights_received:
        return False
    from ..transport import meta_of

    transport = transports().get(weights["transport"])
    if transport is None:
        raise VerificationFailed(f"the leader shared its weights through the transport "
                                 f"{weights['transport']!r}, which this rank does not have")
    entries = weights["entries"]
    tensors = None
    if transport.collective:  # a member joins before anything else: the others wait for it
        tensors = _received(transport, mode, weights)
    verify_so_far(mode)
    if weights.get("dtype_plan") != plan:
        raise VerificationFailed(f"this rank's {type(model).__name__} keeps other modules in "
                                 f"float32 ({plan}) than the leader's "
                                 f"({weights.get('dtype_plan')})")
    skip = initialized_by_follower(weights.get("loading_info") or {})
    if skip is None:  # this transformers line initialises them inside the replaced step
        return False
    skip |= _non_persistent(model, entries)
    if not transport.collective:
        tensors = _received(transport, mode, weights)
    if tensors is None:  # not a member, a broken broadcast, a failed attach: load plainly
        return False
    _check_structure(model, entries, [meta_of(t) for t in tensors], skip)
    initialize_as_before_loading(model)  # nothing fails after it: no plain load draws twice
    _assemble(model, entries, tensors, skip)
    mode.load.weights_received = True
    mode.load.received = (entries, tensors, skip)
    taken = {index for name, _, index, _ in entries if name not in skip}
    mode.load.received_bytes = sum(tensors[i].numel() * tensors[i].element_size()
                                   for i in taken)
    mode.load.received_how = transport.verb
    return True


def _received(transport: Any, mode: Mode, weights: dict[str, Any]) -> list[torch.Tensor] | None:
    """The transport's tensors, each an inference tensor exactly where the leader's is (a
    plain load inside ``torch.inference_mode()`` makes some, on the thread that loads them)."""
    import torch

    with torch.inference_mode(False):
        tensors = transport.receive(mode.call, weights, mode.load)
    if tensors is None:
        return None
    for index in weights.get("inference", ()):
        t = tensors[index]
        with torch.inference_mode():  # the same bytes and storage, no copy
            tensors[index] = torch.empty(0, dtype=t.dtype).set_(
                t.untyped_storage(), t.storage_offset(), t.shape, t.stride())
    return tensors


def abandon_weights(mode: Mode) -> None:
    """Follower giving up on the leader's result: its transport may still need it (a broadcast
    member: the leader and the other members wait for every member)."""
    weights = (mode.payload.get("weights") or {}) if mode.leader is not None else {}
    transport = transports().get(weights["transport"]) if weights.get("transport") else None
    if transport is not None:
        transport.abandon(mode.call, weights, mode.load)


def settle_weights(result: Any, mode: Mode) -> Any:
    """Follower, after the original call returned: re-point every tensor at the leader's bytes
    (transformers re-creates non-persistent buffers after loading; their values must match),
    but those this rank initialised itself, and give each transformers' "loaded" mark as the
    leader's has it."""
    model = model_of(result)
    if model is not None and mode.load.received is not None:
        entries, tensors, skip = mode.load.received
        weights = mode.payload["weights"]
        marked = weights.get("marked", {})
        for module, attribute, kind, index, _ in _places(model, entries, skip):
            if kind == "buffer":
                module._buffers[attribute] = tensor = tensors[index]
            else:
                tensor = module._parameters[attribute]
                if tensor.data.data_ptr() != tensors[index].data_ptr():
                    tensor.data = tensors[index]
            if str(index) in marked:
                tensor._is_hf_initialized = marked[str(index)]
            elif hasattr(tensor, "_is_hf_initialized"):
                del tensor._is_hf_initialized
        held = {index for name, _, index, _ in entries if name not in skip}
        transports().get(weights["transport"]).settle(
            mode.call, model, weights, [t if i in held else None for i, t in enumerate(tensors)])
        # The model holds them now; no other reference may pin a mapping (see mapped_models).
        mode.load.received = None
    return result


def checkpoint_header(mode: Mode, checkpoint_file: Any,
                      read: Callable[[], dict[str, Any]]) -> tuple[dict[str, Any], bool]:
    """Read a checkpoint's state dict inside a model load, or answer it from the leader's record.

    The leader calls ``read()`` and records each tensor's dtype and shape under the file's base
    name (published with its weights). A follower whose leader recorded that file gets meta-device
    tensors of the same names, dtypes and shapes, without opening the file.

    Returns:
        ``(state_dict, answered)``: ``answered`` is True when the tensors are the meta-device
        answer (a follower must not load them as weights).
    """
    name = os.path.basename(str(checkpoint_file))
    if mode.lead:
        state = read()
        mode.load.headers[name] = {
            key: [str(t.dtype).removeprefix("torch."), list(t.shape)] for key, t in state.items()}
        return state, False
    header = _described_header(mode, checkpoint_file)
    if header is None:
        header = (mode.payload.get("weights") or {}).get("headers", {}).get(name)
    if header is None:
        return read(), False
    import torch

    from ..transport import dtype_from_str

    return {key: torch.empty(shape, dtype=dtype_from_str(dtype), device="meta")
            for key, (dtype, shape) in header.items()}, True


def _described_header(mode: Mode, checkpoint_file: Any) -> dict[str, Any] | None:
    """Follower: a checkpoint file's ``{key: [dtype, shape]}`` from the layout its leader
    announced with its files (:mod:`patchload.transport.mapped_files`), or None: known before the
    leader's outcome."""
    layout = announced_layout(mode)
    real = os.path.realpath(str(checkpoint_file))
    for file in (layout or {}).get("files", ()):
        if file["path"] == real:
            return {key: [dtype, shape] for key, dtype, shape, _, _ in file["tensors"]}
    return None


def announced_layout(mode: Mode) -> dict[str, Any] | None:
    """Follower: the checkpoint layout its node leader announced (read once per call)."""
    if not mode.load.layout_known:
        announced = mode.announcement() if mode.call.scope == "node" else None
        mode.load.layout = (announced or {}).get("layout")
        mode.load.layout_known = True
    return mode.load.layout
