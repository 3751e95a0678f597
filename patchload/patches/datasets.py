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
does every call where huggingface_hub's client is not ``httpx`` (0.x: ``requests``).

The HTTP exchanges are recorded and replayed at ``Client.send`` of the client library
huggingface_hub uses (``httpx2`` for huggingface_hub 2, ``httpx`` for 1); outside a coordinated
``load_dataset`` that patch passes every request straight through.
"""

from __future__ import annotations

import base64
import collections
import contextvars
import functools
import hashlib
import inspect
import json
import sys
import threading
from typing import Any, Callable, Final

from .._logging import get_logger
from .._patching import Patch
from .._topology import current_topology
from .. import _state
from ..coordination.call import VerificationFailed, coordinated, current_mode, plain

__all__ = ["datasets_patches"]

logger = get_logger(__name__)

# The record a leader publishes is JSON in the job's store: a repo listing is kilobytes, but a
# repo of many thousand files could list megabytes. Past this, followers make the plain call.
_MAX_RECORD_BYTES: Final = 8 << 20
# Response headers not replayed as recorded: the recorded body is already decoded, and its length
# is set from it.
_UNREPLAYED_HEADERS: Final = frozenset({"content-encoding", "transfer-encoding", "content-length"})
_HTTP_PACKAGES: Final = ("httpx2", "httpx")

# The leader's call: the exchanges recorded so far (None: not recording).
_RECORDING: contextvars.ContextVar[list[dict[str, Any]] | None] = contextvars.ContextVar(
    "patchload_datasets_recording", default=None)
# A follower's rerun: the leader's record it answers from (None: not replaying).
_REPLAY: contextvars.ContextVar[_Replay | None] = contextvars.ContextVar(
    "patchload_datasets_replay", default=None)


class _ReplayMiss(BaseException):
    """A follower's rerun made a request its leader never made. A BaseException, so that the
    library code in between (``except Exception``) cannot take it for a hub error and go on."""


# --- the HTTP record -------------------------------------------------------------------------

def _request_key(request: Any) -> str:
    """``<METHOD> <url> <body sha1>``: what a follower's request must equal to get the
    leader's answer (headers differ per rank: the user agent names the rank)."""
    try:
        body = hashlib.sha1(request.content).hexdigest()
    except Exception:  # noqa: BLE001 - a streaming body (an upload): never replayed
        body = "stream"
    return f"{request.method} {request.url} {body}"


def _error_entry(err: BaseException) -> dict[str, str]:
    return {"module": type(err).__module__, "qualname": type(err).__qualname__,
            "message": str(err)}


class _History:
    """The latest answer to each request this process's earlier coordinated calls made as a
    leader (bounded, oldest dropped first). A leader answers some requests from what
    ``HfFileSystem`` cached in an earlier call (a repo's existence, a listing), which its
    followers may not have made (they followed a leader that failed); it publishes these with
    its record, so that such a follower's rerun gets the answer the leader's cache holds."""

    def __init__(self, max_bytes: int) -> None:
        self._lock = threading.Lock()
        self._entries: dict[str, dict[str, Any]] = {}
        self._bytes = 0
        self._max_bytes = max_bytes

    def add(self, entries: list[dict[str, Any]]) -> None:
        with self._lock:
            for entry in entries:
                old = self._entries.pop(entry["key"], None)
                self._bytes += _entry_bytes(entry) - (_entry_bytes(old) if old else 0)
                self._entries[entry["key"]] = entry
            while self._bytes > self._max_bytes and self._entries:
                self._bytes -= _entry_bytes(self._entries.pop(next(iter(self._entries))))

    def except_for(self, entries: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """The earlier answers to requests that are not among ``entries``."""
        keys = {entry["key"] for entry in entries}
        with self._lock:
            return [entry for key, entry in self._entries.items() if key not in keys]


def _entry_bytes(entry: dict[str, Any]) -> int:
    return len(entry.get("content", "")) + len(entry["key"]) + 64


_HISTORY: Final = _History(_MAX_RECORD_BYTES // 2)


class _Replay:
    """A leader's record, answering a follower's requests: the same request gets the leader's
    answers in the order the leader got them (the last one again once they run out); a request
    the leader answered from an earlier call's cache gets that earlier answer."""

    def __init__(self, entries: list[dict[str, Any]],
                 earlier: list[dict[str, Any]] | None = None) -> None:
        self._answers: dict[str, collections.deque[dict[str, Any]]] = \
            collections.defaultdict(collections.deque)
        self._last: dict[str, dict[str, Any]] = {e["key"]: e for e in earlier or ()}
        for entry in entries:
            self._answers[entry["key"]].append(entry)
        self.missed: str | None = None
        self.answered = 0

    def answer(self, request: Any) -> Any:
        """The leader's response to ``request`` (an ``httpx`` request), or its transport error
        raised again.

        Raises:
            _ReplayMiss: the leader never made this request.
        """
        key = _request_key(request)
        queue = self._answers.get(key)
        entry = queue.popleft() if queue else self._last.get(key)
        if entry is None:
            self.missed = key
            raise _ReplayMiss(f"the leader made no request {key.rsplit(' ', 1)[0]}")
        self._last[key] = entry
        self.answered += 1
        package = sys.modules[type(request).__module__.partition(".")[0]]
        if "error" in entry:
            raise _rebuilt_error(entry["error"], request, package, key)
        headers = [(name, value) for name, value in entry["headers"]
                   if name.lower() not in _UNREPLAYED_HEADERS]
        return package.Response(entry["status"], headers=headers,
                                content=base64.b64decode(entry["content"]), request=request)


def _rebuilt_error(error: dict[str, str], request: Any, package: Any, key: str) -> BaseException:
    """The leader's transport error (a connection refused, a timeout), of its class."""
    cls: Any = sys.modules.get(error["module"]) \
        if error["module"].partition(".")[0] in _HTTP_PACKAGES else None
    for part in error["qualname"].split("."):
        cls = getattr(cls, part, None)
    if not (isinstance(cls, type) and issubclass(cls, Exception)):
        return _ReplayMiss(f"the leader's request {key} raised {error['qualname']}, which "
                           "cannot be rebuilt here")
    try:
        return cls(error["message"], request=request)
    except TypeError:
        return cls(error["message"])


def _send(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...],
          kwargs: dict[str, Any]) -> Any:
    """``Client.send``: inside a follower's rerun, answered from its leader's record; inside a
    leader's call, made and recorded (a streamed response, a file body, is not recorded: a
    follower finds the file in the cache the leader filled); elsewhere passed through."""
    replay = _REPLAY.get()
    if replay is not None:
        return replay.answer(kwargs["request"] if "request" in kwargs else args[0])
    record = _RECORDING.get()
    if record is None:
        return wrapped(*args, **kwargs)
    request = kwargs["request"] if "request" in kwargs else args[0]
    key = _request_key(request)
    try:
        response = wrapped(*args, **kwargs)
    except Exception as err:
        record.append({"key": key, "error": _error_entry(err)})
        raise
    if not kwargs.get("stream", False):
        record.append({"key": key, "status": response.status_code,
                       "headers": [list(item) for item in response.headers.multi_items()],
                       "content": base64.b64encode(response.content).decode("ascii")})
    return response


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


def _leader(wrapped: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(wrapped)
    def lead(*args: Any, **kwargs: Any) -> Any:
        record: list[dict[str, Any]] = []
        mode = current_mode()
        if mode is not None:
            mode.used["datasets_earlier"] = _HISTORY.except_for([])
        token = _RECORDING.set(record)
        try:
            result = wrapped(*args, **kwargs)
        finally:
            _RECORDING.reset(token)
            _HISTORY.add(record)  # a failed call's answers are cached all the same
        if mode is not None:
            mode.used["datasets_record"] = record
        return result

    return lead


def _share(kwargs: dict[str, Any]) -> Callable[..., tuple[dict[str, Any], None]]:
    def share(result: Any, call: Any, mode: Any) -> tuple[dict[str, Any], None]:
        record = mode.used.get("datasets_record") or []
        keys = {entry["key"] for entry in record}
        earlier = [entry for entry in mode.used.get("datasets_earlier") or ()
                   if entry["key"] not in keys]
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
        leader = mode.payload.get("datasets")  # waits; raises the leader's failure
        if not leader or leader.get("record") is None or leader.get("summary") is None:
            raise VerificationFailed("the leader published no record of its call")
        if leader["caches"] != _caches(kwargs):
            raise VerificationFailed(f"this rank's caches {_caches(kwargs)} are not the "
                                     f"leader's {leader['caches']}")
        replay = _Replay(leader["record"], leader.get("earlier"))
        token = _REPLAY.set(replay)
        try:
            with plain():
                result = wrapped(*args, **kwargs)
        except _ReplayMiss as miss:
            raise VerificationFailed(str(miss)) from None
        finally:
            _REPLAY.reset(token)
        if replay.missed is not None:  # a miss the library caught
            raise VerificationFailed(f"the leader made no request {replay.missed}")
        differences = _differences(_summary(result), leader["summary"])
        if differences:
            raise VerificationFailed(f"loaded other data than the leader: {differences}")
        return result

    return follow


def _recordable() -> bool:
    """huggingface_hub sends its requests through an ``httpx``/``httpx2`` client (1.x and 2.x;
    0.x uses ``requests``, whose exchanges :func:`_send` does not see)."""
    from huggingface_hub.utils import get_session

    return type(get_session()).__module__.partition(".")[0] in _HTTP_PACKAGES


def _load_dataset(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...],
                  kwargs: dict[str, Any]) -> Any:
    """``datasets.load_dataset``: coordinated (see the module docstring), but for
    ``streaming=True``, which every rank makes itself."""
    path = _argument(wrapped, args, kwargs, "path")
    streaming = bool(_argument(wrapped, args, kwargs, "streaming"))
    if streaming or not _recordable():
        topology = current_topology()
        if _state.active() and topology.distributed and current_mode() is None:
            why = ("streaming=True: every rank streams its data itself" if streaming else
                   "huggingface_hub's HTTP client is not httpx: its requests cannot be recorded")
            logger.info("[rank %d/%d] load_dataset(%r): not coordinated (%s)", topology.rank,
                        topology.world_size, path, why)
        with plain():  # its hub calls too: as without patchload
            return wrapped(*args, **kwargs)
    return coordinated("datasets.load.load_dataset", _follower(wrapped), args, kwargs,
                       what=f"load_dataset({path!r})", share=_share(kwargs),
                       lead_with=_leader(wrapped), offline_kwarg=False)


def datasets_patches() -> list[Patch]:
    """The patches for ``datasets``: ``load_dataset`` (also as ``datasets.load_dataset``), and
    the HTTP client's ``Client.send`` that records and replays its exchanges."""
    return [
        Patch("datasets.load", "load_dataset", _load_dataset, rebind_aliases=True),
        *(Patch(f"{package}._client", "Client.send", _send) for package in _HTTP_PACKAGES),
    ]
