"""Simulated nodes as real as one machine allows: each in its own PID, mount and UTS namespace.

A multi-node test started as plain processes on one host shares one kernel view between its
"nodes": hostname, ``/proc`` and pids, ``/tmp`` (patchload's private directory is
``$TMPDIR/patchload-<uid>``) and ``/dev/shm``. A follower on node 1 could then attach to node
0's blob, or call node 0's live leader dead, and no test would notice. :class:`SimulatedNodes`
gives each node, as root, what a real node has of its own:

* a hostname (``simnode0``, ``simnode1``, ... unless given), which resolves to 127.0.0.1 (an
  ``/etc/hosts`` of the node's own, so that nothing asks a DNS server);
* a PID namespace with its own ``/proc``; node ``i``'s processes get pids from a range of its
  own (``first_pids``), so a pid from another node names no process here, never a live one
  by chance;
* a private tmpfs on ``/tmp`` and one on ``/dev/shm``; the processes get ``TMPDIR=/tmp``.
  The ``shared`` directories (the test's own, under pytest's temp dir: reports, shared caches)
  are bind-mounted back into the private ``/tmp``, as a shared filesystem would be.
  ``NODE_LOCAL`` is a path inside the private ``/tmp``: the same name on every node, a
  different disk (e.g. ``HF_HOME=NODE_LOCAL / "hf"``: a node-local cache);
* the network stays the host's (no network namespace): every node reaches the loopback hub,
  the test's TCPStore and torchrun's rendezvous on 127.0.0.1.

How it works: for each node one ``unshare --pid --fork --mount --uts --mount-proc
--kill-child`` runs a setup script, then ``sleep infinity`` as the namespace's pid 1 (the
"holder"); each process of the node is started with ``nsenter --target <holder> --pid --mount
--uts --wd <cwd> -- cmd...``, whose exit status (a signal included) is the command's. Closing
the nodes SIGKILLs each holder: the kernel then kills every process left in its namespace, and
the tmpfs mounts go with the mount namespace.

Usage::

    reason = _nodes.unavailable()           # None, or why namespaces cannot be made here
    if reason: pytest.skip(reason)
    with SimulatedNodes(2, shared=[tmp_path], log_dir=tmp_path) as nodes:
        proc = subprocess.Popen(nodes.command(1, [sys.executable, "w.py"], cwd=tmp_path),
                                env=nodes.env(env), start_new_session=True)

``_launch.run_torchrun``, ``run_processes`` and ``start_ranks`` take ``hosts="namespaced"``
and do this themselves.
"""

from __future__ import annotations

import functools
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, Final, Mapping, Sequence

import psutil

HOSTS: Final = ("shared-kernel", "namespaced")
"""How a test's simulated nodes run: ``shared-kernel`` (plain processes on this host, one
kernel view) or ``namespaced`` (:class:`SimulatedNodes`)."""

NODE_LOCAL: Final = Path("/tmp/node-local")
"""A path inside every namespaced node's private ``/tmp``: same name on each node, own disk."""

_READY_TIMEOUT_S: Final = 30.0

# $1 hostname, $2 last pid before the node's first one (0: leave it), $3... shared directories
# under /tmp (bind-mounted back into the private /tmp through a stash in the private /dev/shm).
_SETUP: Final = r"""
set -eu
host=$1; last_pid=$2; shift 2
mount -t tmpfs -o mode=1777 simnode-shm /dev/shm
i=0
for keep in "$@"; do
    mkdir "/dev/shm/.keep$i"; mount --bind "$keep" "/dev/shm/.keep$i"; i=$((i + 1))
done
mount -t tmpfs -o mode=1777 simnode-tmp /tmp
i=0
for keep in "$@"; do
    mkdir -p "$keep"; mount --move "/dev/shm/.keep$i" "$keep"; rmdir "/dev/shm/.keep$i"
    i=$((i + 1))
done
mkdir -m 0755 /tmp/.simnode
{ cat /etc/hosts; echo "127.0.0.1 $host"; } > /tmp/.simnode/hosts
mount --bind /tmp/.simnode/hosts /etc/hosts
hostname "$host"
if [ "$last_pid" -gt 0 ]; then echo "$last_pid" > /proc/sys/kernel/ns_last_pid; fi
echo ready
exec sleep infinity
"""


@functools.cache
def unavailable() -> str | None:
    """Why namespaced nodes cannot be made on this machine (None when they can).

    Checked once per process: root, ``unshare`` and ``nsenter`` on the PATH, and a probe node
    that runs the whole setup and one command inside it.
    """
    if not os.path.exists("/proc/self/ns/pid"):
        return "namespaced nodes: Linux namespaces only"
    if os.geteuid() != 0:
        return "namespaced nodes need root (unshare --pid --mount --uts); not root here"
    missing = [tool for tool in ("unshare", "nsenter", "mount", "hostname", "sleep")
               if shutil.which(tool) is None]
    if missing:
        return f"namespaced nodes: {', '.join(missing)} not found on the PATH"
    with tempfile.TemporaryDirectory(prefix="simnode-probe-") as tmp:
        try:
            with SimulatedNodes(1, shared=[Path(tmp)], log_dir=Path(tmp)) as nodes:
                probe = subprocess.run(
                    nodes.command(0, ["sh", "-c", "hostname; ls -A /dev/shm; test -d \"$1\"",
                                      "probe", tmp], cwd=Path(tmp)),
                    capture_output=True, text=True, timeout=_READY_TIMEOUT_S, check=False)
        except (OSError, RuntimeError, subprocess.TimeoutExpired) as err:
            return f"namespaced nodes: cannot make one here: {err}"
    if probe.returncode != 0 or probe.stdout.split() != ["simnode0"]:
        return (f"namespaced nodes: the probe node misbehaved (exit {probe.returncode}, "
                f"stdout {probe.stdout!r}, stderr {probe.stderr.strip()!r})")
    return None


def _under(path: Path, root: Path) -> bool:
    return path == root or root in path.parents


class SimulatedNodes:
    """``count`` namespaced nodes on this host (a context manager; see the module docstring).

    Args:
        count: how many nodes.
        shared: directories every node sees, as on a shared filesystem (reports, shared caches,
            plans); those under ``/tmp`` are bind-mounted into each node's private ``/tmp``.
            None of them may be ``/tmp`` itself or under ``NODE_LOCAL``.
        log_dir: where each holder's setup errors go (``simnode-<i>.log``).
        hostnames: one per node; default ``simnode<i>``. Equal names simulate containers with
            their own PID namespace and ``/tmp`` on one host (one hostname).
        first_pids: node ``i``'s first pid; default: disjoint ranges, one per node.

    Raises:
        RuntimeError: a node's setup failed (with its output) or did not finish within 30 s.
    """

    def __init__(self, count: int, *, shared: Sequence[Path], log_dir: Path,
                 hostnames: Sequence[str] | None = None,
                 first_pids: Sequence[int] | None = None) -> None:
        self.hostnames = list(hostnames or [f"simnode{i}" for i in range(count)])
        if first_pids is None:
            pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
            span = (min(pid_max, 1 << 22) - 1000) // count
            first_pids = [1000 + i * span for i in range(count)]
        self.first_pids = list(first_pids)
        if len(self.hostnames) != count or len(self.first_pids) != count:
            raise ValueError(f"{count} nodes: got {len(self.hostnames)} hostnames and "
                             f"{len(self.first_pids)} first pids")
        tmp = Path("/tmp")
        keep: list[Path] = []
        # What every process needs to start: this checkout (workers, patchload) and the Python
        # environment, wherever they are (a CI clone may itself live under /tmp).
        runtime = [Path(__file__).resolve().parents[1], Path(sys.prefix), Path(sys.base_prefix)]
        shared = [*shared, *(p for p in runtime if _under(Path(os.path.realpath(p)), tmp))]
        for path in sorted({Path(os.path.realpath(p)) for p in shared}):
            if path == tmp or _under(path, NODE_LOCAL) or path == Path("/"):
                raise ValueError(f"shared directory {path}: would hide the nodes' private /tmp")
            path.mkdir(parents=True, exist_ok=True)
            if _under(path, tmp) and not any(_under(path, k) for k in keep):
                keep.append(path)
        self._keep = keep
        self._log_dir = log_dir
        self._holders: list[subprocess.Popen[bytes]] = []
        self._init_pids: list[int] = []

    # --- lifecycle ---------------------------------------------------------------------------

    def __enter__(self) -> SimulatedNodes:
        try:
            for i in range(len(self.hostnames)):
                self._start(i)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def _start(self, i: int) -> None:
        self._log_dir.mkdir(parents=True, exist_ok=True)
        log = self._log_dir / f"simnode-{i}.log"
        cmd = ["unshare", "--pid", "--fork", "--mount", "--uts", "--mount-proc", "--kill-child",
               "sh", "-c", _SETUP, "simnode-setup", self.hostnames[i],
               str(max(0, self.first_pids[i] - 1)), *map(str, self._keep)]
        with open(log, "wb") as err:
            holder = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err,
                                      stdin=subprocess.DEVNULL, start_new_session=True)
        self._holders.append(holder)
        assert holder.stdout is not None
        with selectors.DefaultSelector() as sel:
            sel.register(holder.stdout, selectors.EVENT_READ)
            line = holder.stdout.readline() if sel.select(_READY_TIMEOUT_S) else b""
        holder.stdout.close()
        if line.strip() != b"ready":
            holder.poll()
            raise RuntimeError(f"simulated node {i} ({self.hostnames[i]}): setup failed "
                               f"(exit {holder.returncode}): "
                               f"{log.read_text(errors='replace').strip()[-2000:]}")
        children = psutil.Process(holder.pid).children()
        if len(children) != 1:
            raise RuntimeError(f"simulated node {i}: unshare has {len(children)} children")
        self._init_pids.append(children[0].pid)

    def close(self) -> None:
        """SIGKILL every node's holder, and so everything left in its namespaces. Idempotent."""
        for holder in self._holders:
            try:
                os.killpg(holder.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        for holder in self._holders:
            try:
                holder.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        self._holders, self._init_pids = [], []

    # --- starting processes in a node ----------------------------------------------------------

    def command(self, node: int, cmd: Sequence[str], *, cwd: Path) -> list[str]:
        """``cmd`` run inside ``node``'s namespaces, in ``cwd`` (a path the node sees)."""
        return ["nsenter", f"--target={self._init_pids[node]}", "--pid", "--mount", "--uts",
                f"--wd={cwd}", "--", *cmd]

    @staticmethod
    def env(env: Mapping[str, str]) -> dict[str, str]:
        """``env`` for a process of a node: ``TMPDIR`` is the node's private ``/tmp``."""
        return {**env, "TMPDIR": "/tmp"}


# --- checks on the ranks' reports (``tests/workers/_common.py``: host, pidns, attached) --------

def check_hosts(ranks: Mapping[int, Mapping[str, Any]], node_of: Mapping[int, int],
                hosts: str) -> None:
    """Every rank ran where ``hosts`` says: namespaced, node ``i``'s ranks on host
    ``simnode<i>`` in one PID namespace of their own; shared-kernel, all on this host."""
    if hosts == "namespaced":
        for rank, report in ranks.items():
            assert report["host"] == f"simnode{node_of[rank]}", (rank, report["host"])
        pidns = {node: {ranks[r]["pidns"] for r in ranks if node_of[r] == node}
                 for node in set(node_of.values())}
        assert all(len(ns) == 1 for ns in pidns.values()), pidns
        assert len({next(iter(ns)) for ns in pidns.values()}) == len(pidns), pidns
    else:
        assert {report["host"] for report in ranks.values()} == {os.uname().nodename}, \
            {rank: report["host"] for rank, report in ranks.items()}


def check_attached_within_nodes(ranks: Mapping[int, Mapping[str, Any]],
                                node_of: Mapping[int, int]) -> dict[int, list[int]]:
    """Every shared-memory attach a rank made (``report["attached"]``: the pids named by
    patchload's "attached N tensors shared by pid P" debug line) names a rank of its own node.

    Returns:
        The attached pids by rank.
    """
    attached = {rank: [int(pid) for pid in report.get("attached", [])]
                for rank, report in ranks.items()}
    for rank, pids in attached.items():
        own = {ranks[r]["pid"] for r in ranks if node_of[r] == node_of[rank]}
        assert set(pids) <= own, \
            f"rank {rank} (node {node_of[rank]}) attached to pids {pids}; its node's: {own}"
    return attached
