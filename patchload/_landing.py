"""When the patches land: at the first import of a third-party package after ``import patchload``.

``import patchload`` reads the configuration and, unless a third-party package is imported
already, leaves :class:`LandOnFirstImport` in ``sys.meta_path``; wrapt and the patch modules are
imported when the patches land. Every patched library is a third-party package, and so is every
package that imports one, so the patches land before any of them runs. Not collective; no I/O.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, Callable

__all__ = ["LandOnFirstImport", "third_party_imported"]

# Top-level modules outside the standard library that are no library: the interpreter's own
# startup hooks.
_NOT_LIBRARIES = frozenset({"sitecustomize", "usercustomize", "patchload"})


def _third_party(name: str) -> bool:
    """Whether the module ``name`` may be (or import) a library patchload patches: a top-level
    public module outside the standard library and patchload (not a packaging shim such as
    ``_distutils_hack`` or an editable install's ``__editable___*_finder``)."""
    return ("." not in name and not name.startswith("_") and name not in _NOT_LIBRARIES
            and name not in sys.stdlib_module_names)


def third_party_imported() -> bool:
    """Whether a third-party package is imported already: the patches then land at once."""
    return any(_third_party(name) for name in list(sys.modules))


def _from_patchload(frame: Any) -> bool:
    """Whether patchload's own code runs in ``frame`` or a frame that called it."""
    while frame is not None:
        name = frame.f_globals.get("__name__", "")
        if name == "patchload" or name.startswith("patchload."):
            return True
        frame = frame.f_back
    return False


class LandOnFirstImport:
    """A ``sys.meta_path`` finder that lands the patches at the first import of a third-party
    package, before that package runs. It then leaves ``sys.meta_path`` and finds the package
    through the finders there (wrapt's post-import hook finder first, inserted by the landing),
    so that the hooks on the package itself fire.

    Not from patchload's own code (importing ``wrapt`` or ``psutil`` at its top, a transport's
    package, ``torch.distributed`` for ``main_process_first``): that code may hold a lock the
    landing takes, or be a module half imported that the landing imports. The next import of a
    third-party package lands the patches instead, and they land at once on the modules
    imported by then, as after an ``install()`` made late. Neither does a thread importing
    while another lands wait for it: what it imports is patched when the landing reaches it.

    One part of the install's runtime (:mod:`patchload._runtime`).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._land: Callable[[], None] | None = None

    def arm(self, land: Callable[[], None]) -> None:
        """Call ``land()`` at the first import of a third-party package."""
        with self._lock:
            if self._land is None:
                sys.meta_path.insert(0, self)  # type: ignore[arg-type]
            self._land = land

    def disarm(self) -> Callable[[], None] | None:
        """Leave ``sys.meta_path``; returns the landing it was armed with (None: none)."""
        with self._lock:
            land, self._land = self._land, None
            if land is not None:
                sys.meta_path.remove(self)  # type: ignore[arg-type]
            return land

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if path is not None or not _third_party(fullname) \
                or _from_patchload(sys._getframe(1)):
            return None
        land = self.disarm()
        if land is None:
            return None  # landed (or landing) already
        land()
        module = sys.modules.get(fullname)
        if module is not None:  # the landing imported it: it must not run a second time
            return _loaded_spec(module)
        for finder in list(sys.meta_path):
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                return spec
        return None


class _Loaded:
    """The loader of a module the landing imported while the import system was finding it."""

    def __init__(self, module: Any) -> None:
        self._module, self._spec = module, getattr(module, "__spec__", None)

    def create_module(self, spec: Any) -> Any:
        return self._module

    def exec_module(self, module: Any) -> None:
        module.__spec__ = self._spec  # the import system set the stand-in's


def _loaded_spec(module: Any) -> Any:
    """A spec whose loading hands back ``module`` as it is. Also set as ``module.__spec__``
    until then: the import system finds a module that appeared in ``sys.modules`` while it was
    looking for it by that attribute, and would run it again with its own loader. Its origin and
    search locations are the module's own (``importlib.util.find_spec`` returns it as it is)."""
    from importlib.machinery import ModuleSpec

    own = getattr(module, "__spec__", None)
    spec = ModuleSpec(module.__name__, _Loaded(module),  # type: ignore[arg-type]
                      origin=getattr(own, "origin", None))
    spec.submodule_search_locations = getattr(own, "submodule_search_locations", None)
    module.__spec__ = spec
    return spec
