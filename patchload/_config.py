"""The only module that reads ``PATCHLOAD_*`` environment variables.

:func:`load_config` reads them when called (not at import), validates every value and returns a
frozen :class:`Config`. A bad value raises :class:`ConfigError` naming the variable, the value,
the accepted values and the rank. With ``PATCHLOAD=0`` nothing else is read or validated. A
``PATCHLOAD_*`` name that patchload does not know is logged at WARNING once per process, with
the closest known name, and otherwise ignored.

Accepted spellings (leading and trailing spaces ignored; an empty value means unset):

- switches: ``1`` / ``0``, ``true`` / ``false``, ``yes`` / ``no``, ``on`` / ``off``, any case;
- choices and log levels: the listed words, any case;
- seconds and MiB: a decimal number (``5``, ``2.5``, ``1e3``); seconds at most ``1e9`` (what
  every wait below can take); ``PATCHLOAD_TIMEOUT`` and ``PATCHLOAD_PROGRESS_WARNING`` also take
  ``none`` (or ``inf``, ``infinity``): no bound; MiB at least one byte.
"""

from __future__ import annotations

import difflib
import logging
import math
import os
import threading
from dataclasses import dataclass
from typing import Any, Final, Mapping

from . import _runtime
from ._errors import ConfigError
from ._logging import get_logger
from ._topology import current_topology

__all__ = ["Config", "load_config"]

logger = get_logger(__name__)

_SCOPES: Final = ("auto", "node", "job")
_TRANSPORTS: Final = ("auto", "shm", "collective")
# Where other packages register weight transports (patchload.transport.registry).
TRANSPORT_ENTRY_POINTS: Final = "patchload.transports"


def transport_entry_points() -> list[Any]:
    """The installed packages' entry points in :data:`TRANSPORT_ENTRY_POINTS`."""
    from importlib.metadata import entry_points

    return list(entry_points(group=TRANSPORT_ENTRY_POINTS))
_SWITCH: Final = {"1": True, "true": True, "yes": True, "on": True,
                  "0": False, "false": False, "no": False, "off": False}
_NO_BOUND: Final = ("none", "inf", "infinity")
# The longest wait patchload accepts (about 31 years): longer ones overflow the store's and the
# threads' timeouts (datetime.timedelta, threading.TIMEOUT_MAX).
_MAX_SECONDS: Final = 1e9

_VARIABLES: Final = ("PATCHLOAD", "PATCHLOAD_DOWNLOAD_SCOPE", "PATCHLOAD_BROADCAST",
                     "PATCHLOAD_TRANSPORT", "PATCHLOAD_TIMEOUT", "PATCHLOAD_HEARTBEAT",
                     "PATCHLOAD_CLAIM_GRACE", "PATCHLOAD_EXIT_WAIT", "PATCHLOAD_ARRIVAL_WINDOW",
                     "PATCHLOAD_GROUP_TIMEOUT", "PATCHLOAD_PROGRESS_WARNING",
                     "PATCHLOAD_SCOPE_WAIT", "PATCHLOAD_BUCKET_MB", "PATCHLOAD_FS_READ_MB",
                     "PATCHLOAD_LOG_LEVEL")
_PREFIX: Final = "PATCHLOAD_"
_SUFFIXES: Final = tuple(name[len(_PREFIX):] for name in _VARIABLES if name.startswith(_PREFIX))
# Read by patchload's own tools, not by the library: never reported as unknown.
_TOOL_VARIABLES: Final = ("PATCHLOAD_HUB_LOG_LEVEL",  # patchload.testing.hub
                          "PATCHLOAD_MEASURE_DIR")  # demo/site/sitecustomize.py



class _Warned:
    """The unknown variable names this install already reported."""

    def __init__(self) -> None:
        self.names: set[str] = set()
        self.lock = threading.Lock()


@dataclass(frozen=True, kw_only=True, slots=True)
class Config:
    """patchload's settings, one field per ``PATCHLOAD_*`` variable (the table in
    docs/configuration.md is generated from these docstrings: ``scripts/config_doc.py``)."""

    enabled: bool = True
    """``PATCHLOAD``: master switch. False: importing patchload installs no patch, and no other
    variable is read."""
    download_scope: str = "auto"
    """``PATCHLOAD_DOWNLOAD_SCOPE``: ``node`` (local rank 0 of each node downloads into that node's
    cache), ``job`` (one download for the job into a shared cache) or ``auto`` (``job`` when every
    node sees the same cache directory, else ``node``)."""
    broadcast: bool = True
    """``PATCHLOAD_BROADCAST``: followers receive the leader's weights. False: only downloads are
    coordinated and every rank loads the weights itself."""
    transport: str = "auto"
    """``PATCHLOAD_TRANSPORT``: ``shm`` (each node's leader reads its files and shares them in
    node shared memory), ``collective`` (one job leader broadcasts to every rank over a private
    process group) or ``auto`` (shm inside a node; across nodes on one shared hub cache, the job
    leader broadcasts to the other nodes' leaders, else each node leader reads its own disk), or
    the name of a transport an installed package registers (entry point group
    ``patchload.transports``)."""
    timeout_s: float | None = None
    """``PATCHLOAD_TIMEOUT``: the most a follower waits in total for its leader's outcome, in
    seconds. None (``none``, the default): no bound on the total wait; a follower still fails
    within two ``heartbeat_s`` periods when its leader dies or goes silent, so by default it gives
    up on a leader that stopped making progress, never on a live leader's long download."""
    heartbeat_s: float = 5.0
    """``PATCHLOAD_HEARTBEAT``: seconds between leader heartbeats; a leader silent for two periods
    is reported dead."""
    claim_grace_s: float = 120.0
    """``PATCHLOAD_CLAIM_GRACE``: the most another rank waits, in seconds, for rank 0 of the
    scope to reach a call when rank 0 is alive, behind (it has not reached that point of its
    sequence of calls) and not blocked in a collective of the user's; then it claims (and
    leads) the call itself. Never waited out on the common path: a rank 0 that passed the
    call by, is blocked in a collective, exited, or whose cache or endpoint differs, is
    known at once (see :mod:`patchload.coordination.rank0`). 0: nobody waits; the first rank
    to claim a call leads it."""
    exit_wait_s: float = 60.0
    """``PATCHLOAD_EXIT_WAIT``: the most a leader waits at exit, in seconds, for its followers to
    take the weights it shares. 0: it does not wait (a follower that finds the leader gone loads
    from the cache)."""
    arrival_window_s: float = 5.0
    """``PATCHLOAD_ARRIVAL_WINDOW``: seconds a collective broadcast's leader waits for the members
    to arrive once its load is done; later ranks load from the cache."""
    group_timeout_s: float = 300.0
    """``PATCHLOAD_GROUP_TIMEOUT``: seconds a collective broadcast's members wait for each other
    (connecting the private group, then each bucket) before a member gives up and loads from
    the cache."""
    progress_warning_s: float | None = 60.0
    """``PATCHLOAD_PROGRESS_WARNING``: a follower that has waited longer than this, in seconds,
    logs a WARNING, and again periodically while it waits. None (``none``): no such warning."""
    scope_wait_s: float = 60.0
    """``PATCHLOAD_SCOPE_WAIT``: accepted and validated, no longer used: the ``auto`` download
    scope is decided without waiting for any rank (see ``patchload.coordination.scope``)."""
    bucket_bytes: int = 256 * 2**20
    """``PATCHLOAD_BUCKET_MB`` (in MiB, stored here in bytes): collective broadcast bucket size."""
    fs_read_bytes: int = 4 * 2**20
    """``PATCHLOAD_FS_READ_MB`` (in MiB, stored here in bytes): the largest file body a user's
    ``HfFileSystem`` read (``open(...).read()``, ``cat_file``, ``read_text``...) shares: the
    leader publishes a body up to this size with the call's record and its followers get it
    from there; a larger file is read by every rank from the hub, as plain."""
    log_level: str | None = None
    """``PATCHLOAD_LOG_LEVEL``: level of the ``patchload`` logger (a ``logging`` level name);
    None when unset: WARNING, and no handler of patchload's own (see :mod:`patchload._logging`)."""


def _invalid(env: Mapping[str, str], name: str, raw: str, accepted: str) -> ConfigError:
    """The error for a bad value, naming this process's rank in a distributed job."""
    topology = current_topology(env)
    return ConfigError(name, raw, accepted, rank=topology.rank if topology.distributed else None)


def _raw(env: Mapping[str, str], name: str) -> str | None:
    raw = env.get(name)
    return None if raw is None or raw.strip() == "" else raw


def _switch(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = _raw(env, name)
    if raw is None:
        return default
    value = _SWITCH.get(raw.strip().lower())
    if value is None:
        raise _invalid(env, name, raw, "1 or 0 (also true/false, yes/no, on/off, any case)")
    return value


def _choice(env: Mapping[str, str], name: str, choices: tuple[str, ...], default: str) -> str:
    raw = _raw(env, name)
    if raw is None:
        return default
    value = raw.strip().lower()
    if value not in choices:
        raise _invalid(env, name, raw, " / ".join(choices))
    return value


def _transport(env: Mapping[str, str]) -> str:
    """A built-in transport's name, or one an installed package registers (read only then:
    listing entry points costs milliseconds at import)."""
    raw = _raw(env, "PATCHLOAD_TRANSPORT")
    if raw is None or raw.strip().lower() in _TRANSPORTS:
        return _choice(env, "PATCHLOAD_TRANSPORT", _TRANSPORTS, "auto")
    names = (*_TRANSPORTS, *sorted(ep.name for ep in transport_entry_points()))
    return _choice(env, "PATCHLOAD_TRANSPORT", names, "auto")


def _seconds(env: Mapping[str, str], name: str, default: float, *, zero: bool = False) -> float:
    """A number of seconds > 0 (>= 0 with ``zero``), at most ``_MAX_SECONDS``."""
    raw = _raw(env, name)
    if raw is None:
        return default
    value = _float(raw)
    if not ((value >= 0 if zero else value > 0) and value <= _MAX_SECONDS):
        raise _invalid(env, name, raw, ("a finite number >= 0" if zero else
                                        "a positive finite number") + " of seconds, at most 1e9")
    return value


def _bytes_of_mib(env: Mapping[str, str], name: str, default: float) -> int:
    """A positive finite number of MiB, in bytes (at least one)."""
    raw = _raw(env, name)
    if raw is None:
        return int(default * 2**20)
    value = _float(raw)
    nbytes = int(value * 2**20) if 0 < value < math.inf else 0
    if nbytes < 1:
        raise _invalid(env, name, raw, "a positive finite number of MiB, at least one byte "
                                       "(1e-6)")
    return nbytes


def _float(raw: str) -> float:
    try:
        return float(raw)
    except ValueError:
        return math.nan


def _bound(env: Mapping[str, str], name: str, default: float | None) -> float | None:
    """A positive number of seconds up to ``_MAX_SECONDS``, or None for ``none`` / ``inf`` /
    ``infinity``."""
    raw = _raw(env, name)
    if raw is None:
        return default
    if raw.strip().lower() in _NO_BOUND:
        return None
    value = _float(raw)
    if not 0 < value <= _MAX_SECONDS:
        raise _invalid(env, name, raw, "a positive number of seconds, at most 1e9, or none (no "
                                       "bound; also inf)")
    return value


def _log_level(env: Mapping[str, str], name: str) -> str | None:
    raw = _raw(env, name)
    if raw is None:
        return None
    value = raw.strip().upper()
    if not isinstance(logging.getLevelName(value), int):
        raise _invalid(env, name, raw, "DEBUG / INFO / WARNING / ERROR / CRITICAL")
    return value


def _warn_unknown(env: Mapping[str, str]) -> None:
    """Log each ``PATCHLOAD_*`` name patchload does not read, once per process."""
    known = _VARIABLES + _TOOL_VARIABLES
    for name in sorted(env):
        if not name.startswith(_PREFIX) or name in known:
            continue
        warned = _runtime.current().part(_Warned)
        with warned.lock:
            if name in warned.names:
                continue
            warned.names.add(name)
        # Compared without the common prefix, which would make every name look close.
        close = difflib.get_close_matches(name[len(_PREFIX):], _SUFFIXES, n=1)
        if close:
            logger.warning("unknown variable %s (did you mean %s%s?): ignored", name, _PREFIX,
                           close[0])
        else:
            logger.warning("unknown variable %s: ignored (patchload reads %s)", name,
                           ", ".join(_VARIABLES))


def load_config(env: Mapping[str, str] | None = None) -> Config:
    """Read and validate the ``PATCHLOAD_*`` variables.

    With ``PATCHLOAD=0`` only that variable is read: the other fields keep their defaults and no
    other value is validated (a bad one does not stop a disabled patchload).

    Args:
        env: the mapping to read; ``os.environ`` when None.

    Returns:
        A frozen :class:`Config`. Unset or empty variables take their defaults.

    Raises:
        ConfigError: a variable holds a value outside its accepted values (``PATCHLOAD`` itself
            always, the others when enabled); the message names the variable, the value, what
            is accepted and, in a distributed job, this process's rank.
    """
    env = os.environ if env is None else env
    if not _switch(env, "PATCHLOAD", True):
        return Config(enabled=False)
    return _read(env)


def _read(env: Mapping[str, str] | None = None) -> Config:
    """Every variable, validated, whatever ``PATCHLOAD`` says (for an explicit ``install()``)."""
    env = os.environ if env is None else env
    _warn_unknown(env)
    return Config(
        enabled=_switch(env, "PATCHLOAD", True),
        download_scope=_choice(env, "PATCHLOAD_DOWNLOAD_SCOPE", _SCOPES, "auto"),
        broadcast=_switch(env, "PATCHLOAD_BROADCAST", True),
        transport=_transport(env),
        timeout_s=_bound(env, "PATCHLOAD_TIMEOUT", None),
        heartbeat_s=_seconds(env, "PATCHLOAD_HEARTBEAT", 5.0),
        claim_grace_s=_seconds(env, "PATCHLOAD_CLAIM_GRACE", 120.0, zero=True),
        exit_wait_s=_seconds(env, "PATCHLOAD_EXIT_WAIT", 60.0, zero=True),
        arrival_window_s=_seconds(env, "PATCHLOAD_ARRIVAL_WINDOW", 5.0),
        group_timeout_s=_seconds(env, "PATCHLOAD_GROUP_TIMEOUT", 300.0),
        progress_warning_s=_bound(env, "PATCHLOAD_PROGRESS_WARNING", 60.0),
        scope_wait_s=_seconds(env, "PATCHLOAD_SCOPE_WAIT", 60.0),
        bucket_bytes=_bytes_of_mib(env, "PATCHLOAD_BUCKET_MB", 256.0),
        fs_read_bytes=_bytes_of_mib(env, "PATCHLOAD_FS_READ_MB", 4.0),
        log_level=_log_level(env, "PATCHLOAD_LOG_LEVEL"),
    )
