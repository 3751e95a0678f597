"""The weight transports by name: the built-in ones and those other packages register.

``PATCHLOAD_TRANSPORT`` names one (``auto``: shm inside a node, a broadcast among node leaders
across nodes on one shared cache). A leader publishes its transport's name with the weights, and
a follower looks it up here: one that does not know the name loads plainly.

A new transport is one package implementing :class:`~patchload.transport.base.WeightTransport`
plus one registry line: an entry point in the group ``patchload.transports`` of the package's
metadata (``copy = "my_package:CopyWeights"``), or, for one of patchload's own, a function
that imports and makes it and its line in :data:`_BUILTIN`. Each transport is made once per
install, on first use (it holds its own state: open blobs, mapped models), and closed with the
install (:class:`patchload._runtime.Runtime`).
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Callable, Final

from .. import _runtime
from .._config import TRANSPORT_ENTRY_POINTS, transport_entry_points

if TYPE_CHECKING:
    from importlib.metadata import EntryPoint

    from .base import WeightTransport

__all__ = ["TransportRegistry", "transports"]


def _shm() -> WeightTransport:
    from .node_shm import ShmWeights

    return ShmWeights()


def _collective() -> WeightTransport:
    from .job_collective import CollectiveWeights

    return CollectiveWeights()


# A name read from the store (the leader's transport) only ever selects one of these or an
# installed entry point: nothing it names is imported by name.
_BUILTIN: Final[dict[str, Callable[[], WeightTransport]]] = {"shm": _shm, "collective": _collective}
_SCOPES: Final = ("node", "job")


class TransportRegistry:
    """Name -> transport object, made on first use and kept for the install (a part of
    :class:`patchload._runtime.Runtime`).

    Not collective; no I/O but importing a transport's module (and reading the installed
    packages' entry points once, for a name that is not built in).
    """

    CLOSE_PHASE: Final = _runtime.RELEASE_SHARES

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._made: dict[str, WeightTransport] = {}
        self._plugins: dict[str, EntryPoint] | None = None

    def names(self) -> tuple[str, ...]:
        """Every name a transport can be had by: the built-in ones first."""
        return (*_BUILTIN, *sorted(set(self._plugin_targets()) - set(_BUILTIN)))

    def get(self, name: str) -> WeightTransport | None:
        """The transport called ``name``, or None when none is registered under it.

        Raises:
            ImportError, AttributeError: its module or class cannot be imported (a broken
                package: never silently another transport).
            TypeError: the object lacks the :class:`WeightTransport` attributes or has an
                unknown ``scope``.
        """
        with self._lock:
            if name in self._made:
                return self._made[name]
            if name in _BUILTIN:
                transport = _BUILTIN[name]()
            elif (entry_point := self._plugin_targets().get(name)) is not None:
                transport = entry_point.load()()
            else:
                return None
            _check(name, transport)
            self._made[name] = transport
            return transport

    def close(self) -> None:
        """End what the transports made keep (a transport's optional ``close()``: the shm
        transport's open shares, released once the followers took them, and its mapped-model
        watcher), the transport made last first. Not collective."""
        with self._lock:
            made = list(self._made.values())
        for transport in reversed(made):
            close = getattr(transport, "close", None)
            if close is not None:
                close()

    def _plugin_targets(self) -> dict[str, EntryPoint]:
        if self._plugins is None:
            self._plugins = {ep.name: ep for ep in transport_entry_points()}
        return self._plugins


def _check(name: str, transport: object) -> None:
    missing = [attr for attr in ("name", "verb", "collective", "scope", "prepare", "discard",
                                 "share", "receive", "abandon", "settle")
               if not hasattr(transport, attr)]
    if missing or getattr(transport, "name", None) != name \
            or getattr(transport, "scope", None) not in _SCOPES:
        raise TypeError(f"the transport registered as {name!r} (entry point group "
                        f"{TRANSPORT_ENTRY_POINTS!r}) is not a WeightTransport: missing "
                        f"{missing}, name {getattr(transport, 'name', None)!r}, scope "
                        f"{getattr(transport, 'scope', None)!r} (one of {_SCOPES})")


def transports() -> TransportRegistry:
    """This install's transport registry."""
    return _runtime.current().part(TransportRegistry)
