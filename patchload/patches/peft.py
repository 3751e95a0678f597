"""peft's adapters and configs: ``PeftModel.from_pretrained``, ``load_adapter`` (also
transformers' ``PeftAdapterMixin``), ``AutoPeftModel*.from_pretrained`` and
``PeftConfig.from_pretrained``, each coordinated as an entry point (the leader fetches, followers
rerun from the cache). The base model's weights are shared by its own patched
``from_pretrained``.
"""

from __future__ import annotations

from typing import Final

from .._patching import Patch
from ._wrappers import entry_points

__all__ = ["peft_patches"]

# (module, attribute path) of every peft entry point.
_ENTRY_POINTS: Final = (
    ("peft.config", "PeftConfigMixin.from_pretrained"),
    ("peft.peft_model", "PeftModel.from_pretrained"),
    ("peft.peft_model", "PeftModel.load_adapter"),
    # The adapter config, the base model (its weights shared on their own), a file_exists
    # check for a tokenizer, then PeftModel.from_pretrained.
    ("peft.auto", "_BaseAutoPeftModel.from_pretrained"),
)
# Entry points whose followers must not get local_files_only=True (see coordinated()).
_REJECTING_OFFLINE_KWARG: Final = (
    ("transformers.integrations.peft", "PeftAdapterMixin.load_adapter"),
)


def peft_patches() -> list[Patch]:
    """The patches of peft's entry points, then of transformers' ``PeftAdapterMixin``."""
    return (entry_points(_ENTRY_POINTS)
            + entry_points(_REJECTING_OFFLINE_KWARG, offline_kwarg=False))
