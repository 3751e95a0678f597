"""Process-wide switches: the configuration read at install time and whether patches are live."""

from __future__ import annotations

from ._config import Config, load_config

__all__ = ["active", "config", "set_active"]

_CONFIG: Config | None = None
_ACTIVE = False


def config() -> Config:
    """The configuration read by :func:`patchload.install` (read now if not installed)."""
    global _CONFIG
    if _CONFIG is None:
        _CONFIG = load_config()
    return _CONFIG


def active() -> bool:
    """True while patchload's patches are installed; wrappers pass straight through otherwise."""
    return _ACTIVE


def set_active(value: bool, cfg: Config | None = None) -> None:
    """Record whether patches are live and the configuration they run with."""
    global _ACTIVE, _CONFIG
    _ACTIVE = value
    if cfg is not None:
        _CONFIG = cfg
