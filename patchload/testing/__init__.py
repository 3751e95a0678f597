"""Test helpers for patchload: a loopback Hugging Face Hub and tiny model repos.

* :mod:`patchload.testing.hub`: :class:`LoopbackHub` serves local folders as Hub repos over real
  HTTP on ``127.0.0.1``, records every request (with the client's rank) and injects
  :class:`Fault` s. Stdlib only.
* :mod:`patchload.testing.models`: factories that write tiny, deterministic model repos
  (``tiny_llama``, ``tiny_gpt2``, ``tiny_bert``, ``tiny_t5``, ``tiny_custom``, ``tiny_remote_code``, ``minilm``).
  They import torch and transformers.

Every name is re-exported lazily (module ``__getattr__``), so importing ``patchload.testing``
stays cheap and ``python -m patchload.testing.hub`` does not import the hub module twice.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .hub import Fault, LoopbackHub, Request, read_request_log
    from .models import (
        MINILM_REPO_ID,
        PatchloadToyConfig,
        PatchloadToyModel,
        minilm,
        mistral_style_tokenizer,
        tiny_bert,
        tiny_custom,
        tiny_gpt2,
        tiny_llama,
        tiny_remote_code,
        tiny_t5,
        tiny_tokenizer,
    )

__all__ = [
    "MINILM_REPO_ID",
    "Fault",
    "LoopbackHub",
    "PatchloadToyConfig",
    "PatchloadToyModel",
    "Request",
    "minilm",
    "mistral_style_tokenizer",
    "read_request_log",
    "tiny_bert",
    "tiny_custom",
    "tiny_gpt2",
    "tiny_llama",
    "tiny_remote_code",
    "tiny_t5",
    "tiny_tokenizer",
]

_FROM_HUB = frozenset({"Fault", "LoopbackHub", "Request", "read_request_log"})


def __getattr__(name: str) -> Any:
    """Imports :mod:`.hub` or :mod:`.models` on first use of one of their names."""
    if name in _FROM_HUB:
        from . import hub

        return getattr(hub, name)
    if name in __all__:
        from . import models

        return getattr(models, name)
    raise AttributeError("module %r has no attribute %r" % (__name__, name))
