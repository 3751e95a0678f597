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
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

from _launch import WORKERS, Job, diff_fingerprints, free_port, gets_per_file, job_env, \
    run_processes
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

    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=120))
    yield store
    del store


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
    shas = {rank: {n: t["sha256"] for n, t in rep["steps"][step]["fingerprint"]["tensors"].items()}
            for rank, rep in job.ranks.items()} if reads_weights else {}
    assert len({str(sorted(s.items())) for s in shas.values()}) <= 1, step


def _one_node(world_size: int, launcher: str) -> dict[int, dict[str, Any]]:
    return {r: {"rank": r, "world_size": world_size, "local_rank": r,
                "local_world_size": world_size, "node": 0, "launcher": launcher}
            for r in range(world_size)}


LLAMA_FILES = ("config.json", "model.safetensors")


@pytest.mark.timeout(JOB_TIMEOUT_S + 30)
def test_accelerate_launch_remote_code_and_main_process_first(
        hub: LoopbackHub, repos: None, barrier_store: Any, tmp_path: Path) -> None:
    """``accelerate launch`` (3 ranks, torchrun's agent store): a load; ``trust_remote_code``
    with a cold cache (config, model, and ``get_class_from_dynamic_module`` called directly);
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
