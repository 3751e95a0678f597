"""patchload's exception types, and how a leader's exception is re-raised on followers.

Every error pickles (``__reduce__``), so it survives ``torch.multiprocessing`` and the like. A
leader's exception crosses ranks as JSON (class path, message, rank), never as a pickle; the
follower re-raises it as a class derived from the original, so an ``except`` clause written for the
plain call still catches it.
"""

from __future__ import annotations

import base64
import http.client
import importlib
import sys
from typing import Any, Final

from ._libraries import facts

from . import _runtime

__all__ = [
    "PatchloadError",
    "ConfigError",
    "LeaderFailedError",
    "LeaderInterruptedError",
    "PatchloadTimeout",
    "PatchConflictError",
    "describe_exception",
    "follower_exception",
    "requests_response",
]


class PatchloadError(RuntimeError):
    """Base of every error patchload raises itself.

    Attributes:
        rank: the global rank that raised, or None outside a distributed job.
    """

    def __init__(self, message: str, *, rank: int | None = None) -> None:
        super().__init__(message)
        self.rank = rank

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (type(self), self.args, self.__dict__))


def _blank(cls: type) -> Any:
    # OSError subclasses must be allocated by OSError.__new__ (CPython refuses the others).
    return OSError.__new__(cls) if issubclass(cls, OSError) else cls.__new__(cls)


def _rebuild(cls: type, args: tuple[Any, ...], state: dict[str, Any]) -> BaseException:
    exc = _blank(cls)
    BaseException.__init__(exc, *args)
    exc.__dict__.update(state)
    return exc


class ConfigError(PatchloadError, ValueError):
    """A ``PATCHLOAD_*`` variable holds a value outside its accepted values.

    Attributes:
        variable: the environment variable's name.
        value: the rejected value, as read.
        rank: the global rank that read it (named in the message), or None outside a
            distributed job.
    """

    def __init__(self, variable: str, value: str, accepted: str, *,
                 rank: int | None = None) -> None:
        where = "" if rank is None else f" on rank {rank}"
        super().__init__(f"{variable}={value!r} is not valid{where}: accepted values are "
                         f"{accepted}", rank=rank)
        self.variable = variable
        self.value = value


class LeaderFailedError(PatchloadError):
    """The leader of a call failed (raised, died or went silent) before publishing its outcome.

    Attributes:
        leader_rank: the global rank of the leader.
        cause: the leader's message, or why it is presumed dead.
    """

    def __init__(self, message: str, *, rank: int | None = None, leader_rank: int | None = None,
                 cause: str = "") -> None:
        super().__init__(message, rank=rank)
        self.leader_rank = leader_rank
        self.cause = cause


class LeaderInterruptedError(LeaderFailedError):
    """The leader's call was interrupted (``KeyboardInterrupt``, ``SystemExit``,
    ``GeneratorExit``: the leader's process is stopping, not an error of the call), so it has no
    outcome to pass on. A follower that waited for it makes the call plainly instead (see
    :meth:`patchload.coordination.call._Coordinated.interrupted`); where that cannot be
    (``main_process_first``), it raises this, as for a leader that died.

    Attributes:
        interrupted: the class name of what interrupted the leader, e.g. ``KeyboardInterrupt``.
    """

    def __init__(self, message: str, *, rank: int | None = None, leader_rank: int | None = None,
                 cause: str = "", interrupted: str = "") -> None:
        super().__init__(message, rank=rank, leader_rank=leader_rank, cause=cause)
        self.interrupted = interrupted


class PatchloadTimeout(PatchloadError, TimeoutError):
    """A follower waited longer than ``PATCHLOAD_TIMEOUT`` seconds for its leader.

    Attributes:
        leader_rank: the global rank waited for.
        waited_s: how long it waited, in seconds.
    """

    def __init__(self, message: str, *, rank: int | None = None, leader_rank: int | None = None,
                 waited_s: float = 0.0) -> None:
        super().__init__(message, rank=rank)
        self.leader_rank = leader_rank
        self.waited_s = waited_s


class PatchConflictError(PatchloadError):
    """Another library replaced an attribute patchload patched, so it cannot be restored."""


_CAUSE_CHARS = 500


def _root_cause(exc: BaseException) -> BaseException | None:
    """The innermost exception ``exc`` was raised from or while handling, if any."""
    seen = {id(exc)}
    current, root = exc, None
    while True:
        nxt = current.__cause__ or (None if current.__suppress_context__ else current.__context__)
        if nxt is None or id(nxt) in seen:
            return root
        seen.add(id(nxt))
        current = root = nxt


def describe_exception(exc: BaseException) -> dict[str, Any]:
    """The JSON-able description of ``exc`` a leader publishes: class path, message and, when
    ``exc`` was raised from (or while handling) another exception whose text it does not
    repeat, that root cause as ``"<class name>: <message>"`` (e.g. transformers' "Can't load the
    model" hides the network error that caused it); and, as ``state``, the JSON-able
    ``exc._patchload_state`` the leader set (what its failed call left in its process, such as
    the random-number state: :mod:`patchload.coordination.rng`)."""
    cls = type(exc)
    original = getattr(exc, "_patchload_original", None)
    if original is not None:  # a follower error re-published: keep the leader's own class
        cls = original
    description = {"module": cls.__module__, "qualname": cls.__qualname__, "message": str(exc)}
    attributes = _attributes(exc)
    if attributes:
        description["attributes"] = attributes
    root = _root_cause(exc)
    if root is not None and str(root) not in str(exc):
        description["cause"] = f"{type(root).__name__}: {str(root)[:_CAUSE_CHARS]}"
    state = getattr(exc, "_patchload_state", None)
    if isinstance(state, dict):  # what the failed call left in the leader's process
        description["state"] = state
    return description


def _attributes(exc: BaseException) -> dict[str, Any]:
    """What handlers of the plain call read on the exception, as JSON: an ``OSError``'s
    ``errno`` / ``strerror`` / ``filename``; an HTTP error's response (:func:`_described_response`);
    and the plain values the raising library set on the instance (huggingface_hub's
    ``repo_id``, ``repo_type``, ``request_id``, ``server_message``)."""
    out: dict[str, Any] = {}
    if isinstance(exc, OSError):
        out.update(errno=exc.errno, strerror=exc.strerror,
                   filename=None if exc.filename is None else str(exc.filename))
    response = _described_response(getattr(exc, "response", None))
    if response is not None:
        out["response"] = response
    values = {name: value for name, value in vars(exc).items()
              if not name.startswith("_") and name not in _SET_HERE and _plain(value)}
    if values:
        out["values"] = values
    return out


# Attributes follower_exception sets itself (a re-published follower error holds them too).
_SET_HERE: Final = frozenset({"rank", "leader_rank", "cause", "response", "request"})
_VALUE_MAX_CHARS: Final = 4096
_BODY_MAX_BYTES: Final = 64 << 10
# A recorded body is decoded; a rebuilt response must not decode it again or expect a length.
_DECODED_HEADERS: Final = frozenset({"content-encoding", "transfer-encoding", "content-length"})


def _plain(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float)) or (
        isinstance(value, str) and len(value) <= _VALUE_MAX_CHARS)


def _described_response(response: Any) -> dict[str, Any] | None:
    """An HTTP client's response (httpx's, requests') as JSON: status, headers (names as sent,
    in order), URL, reason phrase, body (up to 64 KiB, where already read), its request's method
    and URL, and the client library; None where ``response`` has no integer status."""
    status = getattr(response, "status_code", None)
    if not isinstance(status, int):
        return None
    headers = getattr(response, "headers", None)
    try:
        pairs = headers.multi_items() if hasattr(headers, "multi_items") else \
            list(dict(headers or {}).items())
        pairs = [[str(name), str(value)] for name, value in pairs]
    except (TypeError, ValueError, AttributeError):  # headers of an unexpected kind
        pairs = []
    described: dict[str, Any] = {"status_code": status, "headers": pairs,
                                 "library": type(response).__module__.partition(".")[0]}
    for name, read in (("url", lambda: str(response.url)),
                       ("reason", lambda: getattr(response, "reason_phrase", None)
                        or getattr(response, "reason", None)),
                       ("method", lambda: response.request.method),
                       ("request_url", lambda: str(response.request.url)),
                       ("content", lambda: _body(response.content))):
        try:  # httpx raises where a response has no request, or a streamed body is unread
            value = read()
        except Exception:  # noqa: BLE001 - that part is not recorded
            value = None
        if value is not None:
            described[name] = value if isinstance(value, str) else str(value)
    return described


def _body(content: Any) -> str | None:
    if not isinstance(content, bytes) or len(content) > _BODY_MAX_BYTES:
        return None
    return base64.b64encode(content).decode("ascii")


class _Response:
    """What a follower's rebuilt HTTP error holds in place of the leader's ``response`` where the
    leader's client library is not imported here: its status code, headers and URL."""

    def __init__(self, status_code: int, url: str, headers: dict[str, str]) -> None:
        self.status_code = status_code
        self.url = url
        self.headers = headers

    def __repr__(self) -> str:
        return f"<Response [{self.status_code}] from the leader>"


def _rebuilt_response(described: dict[str, Any]) -> Any:
    """The leader's response (:func:`_described_response`) as its client library's own
    ``Response``, with a request of that library, when this process has imported that library;
    else a :class:`_Response` holding the status, headers and URL."""
    status = int(described["status_code"])
    pairs = [(str(name), str(value)) for name, value in described.get("headers", [])]
    content = base64.b64decode(described["content"]) if "content" in described else b""
    method, request_url = described.get("method"), described.get("request_url")
    library = sys.modules.get(str(described.get("library")))
    name = getattr(library, "__name__", "")
    if name in ("httpx", "httpx2"):
        kept = [(k, v) for k, v in pairs if k.lower() not in _DECODED_HEADERS
                or (k.lower() == "content-length" and method == "HEAD")]
        request = library.Request(method, request_url) if method and request_url else None
        return library.Response(status, headers=kept, content=content, request=request)
    if name == "requests":
        request = library.Request(method, request_url).prepare() \
            if method and request_url else None
        return requests_response(library, status, pairs, content, request,
                                 reason=described.get("reason"), url=described.get("url", ""))
    return _Response(status, str(described.get("url", "")), dict(pairs))


def requests_response(requests: Any, status: int, headers: list[tuple[str, str]] | list[list[str]],
                      content: bytes, request: Any, *, reason: str | None = None,
                      url: str | None = None) -> Any:
    """A ``requests.Response`` as ``HTTPAdapter.build_response`` makes it, its body already
    read (no connection behind it: ``raw`` is None). ``reason``: the standard phrase of
    ``status`` when None; ``url``: the request's when None."""
    response = requests.Response()
    response.status_code = status
    response.headers = requests.structures.CaseInsensitiveDict([tuple(h) for h in headers])
    response.encoding = requests.utils.get_encoding_from_headers(response.headers)
    response.reason = http.client.responses.get(status, "") if reason is None else reason
    response.url = (getattr(request, "url", "") or "") if url is None else url
    response.request = request
    response._content = content
    response._content_consumed = True
    return response


# Packages whose exceptions the patched calls raise: patchload's own, and those the patch
# registry names (``LibraryFacts.importable``, handed down by install()). A follower that has not
# run the call yet may not have imported the module of the leader's exception class (safetensors
# is imported only when transformers.modeling_utils is); the plain call would import it, so it
# may be imported here.
_OWN_PACKAGE: Final = "patchload"


def _resolve_class(module: str, qualname: str) -> type[BaseException] | None:
    # Only classes of modules this process already imported, or of the packages above: nothing
    # named by the store outside them is imported, and nothing from the store is executed.
    obj: Any = sys.modules.get(module)
    package = module.partition(".")[0]
    if obj is None and (package == _OWN_PACKAGE or package in facts().importable):
        try:
            obj = importlib.import_module(module)
        except Exception:  # noqa: BLE001 - not importable here: LeaderFailedError instead
            obj = None
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    if isinstance(obj, type) and issubclass(obj, BaseException):
        return obj
    return None


class _FollowerClasses:
    """The follower classes this install made: a leader's exception class -> its subclass."""

    def __init__(self) -> None:
        self.made: dict[type, type] = {}


def _follower_class(original: type[BaseException]) -> type[BaseException]:
    made = _runtime.current().part(_FollowerClasses).made
    cls = made.get(original)
    if cls is not None:
        return cls
    namespace = {"__str__": lambda self: self._patchload_message,
                 "__reduce__": lambda self: (_rebuild_follower, (
                     original, self._patchload_message, self.rank, self.leader_rank,
                     getattr(self, "__notes__", None))),
                 "__module__": original.__module__}
    try:
        cls = type(original.__name__, (original, LeaderFailedError), namespace)
    except TypeError:  # instance layouts conflict (C-level bases): keep only the original
        cls = type(original.__name__, (original,), namespace)
    cls.__qualname__ = original.__qualname__
    made[original] = cls
    return cls


def _rebuild_follower(original: type[BaseException], message: str, rank: int | None,
                      leader_rank: int | None, notes: list[str] | None = None) -> BaseException:
    exc = follower_exception({"module": original.__module__, "qualname": original.__qualname__,
                              "message": message}, rank=rank, leader_rank=leader_rank, note="")
    if notes:
        exc.__notes__ = list(notes)
    return exc


def follower_exception(description: dict[str, str], *, rank: int | None, leader_rank: int | None,
                       note: str) -> BaseException:
    """Rebuild a leader's exception on a follower.

    Args:
        description: what :func:`describe_exception` returned on the leader.
        rank: this follower's global rank.
        leader_rank: the leader's global rank.
        note: names the ranks and the action; set as the exception's ``__notes__`` (what
            ``add_note`` sets: a traceback prints it under the message), with the leader's
            root cause, if any, after it.

    Returns:
        An exception whose class derives from the leader's class (and from
        :class:`LeaderFailedError` where the layouts allow), so ``except`` clauses written for the
        plain call catch it, and whose ``str()`` is the leader's message, as the plain call's
        would be; :class:`LeaderFailedError` (note and message in its text) when the class is
        not importable here. The original ``__init__`` is not called: ``args``, ``rank``,
        ``leader_rank`` and ``cause`` are set, plus what handlers read on the plain call's
        exception: an ``OSError``'s ``errno`` / ``strerror`` / ``filename``, an HTTP error's
        ``response`` (its client library's own, with its request, headers and body) and
        ``request``, and the plain values the library set on it (``repo_id``, ``request_id``).
    """
    message = description.get("message", "")
    if description.get("cause"):
        note += f" (caused on the leader by {description['cause']})"
    original = _resolve_class(description.get("module", ""), description.get("qualname", ""))
    if original is None:
        name = f"{description.get('module')}.{description.get('qualname')}"
        failed = LeaderFailedError(f"{note}: {message} (leader raised {name})", rank=rank,
                                   leader_rank=leader_rank, cause=message)
        failed._patchload_state = description.get("state")
        return failed
    cls = _follower_class(original)
    exc = _blank(cls)
    BaseException.__init__(exc, message)
    exc._patchload_message = message
    exc._patchload_original = original
    exc.rank = rank
    exc.leader_rank = leader_rank
    exc.cause = message
    exc._patchload_state = description.get("state")
    if note:
        exc.__notes__ = [note]  # what add_note() sets (Python 3.11+ prints it in tracebacks)
    attributes = description.get("attributes") or {}
    if isinstance(exc, OSError):
        for name in ("errno", "strerror", "filename"):
            setattr(exc, name, attributes.get(name))
    if "response" in attributes:
        exc.response = _rebuilt_response(attributes["response"])
        exc.request = getattr(exc.response, "request", None)
    for name, value in (attributes.get("values") or {}).items():
        setattr(exc, name, value)
    return exc
