"""Helpers for the multi-rank tests: environments, torchrun jobs, plain ranks, request logs.

Every job is a set of real processes: ``python -m torch.distributed.run`` (CPU, gloo) or, where
torchrun's agent would get in the way (a rank SIGKILLed on purpose), plain ``subprocess.Popen``
ranks with the launcher variables set by hand and a ``TCPStore`` hosted by the test. Each worker
writes one JSON report per rank to ``<out>/rank-<RANK>.json`` (see ``tests/workers/_common.py``);
the loopback hub in the pytest process records which rank sent which request.
"""

from __future__ import annotations

import collections
import contextlib
import importlib.metadata
import json
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, Iterable, Sequence

from _nodes import NODE_LOCAL, SimulatedNodes
from patchload.testing import LoopbackHub, Request

TRANSFORMERS_4: Final = importlib.metadata.version("transformers").startswith("4.")
"""The tests run on transformers 4.x (the ``tf4`` subset in ``.venv-tf4``)."""


def follower_checkpoint(leader_files: list[str]) -> dict[str, Any]:
    """The checkpoint record (``opens``, ``reads``, ``files``) of a follower that got its weights
    from a leader which opened ``leader_files``: nothing on transformers 5.x. On 4.x,
    ``from_pretrained`` opens a single-file safetensors checkpoint once to check the format in
    its metadata header before it loads anything; the follower reads no tensor."""
    names = sorted(set(leader_files))
    if TRANSFORMERS_4 and len(names) == 1 and names[0].endswith(".safetensors"):
        return {"opens": 1, "reads": 0, "files": names}
    return {"opens": 0, "reads": 0, "files": []}

REPO_ROOT = Path(__file__).resolve().parents[1]
WORKERS = Path(__file__).resolve().parent / "workers"

# Variables a job must not inherit from the pytest process (it may itself run under a launcher).
_STRIP_PREFIXES = ("HF_", "HUGGINGFACE_", "TRANSFORMERS_", "SENTENCE_TRANSFORMERS_", "PATCHLOAD",
                   "TORCHELASTIC_", "SLURM_", "OMPI_", "PMIX_")
_STRIP = frozenset({"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                    "MASTER_ADDR", "MASTER_PORT", "ROLE_RANK", "ROLE_WORLD_SIZE"})


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def job_env(endpoint: str, hf_home: Path, out_dir: Path, **extra: str) -> dict[str, str]:
    """The environment of one job's ranks: hub, cache, report directory and ``extra``."""
    env = {k: v for k, v in os.environ.items()
           if k not in _STRIP and not k.startswith(_STRIP_PREFIXES)}
    env.update({
        "HF_HOME": str(hf_home),
        "HF_ENDPOINT": endpoint,
        "HF_HUB_DISABLE_XET": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": "1",
        "PYTHONUNBUFFERED": "1",
        "PLT_OUT": str(out_dir),
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH"))
                                      if p),
    })
    env.update(extra)
    return env


@dataclass
class Job:
    """What a finished job left behind."""

    returncodes: list[int]
    outputs: list[str]
    elapsed_s: float
    ranks: dict[int, dict[str, Any]]
    requests: list[Request]
    out_dir: Path
    extra: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        """Return codes and the tail of every process's output, for assertion messages."""
        parts = [f"returncodes={self.returncodes} elapsed={self.elapsed_s:.1f}s"]
        for i, text in enumerate(self.outputs):
            parts.append(f"--- process {i} output (tail) ---\n{text[-6000:]}")
        return "\n".join(parts)

    def check_ok(self) -> Job:
        """Fail with the processes' output unless every process exited 0 and reported."""
        assert all(rc == 0 for rc in self.returncodes), self.describe()
        for rank, report in self.ranks.items():
            assert "crash" not in report, f"rank {rank} crashed:\n{report['crash']}\n" + \
                self.describe()
        return self

    def by_rank(self) -> dict[int | None, list[Request]]:
        """The job's requests grouped by the rank that sent them."""
        grouped: dict[int | None, list[Request]] = collections.defaultdict(list)
        for r in self.requests:
            grouped[r.rank].append(r)
        return dict(grouped)

    def window(self, step: str) -> list[Request]:
        """Requests that arrived during ``step``: between the first rank's start and the last
        rank's end of it (workers separate steps with a barrier, so windows never overlap)."""
        starts = [r["steps"][step]["t0"] for r in self.ranks.values() if step in r.get("steps", {})]
        ends = [r["steps"][step]["t1"] for r in self.ranks.values() if step in r.get("steps", {})]
        assert starts, f"no rank reported step {step!r}"
        lo, hi = min(starts), max(ends)  # a request arrives after its sender's t0, before t1
        return [r for r in self.requests if lo <= r.time <= hi]


def _read_reports(out_dir: Path) -> dict[int, dict[str, Any]]:
    reports = {}
    for path in sorted(out_dir.glob("rank-*.json")):
        reports[int(path.stem.split("-", 1)[1])] = json.loads(path.read_text())
    return reports


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _wait_all(procs: Sequence[subprocess.Popen], logs: Sequence[Path], deadline: float,
              ) -> tuple[list[int], list[str]]:
    timed_out = False
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
    for proc in procs:
        if proc.poll() is None:
            _kill_group(proc)
            proc.wait(timeout=30)
    outputs = [p.read_text(errors="replace") if p.exists() else "" for p in logs]
    if timed_out:
        raise AssertionError("job ran past its deadline and was killed\n" + "\n".join(
            f"--- process {i} ---\n{text[-6000:]}" for i, text in enumerate(outputs)))
    return [p.returncode for p in procs], outputs


def _spawn(cmd: Sequence[str], env: dict[str, str], log: Path, cwd: Path,
           nodes: SimulatedNodes | None = None, node: int = 0) -> subprocess.Popen:
    """Start ``cmd`` on this host or, with ``nodes``, inside simulated node ``node``."""
    if nodes is not None:
        cmd, env = nodes.command(node, cmd, cwd=cwd), nodes.env(env)
    with open(log, "wb") as handle:
        return subprocess.Popen(list(cmd), env=env, stdout=handle, stderr=subprocess.STDOUT,
                                cwd=cwd, start_new_session=True)


def simulated_nodes(hosts: str, count: int, envs: Sequence[dict[str, str]], *, log_dir: Path,
                    hostnames: Sequence[str] | None = None,
                    ) -> contextlib.AbstractContextManager[SimulatedNodes | None]:
    """The nodes a job's processes run in: None for ``shared-kernel`` (this host), else
    ``count`` namespaced nodes (``tests/_nodes.py``; ``hostnames`` default ``simnode<i>``)
    sharing the directory that holds every ``PLT_OUT`` and every ``HF_HOME`` not under
    ``NODE_LOCAL`` (a node-private path)."""
    if hosts == "shared-kernel":
        return contextlib.nullcontext()
    if hosts != "namespaced":
        raise ValueError(f"hosts={hosts!r}: expected 'shared-kernel' or 'namespaced'")
    paths = [e["PLT_OUT"] for e in envs] + [
        e["HF_HOME"] for e in envs
        if "HF_HOME" in e and NODE_LOCAL not in Path(e["HF_HOME"]).parents]
    return SimulatedNodes(count, shared=[Path(os.path.commonpath(paths))], log_dir=log_dir,
                          hostnames=hostnames)


def _requests_since(hub: LoopbackHub, t0: float, settle_s: float = 3.0) -> list[Request]:
    return [r for r in hub.requests(settle_s=settle_s) if r.time >= t0]


def torchrun_cmd(worker: str, args: Iterable[str], *, nproc: int, port: int, nnodes: int = 1,
                 node_rank: int = 0) -> list[str]:
    """``python -m torch.distributed.run`` for ``tests/workers/<worker>.py`` (static rendezvous
    at 127.0.0.1:``port``; with ``nnodes`` > 1, this is node ``node_rank``'s agent)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
           "--nnodes", str(nnodes), "--node-rank", str(node_rank),
           "--master-addr", "127.0.0.1", "--master-port", str(port), "--max-restarts", "0",
           "--monitor-interval", "0.1"]
    return cmd + [str(WORKERS / f"{worker}.py"), *args]


def run_torchrun(hub: LoopbackHub, worker: str, args: Iterable[str], *, nproc: int,
                 env: dict[str, str] | Sequence[dict[str, str]], timeout_s: float,
                 nnodes: int = 1, hosts: str = "shared-kernel") -> Job:
    """Run one torchrun job (``nnodes`` agents started together, one per simulated node, each
    with its own environment when ``env`` is a list) and collect reports and requests.

    ``hosts="namespaced"``: each agent runs in a namespaced node of its own (see
    :func:`simulated_nodes`); the default runs them all on this host.

    Raises AssertionError (with every process's output) when the job outlives ``timeout_s``.
    """
    envs = [env] * nnodes if isinstance(env, dict) else list(env)
    assert len(envs) == nnodes
    out_dir = Path(envs[0]["PLT_OUT"])
    out_dir.mkdir(parents=True, exist_ok=True)
    port = free_port()
    args = list(args)
    t0 = time.time()
    start = time.monotonic()
    procs, logs = [], []
    with simulated_nodes(hosts, nnodes, envs, log_dir=out_dir) as nodes:
        for node in range(nnodes):
            Path(envs[node]["PLT_OUT"]).mkdir(parents=True, exist_ok=True)
            log = out_dir / f"agent-{node}.log"
            cmd = torchrun_cmd(worker, args, nproc=nproc, port=port, nnodes=nnodes,
                               node_rank=node)
            procs.append(_spawn(cmd, envs[node], log, out_dir, nodes, node))
            logs.append(log)
        returncodes, outputs = _wait_all(procs, logs, start + timeout_s)
    elapsed = time.monotonic() - start
    ranks: dict[int, dict[str, Any]] = {}
    for node_env in envs:
        ranks.update(_read_reports(Path(node_env["PLT_OUT"])))
    return Job(returncodes, outputs, elapsed, ranks, _requests_since(hub, t0), out_dir)


def run_plain(hub: LoopbackHub, worker: str, args: Iterable[str], *, env: dict[str, str],
              timeout_s: float) -> Job:
    """Run ``python tests/workers/<worker>.py`` alone (world size 1, no launcher)."""
    out_dir = Path(env["PLT_OUT"])
    out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    start = time.monotonic()
    log = out_dir / "plain.log"
    proc = _spawn([sys.executable, str(WORKERS / f"{worker}.py"), *args], env, log, out_dir)
    returncodes, outputs = _wait_all([proc], [log], start + timeout_s)
    return Job(returncodes, outputs, time.monotonic() - start, _read_reports(out_dir),
               _requests_since(hub, t0), out_dir)


def plain_rank_env(env: dict[str, str], rank: int, world_size: int, store_port: int, *,
                   run_id: str) -> dict[str, str]:
    """``env`` plus torchrun's variables for ``rank`` of a one-node job whose agent store is the
    caller's TCPStore at ``127.0.0.1:store_port``."""
    return {**env, "RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size), "GROUP_RANK": "0", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(store_port), "TORCHELASTIC_USE_AGENT_STORE": "True",
            "TORCHELASTIC_RUN_ID": run_id}


def start_ranks(worker: str, args: Iterable[str], *, world_size: int, store_port: int,
                env: dict[str, str]) -> tuple[list[subprocess.Popen], list[Path]]:
    """Start ``world_size`` plain processes as the ranks of one node, with torchrun's variables
    set by hand and ``TORCHELASTIC_USE_AGENT_STORE=True`` pointing at the caller's TCPStore
    (``127.0.0.1:store_port``). No agent watches them: killing one leaves the others running."""
    out_dir = Path(env["PLT_OUT"])
    out_dir.mkdir(parents=True, exist_ok=True)
    procs, logs = [], []
    for rank in range(world_size):
        rank_env = plain_rank_env(env, rank, world_size, store_port, run_id=f"plain-{store_port}")
        log = out_dir / f"rank-{rank}.log"
        procs.append(_spawn([sys.executable, str(WORKERS / f"{worker}.py"), *args], rank_env, log,
                            out_dir))
        logs.append(log)
    return procs, logs


def wait_ranks(hub: LoopbackHub, procs: Sequence[subprocess.Popen], logs: Sequence[Path],
               t0: float, timeout_s: float, *, settle_s: float = 3.0) -> Job:
    """Join plain ranks started by :func:`start_ranks` (killing leftovers at the deadline).
    ``settle_s``: the longest wait for the hub's requests still in flight to be recorded (0
    for a caller that reads none of the job's requests, where a request a killed rank left
    stalled would hold it the whole time)."""
    start = time.monotonic()
    returncodes, outputs = _wait_all(procs, logs, start + timeout_s)
    return Job(returncodes, outputs, time.monotonic() - start,
               _read_reports(Path(logs[0]).parent), _requests_since(hub, t0, settle_s),
               Path(logs[0]).parent)


def gets_per_file(requests: Iterable[Request]) -> collections.Counter[tuple[str, str]]:
    """How many successful (200/206) GETs of each ``(repo_id, filename)`` the requests hold."""
    return collections.Counter((r.repo_id, r.filename) for r in requests
                               if r.method == "GET" and r.filename is not None
                               and r.status in (200, 206))


def request_signature(requests: Iterable[Request]) -> collections.Counter[tuple[str, str, int]]:
    """The requests as a multiset of ``(method, path, status)`` (order differs between runs:
    snapshot_download fetches in threads)."""
    return collections.Counter((r.method, r.path, r.status) for r in requests)


def diff_fingerprints(got: dict[str, Any], want: dict[str, Any], *, limit: int = 12) -> list[str]:
    """Human-readable differences between two model fingerprints (empty when identical)."""
    diffs: list[str] = []
    got_t, want_t = got["tensors"], want["tensors"]
    for name in sorted(set(got_t) | set(want_t)):
        if name not in got_t or name not in want_t:
            diffs.append(f"{name}: only in {'got' if name in got_t else 'reference'}")
        elif got_t[name] != want_t[name]:
            fields = [k for k in want_t[name] if got_t[name].get(k) != want_t[name][k]]
            diffs.append(f"{name}: differs in {fields}: got "
                         f"{ {k: got_t[name].get(k) for k in fields} }, reference "
                         f"{ {k: want_t[name][k] for k in fields} }")
    for key in sorted(set(got) | set(want)):
        if key != "tensors" and got.get(key) != want.get(key):
            diffs.append(f"{key}: got {str(got.get(key))[:300]}, reference "
                         f"{str(want.get(key))[:300]}")
    return diffs[:limit] + ([f"... {len(diffs) - limit} more"] if len(diffs) > limit else [])


def step_records(job: Job, step: str) -> dict[int, dict[str, Any]]:
    """Every rank's record of ``step``, by rank; fails if a rank recorded an error there."""
    records = {}
    for rank, report in sorted(job.ranks.items()):
        record = report["steps"][step]
        assert "error" not in record, f"rank {rank} {step}: {record['error']}"
        records[rank] = record
    return records


def check_same_error_everywhere(job: Job, step: str, within_s: float = 10.0) -> dict[int, Any]:
    """Every rank raised the same class; the ranks that waited on an attempt are followers naming
    its leader (the original exception); a rank that arrived after an attempt had failed led an
    attempt of its own (its own request, the same error, as a plain call); all raised within
    ``within_s`` of the first leader."""
    errors = {}
    for rank, report in sorted(job.ranks.items()):
        record = report["steps"][step]
        assert not record.get("ok"), f"rank {rank} {step}: no error"
        errors[rank] = record["error"]
    types = {e["type"] for e in errors.values()}
    assert len(types) == 1, f"{step}: classes differ: { {r: e['type'] for r, e in errors.items()} }"
    leaders = [r for r, e in errors.items() if not e["follower"]]
    assert leaders, f"{step}: no leader: {errors}"
    assert all(errors[r]["message"] == errors[leaders[0]]["message"] for r in leaders), errors
    first = min(leaders, key=lambda r: errors[r]["t_raised"])
    for rank, error in errors.items():
        if rank in leaders:
            assert error["t_raised"] - errors[first]["t_raised"] < within_s, (step, rank, error)
            continue
        leader = error["leader_rank"]
        assert leader in leaders, (step, rank, error)
        original = errors[leader]
        # The plain call's message; a note names the ranks.
        assert error["message"] == original["message"], (original, error)
        assert any(f"leader rank {leader}" in note for note in error["notes"]), error
        # except clauses written for the plain call still catch it
        assert all(error["isinstance"][k] for k, v in original["isinstance"].items() if v), \
            (step, rank, error["isinstance"], original["isinstance"])
        assert error["t_raised"] - original["t_raised"] < within_s, (step, rank, error, original)
    return errors


def run_processes(hub: LoopbackHub, cmds: Sequence[Sequence[str]], envs: Sequence[dict[str, str]],
                  *, out_dir: Path, timeout_s: float, hosts: str = "shared-kernel",
                  node_of: Sequence[int] | None = None, hostnames: Sequence[str] | None = None,
                  ) -> Job:
    """Start one process per command (each with its environment; a launcher, or a rank started
    by hand with a launcher's variables), join them with a deadline and collect the reports in
    ``out_dir`` and the requests that arrived meanwhile.

    ``hosts="namespaced"``: process ``i`` runs in namespaced node ``node_of[i]`` (see
    :func:`simulated_nodes`; ``hostnames``: one per node)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    node_of = list(node_of) if node_of is not None else [0] * len(cmds)
    t0 = time.time()
    start = time.monotonic()
    procs, logs = [], []
    with simulated_nodes(hosts, max(node_of) + 1, envs, log_dir=out_dir,
                         hostnames=hostnames) as nodes:
        for i, (cmd, env) in enumerate(zip(cmds, envs)):
            log = out_dir / f"process-{i}.log"
            procs.append(_spawn(cmd, env, log, out_dir, nodes, node_of[i]))
            logs.append(log)
        returncodes, outputs = _wait_all(procs, logs, start + timeout_s)
    return Job(returncodes, outputs, time.monotonic() - start, _read_reports(out_dir),
               _requests_since(hub, t0), out_dir)
