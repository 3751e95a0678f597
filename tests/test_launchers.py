"""Under every launcher: the topology is right on every rank and loads are coordinated.

One job per launcher, each running ``tests/workers/launchers.py`` (see its docstring for the
steps): ``accelerate launch`` (torchrun underneath; also remote code and accelerate's own
``main_process_first``), the deepspeed launcher (no torchrun agent: a node-local ``FileStore``;
also ZeRO-3), SLURM ``srun`` and Open MPI ``mpirun`` (ranks started by hand with their variables;
SLURM as two simulated nodes, each with its own cache and temp directory), and
``torch.multiprocessing.spawn`` with a process group initialised by the user before loading.
Every job checks: files fetched once per node, by one rank; the other ranks made no request and
opened no checkpoint; every model bitwise equal to a plain load of the same call on that rank.
"""

from __future__ import annotations

import collections
import datetime
import re
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

import _nodes
from _launch import WORKERS, Job, diff_fingerprints, free_port, gets_per_file, job_env, \
    request_signature, run_processes
from patchload.testing import LoopbackHub

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="shared-memory transport (memfd, /proc): Linux only")

JOB_TIMEOUT_S = 240
WORKER = str(WORKERS / "launchers.py")
TAGS = ("acc", "ds", "slurm", "mpi", "spawn")


@pytest.fixture(scope="module")
def repos(hub: LoopbackHub, folders: dict[str, Path],
          tmp_path_factory: pytest.TempPathFactory) -> None:
    """Each launcher's repo ids on the session hub (so requests name the job and step)."""
    from patchload.testing import tiny_remote_code

    remote = tiny_remote_code(tmp_path_factory.mktemp("remote-code") / "repo")
    for tag in TAGS:
        for suffix in ("", "-pfirst", "-afirst", "-zero3"):
            hub.add_repo(f"launch/{tag}{suffix}", folders["org/llama"])
        hub.add_repo(f"remote/{tag}", remote)
        hub.add_repo(f"remote/{tag}-direct", remote)


@pytest.fixture
def barrier_store() -> Any:
    """The TCPStore the workers' test barrier meets at (the test's own, never patchload's)."""
    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=120))


def _env(hub: LoopbackHub, root: Path, store: Any, **extra: str) -> dict[str, str]:
    return job_env(hub.endpoint, root / "hf", root / "out", PLT_STORE_PORT=str(store.port),
                   **extra)


def _tool(name: str) -> str:
    path = shutil.which(name, path=str(Path(sys.executable).parent))
    if path is None:
        pytest.skip(f"{name} is not installed next to {sys.executable} (pip install -e .[test])")
    return path


def _check_topologies(job: Job, expected: dict[int, dict[str, Any]]) -> None:
    got = {rank: report["topology"] for rank, report in job.ranks.items()}
    assert got == expected, job.describe()


def _check_coordinated(job: Job, step: str, *, nodes: dict[int, list[int]], repo: str,
                       files: tuple[str, ...], store: str, reads_weights: bool = True) -> None:
    """``step`` fetched each file once per node, from one rank per node; the others made no
    request; only that rank opened the checkpoint; every rank's model equals its plain load."""
    window = job.window(step)
    assert {r.repo_id for r in window if r.repo_id} == {repo}, [r.path for r in window]
    per_rank = collections.Counter(r.rank for r in window)
    for node, ranks in nodes.items():
        askers = [r for r in ranks if per_rank[r]]
        assert len(askers) == 1, (step, node, dict(per_rank))
    gets = gets_per_file(window)
    for name in files:
        assert gets[(repo, name)] == len(nodes), (step, name, gets)
    for rank, report in job.ranks.items():
        record = report["steps"][step]
        assert record["store"] == store, (rank, step, record["store"])
        if not reads_weights:
            continue
        opened = record["checkpoint"]["opens"]
        assert bool(opened) == bool(per_rank[rank]), (step, rank, opened, dict(per_rank))
        assert diff_fingerprints(record["fingerprint"], record["reference"]) == [], (step, rank)
    if reads_weights:  # and the ranks hold the same bytes
        tensors = [rep["steps"][step]["fingerprint"]["tensors"] for rep in job.ranks.values()]
        assert all(t == tensors[0] for t in tensors), step


def _one_node(world_size: int, launcher: str) -> dict[int, dict[str, Any]]:
    return {r: {"rank": r, "world_size": world_size, "local_rank": r,
                "local_world_size": world_size, "node": 0, "launcher": launcher}
            for r in range(world_size)}


LLAMA_FILES = ("config.json", "model.safetensors")


@pytest.mark.timeout(JOB_TIMEOUT_S + 30)
def test_accelerate_launch_remote_code_and_main_process_first(
        hub: LoopbackHub, repos: None, barrier_store: Any, tmp_path: Path) -> None:
    """``accelerate launch`` (3 ranks, torchrun's agent store): a load; ``trust_remote_code``
    with a cold cache (config, model, and ``get_class_from_dynamic_module`` called directly,
    with slow module-file copies: without patchload's per-node coordination of
    ``get_cached_module_file`` the followers import a half-written file and fail);
    loads inside ``PartialState().main_process_first()`` and
    ``Accelerator().main_process_first()``: no deadlock, still coordinated."""
    port = free_port()
    cmd = [_tool("accelerate"), "launch", "--multi_gpu", "--num_processes", "3",
           "--num_machines", "1", "--main_process_port", str(port), "--mixed_precision", "no",
           "--dynamo_backend", "no", "--monitor_interval", "0.1", WORKER, "--tag", "acc",
           "--steps", "load,remote,accelerate"]
    job = run_processes(hub, [cmd], [_env(hub, tmp_path, barrier_store)],
                        out_dir=tmp_path / "out", timeout_s=JOB_TIMEOUT_S).check_ok()
    _check_topologies(job, _one_node(3, "torchrun"))
    nodes = {0: [0, 1, 2]}
    _check_coordinated(job, "load", nodes=nodes, repo="launch/acc", files=LLAMA_FILES,
                       store="agent")
    # Remote code: every file once, the same class on every rank, weights equal a plain load.
    _check_coordinated(job, "remote_config", nodes=nodes, repo="remote/acc",
                       files=("config.json", "configuration_remote_toy.py"), store="agent",
                       reads_weights=False)
    _check_coordinated(job, "remote", nodes=nodes, repo="remote/acc",
                       files=("modeling_remote_toy.py", "model.safetensors"), store="agent")
    _check_coordinated(job, "remote_direct", nodes=nodes, repo="remote/acc-direct",
                       files=("modeling_remote_toy.py", "configuration_remote_toy.py"),
                       store="agent", reads_weights=False)
    for rank, report in job.ranks.items():
        assert report["steps"]["remote_config"]["class"] == "RemoteToyConfig", rank
        assert report["steps"]["remote"]["fingerprint"]["class"] == "RemoteToyModel", rank
        assert report["steps"]["remote_direct"]["class"] == "RemoteToyModel", rank
        assert report["accelerate"]["num_processes"] == 3, report["accelerate"]
    # accelerate initialised the process group: patchload now reads it (and its store).
    for step, repo in (("partial_state_first", "launch/acc-pfirst"),
                       ("accelerator_first", "launch/acc-afirst")):
        _check_coordinated(job, step, nodes=nodes, repo=repo, files=LLAMA_FILES, store="agent")
        for rank, report in job.ranks.items():
            assert report["steps"][step]["topology"]["launcher"] == "process_group", rank


@pytest.mark.timeout(JOB_TIMEOUT_S + 30)
def test_deepspeed_launcher_file_store_and_zero3_steps_aside(
        hub: LoopbackHub, repos: None, barrier_store: Any, tmp_path: Path) -> None:
    """The deepspeed launcher (3 ranks: ``RANK``/``LOCAL_RANK``/``WORLD_SIZE``/``LOCAL_SIZE``,
    no torchrun agent): before any process group, loads coordinate through the node-local
    ``FileStore``. Then ZeRO-3 (``HfDeepSpeedConfig``, stage 3): patchload steps aside: one rank
    downloads, every rank reads its own weights, one INFO line says why."""
    cmd = [_tool("deepspeed"), "--num_gpus", "3", "--master_port", str(free_port()), WORKER,
           "--tag", "ds", "--steps", "load,zero3"]
    job = run_processes(hub, [cmd], [_env(hub, tmp_path, barrier_store)],
                        out_dir=tmp_path / "out", timeout_s=JOB_TIMEOUT_S).check_ok()
    _check_topologies(job, _one_node(3, "deepspeed"))
    _check_coordinated(job, "load", nodes={0: [0, 1, 2]}, repo="launch/ds", files=LLAMA_FILES,
                       store="file")
    # Every rank runs the load at once; each hub call inside is led by rank 0 (or whichever rank
    # claims it first): every request is made once in all, but a probe that fails (a 404 for an
    # optional file, adapter_config.json) may be repeated by a rank that arrived after it
    # failed: an error is inherited only by the ranks that waited for it, as in a plain call.
    window = job.window("zero3")
    signature = request_signature(window)
    assert signature and {n for (_, _, status), n in signature.items() if status != 404} == {1}, \
        signature
    assert all(n <= 3 for n in signature.values()), signature
    assert {name for _, name in gets_per_file(window)} >= set(LLAMA_FILES), signature
    want = {n: t["sha256"] for n, t in job.ranks[0]["steps"]["load"]["reference"]["tensors"]
            .items() if t["kind"] == "param"}
    for rank, report in job.ranks.items():
        record = report["steps"]["zero3"]
        assert record["store"] == "process_group" and record["zero3"], rank
        assert record["checkpoint"]["opens"] >= 1, (rank, record["checkpoint"])
        assert [line for line in record["log"] if "DeepSpeed ZeRO-3 is enabled" in line], \
            (rank, record["log"])
        # Nothing shared, no fallback: besides that line, only each call's summary line.
        others = [line for line in record["log"] if "DeepSpeed ZeRO-3 is enabled" not in line
                  and not re.search(r": (led it|followed rank \d+: no request)", line)]
        assert not others and len(record["log"]) > 1, (rank, record["log"])
        got = {n: t["sha256"] for n, t in record["fingerprint"]["tensors"].items()
               if t["kind"] == "param"}
        assert got == want, rank


def _slurm_env(base: dict[str, str], rank: int, *, nodes: int, per_node: int,
               job_id: str) -> dict[str, str]:
    """What ``srun -N nodes -n nodes*per_node`` gives task ``rank`` (no --ntasks-per-node)."""
    layout = f"{per_node}(x{nodes})"
    return {**base, "SLURM_JOB_ID": job_id, "SLURM_STEP_ID": "0", "SLURM_PROCID": str(rank),
            "SLURM_LOCALID": str(rank % per_node), "SLURM_NODEID": str(rank // per_node),
            "SLURM_NTASKS": str(nodes * per_node), "SLURM_STEP_NUM_TASKS": str(nodes * per_node),
            "SLURM_NNODES": str(nodes), "SLURM_JOB_NUM_NODES": str(nodes),
            "SLURM_TASKS_PER_NODE": layout, "SLURM_STEP_TASKS_PER_NODE": layout,
            "SLURM_NODELIST": f"sim[0-{nodes - 1}]"}


@pytest.mark.timeout(JOB_TIMEOUT_S + 30)
@pytest.mark.parametrize("hosts", _nodes.HOSTS)
def test_srun_two_simulated_nodes(hub: LoopbackHub, repos: None, barrier_store: Any,
                                  tmp_path: Path, hosts: str) -> None:
    """SLURM ``srun`` (simulated: 2 nodes x 2 tasks started by hand with ``SLURM_*``; each node
    with its own ``HF_HOME`` and temp directory, so its own ``FileStore``; on this host, or in
    namespaced nodes, ``tests/_nodes.py``, where both are one path on each node's private
    disk): the topology per rank; each node fetches every file (remote code included) once,
    through one rank; followers attach only to shared memory of their own node."""
    if hosts == "namespaced" and (reason := _nodes.unavailable()):
        pytest.skip(reason)
    cmds, envs = [], []
    for rank in range(4):
        node = rank // 2
        if hosts == "namespaced":  # TMPDIR: the node's private /tmp
            env = job_env(hub.endpoint, _nodes.NODE_LOCAL / "hf", tmp_path / "out",
                          PLT_STORE_PORT=str(barrier_store.port), PLT_RECORD_ATTACHES="1")
        else:
            env = job_env(hub.endpoint, tmp_path / f"hf-{node}", tmp_path / "out",
                          PLT_STORE_PORT=str(barrier_store.port), PLT_RECORD_ATTACHES="1",
                          TMPDIR=str(tmp_path / f"tmp-{node}"))
            (tmp_path / f"tmp-{node}").mkdir(exist_ok=True)
        envs.append(_slurm_env(env, rank, nodes=2, per_node=2, job_id=f"{barrier_store.port}"))
        cmds.append([sys.executable, WORKER, "--tag", "slurm", "--steps", "load,remote"])
    job = run_processes(hub, cmds, envs, out_dir=tmp_path / "out", timeout_s=JOB_TIMEOUT_S,
                        hosts=hosts, node_of=[rank // 2 for rank in range(4)]).check_ok()
    node_of = {rank: rank // 2 for rank in range(4)}
    _nodes.check_hosts(job.ranks, node_of, hosts)
    _nodes.check_attached_within_nodes(job.ranks, node_of)
    _check_topologies(job, {r: {"rank": r, "world_size": 4, "local_rank": r % 2,
                                "local_world_size": 2, "node": r // 2, "launcher": "slurm"}
                            for r in range(4)})
    nodes = {0: [0, 1], 1: [2, 3]}
    _check_coordinated(job, "load", nodes=nodes, repo="launch/slurm", files=LLAMA_FILES,
                       store="file")
    _check_coordinated(job, "remote", nodes=nodes, repo="remote/slurm",
                       files=("modeling_remote_toy.py", "model.safetensors"), store="file")


@pytest.mark.timeout(JOB_TIMEOUT_S + 30)
def test_mpirun_and_mp_spawn(hub: LoopbackHub, repos: None, barrier_store: Any,
                             tmp_path: Path) -> None:
    """Open MPI ``mpirun`` (simulated: 2 ranks started by hand with ``OMPI_COMM_WORLD_*``; a
    node-local ``FileStore``), then ``torch.multiprocessing.spawn`` of 2 ranks that initialise a
    gloo process group themselves before loading (its store). Two ranks each: the budget."""
    mpi_root, spawn_root = tmp_path / "mpi", tmp_path / "spawn"
    mpi_env = _env(hub, mpi_root, barrier_store)
    cmds, envs = [], []
    for rank in range(2):
        envs.append({**mpi_env, "OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": "2",
                     "OMPI_COMM_WORLD_LOCAL_RANK": str(rank), "OMPI_COMM_WORLD_LOCAL_SIZE": "2",
                     "OMPI_COMM_WORLD_NODE_RANK": str(rank),
                     "OMPI_MCA_ess_base_jobid": str(barrier_store.port)})
        cmds.append([sys.executable, WORKER, "--tag", "mpi", "--steps", "load"])
    mpi = run_processes(hub, cmds, envs, out_dir=mpi_root / "out",
                        timeout_s=JOB_TIMEOUT_S).check_ok()
    _check_topologies(mpi, _one_node(2, "mpi"))
    _check_coordinated(mpi, "load", nodes={0: [0, 1]}, repo="launch/mpi", files=LLAMA_FILES,
                       store="file")

    env = _env(hub, spawn_root, barrier_store, PLT_PG_PORT=str(free_port()))
    spawn = run_processes(hub, [[sys.executable, WORKER, "--tag", "spawn", "--steps", "load",
                                 "--spawn", "2"]], [env], out_dir=spawn_root / "out",
                          timeout_s=JOB_TIMEOUT_S).check_ok()
    _check_topologies(spawn, _one_node(2, "process_group"))
    _check_coordinated(spawn, "load", nodes={0: [0, 1]}, repo="launch/spawn",
                       files=LLAMA_FILES, store="process_group")
