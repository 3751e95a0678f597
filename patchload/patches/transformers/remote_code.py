"""Remote code (``trust_remote_code=True``): module files written once per node, then imported.

transformers copies a repo's ``*.py`` files into its dynamic-module cache (``HF_MODULES_CACHE``,
node-local unless on a shared filesystem) with ``shutil.copyfile`` after an ``exists()`` check,
and every rank imports them from there. Ranks doing this at once read a file another rank is
still writing, or miss a relatively imported file not copied yet (FileNotFoundError,
ModuleNotFoundError, SyntaxError).

``transformers.dynamic_module_utils.get_cached_module_file`` is therefore coordinated per node:
the node's leader fetches the file and writes the module files; the other ranks wait for its
outcome (a model load's followers, which start at once: for the leader's module, before they
take the lock below), then run the call from the cache, find the files complete and forget
the import system's cached directory listings before importing them. Every rank also holds a
file lock in the modules cache while transformers writes there: it covers the calls made inside
another coordinated call whose leader sits on another node (``PATCHLOAD_DOWNLOAD_SCOPE=job``),
where the followers of one node would otherwise write at the same time.
"""

from __future__ import annotations

import functools
import importlib
from pathlib import Path
from typing import Any, Callable

from ... import _state
from ...coordination.call import Hooks, add_pins, coordinated, current_mode, without_waiting
from ..._patching import Patch

__all__ = ["dynamic_module_patches"]


def _modules_lock() -> Any:
    """The node's lock on transformers' modules cache (reentrant in this process: the call
    recurses for relatively imported files)."""
    from filelock import FileLock
    from transformers import dynamic_module_utils

    cache = Path(dynamic_module_utils.HF_MODULES_CACHE)
    cache.mkdir(parents=True, exist_ok=True)
    timeout_s = _state.config().timeout_s
    return FileLock(str(cache / ".patchload.lock"), timeout=-1 if timeout_s is None else timeout_s,
                    is_singleton=True)  # -1: no bound


def _get_cached_module_file(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...],
                            kwargs: dict[str, Any]) -> Any:
    repo = args[0] if args else kwargs.get("pretrained_model_name_or_path")
    module_file = args[1] if len(args) > 1 else kwargs.get("module_file")

    @functools.wraps(wrapped)
    def locked(*args: Any, **kwargs: Any) -> Any:
        mode = current_mode()
        key = f"module:{repo}:{module_file}"
        if mode is not None and not mode.lead:
            # A model load's follower (it starts at once) waits for the leader's module before
            # it takes the lock, and waits for nothing inside: the leader takes the lock for
            # each module it writes.
            mode.wait_pin(key)
            with without_waiting(), _modules_lock():
                path = wrapped(*args, **kwargs)
        else:
            with _modules_lock():
                path = wrapped(*args, **kwargs)
            if mode is not None:  # written: followers may take the lock for it
                add_pins(mode, {key: [str(path)]})
        # transformers forgets the import system's directory listings only when this process
        # wrote a file; another process's new module files would stay invisible wherever
        # directory mtimes are coarse (ModuleNotFoundError).
        importlib.invalidate_caches()
        return path

    return coordinated("get_cached_module_file", locked, args, kwargs, Hooks(
        f"get_cached_module_file({str(repo)!r}, {module_file!r})", scope="node"))


def dynamic_module_patches() -> list[Patch]:
    """The patch for transformers' remote-code module cache."""
    return [Patch("transformers.dynamic_module_utils", "get_cached_module_file",
                  _get_cached_module_file)]
