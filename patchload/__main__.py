"""``python -m patchload doctor``: what patchload would do in this environment."""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
from typing import Sequence

__all__ = ["main"]


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def doctor() -> list[str]:
    """The report's lines: launcher and topology, store, scope, transport, versions, patches."""
    import patchload
    from patchload import _state
    from patchload._patching import installed_patches
    from patchload._store import _kind

    cfg = _state.config()
    topo = patchload.topology()
    lines = [f"patchload {patchload.__version__}",
             f"topology: {topo}",
             f"enabled: {cfg.enabled} (PATCHLOAD)"]
    if not topo.distributed:
        lines.append("world size 1: every patched call passes straight through")
    else:
        kind = _kind()
        lines.append(f"store: {kind}" + (" (node-local: downloads coordinated per node only)"
                                         if kind == "file" else ""))
    scope = cfg.download_scope
    if scope == "auto":
        scope = "auto -> node (one node)" if topo.num_nodes == 1 else \
            "auto (decided at the first call: job if the hub cache is shared by the nodes)"
    lines += [f"download scope: {scope}",
              f"weights: {'shared with followers' if cfg.broadcast else 'each rank loads its own'}"
              " (PATCHLOAD_BROADCAST)",
              f"transport: {cfg.transport}" + (
                  " -> shm inside a node; across nodes, a broadcast to the node leaders if the "
                  "hub cache is shared, else each node leader reads its own disk"
                  if cfg.transport == "auto" else ""),
              f"timeout: {'none' if cfg.timeout_s is None else f'{cfg.timeout_s:.0f} s'}, "
              f"heartbeat: {cfg.heartbeat_s:.0f} s, "
              f"bucket: {cfg.bucket_bytes // 2**20} MiB"]
    lines += [f"{pkg}: {_version(pkg)}" for pkg in
              ("torch", "transformers", "huggingface_hub", "safetensors", "wrapt", "filelock")]
    import huggingface_hub  # noqa: F401 - lands the deferred hub patches so they are listed
    import transformers.modeling_utils  # noqa: F401
    import transformers.models.auto.modeling_auto  # noqa: F401

    patches = installed_patches()
    lines.append(f"patches installed: {len(patches)}")
    lines += [f"  {p}" for p in patches]
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m patchload")
    parser.add_argument("command", choices=["doctor"], help="doctor: print what patchload does here")
    parser.parse_args(argv)
    print("\n".join(doctor()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
