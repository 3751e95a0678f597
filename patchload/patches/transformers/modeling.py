"""transformers' model loads: ``PreTrainedModel.from_pretrained`` (and the Auto model classes) and
the steps of it that read checkpoint files.

``from_pretrained`` gets the load-once wrapper of :mod:`patchload.weights.load` (which
:mod:`patchload.patches.diffusers` gives diffusers' ``ModelMixin`` too). The leader runs the
original call, then shares every parameter and buffer (persistent or not) through a transport
(:mod:`patchload.weights.share`). Followers run the same original call from the cache, so
configuration, dtype resolution, the meta-device skeleton, tying, ``eval()``, generation config
and ``hf_device_map`` all come from transformers itself; only ``_load_pretrained_model`` (the step
that reads checkpoint files) is replaced by assembling the leader's tensors
(:mod:`patchload.weights.receive`). Followers start at once: each hub call of theirs waits only
for the leader's same call (its pin), so they build their config and skeleton while it downloads
and loads, and wait for its tensors only there; the leader announces when its checkpoint files
are resolved, with their layout (``_get_dtype``). At the end every follower parameter and buffer
is re-pointed at the leader's bytes, so the model equals a plain load bitwise. Building
``DistributedDataParallel`` or an optimizer over such weights first copies them out of the shared
memory (:mod:`patchload.weights.writes`).

Steps aside where a broadcast is unsafe or pointless: see :mod:`patchload.weights.policy`.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable

from ..._compat import describe_loading_info, dtype_plan, loaded_from_leader
from ..._patching import Patch
from ...coordination.call import Mode, VerificationFailed, current_mode
from ...coordination.protocol import files_ready
from ...transport.mapped_files import describe, mapped_state_dict, maps_as_plain
from ...transport.registry import transports
from ...weights.load import from_pretrained
from ...weights.policy import transport_of
from ...weights.receive import announced_layout, checkpoint_header, receive
from ...weights.writes import write_patches
from .materialize import state_of_a_new_thread

__all__ = ["load_patches"]


def _load_state_dict(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> Any:
    """``transformers.modeling_utils.load_state_dict`` with ``map_location="meta"``: how
    ``dtype="auto"`` reads a checkpoint's header. The leader records what it saw; a follower is
    answered from that record, so it opens no checkpoint file at all."""
    mode = current_mode()
    location = kwargs.get("map_location", args[1] if len(args) > 1 else None)
    if mode is None or not mode.loads_model or str(location) != "meta":
        return wrapped(*args, **kwargs)
    checkpoint_file = args[0] if args else kwargs.get("checkpoint_file")
    return checkpoint_header(mode, checkpoint_file, lambda: wrapped(*args, **kwargs))[0]


def _load_pretrained_model(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...],
                           kwargs: dict[str, Any]) -> Any:
    mode = current_mode()
    if mode is None or not mode.loads_model:
        return wrapped(*args, **kwargs)
    bound = _arguments(wrapped, args, kwargs)
    model, state_dict, files, load_config = (bound.get(name) for name in
                                             ("model", "state_dict", "checkpoint_files",
                                              "load_config"))
    # transformers 5: the key conversions this load may apply
    mapping = getattr(load_config, "weight_mapping", None)
    if mode.lead:
        # if _files_resolved did not already (no _get_dtype there)
        _announce_files(mode, files)
        first = not mode.load.described  # not an adapter's load inside the same call
        if first:  # followers decide the same from the same arguments and layout
            mode.load.alongside = maps_as_plain(state_dict, files, load_config, mode.load.layout)
            mode.load.materialise_here = mode.load.alongside and state_of_a_new_thread()
        if model is not None and first and not mode.load.alongside:  # nothing to share
            transport_of(mode.call).prepare(mode.call, model, mode.load)
        result = wrapped(*args, **kwargs)
        if first:
            mode.load.describe(loading_info=describe_loading_info(result),
                               conversions=_used_conversions(model, mapping),
                               dtype_plan=dtype_plan(bound))
        return result
    if mode.load.alongside is None:  # the call's first load, not an adapter's after it
        mode.load.alongside = False
        if maps_as_plain(state_dict, files, load_config, announced_layout(mode)):
            state = mapped_state_dict(announced_layout(mode), files)
            if state is not None:
                mode.load.alongside = True
                mode.load.materialise_here = state_of_a_new_thread()
                return _load_alongside(wrapped, mode, args, kwargs, state)
    if not receive(mode, model, dtype_plan(bound)):
        return wrapped(*args, **kwargs)
    weights = mode.payload["weights"]
    _conversions_as_leader(model, mapping, weights.get("conversions"))
    return loaded_from_leader(model, weights["loading_info"])


def _arguments(function: Callable[..., Any], args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> dict[str, Any]:
    """The arguments of a call of ``function`` by parameter name (empty where they do not bind):
    by name, as positions differ between transformers lines (4.x's ``_get_dtype`` takes
    ``cls`` first)."""
    try:
        return dict(inspect.signature(function).bind_partial(*args, **kwargs).arguments)
    except (TypeError, ValueError):
        return {}


def _load_alongside(wrapped: Callable[..., Any], mode: Mode, args: tuple[Any, ...],
                    kwargs: dict[str, Any], state: dict[str, Any]) -> Any:
    """Follower of a zero-copy load: transformers' own step, reading ``state`` (the checkpoint
    files mapped, :func:`patchload.transport.mapped_files.mapped_state_dict`) where it would open
    them, while the leader loads. Each hub call the rest of the call makes (a generation config,
    which the leader fetches after its weights) waits for the leader's same call to return
    (:func:`patchload.coordination.call._nested`); the leader's outcome is waited for at the
    end of the call."""
    if len(args) > 1:
        args = (args[0], state, *args[2:])
    else:
        kwargs = {**kwargs, "state_dict": state}
    result = wrapped(*args, **kwargs)
    mode.load.received_bytes = sum(tensor.nbytes for tensor in state.values())
    mode.load.received_how = "mapped from the checkpoint files"
    return result


def _used_conversions(model: Any, mapping: list[Any] | None) -> list[int] | None:
    """Leader: which of the load's key conversions it applied (by index), as transformers 5
    keeps them on the model (``_weight_conversions``) for ``save_pretrained`` to reverse."""
    used = getattr(model, "_weight_conversions", None)
    if mapping is None or used is None:
        return None
    ids = {id(conversion) for conversion in used}
    return [index for index, conversion in enumerate(mapping) if id(conversion) in ids]


def _conversions_as_leader(model: Any, mapping: list[Any] | None,
                           used: list[int] | None) -> None:
    """Follower: keep on ``model`` the key conversions the leader's load applied (this rank's
    own, equal, conversion objects), as its plain load would, so that ``save_pretrained``
    writes the checkpoint's names.

    Raises:
        VerificationFailed: this rank's load has fewer conversions than the leader's used.
    """
    if used is None or mapping is None:
        return
    if any(index >= len(mapping) for index in used):
        raise VerificationFailed(f"the leader applied key conversions {used}, this rank's load "
                                 f"has {len(mapping)}")
    chosen = [mapping[index] for index in used]
    for conversion in chosen:
        if hasattr(conversion, "_was_used"):  # what matching a checkpoint key sets
            conversion._was_used = True
    model._weight_conversions = chosen


def _files_resolved(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Any:
    """``transformers.modeling_utils._get_dtype``, which ``from_pretrained`` calls once the
    config and every checkpoint file are resolved: a leader announces its files here, with their
    layout (what followers resolve after this, the generation config, they resolve once the
    leader's same hub call returned)."""
    mode = current_mode()
    if mode is not None and mode.lead and mode.loads_model:
        _announce_files(mode, _arguments(wrapped, args, kwargs).get("checkpoint_files"))
    return wrapped(*args, **kwargs)


def _announce_files(mode: Mode, checkpoint_files: list[str] | None) -> None:
    """Leader: :func:`files_ready`, once per call, with the fingerprints of the call's local
    paths and the layout of its checkpoint files where its followers share its node
    (:mod:`patchload.transport.mapped_files`)."""
    if not mode.load.files_announced:
        layout = describe(checkpoint_files) if mode.call.scope == "node" else None
        mode.load.layout, mode.load.layout_known = layout, True
        files_ready(mode.call, {"layout": layout, "local": mode.local})
        mode.load.files_announced = True


def _offline_on_followers(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...],
                          kwargs: dict[str, Any]) -> Any:
    """``is_offline_mode`` as ``transformers.modeling_utils`` sees it: True inside a follower's
    call, so that no background request starts there (the safetensors auto-conversion thread of
    a ``.bin`` checkpoint); the leader's answer otherwise."""
    mode = current_mode()
    if mode is not None and not mode.lead:
        return True
    return wrapped(*args, **kwargs)


def _auto_classes(module: Any) -> list[str]:
    # transformers copies from_pretrained into every Auto class (auto_class_update): wrap each.
    from transformers.models.auto.auto_factory import _BaseAutoModelClass

    return [f"{name}.from_pretrained" for name, obj in sorted(vars(module).items())
            if isinstance(obj, type) and issubclass(obj, _BaseAutoModelClass)
            and "from_pretrained" in vars(obj)]


def load_patches() -> list[Patch]:
    """The patches for model loading: ``from_pretrained`` and the checkpoint-reading step, and
    the calls announcing that loaded weights will be written."""
    return write_patches(transports().get("shm").mapped) + [
        Patch("transformers.modeling_utils", "PreTrainedModel.from_pretrained", from_pretrained),
        Patch("transformers.models.auto.modeling_auto", "", from_pretrained,
              expand=_auto_classes),
        Patch("transformers.modeling_utils", "PreTrainedModel._load_pretrained_model",
              _load_pretrained_model),
        Patch("transformers.modeling_utils", "load_state_dict", _load_state_dict),
        Patch("transformers.modeling_utils", "_get_dtype", _files_resolved),
        Patch("transformers.modeling_utils", "is_offline_mode", _offline_on_followers),
    ]
