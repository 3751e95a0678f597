"""One coordinated call of a patched function: the leader runs it, followers verify and rerun it.

Every patched entry point (``hf_hub_download``, ``snapshot_download``, ``from_pretrained`` of
configs, tokenizers, processors, models and the Auto classes) goes through :func:`coordinated`.
The outermost patched call of a thread is the one coordinated (threads that a coordinated call
starts through a ``ThreadPoolExecutor`` count as inside it).

- The **leader** runs the original call (which downloads what it needs) and publishes the outcome,
  pinned to what it used: every hub file it resolved (commit, blob, size) and a fingerprint of
  every local path among its arguments.
- A **follower** waits for that outcome, then reruns the same call from its own cache
  (``local_files_only=True``; nested calls offline; library background requests off), recording
  the files it resolves. A model load's followers start at once instead: the leader publishes
  each hub call's pin as it returns, and a follower's same call waits for that
  (:meth:`Mode.wait_pin`). A follower uses its result only when those files are the leader's;
  otherwise, or when the rerun fails where the leader succeeded, it warns and makes a **plain
  call** (online, nothing patched inside), after restoring the random-number state it had before
  the rerun. A follower that started at once ends with the leader's error where the leader
  failed before announcing its files, as one that waited would.
- A call whose arguments cannot be rendered (:mod:`.key`) is not matched across ranks: it runs as
  it is, and the hub calls inside it are coordinated one by one.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import os
import stat
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Final, Iterator

from .. import _state
from .._errors import LeaderInterruptedError
from .._logging import get_logger
from .._topology import Topology, current_topology
from . import credentials as _credentials
from . import protocol as _coordinate
from . import rank0 as _rank0
from . import replay as _replay
from . import rng as _rng
from .key import Unrenderable, credentials_digest, deciding_arguments, digest, process_state
from .load_state import LoadState
from .offline_notes import quiet_offline_fallbacks
from .scope import download_scope
from .store import job_store

__all__ = ["Hooks", "Mode", "VerificationFailed", "add_pins", "context_patches",
           "current_mode", "coordinated", "coordinates_here", "plain", "record_hub_result",
           "verify_so_far", "without_waiting"]

logger = get_logger(__name__)

_FINGERPRINT_MAX_FILES: Final = 10_000
_HUB_DOWNLOADS: Final = ("hf_hub_download", "snapshot_download")
# The hub calls whose result is pinned: a follower's must be the leader's.
_PINNED: Final = (*_HUB_DOWNLOADS, "resolve_revision")
# The names of user code's own hub metadata calls (patchload.patches.hub_api): counted in a
# sequence of their own (rank0.place).
_METADATA_PREFIX: Final = "HfApi."


class VerificationFailed(Exception):
    """A follower's rerun resolved other files than its leader (stale or partial cache)."""


@dataclass(frozen=True)
class Mode:
    """What the enclosing coordinated call is doing on this rank.

    Attributes:
        lead: True on the leader, False on a follower.
        call: the enclosing coordinated call (one attempt of it).
        loads_model: the enclosing call loads model weights (it shares them on the leader).
        load: the model load's state on this rank, shared by the wrappers nested in the call
            and its transport (:class:`.load_state.LoadState`); a library patch keeps its own
            per-call state in the hooks it builds for the call (``patches/datasets.py``).
        pins: the hub files this rank's call resolved: ``{"<type>:<repo>:<path>": [commit,
            blob, size]}``, or ``None`` for a file found absent; ``{"<type>:<repo>:@<revision>":
            [commit]}`` for a revision it resolved (:func:`_pin_key`).
        leader: followers: their view of the leader (its outcome, announcement and pins).
        cache_dir: the call's ``cache_dir`` argument (None: the default hub cache), where a
            follower answers cache lookups that take no ``cache_dir`` (``file_exists``).
        local: the leader's fingerprints of the local paths among the call's arguments (it
            announces them with its files; see :func:`_local_paths`).
        asked_offline: followers on the offline path (``replayed`` False): the
            ``local_files_only`` the caller of the outermost coordinated call asked for (its
            rerun passes True, and libraries pass that on to the objects they build:
            :func:`_as_asked` undoes it in each).
        replayed: followers: the call's HTTP requests are answered from the leader's record
            (:mod:`.replay`), so it runs with the caller's arguments; only its hub downloads
            (``hf_hub_download``, ``snapshot_download``) are made offline. False where
            huggingface_hub's client is neither ``httpx`` (>= 1) nor ``requests`` (0.x): a
            ``configure_http_backend`` factory of the user's.
        answers: followers with ``replayed``: the answers given so far (requests counted).
    """

    lead: bool
    call: _coordinate.Call
    loads_model: bool = False
    load: LoadState = field(default_factory=LoadState)
    pins: dict[str, Any] = field(default_factory=dict)
    leader: _coordinate.LeaderView | None = None
    cache_dir: str | os.PathLike[str] | None = None
    local: dict[str, Any] = field(default_factory=dict)
    asked_offline: bool = False
    replayed: bool = False
    answers: _replay.LeaderAnswers | None = None
    pins_lock: threading.Lock = field(default_factory=threading.Lock, repr=False,
                                      compare=False)

    @property
    def payload(self) -> dict[str, Any]:
        """The leader's published payload; empty on the leader. A follower that started before
        the leader finished (a model load's followers start at once) waits here for the
        leader's outcome, bounded, and raises the leader's failure."""
        return self.leader.payload() if self.leader is not None else {}

    def wait_pin(self, key: str | None) -> None:
        """Follower: wait until its leader resolved the hub file ``key`` (or announced its
        files, or finished): see :meth:`patchload.coordination.protocol.LeaderView.wait_pin`.
        Returns at once on the leader and inside :func:`without_waiting`."""
        if self.leader is not None and not _NO_WAIT.get():
            self.leader.wait_pin(key)

    def announcement(self) -> dict[str, Any] | None:
        """Follower: what its leader announced with its files (:func:`.protocol.files_ready`),
        once it did or finished (None: never announced); None on the leader."""
        return self.leader.announcement() if self.leader is not None else None


_MODE: contextvars.ContextVar[Mode | None] = contextvars.ContextVar("patchload_mode", default=None)
# True inside a plain call: every patched function inside runs as if unpatched.
_PLAIN: contextvars.ContextVar[bool] = contextvars.ContextVar("patchload_plain", default=False)
# True inside a follower's block that must not wait for its leader (it holds a lock the leader
# takes): its hub calls are made offline at once.
_NO_WAIT: contextvars.ContextVar[bool] = contextvars.ContextVar("patchload_no_wait", default=False)
# True inside a snapshot download: its files are pinned by the snapshot's commit (offline, a
# follower's snapshot_download resolves the folder without a call per file).
_IN_SNAPSHOT: contextvars.ContextVar[bool] = contextvars.ContextVar("patchload_in_snapshot",
                                                                    default=False)


def current_mode() -> Mode | None:
    """The mode of the enclosing coordinated call in this thread, or None at top level and
    inside a plain call."""
    return None if _PLAIN.get() else _MODE.get()


def coordinates_here() -> bool:
    """Whether a patched call made here and now is coordinated across ranks as a top-level
    call: patchload is installed and on, the job has more than one process, and no coordinated
    or plain call encloses this one."""
    return (not _PLAIN.get() and _MODE.get() is None and _state.active()
            and current_topology().distributed)


@contextlib.contextmanager
def plain() -> Iterator[None]:
    """Run the block as without patchload: patched functions inside pass straight through."""
    token = _PLAIN.set(True)
    try:
        yield
    finally:
        _PLAIN.reset(token)


@contextlib.contextmanager
def without_waiting() -> Iterator[None]:
    """Follower: nothing inside the block waits for the leader's pins (:meth:`Mode.wait_pin`;
    a block holding a lock the leader takes, entered once the leader is done with what it
    covers): its hub calls are made offline at once."""
    token = _NO_WAIT.set(True)
    try:
        yield
    finally:
        _NO_WAIT.reset(token)


def _carry_context(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> Any:
    """``ThreadPoolExecutor.submit``: inside a coordinated call, the task runs in a copy of the
    submitter's context, so the hub calls of a library's worker pool (``snapshot_download``'s
    file downloads) are nested in the call that started them."""
    if _MODE.get() is None and not _PLAIN.get():
        return wrapped(*args, **kwargs)
    fn, *rest = args
    return wrapped(contextvars.copy_context().run, fn, *rest, **kwargs)


def context_patches() -> list[Any]:
    """The patch that carries a coordinated call's context into worker threads."""
    from .._patching import Patch

    return [Patch("concurrent.futures.thread", "ThreadPoolExecutor.submit", _carry_context)]


# --- pins: what a call used ------------------------------------------------------------------

def _pin_of(path: str) -> list[Any] | None:
    """``[commit, blob, size]`` of a file or snapshot folder a hub function returned: the blob
    is the name of the file its path resolves to (``os.path.realpath``)."""
    parts = os.path.normpath(path).split(os.sep)
    commit = parts[parts.index("snapshots") + 1] if "snapshots" in parts[:-1] else ""
    try:
        st = os.stat(path)
        if stat.S_ISDIR(st.st_mode):  # a snapshot: its commit (files may be added to it later)
            return [commit, "snapshot"]
        return [commit, _resolved_name(path), st.st_size]
    except OSError:
        return None


def _resolved_name(path: str) -> str:
    """``os.path.basename(os.path.realpath(path))`` of an existing file, in one or two system
    calls where the cache's layout holds (a snapshot file is a link to its blob, or a copy)
    rather than one per component of the path: only the last link decides the name."""
    try:
        target = os.readlink(path)
    except OSError:  # not a link (a copied file): its own name
        return os.path.basename(os.path.normpath(path))
    if os.path.islink(os.path.join(os.path.dirname(path), target)):  # a chain of links
        return os.path.basename(os.path.realpath(path))
    return os.path.basename(target)


def _metadata_pin(local_dir: str, name: str) -> list[Any]:
    """``[name, commit, etag, size]`` of the file ``name`` (a repo path) of a ``local_dir``
    download, from the download metadata huggingface_hub keeps beside it
    (``<local_dir>/.cache/huggingface/download/<name>.metadata``: commit, etag, timestamp);
    ``[name, None, None, size]`` (unverifiable: see :func:`_differences`) when that metadata is
    missing, unreadable or older than the file (huggingface_hub ignores it then too), or
    ``[name, None, None, None]`` without the file. Read without huggingface_hub's lock, which
    would create files in the folder; never raises."""
    file_path = os.path.join(local_dir, *name.split("/"))
    metadata = os.path.join(local_dir, ".cache", "huggingface", "download",
                            *f"{name}.metadata".split("/"))
    try:
        st = os.stat(file_path)
    except OSError:
        return [name, None, None, None]
    try:
        with open(metadata, encoding="utf-8") as f:
            commit, etag, timestamp = (f.readline().strip() for _ in range(3))
        fresh = st.st_mtime - 1 <= float(timestamp)  # huggingface_hub's own test
    except (OSError, ValueError, UnicodeDecodeError):
        fresh = False
    if not fresh or not commit or not etag:
        return [name, None, None, st.st_size]
    return [name, commit, etag, st.st_size]


def _local_dir_pin(local_dir: str, names: list[str] | None) -> list[Any]:
    """``["local_dir", [file pins]]``: :func:`_metadata_pin` of each of ``names`` in a
    ``local_dir`` download, or (``names`` None: a snapshot into it) of every file the folder's
    download metadata names, sorted, bounded (a folder with more than
    :data:`_FINGERPRINT_MAX_FILES` gets one unverifiable entry)."""
    if names is None:
        names = []
        root = os.path.join(local_dir, ".cache", "huggingface", "download")
        for folder, dirs, files in os.walk(root):
            dirs.sort()
            names += [os.path.relpath(os.path.join(folder, f), root)[:-len(".metadata")]
                      .replace(os.sep, "/") for f in sorted(files) if f.endswith(".metadata")]
            if len(names) > _FINGERPRINT_MAX_FILES:
                return ["local_dir", [["*", None, None, None]]]
    return ["local_dir", [_metadata_pin(local_dir, name) for name in sorted(names)]]


def _unverifiable(pin: Any) -> bool:
    """A ``local_dir`` pin with a file whose metadata cannot vouch for it."""
    return (isinstance(pin, list) and len(pin) == 2 and pin[0] == "local_dir"
            and any(entry[1] is None for entry in pin[1]))


def _pin_key(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> str:
    """The key under which a hub call's result is pinned (one of :data:`_PINNED`):
    ``<type>:<repo>:<path>`` (``*`` for a snapshot, ``*<digest>`` for one of some files),
    ``<type>:<repo>:@<revision>`` for a revision resolved."""
    repo = kwargs.get("repo_id", args[0] if args else None)
    repo_type = kwargs.get("repo_type") or "model"
    if name == "resolve_revision":
        return f"{repo_type}:{repo}:@{kwargs.get('revision') or ''}"
    if name == "hf_hub_download":
        filename = kwargs.get("filename", args[1] if len(args) > 1 else None)
    else:  # a snapshot, of the files its patterns select (transformers: a sharded checkpoint's)
        patterns = {"allow": repr(kwargs.get("allow_patterns")),
                    "ignore": repr(kwargs.get("ignore_patterns"))}
        filename = "*" if patterns == {"allow": "None", "ignore": "None"} \
            else "*" + digest("snapshot", patterns)[:12]
    subfolder = kwargs.get("subfolder") or ""
    return f"{repo_type}:{repo}:{subfolder + '/' if subfolder else ''}{filename}"


def record_hub_result(mode: Mode, name: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                      result: Any) -> None:
    """Record in ``mode.pins`` the file (or snapshot, or revision) a nested hub call resolved,
    or None for a file it found absent (``result`` is the exception); a model load's leader
    publishes it at once (see :func:`_add_pins`)."""
    if isinstance(result, BaseException):
        pin = None
        # Why a follower's verification may later say "None here": what its own call raised.
        logger.debug("%s(%s): recorded as absent: %s: %s", name, _pin_key(name, args, kwargs),
                     type(result).__name__, str(result).split("\n", 1)[0])
    elif name == "resolve_revision":  # a str equal to the revision asked, holding the commit
        pin = [str(getattr(result, "resolved", result))]
    elif not isinstance(result, (str, os.PathLike)):
        pin = None
    elif kwargs.get("local_dir") is not None:
        # Not in the hub cache (no snapshots/<commit> in its path, no refs/): its metadata.
        pin = _local_dir_result_pin(name, args, kwargs, os.fspath(result))
    else:
        pin = _pin_of(result)
    add_pins(mode, {_pin_key(name, args, kwargs): pin})


def _local_dir_result_pin(name: str, args: tuple[Any, ...], kwargs: dict[str, Any],
                          result: str) -> list[Any]:
    """The pin of a hub download into a ``local_dir`` (:func:`_local_dir_pin`): the file an
    ``hf_hub_download`` returned (``<local_dir>/<subfolder>/<filename>``, the folder as the hub
    resolved it), or every file of the folder a ``snapshot_download`` returned."""
    if name != "hf_hub_download":
        return _local_dir_pin(result, None)
    filename = kwargs.get("filename", args[1] if len(args) > 1 else None)
    subfolder = kwargs.get("subfolder") or ""
    repo_path = f"{subfolder}/{filename}" if subfolder else str(filename)
    if not result.replace(os.sep, "/").endswith("/" + repo_path):
        return ["local_dir", [[repo_path, None, None, None]]]  # not where expected: unverifiable
    return _local_dir_pin(result[:-len(repo_path) - 1], [repo_path])


def add_pins(mode: Mode, pins: dict[str, Any]) -> None:
    """Add ``pins`` to ``mode``'s. A model load's leader publishes them at once: its followers,
    which start at once, make each hub call from the cache once the leader's same call returned
    (:meth:`Mode.wait_pin`). A store failure only costs its followers that head start (they wait
    for its outcome instead); it never fails the leader's call."""
    # The call's worker threads add pins too (recorded answers): each publication holds all
    # that were added before it.
    with mode.pins_lock:
        mode.pins.update(pins)
        if not (mode.lead and mode.loads_model and pins):
            return
        try:
            _coordinate.publish_pins(mode.call, mode.pins)
        except Exception as err:  # noqa: BLE001 - see the docstring
            logger.warning("%s: publishing what the leader's hub calls resolved failed (%s): "
                           "followers wait for its outcome", mode.call.prefix(), err)


def _fingerprint(path: str) -> list[Any]:
    """Names, sizes and modification times of the files under a local directory (bounded), or
    of one file: what a follower compares before taking a leader's result for a local path."""
    if os.path.isfile(path):
        st = os.stat(path)
        return [[os.path.basename(path), st.st_size, st.st_mtime_ns]]
    entries = []
    for root, dirs, files in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(files):
            full = os.path.join(root, name)
            try:
                st = os.stat(full)
            except OSError:
                continue
            entries.append([os.path.relpath(full, path), st.st_size, st.st_mtime_ns])
            if len(entries) >= _FINGERPRINT_MAX_FILES:
                return entries
    return entries


def _local_paths(deciding: dict[str, str]) -> dict[str, Any]:
    return {text[len("path:"):]: _fingerprint(text[len("path:"):])
            for text in deciding.values() if text.startswith("path:")}


def _differences(mine: dict[str, Any], leader: dict[str, Any]) -> list[str]:
    """How this rank's pins differ from the leader's (empty: they agree): a file both resolved,
    at another commit or blob, or present on one side and absent on the other. A file only one
    side asked for is not compared: transformers answers some from the cache without a hub call
    once a commit is pinned, and the leader makes online checks a follower skips. A ``local_dir``
    file whose download metadata cannot vouch for it always differs (:func:`_unverifiable`): an
    offline ``local_dir`` download returns any file it finds there."""
    return [f"{key}: {value!r} here, {leader[key]!r} on the leader"
            for key, value in sorted(mine.items())
            if key in leader and (leader[key] != value or _unverifiable(value))]


def verify_so_far(mode: Mode) -> None:
    """Follower: check that every file its call has resolved so far is the leader's.

    Raises:
        VerificationFailed: a file differs (another commit or blob, or absent on one side).
    """
    differences = _differences(mode.pins, mode.payload.get("pins", {}))
    if differences:
        raise VerificationFailed("; ".join(differences[:3]))


# --- the coordinated call --------------------------------------------------------------------

def _offline(kwargs: dict[str, Any]) -> dict[str, Any]:
    offline = {**kwargs, "local_files_only": True}
    if "force_download" in kwargs:  # the leader just fetched: do not fetch again
        offline["force_download"] = False
    return offline


def _as_asked(result: Any, asked_offline: bool) -> Any:
    """``result`` of a call a follower made offline, showing the ``local_files_only`` its caller
    asked for (``asked_offline``) where it records its arguments: a tokenizer keeps it in
    ``init_kwargs``, which ``save_pretrained`` writes into ``tokenizer_config.json`` (plain: the
    argument, or True in offline mode, as ``PreTrainedTokenizerBase.from_pretrained`` sets it).

    A tokenizer built inside the call (a processor's, a sentence-transformers module's) got the
    follower's True from the library that built it, as the library passes its own
    ``local_files_only`` on: each is undone as it is built (:func:`_nested`), against what the
    outermost caller asked. (A library that passed a literal True of its own where its caller
    asked for nothing would be undone too; transformers, sentence-transformers, diffusers and
    peft pass their argument on.)"""
    init_kwargs = getattr(result, "init_kwargs", None)
    if (isinstance(init_kwargs, dict) and init_kwargs.get("local_files_only") is True
            and not asked_offline):
        from huggingface_hub import constants

        init_kwargs["local_files_only"] = bool(constants.HF_HUB_OFFLINE)
    return result


@dataclass(frozen=True)
class Hooks:
    """What a patch adds to a coordinated call beyond the plain call (:func:`coordinated`).

    Attributes:
        what: human-readable description for logs and errors.
        scope: ``node`` or ``job``; the download scope when None.
        share: run by the leader on the result (with the call and the leader's mode, whose
            ``load`` the nested wrappers filled); returns extra payload for followers (weights) and a
            step to run once the payload is published (or None).
        settle: run by a follower on its result before returning it.
        abandon: run by a follower that gives up on the leader's result (before its plain
            call), with what the leader may still be waiting on (a broadcast) to settle.
        lead_with: what the leader runs in place of ``wrapped`` (same arguments), e.g. a node
            leader that takes the weights from the job leader instead of its disk.
        call: a call built by the caller (the node leaders' call inside a node-scoped load);
            coordinated as it is, whatever the enclosing mode.
        offline_kwarg: a follower reruns the call with ``local_files_only=True``. False for
            calls that reject it (transformers 5.2x ``load_adapter`` passes it on to a config
            that raises TypeError); their nested hub calls are still made offline.
        idle: run by a follower before it waits for the leader (see
            :func:`patchload.coordination.protocol.leader_first`).
    """

    what: str
    scope: str | None = None
    share: Callable[[Any, _coordinate.Call, Mode],
                    tuple[dict[str, Any], Callable[[], None] | None]] | None = None
    settle: Callable[[Any, Mode], Any] | None = None
    abandon: Callable[[Mode], None] | None = None
    lead_with: Callable[..., Any] | None = None
    call: _coordinate.Call | None = None
    offline_kwarg: bool = True
    idle: Callable[[], None] | None = None

    @property
    def loads_model(self) -> bool:
        """The call loads model weights: its leader shares them (``share``)."""
        return self.share is not None


@dataclass
class _Coordinated:
    """One patched call on this rank, with what it needs to lead, follow or run plainly.

    Attributes:
        name: the patched function's name (part of the call key).
        wrapped: the original function.
        args, kwargs: the caller's arguments, passed through untouched on the leader.
        hooks: what the patch adds (:class:`Hooks`).
        local: fingerprints of the local paths among the arguments.
    """

    name: str
    wrapped: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    hooks: Hooks
    local: dict[str, Any] = dataclasses.field(default_factory=dict)
    credentials: str | None = None
    """The digest of the credentials the call sends, where they may change what it gets
    (:func:`.credentials.call_credentials`); None: they cannot (or the key holds them)."""
    source: tuple[str, str] | None = None
    """``(repo type, repo id)`` the call names, if a hub repo."""
    did: str = "made the call"
    """What this rank did, for its INFO line."""

    def lead(self, call: _coordinate.Call
             ) -> tuple[Any, dict[str, Any], Callable[[], None] | None]:
        self.did = f"led it ({call.scope} scope)"
        mode = Mode(lead=True, call=call, loads_model=self.hooks.loads_model, local=self.local)
        # Its HTTP exchanges, published among its pins (a model load's at once).
        record = _replay.Record(lambda key, entry: add_pins(mode, {key: entry})) \
            if _replays() else None
        before = _rng.state()
        try:
            with _replay.recording(record):
                result = self._run(mode, self.hooks.lead_with or self.wrapped, self.kwargs)
        except Exception as err:
            # Published with the error: followers that raise it without running their own part
            # take the random-number state a plain call leaves (coordination.rng).
            try:
                err._patchload_state = {"rng": _rng.failure_state(before)}
            except Exception:  # noqa: BLE001 - an exception that takes no attribute
                pass
            raise
        if self.credentials is not None:  # ranks with other credentials: are its repos public?
            with plain():
                _credentials.publish_verdicts(call, self.credentials, mode.pins)
        payload: dict[str, Any] = {}
        after = None
        if self.hooks.loads_model:
            try:
                payload, after = self.hooks.share(result, call, mode)
            except Exception as err:  # noqa: BLE001 - the leader's own load stands; it shares none
                logger.warning("%s: sharing the weights failed (%s: %s): followers load their "
                               "own", call.prefix(), type(err).__name__, err)
                payload = {"weights": None, "reason": f"sharing failed: {err}"}
        return result, {**payload, "pins": mode.pins, "local": self.local}, after

    def follow(self, call: _coordinate.Call, role: _coordinate.Role,
               leader: _coordinate.LeaderView) -> Any:
        outer = _MODE.get()
        asked = outer.asked_offline if outer is not None and not outer.lead else bool(
            self.kwargs.get("local_files_only"))
        replayed = _replays()
        answers = _leader_answers(leader, self.hooks.what) if replayed else None
        mode = Mode(lead=False, call=call, leader=leader, loads_model=self.hooks.loads_model,
                    cache_dir=self.kwargs.get("cache_dir"), asked_offline=asked,
                    replayed=replayed, answers=answers)
        why = self._unshared(call, role.leader_rank, leader.payload, role.leader_credentials)
        if why is not None:
            if self.hooks.abandon is not None and _leader_succeeded(mode):
                self.hooks.abandon(mode)  # e.g. a broadcast this rank is a member of
            return self.own_credentials(call, why)
        rng = _rng.state()
        if replayed and self.name not in _HUB_DOWNLOADS:  # as asked: see Mode.replayed
            kwargs = self.kwargs
        else:
            kwargs = _offline(self.kwargs) if self.hooks.offline_kwarg else self.kwargs
        # A plain call after this rank's part failed runs once the handler ended: raised inside
        # it, its own error would carry that failure as __context__, which some libraries read
        # (datasets unwraps it into another exception class).
        fallback: Exception | None = None
        try:
            if self.local:
                self._check_local(mode)
            with _replay.replaying(answers) if answers is not None else contextlib.nullcontext(), \
                    quiet_offline_fallbacks(mode.asked_offline or kwargs is self.kwargs):
                result = self._run(mode, self.wrapped, kwargs)
            if not replayed:
                result = _as_asked(result, mode.asked_offline)
            differences = _differences(mode.pins, mode.payload.get("pins", {}))
            if differences:
                raise VerificationFailed("; ".join(differences[:3]))
            if self.hooks.settle is not None:
                result = self.hooks.settle(result, mode)
        except BaseException as err:
            if not isinstance(err, Exception):
                raise  # this rank's own interrupt (Ctrl-C, SystemExit), unchanged
            if isinstance(leader.raised, LeaderInterruptedError):
                # Nothing to abandon: the leader never published a success (no broadcast).
                fallback = leader.raised
            elif leader.raised is not None:
                if self.hooks.abandon is not None and _leader_succeeded(mode):
                    # It timed out, then the leader published: leave its broadcast.
                    self.hooks.abandon(mode)
                # As the view raised it: transformers turns an error inside a hub call into an
                # OSError of its own.
                _take_leaders_rng(leader.raised, rng)
                raise leader.raised from None
            elif not _leader_succeeded(mode):
                if isinstance(leader.raised, LeaderInterruptedError):
                    fallback = leader.raised
                # The leader's error, as on a rank that waited for it: it failed before its
                # files, or after them where this rank loaded alongside it (its own offline
                # calls then miss what the leader never fetched). A leader that died or went
                # silent published no error: this rank's own stands.
                elif leader.failed_early() or (mode.load.alongside and leader.failed()):
                    _take_leaders_rng(leader.raised, rng)
                    raise leader.raised from None
                else:
                    raise
            else:
                if self.hooks.abandon is not None:
                    self.hooks.abandon(mode)  # e.g. a broadcast this rank is a member of
                fallback = err
        if fallback is not None:
            return self._plain_after(call, role, fallback, rng)
        self.did = f"followed rank {role.leader_rank}: {_requests_note(mode)}" + \
            _weights_note(mode)
        return result

    def _unshared(self, call: _coordinate.Call, leader_rank: int,
                  payload: Callable[[], dict[str, Any]] | None,
                  theirs: str | None = None) -> str | None:
        """Why this follower must not take the result of ``leader_rank``, whose credentials
        differ from its own (:func:`.credentials.unshareable`), or None. ``payload`` waits for
        the leader's (None: it failed); asked only where the credentials differ. ``theirs``:
        the leader's digest from its claim, if known."""
        if self.credentials is None:
            return None

        def pins() -> dict[str, Any] | None:
            if payload is None:
                return None
            try:
                return payload().get("pins", {})
            except Exception:  # noqa: BLE001 - its failure is not taken across credentials
                return None

        try:
            with plain():
                return _credentials.unshareable(call, leader_rank, self.credentials, pins,
                                                self.source, theirs)
        except Exception as err:  # noqa: BLE001 - a store failure: take nothing across them
            return f"whether rank {leader_rank}'s credentials are this rank's is unknown ({err})"

    def own_credentials(self, call: _coordinate.Call, why: str) -> Any:
        """The call among the ranks of its scope with this rank's credentials (the key holds
        their digest; the first of them to claim leads, as rank 0 may not be one of them),
        where the leader of ``call`` has other credentials and ``why`` says it may not share
        its result (a gated or private repo, a failure)."""
        logger.info("%s: not taking the result of a leader with other hub credentials (%s): "
                    "the ranks with this rank's credentials make the call among themselves",
                    call.prefix(), why)
        own = dataclasses.replace(call, key=f"{call.base}credentials-{self.credentials}/",
                                  attempt=None, placement=None,
                                  config=dataclasses.replace(call.config, claim_grace_s=0.0))
        one = dataclasses.replace(self, hooks=dataclasses.replace(self.hooks, lead_with=None),
                                  credentials=None, did="made the call")
        result = _coordinate.leader_first(own, one.lead, one.follow,
                                          early=self.hooks.loads_model,
                                          interrupted=one.interrupted)
        self.did = f"{one.did}, among the ranks with its hub credentials ({why})"
        return result

    def interrupted(self, call: _coordinate.Call, role: _coordinate.Role,
                    err: LeaderInterruptedError) -> Any:
        """Follower whose leader's call was interrupted (its Ctrl-C or SIGTERM) before this
        rank started its own part: the plain call, as this rank makes without patchload (a
        plain rank never sees another rank's interrupt). Each such follower makes its own
        requests: a new attempt led by one of them would make fewer, but the followers of a
        model load already run their own part (:func:`leader_first`'s ``early``) and would
        have to start it again under the new leader; an interrupt is rare, and equality with
        the plain call is what counts."""
        return self._plain_after(call, role, err, _rng.state())

    def _check_local(self, mode: Mode) -> None:
        # A model load's leader announces them with its files: its followers check them then,
        # before their rerun, without waiting for its outcome.
        announced = mode.announcement()
        theirs = (announced if announced is not None else mode.payload).get("local", {})
        for path, fingerprint in self.local.items():
            if theirs.get(path) != fingerprint:
                raise VerificationFailed(f"the local path {path} holds other files (names, "
                                         "sizes, times) here than on the leader")

    def _run(self, mode: Mode, function: Callable[..., Any], kwargs: dict[str, Any]) -> Any:
        outer = _MODE.get()
        token = _MODE.set(mode)
        snapshot = _IN_SNAPSHOT.set(self.name == "snapshot_download")
        try:
            result = function(*self.args, **kwargs)
        finally:
            _IN_SNAPSHOT.reset(snapshot)
            _MODE.reset(token)
            if outer is not None:  # the enclosing call used what this one used
                add_pins(outer, mode.pins)
        if self.name in _PINNED:  # a hub call pins what it returned
            record_hub_result(mode, self.name, self.args, kwargs, result)
        return result

    def _plain_after(self, call: _coordinate.Call, role: _coordinate.Role, err: Exception,
                     rng: Any) -> Any:
        self.did = (f"followed rank {role.leader_rank}, then made the call plainly "
                    f"({type(err).__name__})")
        logger.warning("%s: cannot use the leader's result on this rank (%s: %s): making the "
                       "call plainly here", call.prefix(role.leader_rank), type(err).__name__,
                       err)
        _rng.set_state(rng)  # the rerun may have drawn random numbers a plain call draws once
        with plain():
            return self.wrapped(*self.args, **self.kwargs)


def _requests_note(mode: Mode) -> str:
    """The follower's requests, for its INFO line: those its leader never made (sent to the
    hub, as a plain rank sends them) and the answers it got from the leader's record."""
    answers = mode.answers
    if answers is None or not (answers.unrecorded or answers.answered):
        return "no request"
    made = f"{answers.unrecorded} request{'s' if answers.unrecorded != 1 else ''} the leader " \
        "never made" if answers.unrecorded else "no request"
    return f"{made}, {answers.answered} answered from its record"


def _replays() -> bool:
    """Whether this process's coordinated calls record (leader) and replay (followers) their
    HTTP exchanges: huggingface_hub's client is ``httpx`` (>= 1) or ``requests`` (0.x)."""
    try:
        return _replay.recordable()
    except ImportError:  # no huggingface_hub: nothing to record
        return False


def _leader_answers(leader: _coordinate.LeaderView, what: str) -> _replay.LeaderAnswers:
    """A follower's answers from ``leader``'s record as it publishes it (among its pins)."""
    def wait(key: str) -> None:
        if not _NO_WAIT.get():  # a block holding a lock the leader takes: no wait
            leader.wait_pin(key)

    return _replay.LeaderAnswers(leader.pin, wait, what)


def _take_leaders_rng(err: BaseException | None, start: Any) -> None:
    """A follower raising its leader's error ``err``: the random-number state the leader's call
    ended in, where this rank started it from the same (``start``; see
    :mod:`.rng`). Nothing for the leader's own error or another rank's."""
    if err is not None and getattr(err, "_patchload_original", None) is not None:
        state = getattr(err, "_patchload_state", None) or {}
        _rng.take_leaders(state.get("rng"), start)


def _weights_note(mode: Mode) -> str:
    size = mode.load.received_bytes
    if size is None:
        return ""
    return f", {size} bytes of weights {mode.load.received_how or 'taken'}"


def _leader_succeeded(mode: Mode) -> bool:
    try:
        mode.payload  # noqa: B018 - waits for the outcome; raises the leader's failure
    except Exception:  # noqa: BLE001 - a failed leader: the follower's own error stands
        return False
    return True


def coordinated(name: str, wrapped: Callable[..., Any], args: tuple[Any, ...],
                kwargs: dict[str, Any], hooks: Hooks) -> Any:
    """Run ``wrapped(*args, **kwargs)`` leader-first across the ranks of its scope.

    Not collective: no rank waits for ranks that do not make the same call.

    Args:
        name: the patched function's name (part of the call key).
        wrapped: the original function.
        args, kwargs: the caller's arguments, passed through untouched on the leader.
        hooks: what the patch adds to the plain call (:class:`Hooks`): its description, scope,
            what the leader shares and what a follower does with it.

    Returns:
        The original call's result on this rank: the same as a plain call's.

    Raises:
        The leader's exception, on every rank of the scope that waited for that attempt (see
        :func:`patchload.coordination.protocol.leader_first`).
    """
    if _PLAIN.get() or not _state.active():
        return wrapped(*args, **kwargs)
    topology = current_topology()
    if not topology.distributed:
        return wrapped(*args, **kwargs)
    mode = _MODE.get()
    deciding: dict[str, str] = {}
    call = hooks.call
    if call is None:
        # A model load nested in a call that loads no model itself (a sentence-transformers
        # model, a pipeline) is coordinated on its own, so that its weights are still shared.
        nested = mode is not None and not (hooks.loads_model and not mode.loads_model)
        if nested and not mode.lead:
            return _nested(mode, name, wrapped, args, kwargs)  # a follower reruns it offline
        if nested and not (mode.call.scope == "node" and not hooks.loads_model and download_scope(
                _state.config(), topology, job_store()) == "job"):
            return _recorded(mode, name, args, kwargs, lambda: wrapped(*args, **kwargs))
        # Top level, or (job-scoped downloads) nested in a node leader's call: the node leaders
        # coordinate it among themselves.
        try:
            call, deciding = _call_of(name, wrapped, args, kwargs, what=hooks.what,
                                      scope=hooks.scope, nested=mode is not None,
                                      loads_model=hooks.loads_model, topology=topology)
        except Unrenderable as err:
            logger.info("%s: not coordinated (%s): every rank makes this call itself", hooks.what,
                        err)
            token = _MODE.set(None)  # hub calls inside are coordinated one by one
            try:
                return wrapped(*args, **kwargs)
            finally:
                _MODE.reset(token)
    else:  # the caller's call (the node leaders'): its local paths are verified all the same
        call = _rank0.place(call, nested=True)
        try:
            deciding = deciding_arguments(wrapped, args, kwargs)
        except Unrenderable:
            deciding = {}
    one = _Coordinated(name, wrapped, args, kwargs, hooks, _local_paths(deciding),
                       _credentials.call_credentials(kwargs), _source_repo(name, args, kwargs))

    def run() -> Any:
        # A model load's followers build their model while the leader loads; they wait for its
        # weights (the outcome) when they need them.
        try:
            return _coordinate.leader_first(call, one.lead, one.follow, early=hooks.loads_model,
                                            idle=hooks.idle, interrupted=one.interrupted)
        except Exception as err:
            # A follower that waited for the outcome raises its leader's error before its own
            # part: not across credentials (one that started at once decided in follow()). It
            # ran nothing of the call: its state now is the one it started from.
            _take_leaders_rng(err, _rng.state())
            leader_rank = getattr(err, "leader_rank", None)
            if (one.credentials is None or leader_rank is None
                    or getattr(err, "_patchload_original", None) is None):
                raise
            why = one._unshared(call, leader_rank, None)
            if why is None:
                raise
        # Outside the handler: the call among the ranks with this rank's credentials raises
        # its own error, with no __context__ of the leader's (see _Coordinated.follow).
        return one.own_credentials(call, why)

    start = time.monotonic()
    result = _recorded(mode, name, args, kwargs, run)
    if mode is None:  # one line per rank per top-level call
        logger.info("%s %s: %s, in %.2f s", call.prefix(), hooks.what, one.did,
                    time.monotonic() - start)
    return result


def _recorded(mode: Mode | None, name: str, args: tuple[Any, ...], kwargs: dict[str, Any],
              run: Callable[[], Any]) -> Any:
    """``run()``; inside a coordinated call, a hub download's file (or absence) is recorded."""
    if mode is None or name not in _PINNED or _IN_SNAPSHOT.get():
        return run()
    token = _IN_SNAPSHOT.set(name == "snapshot_download")
    try:
        result = run()
    except Exception as err:
        record_hub_result(mode, name, args, kwargs, err)
        raise
    finally:
        _IN_SNAPSHOT.reset(token)
    record_hub_result(mode, name, args, kwargs, result)
    return result


def _nested(mode: Mode, name: str, wrapped: Callable[..., Any], args: tuple[Any, ...],
            kwargs: dict[str, Any]) -> Any:
    """A patched call nested in a follower's coordinated call: a hub download made offline
    (files come from the cache the leader filled); any other call as it is where the call's
    requests are replayed (``mode.replayed``: a revision resolution gets the leader's answer,
    or its error), else offline; a hub download or revision recorded, to be verified against
    the leader's; once the leader's same call returned (a model load's followers start at once:
    :meth:`Mode.wait_pin`), also after weights this rank loads alongside its leader
    (``load.alongside``): a file the leader resolves after them (a generation config) is in the
    cache once its pin is published, so the rest of this rank's load runs while the leader's
    does. The leader's outcome is waited for at the end (:meth:`_Coordinated.follow`)."""
    if name in _PINNED and not _IN_SNAPSHOT.get():
        mode.wait_pin(_pin_key(name, args, kwargs))
    if mode.replayed and name not in _HUB_DOWNLOADS:  # its requests get the leader's answers
        return _recorded(mode, name, args, kwargs, lambda: wrapped(*args, **kwargs))
    if _leader_found_no_snapshot(mode, name, args, kwargs):
        return _recorded(mode, name, args, kwargs, _no_cached_snapshot)

    def offline() -> Any:
        with quiet_offline_fallbacks(mode.asked_offline):
            return _as_asked(wrapped(*args, **_offline(kwargs)), mode.asked_offline)

    return _recorded(mode, name, args, kwargs, offline)


def _leader_found_no_snapshot(mode: Mode, name: str, args: tuple[Any, ...],
                              kwargs: dict[str, Any]) -> bool:
    """A cache-only snapshot lookup the library makes (``local_files_only=True`` as its caller
    passes it: transformers' ``list_repo_templates``) where the leader's same lookup found no
    snapshot: it looked before its own downloads of the call wrote the revision's ref. This
    rank's lookup gets the leader's answer, as its requests do (``mode.replayed``); looking in
    the cache the leader has filled since would find the snapshot and take this rank off the
    leader's result (its pins would differ)."""
    return (mode.replayed and name == "snapshot_download" and kwargs.get("local_files_only") is True
            and mode.leader is not None and not _IN_SNAPSHOT.get()
            and mode.leader.pin(_pin_key(name, args, kwargs), _NOT_PINNED) is None)


_NOT_PINNED: Final = object()


def _no_cached_snapshot() -> Any:
    """What ``snapshot_download(local_files_only=True)`` raises where the cache holds no
    snapshot of the revision (huggingface_hub's own error and message)."""
    from huggingface_hub.errors import LocalEntryNotFoundError

    raise LocalEntryNotFoundError(
        "Cannot find an appropriate cached snapshot folder for the specified revision on the "
        "local disk and outgoing traffic has been disabled. To enable repo look-ups and "
        "downloads online, pass 'local_files_only=False' as input.")


def _cache_dir(kwargs: dict[str, Any]) -> str:
    from huggingface_hub import constants

    from .identity import cache_identity

    return cache_identity(kwargs.get("cache_dir") or constants.HF_HUB_CACHE)


def _call_of(name: str, wrapped: Callable[..., Any], args: tuple[Any, ...],
             kwargs: dict[str, Any], *, what: str, scope: str | None, nested: bool,
             loads_model: bool, topology: Topology) -> tuple[_coordinate.Call, dict[str, str]]:
    """The call to coordinate and its rendered arguments (with :func:`process_state`'s parts;
    ``loads_model``: the call loads a model, so the inference mode it runs in counts).

    ``nested``: the call is made inside a coordinated one (a model inside a sentence-transformers
    model): its ``local_files_only`` / ``force_download`` are then the enclosing call's, which a
    follower sets itself, so they are left out of the key (the enclosing call's key holds them).
    ``topology``: this rank's, as the caller read it (:func:`current_topology`).

    Raises:
        Unrenderable: an argument has no stable rendering (the call is not matched).
    """
    config = _state.config()
    deciding = deciding_arguments(wrapped, args, kwargs)
    if nested:
        deciding.pop("local_files_only", None)
        deciding.pop("force_download", None)
    # Ranks whose caches differ never share a call: each would read another cache than its own.
    deciding["__cache__"] = _cache_dir(kwargs)
    deciding.update(process_state(loads_model=loads_model))
    # Decided by every rank at its first top-level call, whatever this call's scope: rank 0's
    # decision is what the others wait for. A cache of the call's own (cache_dir=) is not the one
    # the decision was made for: per node.
    hub_scope = download_scope(config, topology, job_store())
    if kwargs.get("cache_dir") and deciding["__cache__"] != _cache_dir({}):
        hub_scope = "node"
    # A folder the call downloads into (local_dir=, cache_folder=) may be another folder on
    # another node under the same path (node-local disk): nothing shows it is one folder (the
    # scope's marker test covers the hub cache only), so such a call is shared per node only.
    if any(part.startswith("__dir__") for part in deciding):
        scope = hub_scope = "node"
    call = _coordinate.call_key(name, deciding, scope=scope or hub_scope, topology=topology,
                                config=config, what=what, watch=_repo_folder(args, kwargs))
    stands_for: tuple[str, ...] = ()
    if kwargs.get("local_files_only") is True or deciding["__offline__"] == "True":
        call = dataclasses.replace(call, cache_only=True)  # its plain call reads the cache now
        if "local_files_only" in deciding:  # rank 0's same call online: where this one stands
            online = {k: v for k, v in deciding.items() if k != "local_files_only"}
            stands_for = tuple(_coordinate.key_with(call, name, each)
                               for each in (online, {**online, "local_files_only": "False"}))
    # The process-level parts of the key, which rank 0 publishes: a rank whose parts differ
    # from rank 0's never waits for it (a call with a cache of its own: only that cache).
    facts = {part: deciding[part] for part in _rank0.FACTS if part in deciding
             and not (part == "__cache__" and kwargs.get("cache_dir"))}
    # Not a key part (ranks with other credentials share what any credentials can fetch):
    # published by rank 0 and reported by every rank (.credentials).
    facts["__credentials__"] = credentials_digest()
    return _rank0.place(call, nested=nested, facts=facts, stands_for=stands_for,
                        metadata=name.startswith(_METADATA_PREFIX)), deciding


def _source_repo(name: str, args: tuple[Any, ...],
                 kwargs: dict[str, Any]) -> tuple[str, str] | None:
    """``(repo type, repo id)`` of the hub repo a call names (its first string argument or
    ``repo_id``, when that is not a local path), or None."""
    source = kwargs.get("repo_id", kwargs.get("pretrained_model_name_or_path"))
    if source is None:
        source = next((a for a in args if isinstance(a, (str, os.PathLike))), None)
    if not isinstance(source, str) or not source or os.path.exists(source) \
            or source.count("/") > 1:
        return None
    repo_type = kwargs.get("repo_type") or ("dataset" if "load_dataset" in name else "model")
    return str(repo_type), source


def _repo_folder(args: tuple[Any, ...], kwargs: dict[str, Any]) -> str | None:
    """The hub cache folder of the repo a call names (its first string argument, when that is
    not a local path), whose growth shows a leader's download progress."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    source = kwargs.get("repo_id", kwargs.get("pretrained_model_name_or_path"))
    if source is None:
        source = next((a for a in args if isinstance(a, (str, os.PathLike))), None)
    if not isinstance(source, str) or os.path.exists(source) or source.count("/") > 1:
        return None
    repo_type = kwargs.get("repo_type") or "model"
    cache = kwargs.get("cache_dir") or constants.HF_HUB_CACHE
    return os.path.join(os.fspath(cache), repo_folder_name(repo_id=source, repo_type=repo_type))
