"""What differs between the transformers lines patchload supports, in one place.

transformers 5.x and the last 4.x line (4.57). The hub patches need no adapter for
huggingface_hub 0.x (requests, pulled in by transformers 4.x): a patch target that a version
lacks (0.x has no ``HfApi.resolve_revision``) is skipped by ``install_patches``. Nothing here
imports transformers at import time: each function imports what it needs when called.
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Any

from ._logging import get_logger

if TYPE_CHECKING:
    import torch

__all__ = ["config_base", "describe_loading_info", "dtype_plan", "init_copy_",
           "initialize_as_before_loading", "initialized_by_follower", "loaded_from_leader",
           "warm_conversions"]

logger = get_logger(__name__)


def dtype_plan(arguments: dict[str, Any]) -> Any:
    """Which tensors a model load keeps in float32 whatever the dtype asked for, as JSON, from
    ``PreTrainedModel._load_pretrained_model``'s bound arguments: 5.x's
    ``load_config.dtype_plan`` (module pattern -> dtype, from the model's
    ``_keep_in_fp32_modules`` and ``_keep_in_fp32_modules_strict``), 4.x's
    ``keep_in_fp32_regex`` pattern. It comes from the model class and instance, not from the
    call's arguments, so a rank may have another one (a subclass, a patched attribute)."""
    plan = getattr(arguments.get("load_config"), "dtype_plan", None)
    if plan is not None:  # transformers 5.x
        return sorted([str(pattern), str(dtype)] for pattern, dtype in plan.items())
    regex = arguments.get("keep_in_fp32_regex")
    return getattr(regex, "pattern", regex)


def describe_loading_info(result: Any) -> dict[str, Any]:
    """What ``PreTrainedModel._load_pretrained_model`` returned on the leader, as JSON: the keys
    missing from the checkpoint, unexpected in it, of mismatched shape, and the error messages.

    Args:
        result: transformers 5.x: ``(LoadStateDictInfo, offload_index)``; 4.x: ``(model,
            missing_keys, unexpected_keys, mismatched_keys, offload_index, error_msgs)``.
    """
    if len(result) == 2:  # transformers 5.x
        info = result[0]
        return {"missing_keys": sorted(info.missing_keys),
                "unexpected_keys": sorted(info.unexpected_keys),
                "mismatched_keys": sorted([k, list(a), list(b)] for k, a, b in
                                          info.mismatched_keys),
                "error_msgs": list(info.error_msgs),
                "conversion_errors": dict(info.conversion_errors),
                "skipped_pp_keys": sorted(info.skipped_pp_keys)}
    _, missing, unexpected, mismatched, _, error_msgs = result
    return {"missing_keys": list(missing), "unexpected_keys": list(unexpected),
            "mismatched_keys": list(mismatched), "error_msgs": list(error_msgs)}


def initialized_by_follower(info: dict[str, Any]) -> set[str] | None:
    """The keys a follower initialises itself (missing or of mismatched shape on the leader), or
    None where this transformers line initialises them inside the step a follower replaces (4.x:
    the follower then reads the checkpoint itself, so its random draws match a plain load)."""
    keys = set(info.get("missing_keys", ())) | {m[0] if isinstance(m, list) else m
                                                for m in info.get("mismatched_keys", ())}
    try:
        from transformers.utils.loading_report import LoadStateDictInfo  # noqa: F401
    except ImportError:  # transformers 4.x
        return None if keys else set()
    return keys


def initialize_as_before_loading(model: Any) -> None:
    """A follower that skips transformers 4.x's loading step for the leader's tensors: first do
    what that step does before it reads the checkpoint where no key is missing,
    ``_initialize_missing_keys([])``: 4.57 runs ``_init_weights`` on every module holding a
    non-persistent buffer there (drawing from the rank's own random stream, as a plain load
    does). Nothing on 5.x, which initialises them after the replaced step."""
    try:
        from transformers.utils.loading_report import LoadStateDictInfo  # noqa: F401
    except ImportError:  # transformers 4.x
        initialize = getattr(model, "_initialize_missing_keys", None)
        if initialize is not None and \
                list(inspect.signature(initialize).parameters) == ["missing_keys", "is_quantized"]:
            initialize([], False)


def loaded_from_leader(model: Any, info: dict[str, Any]) -> Any:
    """What ``PreTrainedModel._load_pretrained_model`` returns for a follower whose tensors came
    from the leader: the leader's loading info, so that transformers then initialises the same
    missing keys on the follower (drawing from its own random-number stream, as a plain load does)
    and reports the same keys.

    Args:
        model: The model passed to ``_load_pretrained_model`` (its first argument).
        info: the leader's :func:`describe_loading_info`.

    Returns:
        transformers 5.x: ``(LoadStateDictInfo, None)``; 4.x: ``(model, missing_keys,
        unexpected_keys, mismatched_keys, offload_index, error_msgs)``.
    """
    try:
        from transformers.utils.loading_report import LoadStateDictInfo
    except ImportError:  # transformers 4.x
        return (model, list(info["missing_keys"]), list(info["unexpected_keys"]),
                list(info["mismatched_keys"]), None, list(info["error_msgs"]))
    import torch

    loaded = LoadStateDictInfo(
        missing_keys=set(info["missing_keys"]), unexpected_keys=set(info["unexpected_keys"]),
        mismatched_keys={(k, torch.Size(a), torch.Size(b)) for k, a, b in info["mismatched_keys"]},
        error_msgs=list(info["error_msgs"]), conversion_errors=dict(info["conversion_errors"]),
        skipped_pp_keys=set(info["skipped_pp_keys"]))
    return loaded, None


def config_base() -> type:
    """The base class of model configs: ``PreTrainedConfig`` (5.x), ``PretrainedConfig`` (4.x)."""
    import transformers

    return getattr(transformers, "PreTrainedConfig", None) or transformers.PretrainedConfig


def init_copy_(tensor: torch.Tensor, value: torch.Tensor) -> None:
    """Fills ``tensor`` with ``value`` inside a model's ``_init_weights``, leaving tensors that
    transformers marked as loaded alone (5.x: ``transformers.initialization.copy_``; 4.x has no
    such helper, and runs ``_init_weights`` only on what it did not load)."""
    try:
        from transformers import initialization
    except ImportError:  # transformers 4.x
        import torch

        with torch.no_grad():
            tensor.copy_(value)
        return
    initialization.copy_(tensor, value)


def warm_conversions() -> None:
    """Build transformers 5's table of checkpoint key conversions (a process-wide cache that a
    model's ``from_pretrained`` builds on its first call: about 0.2 s of regex compilation), so
    that a follower does it while its leader downloads rather than after. The table does not
    depend on the model; transformers 4 has none."""
    try:
        from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    except ImportError:
        return
    try:
        get_checkpoint_conversion_mapping("llama")
    except Exception as err:  # noqa: BLE001 - a head start only: the load builds it itself
        logger.debug("not building transformers' key-conversion table ahead: %s", err)
