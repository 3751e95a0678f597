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

User code's ``HfFileSystem`` listings are coordinated the same way, one call per method the user
calls (:data:`FS_METHODS`: ``ls``, ``info``, ``exists``, ``glob``, ``find``): the ``HfApi``
calls the file system makes inside (``repo_info``, ``list_repo_tree``, ``get_paths_info``) are
part of that call's record. Each rank's instance keeps its own caches (``dircache``, the repos it
found): a follower's rerun asks only what its own caches lack, and a request its leader never
made (its leader's caches answered it) goes to the hub, as plain.

Reading a file is coordinated too (:data:`FS_READ_METHODS`: ``open`` in a read mode,
``cat_file``, ``cat``, ``read_bytes``, ``read_text``, each one call; and the read of a whole file
that user code makes on an ``HfFileSystemFile`` it opened, ``open(...).read()``, a call of its
own keyed by the file's path and revision). Inside these calls the leader also records the
file's body it streams (:func:`patchload.coordination.replay.recording_bodies`), where the body
is at most ``Config.fs_read_bytes`` (``PATCHLOAD_FS_READ_MB``, 4 MiB by default); a follower's
rerun gets the same bytes (and the same revision resolution, listings and errors) from the
record. A larger body, one the leader read only in part, and any request the record does not
hold (a range read at another offset, an answer the leader's caches gave) go to the hub, as
plain, and count in the follower's INFO line. A file object's partial reads (``read(n)``, a
read after ``seek``) and a streaming handle's reads (``block_size=0``) are not coordinated:
every rank makes their requests, as plain.

Made as plain, by every rank:

- inside a coordinated call (the ``model_info`` of a ``from_pretrained``): that call's record
  answers it already;
- called by huggingface_hub itself (``HfFileSystem``'s listings, ``repo_info``'s
  ``model_info``) or, for ``HfFileSystem``'s methods, by fsspec or datasets (``walk``'s ``ls``,
  ``data_files``' ``glob``): the calls a client makes from its caches differ from rank to rank,
  and a rank would wait for a call rank 0 never makes;
- where huggingface_hub's client is neither ``httpx`` nor ``requests`` (a
  ``configure_http_backend`` factory of the user's), whose exchanges cannot be replayed;
- on an ``HfApi`` built with an endpoint other than ``HF_ENDPOINT`` or with headers of its own
  (what they send is not part of the call's key). An ``HfApi(token=...)``'s token is passed as
  the call's ``token=`` (what its methods use for ``token=None``), so the key holds its digest;
- on an ``HfFileSystem`` built with a token or an endpoint of its own (its methods take no
  ``token=`` to carry it into the key).

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

__all__ = ["FS_METHODS", "FS_READ_METHODS", "METHODS", "hub_api_patches"]

# HfApi's read-only metadata methods, each also a module-level function of huggingface_hub.
METHODS: Final = ("model_info", "dataset_info", "space_info", "repo_info", "repo_exists",
                  "revision_exists", "file_exists", "list_repo_files", "list_repo_tree",
                  "list_repo_refs", "list_repo_commits", "get_paths_info")
# HfFileSystem's listing methods (each a call of its own; the HfApi calls inside are its record).
FS_METHODS: Final = ("ls", "info", "exists", "glob", "find")
# HfFileSystem's methods that read files (each a call of its own; the HfApi calls and the file
# bodies, up to Config.fs_read_bytes, inside are its record). ``open`` only in a read mode.
FS_READ_METHODS: Final = ("open", "cat_file", "cat", "read_bytes", "read_text")
# The read modes of ``open`` (a write or an append is never coordinated).
_READ_MODES: Final = ("rb", "r", "rt")
# The coordinated call's name of an HfFileSystem method: under ``HfApi.``, so that it counts in
# the metadata calls' sequence (coordination.call._METADATA_PREFIX).
_FS_CALL_PREFIX: Final = "HfApi.HfFileSystem."
# Callers of HfFileSystem's methods whose calls are made as plain: the file system itself and
# fsspec's methods it inherits (``exists`` -> ``info``, ``walk`` -> ``ls``), and datasets, whose
# calls depend on caches of its own (its load_dataset is coordinated as a whole).
_FS_CLIENTS: Final = ("huggingface_hub", "fsspec", "datasets")


def _api_of(wrapped: Callable[..., Any], instance: Any) -> Any:
    """The ``HfApi`` a call goes through: the instance, or the one a module-level function is
    bound to."""
    return instance if instance is not None else getattr(wrapped, "__self__", None)


def _shareable(api: Any) -> bool:
    from huggingface_hub import constants

    return (api is not None and getattr(api, "headers", None) is None
            and getattr(api, "endpoint", constants.ENDPOINT) == constants.ENDPOINT)


def _called_by_the_hub_client(clients: tuple[str, ...] = ("huggingface_hub",)) -> bool:
    """Whether the patched method's caller (above this function and the wrapper, and any frame
    of wrapt's pure-Python fallback) is the code of one of ``clients`` (top-level package
    names): huggingface_hub's own, by default."""
    frame = sys._getframe(2)
    while frame is not None and frame.f_globals.get("__name__", "").partition(".")[0] == "wrapt":
        frame = frame.f_back
    name = frame.f_globals.get("__name__", "") if frame is not None else ""
    return name.partition(".")[0] in clients


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


def _fs_shareable(fs: Any) -> bool:
    """Whether an ``HfFileSystem`` sends what every rank's default one sends: ``HF_ENDPOINT``,
    this process's own credentials, no headers of its own."""
    from huggingface_hub import constants

    return (fs is not None and getattr(fs, "token", True) is None
            and getattr(fs, "endpoint", None) == constants.ENDPOINT
            and _shareable(getattr(fs, "_api", None)))


def _fs_path(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    return kwargs["path"] if "path" in kwargs else (args[0] if args else None)


def _fs_mode(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """``HfFileSystem.open``'s ``mode`` (fsspec's default: ``rb``)."""
    return kwargs["mode"] if "mode" in kwargs else (args[1] if len(args) > 1 else "rb")


def _with_bodies(wrapped: Callable[..., Any]) -> Callable[..., Any]:
    """``wrapped``, with the file bodies its requests stream recorded by a leader, up to
    ``Config.fs_read_bytes`` bytes each (:func:`patchload.coordination.replay.recording_bodies`)."""
    from .. import _state
    from ..coordination import replay

    @functools.wraps(wrapped)  # the signature the call's key binds the arguments to
    def read(*args: Any, **kwargs: Any) -> Any:
        with replay.recording_bodies(_state.config().fs_read_bytes):
            return wrapped(*args, **kwargs)

    return read


def _fs_method(name: str, *, reads: bool = False) -> Callable[..., Any]:
    """The wrapper of ``HfFileSystem.<name>``: user code's call coordinated as one metadata
    call, its file system's ``HfApi`` requests recorded by the leader and replayed to followers
    (see the module docstring). ``reads``: a method of :data:`FS_READ_METHODS`, whose file
    bodies are recorded too; ``open`` is coordinated in a read mode only."""
    def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> Any:
        if (not coordinates_here() or _called_by_the_hub_client(_FS_CLIENTS)
                or not _replays() or not _fs_shareable(instance)
                or (name == "open" and _fs_mode(args, kwargs) not in _READ_MODES)):
            return wrapped(*args, **kwargs)
        function = _with_bodies(wrapped) if reads else _read_to_end(wrapped)
        return coordinated(f"{_FS_CALL_PREFIX}{name}", function, args, kwargs,
                           Hooks(f"HfFileSystem.{name}({_fs_path(args, kwargs)!r})",
                                 offline_kwarg=False))

    return wrapper


def _whole_read(instance: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether ``HfFileSystemFile.read(*args, **kwargs)`` reads the whole file from its start
    in binary mode (huggingface_hub's one-request path), the one read that is coordinated."""
    length = kwargs["length"] if "length" in kwargs else (args[0] if args else -1)
    return ((length is None or (isinstance(length, int) and length == -1))
            and getattr(instance, "mode", None) == "rb" and getattr(instance, "loc", None) == 0
            and not getattr(instance, "closed", True))


def _file_read(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> Any:
    """The wrapper of ``HfFileSystemFile.read``: user code's read of a whole file (an
    ``open(...).read()``) coordinated as one call keyed by the file's path (its repo, revision
    and name), its body recorded by the leader up to ``Config.fs_read_bytes`` (see the module
    docstring). Any other read (a length, after a seek, in a write mode), or a read made by
    huggingface_hub, fsspec or datasets, is made as plain."""
    if (not coordinates_here() or _called_by_the_hub_client(_FS_CLIENTS) or not _replays()
            or not _fs_shareable(getattr(instance, "fs", None))
            or not _whole_read(instance, args, kwargs)):
        return wrapped(*args, **kwargs)
    read = _with_bodies(wrapped)

    def read_file(path: str) -> Any:  # the call's key: the file's path (with its revision)
        return read(*args, **kwargs)

    return coordinated(f"{_FS_CALL_PREFIX}HfFileSystemFile.read", read_file, (instance.path,), {},
                       Hooks(f"HfFileSystemFile.read({instance.path!r})", offline_kwarg=False))


def _replays() -> bool:
    from ..coordination import replay

    return replay.recordable()


def hub_api_patches() -> list[Patch]:
    """The patches of :data:`METHODS`, on ``HfApi`` and on the module-level functions (with
    their aliases elsewhere), of :data:`FS_METHODS` and :data:`FS_READ_METHODS` on
    ``HfFileSystem``, and of ``HfFileSystemFile.read``. Landed when
    ``huggingface_hub.hf_api`` (``hf_file_system``) is imported; a method this huggingface_hub
    lacks is skipped at install."""
    patches = []
    for name in METHODS:
        patches.append(Patch("huggingface_hub.hf_api", f"HfApi.{name}", _method(name)))
        patches.append(Patch("huggingface_hub.hf_api", name,
                             _method(name, answers_from_cache=name == "file_exists"),
                             rebind_aliases=True))
    for name in FS_METHODS:
        patches.append(Patch("huggingface_hub.hf_file_system", f"HfFileSystem.{name}",
                             _fs_method(name)))
    for name in FS_READ_METHODS:
        patches.append(Patch("huggingface_hub.hf_file_system", f"HfFileSystem.{name}",
                             _fs_method(name, reads=True)))
    patches.append(Patch("huggingface_hub.hf_file_system", "HfFileSystemFile.read", _file_read))
    return patches
