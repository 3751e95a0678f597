"""The only module that reads ``PATCHLOAD_*`` environment variables.

:func:`load_config` reads them when called (not at import), validates every value and returns a
frozen :class:`Config`. A bad value raises :class:`ConfigError` naming the variable, the value and
the accepted values.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Final, Mapping

from ._errors import ConfigError

__all__ = ["Config", "load_config"]

_SCOPES: Final = ("auto", "node", "job")
_TRANSPORTS: Final = ("auto", "shm", "collective")
_SWITCH: Final = {"1": True, "true": True, "yes": True, "on": True,
                  "0": False, "false": False, "no": False, "off": False}


@dataclass(frozen=True, kw_only=True, slots=True)
class Config:
    """patchload's settings, one field per ``PATCHLOAD_*`` variable (table in README.md)."""

    enabled: bool = True
    """``PATCHLOAD``: master switch. False: importing patchload installs no patch."""
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
    leader broadcasts to the other nodes' leaders, else each node's leader reads its own disk)."""
    timeout_s: float = 3600.0
    """``PATCHLOAD_TIMEOUT``: seconds a follower waits for the leader's outcome."""
    heartbeat_s: float = 5.0
    """``PATCHLOAD_HEARTBEAT``: seconds between leader heartbeats; a leader silent for two periods
    is reported dead."""
    bucket_bytes: int = 256 * 2**20
    """``PATCHLOAD_BUCKET_MB`` (in MiB, stored here in bytes): collective broadcast bucket size."""
    log_level: str | None = None
    """``PATCHLOAD_LOG_LEVEL``: level of the ``patchload`` logger (a ``logging`` level name);
    None when unset: the library then leaves logging alone (effectively WARNING)."""


def _switch(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = _SWITCH.get(raw.strip().lower())
    if value is None:
        raise ConfigError(name, raw, "1 or 0 (also true/false, yes/no, on/off)")
    return value


def _choice(env: Mapping[str, str], name: str, choices: tuple[str, ...], default: str) -> str:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value not in choices:
        raise ConfigError(name, raw, " / ".join(choices))
    return value


def _positive(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not value > 0 or value == float("inf"):
        raise ConfigError(name, raw, "a positive finite number")
    return value


def _log_level(env: Mapping[str, str], name: str) -> str | None:
    raw = env.get(name)
    if raw is None or raw.strip() == "":
        return None
    value = raw.strip().upper()
    if not isinstance(logging.getLevelName(value), int):
        raise ConfigError(name, raw, "DEBUG / INFO / WARNING / ERROR / CRITICAL")
    return value


def load_config(env: Mapping[str, str] | None = None) -> Config:
    """Read and validate the ``PATCHLOAD_*`` variables.

    Args:
        env: the mapping to read; ``os.environ`` when None.

    Returns:
        A frozen :class:`Config`. Unset or empty variables take their defaults.

    Raises:
        ConfigError: a variable holds a value outside its accepted values; the message names the
            variable, the value and what is accepted.
    """
    env = os.environ if env is None else env
    return Config(
        enabled=_switch(env, "PATCHLOAD", True),
        download_scope=_choice(env, "PATCHLOAD_DOWNLOAD_SCOPE", _SCOPES, "auto"),
        broadcast=_switch(env, "PATCHLOAD_BROADCAST", True),
        transport=_choice(env, "PATCHLOAD_TRANSPORT", _TRANSPORTS, "auto"),
        timeout_s=_positive(env, "PATCHLOAD_TIMEOUT", 3600.0),
        heartbeat_s=_positive(env, "PATCHLOAD_HEARTBEAT", 5.0),
        bucket_bytes=int(_positive(env, "PATCHLOAD_BUCKET_MB", 256.0) * 2**20),
        log_level=_log_level(env, "PATCHLOAD_LOG_LEVEL"),
    )
