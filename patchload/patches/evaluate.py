"""Patches for Hugging Face ``evaluate``: fetching a metric module as one coordinated call.

``evaluate.load("accuracy")`` fetches the module from the hub with
``evaluate.loading.evaluation_module_factory`` (the ``evaluate-metric/accuracy`` space's
``accuracy.py``, its relative imports) and then builds the metric from it, on each rank, with
that rank's own ``process_id``, ``num_process``, ``experiment_id`` and ``cache_dir``. Only the
fetch is coordinated (in the download scope: the node's rank 0, or the job's for a cache the job
shares); building the metric is every rank's own, as plain.

``evaluate`` sends its requests through ``requests`` (``evaluate.utils.file_utils.
_request_with_retry``), which huggingface_hub's ``httpx`` record and replay
(:mod:`patchload.coordination.replay`) does not see: this module records and replays them
itself, at ``_request_with_retry``.

- The **leader** makes the plain fetch: ``HEAD`` of the module script (at the tag of the
  installed evaluate, then at ``main``), of each relative import, the download counter's
  ``HEAD`` (``HF_UPDATE_DOWNLOAD_COUNTS``), and a ``GET`` of each file missing from evaluate's
  download cache, which it copies into the modules cache. It publishes the answers to its
  ``HEAD`` requests (status, headers, final URL; a transport error by class and message) and
  the module it got (module path and hash).
- A **follower** waits for that outcome, then reruns the same fetch with every request
  answered from the leader's record: evaluate's own code finds the leader's files in its
  download cache under the same ETag, copies nothing new, and returns the same module. It uses
  that result only when its evaluate download cache and offline settings are the leader's, its
  rerun asked for nothing the leader's record does not hold (a ``GET``: a file its download
  cache lacks) and it got the leader's module path and hash; otherwise it warns and makes the
  plain fetch.

``PATCHLOAD=0`` patches nothing here. The leader's failure (a metric that does not exist:
``FileNotFoundError``) reaches the followers as the same class.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
from typing import Any, Callable, Final, Iterator

from .._patching import Patch
from ..coordination.call import Hooks, VerificationFailed, coordinated, current_mode, plain
from ..coordination.replay import ReplayMiss, rebuilt_error

__all__ = ["evaluate_patches"]

# The packages whose exception classes a follower raises again from the leader's record.
_ERROR_PACKAGES: Final = ("requests", "urllib3", "evaluate", "builtins")

# The leader's fetch: the answers recorded so far (None: not recording).
_RECORDING: contextvars.ContextVar[list[dict[str, Any]] | None] = contextvars.ContextVar(
    "patchload_evaluate_recording", default=None)
# A follower's rerun: the leader's answers (None: not replaying).
_REPLAY: contextvars.ContextVar[_Replay | None] = contextvars.ContextVar(
    "patchload_evaluate_replay", default=None)


# --- evaluate's requests ---------------------------------------------------------------------

def _key(method: str, url: str, params: dict[str, Any]) -> str:
    headers = params.get("headers") or {}
    ranged = next((value for name, value in headers.items() if name.lower() == "range"), None)
    return f"{method.upper()} {url}" + (f" range={ranged}" if ranged else "")


class _Replay:
    """The leader's answers: the same request gets them in the leader's order (the last one
    again once they run out); any other request is a miss (:class:`ReplayMiss`, which
    evaluate's ``except Exception`` does not catch)."""

    def __init__(self, entries: list[dict[str, Any]]) -> None:
        self._answers: dict[str, list[dict[str, Any]]] = {}
        for entry in entries:
            self._answers.setdefault(entry["key"], []).append(entry)
        self.missed: str | None = None

    def answer(self, key: str) -> Any:
        queue = self._answers.get(key)
        if not queue:
            self.missed = key
            raise ReplayMiss(f"the leader made no request {key} (or did not record it)")
        entry = queue.pop(0) if len(queue) > 1 else queue[0]
        if "error" in entry:
            raise rebuilt_error(entry["error"], key, _ERROR_PACKAGES)
        import requests
        from requests.structures import CaseInsensitiveDict

        response = requests.Response()
        response.status_code = entry["status"]
        response.headers = CaseInsensitiveDict(dict(entry["headers"]))
        response.url = entry["url"]
        response.reason = entry["reason"]
        response._content = b""  # a HEAD: no body
        return response


def _request(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> Any:
    """``evaluate.utils.file_utils._request_with_retry(method, url, ...)``: answered from the
    leader's record in a follower's rerun, recorded (a ``HEAD``'s answer or any request's
    transport error) in a leader's fetch, else passed through."""
    record, replay = _RECORDING.get(), _REPLAY.get()
    if record is None and replay is None:
        return wrapped(*args, **kwargs)
    try:
        bound = inspect.signature(wrapped).bind(*args, **kwargs).arguments
        method, url = str(bound["method"]), str(bound["url"])
        params = bound.get("params") or {}
    except (TypeError, ValueError, KeyError):
        if replay is not None:
            raise ReplayMiss("a request of another shape than evaluate 0.4's") from None
        return wrapped(*args, **kwargs)
    key = _key(method, url, params)
    try:
        response = replay.answer(key) if replay is not None else wrapped(*args, **kwargs)
    except Exception as err:
        if record is not None:
            record.append({"key": key, "error": {"module": type(err).__module__,
                                                 "qualname": type(err).__qualname__,
                                                 "message": str(err)}})
        raise
    if record is not None and method.upper() == "HEAD":  # a GET's body is in the cache
        record.append({"key": key, "status": response.status_code,
                       "headers": sorted(response.headers.items()), "url": response.url,
                       "reason": response.reason})
    return response


@contextlib.contextmanager
def _set(var: contextvars.ContextVar[Any], value: Any) -> Iterator[None]:
    """``var`` holds ``value`` for the block (the leader's record, a follower's replay)."""
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


# --- the fetch ---------------------------------------------------------------------------------

def _arguments(wrapped: Callable[..., Any], args: tuple[Any, ...],
               kwargs: dict[str, Any]) -> dict[str, Any]:
    try:
        return dict(inspect.signature(wrapped).bind_partial(*args, **kwargs).arguments)
    except (TypeError, ValueError):
        return dict(kwargs)


def _settings(arguments: dict[str, Any]) -> dict[str, Any]:
    """What decides the fetch besides its arguments and may differ per rank: evaluate's
    download cache (by identity), its offline mode and whether it counts downloads."""
    from evaluate import config

    from ..coordination.identity import cache_identity

    download_config = arguments.get("download_config")
    cache = getattr(download_config, "cache_dir", None) \
        or (arguments.get("download_kwargs") or {}).get("cache_dir") \
        or config.DOWNLOADED_EVALUATE_PATH
    return {"downloads": cache_identity(cache), "offline": bool(config.HF_EVALUATE_OFFLINE),
            "counts": bool(config.HF_UPDATE_DOWNLOAD_COUNTS)}


def _module(result: Any) -> list[str] | None:
    module_path, module_hash = getattr(result, "module_path", None), getattr(result, "hash", None)
    if not isinstance(module_path, str) or not isinstance(module_hash, str):
        return None
    return [module_path, module_hash]


def _leader(wrapped: Callable[..., Any], led: list[dict[str, Any]]) -> Callable[..., Any]:
    """What the leader runs: ``wrapped``, its exchanges recorded into ``led`` (this call's)."""
    @functools.wraps(wrapped)
    def lead(*args: Any, **kwargs: Any) -> Any:
        led.clear()
        with _set(_RECORDING, led):
            return wrapped(*args, **kwargs)

    return lead


def _share(arguments: dict[str, Any],
           led: list[dict[str, Any]]) -> Callable[..., tuple[dict[str, Any], None]]:
    def share(result: Any, call: Any, mode: Any) -> tuple[dict[str, Any], None]:
        return {"evaluate": {"record": led,
                             "module": _module(result), "settings": _settings(arguments)}}, None

    return share


def _follower(wrapped: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(wrapped)
    def follow(*args: Any, **kwargs: Any) -> Any:
        mode = current_mode()
        if mode is None or mode.lead:  # the plain call of a follower that gave up
            return wrapped(*args, **kwargs)
        leader = mode.payload.get("evaluate")  # waits; raises the leader's failure
        if not leader or leader.get("record") is None or leader.get("module") is None:
            raise VerificationFailed("the leader published no record of its fetch")
        mine = _settings(_arguments(wrapped, args, kwargs))
        if mine != leader["settings"]:
            raise VerificationFailed(f"this rank's evaluate settings {mine} are not the "
                                     f"leader's {leader['settings']}")
        replay = _Replay(leader["record"])
        try:
            with _set(_REPLAY, replay), plain():
                result = wrapped(*args, **kwargs)
        except ReplayMiss as miss:
            raise VerificationFailed(str(miss)) from None
        if replay.missed is not None:  # a miss the library caught
            raise VerificationFailed(f"the leader made no request {replay.missed}")
        if _module(result) != leader["module"]:
            raise VerificationFailed(f"fetched the module {_module(result)}, the leader "
                                     f"{leader['module']}")
        return result

    return follow


def _factory(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...],
             kwargs: dict[str, Any]) -> Any:
    """``evaluate.loading.evaluation_module_factory`` (what ``evaluate.load`` fetches with):
    coordinated (see the module docstring)."""
    arguments = _arguments(wrapped, args, kwargs)
    led: list[dict[str, Any]] = []  # the leader's exchanges, when this rank leads
    return coordinated("evaluate.loading.evaluation_module_factory", _follower(wrapped), args,
                       kwargs, Hooks(f"evaluate.load({arguments.get('path')!r})",
                                     share=_share(arguments, led),
                                     lead_with=_leader(wrapped, led), offline_kwarg=False))


def evaluate_patches() -> list[Patch]:
    """The patches for ``evaluate``: the module fetch (also where ``evaluate.inspect`` and
    ``evaluate.evaluation_suite`` bound it by name) and the requests it sends."""
    return [
        Patch("evaluate.utils.file_utils", "_request_with_retry", _request),
        Patch("evaluate.loading", "evaluation_module_factory", _factory, rebind_aliases=True),
    ]
