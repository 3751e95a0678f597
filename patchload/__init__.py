"""patchload: rank-aware Hugging Face model loading for distributed PyTorch jobs.

``import patchload`` installs the patches (unless ``PATCHLOAD=0``; they land at the first import
of a third-party package, or at once if one is imported already): under torchrun, accelerate,
deepspeed, srun or mpirun one process downloads and reads the weights, the others wait and
receive them. With one process every patched call passes straight through.
"""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING

from . import _runtime, _state
from ._config import Config, load_config
from ._landing import LandOnFirstImport, third_party_imported
from ._errors import (
    ConfigError,
    LeaderFailedError,
    PatchConflictError,
    PatchloadError,
    PatchloadTimeout,
)
from ._topology import Topology

if TYPE_CHECKING:
    from ._patching import Patch

__all__ = [
    "Config",
    "ConfigError",
    "LeaderFailedError",
    "PatchConflictError",
    "PatchloadError",
    "PatchloadTimeout",
    "Topology",
    "install",
    "is_installed",
    "load_config",
    "main_process_first",
    "patch",
    "topology",
    "uninstall",
    "unpatch",
]

__version__ = "0.1.0"


def install(config: Config | None = None) -> None:
    """Install every patch (now, or when the patched library is first imported). Idempotent.

    The patches land at once when a third-party package is imported already, else at the first
    import of one (:class:`patchload._landing.LandOnFirstImport`): ``import patchload`` alone
    imports neither wrapt nor the patch modules.

    Args:
        config: the settings; read from the ``PATCHLOAD_*`` variables when None (all of them,
            even under ``PATCHLOAD=0``: calling install() is asking for the patches).

    Raises:
        ConfigError: a ``PATCHLOAD_*`` variable holds a bad value.
    """
    from ._config import _read
    from ._logging import configure

    cfg = config or _read()
    configure(cfg.log_level)
    _runtime.start()
    _state.set_active(True, cfg)
    landing = _runtime.current().part(LandOnFirstImport)
    if third_party_imported():
        landing.disarm()
        _land()
    else:
        landing.arm(_land)


def _land() -> None:
    """Land every patch now or when its module is first imported (imports wrapt)."""
    from ._patching import install_patches
    from .coordination.rank0 import sample_collectives_when_imported
    from .coordination.scope import announce_when_hub_imported

    install_patches(_patches())
    announce_when_hub_imported()
    sample_collectives_when_imported()


def _patches() -> list[Patch]:
    """Every patch :func:`install` lands, now or when its module is first imported
    (:func:`patchload.patches.all_patches`). First hands the patch registry's facts down to the
    layers below it, which may not import it (:mod:`patchload._libraries`)."""
    from ._libraries import hand_down
    from .patches import all_patches, library_facts

    hand_down(library_facts())
    return all_patches()


def uninstall() -> None:
    """Remove every patch, restoring the original objects (identity), in reverse order, and end
    what the install started (:meth:`patchload._runtime.Runtime.close`: open shares released once
    their followers took them, background threads stopped, store clients closed).

    Raises:
        PatchConflictError: another library replaced a patched attribute after patchload.
    """
    _state.set_active(False)
    _runtime.current().part(LandOnFirstImport).disarm()
    try:
        if "patchload._patching" in sys.modules:  # else nothing landed
            from ._patching import uninstall_patches

            uninstall_patches()
    finally:
        _runtime.end()


def is_installed() -> bool:
    """True while the patches are installed."""
    return _state.installed()


patch = install
unpatch = uninstall


def topology() -> Topology:
    """This process's rank, world size, local rank, local world size and node (no I/O)."""
    from ._topology import current_topology

    return current_topology()


def main_process_first(scope: str = "node"):  # type: ignore[no-untyped-def]
    """Context manager: the leader of ``scope`` runs the block first, then the others.

    See :func:`patchload._first.main_process_first`.
    """
    from ._first import main_process_first as _main_process_first

    return _main_process_first(scope)


_config_at_import = load_config()
if _config_at_import.enabled:
    install(_config_at_import)
else:  # nothing is patched, but a warning still says it is patchload's
    from ._logging import configure as _configure_logging

    _configure_logging(_config_at_import.log_level)
