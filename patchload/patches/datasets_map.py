"""Patches for Hugging Face ``datasets``: ``Dataset.map`` (and ``filter``, which maps) with a
cache file, computed once per node.

``Dataset.map`` decides itself whether it computes: it fingerprints the function and its
arguments (``update_fingerprint``), names the cache file after that fingerprint
(``Dataset._get_cache_file_path``: next to the dataset's Arrow files), loads that file when it
exists, and otherwise runs the function and writes the file (a temporary file moved into
place). patchload takes ``datasets``' own answers:

1. **Probe.** Each rank starts its ``map`` and stops it as ``datasets`` names the cache file,
   before it looks for the file: no function call, no file read or written, nothing logged.
   This point comes on every rank, whatever its cache holds, so every rank makes the same
   coordinated call (a rank that skipped one because the file was there already would shift
   its sequence against rank 0's).
2. **One coordinated call** (node scope: the file lives on this node's disk) keyed by the new
   fingerprint and the cache file's real path: ranks agree on a key only when their plain
   ``map`` would read or write the same file for the same fingerprint.
3. The **leader** (the node's rank 0) makes its ``map`` call as plain: it computes and writes
   the file (or loads it, warm). A **follower** waits for the leader's outcome (without
   polling), then makes its ``map`` call plainly: ``datasets`` finds the leader's file and
   memory-maps it, as a plain rank that comes after another one's ``map`` does (same
   fingerprint, rows, content). Where the leader wrote none (a function that returns nothing:
   ``datasets`` keeps the dataset and writes no file) the follower computes, as plain.
4. The leader's exception (the function raised) reaches every follower that waited for it as
   the same class; a rank that arrives after it failed makes its own call (the same error). A
   leader that dies, goes silent or is interrupted is noticed as for models (its pid, its
   heartbeat), and so is ``PATCHLOAD_TIMEOUT``; its followers then make the plain call, with a
   WARNING (unlike a model load's, which raise ``LeaderFailedError``: a map's result is this
   rank's own to compute).

Every other ``map`` runs as plain on every rank: a random fingerprint (``datasets`` could not
hash the function or an argument, and drew one: it differs per rank), no cache file named by
``datasets`` (an in-memory dataset, ``cache_file_name=`` given), ``keep_in_memory=True``,
``load_from_cache_file=False`` or caching disabled (``datasets`` recomputes on every rank
anyway), a ``map`` inside another coordinated call, or inside the function of another ``map``.
"""

from __future__ import annotations

import collections
import contextvars
import dataclasses
import glob
import inspect
import os
import threading
from typing import Any, Callable, Final

from .. import _runtime, _state
from .._errors import LeaderFailedError, PatchloadTimeout
from .._logging import get_logger
from .._patching import Patch
from .._topology import current_topology
from ..coordination.call import Hooks, coordinated, current_mode, plain

__all__ = ["map_patches"]

logger = get_logger(__name__)

_GONE: Final = object()  # the map's leader died, went silent or took too long


@dataclasses.dataclass
class _Probe:
    """One ``Dataset.map`` call's probe (see the module docstring).

    Attributes:
        pid: the process that probes (a ``num_proc`` pool's forked workers inherit the
            context, and are no rank of their own).
        fingerprint: the new fingerprint ``datasets`` named the cache file after.
        cache_file: the cache file's path, as ``datasets`` named it.
        random: ``datasets`` drew a random fingerprint during the probe.
    """

    pid: int
    fingerprint: str | None = None
    cache_file: str | None = None
    random: bool = False


_PROBE: contextvars.ContextVar[_Probe | None] = contextvars.ContextVar(
    "patchload_datasets_map_probe", default=None)
# Inside a map call's function (leader or plain): maps made there are the function's own.
_IN_MAP: contextvars.ContextVar[bool] = contextvars.ContextVar("patchload_datasets_in_map",
                                                               default=False)


class _Named(BaseException):
    """``datasets`` named the probed ``map``'s cache file: the probe stops there. A
    BaseException, so that ``datasets``' own handlers (``except Exception``) let it through."""


class _Draws:
    """The random fingerprints ``datasets`` drew lately in each thread (bounded): ``filter``
    draws its new fingerprint before it calls ``map`` (its ``fingerprint_transform``), which
    gets it as ``new_fingerprint``."""

    _KEEP: Final = 64

    def __init__(self) -> None:
        self._local = threading.local()

    def add(self, fingerprint: Any) -> None:
        recent = getattr(self._local, "recent", None)
        if recent is None:
            recent = self._local.recent = collections.deque(maxlen=self._KEEP)
        recent.append(fingerprint)

    def drawn(self, fingerprint: Any) -> bool:
        return fingerprint in (getattr(self._local, "recent", None) or ())


def _draws() -> _Draws:
    return _runtime.current().part(_Draws)


def _argument(wrapped: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
              name: str) -> Any:
    if name in kwargs:
        return kwargs[name]
    try:
        bound = inspect.signature(wrapped).bind_partial(*args, **kwargs)
    except (TypeError, ValueError):
        return None
    return bound.arguments.get(name)


def _why_not(wrapped: Callable[..., Any], args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> str | None:
    """Why this ``map`` call is not coordinated, from its arguments (None: it may be)."""
    from datasets.fingerprint import is_caching_enabled

    load = _argument(wrapped, args, kwargs, "load_from_cache_file")
    if not (load if load is not None else is_caching_enabled()):
        return "load_from_cache_file=False or caching disabled: datasets computes on every rank"
    if _argument(wrapped, args, kwargs, "keep_in_memory"):
        return "keep_in_memory=True: datasets writes no cache file"
    if _argument(wrapped, args, kwargs, "cache_file_name") is not None:
        return "cache_file_name= given"
    return None


def _why_not_probed(probe: _Probe) -> str | None:
    if probe.cache_file is None:
        return "no cache file (an in-memory dataset)"
    if probe.random or _draws().drawn(probe.fingerprint):
        return ("datasets gave it a random fingerprint (it could not hash the function or an "
                "argument): it differs per rank")
    return None


def _not_coordinated(why: str) -> None:
    topology = current_topology()
    logger.info("[rank %d/%d] Dataset.map: not coordinated (%s): this rank computes, as plain",
                topology.rank, topology.world_size, why)


def _map(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...],
         kwargs: dict[str, Any]) -> Any:
    """``Dataset.map``: probed, then one coordinated call (see the module docstring)."""
    if (not _state.active() or not current_topology().distributed or current_mode() is not None
            or _IN_MAP.get() or _PROBE.get() is not None):
        return wrapped(*args, **kwargs)
    why = _why_not(wrapped, args, kwargs)
    if why is not None:
        _not_coordinated(why)
        return _plain_map(wrapped, args, kwargs)
    probe = _Probe(os.getpid())
    token = _PROBE.set(probe)
    try:
        # Returns only where datasets names no cache file (an empty dataset): the plain result.
        result = wrapped(*args, **kwargs)
    except _Named:
        pass
    else:
        _not_coordinated("no cache file (an empty dataset)")
        return result
    finally:
        _PROBE.reset(token)
    why = _why_not_probed(probe)
    if why is not None:
        _not_coordinated(why)
        return _plain_map(wrapped, args, kwargs)
    return _coordinated_map(wrapped, args, _with_fingerprint(wrapped, args, kwargs, probe), probe)


def _shards_fingerprint_themselves() -> bool:
    """Older ``datasets`` (``_map_single`` a ``fingerprint_transform``): with ``num_proc`` each
    shard hashed its own fingerprint, so the probe's (the first shard's) is not the map's."""
    from datasets import Dataset

    layer: Any = Dataset._map_single
    while layer is not None:
        if getattr(layer, "_decorator_name_", None) == "fingerprint":
            return True
        layer = getattr(layer, "__wrapped__", None)
    return False


def _with_fingerprint(wrapped: Callable[..., Any], args: tuple[Any, ...],
                      kwargs: dict[str, Any], probe: _Probe) -> dict[str, Any]:
    """``kwargs`` with the probe's fingerprint as ``new_fingerprint``: ``datasets`` then only
    validates it instead of hashing the function and its arguments a second time (the same
    hash, so the same fingerprint and cache file as its own). Unchanged where the caller passed
    ``new_fingerprint`` positionally, and where shards hash their own."""
    if kwargs.get("new_fingerprint") is not None or _shards_fingerprint_themselves():
        return kwargs
    try:
        positional = "new_fingerprint" in inspect.signature(wrapped).bind_partial(*args).arguments
    except (TypeError, ValueError):
        positional = True  # not known: the call as the caller made it
    return kwargs if positional else {**kwargs, "new_fingerprint": probe.fingerprint}


def _plain_map(wrapped: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    token = _IN_MAP.set(True)
    try:
        return wrapped(*args, **kwargs)
    finally:
        _IN_MAP.reset(token)


def _coordinated_map(wrapped: Callable[..., Any], args: tuple[Any, ...],
                     kwargs: dict[str, Any], probe: _Probe) -> Any:
    from ..coordination.identity import cache_identity

    assert probe.cache_file is not None  # noqa: S101 - _why_not_probed checked it
    cache_file = name_path = probe.cache_file
    name = os.path.basename(cache_file)
    followed: list[bool] = []

    def lead(*, fingerprint: str, cache_file: str) -> Any:
        del fingerprint, cache_file  # the key's parts: the call is the caller's
        with plain():  # what its function calls is its own, as without patchload
            return _plain_map(wrapped, args, kwargs)

    def follow(*, fingerprint: str, cache_file: str) -> Any:
        del fingerprint, cache_file
        mode = current_mode()
        if mode is not None and not mode.lead:
            mode.payload  # noqa: B018 - the leader succeeded (this raises its failure)
            followed.append(_written(name_path))
        with plain():  # a follower: datasets finds the leader's file
            return _plain_map(wrapped, args, kwargs)

    try:
        result = coordinated(
            "datasets.arrow_dataset.Dataset.map", follow, (),
            {"fingerprint": probe.fingerprint,
             # A pair, not a path string: a path that exists (a late rank's, once the leader
             # wrote it) would add a ``__path__`` part to its key and none to an early rank's.
             "cache_file": (cache_identity(os.path.dirname(cache_file)), name)},
            Hooks(f"Dataset.map(-> {name})", scope="node", lead_with=lead, offline_kwarg=False))
    except (LeaderFailedError, PatchloadTimeout) as err:
        if type(err) not in (LeaderFailedError, PatchloadTimeout):
            raise  # the leader's own exception, rebuilt: what this rank's plain map raises
        # The leader died, went silent or took too long: nothing of this map is the leader's
        # to give; this rank's plain map computes (or finds a file the leader did finish).
        logger.warning("%s: making the map plainly here", err)
        result = _GONE
    if result is _GONE:  # outside the handler: its error has no __context__ of patchload's
        with plain():
            return _plain_map(wrapped, args, kwargs)
    if followed:
        topology = current_topology()
        how = (f"loaded its cache file {name} (or its shards), the function not run here"
               if followed[0] else "it wrote no cache file: computed here, as plain")
        logger.info("[rank %d/%d] Dataset.map: followed its leader: %s", topology.rank,
                    topology.world_size, how)
    return result


def _written(cache_file: str) -> bool:
    """The cache file exists, or shards of it (``<name>_<rank>_of_<n><ext>``: ``num_proc``)."""
    prefix, ext = os.path.splitext(cache_file)
    return os.path.exists(cache_file) or bool(glob.glob(glob.escape(prefix) + "_*" + ext))


def _cache_file_path(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...],
                     kwargs: dict[str, Any]) -> Any:
    """``Dataset._get_cache_file_path``: inside a probe, the cache file ``map`` names, which
    ends the probe."""
    path = wrapped(*args, **kwargs)
    probe = _PROBE.get()
    if probe is None or probe.pid != os.getpid() or probe.cache_file is not None:
        return path
    probe.fingerprint = args[0] if args else kwargs.get("fingerprint")
    probe.cache_file = path
    raise _Named()


def _random_fingerprint(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...],
                        kwargs: dict[str, Any]) -> Any:
    """``datasets.fingerprint.generate_random_fingerprint``: noted, since a fingerprint drawn at
    random differs per rank."""
    fingerprint = wrapped(*args, **kwargs)
    probe = _PROBE.get()
    if probe is not None:
        probe.random = True
    _draws().add(fingerprint)
    return fingerprint


def map_patches() -> list[Patch]:
    """The patches for ``Dataset.map``: ``map`` itself, ``_get_cache_file_path`` (where a probe
    stops), and ``generate_random_fingerprint`` (also where ``datasets`` imported it by
    name)."""
    return [
        Patch("datasets.arrow_dataset", "Dataset.map", _map),
        Patch("datasets.arrow_dataset", "Dataset._get_cache_file_path", _cache_file_path),
        Patch("datasets.fingerprint", "generate_random_fingerprint", _random_fingerprint,
              rebind_aliases=True),
    ]
