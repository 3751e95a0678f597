"""The registry of library patches: one module per library, one line per library here.

Each entry names the library's top-level package and the function returning its patches
(:class:`patchload._patching.Patch` objects, landed now or when the library is imported).
:func:`library_patches` returns them all, in registry order; :func:`patchload.install` lands
them after the hub and model patches.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Final

from .datasets import datasets_patches
from .datasets_map import map_patches
from .evaluate import evaluate_patches
from .hub_api import hub_api_patches

if TYPE_CHECKING:
    from .._patching import Patch

__all__ = ["LibraryPatches", "LIBRARIES", "library_patches"]


@dataclass(frozen=True)
class LibraryPatches:
    """The patches of one library.

    Attributes:
        package: the library's top-level import name, e.g. ``datasets``.
        patches: returns the library's patches; importing the library is left to the patches'
            post-import hooks (building them imports nothing).
    """

    package: str
    patches: Callable[[], list[Patch]]


LIBRARIES: Final = (
    # HfApi's metadata calls (model_info, list_repo_tree, ...) made by user code.
    LibraryPatches(package="huggingface_hub", patches=hub_api_patches),
    LibraryPatches(package="datasets", patches=datasets_patches),
    # datasets' Dataset.map: a module of its own (load_dataset's HTTP record is another job).
    LibraryPatches(package="datasets", patches=map_patches),
    # evaluate's module fetch (evaluate.load): its requests go through `requests`, not httpx.
    LibraryPatches(package="evaluate", patches=evaluate_patches),
)


def library_patches() -> list[Patch]:
    """Every registered library's patches, in registry order."""
    return [patch for library in LIBRARIES for patch in library.patches()]
