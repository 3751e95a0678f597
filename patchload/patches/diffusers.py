"""diffusers models: weights from the node's leader, through the same steps as transformers'.

``ModelMixin.from_pretrained`` and diffusers' ``AutoModel.from_pretrained`` get the wrapper of
:mod:`patchload.weights.load`: the leader loads and shares every parameter and buffer; a follower
reruns the call from the cache, so diffusers itself builds the module from the config on the meta
device (``init_empty_weights``), resolves the dtype, ``_keep_in_fp32_modules``, ``eval()`` and
``register_to_config``. Two steps of it are replaced on a follower:

- ``load_state_dict`` (the single-file read that gives diffusers the checkpoint's key names) is
  answered with meta tensors from the leader's record
  (:func:`patchload.weights.receive.checkpoint_header`);
- ``ModelMixin._load_pretrained_model`` assembles the leader's tensors instead of reading any file
  (:func:`patchload.weights.receive.receive`). When they do not apply (leader gone, other tensor
  names) it reads the checkpoint itself, replacing a meta-tensor answer by the real state dict
  first.

In a pipeline's ``from_pretrained``, ``DiffusionPipeline.download`` is coordinated as an entry point
(:func:`pipeline_patches`, with scheduler ``from_pretrained``): the leader makes the one snapshot
download; followers read the cache and skip ``model_info``.
Then every rank loads the components together, each a ``ModelMixin`` or ``PreTrainedModel`` load
whose weights come from the leader (through either transport). diffusers orders a pipeline's
components by iterating a set of names, so each process (string hash randomization) would load
them in its own order; in a multi-rank job they are loaded in sorted order instead, so that ranks
meet at the same component (a collective broadcast waits only briefly for the others to arrive).
"""

from __future__ import annotations

import inspect
import sys
from typing import Any, Callable, Final

from ..coordination.call import current_mode
from .._patching import Patch
from .._topology import current_topology
from ..weights.load import from_pretrained
from ..weights.receive import checkpoint_header, receive
from ._wrappers import entry_points

__all__ = ["diffusers_patches", "pipeline_patches"]

_MODELING: Final = "diffusers.models.modeling_utils"

# (module, attribute path) of diffusers' entry points that fetch files but no weights.
_ENTRY_POINTS: Final = (
    # model_info, model_index.json, one snapshot_download: every request of a pipeline's
    # from_pretrained. Not from_pretrained itself: its followers would only start loading the
    # components once the leader had loaded them all, too late to join a collective broadcast.
    ("diffusers.pipelines.pipeline_utils", "DiffusionPipeline.download"),
    ("diffusers.schedulers.scheduling_utils", "SchedulerMixin.from_pretrained"),
)


def _load_state_dict(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> Any:
    """``diffusers.models.modeling_utils.load_state_dict`` inside a model load: the leader
    records the header, a follower gets meta tensors (see :func:`checkpoint_header`)."""
    mode = current_mode()
    checkpoint_file = args[0] if args else kwargs.get("checkpoint_file")
    if mode is None or not mode.loads_model or isinstance(checkpoint_file, dict):
        return wrapped(*args, **kwargs)
    state, answered = checkpoint_header(mode, checkpoint_file, lambda: wrapped(*args, **kwargs))
    if answered:
        mode.load.answered = state
    return state


def _load_pretrained_model(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...],
                           kwargs: dict[str, Any]) -> Any:
    """``ModelMixin._load_pretrained_model`` on a follower: the leader's tensors, no file read.

    Returns diffusers' tuple ``(model, missing, unexpected, mismatched, offload_index, errors)``.
    """
    mode = current_mode()
    if mode is None or mode.lead:
        return wrapped(*args, **kwargs)
    bound = inspect.signature(wrapped).bind(*args, **kwargs)
    model = bound.arguments["model"]
    if receive(mode, model):
        return model, [], [], [], None, []
    state_dict = bound.arguments.get("state_dict")
    if state_dict is not None and state_dict is mode.load.answered:
        # The checkpoint's keys were answered with meta tensors: read the real weights now.
        from diffusers.models.model_loading_utils import load_state_dict

        real = load_state_dict(bound.arguments["resolved_model_file"][0],
                               disable_mmap=bound.arguments.get("disable_mmap", False))
        model._fix_state_dict_keys_on_load(real)
        bound.arguments["state_dict"] = real
    return wrapped(*bound.args, **bound.kwargs)


def _extract_init_dict(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...],
                       kwargs: dict[str, Any]) -> Any:
    """``ConfigMixin.extract_init_dict`` of a pipeline class, in a multi-rank job: the same
    ``(init_dict, unused_kwargs, hidden_dict)`` with ``init_dict`` (the components to load, in
    load order) sorted by name."""
    result = wrapped(*args, **kwargs)
    pipelines = sys.modules.get("diffusers.pipelines.pipeline_utils")
    if (pipelines is None or not isinstance(instance, type)
            or not issubclass(instance, pipelines.DiffusionPipeline)
            or not current_topology().distributed):
        return result
    init_dict, *rest = result
    return (dict(sorted(init_dict.items())), *rest)


def pipeline_patches() -> list[Patch]:
    """The patches of diffusers' entry points that fetch files but no weights (a pipeline's
    download, a scheduler's ``from_pretrained``)."""
    return entry_points(_ENTRY_POINTS)


def diffusers_patches() -> list[Patch]:
    """The patches for diffusers model loading (landed when diffusers' modules are imported)."""
    return [
        Patch(_MODELING, "ModelMixin.from_pretrained", from_pretrained),
        Patch("diffusers.models.auto_model", "AutoModel.from_pretrained", from_pretrained),
        Patch(_MODELING, "ModelMixin._load_pretrained_model", _load_pretrained_model),
        Patch(_MODELING, "load_state_dict", _load_state_dict),
        Patch("diffusers.configuration_utils", "ConfigMixin.extract_init_dict",
              _extract_init_dict),
    ]
