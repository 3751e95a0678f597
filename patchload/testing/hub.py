"""A loopback Hugging Face Hub that serves repos from local folders over real HTTP.

:class:`LoopbackHub` runs a stdlib :class:`http.server.ThreadingHTTPServer` on ``127.0.0.1`` in
daemon threads. Point the real ``huggingface_hub`` client at it with
``HF_ENDPOINT=<hub.endpoint>`` and ``HF_HUB_DISABLE_XET=1`` (set *before* ``huggingface_hub`` is
imported: the client freezes both at import) and ``hf_hub_download``, ``snapshot_download``,
``HfApi.model_info`` / ``list_repo_tree`` / ``get_paths_info`` and ``from_pretrained`` work
against it, with no internet.

Served endpoints (``{type}`` is ``models``, ``datasets`` or ``spaces``; ``{rev}`` is a branch name,
url-encoded if it has a ``/``, or a full 40-hex commit sha):

* ``HEAD``/``GET /[{type}/]{repo_id}/resolve/{rev}/{path}``: file bytes, with ``X-Repo-Commit``,
  ``ETag`` (git blob sha1; sha256 for LFS-style files, also in ``X-Linked-Etag`` with
  ``X-Linked-Size``), ``Content-Length`` and ``Range`` (206) support.
* ``GET /api/{type}/{repo_id}`` and ``.../revision/{rev}``: repo info (``sha``, ``siblings``).
* ``GET /api/{type}/{repo_id}/tree/{rev}[/{path}]`` (``recursive`` query parameter).
* ``POST /api/{type}/{repo_id}/paths-info/{rev}`` (form or JSON body with ``paths``).
* ``GET /api/{type}/{repo_id}/commits/{rev}``, ``.../refs``, ``.../discussions`` (always empty).
* ``GET /api/agent-harnesses``: an empty registry (``huggingface_hub`` fetches it once a day per
  ``HF_HOME``, without the usual headers, so such requests carry no rank).

Errors carry the headers ``huggingface_hub.utils.hf_raise_for_status`` maps to exception classes:
``X-Error-Code: RepoNotFound`` (:class:`~huggingface_hub.errors.RepositoryNotFoundError`),
``RevisionNotFound``, ``EntryNotFound`` and ``GatedRepo``.

:meth:`LoopbackHub.restrict` makes a repo gated or private, readable with the tokens given
(``Authorization: Bearer <token>``), answering as the real hub does: a gated repo's info
(``GET /api/{type}/{repo_id}``, with ``"gated": "manual"``) is public, its files are not (401
``GatedRepo`` "... Please log in." without a token, 403 ``GatedRepo`` "... not in the authorized
list" with another); a private repo is hidden on every endpoint (401 ``RepoNotFound`` without a
token, 404 ``RepoNotFound`` with another), its info says ``"private": true`` to a token that
may read it. Any token reads a public repo (tokens are not validated). Unknown endpoints are logged and
answered with a plain 404 JSON error; a bug in a handler answers 500 and never stops the server.

Every request is recorded as a :class:`Request` (and, with ``log_path``, appended to a JSON-lines
file that :func:`read_request_log` parses). The rank of the client comes from its User-Agent:
``huggingface_hub`` appends ``; origin/<value>`` when ``HF_HUB_USER_AGENT_ORIGIN`` is set, so a
process run with ``HF_HUB_USER_AGENT_ORIGIN=rank-3`` is recorded with ``rank=3``.

:class:`Fault` objects added with :meth:`LoopbackHub.add_fault` turn matching requests into errors,
dropped connections or slow/truncated bodies.

Command line (serves until SIGTERM/SIGINT)::

    python -m patchload.testing.hub --repo org/name=/path/to/folder [--repo ...] \\
        --port-file endpoint.txt --log requests.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import fnmatch
import hashlib
import http.server
import json
import logging
import os
import re
import signal
import socket
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Iterable, Sequence
from urllib.parse import parse_qs, unquote, urlsplit

from .._logging import get_logger

__all__ = ["Fault", "LoopbackHub", "Request", "read_request_log"]

logger = get_logger(__name__)

_REPO_TYPES: Final = ("model", "dataset", "space")
_URL_PREFIX_TO_TYPE: Final = {"datasets": "dataset", "spaces": "space"}
_API_PLURAL_TO_TYPE: Final = {"models": "model", "datasets": "dataset", "spaces": "space"}
_API_SUBPATHS: Final = frozenset(
    {"resolve", "tree", "blob", "raw", "refs", "commit", "commits", "discussions", "settings",
     "revision", "paths-info", "treesize", "xet-read-token"}
)
_LFS_SUFFIXES: Final = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack",
                        ".onnx", ".gguf", ".model", ".npz", ".npy", ".tflite", ".ot")
_LFS_MIN_BYTES: Final = 1_000_000
_FIXED_DATE: Final = "2024-01-01T00:00:00.000Z"
_RANK_RE: Final = re.compile(r"origin/rank-(\d+)")
_COMMIT_RE: Final = re.compile(r"[0-9a-f]{40}")
_CHUNK_BYTES: Final = 1 << 20
_THROTTLE_TICK_S: Final = 0.05
_SOCKET_TIMEOUT_S: Final = 120.0


# --------------------------------------------------------------------------------------------
# Public records
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True, slots=True)
class Request:
    """One request the hub answered (or dropped), recorded after the response ended."""

    method: str
    """HTTP method, e.g. ``"HEAD"``."""
    path: str
    """URL path as sent, without the query string (still percent-encoded)."""
    status: int
    """Status code sent; ``0`` when the connection was closed without a response."""
    rank: int | None
    """``N`` from ``origin/rank-N`` in the User-Agent, or None."""
    bytes_sent: int
    """Body bytes written to the socket (0 for HEAD), in bytes."""
    time: float
    """When the request arrived, in seconds since the epoch (``time.time()``)."""
    duration_s: float = 0.0
    """Seconds from arrival to the end of the response."""
    query: str = ""
    """Raw query string, without the ``?``."""
    repo_id: str | None = None
    """Repo the URL names, if any (registered or not)."""
    filename: str | None = None
    """Decoded path inside the repo for ``/resolve/`` requests, else None."""
    range: str | None = None
    """The request's ``Range`` header, if any."""
    fault: str | None = None
    """Short description of the :class:`Fault` applied, if any."""
    user_agent: str | None = None
    """The request's ``User-Agent`` header, if any (a request without ``origin/rank-N`` can still
    be told apart by the client's session id in it, e.g. transformers' ``session_id/<hex>``)."""

    def to_json(self) -> str:
        """Returns the record as one line of JSON (no trailing newline)."""
        return json.dumps(dataclasses.asdict(self), sort_keys=True)


def read_request_log(path: str | os.PathLike[str], *, min_records: int = 0,
                     timeout_s: float = 0.0) -> list[Request]:
    """Parses a JSON-lines request log written by a hub started with ``log_path``.

    A request is logged just after its response is written, so a client may finish before its
    last requests are in the file; ``min_records`` with ``timeout_s`` waits for them.

    Args:
        path: The log file. A missing file reads as no requests; a torn last line (the hub was
            writing it) is skipped.
        min_records: Poll until the file holds at least this many records...
        timeout_s: ...or this many seconds have passed (then return what is there).

    Returns:
        The recorded requests, oldest first.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        records = _parse_request_log(Path(path))
        if len(records) >= min_records or time.monotonic() >= deadline:
            return records
        time.sleep(0.02)


def _parse_request_log(path: Path) -> list[Request]:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return []
    records: list[Request] = []
    for line in text.splitlines():
        if not line.strip():
            continue
        try:
            records.append(Request(**json.loads(line)))
        except (json.JSONDecodeError, TypeError):
            logger.debug("skipping unreadable request log line %r", line)
    return records


@dataclass(frozen=True, kw_only=True, slots=True)
class Fault:
    """A misbehaviour applied to matching requests.

    A request matches when every given filter matches. Faults are checked in the order they were
    added; the first matching one with uses left applies (one fault per request).

    Exactly what happens is set by the action fields; with several set, a ``status`` or ``close``
    wins (no body is sent), otherwise ``stall_s``, ``throttle_bytes_per_s`` and
    ``abort_after_bytes`` combine on the normal response body.

    Example::

        hub.add_fault(Fault(repo_id="org/tiny", path="*.safetensors", method="GET",
                            abort_after_bytes=1000, times=1))
    """

    repo_id: str | None = None
    """Repo the request must name; None matches any repo (and non-repo URLs)."""
    path: str | None = None
    """:func:`fnmatch.fnmatch` glob. For ``/resolve/`` requests it is matched against the decoded
    path inside the repo (``"*.safetensors"``, ``"config.json"``); for every other request against
    the URL path (``"/api/*"``, ``"*/tree/*"``). None matches all paths."""
    method: str | None = None
    """``"HEAD"``, ``"GET"`` or ``"POST"``; None matches all methods."""
    rank: int | None = None
    """Only requests whose User-Agent says ``origin/rank-<rank>``; None matches any client."""
    times: int | None = None
    """Apply to the first ``times`` matching requests, then stop matching; None: all of them."""
    status: int | None = None
    """Answer with this status instead: 404 (``RepoNotFound``), 401 (``GatedRepo``), 429 (with
    ``retry_after_s``), 500 or any other code (plain JSON error)."""
    retry_after_s: int | None = None
    """With ``status=429`` (or 503): the ``Retry-After`` header, in seconds."""
    close: bool = False
    """Close the connection without sending any response."""
    throttle_bytes_per_s: int | None = None
    """Send a ``/resolve/`` file body at about this rate, in bytes per second."""
    abort_after_bytes: int | None = None
    """For a ``/resolve/`` GET: send the headers with the full ``Content-Length``, then only this
    many body bytes, then close the connection."""
    stall_s: float | None = None
    """Send the headers, then sleep this many seconds before the body (or before ending a HEAD).
    Any response. If the hub stops meanwhile, the connection is dropped."""

    def describe(self) -> str:
        """Returns a short description of the action, e.g. ``"status=500"``."""
        parts = []
        for name in ("status", "retry_after_s", "close", "throttle_bytes_per_s",
                     "abort_after_bytes", "stall_s"):
            value = getattr(self, name)
            if value not in (None, False):
                parts.append("%s=%s" % (name, value))
        return ",".join(parts) or "noop"

    def _matches(self, *, repo_id: str | None, match_path: str, method: str,
                 rank: int | None) -> bool:
        if self.repo_id is not None and self.repo_id != repo_id:
            return False
        if self.method is not None and self.method.upper() != method:
            return False
        if self.rank is not None and self.rank != rank:
            return False
        return self.path is None or fnmatch.fnmatchcase(match_path, self.path)


# --------------------------------------------------------------------------------------------
# Repo storage
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _File:
    path: str  # POSIX path inside the repo
    size: int  # bytes
    git_sha1: str  # git blob sha1 of the content
    sha256: str
    lfs: bool
    blob: Path  # content-addressed copy owned by the hub

    @property
    def pointer(self) -> bytes:
        return ("version https://git-lfs.github.com/spec/v1\noid sha256:%s\nsize %d\n"
                % (self.sha256, self.size)).encode()

    @property
    def etag(self) -> str:
        return self.sha256 if self.lfs else self.git_sha1

    def tree_entry(self) -> dict[str, Any]:
        """The ``/tree`` and ``/paths-info`` JSON object of this file."""
        if not self.lfs:
            return {"type": "file", "oid": self.git_sha1, "size": self.size, "path": self.path}
        pointer = self.pointer
        return {"type": "file", "oid": _git_blob_sha1(pointer), "size": self.size,
                "path": self.path,
                "lfs": {"oid": self.sha256, "size": self.size, "pointerSize": len(pointer)}}


@dataclass(slots=True)
class _Repo:
    repo_type: str
    repo_id: str
    branches: dict[str, str]  # branch name -> commit sha
    snapshots: dict[str, dict[str, _File]]  # commit sha -> path -> file
    access: str = "public"  # "public", "gated" or "private" (see LoopbackHub.restrict)
    tokens: frozenset[str] = frozenset()  # the tokens that may read a gated or private repo

    def resolve(self, revision: str) -> str | None:
        """Returns the commit sha for a branch name or a known full commit sha."""
        if revision in self.branches:
            return self.branches[revision]
        if revision in self.snapshots:
            return revision
        return None


def _git_blob_sha1(data: bytes) -> str:
    digest = hashlib.sha1(b"blob %d\0" % len(data))
    digest.update(data)
    return digest.hexdigest()


def _is_lfs(path: str, size: int) -> bool:
    return path.endswith(_LFS_SUFFIXES) or size >= _LFS_MIN_BYTES


def _snapshot_folder(folder: Path, blob_dir: Path) -> dict[str, _File]:
    """Hashes every file under ``folder`` and copies it into ``blob_dir`` (content-addressed)."""
    files: dict[str, _File] = {}
    for source in sorted(p for p in folder.rglob("*") if p.is_file()):
        rel = source.relative_to(folder).as_posix()
        if rel.startswith(".git/") or rel == ".git":
            continue
        data = source.read_bytes()
        sha256 = hashlib.sha256(data).hexdigest()
        blob = blob_dir / sha256
        if not blob.exists():
            tmp = blob_dir / (sha256 + ".tmp")
            tmp.write_bytes(data)
            os.replace(tmp, blob)
        files[rel] = _File(path=rel, size=len(data), git_sha1=_git_blob_sha1(data), sha256=sha256,
                           lfs=_is_lfs(rel, len(data)), blob=blob)
    return files


def _commit_sha(files: dict[str, _File]) -> str:
    digest = hashlib.sha1(b"patchload-loopback-commit\0")
    for path in sorted(files):
        digest.update(("%s\0%s\n" % (path, files[path].git_sha1)).encode())
    return digest.hexdigest()


# --------------------------------------------------------------------------------------------
# HTTP handling
# --------------------------------------------------------------------------------------------


class _HubError(Exception):
    """An HTTP error answer: status, ``X-Error-Code`` and message."""

    def __init__(self, status: int, message: str, *, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.headers = headers or {}


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 256  # many ranks x parallel download threads connect at once
    hub: LoopbackHub


class _Handler(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server_version = "patchload-loopback-hub"
    timeout = _SOCKET_TIMEOUT_S
    # Headers and body go out in two writes: with Nagle's algorithm on, the body of a small
    # response waits for the client's delayed ACK (about 40 ms on Linux), which no real hub has.
    disable_nagle_algorithm = True
    server: _Server

    # -- plumbing ---------------------------------------------------------------------------------

    def setup(self) -> None:
        super().setup()
        self.server.hub._track(self.connection, add=True)

    def finish(self) -> None:
        try:
            super().finish()
        finally:
            self.server.hub._track(self.connection, add=False)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
        logger.debug("%s " + format, self.address_string(), *args)

    def do_HEAD(self) -> None:  # noqa: N802 - stdlib naming
        self._handle()

    def do_GET(self) -> None:  # noqa: N802
        self._handle()

    def do_POST(self) -> None:  # noqa: N802
        self._handle()

    def do_PUT(self) -> None:  # noqa: N802
        self._handle()

    def do_DELETE(self) -> None:  # noqa: N802
        self._handle()

    def do_PATCH(self) -> None:  # noqa: N802
        self._handle()

    def do_OPTIONS(self) -> None:  # noqa: N802
        self._handle()

    # -- request lifecycle ------------------------------------------------------------------------

    def _handle(self) -> None:
        hub = self.server.hub
        hub._begin()
        self._started = time.time()
        self._status = 0
        self._bytes_sent = 0
        self._headers_sent = False
        self._url_path, self._query = self.path, ""
        self._rank: int | None = None
        self._repo_id: str | None = None
        self._filename: str | None = None
        self._fault: Fault | None = None
        try:
            split = urlsplit(self.path)
            self._url_path, self._query = split.path, split.query
            self._params = parse_qs(split.query)
            match = _RANK_RE.search(self.headers.get("User-Agent", ""))
            self._rank = int(match.group(1)) if match else None
            self._body = self._read_body()
            self._route()
        except (BrokenPipeError, ConnectionResetError, ConnectionAbortedError) as err:
            logger.debug("client went away during %s %s: %s", self.command, self.path, err)
            self.close_connection = True
        except _HubError as err:
            self._send_error(err)
        except Exception:  # noqa: BLE001 - the server must survive any handler bug
            logger.exception("loopback hub failed on %s %s", self.command, self.path)
            if not self._headers_sent:
                self._send_error(_HubError(500, "internal loopback hub error"))
            else:
                self.close_connection = True
        finally:
            hub._record(Request(
                method=self.command, path=self._url_path, status=self._status, rank=self._rank,
                bytes_sent=self._bytes_sent, time=self._started,
                duration_s=round(time.time() - self._started, 6), query=self._query,
                repo_id=self._repo_id, filename=self._filename,
                range=self.headers.get("Range"),
                fault=self._fault.describe() if self._fault is not None else None,
                user_agent=self.headers.get("User-Agent")))

    def _read_body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        return self.rfile.read(length) if length > 0 else b""

    def _route(self) -> None:
        path = self._url_path
        segments = path.strip("/").split("/")
        if segments and segments[0] == "api" and len(segments) >= 3 \
                and segments[1] in _API_PLURAL_TO_TYPE:
            repo_type = _API_PLURAL_TO_TYPE[segments[1]]
            repo_id, rest = _split_repo_id(segments[2:])
            self._repo_id = repo_id
            self._apply_fault(match_path=path)
            info = self.command == "GET" and (not rest or rest[0] == "revision")
            self._check_access(repo_type, repo_id, info=info)
            self._api(repo_type, repo_id, rest)
            return
        if "/resolve/" in path and not path.startswith("/api/"):
            prefix, _, tail = path.partition("/resolve/")
            head = prefix.strip("/").split("/")
            repo_type = "model"
            if len(head) > 1 and head[0] in _URL_PREFIX_TO_TYPE:
                repo_type = _URL_PREFIX_TO_TYPE[head[0]]
                head = head[1:]
            repo_id = "/".join(head)
            revision, _, filename = tail.partition("/")
            self._repo_id = repo_id
            self._filename = unquote(filename)
            self._apply_fault(match_path=self._filename)
            if self.command not in ("HEAD", "GET"):
                raise _HubError(405, "method %s not allowed on /resolve/" % self.command)
            self._check_access(repo_type, repo_id, info=False)
            self._resolve(repo_type, repo_id, unquote(revision), self._filename)
            return
        self._apply_fault(match_path=path)
        if path == "/api/agent-harnesses" and self.command == "GET":
            # huggingface_hub's AI-agent detection registry (fetched once a day per HF_HOME).
            self._send_json({"standardEnvVars": [], "harnesses": {}})
            return
        logger.warning("loopback hub: unknown endpoint %s %s", self.command, self.path)
        raise _HubError(404, "unknown endpoint %s %s" % (self.command, path))

    def _apply_fault(self, *, match_path: str) -> None:
        """Picks the fault for this request; raises or closes for status/close faults."""
        fault = self.server.hub._take_fault(repo_id=self._repo_id, match_path=match_path,
                                            method=self.command, rank=self._rank)
        if fault is None:
            return
        self._fault = fault
        logger.debug("loopback hub: fault %s on %s %s", fault.describe(), self.command, self.path)
        if fault.close:
            self.close_connection = True
            _shutdown(self.connection)
            raise _Dropped()
        if fault.status is not None:
            raise _fault_error(fault, self._repo_id)

    def _token(self) -> str | None:
        """The ``Authorization: Bearer <token>`` the client sent, or None."""
        header = self.headers.get("Authorization") or ""
        scheme, _, token = header.partition(" ")
        return token.strip() or None if scheme.lower() == "bearer" else None

    def _check_access(self, repo_type: str, repo_id: str, *, info: bool) -> None:
        """Raise the real hub's answer to a client that may not read a gated or private repo
        (``info``: the repo-info endpoint, public for a gated repo)."""
        with self.server.hub._lock:
            repo = self.server.hub._repos.get((repo_type, repo_id))
        if repo is None or repo.access == "public":
            return
        token = self._token()
        if token is not None and token in repo.tokens:
            return
        if repo.access == "private":
            if token is None:
                raise _HubError(401, "Invalid username or password.", code="RepoNotFound")
            raise _HubError(404, "Repository not found", code="RepoNotFound")
        if info:
            return
        kind = {"model": "model", "dataset": "dataset", "space": "space"}[repo_type]
        if token is None:
            raise _HubError(401, "Access to %s %s is restricted. You must have access to it and "
                            "be authenticated to access it. Please log in." % (kind, repo_id),
                            code="GatedRepo")
        raise _HubError(403, "Access to %s %s is restricted and you are not in the authorized "
                        "list. Visit https://huggingface.co/%s to ask for access."
                        % (kind, repo_id, repo_id), code="GatedRepo")

    # -- /resolve ---------------------------------------------------------------------------------

    def _resolve(self, repo_type: str, repo_id: str, revision: str, filename: str) -> None:
        repo, commit = self.server.hub._lookup(repo_type, repo_id, revision)
        file = self.server.hub._file(repo, commit, filename)
        if file is None:
            raise _HubError(404, "Entry not found", code="EntryNotFound",
                            headers={"X-Repo-Commit": commit})
        headers = {
            "X-Repo-Commit": commit,
            "ETag": '"%s"' % file.etag,
            "Accept-Ranges": "bytes",
            "Content-Type": "application/octet-stream",
            "Content-Disposition": 'inline; filename="%s"' % Path(filename).name,
        }
        if file.lfs:
            headers["X-Linked-Etag"] = '"%s"' % file.sha256
            headers["X-Linked-Size"] = str(file.size)
        start, end = 0, file.size - 1
        status = 200
        range_header = self.headers.get("Range")
        if range_header and self.command == "GET":
            parsed = _parse_range(range_header, file.size)
            if parsed is None:
                raise _HubError(416, "Requested range not satisfiable: %s" % range_header,
                                headers={"Content-Range": "bytes */%d" % file.size})
            start, end = parsed
            status = 206
            headers["Content-Range"] = "bytes %d-%d/%d" % (start, end, file.size)
        length = max(0, end - start + 1)
        headers["Content-Length"] = str(length)
        self._start_response(status, headers)
        self._stall()
        if self.command == "HEAD" or length == 0:
            return
        self._send_file(file.blob, start, length)

    def _send_file(self, blob: Path, start: int, length: int) -> None:
        fault = self._fault
        limit = length
        if fault is not None and fault.abort_after_bytes is not None:
            limit = min(length, max(0, fault.abort_after_bytes))
        rate = fault.throttle_bytes_per_s if fault is not None else None
        chunk = _CHUNK_BYTES if not rate else max(1, int(rate * _THROTTLE_TICK_S))
        stop_event = self.server.hub._stop_event
        with open(blob, "rb") as handle:
            handle.seek(start)
            while self._bytes_sent < limit:
                data = handle.read(min(chunk, limit - self._bytes_sent))
                if not data:
                    break
                self.wfile.write(data)
                self.wfile.flush()
                self._bytes_sent += len(data)
                if rate and stop_event.wait(len(data) / rate):
                    break
        if self._bytes_sent < length:
            logger.debug("loopback hub: aborting %s after %d of %d bytes",
                         self.path, self._bytes_sent, length)
            self.close_connection = True
            _shutdown(self.connection)

    # -- /api -------------------------------------------------------------------------------------

    def _api(self, repo_type: str, repo_id: str, rest: list[str]) -> None:
        hub = self.server.hub
        kind = rest[0] if rest else ""
        if self.command == "GET" and kind in ("", "revision"):
            revision = unquote(rest[1]) if kind == "revision" and len(rest) > 1 else "main"
            repo, commit = hub._lookup(repo_type, repo_id, revision)
            self._send_json(hub._repo_info(repo, commit, blobs=_flag(self._params, "blobs")))
        elif self.command == "GET" and kind == "tree" and len(rest) >= 2:
            repo, commit = hub._lookup(repo_type, repo_id, unquote(rest[1]))
            folder = unquote("/".join(rest[2:])).strip("/")
            self._send_json(hub._tree(repo, commit, folder,
                                      recursive=_flag(self._params, "recursive")))
        elif self.command == "POST" and kind == "paths-info" and len(rest) >= 2:
            repo, commit = hub._lookup(repo_type, repo_id, unquote(rest[1]))
            self._send_json(hub._paths_info(repo, commit, self._requested_paths()))
        elif self.command == "GET" and kind == "commits" and len(rest) >= 2:
            _, commit = hub._lookup(repo_type, repo_id, unquote(rest[1]))
            self._send_json([{"id": commit, "title": "patchload loopback snapshot", "message": "",
                              "authors": [{"user": "patchload"}], "date": _FIXED_DATE}])
        elif self.command == "GET" and kind == "refs":
            repo, _ = hub._lookup(repo_type, repo_id, None)
            self._send_json({
                "branches": [{"name": name, "ref": "refs/heads/" + name, "targetCommit": sha}
                             for name, sha in sorted(repo.branches.items())],
                "converts": [], "tags": [], "pullRequests": []})
        elif self.command == "GET" and kind == "discussions":
            hub._lookup(repo_type, repo_id, None)
            self._send_json({"discussions": [], "count": 0, "start": 0,
                             "numClosedDiscussions": 0})
        else:
            logger.warning("loopback hub: unknown API endpoint %s %s", self.command, self.path)
            raise _HubError(404, "unknown endpoint %s %s" % (self.command, self._url_path))

    def _requested_paths(self) -> list[str]:
        content_type = self.headers.get("Content-Type", "")
        if "json" in content_type:
            paths = json.loads(self._body or b"{}").get("paths", [])
        else:
            paths = parse_qs(self._body.decode("utf-8")).get("paths", [])
        return [paths] if isinstance(paths, str) else list(paths)

    # -- responses --------------------------------------------------------------------------------

    def _start_response(self, status: int, headers: dict[str, str]) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.flush()
        self._status = status
        self._headers_sent = True

    def _stall(self) -> None:
        """Sleeps for the fault's ``stall_s``; if the hub stops meanwhile, drops the connection."""
        fault = self._fault
        if fault is not None and fault.stall_s and self.server.hub._stop_event.wait(fault.stall_s):
            self.close_connection = True
            _shutdown(self.connection)
            raise _Dropped()

    def _send_json(self, payload: Any) -> None:
        body = json.dumps(payload).encode("utf-8")
        self._start_response(200, {"Content-Type": "application/json",
                                   "Content-Length": str(len(body))})
        self._stall()
        if self.command != "HEAD":
            self.wfile.write(body)
            self._bytes_sent = len(body)

    def _send_error(self, err: _HubError) -> None:
        if isinstance(err, _Dropped):
            return
        body = json.dumps({"error": err.message}).encode("utf-8")
        headers = {"Content-Type": "application/json", "Content-Length": str(len(body)),
                   "X-Error-Message": err.message}
        if err.code:
            headers["X-Error-Code"] = err.code
        headers.update(err.headers)
        try:
            self._start_response(err.status, headers)
            if self.command != "HEAD":
                self.wfile.write(body)
                self._bytes_sent = len(body)
        except OSError as os_err:
            logger.debug("client went away before error %d: %s", err.status, os_err)
            self.close_connection = True


class _Dropped(_HubError):
    """Raised after a ``close`` fault shut the socket: nothing more to send."""

    def __init__(self) -> None:
        super().__init__(0, "connection closed by fault")


def _fault_error(fault: Fault, repo_id: str | None) -> _HubError:
    status = fault.status or 500
    name = repo_id or "<unknown>"
    headers = {}
    if fault.retry_after_s is not None:
        headers["Retry-After"] = str(int(fault.retry_after_s))
    if status == 404:
        return _HubError(404, "Repository not found", code="RepoNotFound", headers=headers)
    if status == 401:
        return _HubError(401, "Access to model %s is restricted. You must have access to it and "
                         "be authenticated to access it. Please log in." % name,
                         code="GatedRepo", headers=headers)
    if status == 429:
        return _HubError(429, "Too many requests (injected fault)", headers=headers)
    return _HubError(status, "Injected fault: HTTP %d" % status, headers=headers)


def _split_repo_id(segments: list[str]) -> tuple[str, list[str]]:
    """Splits ``["org", "name", "tree", "main"]`` into ``("org/name", ["tree", "main"])``."""
    if len(segments) >= 2 and segments[1] not in _API_SUBPATHS:
        return unquote(segments[0]) + "/" + unquote(segments[1]), segments[2:]
    return unquote(segments[0]), segments[1:]


def _flag(params: dict[str, list[str]], name: str) -> bool:
    values = params.get(name) or params.get(name + "[]") or []
    return bool(values) and values[-1].lower() in ("1", "true", "yes")


def _parse_range(header: str, size: int) -> tuple[int, int] | None:
    """Parses a single ``bytes=a-b`` range; returns inclusive (start, end) or None if invalid."""
    match = re.fullmatch(r"\s*bytes\s*=\s*(\d*)\s*-\s*(\d*)\s*", header, flags=re.IGNORECASE)
    if match is None or size == 0:
        return None
    first, last = match.groups()
    if not first:
        if not last:
            return None
        suffix = int(last)
        return (max(0, size - suffix), size - 1) if suffix > 0 else None
    start = int(first)
    end = min(int(last), size - 1) if last else size - 1
    return (start, end) if start <= end else None


def _shutdown(sock: socket.socket) -> None:
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


# --------------------------------------------------------------------------------------------
# The hub
# --------------------------------------------------------------------------------------------


class LoopbackHub:
    """A Hugging Face Hub look-alike on ``127.0.0.1``, serving folders registered as repos.

    :meth:`add_repo` snapshots a folder: it hashes and copies every file into a content-addressed
    temporary directory owned by the hub, so later changes to the folder are not seen until
    :meth:`add_repo` is called again (which moves the branch to a new commit; the old commit stays
    downloadable by its sha). Repos may be added before or after :meth:`start`.

    Not collective and unrelated to ``torch.distributed``: run one hub per test (usually in the
    pytest process) and point every rank's ``HF_ENDPOINT`` at :attr:`endpoint`.

    Example::

        with LoopbackHub() as hub:
            hub.add_repo("org/tiny", folder)
            env = {**os.environ, "HF_ENDPOINT": hub.endpoint, "HF_HUB_DISABLE_XET": "1"}
    """

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0,
                 log_path: str | os.PathLike[str] | None = None) -> None:
        """Creates a stopped hub.

        Args:
            host: Interface to bind; keep the loopback default.
            port: TCP port; 0 picks a free one at :meth:`start`.
            log_path: If set, each request is also appended to this file as one JSON line
                (see :func:`read_request_log`). The file is created at :meth:`start`.
        """
        self._host = host
        self._port = port
        self._log_path = Path(log_path) if log_path is not None else None
        self._lock = threading.Lock()
        self._repos: dict[tuple[str, str], _Repo] = {}
        self._faults: list[list[Any]] = []  # [fault, uses_left (int | None), hits]
        self._requests: list[Request] = []
        self._in_flight = 0
        self._idle = threading.Condition(self._lock)
        self._connections: set[socket.socket] = set()
        self._stop_event = threading.Event()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None
        self._blob_tmp = tempfile.TemporaryDirectory(prefix="patchload-hub-")
        self._blob_dir = Path(self._blob_tmp.name)

    # -- lifecycle --------------------------------------------------------------------------------

    def start(self) -> str:
        """Starts serving in a daemon thread.

        Returns:
            The endpoint URL, e.g. ``"http://127.0.0.1:43121"`` (use as ``HF_ENDPOINT``).

        Raises:
            RuntimeError: The hub is already running.
            OSError: The port cannot be bound.
        """
        if self._server is not None:
            raise RuntimeError("LoopbackHub is already running at %s" % self.endpoint)
        self._stop_event.clear()
        server = _Server((self._host, self._port), _Handler)
        server.hub = self
        self._server = server
        if self._log_path is not None:
            self._log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log_path.touch()
        self._thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05},
                                        name="patchload-loopback-hub", daemon=True)
        self._thread.start()
        logger.debug("loopback hub serving at %s", self.endpoint)
        return self.endpoint

    def stop(self) -> None:
        """Stops serving within about a second; open connections are cut. No-op if stopped."""
        server, self._server = self._server, None
        if server is None:
            return
        self._stop_event.set()
        server.shutdown()
        with self._lock:
            connections = list(self._connections)
        for conn in connections:
            _shutdown(conn)
        server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=1.0)
            self._thread = None
        logger.debug("loopback hub stopped")

    def close(self) -> None:
        """Stops the hub and deletes its copies of the repo files."""
        self.stop()
        self._blob_tmp.cleanup()

    def __enter__(self) -> LoopbackHub:
        if self._server is None:
            self.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def endpoint(self) -> str:
        """The base URL, ``http://127.0.0.1:<port>``.

        Raises:
            RuntimeError: The hub is not running.
        """
        if self._server is None:
            raise RuntimeError("LoopbackHub is not running; call start() first")
        host, port = self._server.server_address[:2]
        return "http://%s:%d" % (host, port)

    @property
    def log_path(self) -> Path | None:
        """The JSON-lines request log given to the constructor, or None."""
        return self._log_path

    # -- repos ------------------------------------------------------------------------------------

    def add_repo(self, repo_id: str, folder: str | os.PathLike[str], *, repo_type: str = "model",
                 branch: str = "main") -> str:
        """Serves ``folder`` as ``repo_id`` at ``branch`` (snapshot; see the class docstring).

        Args:
            repo_id: ``"name"`` or ``"org/name"``.
            folder: Directory whose files (recursively; ``.git/`` skipped) form the repo.
            repo_type: ``"model"``, ``"dataset"`` or ``"space"``.
            branch: Branch to point at the new commit; may contain ``/``.

        Returns:
            The commit sha, 40 lowercase hex digits, a pure function of the file paths and
            contents (same files: same sha).

        Raises:
            ValueError: Bad ``repo_type`` or ``repo_id``.
            NotADirectoryError: ``folder`` is not a directory.
        """
        if repo_type not in _REPO_TYPES:
            raise ValueError("repo_type %r is not one of %s" % (repo_type, ", ".join(_REPO_TYPES)))
        if not repo_id or repo_id.count("/") > 1 or repo_id.strip("/") != repo_id:
            raise ValueError("repo_id %r must be 'name' or 'org/name'" % repo_id)
        source = Path(folder)
        if not source.is_dir():
            raise NotADirectoryError("cannot serve %s as %s: not a directory" % (source, repo_id))
        files = _snapshot_folder(source, self._blob_dir)
        commit = _commit_sha(files)
        with self._lock:
            repo = self._repos.setdefault((repo_type, repo_id),
                                          _Repo(repo_type, repo_id, branches={}, snapshots={}))
            repo.snapshots[commit] = files
            repo.branches[branch] = commit
        logger.debug("loopback hub: %s %s@%s -> %s (%d files)", repo_type, repo_id, branch,
                     commit, len(files))
        return commit

    def restrict(self, repo_id: str, *, access: str, tokens: Iterable[str] = (),
                 repo_type: str = "model") -> None:
        """Make a served repo gated or private (or public again), readable with ``tokens``.

        Args:
            repo_id: a repo added with :meth:`add_repo`.
            access: ``"gated"`` (its info is public, its files need a token of ``tokens``),
                ``"private"`` (hidden from every other client) or ``"public"``.
            tokens: the tokens (sent as ``Authorization: Bearer <token>``) that may read it.
            repo_type: ``"model"``, ``"dataset"`` or ``"space"``.

        Raises:
            ValueError: ``access`` is none of the three.
            KeyError: the repo is not served.
        """
        if access not in ("public", "gated", "private"):
            raise ValueError("access %r is not one of public, gated, private" % access)
        with self._lock:
            repo = self._repos[(repo_type, repo_id)]
            repo.access = access
            repo.tokens = frozenset(tokens)

    def commit_of(self, repo_id: str, *, repo_type: str = "model", branch: str = "main") -> str:
        """Returns the commit sha ``branch`` points at.

        Raises:
            KeyError: Unknown repo or branch.
        """
        with self._lock:
            return self._repos[(repo_type, repo_id)].branches[branch]

    def files_of(self, repo_id: str, *, repo_type: str = "model",
                 branch: str = "main") -> dict[str, tuple[Path, str]]:
        """The files ``branch`` of a served repo holds: repo path -> (the hub's own copy of its
        content, its etag as the hub sends it). The copies are the hub's: read them, link them
        (a benchmark filling a cache without a second copy), never write them.

        Raises:
            KeyError: Unknown repo or branch.
        """
        with self._lock:
            repo = self._repos[(repo_type, repo_id)]
            files = repo.snapshots[repo.branches[branch]]
            return {path: (file.blob, file.etag) for path, file in files.items()}

    def remove_repo(self, repo_id: str, *, repo_type: str = "model") -> None:
        """Stop serving a repo (every branch and commit) and delete the hub's copies of its
        files that no other served repo holds (copies are content-addressed: repos with the same
        tokenizer share its files). Nothing happens for a repo not served."""
        with self._lock:
            repo = self._repos.pop((repo_type, repo_id), None)
            kept = {file.blob for other in self._repos.values()
                    for files in other.snapshots.values() for file in files.values()}
        for files in (repo.snapshots.values() if repo is not None else ()):
            for file in files.values():
                if file.blob not in kept:
                    file.blob.unlink(missing_ok=True)

    # -- faults -----------------------------------------------------------------------------------

    def add_fault(self, fault: Fault) -> Fault:
        """Adds a fault (checked after those already added) and returns it."""
        if not isinstance(fault, Fault):
            raise TypeError("add_fault expects a Fault, got %r" % (fault,))
        with self._lock:
            self._faults.append([fault, fault.times, 0])
        return fault

    def fault_hits(self, fault: Fault) -> int:
        """How many requests ``fault`` (as passed to :meth:`add_fault`) applied to so far,
        counted when it is applied: a request it stalls counts while still stalled (the
        request log records a request only once its response ended)."""
        with self._lock:
            return sum(entry[2] for entry in self._faults if entry[0] is fault)

    def clear_faults(self) -> None:
        """Removes every fault."""
        with self._lock:
            self._faults.clear()

    # -- request log ------------------------------------------------------------------------------

    def requests(self, rank: int | None = None, path_contains: str | None = None,
                 method: str | None = None, *, settle_s: float = 1.0) -> list[Request]:
        """Returns the recorded requests, oldest first, filtered.

        A request is recorded when its response has been written, which can be just after the
        client has read it; so this first waits (up to ``settle_s``) until no request is being
        handled.

        Args:
            rank: Keep requests from this rank (``origin/rank-N``) only.
            path_contains: Keep requests whose URL path contains this substring.
            method: Keep requests with this HTTP method only.
            settle_s: Longest wait for in-flight requests to finish, in seconds (0: no wait).
        """
        with self._idle:
            self._idle.wait_for(lambda: self._in_flight == 0, timeout=settle_s)
            records = list(self._requests)
        return [r for r in records
                if (rank is None or r.rank == rank)
                and (path_contains is None or path_contains in r.path)
                and (method is None or r.method == method.upper())]

    def clear_requests(self) -> None:
        """Forgets the in-memory request log (the ``log_path`` file is left as is)."""
        with self._lock:
            self._requests.clear()

    # -- used by the handler ----------------------------------------------------------------------

    def _track(self, conn: socket.socket, *, add: bool) -> None:
        with self._lock:
            if add:
                self._connections.add(conn)
            else:
                self._connections.discard(conn)

    def _begin(self) -> None:
        with self._lock:
            self._in_flight += 1

    def _record(self, request: Request) -> None:
        with self._lock:
            self._in_flight -= 1
            self._idle.notify_all()
            self._requests.append(request)
            if self._log_path is not None:
                try:
                    with open(self._log_path, "a", encoding="utf-8") as handle:
                        handle.write(request.to_json() + "\n")
                except OSError as err:
                    logger.warning("loopback hub: cannot append to %s: %s", self._log_path, err)

    def _take_fault(self, *, repo_id: str | None, match_path: str, method: str,
                    rank: int | None) -> Fault | None:
        with self._lock:
            for entry in self._faults:
                fault, left, _ = entry
                if left is not None and left <= 0:
                    continue
                if fault._matches(repo_id=repo_id, match_path=match_path, method=method, rank=rank):
                    if left is not None:
                        entry[1] = left - 1
                    entry[2] += 1
                    return fault
        return None

    def _lookup(self, repo_type: str, repo_id: str, revision: str | None) -> tuple[_Repo, str]:
        """Returns (repo, commit); raises the Hub's RepoNotFound / RevisionNotFound errors."""
        with self._lock:
            repo = self._repos.get((repo_type, repo_id))
        if repo is None:
            raise _HubError(404, "Repository not found", code="RepoNotFound")
        if revision is None:
            revision = "main" if "main" in repo.branches else next(iter(repo.branches))
        commit = repo.resolve(revision)
        if commit is None:
            raise _HubError(404, "Invalid rev id: %s" % revision, code="RevisionNotFound")
        return repo, commit

    def _file(self, repo: _Repo, commit: str, path: str) -> _File | None:
        return repo.snapshots[commit].get(path)

    def _repo_info(self, repo: _Repo, commit: str, *, blobs: bool) -> dict[str, Any]:
        siblings = []
        for file in repo.snapshots[commit].values():
            sibling: dict[str, Any] = {"rfilename": file.path}
            if blobs:
                entry = file.tree_entry()
                sibling.update(size=file.size, blobId=entry["oid"])
                if file.lfs:
                    sibling["lfs"] = {"sha256": file.sha256, "size": file.size,
                                      "pointerSize": entry["lfs"]["pointerSize"]}
            siblings.append(sibling)
        info: dict[str, Any] = {
            "_id": commit[:24], "id": repo.repo_id, "sha": commit,
            "private": repo.access == "private",
            "gated": "manual" if repo.access == "gated" else False, "disabled": False, "lastModified": _FIXED_DATE,
            "createdAt": _FIXED_DATE, "tags": [], "downloads": 0, "likes": 0,
            "siblings": siblings,
        }
        if repo.repo_type == "model":
            info["modelId"] = repo.repo_id
        return info

    def _tree(self, repo: _Repo, commit: str, folder: str, *, recursive: bool) -> list[dict]:
        files = repo.snapshots[commit]
        prefix = folder + "/" if folder else ""
        entries: list[dict[str, Any]] = []
        folders: set[str] = set()
        for path in sorted(files):
            if not path.startswith(prefix):
                continue
            parts = path[len(prefix):].split("/")
            for depth in range(1, len(parts)):
                if not recursive and depth > 1:
                    break
                folders.add(prefix + "/".join(parts[:depth]))
            if recursive or len(parts) == 1:
                entries.append(files[path].tree_entry())
        if folder and not entries and not folders:
            raise _HubError(404, "Entry not found", code="EntryNotFound",
                            headers={"X-Repo-Commit": commit})
        dirs = [_folder_entry(commit, name) for name in sorted(folders)]
        return dirs + entries

    def _paths_info(self, repo: _Repo, commit: str, paths: Iterable[str]) -> list[dict]:
        files = repo.snapshots[commit]
        result = []
        for raw in paths:
            path = raw.strip("/")
            if path in files:
                result.append(files[path].tree_entry())
            elif any(name.startswith(path + "/") for name in files):
                result.append(_folder_entry(commit, path))
        return result


def _folder_entry(commit: str, path: str) -> dict[str, Any]:
    oid = hashlib.sha1(("tree\0%s\0%s" % (commit, path)).encode()).hexdigest()
    return {"type": "directory", "oid": oid, "path": path}


# --------------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------------


def _parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m patchload.testing.hub",
        description="Serve local folders as a Hugging Face Hub on 127.0.0.1 until killed.")
    parser.add_argument("--repo", action="append", default=[], metavar="REPO_ID=FOLDER",
                        help="serve FOLDER as model repo REPO_ID (repeatable); "
                             "prefix REPO_ID with 'datasets/' for a dataset repo")
    parser.add_argument("--port", type=int, default=0, help="TCP port (default: a free one)")
    parser.add_argument("--port-file", help="write the endpoint URL here once serving")
    parser.add_argument("--log", help="append each request here as one JSON line")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """Runs the CLI; returns the exit status. Serves until SIGTERM or SIGINT."""
    args = _parse_args(argv)
    hub = LoopbackHub(port=args.port, log_path=args.log)
    for spec in args.repo:
        repo_id, sep, folder = spec.partition("=")
        if not sep:
            raise SystemExit("--repo expects REPO_ID=FOLDER, got %r" % spec)
        repo_type = "model"
        for prefix, kind in _URL_PREFIX_TO_TYPE.items():
            if repo_id.startswith(prefix + "/"):
                repo_type, repo_id = kind, repo_id[len(prefix) + 1:]
        hub.add_repo(repo_id, folder, repo_type=repo_type)
    done = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: done.set())
    endpoint = hub.start()
    if args.port_file:
        tmp = args.port_file + ".tmp"
        Path(tmp).write_text(endpoint + "\n", encoding="utf-8")
        os.replace(tmp, args.port_file)
    print(endpoint, flush=True)
    try:
        while not done.wait(0.2):
            pass
    finally:
        hub.close()
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=os.environ.get("PATCHLOAD_HUB_LOG_LEVEL", "WARNING"))
    raise SystemExit(main())
