"""Load once: followers get the leader's weights instead of reading the checkpoint.

Wraps ``PreTrainedModel.from_pretrained`` (and the Auto model classes);
:mod:`patchload.patches.diffusers` reuses the same wrapper and steps for diffusers' ``ModelMixin``.
The leader runs the original call, then shares every parameter and buffer (persistent or not)
through a transport (the Protocol of :mod:`patchload.transport.base`: shared memory inside a node,
a broadcast across nodes) and publishes where they are. Followers run the same original call from
the cache, so configuration, dtype resolution, the meta-device skeleton, tying, ``eval()``,
generation config and ``hf_device_map`` all come from transformers itself; only
``_load_pretrained_model`` (the step that reads checkpoint files) is replaced by assembling the
leader's tensors. Followers start at once: each hub call of theirs waits only for the leader's same
call (its pin), so they build their config and skeleton while it downloads and loads, and wait for
its tensors only there; the leader announces when its checkpoint files are resolved, with their
layout. At the end every follower parameter and buffer is re-pointed at the leader's bytes, so the
model equals a plain load bitwise. Building ``DistributedDataParallel`` or an optimizer over such
weights first copies them out of the shared memory (:mod:`patchload.weights.writes`).

Steps aside (downloads still coordinated, weights loaded plainly, one INFO line says why) where a
broadcast is unsafe or pointless: ``PATCHLOAD_BROADCAST=0``, DeepSpeed ZeRO-3, a ``device_map``
other than the CPU, quantized loads, tensor parallelism, GGUF files, a user ``state_dict``.
"""

from __future__ import annotations

import contextvars
import inspect
import os
from typing import TYPE_CHECKING, Any, Callable, Final

from . import _state
from ._compat import (describe_loading_info, dtype_plan, initialized_by_follower,
                      loaded_from_leader, warm_conversions)
from ._errors import ConfigError
from ._logging import get_logger
from ._patching import Patch
from .coordination.call import (Hooks, Mode, VerificationFailed, coordinated, current_mode,
                                verify_so_far)
from .coordination.protocol import Call, files_ready, node_leaders_call
from .coordination.scope import download_scope
from .patches.transformers.materialize import state_of_a_new_thread
from .transport.mapped_files import describe, mapped_state_dict, maps_as_plain
from .transport.registry import transports
from .transport.tensors import Owners, entries_of, named_tensors
from .weights.writes import write_patches

if TYPE_CHECKING:
    import torch

__all__ = ["load_patches", "from_pretrained", "receive", "checkpoint_header"]

logger = get_logger(__name__)

# from_pretrained keyword arguments under which patchload does not share weights.
_UNSAFE_KWARGS: Final = ("quantization_config", "gguf_file", "tp_plan", "tp_size",
                         "distributed_config", "device_mesh", "state_dict", "load_in_8bit",
                         "load_in_4bit", "offload_folder", "key_mapping",
                         # diffusers
                         "parallel_config", "use_flashpack", "dduf_entries")
# Those under which building the model runs collectives on every rank: the call cannot run on a
# leader first (its collectives would wait for followers that wait for it).
_COLLECTIVE_KWARGS: Final = ("tp_plan", "tp_size", "distributed_config", "device_mesh")
_CPU_MAPS: Final = (None, "cpu", {"": "cpu"})

# True inside a from_pretrained that runs on every rank at once (collective construction).
_ALONE: contextvars.ContextVar[bool] = contextvars.ContextVar("patchload_alone", default=False)


def _step_aside_reason(kwargs: dict[str, Any]) -> tuple[str | None, bool]:
    """Why weights are not shared for this call (None: they are), and whether building the
    model runs collectives (then every rank runs the call at once; only its downloads are
    coordinated, one hub call at a time)."""
    try:
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
    except ImportError:  # transformers moved it: ZeRO-3 cannot be on
        is_deepspeed_zero3_enabled = None
    if is_deepspeed_zero3_enabled is not None and is_deepspeed_zero3_enabled():
        return "DeepSpeed ZeRO-3 is enabled (model construction runs collectives)", True
    for name in _COLLECTIVE_KWARGS:
        if kwargs.get(name) is not None:
            return f"{name} is set (model construction runs collectives)", True
    if not _state.config().broadcast:
        return "PATCHLOAD_BROADCAST=0", False
    for name in _UNSAFE_KWARGS:
        value = kwargs.get(name)
        if value is not None and value is not False:  # diffusers passes use_flashpack=False
            return f"{name} is set", False
    device_map = kwargs.get("device_map")
    if str(device_map) not in {str(m) for m in _CPU_MAPS}:
        return f"device_map={device_map!r} is not the CPU", False
    return None, False


def _model_of(result: Any) -> torch.nn.Module | None:
    """The model a ``from_pretrained`` returned (transformers or diffusers, with or without
    ``output_loading_info``), or None."""
    import torch

    model = result[0] if isinstance(result, tuple) and result else result
    return model if isinstance(model, torch.nn.Module) else None


def _post_load_reason(model: torch.nn.Module, entries: list[list[Any]],
                      unique: list[torch.Tensor]) -> str | None:
    if getattr(model, "hf_quantizer", None) is not None or getattr(
            model.config, "quantization_config", None) is not None:
        return "the checkpoint is quantized"
    for index, tensor in enumerate(unique):
        if tensor.device.type != "cpu":
            name = next(e[0] for e in entries if e[2] == index)
            return f"{name} is on {tensor.device}, not the CPU"
    return None


def _share(result: Any, call: Call, mode: Mode
           ) -> tuple[dict[str, Any], Callable[[], None] | None]:
    """Leader: share the loaded model's tensors; returns the payload and a post-publish step."""
    model = _model_of(result)
    if model is None:
        return {}, None
    transport = _transport_of(call)
    if mode.load.alongside:
        transport.discard(model, mode.load)
        logger.info("%s: not sharing weights: a zero-copy load, followers map the checkpoint "
                    "files themselves", call.prefix())
        return {"weights": None, "reason": "followers map the checkpoint files"}, None
    entries, unique = entries_of(model)
    reason = _post_load_reason(model, entries, unique)
    if reason is None and initialized_by_follower(mode.load.loading_info or {}) is None:
        reason = "keys missing from the checkpoint are initialised inside the step followers skip"
    if reason is not None:
        unique.clear()  # discarding re-points them; no reference may outlive that here
        transport.discard(model, mode.load)
        logger.info("%s: not sharing weights: %s; followers load them plainly",
                    call.prefix(), reason)
        return {"weights": None, "reason": reason}, None
    info = {"entries": entries, "class": f"{type(model).__module__}.{type(model).__qualname__}",
            "headers": mode.load.headers,
            "loading_info": mode.load.loading_info, "transport": transport.name,
            "conversions": mode.load.conversions, "dtype_plan": mode.load.dtype_plan,
            # Inference tensors (made inside torch.inference_mode() on the loading thread):
            # followers make theirs so too.
            "inference": [i for i, t in enumerate(unique) if t.is_inference()],
            # transformers' "loaded" mark, where the leader's tensors carry it (followers mark
            # every tensor they receive while loading, then set these).
            "marked": {str(i): t._is_hf_initialized for i, t in enumerate(unique)
                       if hasattr(t, "_is_hf_initialized")}}
    try:
        payload, after = transport.share(call, model, entries, unique, mode.load)
    except BaseException:
        transport.discard(model, mode.load)
        raise
    info.update(payload)
    return {"weights": info}, after


def _chosen() -> Any:
    """The transport ``PATCHLOAD_TRANSPORT`` names (None: ``auto``).

    Raises:
        ConfigError: no transport is registered under that name (a package removed since the
            variable was read).
    """
    name = _state.config().transport
    if name == "auto":
        return None
    transport = transports().get(name)
    if transport is None:
        from ._topology import current_topology

        raise ConfigError("PATCHLOAD_TRANSPORT", name,
                          " / ".join(("auto", *transports().names())),
                          rank=current_topology().rank)
    return transport


def _transport_of(call: Call) -> Any:
    """The transport of a load call: the one ``PATCHLOAD_TRANSPORT`` names where its scope is
    the call's; else a job-scope load is a broadcast (to every rank, or to the other nodes'
    leaders) and a node-scope one shares memory."""
    chosen = _chosen()
    if chosen is not None and chosen.scope == call.scope:
        return chosen
    return transports().get("collective" if call.scope == "job" else "shm")


def _assemble(model: Any, entries: list[list[Any]], tensors: list[torch.Tensor],
              skip: set[str]) -> None:
    """Follower: put the leader's tensors into ``model`` under every name, ties included, but
    those in ``skip`` (keys the follower initialises itself, as a plain load does)."""
    import torch

    params: dict[int, torch.nn.Parameter] = {}
    owner = Owners(model)
    for name, kind, index, requires_grad in entries:
        if name in skip:
            continue
        module, attribute = owner(name)
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
    from .transport import meta_of

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
    if not transport.collective:
        tensors = _received(transport, mode, weights)
    if tensors is None:  # not a member, a broken broadcast, a failed attach: load plainly
        return False
    _check_structure(model, entries, [meta_of(t) for t in tensors], skip)
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


def _abandon(mode: Mode) -> None:
    """Follower giving up on the leader's result: its transport may still need it (a broadcast
    member: the leader and the other members wait for every member)."""
    weights = (mode.payload.get("weights") or {}) if mode.leader is not None else {}
    transport = transports().get(weights["transport"]) if weights.get("transport") else None
    if transport is not None:
        transport.abandon(mode.call, weights, mode.load)


def _settle(result: Any, mode: Mode) -> Any:
    """Follower, after the original call returned: re-point every tensor at the leader's bytes
    (transformers re-creates non-persistent buffers after loading; their values must match),
    but those this rank initialised itself, and give each transformers' "loaded" mark as the
    leader's has it."""
    model = _model_of(result)
    if model is not None and mode.load.received is not None:
        entries, tensors, skip = mode.load.received
        weights = mode.payload["weights"]
        marked = weights.get("marked", {})
        owner = Owners(model)
        for name, kind, index, _ in entries:
            if name in skip:
                continue
            module, attribute = owner(name)
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
        transports().get(weights["transport"]).settle(mode.call, model, weights, tensors)
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

    from .transport import dtype_from_str

    return {key: torch.empty(shape, dtype=dtype_from_str(dtype), device="meta")
            for key, (dtype, shape) in header.items()}, True


def _described_header(mode: Mode, checkpoint_file: Any) -> dict[str, Any] | None:
    """Follower: a checkpoint file's ``{key: [dtype, shape]}`` from the layout its leader
    announced with its files (:mod:`patchload.transport.mapped_files`), or None: known before the
    leader's outcome."""
    layout = _layout(mode)
    real = os.path.realpath(str(checkpoint_file))
    for file in (layout or {}).get("files", ()):
        if file["path"] == real:
            return {key: [dtype, shape] for key, dtype, shape, _, _ in file["tensors"]}
    return None


def _layout(mode: Mode) -> dict[str, Any] | None:
    """Follower: the checkpoint layout its node leader announced (read once per call)."""
    if not mode.load.layout_known:
        announced = mode.announcement() if mode.call.scope == "node" else None
        mode.load.layout = (announced or {}).get("layout")
        mode.load.layout_known = True
    return mode.load.layout


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


def from_pretrained(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Any:
    """The wrapt wrapper of a model class's ``from_pretrained`` (transformers or diffusers):
    weights from the node's leader, unless a reason to step aside applies."""
    owner = instance if isinstance(instance, type) else type(instance)
    name = f"{owner.__module__}.{owner.__qualname__}.from_pretrained"
    source = args[0] if args else kwargs.get("pretrained_model_name_or_path")
    what = f"{owner.__name__}.from_pretrained({source!r})"
    mode = current_mode()
    if mode is not None and mode.loads_model:  # e.g. the model class's call inside an Auto call
        return coordinated(name, wrapped, args, kwargs, Hooks(what))
    if _ALONE.get():  # the model class's call inside an Auto call that stepped aside
        return wrapped(*args, **kwargs)
    reason, collective = _step_aside_reason(kwargs)
    if reason is not None:
        logger.info("%s: weights not shared (%s): downloads coordinated, each rank loads its own",
                    what, reason)
        if collective:  # every rank runs the call at once; each hub call inside is coordinated
            token = _ALONE.set(True)
            try:
                return wrapped(*args, **kwargs)
            finally:
                _ALONE.reset(token)
        return coordinated(name, wrapped, args, kwargs, Hooks(what))
    chosen = _chosen()
    if chosen is not None and chosen.scope == "job":
        return coordinated(name, wrapped, args, kwargs, Hooks(
            what, scope="job", share=_share, settle=_settle, abandon=_abandon,
            idle=warm_conversions))
    return coordinated(name, wrapped, args, kwargs, Hooks(
        what, scope="node", share=_share, settle=_settle, abandon=_abandon, idle=warm_conversions,
        lead_with=NodeLeadersLoad(name, wrapped, what)))


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
            self.what, share=self.share, settle=self.settle, abandon=_abandon,
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
            return _share(result, call, mode)
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
        result = _settle(result, mode)
        arena, mode.load.arena = mode.load.arena, None
        joined, mode.load.joined = mode.load.joined, None
        if arena is not None and joined is not None:
            # Received into it (the model holds the tensors now, nothing else may): the
            # node's share copies nothing.
            self.node_mode.load.arena = arena
        elif arena is not None:  # the broadcast failed: this rank loaded plainly
            arena.close()
        return result


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
            _transport_of(mode.call).prepare(mode.call, model, mode.load)
        result = wrapped(*args, **kwargs)
        if first:
            mode.load.describe(loading_info=describe_loading_info(result),
                               conversions=_used_conversions(model, mapping),
                               dtype_plan=dtype_plan(bound))
        return result
    if mode.load.alongside is None:  # the call's first load, not an adapter's after it
        mode.load.alongside = False
        if maps_as_plain(state_dict, files, load_config, _layout(mode)):
            state = mapped_state_dict(_layout(mode), files)
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
    them, while the leader loads. The hub calls the rest of the call makes (a generation config)
    wait for the leader's outcome first (:func:`patchload.coordination.call._nested`): the
    leader fetches those files after its weights."""
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
    layout (what followers resolve after this, the generation config, they resolve after the
    leader's outcome)."""
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
