"""Where this process sits in the job: rank, world size, local rank, node. No I/O, no waiting.

Read from an initialized default process group when there is one, else from the launcher's
variables: torchrun / accelerate (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``LOCAL_WORLD_SIZE``,
``GROUP_RANK``), the deepspeed launcher (the same, but ``LOCAL_SIZE`` and ``CROSS_RANK`` for the
node), SLURM ``srun`` (``SLURM_PROCID``, ``SLURM_STEP_NUM_TASKS`` / ``SLURM_NTASKS``,
``SLURM_LOCALID``, ``SLURM_NODEID``, ``SLURM_STEP_TASKS_PER_NODE`` / ``SLURM_NTASKS_PER_NODE`` /
``SLURM_TASKS_PER_NODE``) and Open MPI (``OMPI_COMM_WORLD_RANK``, ``_SIZE``, ``_LOCAL_RANK``,
``_LOCAL_SIZE``). A launcher whose variables are all set wins over one with only some of them set
(deepspeed's ranks have ``RANK`` but not ``LOCAL_WORLD_SIZE``).
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Final, Mapping

__all__ = ["Topology", "current_topology", "process_group_initialized"]

# (launcher, rank, world size, local rank, local world size, node index): the variables to read
# for each, the first one set wins.
_LAUNCHERS: Final = (
    ("torchrun", ("RANK",), ("WORLD_SIZE",), ("LOCAL_RANK",), ("LOCAL_WORLD_SIZE",),
     ("GROUP_RANK",)),
    ("deepspeed", ("RANK",), ("WORLD_SIZE",), ("LOCAL_RANK",), ("LOCAL_SIZE",), ("CROSS_RANK",)),
    # srun's step values first: SLURM_NTASKS and SLURM_TASKS_PER_NODE describe the allocation,
    # and SLURM_NTASKS_PER_NODE is only set when --ntasks-per-node was given.
    ("slurm", ("SLURM_PROCID",), ("SLURM_STEP_NUM_TASKS", "SLURM_NTASKS"), ("SLURM_LOCALID",),
     ("SLURM_STEP_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"),
     ("SLURM_NODEID",)),
    ("mpi", ("OMPI_COMM_WORLD_RANK",), ("OMPI_COMM_WORLD_SIZE",), ("OMPI_COMM_WORLD_LOCAL_RANK",),
     ("OMPI_COMM_WORLD_LOCAL_SIZE",), ()),
)


@dataclass(frozen=True, slots=True)
class Topology:
    """This process's place in the job.

    Attributes:
        rank: global rank, 0 <= rank < world_size.
        world_size: number of processes in the job.
        local_rank: index among the processes of this node.
        local_world_size: number of processes on this node.
        node: index of this node, 0 <= node < world_size // local_world_size.
        launcher: where the figures come from: ``process_group``, ``torchrun``, ``slurm``,
            ``mpi`` or ``none``.
    """

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node: int = 0
    launcher: str = "none"

    @property
    def distributed(self) -> bool:
        """True when there is more than one process in the job."""
        return self.world_size > 1

    @property
    def num_nodes(self) -> int:
        """Number of nodes, assuming the same number of processes on each."""
        return max(1, self.world_size // max(1, self.local_world_size))

    def node_of(self, rank: int) -> int:
        """The node of global ``rank``, assuming ranks are laid out node by node (as every
        supported launcher does)."""
        return rank // max(1, self.local_world_size)

    def node_ranks(self, node: int | None = None) -> range:
        """The global ranks of ``node`` (this node when None)."""
        node = self.node if node is None else node
        return range(node * self.local_world_size, min(self.world_size,
                                                       (node + 1) * self.local_world_size))

    def __str__(self) -> str:
        return (f"rank {self.rank}/{self.world_size}, local rank "
                f"{self.local_rank}/{self.local_world_size}, node {self.node}/{self.num_nodes} "
                f"(from {self.launcher})")


def _int(env: Mapping[str, str], names: tuple[str, ...]) -> int | None:
    for name in names:
        raw = env.get(name, "")
        try:
            return int(raw.split("(")[0].split(",")[0])  # SLURM's "4(x2)": 4 tasks on 2 nodes
        except ValueError:
            continue
    return None


def _from_env(env: Mapping[str, str]) -> Topology | None:
    partial = None
    for launcher, *names in _LAUNCHERS:
        rank, world, local_rank, local_world, node = (_int(env, n) for n in names)
        if rank is None or world is None:
            continue
        complete = None not in (local_rank, local_world) and (node is not None or not names[4])
        if local_world is None or local_world < 1:
            local_world = world  # one node unless the launcher says otherwise
        if local_rank is None:
            local_rank = rank % local_world
        if node is None:
            node = rank // local_world
        found = Topology(rank, world, local_rank, local_world, node, launcher)
        if complete:
            return found
        partial = partial or found
    return partial


def process_group_initialized() -> bool:
    """Whether torch's default process group is initialized. Never imports torch just to look,
    and is False while ``torch.distributed`` itself is still being imported (patches land, and
    log, during ``import torch``)."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not hasattr(dist, "is_initialized") or not dist.is_available():
        return False
    return bool(dist.is_initialized())


def _from_process_group(env: Mapping[str, str]) -> Topology | None:
    if not process_group_initialized():
        return None
    dist = sys.modules["torch.distributed"]
    rank, world = dist.get_rank(), dist.get_world_size()
    launched = _from_env(env)
    if launched is not None and (launched.rank, launched.world_size) == (rank, world):
        return Topology(rank, world, launched.local_rank, launched.local_world_size,
                        launched.node, "process_group")
    # A group the user built by hand (e.g. torch.multiprocessing.spawn): one node.
    return Topology(rank, world, rank, world, 0, "process_group")


def current_topology(env: Mapping[str, str] | None = None) -> Topology:
    """This process's topology now.

    Args:
        env: the variables to read; ``os.environ`` when None.

    Returns:
        The default process group's figures once ``init_process_group`` ran (local figures from
        the launcher when it agrees), else the launcher's, else a single process (world size 1).
    """
    env = os.environ if env is None else env
    return _from_process_group(env) or _from_env(env) or Topology()
