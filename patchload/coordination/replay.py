"""A leader's HTTP exchanges, recorded, and replayed to its followers.

huggingface_hub (>= 1) sends every request through an ``httpx`` client (``httpx2`` for 2.x):
``Client.send`` is patched here. Inside a leader's call that records (:func:`recording`), each
non-streamed exchange (API calls, HEAD/metadata requests; not a file body, which a follower finds
in the cache the leader filled) is recorded: the request (method, URL, ``Range``, body digest)
and the response (status, headers, body), or the transport error. Inside a block of
:func:`recording_bodies` (a user's file read through ``HfFileSystem``, whose body lands in no
cache), a streamed response is recorded too, once the leader has read its body to the end, where
that body is at most the block's bound. Inside a follower's call that replays
(:func:`replaying`), each request is answered from its leader's record (:class:`Replay`).
Elsewhere the patch passes every request straight through.

huggingface_hub 0.x sends through ``requests``: there ``HTTPAdapter.send`` is patched instead
(one hop of a redirect each; ``Session.send`` follows the redirects), with the same record and
replay, except that no streamed body is ever recorded (a user's ``HfFileSystem`` read goes to the
hub from every rank, as plain).
"""

from __future__ import annotations

import base64
import collections
import contextlib
import contextvars
import hashlib
import importlib.metadata
import sys
import threading
from typing import Any, Callable, Final, Iterator

from .._errors import requests_response
from .._logging import get_logger
from .._patching import Patch

__all__ = ["History", "HISTORY", "LeaderAnswers", "Record", "Replay", "ReplayMiss",
           "answer_key", "current_replay", "http_patches", "rebuilt_error", "recordable",
           "recording", "recording_bodies", "is_answer", "recording_active", "replaying",
           "request_key"]

logger = get_logger(__name__)

# Response headers an ``httpx`` response is not rebuilt with: the recorded body is already
# decoded, and httpx sets its length from it (a ``HEAD`` answer keeps its Content-Length: it has
# no body, and huggingface_hub reads a file's size from it). A ``requests`` response keeps every
# header, as a plain one does (its body is decoded too; nothing decodes it again).
_UNREPLAYED_HEADERS: Final = frozenset({"content-encoding", "transfer-encoding", "content-length"})
_HTTP_PACKAGES: Final = ("httpx2", "httpx")
# The packages whose transport errors a follower raises again from its leader's record.
_ERROR_PACKAGES: Final = (*_HTTP_PACKAGES, "requests", "urllib3")
_HISTORY_MAX_BYTES: Final = 4 << 20
# A coordinated call's leader publishes each answer it records in the job's store: a response
# body past this (a listing of many thousand files) is not recorded, and a follower that makes
# the same request sends it to the hub itself.
_MAX_ANSWER_BYTES: Final = 4 << 20
# Where a coordinated call's leader publishes each recorded answer among its pins.
_ANSWER_PREFIX: Final = "http:"

# The leader's call: the exchanges recorded so far (None: not recording).
_RECORDING: contextvars.ContextVar[list[dict[str, Any]] | Record | None] = contextvars.ContextVar(
    "patchload_recording", default=None)
# The largest streamed body recorded, in bytes (None: streamed bodies are not recorded).
_BODIES_MAX_BYTES: contextvars.ContextVar[int | None] = contextvars.ContextVar(
    "patchload_bodies_max_bytes", default=None)
# A follower's rerun: the leader's record it answers from (None: not replaying).
_REPLAY: contextvars.ContextVar[Replay | LeaderAnswers | None] = contextvars.ContextVar(
    "patchload_replay", default=None)


class ReplayMiss(BaseException):
    """A follower's rerun made a request its leader never made. A BaseException, so that the
    library code in between (``except Exception``) cannot take it for a hub error and go on."""


def request_key(request: Any) -> str:
    """``<METHOD> <url> <body sha1>``, and `` range=<Range header>`` where the request has one
    (a read from an offset): what a follower's request must equal to get the leader's answer
    (other headers differ per rank: the user agent names the rank)."""
    try:
        body = hashlib.sha1(_request_body(request)).hexdigest()
    except Exception:  # noqa: BLE001 - a streaming body (an upload): never replayed
        body = "stream"
    key = f"{request.method} {request.url} {body}"
    byte_range = request.headers.get("range")
    return key if byte_range is None else f"{key} range={byte_range.replace(' ', '')}"


def _request_body(request: Any) -> bytes:
    """The body of an ``httpx`` request (``content``; raises for a stream) or of a ``requests``
    ``PreparedRequest`` (``body``: bytes, str or None; raises for a stream)."""
    if not _is_requests(request):
        return request.content
    body = request.body
    if body is None or isinstance(body, bytes):
        return body or b""
    if isinstance(body, str):
        return body.encode("utf-8")
    raise TypeError(f"a streamed request body ({type(body).__name__})")


def _is_requests(obj: Any) -> bool:
    """Whether ``obj`` (a request or a response) is the ``requests`` library's."""
    return type(obj).__module__.partition(".")[0] == "requests"


def _shown(key: str) -> str:
    """A :func:`request_key` without its body digest, for a log line."""
    method, url, _rest = key.split(" ", 2)
    return f"{method} {url}"


def _error_entry(err: BaseException) -> dict[str, str]:
    return {"module": type(err).__module__, "qualname": type(err).__qualname__,
            "message": str(err)}


class History:
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
        """Keep ``entries`` (a call's record), except a file's body (no cache holds one)."""
        with self._lock:
            for entry in entries:
                if entry.get("body"):
                    continue
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


HISTORY: Final = History(_HISTORY_MAX_BYTES)


class Replay:
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

    def answer(self, request: Any, send: Callable[[], Any]) -> Any:
        """The leader's response to ``request`` (an ``httpx`` request), or its transport error
        raised again (``send`` is never called: a request the leader never made is a miss).

        Raises:
            ReplayMiss: the leader never made this request.
        """
        key = request_key(request)
        queue = self._answers.get(key)
        entry = queue.popleft() if queue else self._last.get(key)
        if entry is None:
            self.missed = key
            raise ReplayMiss(f"the leader made no request {_shown(key)}")
        self._last[key] = entry
        self.answered += 1
        return _response(entry, request, key)


def answer_key(key: str, occurrence: int) -> str:
    """The pin under which a coordinated call's leader publishes the answer to its
    ``occurrence``-th (from 0) request :func:`request_key` ``key``."""
    return f"{_ANSWER_PREFIX}{key}#{occurrence}"


def is_answer(pin_key: str) -> bool:
    """Whether a pin key names a recorded answer (:func:`answer_key`), not a hub file."""
    return pin_key.startswith(_ANSWER_PREFIX)


class Record(list):  # type: ignore[type-arg]
    """A coordinated call's leader's record: each exchange appended (by :func:`_send`, from any
    thread of the call) is handed to ``added`` with its :func:`answer_key` at once, so that a
    model load's followers, which start at once, get it while the leader goes on. An answer
    whose body is larger than :data:`_MAX_ANSWER_BYTES` is not handed on, except a streamed
    body (``"body": True``), which :func:`recording_bodies`' own bound limits already."""

    def __init__(self, added: Callable[[str, dict[str, Any]], None]) -> None:
        super().__init__()
        self._added = added
        self._lock = threading.Lock()
        self._counts: collections.Counter[str] = collections.Counter()

    def append(self, entry: dict[str, Any]) -> None:
        with self._lock:
            occurrence = self._counts[entry["key"]]
            self._counts[entry["key"]] += 1
            super().append(entry)
        if entry.get("body") or len(entry.get("content", "")) <= _MAX_ANSWER_BYTES:
            self._added(answer_key(entry["key"], occurrence), entry)


class LeaderAnswers:
    """A follower's answers from its leader's record, as the leader publishes it: the
    ``n``-th request of a kind (:func:`request_key`) gets the leader's ``n``-th answer to it.
    One the leader has not answered yet is waited for (``wait``: until the leader published it
    or its outcome, bounded by ``PATCHLOAD_TIMEOUT``); one it never answered, or answered with
    a transport error whose class cannot be rebuilt here (:func:`rebuilt_error`), is sent to the
    hub as a plain rank sends it (never guessed) and counted in :attr:`unrecorded`.

    Args:
        lookup: the leader's published answer under an :func:`answer_key`, or None; never
            waits.
        wait: waits until the leader published that answer or its outcome (returns at once
            where this rank must not wait); raises the leader's failure.
        what: the call, for the log line of a wait.
    """

    def __init__(self, lookup: Callable[[str], dict[str, Any] | None],
                 wait: Callable[[str], None], what: str) -> None:
        self._lookup = lookup
        self._wait = wait
        self._what = what
        self._lock = threading.Lock()
        self._counts: collections.Counter[str] = collections.Counter()
        self.answered = 0
        self.unrecorded = 0

    def answer(self, request: Any, send: Callable[[], Any]) -> Any:
        """The leader's response to ``request``, its transport error raised again, or (a
        request the leader never made) ``send()``."""
        key = request_key(request)
        with self._lock:
            occurrence = self._counts[key]
            self._counts[key] += 1
        name = answer_key(key, occurrence)
        entry = self._lookup(name)
        if entry is None:
            logger.debug("%s: waiting for the leader's answer to %s (#%d)", self._what,
                         _shown(key), occurrence)
            self._wait(name)
            entry = self._lookup(name)
        if entry is None:
            with self._lock:
                self.unrecorded += 1
            logger.debug("%s: the leader made no request %s (#%d): sent to the hub", self._what,
                         _shown(key), occurrence)
            return send()
        try:
            response = _response(entry, request, key)
        except ReplayMiss:  # the leader's transport error, of a class not rebuilt here
            with self._lock:
                self.unrecorded += 1
            return send()
        with self._lock:
            self.answered += 1
        return response


def _response(entry: dict[str, Any], request: Any, key: str) -> Any:
    """The recorded response as the client library's own ``Response`` to ``request``, or the
    recorded transport error raised again."""
    package = sys.modules[type(request).__module__.partition(".")[0]]
    if "error" in entry:
        raise rebuilt_error(entry["error"], key, _ERROR_PACKAGES, request=request)
    content = base64.b64decode(entry["content"])
    if package.__name__ == "requests":
        return requests_response(package, entry["status"], entry["headers"], content, request)
    dropped = _UNREPLAYED_HEADERS - ({"content-length"} if request.method == "HEAD" else set())
    headers = [(name, value) for name, value in entry["headers"] if name.lower() not in dropped]
    return package.Response(entry["status"], headers=headers, content=content, request=request)


def rebuilt_error(error: dict[str, str], key: str, packages: tuple[str, ...],
                  **kwargs: Any) -> BaseException:
    """The leader's recorded error of request ``key`` (``{"module", "qualname", "message"}``:
    a connection refused, a timeout) as an instance of its class, built from its message and
    ``kwargs`` (from its message alone where the class takes no such keyword); a
    :class:`ReplayMiss` where the class is not from one of ``packages`` (top-level names) or
    cannot be built so."""
    cls: Any = sys.modules.get(error["module"]) \
        if error["module"].partition(".")[0] in packages else None
    for part in error["qualname"].split("."):
        cls = getattr(cls, part, None)
    miss = ReplayMiss(f"the leader's request {key} raised {error['qualname']}, which cannot be "
                      "rebuilt here")
    if not (isinstance(cls, type) and issubclass(cls, Exception)):
        return miss
    for extra in ((kwargs, {}) if kwargs else ({},)):
        try:
            return cls(error["message"], **extra)
        except Exception:  # noqa: BLE001 - a class that takes other arguments
            continue
    return miss


@contextlib.contextmanager
def recording(record: list[dict[str, Any]] | Record | None) -> Iterator[None]:
    """Record the block's HTTP exchanges into ``record`` (see the module docstring; None: do
    not record them)."""
    token = _RECORDING.set(record)
    try:
        yield
    finally:
        _RECORDING.reset(token)


@contextlib.contextmanager
def recording_bodies(max_bytes: int) -> Iterator[None]:
    """Inside the block, a leader that records also records each streamed response (a file's
    body) that it reads to the end, where the body (as sent: no ``Content-Encoding``) is at most
    ``max_bytes`` bytes; a larger one, one read in part, one whose stream fails or one sent
    encoded is not recorded, and a follower's same request goes to the hub, as plain. The
    leader's own read is unchanged: the chunks are kept as they pass.

    Args:
        max_bytes: the largest body recorded, in bytes.
    """
    token = _BODIES_MAX_BYTES.set(max_bytes)
    try:
        yield
    finally:
        _BODIES_MAX_BYTES.reset(token)


@contextlib.contextmanager
def replaying(replay: Replay | LeaderAnswers | None) -> Iterator[None]:
    """Answer the block's HTTP requests from ``replay`` (None: pass them through)."""
    token = _REPLAY.set(replay)
    try:
        yield
    finally:
        _REPLAY.reset(token)


def current_replay() -> Replay | LeaderAnswers | None:
    """The replay answering this context's requests, or None."""
    return _REPLAY.get()


def _send(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...],
          kwargs: dict[str, Any]) -> Any:
    """``Client.send`` (``requests``: ``HTTPAdapter.send``): inside a follower's rerun, answered
    from its leader's record; inside a leader's call, made and recorded (a streamed response, a
    file body, is not recorded: a follower finds the file in the cache the leader filled);
    elsewhere passed through. Both at once for a node leader that follows the job's leader
    (several nodes on one cache): the answers it gets are recorded for its own node's
    followers."""
    request = kwargs["request"] if "request" in kwargs else args[0]
    replay, record = _REPLAY.get(), _RECORDING.get()
    streamed = _streamed(request, args, kwargs)

    def send() -> Any:
        # A streamed requests response is never recorded (nor its body): sent, as plain.
        if replay is not None and not (streamed and _is_requests(request)):
            return replay.answer(request, lambda: wrapped(*args, **kwargs))
        return wrapped(*args, **kwargs)

    if record is None:
        return send()
    key = request_key(request)
    try:
        response = send()
    except Exception as err:
        record.append({"key": key, "error": _error_entry(err)})
        raise
    if not streamed:
        record.append({"key": key, "status": response.status_code,
                       "headers": _header_items(response),
                       "content": base64.b64encode(response.content).decode("ascii")})
    elif _BODIES_MAX_BYTES.get() is not None and not _is_requests(response):
        _record_body(response, key, record, _BODIES_MAX_BYTES.get())
    return response


def _streamed(request: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
    """Whether the response's body is streamed: ``stream=`` of ``httpx``'s ``Client.send``
    (keyword-only) or of ``requests``' ``HTTPAdapter.send(request, stream, ...)``."""
    if "stream" in kwargs:
        return bool(kwargs["stream"])
    return _is_requests(request) and len(args) > 1 and bool(args[1])


def _header_items(response: Any) -> list[list[str]]:
    """A response's headers as ``[name, value]`` pairs (``httpx`` keeps repeated ones apart;
    ``requests`` has joined them)."""
    items = response.headers.multi_items() if hasattr(response.headers, "multi_items") \
        else response.headers.items()
    return [list(item) for item in items]


def _record_body(response: Any, key: str, record: list[dict[str, Any]] | Record,
                 max_bytes: int) -> None:
    """Record streamed ``response`` (its body as its reader reads it) once read to the end, if
    its body is at most ``max_bytes`` bytes and sent as it is (see :func:`recording_bodies`); a
    response already read (an answer replayed to a node leader that follows the job's leader)
    is recorded at once, for that node's followers."""
    headers = response.headers
    if headers.get("content-encoding", "identity").strip().lower() != "identity":
        return
    length = headers.get("content-length")
    if length is not None and (not length.strip().isdigit() or int(length) > max_bytes):
        return

    def done(body: bytes) -> None:
        record.append({"key": key, "status": response.status_code,
                       "headers": _header_items(response),
                       "content": base64.b64encode(body).decode("ascii"), "body": True})

    if response.is_stream_consumed:  # an answer replayed to a node leader: its body is here
        if len(response.content) <= max_bytes:
            done(response.content)
        return
    package = sys.modules[type(response).__module__.partition(".")[0]]
    response.stream = _recorded_stream(package.SyncByteStream)(response.stream, max_bytes, done)


def _recorded_stream(base: type) -> type:
    """A ``SyncByteStream`` subclass of the client library's (``base``: a response's stream
    must be one) that passes a stream's chunks on and hands the whole body to ``done`` once
    read to the end, if at most ``max_bytes`` bytes. Built per response (no cache: no state
    outside the runtime)."""

    class RecordedStream(base):  # type: ignore[misc, valid-type]
        def __init__(self, stream: Any, max_bytes: int, done: Callable[[bytes], None]) -> None:
            self._stream = stream
            self._max_bytes = max_bytes
            self._done = done

        def __iter__(self) -> Iterator[bytes]:
            chunks: list[bytes] | None = []
            size = 0
            for chunk in self._stream:
                if chunks is not None:
                    size += len(chunk)
                    if size <= self._max_bytes:
                        chunks.append(chunk)
                    else:
                        chunks = None
                yield chunk
            if chunks is not None:
                self._done(b"".join(chunks))

        def close(self) -> None:
            self._stream.close()

    return RecordedStream


def recordable(*, through_requests: bool = True) -> bool:
    """huggingface_hub sends its requests through an ``httpx``/``httpx2`` client (1.x and 2.x)
    or, with ``through_requests``, a ``requests`` session (0.x): both are recorded and
    replayed. False for another client (a ``configure_http_backend`` factory of the user's)."""
    from huggingface_hub.utils import get_session

    client = type(get_session()).__module__.partition(".")[0]
    return client in _HTTP_PACKAGES or (through_requests and client == "requests")


def recording_active() -> bool:
    """Whether this context records its HTTP exchanges (a leader's call)."""
    return _RECORDING.get() is not None


def http_patches() -> list[Patch]:
    """The patches that record and replay huggingface_hub's exchanges: ``httpx``'s and
    ``httpx2``'s ``Client.send``, and where the installed huggingface_hub is 0.x (its client is
    ``requests``) ``requests``' ``HTTPAdapter.send``. Not there for huggingface_hub >= 1: other
    libraries' ``requests`` traffic (evaluate records its own) stays as it is."""
    patches = [Patch(f"{package}._client", "Client.send", _send) for package in _HTTP_PACKAGES]
    try:
        hub_major = importlib.metadata.version("huggingface_hub").partition(".")[0]
    except importlib.metadata.PackageNotFoundError:
        return patches
    if hub_major == "0":
        patches.append(Patch("requests.adapters", "HTTPAdapter.send", _send))
    return patches
