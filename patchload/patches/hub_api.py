"""The hub metadata calls a script makes itself, each coordinated: rank 0 asks, the others get its answers.

A script that asks the hub on every rank before its download (``HfApi().list_repo_refs``,
``list_repo_tree``, ``model_info``, ``dataset_info``: the calls behind kernels#640's 429s) makes
each such call once per scope: the leader makes it and records its HTTP answers
(:mod:`patchload.coordination.replay`); each follower runs the same call with every request
answered from that record, so it builds the same objects, or raises the same error, with no
request. A request the leader never made goes to the hub, as plain.

Patched on ``HfApi`` and on ``huggingface_hub``'s module-level functions (bound methods of one
``HfApi``, also where a module imported them by name): see :data:`METHODS`. Each counts in a
sequence of its own (:func:`patchload.coordination.rank0.place`), so a listing that rank 0 makes
alone never changes who leads the loads.

Made as plain, by every rank:

- inside a coordinated call (the ``model_info`` of a ``from_pretrained``): that call's record
  answers it already;
- called by huggingface_hub itself (``HfFileSystem``'s listings, ``repo_info``'s ``model_info``):
  the calls a client makes from its caches differ from rank to rank, and a rank would wait for
  a call rank 0 never makes;
- with huggingface_hub 0.x, whose ``requests`` exchanges cannot be replayed;
- on an ``HfApi`` built with an endpoint other than ``HF_ENDPOINT`` or with headers of its own
  (what they send is not part of the call's key). An ``HfApi(token=...)``'s token is passed as
  the call's ``token=`` (what its methods use for ``token=None``), so the key holds its digest.

``list_repo_tree`` (and ``list_repo_files``' listing) returns a lazy iterator: inside the call it
is read to the end, every page fetched at once; the caller gets a generator of the same items
that raises where the listing failed, once it gets there.

``file_exists`` inside a follower's coordinated call (peft asks it before downloading adapter
weights, even with ``local_files_only=True``) is answered from the cache the leader filled (the
call's own ``cache_dir``, or the default cache), without a request.
"""

from __future__ import annotations

import functools
import inspect
import sys
from typing import Any, Callable, Final, Iterator

from .._patching import Patch
from ..coordination.call import Hooks, coordinated, coordinates_here, current_mode

__all__ = ["METHODS", "hub_api_patches"]

# HfApi's read-only metadata methods, each also a module-level function of huggingface_hub.
METHODS: Final = ("model_info", "dataset_info", "space_info", "repo_info", "repo_exists",
                  "revision_exists", "file_exists", "list_repo_files", "list_repo_tree",
                  "list_repo_refs", "list_repo_commits", "get_paths_info")


def _api_of(wrapped: Callable[..., Any], instance: Any) -> Any:
    """The ``HfApi`` a call goes through: the instance, or the one a module-level function is
    bound to."""
    return instance if instance is not None else getattr(wrapped, "__self__", None)


def _shareable(api: Any) -> bool:
    from huggingface_hub import constants

    return (api is not None and getattr(api, "headers", None) is None
            and getattr(api, "endpoint", constants.ENDPOINT) == constants.ENDPOINT)


def _called_by_the_hub_client() -> bool:
    """Whether the patched method's caller (above this function and the wrapper, and any frame
    of wrapt's pure-Python fallback) is huggingface_hub's own code."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] == "wrapt":
        frame = frame.f_back
    name = frame.f_globals.get("__name__", "") if frame is not None else ""
    return name.partition(".")[0] == "huggingface_hub"


def _failing_at_end(items: list[Any], error: Exception | None) -> Iterator[Any]:
    yield from items
    if error is not None:
        raise error


def _read_to_end(wrapped: Callable[..., Any]) -> Callable[..., Any]:
    """``wrapped``, with a generator it returns read to the end inside the call (its requests
    made there, where they are recorded or replayed)."""
    @functools.wraps(wrapped)  # the signature the call's key binds the arguments to
    def read(*args: Any, **kwargs: Any) -> Any:
        result = wrapped(*args, **kwargs)
        if not inspect.isgenerator(result):
            return result
        items: list[Any] = []
        try:
            for item in result:
                items.append(item)
        except Exception as err:  # noqa: BLE001 - raised where a plain caller meets it
            return _failing_at_end(items, err)
        return _failing_at_end(items, None)

    return read


def _source(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return kwargs["repo_id"] if "repo_id" in kwargs else (args[0] if args else None)


def _cached_file_exists(mode: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """``file_exists`` inside a follower's call: whether the cache holds the file."""
    from huggingface_hub import try_to_load_from_cache

    filename = kwargs["filename"] if "filename" in kwargs else (args[1] if len(args) > 1
                                                                else None)
    cached = try_to_load_from_cache(_source(args, kwargs), filename, cache_dir=mode.cache_dir,
                                    revision=kwargs.get("revision"),
                                    repo_type=kwargs.get("repo_type"))
    return isinstance(cached, str)


def _method(name: str, *, answers_from_cache: bool = False) -> Callable[..., Any]:
    def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> Any:
        mode = current_mode()
        if answers_from_cache and mode is not None and not mode.lead and not mode.replayed:
            return _cached_file_exists(mode, args, kwargs)
        api = _api_of(wrapped, instance)
        if (not coordinates_here() or _called_by_the_hub_client() or not _replays()
                or not _shareable(api)):
            return wrapped(*args, **kwargs)
        if getattr(api, "token", None) is not None and kwargs.get("token") is None:
            kwargs = {**kwargs, "token": api.token}
        return coordinated(f"HfApi.{name}", _read_to_end(wrapped), args, kwargs,
                           Hooks(f"HfApi.{name}({_source(args, kwargs)!r})", offline_kwarg=False))

    return wrapper


def _replays() -> bool:
    from ..coordination import replay

    return replay.recordable()


def hub_api_patches() -> list[Patch]:
    """The patches of :data:`METHODS`, on ``HfApi`` and on the module-level functions (with
    their aliases elsewhere). Landed when ``huggingface_hub.hf_api`` is imported; a method
    this huggingface_hub lacks is skipped at install."""
    patches = []
    for name in METHODS:
        patches.append(Patch("huggingface_hub.hf_api", f"HfApi.{name}", _method(name)))
        patches.append(Patch("huggingface_hub.hf_api", name,
                             _method(name, answers_from_cache=name == "file_exists"),
                             rebind_aliases=True))
    return patches
