"""Installs and removes patches with wrapt, whatever the import order.

A patch names a module, a dotted attribute path and a wrapper ``(wrapped, instance, args,
kwargs)``. If the module is imported, the patch lands now; otherwise a wrapt post-import hook lands
it when the module is first imported. Every landed patch keeps ``(parent, attribute, original)``
from ``wrapt.resolve_path`` so :func:`uninstall` restores the exact original objects, in reverse
order. Hub functions are also rebound wherever a module already holds them by name (``from
huggingface_hub import hf_hub_download`` copies the function into the importing module).
"""

from __future__ import annotations

import sys
import threading
from dataclasses import dataclass
from typing import Any, Callable

import wrapt

from . import _runtime, _state
from ._errors import PatchConflictError
from ._logging import get_logger

__all__ = ["Patch", "install_patches", "uninstall_patches", "installed_patches"]

logger = get_logger(__name__)

Wrapper = Callable[[Callable[..., Any], Any, tuple[Any, ...], dict[str, Any]], Any]


@dataclass(frozen=True)
class Patch:
    """One attribute to wrap.

    Attributes:
        module: the module that defines it, e.g. ``huggingface_hub.file_download``.
        path: dotted attribute path inside the module, e.g. ``PreTrainedModel.from_pretrained``.
        wrapper: the wrapt wrapper.
        rebind_aliases: also replace every module-level attribute that holds the original (for
            functions imported by name elsewhere).
        expand: when set, ``path`` is ignored and ``expand(module)`` lists the paths to wrap
            (for attributes a library copies per class, like the Auto classes' from_pretrained).
    """

    module: str
    path: str
    wrapper: Wrapper
    rebind_aliases: bool = False
    expand: Callable[[Any], list[str]] | None = None


@dataclass
class _Landed:
    parent: Any
    attribute: str
    original: Any
    replacement: Any
    owned: bool  # the attribute was in vars(parent) before patching


class _Landing:
    """The runtime's landed patches, in landing order."""

    def __init__(self) -> None:
        self.landed: list[_Landed] = []
        self.lock = threading.RLock()
        self.generation = 0  # bumps on uninstall, so post-import hooks of an old install do nothing


def _landing() -> _Landing:
    return _runtime.current().part(_Landing)


def _land(parent: Any, attribute: str, original: Any, replacement: Any) -> None:
    owned = attribute in vars(parent)
    wrapt.apply_patch(parent, attribute, replacement)
    _landing().landed.append(_Landed(parent, attribute, original, replacement, owned))


def _is_ours(obj: Any) -> bool:
    return isinstance(obj, wrapt.FunctionWrapper) and getattr(obj, "_self_patchload", False)


def _apply(patch: Patch, module: Any) -> None:
    for path in patch.expand(module) if patch.expand is not None else [patch.path]:
        _apply_path(patch, module, path)


def _apply_path(patch: Patch, module: Any, path: str) -> None:
    parent, attribute, original = wrapt.resolve_path(module, path)
    if _is_ours(original):
        return
    replacement = wrapt.FunctionWrapper(original, patch.wrapper, enabled=_state.active)
    replacement._self_patchload = True
    _land(parent, attribute, original, replacement)
    logger.debug("patched %s.%s", patch.module, path)
    if patch.rebind_aliases:
        _rebind(original, replacement)


def _rebind(original: Any, replacement: Any) -> None:
    for name, mod in list(sys.modules.items()):
        namespace = getattr(mod, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for attribute, value in list(namespace.items()):
            if value is original:
                _land(mod, attribute, original, replacement)
                logger.debug("rebound %s.%s", name, attribute)


def _rebind_landed(patch: Patch, module: Any) -> None:
    """Rebind the aliases of ``patch``'s original made since it landed in ``module`` (see
    :func:`_rebind`), and adopt the copies of its replacement."""
    for path in patch.expand(module) if patch.expand is not None else [patch.path]:
        try:
            _, _, current = wrapt.resolve_path(module, path)
        except (AttributeError, wrapt.PathResolutionError):
            continue
        if _is_ours(current):
            _rebind(current.__wrapped__, current)
            _adopt_copies(current.__wrapped__, current)


def _adopt_copies(original: Any, replacement: Any) -> None:
    """Record the module attributes that copied ``replacement`` by name after it landed, so
    that :func:`uninstall_patches` puts ``original`` back there too."""
    landed_ = _landing().landed
    known = {(id(landed.parent), landed.attribute) for landed in landed_}
    for name, mod in list(sys.modules.items()):
        namespace = getattr(mod, "__dict__", None)
        if not isinstance(namespace, dict):
            continue
        for attribute, value in list(namespace.items()):
            if value is replacement and (id(mod), attribute) not in known:
                landed_.append(_Landed(mod, attribute, original, replacement, owned=True))
                logger.debug("rebound %s.%s", name, attribute)


def install_patches(patches: list[Patch]) -> None:
    """Land every patch now or when its module is imported. Idempotent.

    A patch whose target attribute does not exist in the installed library version is skipped
    with a DEBUG line (libraries move things between versions).
    """
    state = _landing()
    with state.lock:
        generation = state.generation
        for patch in patches:
            def hook(module: Any, patch: Patch = patch) -> None:
                with state.lock:
                    if generation != state.generation:
                        return
                    try:
                        _apply(patch, module)
                    except (AttributeError, wrapt.PathResolutionError) as err:
                        logger.debug("not patching %s.%s: %s", patch.module, patch.path, err)

            if patch.module in sys.modules:
                hook(sys.modules[patch.module])
            else:
                wrapt.register_post_import_hook(hook, patch.module)
            top = patch.module.partition(".")[0]
            if patch.rebind_aliases and top != patch.module and top not in sys.modules:
                # A submodule patched while its package imports it is copied by name into the
                # package afterwards (``torch.distributed`` star-imports ``distributed_c10d``):
                # rebind once the whole package is imported, so uninstall restores those too.
                def rebind(_: Any, patch: Patch = patch) -> None:
                    with state.lock:
                        if generation == state.generation and patch.module in sys.modules:
                            _rebind_landed(patch, sys.modules[patch.module])

                wrapt.register_post_import_hook(rebind, top)


def uninstall_patches() -> None:
    """Restore every patched attribute to its original object, in reverse order.

    Raises:
        PatchConflictError: some attribute no longer holds patchload's wrapper (another library
            replaced it); the others are still restored.
    """
    conflicts = []
    state = _landing()
    with state.lock:
        state.generation += 1
        while state.landed:
            landed = state.landed.pop()
            current = vars(landed.parent).get(landed.attribute)
            if current is not landed.replacement:
                conflicts.append(f"{_name(landed.parent)}.{landed.attribute}")
                continue
            if landed.owned:
                setattr(landed.parent, landed.attribute, landed.original)
            else:
                delattr(landed.parent, landed.attribute)
    if conflicts:
        raise PatchConflictError("cannot restore attributes replaced by someone else after "
                                 "patchload patched them: " + ", ".join(conflicts))


def _name(parent: Any) -> str:
    if isinstance(parent, type):
        return f"{parent.__module__}.{parent.__qualname__}"
    return getattr(parent, "__name__", repr(parent))


def installed_patches() -> list[str]:
    """The patched attributes, as ``module.attribute`` strings, in install order."""
    state = _landing()
    with state.lock:
        return [f"{_name(p.parent)}.{p.attribute}" for p in state.landed]
