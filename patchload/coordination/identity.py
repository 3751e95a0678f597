"""Who is who: the job, the node, a process's liveness and a hub cache, decided here only.

- **node**: the kernel (``/proc/sys/kernel/random/boot_id``) plus the PID namespace
  (``/proc/self/ns/pid``). Two processes are on one node when both agree: only then can one see the
  other's pid (liveness) or open its file descriptors through ``/proc`` (shared memory). A hostname
  is not identity: containers with host networking share it across PID namespaces.
- **job**: the launcher's run id (torchrun, SLURM, Open MPI / PMIx) plus the rendezvous address;
  without any, the parent process and its start time.
- **liveness**: a process on this node is alive while its pid exists and is not a zombie; a process
  on another node cannot be watched here (its heartbeat speaks for it). A rank of this node whose
  pid is unknown here (it never published one) is found among the processes its launcher
  started, by the variable that names each one's rank.
- **cache**: a hub cache directory by real path, whatever variable named it.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path
from typing import Final

import psutil

__all__ = ["cache_identity", "job_id", "kernel_id", "launched_rank_alive", "node_id",
           "process_alive"]

_BOOT_ID: Final = "/proc/sys/kernel/random/boot_id"


def kernel_id() -> str:
    """This process's kernel: its boot id. Processes of one kernel see one filesystem (and may
    share a download) even from two PID namespaces (containers with host networking). Falls back
    to the hostname's hash where ``/proc`` lacks it (not Linux)."""
    return _identity(os.getpid())[0]


def node_id() -> str:
    """This process's node: ``<boot id>/<pid namespace inode>``. Only processes of one node can
    watch each other's pids or open each other's file descriptors through ``/proc``."""
    return _identity(os.getpid())[1]


@functools.lru_cache(maxsize=1)
def _identity(pid: int) -> tuple[str, str]:
    """(kernel id, node id) of process ``pid`` (this one), read once per process: neither can
    change while it runs (keyed by pid, so a forked child, perhaps in a new PID namespace,
    reads its own); every coordinated call asks for them."""
    try:
        kernel = Path(_BOOT_ID).read_text().strip()
    except OSError:
        import socket

        kernel = "host-" + hashlib.sha1(socket.gethostname().encode()).hexdigest()[:16]
    try:
        pid_ns = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        pid_ns = 0
    return kernel, f"{kernel}/{pid_ns}"


def process_alive(node: str, pid: int) -> bool:
    """Whether process ``pid`` of ``node`` may still run.

    True for a process on another node (it cannot be watched from here). On this node: False once
    the pid is gone or a zombie (dead, not yet reaped by a launcher that has not noticed).
    """
    if node != node_id():
        return True
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# Variables a launcher names each process's global rank by; those that name its job run (the
# launchers' run ids, their attempt, the rendezvous address: job_id's parts).
_RANK_VARIABLES: Final = ("RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK", "SLURM_PROCID")
_RUN_IDS: Final = ("TORCHELASTIC_RUN_ID", "SLURM_JOB_ID", "OMPI_MCA_ess_base_jobid",
                   "PMIX_NAMESPACE")
_RUN_VARIABLES: Final = (*_RUN_IDS, "TORCHELASTIC_RESTART_COUNT", "SLURM_STEP_ID",
                         "MASTER_ADDR", "MASTER_PORT")


def launched_rank_alive(rank: int, own_rank: int) -> bool | None:
    """Whether global ``rank``, started on this node by this process's launcher, still runs.

    The launcher is this process's nearest ancestor whose environment does not name this
    process's rank (``own_rank``) in the variable that names it here (``RANK`` under torchrun;
    a wrapper shell between them inherits it). Among the launcher's descendants of this job run
    (the same run variables), a process whose variable names ``rank`` and is no zombie runs.

    Returns:
        True (it runs), False (no such process: it exited or died), or None (unknown: no
        variable names this process's rank, or a process's environment cannot be read). The
        caller asks only for a rank the launcher places on this node.
    """
    name = next((n for n in _RANK_VARIABLES if os.environ.get(n) == str(own_rank)), None)
    if name is None:
        return None
    run = {n: os.environ[n] for n in _RUN_VARIABLES if n in os.environ}
    try:
        launcher = psutil.Process().parent()
        while launcher is not None and launcher.environ().get(name) == str(own_rank):
            launcher = launcher.parent()
        if launcher is None:
            return None
        for process in launcher.children(recursive=True):
            env = process.environ()
            if env.get(name) == str(rank) and all(env.get(n) == v for n, v in run.items()) \
                    and process.status() != psutil.STATUS_ZOMBIE:
                return True
    except psutil.NoSuchProcess:
        return None  # one exited while looked at: look again later
    except psutil.Error:  # an environment this process may not read
        return None
    return False


def job_id() -> str:
    """What names this job run and no other, for namespacing store keys and node-local files.

    The launcher's run id (with the restart count or step id) and ``MASTER_ADDR:MASTER_PORT``;
    without a launcher id, the parent process (the launcher) and its start time.
    """
    env = os.environ
    run = None
    for name in _RUN_IDS:
        if env.get(name):
            attempt = env.get("TORCHELASTIC_RESTART_COUNT", "") + env.get("SLURM_STEP_ID", "")
            run = f"{env[name]}.{attempt}"
            break
    if run is None:
        parent = psutil.Process().parent()
        run = f"pid{os.getpid()}" if parent is None else \
            f"ppid{parent.pid}.{parent.create_time():.3f}"
    master = f"{env.get('MASTER_ADDR', '')}:{env.get('MASTER_PORT', '')}"
    return hashlib.sha1(f"{run}|{master}".encode()).hexdigest()[:16]


def cache_identity(path: str | os.PathLike[str]) -> str:
    """A hub cache directory's identity: its real path (symlinks of existing ancestors resolved),
    so two names of one directory agree. Not its inode: a cold cache does not exist yet when the
    first rank names it, and exists when the next one does. Never raises."""
    try:
        return os.path.realpath(os.path.expanduser(os.fspath(path)))
    except (TypeError, ValueError, OSError):
        return repr(path)
