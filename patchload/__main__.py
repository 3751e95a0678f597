"""``python -m patchload doctor``: what patchload would do in this environment.

Under a launcher, one report per job: rank 0 prints the full report, every other rank prints one
line (rank, pid, host, hub cache, versions: what may differ between ranks) in the same form as
rank 0's own line, to compare. No rank waits for another: doctor never touches the job store or
a process group, so it ends even where the job's ranks could not meet.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import importlib.util
import os
import socket
import sys
from typing import TYPE_CHECKING, Sequence

if TYPE_CHECKING:
    from patchload import Config, Topology

__all__ = ["main"]

# Packages patchload always depends on: doctor imports every module of theirs that a patch
# targets, so that those patches are listed as installed (it takes well under a second once
# transformers is imported). The patches of other packages are listed as pending.
_IMPORTED_FOR_THE_LIST = ("huggingface_hub", "transformers")


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _seconds(value: float | None) -> str:
    return "none" if value is None else f"{value:g} s"


def _topology_line(topo: Topology) -> str:
    if topo.launcher == "none":
        return "topology: single process (no launcher variables found)"
    return f"topology: {topo}"


def rank_line(topo: Topology, cfg: Config) -> str:
    """This rank's line: what may differ from rank to rank (no I/O beyond reading settings)."""
    from huggingface_hub import constants

    return (f"rank {topo.rank}/{topo.world_size}: pid {os.getpid()} on {socket.gethostname()} "
            f"(local rank {topo.local_rank}/{topo.local_world_size}, node {topo.node}/"
            f"{topo.num_nodes}), patchload {'on' if cfg.enabled else 'off'}, hub cache "
            f"{constants.HF_HUB_CACHE}, transformers {_version('transformers')}, huggingface_hub "
            f"{_version('huggingface_hub')}, torch {_version('torch')}")


def _patch_lines() -> list[str]:
    """Installed patches, then those pending until their module is imported."""
    import patchload
    from patchload._patching import installed_patches

    patches = patchload._patches()
    for patch in patches:
        if patch.module.split(".")[0] in _IMPORTED_FOR_THE_LIST:
            try:
                importlib.import_module(patch.module)  # lands its patch (post-import hook)
            except ImportError:
                pass  # not in this version: listed as pending below, with the reason
    installed = installed_patches()
    lines = [f"patches installed: {len(installed)}"] + [f"  {name}" for name in installed]
    pending = [p for p in patches if p.module not in sys.modules]
    if pending:
        lines.append(f"patches pending: {len(pending)} (each lands when its module is first "
                     "imported)")
    for patch in pending:
        package = patch.module.split(".")[0]
        if importlib.util.find_spec(package) is None:
            why = f" ({package} is not installed)"
        elif package in _IMPORTED_FOR_THE_LIST:
            why = f" (not in the installed {package} {_version(package)})"
        else:
            why = ""
        target = f"{patch.module}.{patch.path}" if patch.path else f"{patch.module}.*"
        lines.append(f"  {target}: pending until {patch.module} is imported{why}")
    return lines


def doctor() -> list[str]:
    """The report's lines.

    Rank 0 (or a process outside any launcher): the full report: topology, switches, store,
    scope, transport, wait bounds, logging, versions, patches. Any other rank: its one
    :func:`rank_line`.
    """
    import patchload
    from patchload import _state
    from patchload._logging import describe as describe_logging

    cfg = _state.config()
    topo = patchload.topology()
    if topo.rank != 0:
        return [rank_line(topo, cfg)]
    lines = [f"patchload {patchload.__version__}", _topology_line(topo)]
    if topo.distributed:
        lines += [rank_line(topo, cfg),
                  "the other ranks print one such line each (compare host, hub cache, "
                  "versions)"]
    if not cfg.enabled:
        from huggingface_hub import constants

        lines += ["patchload: off (PATCHLOAD=0): nothing is patched; every call runs as without "
                  "patchload",
                  f"hub cache: {constants.HF_HUB_CACHE}"]
        lines += [f"{pkg}: {_version(pkg)}" for pkg in
                  ("torch", "transformers", "huggingface_hub", "safetensors", "wrapt", "filelock")]
        return lines + [describe_logging()]
    lines.append("patchload: on (PATCHLOAD)")
    if not topo.distributed:
        lines.append("world size 1: every patched call passes straight through")
    else:
        from patchload.coordination.store import _kind

        kind = _kind()
        lines.append(f"store: {kind}" + (" (node-local: downloads coordinated per node only)"
                                         if kind == "file" else ""))
    scope = cfg.download_scope
    if scope == "auto":
        scope = "auto -> node (one node)" if topo.num_nodes == 1 else \
            ("auto (decided at the job's first patched call, waiting for no rank: job if every "
             "node has shown by then that it sees this hub cache, else node)")
    lines += [f"download scope: {scope}",
              f"weights: {'shared with followers' if cfg.broadcast else 'each rank loads its own'}"
              " (PATCHLOAD_BROADCAST)",
              f"transport: {cfg.transport}" + (
                  " -> shm inside a node; across nodes, a broadcast to the node leaders if the "
                  "hub cache is shared, else each node leader reads its own disk"
                  if cfg.transport == "auto" else ""),
              f"waits: timeout {_seconds(cfg.timeout_s)}"
              + (" (no bound on the total wait)" if cfg.timeout_s is None else "")
              + f", heartbeat {_seconds(cfg.heartbeat_s)}, claim grace "
              f"{_seconds(cfg.claim_grace_s)}, exit wait {_seconds(cfg.exit_wait_s)}, arrival "
              f"window {_seconds(cfg.arrival_window_s)}, group timeout "
              f"{_seconds(cfg.group_timeout_s)}, progress warning "
              f"{_seconds(cfg.progress_warning_s)}",
              f"bucket: {cfg.bucket_bytes / 2**20:g} MiB",
              describe_logging()]
    if "PATCHLOAD_SCOPE_WAIT" in os.environ:  # validated, but nothing waits for the scope now
        lines.append(f"PATCHLOAD_SCOPE_WAIT={os.environ['PATCHLOAD_SCOPE_WAIT']}: no longer "
                     "used (the download scope is decided without waiting for any rank)")
    from huggingface_hub import constants

    lines.append(f"hub cache: {constants.HF_HUB_CACHE}")
    lines += [f"{pkg}: {_version(pkg)}" for pkg in
              ("torch", "transformers", "huggingface_hub", "safetensors", "wrapt", "filelock")]
    return lines + _patch_lines()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status."""
    parser = argparse.ArgumentParser(prog="python -m patchload")
    parser.add_argument("command", choices=["doctor"], help="doctor: print what patchload does here")
    parser.parse_args(argv)
    print("\n".join(doctor()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
