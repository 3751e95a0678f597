"""Patches for Hugging Face ``datasets``: ``load_dataset`` as one coordinated call.

``datasets.load_dataset`` (hub repos of parquet, csv, json or text files, ``data_files=``,
``split=``, ``revision=``, configs, ``cache_dir=``, local folders and files) runs leader-first
(:func:`patchload.coordination.call.coordinated`, in the download scope: the node's rank 0, or
the job's for a cache the job shares):

- The **leader** makes the plain call: it resolves the repo, downloads the data files and
  prepares the Arrow cache. Every HTTP exchange its call makes through huggingface_hub's client
  (``HfApi``, ``HfFileSystem``, ``hf_hub_download``'s metadata requests, the dataset viewer) is
  recorded: request (method, URL, body digest) and response (status, headers, body), or the
  transport error. It publishes that record with what it loaded: each split's fingerprint,
  Arrow files (whose folder names the builder's config and the resolved commit) and row count.
- A **follower** waits for that outcome (without polling: see
  :func:`patchload.coordination.protocol.leader_first`), then reruns the same call with every
  HTTP exchange answered from the leader's record: no request leaves it. The rerun runs
  ``datasets``' own code, so it finds the leader's Arrow cache, builds no split and
  memory-maps the leader's files (one copy in the node's page cache). It uses its result only
  when its datasets and hub caches are the leader's and what it loaded is what the leader
  loaded (fingerprints, Arrow files, rows); otherwise, or when the rerun asks for something the
  leader never asked (another process history, a file missing from this rank's cache), it warns
  and makes the plain call.

``streaming=True`` steps aside: every rank streams, as without patchload (one INFO line); so
does every call where huggingface_hub's client is not ``httpx`` (0.x: ``requests``; the record
and replay of :mod:`patchload.coordination.replay` works there, but ``datasets`` on 0.x is not
tested).

The HTTP exchanges are recorded and replayed by :mod:`patchload.coordination.replay`.
"""

from __future__ import annotations

import functools
import inspect
import json
from dataclasses import dataclass, field
from typing import Any, Callable, Final

from .._logging import get_logger
from .._patching import Patch
from .._topology import current_topology
from .. import _state
from ..coordination.call import Hooks, VerificationFailed, coordinated, current_mode, plain
from ..coordination.replay import HISTORY, Replay, ReplayMiss, recordable, recording, replaying

__all__ = ["datasets_patches"]

logger = get_logger(__name__)

# The record a leader publishes is JSON in the job's store: a repo listing is kilobytes, but a
# repo of many thousand files could list megabytes. Past this, followers make the plain call.
_MAX_RECORD_BYTES: Final = 8 << 20


# What a first ``load_dataset`` call imports lazily, whatever it loads: every builder's module is
# extended for streaming (``datasets.streaming.extend_module_for_streaming`` imports the module of
# each function it patches: pandas, scipy.io, ...), and resolving a remote path asks fsspec for
# its http filesystem (aiohttp). Plain ranks import them at the start of their calls, all at
# once; a follower imports them while it waits for its leader, not after it (the follower's
# rerun on a warm cache was 1.2 s, 1.1 s of it these imports, serial after the leader's call).
_STREAMING_IMPORTS: Final = ("gzip", "numpy", "pandas", "scipy.io", "xml.etree.ElementTree",
                             "xml.dom.minidom", "pyarrow.parquet")


def _import_ahead(path: Any) -> None:
    """Import what this rank's ``load_dataset`` call will import anyway (see
    :data:`_STREAMING_IMPORTS`); a module that fails to import is left to the call."""
    import importlib
    import os

    for name in _STREAMING_IMPORTS:
        try:
            importlib.import_module(name)
        except Exception:  # noqa: BLE001 - missing or broken: the call meets it as plain would
            continue
    try:
        if not (isinstance(path, (str, os.PathLike)) and os.path.exists(path)):
            import fsspec

            fsspec.get_filesystem_class("https")
    except Exception:  # noqa: BLE001 - as above
        pass


# --- what a call loaded ----------------------------------------------------------------------

def _summary(result: Any) -> dict[str, Any] | None:
    """What a follower's result must equal: each split's fingerprint, Arrow files and rows
    (None: a result of another kind, never taken from a leader)."""
    import datasets

    def one(dataset: Any) -> dict[str, Any]:
        return {"fingerprint": dataset._fingerprint, "rows": dataset.num_rows,
                "split": None if dataset.split is None else str(dataset.split),
                "files": [entry.get("filename") for entry in dataset.cache_files]}

    if isinstance(result, datasets.Dataset):
        return {"dataset": one(result)}
    if isinstance(result, datasets.DatasetDict) and all(
            isinstance(split, datasets.Dataset) for split in result.values()):
        return {"splits": {str(name): one(split) for name, split in result.items()}}
    return None


def _caches(kwargs: dict[str, Any]) -> dict[str, str]:
    """The datasets cache the call prepares into and the hub cache it downloads into, by
    identity."""
    import datasets.config
    from huggingface_hub import constants

    from ..coordination.identity import cache_identity

    datasets_cache = kwargs.get("cache_dir") or datasets.config.HF_DATASETS_CACHE
    return {"datasets": cache_identity(datasets_cache),
            "hub": cache_identity(constants.HF_HUB_CACHE)}


def _differences(mine: dict[str, Any] | None, leader: dict[str, Any] | None) -> str:
    if mine is None:
        return "this rank's result is neither a Dataset nor a DatasetDict of them"
    if mine.keys() != (leader or {}).keys():
        return "another kind of result than the leader's"
    if "dataset" in mine:
        pairs = [("", mine["dataset"], leader["dataset"])]
    else:
        names = sorted(set(mine["splits"]) | set(leader["splits"]))
        pairs = [(f"split {name!r}: ", mine["splits"].get(name), leader["splits"].get(name))
                 for name in names]
    return "; ".join(f"{where}{here!r} here, {theirs!r} on the leader"
                     for where, here, theirs in pairs if here != theirs)


# --- load_dataset ----------------------------------------------------------------------------

def _argument(wrapped: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any],
              name: str) -> Any:
    if name in kwargs:
        return kwargs[name]
    try:
        return inspect.signature(wrapped).bind_partial(*args, **kwargs).arguments.get(name)
    except (TypeError, ValueError):
        return None


@dataclass
class _Led:
    """What this rank recorded when it led one ``load_dataset`` call (its share publishes it)."""

    record: list[dict[str, Any]] | None = None
    """The call's HTTP exchanges; None until the call returned."""
    earlier: list[dict[str, Any]] = field(default_factory=list)
    """The answers this process had cached before the call (huggingface_hub's caches)."""


def _leader(wrapped: Callable[..., Any], led: _Led) -> Callable[..., Any]:
    @functools.wraps(wrapped)
    def lead(*args: Any, **kwargs: Any) -> Any:
        record: list[dict[str, Any]] = []
        led.record, led.earlier = None, HISTORY.except_for([])
        try:
            with recording(record):
                result = wrapped(*args, **kwargs)
        finally:
            HISTORY.add(record)  # a failed call's answers are cached all the same
        led.record = record
        return result

    return lead


def _share(kwargs: dict[str, Any], led: _Led) -> Callable[..., tuple[dict[str, Any], None]]:
    def share(result: Any, call: Any, mode: Any) -> tuple[dict[str, Any], None]:
        record = led.record or []
        keys = {entry["key"] for entry in record}
        earlier = [entry for entry in led.earlier if entry["key"] not in keys]
        size = len(json.dumps(record)) + len(json.dumps(earlier))
        if size > _MAX_RECORD_BYTES:
            logger.warning("%s: the hub's answers to this call take %d bytes, more than %d: "
                           "followers make it plainly", call.prefix(), size, _MAX_RECORD_BYTES)
            record = None
        return {"datasets": {"record": record, "earlier": earlier, "summary": _summary(result),
                             "caches": _caches(kwargs)}}, None

    return share


def _follower(wrapped: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(wrapped)
    def follow(*args: Any, **kwargs: Any) -> Any:
        mode = current_mode()
        if mode is None or mode.lead:  # the plain call of a follower that gave up
            return wrapped(*args, **kwargs)
        _import_ahead(_argument(wrapped, args, kwargs, "path"))  # while the leader works
        leader = mode.payload.get("datasets")  # waits; raises the leader's failure
        if not leader or leader.get("record") is None or leader.get("summary") is None:
            raise VerificationFailed("the leader published no record of its call")
        if leader["caches"] != _caches(kwargs):
            raise VerificationFailed(f"this rank's caches {_caches(kwargs)} are not the "
                                     f"leader's {leader['caches']}")
        replay = Replay(leader["record"], leader.get("earlier"))
        try:
            with replaying(replay), plain():
                result = wrapped(*args, **kwargs)
        except ReplayMiss as miss:
            raise VerificationFailed(str(miss)) from None
        if replay.missed is not None:  # a miss the library caught
            raise VerificationFailed(f"the leader made no request {replay.missed}")
        differences = _differences(_summary(result), leader["summary"])
        if differences:
            raise VerificationFailed(f"loaded other data than the leader: {differences}")
        return result

    return follow


def _load_dataset(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...],
                  kwargs: dict[str, Any]) -> Any:
    """``datasets.load_dataset``: coordinated (see the module docstring), but for
    ``streaming=True``, which every rank makes itself."""
    path = _argument(wrapped, args, kwargs, "path")
    streaming = bool(_argument(wrapped, args, kwargs, "streaming"))
    # Built and tested on huggingface_hub >= 1 only: on 0.x (requests) every rank makes it.
    if streaming or not recordable(through_requests=False):
        topology = current_topology()
        if _state.active() and topology.distributed and current_mode() is None:
            why = ("streaming=True: every rank streams its data itself" if streaming else
                   "huggingface_hub's HTTP client is not httpx: load_dataset's record and "
                   "replay is built on it")
            logger.info("[rank %d/%d] load_dataset(%r): not coordinated (%s)", topology.rank,
                        topology.world_size, path, why)
        with plain():  # its hub calls too: as without patchload
            return wrapped(*args, **kwargs)
    led = _Led()
    return coordinated("datasets.load.load_dataset", _follower(wrapped), args, kwargs, Hooks(
        f"load_dataset({path!r})", share=_share(kwargs, led), lead_with=_leader(wrapped, led),
        offline_kwarg=False))


def datasets_patches() -> list[Patch]:
    """The patches for ``datasets``: ``load_dataset`` (also as ``datasets.load_dataset``). Its
    followers' reruns are answered through huggingface_hub's HTTP client patches
    (:func:`patchload.coordination.replay.http_patches`)."""
    return [Patch("datasets.load", "load_dataset", _load_dataset, rebind_aliases=True)]
