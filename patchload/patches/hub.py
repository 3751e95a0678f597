"""huggingface_hub's downloads: ``hf_hub_download``, ``snapshot_download`` and revision resolution.

``huggingface_hub.hf_hub_download`` and ``snapshot_download`` are wrapped where they are defined
and rebound wherever a module already imported them by name (``transformers.utils.hub``,
``huggingface_hub._snapshot_download``, ``huggingface_hub.repocard``, ...): one call runs on the
leader and followers rerun it from the cache.

``huggingface_hub``'s metadata calls (``file_exists``, ``model_info``, ...) are patched in
:mod:`patchload.patches.hub_api`; the ``from_pretrained`` of everything but model weights in the
libraries' own modules (:mod:`patchload.patches.transformers.entry_points`,
:mod:`~patchload.patches.sentence_transformers`, :mod:`~patchload.patches.diffusers`,
:mod:`~patchload.patches.peft`).
"""

from __future__ import annotations

from typing import Any, Callable

from ..coordination.call import Hooks, coordinated
from ..coordination.replay import http_patches
from .._patching import Patch

__all__ = ["hub_patches"]


def _first(args: tuple[Any, ...], kwargs: dict[str, Any], name: str, index: int) -> Any:
    return kwargs[name] if name in kwargs else (args[index] if len(args) > index else None)


def _hub_function(name: str) -> Callable[..., Any]:
    def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> Any:
        repo = _first(args, kwargs, "repo_id", 0)
        filename = _first(args, kwargs, "filename", 1) if name == "hf_hub_download" else None
        what = f"{name}({repo!r}" + (f", {filename!r})" if filename else ")")
        return coordinated(name, wrapped, args, kwargs, Hooks(what))

    return wrapper


def hub_patches() -> list[Patch]:
    """The patches for huggingface_hub's download functions, and for its HTTP client: a
    coordinated call's exchanges recorded by its leader and replayed to its followers."""
    return [
        Patch("huggingface_hub.file_download", "hf_hub_download",
              _hub_function("hf_hub_download"), rebind_aliases=True),
        Patch("huggingface_hub._snapshot_download", "snapshot_download",
              _hub_function("snapshot_download"), rebind_aliases=True),
        # transformers >= 5.2x resolves the revision (GET /api/models/<repo>) before any file:
        # inside a node leader of a job-scoped download it must be coordinated like the files.
        Patch("huggingface_hub.hf_api", "HfApi.resolve_revision",
              _hub_function("resolve_revision")),
        # The same, bound to hf_api's module-level HfApi at import, imported by name (diffusers).
        Patch("huggingface_hub.hf_api", "resolve_revision", _hub_function("resolve_revision"),
              rebind_aliases=True),
        *http_patches(),
    ]
