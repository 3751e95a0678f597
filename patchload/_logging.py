"""patchload's loggers: every line names patchload and the rank; INFO only when asked for.

The rule (set up once, by :func:`configure`, at ``import patchload`` and at each
:func:`patchload.install`):

- Every module logs through :func:`get_logger` (a ``patchload.*`` logger behind an adapter), so
  every message starts ``patchload [rank r/N]`` whichever handler prints it: the rank is added
  here unless the message already begins with one (``call.prefix()``, hand-written
  ``[rank r]``). Formatting stays lazy (``%``-style arguments).
- ``PATCHLOAD_LOG_LEVEL`` unset: the ``patchload`` logger's level is WARNING (unless the
  application set one before), it has no handler of its own and propagates. So WARNING and above
  reach the application's handlers once, or, where the application configured no logging at
  all, stderr (Python's ``logging.lastResort``); INFO and DEBUG print nowhere, even under a root
  logger at INFO (``logging.basicConfig(level=INFO)``). No ``NullHandler``: it would count as a
  handler and silence ``lastResort``, so a warning would print nowhere in a script without logging
  configured.
- ``PATCHLOAD_LOG_LEVEL`` set: that level, ONE ``StreamHandler`` of patchload's own on stderr
  (``LEVEL patchload [rank r/N] message``), and ``propagate`` off, so a root handler does not
  print the same line a second time.

This is transformers' shape (a level of its own on the library's top logger) without its
always-on handler, which would keep patchload's warnings from the application's handlers.
"""

from __future__ import annotations

import logging
from typing import Any, Final, MutableMapping

__all__ = ["configure", "describe", "get_logger"]

ROOT: Final = "patchload"
FORMAT: Final = "%(levelname)s %(message)s"


class _Named(logging.LoggerAdapter):  # type: ignore[type-arg]
    """A ``patchload.*`` logger whose messages start ``patchload [rank r/N]``."""

    def log(self, level: int, msg: object, *args: Any, **kwargs: Any) -> None:
        if not self.isEnabledFor(level):
            return
        # One frame more than the caller's: %(funcName)s / %(lineno)s name the caller.
        kwargs["stacklevel"] = kwargs.get("stacklevel", 1) + 1
        self.logger.log(level, _named(msg, args), *args, **kwargs)

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]
                ) -> tuple[Any, MutableMapping[str, Any]]:
        return msg, kwargs  # log() above does the naming (it needs the arguments)


def _names_a_rank(text: object) -> bool:
    return isinstance(text, str) and text.startswith(("[rank ", "[group rank "))


def _named(msg: object, args: tuple[Any, ...]) -> str:
    """``msg`` with ``patchload`` and, unless it (or its first ``%s`` argument) starts with one,
    this process's ``[rank r/N]`` in front (no ``%`` added: the arguments still fit)."""
    text = str(msg)
    first = args[0] if args else None
    if isinstance(first, BaseException):  # a patchload error's message names its rank
        first = str(first)
    if _names_a_rank(text) or (text.startswith("%s") and _names_a_rank(first)):
        return f"{ROOT} {text}"
    from ._topology import current_topology

    topology = current_topology()
    return f"{ROOT} [rank {topology.rank}/{topology.world_size}] {text}"


def get_logger(name: str) -> logging.LoggerAdapter:  # type: ignore[type-arg]
    """The logger of module ``name`` (a ``patchload.*`` name): see the module docstring."""
    return _Named(logging.getLogger(name), {})


class _Handler(logging.StreamHandler):  # type: ignore[type-arg]
    """patchload's own handler (stderr), there only while ``PATCHLOAD_LOG_LEVEL`` is set."""


def configure(log_level: str | None) -> None:
    """Set the ``patchload`` logger up by the rule of the module docstring. Idempotent.

    Args:
        log_level: ``PATCHLOAD_LOG_LEVEL`` (a level name), or None when unset.
    """
    log = logging.getLogger(ROOT)
    if log_level is None:
        if log.level == logging.NOTSET:  # a level the application set first is kept
            log.setLevel(logging.WARNING)
        return
    log.setLevel(log_level)
    if not any(isinstance(h, _Handler) for h in log.handlers):
        handler = _Handler()  # sys.stderr at each line, as logging.lastResort
        handler.setFormatter(logging.Formatter(FORMAT))
        log.addHandler(handler)
    log.propagate = False


def describe() -> str:
    """One line for ``python -m patchload doctor``: the ``patchload`` logger's level and where
    its lines go (its own handler, or the application's)."""
    log = logging.getLogger(ROOT)
    level = logging.getLevelName(log.getEffectiveLevel())
    others = [type(h).__name__ for h in log.handlers if not isinstance(h, _Handler)]
    if len(others) < len(log.handlers):
        line = (f"logging: the patchload logger at {level}, to a handler of its own on stderr "
                "(PATCHLOAD_LOG_LEVEL), not passed on to the root logger: each line prints once")
    elif log.propagate:
        line = (f"logging: the patchload logger at {level}, no handler of its own: its lines go "
                "to the application's handlers, or to stderr where it configures none")
    else:
        line = f"logging: the patchload logger at {level}, not passed on to the root logger"
    if others:
        line += f"; handlers added by the application: {', '.join(others)}"
    if log.getEffectiveLevel() > logging.INFO:
        line += "; PATCHLOAD_LOG_LEVEL=INFO adds one line per rank for each top-level call"
    return line
