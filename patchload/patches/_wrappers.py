"""The wrapper shared by the libraries' ``from_pretrained``-like entry points that fetch files but
no weights (configs, tokenizers, processors, sentence-transformers' constructors, diffusers'
pipeline download and schedulers, peft's adapters and configs).

One call (revision resolution, metadata requests, every file) runs on the leader; followers rerun
it from the cache the leader filled (:func:`patchload.coordination.call.coordinated`).
"""

from __future__ import annotations

import os
from typing import Any, Callable, Iterable, Optional

from .._libraries import facts
from .._patching import Patch
from ..coordination.call import Hooks, coordinated

__all__ = ["entry_point", "entry_points"]

# A library's extra follower step for one call, or None: ``(wrapped, owner, instance, kwargs) ->
# settle``, given the wrapped function, the class it was called on, its instance and arguments
# (a follower's ``settle(result, mode)`` of :class:`patchload.coordination.call.Hooks`).
SettleOf = Callable[[Callable[..., Any], type, Any, dict[str, Any]],
                    Optional[Callable[[Any, Any], Any]]]


def _source(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The repo id or path a call loads from, for messages: the first string or path argument
    (``PeftModel.from_pretrained`` takes the base model first)."""
    for value in (*args, *(kwargs.get(name) for name in facts().source_names)):
        if isinstance(value, (str, os.PathLike)):
            return value
    return None


def entry_point(*, offline_kwarg: bool, settle_of: SettleOf | None = None) -> Callable[..., Any]:
    """The wrapt wrapper of an entry point: the call coordinated under the name
    ``<module>.<class>.<function>`` of the class it was called on.

    Args:
        offline_kwarg: whether a follower's rerun may pass ``local_files_only=True`` (False for a
            function that rejects it).
        settle_of: what a follower does with its result, for the library that needs a step
            (see :data:`SettleOf`).
    """
    def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> Any:
        owner = instance if isinstance(instance, type) else type(instance)
        name = f"{owner.__module__}.{owner.__qualname__}.{wrapped.__name__}"
        settle = settle_of(wrapped, owner, instance, kwargs) if settle_of is not None else None
        what = f"{owner.__name__}.{wrapped.__name__}({_source(args, kwargs)!r})"
        return coordinated(name, wrapped, args, kwargs,
                           Hooks(what, settle=settle, offline_kwarg=offline_kwarg))

    return wrapper


def entry_points(targets: Iterable[tuple[str, str]], *, offline_kwarg: bool = True,
                 settle_of: SettleOf | None = None) -> list[Patch]:
    """A patch with an :func:`entry_point` wrapper for each ``(module, attribute path)``."""
    return [Patch(module, path, entry_point(offline_kwarg=offline_kwarg, settle_of=settle_of))
            for module, path in targets]
