"""sentence-transformers' model constructors (``SentenceTransformer``, ``CrossEncoder``,
``SparseEncoder``: ``BaseModel.__init__``), coordinated as an entry point: it fetches
``modules.json`` and friends, and (unless ``local_files_only``) the hub's ``model_info``.

Followers pass ``local_files_only=True``: they skip the hub's ``model_info`` call, so their model
card does not name a base model (its ``local_files_only``, which decides what a later save asks
the hub, is the caller's again: :func:`_card_as_asked`). The model's weights are loaded by
transformers' patched ``from_pretrained`` inside.
"""

from __future__ import annotations

from typing import Any, Callable

from .._patching import Patch
from ._wrappers import entry_points

__all__ = ["sentence_transformers_patches"]


def _card_as_asked(instance: Any, kwargs: dict[str, Any]) -> Callable[[Any, Any], Any]:
    """A follower's ``settle`` for a sentence-transformers model: the model card it built
    (unless the caller gave one) records the ``local_files_only`` the caller asked for, not the
    follower's True (it decides what a later save looks up on the hub: datasets, base model)."""
    def settle(result: Any, mode: Any) -> Any:
        card = getattr(instance, "model_card_data", None)
        if (kwargs.get("model_card_data") is None and not mode.asked_offline
                and getattr(card, "local_files_only", None) is True):
            card.local_files_only = False
        return result

    return settle


def _settle_of(wrapped: Callable[..., Any], owner: type, instance: Any,
               kwargs: dict[str, Any]) -> Callable[[Any, Any], Any] | None:
    # A class of sentence_transformers itself (not a user's subclass elsewhere).
    if wrapped.__name__ == "__init__" and owner.__module__.startswith("sentence_transformers"):
        return _card_as_asked(instance, kwargs)
    return None


def sentence_transformers_patches() -> list[Patch]:
    """The patch of sentence-transformers' model constructors."""
    return entry_points([("sentence_transformers.base.model", "BaseModel.__init__")],
                        settle_of=_settle_of)
