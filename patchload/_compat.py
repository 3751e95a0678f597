"""What differs between the transformers lines patchload supports, in one place.

transformers 5.x and the last 4.x line (4.57). The hub patches need no adapter for
huggingface_hub 0.x (requests, pulled in by transformers 4.x): a patch target that a version
lacks (0.x has no ``HfApi.resolve_revision``) is skipped by ``install_patches``. Nothing here
imports transformers at import time: each function imports what it needs when called.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["config_base", "init_copy_", "loaded_from_leader"]


def loaded_from_leader(model: Any) -> Any:
    """What ``PreTrainedModel._load_pretrained_model`` returns for a follower whose every
    parameter and buffer came from the leader: nothing missing, unexpected or mismatched, no
    error messages, nothing offloaded.

    Args:
        model: The model passed to ``_load_pretrained_model`` (its first argument).

    Returns:
        transformers 5.x: ``(LoadStateDictInfo, None)``; 4.x: ``(model, missing_keys,
        unexpected_keys, mismatched_keys, offload_index, error_msgs)``.
    """
    try:
        from transformers.utils.loading_report import LoadStateDictInfo
    except ImportError:  # transformers 4.x
        return model, [], [], [], None, []
    info = LoadStateDictInfo(missing_keys=set(), unexpected_keys=set(), mismatched_keys=set(),
                             error_msgs=[], conversion_errors={}, skipped_pp_keys=set())
    return info, None


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
