"""Coordinated top-level calls: the leader runs the real call, followers rerun it from the cache.

Every patched entry point (``hf_hub_download``, ``snapshot_download``, ``from_pretrained`` of
configs, tokenizers, processors, models and the Auto classes) goes through :func:`coordinated`.
The outermost patched call of a thread is the one coordinated: its leader runs the original call,
which downloads whatever it needs (revision resolution, metadata calls, files); its followers wait
for the leader's outcome and then run the same original call with ``local_files_only=True``, so
they make no HTTP request at all. Patched calls nested inside run as they are, except that inside
a follower they are forced offline, and inside a node-scoped leader (weights shared per node) the
hub downloads are coordinated among node leaders at the job's download scope.
"""

from __future__ import annotations

import contextvars
import inspect
import logging
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Final

from .. import _state
from . import protocol as _coordinate
from .scope import download_scope
from .store import job_store
from .._topology import current_topology

__all__ = ["Mode", "current_mode", "coordinated", "deciding_arguments"]

logger = logging.getLogger(__name__)

# Arguments that never change what a call returns, or differ per rank without meaning.
_VOLATILE: Final = frozenset({
    "token", "use_auth_token", "tqdm_class", "user_agent", "headers", "proxies", "etag_timeout",
    "library_name", "library_version", "max_workers", "resume_download", "local_files_only",
    "force_download", "_from_auto", "_from_pipeline", "_commit_hash",
})
_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


@dataclass(frozen=True)
class Mode:
    """What the enclosing coordinated call is doing on this rank.

    Attributes:
        lead: True on the leader, False on a follower.
        used: per-call scratch space for nested wrappers (e.g. whether weights were received).
        loads_model: the enclosing call loads model weights (it shares them on the leader).
        call: the enclosing coordinated call.
        payload_of: followers: returns the leader's published payload (see :attr:`payload`).
    """

    lead: bool
    call: _coordinate.Call
    loads_model: bool = False
    used: dict[str, Any] = field(default_factory=dict)
    payload_of: Callable[[], dict[str, Any]] | None = None

    @property
    def payload(self) -> dict[str, Any]:
        """The leader's published payload; empty on the leader. A follower that started before
        the leader finished (model loads start once the leader's files are in the cache) waits
        here for the leader's outcome, bounded, and raises the leader's failure."""
        return self.payload_of() if self.payload_of is not None else {}


_MODE: contextvars.ContextVar[Mode | None] = contextvars.ContextVar("patchload_mode", default=None)


def current_mode() -> Mode | None:
    """The mode of the enclosing coordinated call in this thread, or None at top level."""
    return _MODE.get()


def deciding_arguments(wrapped: Callable[..., Any], args: tuple[Any, ...],
                       kwargs: dict[str, Any]) -> dict[str, Any]:
    """The arguments that decide a call's result, by parameter name (so positional and keyword
    spellings agree across ranks), as stable strings (no object addresses)."""
    try:
        signature = inspect.signature(wrapped)
        named = dict(signature.bind_partial(*args, **kwargs).arguments)
        for name, param in signature.parameters.items():
            if param.kind is inspect.Parameter.VAR_KEYWORD and name in named:
                named.update(named.pop(name))
    except (TypeError, ValueError):  # no signature, or arguments that do not bind
        named = {**{f"arg{i}": a for i, a in enumerate(args)}, **kwargs}
    return {k: _ADDRESS.sub("", repr(v)) for k, v in named.items() if k not in _VOLATILE}


def _offline(kwargs: dict[str, Any]) -> dict[str, Any]:
    offline = {**kwargs, "local_files_only": True}
    if "force_download" in kwargs:  # the leader just fetched: do not fetch again
        offline["force_download"] = False
    return offline


def _cache_miss(err: BaseException) -> bool:
    from huggingface_hub.errors import LocalEntryNotFoundError

    seen: BaseException | None = err
    while seen is not None:
        if isinstance(seen, LocalEntryNotFoundError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def _offline_or_online(wrapped: Callable[..., Any], args: tuple[Any, ...],
                       kwargs: dict[str, Any], call: _coordinate.Call,
                       offline_kwarg: bool) -> Any:
    """Follower: rerun the call from the cache; if the cache lacks what the leader fetched (it
    is not the cache the leader wrote to), warn and make the call online."""
    try:
        return wrapped(*args, **(_offline(kwargs) if offline_kwarg else kwargs))
    except OSError as err:
        if not _cache_miss(err):
            raise
        logger.warning("%s: the leader succeeded but this rank's cache lacks its files (%s): "
                       "downloading here; set PATCHLOAD_DOWNLOAD_SCOPE=node if caches are "
                       "node-local", call.prefix(), err)
        return wrapped(*args, **kwargs)


def coordinated(name: str, wrapped: Callable[..., Any], args: tuple[Any, ...],
                kwargs: dict[str, Any], *, what: str, scope: str | None = None,
                share: Callable[[Any, _coordinate.Call, Mode],
                                tuple[dict[str, Any], Callable[[], None] | None]] | None = None,
                settle: Callable[[Any, Mode], Any] | None = None,
                lead_with: Callable[..., Any] | None = None,
                call: _coordinate.Call | None = None,
                offline_kwarg: bool = True) -> Any:
    """Run ``wrapped(*args, **kwargs)`` leader-first across the ranks of its scope.

    Not collective: no rank waits for ranks that do not make the same call.

    Args:
        name: the patched function's name (part of the call key).
        wrapped: the original function.
        args, kwargs: the caller's arguments, passed through untouched on the leader.
        what: human-readable description for logs and errors.
        scope: ``node`` or ``job``; the download scope when None.
        share: run by the leader on the result (with the call and the leader's mode, whose
            ``used`` nested wrappers filled); returns extra payload for followers (weights) and a
            step to run once the payload is published (or None).
        settle: run by a follower on its result before returning it.
        lead_with: what the leader runs in place of ``wrapped`` (same arguments), e.g. a node
            leader that takes the weights from the job leader instead of its disk.
        call: a call built by the caller (the node leaders' call inside a node-scoped load);
            coordinated as it is, whatever the enclosing mode.
        offline_kwarg: a follower reruns the call with ``local_files_only=True``. False for
            calls that reject it (transformers 5.2x ``load_adapter`` passes it on to a config
            that raises TypeError); their nested hub calls are still made offline.

    Returns:
        The original call's result on this rank.

    Raises:
        The leader's exception, on every rank of the scope (see
        :func:`patchload.coordination.protocol.leader_first`).
    """
    mode = _MODE.get()
    topology = current_topology()
    if not topology.distributed or not _state.active():
        return wrapped(*args, **kwargs)
    if call is None:
        call = _call_of(name, wrapped, args, kwargs, what=what, scope=scope,
                        shares=share is not None)
        if call is None:
            return _nested(mode, wrapped, args, kwargs)
    lead_call = lead_with or wrapped

    def lead() -> tuple[Any, dict[str, Any], Callable[[], None] | None]:
        mode = Mode(lead=True, call=call, loads_model=share is not None)
        token = _MODE.set(mode)
        try:
            result = lead_call(*args, **kwargs)
        finally:
            _MODE.reset(token)
        payload, after = share(result, call, mode) if share is not None else ({}, None)
        return result, payload, after

    def follow(role: _coordinate.Role, payload: Callable[[], dict[str, Any]]) -> Any:
        mode = Mode(lead=False, call=call, payload_of=payload,
                    loads_model=share is not None)
        token = _MODE.set(mode)
        try:
            result = _offline_or_online(wrapped, args, kwargs, call, offline_kwarg)
        finally:
            _MODE.reset(token)
        return settle(result, mode) if settle is not None else result

    # A model load's followers build their model while the leader loads; they wait for its
    # weights (the outcome) when they need them.
    return _coordinate.leader_first(call, lead, follow, early=share is not None)


def _nested(mode: Mode, wrapped: Callable[..., Any], args: tuple[Any, ...],
            kwargs: dict[str, Any]) -> Any:
    """A patched call nested in a coordinated one that covers it."""
    if mode.lead:
        return wrapped(*args, **kwargs)
    return wrapped(*args, **_offline(kwargs))  # a follower rerunning from the cache


def _call_of(name: str, wrapped: Callable[..., Any], args: tuple[Any, ...],
             kwargs: dict[str, Any], *, what: str, scope: str | None,
             shares: bool) -> _coordinate.Call | None:
    """The call to coordinate, or None when the enclosing coordinated call covers this one."""
    mode = _MODE.get()
    topology = current_topology()
    config = _state.config()
    # A model load nested in a call that loads no model itself (a sentence-transformers model, a
    # pipeline) is coordinated on its own, so that its weights are still shared.
    own_weights = shares and (mode is None or not mode.loads_model)
    if mode is not None and not mode.lead and not own_weights:
        return None  # a follower: it reruns everything from the cache
    store = job_store()
    hub_scope = download_scope(config, topology, store)
    if mode is not None and mode.lead and not own_weights and not (
            mode.call.scope == "node" and hub_scope == "job" and not shares):
        return None  # nested inside a leader: its own call covers this one
    return _coordinate.call_key(name, deciding_arguments(wrapped, args, kwargs),
                                scope=scope or hub_scope, topology=topology, config=config,
                                what=what)
