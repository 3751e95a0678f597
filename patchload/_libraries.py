"""What the patch registry (:data:`patchload.patches.LIBRARIES`) tells the layers below it.

The registry sits in the library-patches layer, which the foundation, coordination and weights
layers may not import. So the facts they need from it are handed down once, by
:func:`patchload.install` (through ``patchload._patches``) before any patch lands:

- :attr:`LibraryFacts.importable`: the packages whose modules a follower may import to rebuild
  its leader's exception class (:mod:`patchload._errors`);
- :attr:`LibraryFacts.source_names`: the argument names that name what a call loads from
  (:mod:`patchload.coordination.key`, and messages);
- :attr:`LibraryFacts.unsafe_kwargs`: the ``from_pretrained`` keyword arguments under which a
  load does not share its weights (:mod:`patchload.weights.policy`).

Before the hand-over (``PATCHLOAD=0`` and no ``install()``: nothing is patched, nothing asks)
every set is empty. No I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from . import _runtime

__all__ = ["LibraryFacts", "facts", "hand_down"]


@dataclass(frozen=True)
class LibraryFacts:
    """The union of the registered libraries' facts, in registry order where order shows (in
    messages).

    Attributes:
        importable: top-level package names.
        source_names: argument names.
        unsafe_kwargs: keyword argument names.
    """

    importable: frozenset[str] = frozenset()
    source_names: tuple[str, ...] = ()
    unsafe_kwargs: tuple[str, ...] = ()


class _HandedDown:
    """The runtime's facts (a part of :class:`patchload._runtime.Runtime`)."""

    def __init__(self) -> None:
        self.facts = LibraryFacts()


def hand_down(library_facts: LibraryFacts) -> None:
    """Set the facts the lower layers read (see the module docstring); idempotent."""
    _runtime.current().part(_HandedDown).facts = library_facts


def facts() -> LibraryFacts:
    """The facts handed down last in this install (empty ones before the hand-over)."""
    return _runtime.current().part(_HandedDown).facts
