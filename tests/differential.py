"""The differential harness: run one plan of steps twice, plain (``PATCHLOAD=0``) and patched,
with the same ranks, launcher and environment, and list every difference a rank could observe.

patchload's promise is that a rank observes nothing different from a plain load except fewer
requests, fewer reads and less memory. So the harness compares **per rank** and per step (each
step is one call, or a user's retry loop around one call; see ``tests/workers/differential.py``):

* every named parameter and buffer (sha256 of the bytes, dtype, shape, device, requires_grad,
  ``remove_duplicate=False`` names), the tie structure, the training flags, ``config.to_dict()``,
  ``generation_config.to_dict()``, ``name_or_path`` (``_common.fingerprint``);
* tokenizer output on fixed sentences, files returned by hub downloads (path and sha256);
* loading info (``output_loading_info=True``) with its sets as sorted lists;
* a hash of ``torch.get_rng_state()`` right after each call (and ``torch.rand`` where a step asks);
* failures: the class (by name, and whether the patched exception is an instance of the plain
  one's class: followers re-raise the leader's error as a subclass) and the message, both
  reported; only the run's temporary directory and the hub's port are normalised away, never a
  patchload prefix: a patched message that differs from plain is a finding;
* hub requests per rank in each step's window (:meth:`_launch.Job.window`), by the scenario's
  rule (:class:`Requests`).

A :class:`Group` is one job: several scenarios whose process-level settings agree (one cache for
every rank, one per rank, or simulated hosts) run one after another in the same ranks, barriers
between steps. Each group runs plain once and patched once per variant (e.g. the shm and the
collective transport), plus a second plain run that checks the harness itself: two plain runs
must compare equal, requests included, or a difference under patchload could be noise.

To add a scenario: write a :class:`Scenario` (steps on repo ids of its own, so request windows
never mix; a ``setup`` that serves its repos; a ``per_run`` that prepares caches, faults or
working directories for each run) and put it in a group of ``tests/test_differential.py``.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import datetime
import enum
import json
import os
import re
import shutil
import subprocess
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Final, Iterable, Iterator

from _launch import WORKERS, Job, free_port, job_env, run_plain, run_processes, run_torchrun
from patchload.testing import LoopbackHub, Request

JOB_TIMEOUT_S: Final = 180
WARM_TIMEOUT_S: Final = 120

# Set identically for both runs of a group (plain ignores the PATCHLOAD_* ones):
COMMON_ENV: Final = {
    # A follower stuck waiting fails its step after this long instead of hanging the job.
    "PATCHLOAD_TIMEOUT": "40",
    # transformers' safetensors auto-conversion thread (``.bin`` repos) posts to a public Space;
    # point https at a closed port so no test ever reaches the internet (the loopback hub is
    # plain http and listed in NO_PROXY).
    "HTTPS_PROXY": "http://127.0.0.1:9",
    "https_proxy": "http://127.0.0.1:9",
    "NO_PROXY": "127.0.0.1,localhost",
    "no_proxy": "127.0.0.1,localhost",
    # str() of a set (a config attribute, a loading-info entry) in a stable order
    "PYTHONHASHSEED": "0",
}

# Requests that are not a rank's: huggingface_hub's daily agent-registry fetch carries no
# User-Agent origin (see patchload.testing.hub).
_NOT_A_RANKS: Final = ("/api/agent-harnesses",)


class Requests(enum.Enum):
    """What a scenario's hub requests must satisfy, per step window, patched against plain."""

    ONE_PER_CACHE = "one-per-cache"
    """Ranks sharing a cache (an ``HF_HOME``): at most one of them makes requests (followers
    none), and no more in all than the plain ranks made."""
    PER_RANK = "per-rank"
    """A cache per rank: every rank makes no more requests than its plain run did."""
    TOTAL = "total"
    """No more requests in all than the plain ranks made (e.g. a retry another rank may lead)."""


@dataclass
class SetupContext:
    """What a scenario's ``setup`` gets, once per module: the hub, a directory for its repo
    folders and cache templates, and :meth:`warm`."""

    hub: LoopbackHub
    assets: Path
    root: Path

    def warm(self, home: Path, steps: list[dict[str, Any]], name: str) -> None:
        """Fill ``home`` (an ``HF_HOME``) by running ``steps`` plain in one process."""
        run_root = self.root / "warm" / name
        plan = {"run_root": str(run_root), "per_rank": {}, "steps": steps}
        plan_path = _write_plan(run_root, plan)
        env = job_env(self.hub.endpoint, home, run_root / "out", PATCHLOAD="0", **COMMON_ENV)
        job = run_plain(self.hub, "differential", [str(plan_path)], env=env,
                        timeout_s=WARM_TIMEOUT_S).check_ok()
        for step in steps:
            for attempt in job.ranks[0]["steps"][step["name"]]["attempts"]:
                assert attempt["ok"], f"warming {home}: {step['name']}: {attempt['error']}"


@dataclass
class RunContext:
    """What a scenario's ``per_run`` gets before each run: the hub (faults are cleared before
    every run), this run's directory, every rank's ``HF_HOME`` and per-rank settings to extend
    (``per_rank[rank]["cwd"]``, ``per_rank[rank]["env"][...]``, ``per_rank[rank]["copy"]``).
    On namespaced nodes (``Group.nodes``) only the run's directory is shared: what a rank needs
    from elsewhere is copied there first."""

    hub: LoopbackHub
    run_root: Path
    assets: Path
    world_size: int
    homes: dict[int, Path]
    per_rank: dict[int, dict[str, Any]]


@dataclass(frozen=True)
class Scenario:
    """A named sequence of steps (worker step dicts; names are prefixed with the scenario's)."""

    name: str
    steps: tuple[dict[str, Any], ...]
    requests: Requests
    setup: Callable[[SetupContext], None] | None = None
    per_run: Callable[[RunContext], None] | None = None
    requests_to_end: bool = False
    """Count requests from the step's start to the end of the job (background threads that
    outlive the call); such a scenario must come last in its group."""
    extra_requests: int = 0
    """Requests per step the patched run may make beyond plain's in all: the leader's anonymous
    metadata request per repo where ranks hold other credentials (``coordination.credentials``),
    which a step whose other ranks save nothing (each makes its own call) shows."""

    def step_names(self) -> list[str]:
        return [f"{self.name}/{s['name']}" for s in self.steps]

    def plan_steps(self) -> list[dict[str, Any]]:
        return [{**s, "name": f"{self.name}/{s['name']}"} for s in self.steps]


@dataclass(frozen=True)
class Group:
    """Scenarios run in one job, plain and as each of ``variants`` (patched runs, by name, each
    with its extra environment).

    ``hosts=0``: one torchrun job of ``nproc`` ranks; ``homes`` is ``"shared"`` (one
    ``HF_HOME``) or ``"per-rank"``. ``hosts=N``: N simulated hosts (namespaces of their own:
    hostname, PIDs, boot id; one network), each a user's script started by ``srun`` (one task
    per node) that spawns ``nproc`` ranks with ``torch.multiprocessing.spawn`` and builds the
    process group by hand (``tests/workers/differential_hosts.py``); one ``HF_HOME`` per host.
    ``nodes=N``: one torchrun job of N agents, each in a namespaced node of its own (PIDs,
    hostname, a private ``/tmp``: ``_nodes.NODE_LOCAL`` is node-local; ``tests/_nodes.py``), the
    run's directory shared between them; ``homes`` is ``"shared"`` (downloads are job-scoped).
    """

    name: str
    scenarios: tuple[Scenario, ...]
    homes: str = "shared"
    variants: dict[str, dict[str, str]] = field(default_factory=lambda: {"shm": {}})
    nproc: int = 3
    hosts: int = 0
    process_group: bool = False
    """Every rank joins a gloo process group first (``init_process_group`` over torchrun's
    variables): for steps with a ``collective``."""
    nodes: int = 0
    busy_cores: bool = False
    """Every run (plain and patched alike) runs while one busy-looping process per core
    (``os.cpu_count()``, at this process's priority) competes with the ranks: see
    :func:`busy_cores`."""
    concurrent_plain: bool = False
    """The plain run and the (one) patched variant's run go at the same time, the plain one
    against a loopback hub of its own that serves the repos the group's scenarios serve (the
    same files: the same ETags and commit shas; the endpoint is normalised away in every record),
    so each run's request log is its own. For a group whose runs are mostly asleep (rank0-late:
    40 s of rank 0's own work in each), so that the two sleeps overlap."""

    def __post_init__(self) -> None:
        assert not (self.hosts and self.nodes), "simulated hosts or nodes, not both"
        assert self.homes in (("per-host",) if self.hosts else ("shared", "per-rank")), self.homes
        assert not self.concurrent_plain or (len(self.variants) == 1 and not self.hosts
                                             and not self.busy_cores), self.name
        for scenario in self.scenarios[:-1]:
            assert not scenario.requests_to_end, f"{scenario.name} must be last in {self.name}"

    @property
    def world_size(self) -> int:
        return self.nproc * max(1, self.hosts, self.nodes)

    def cache_of(self, rank: int) -> int:
        """Which cache (``HF_HOME``) ``rank`` uses, numbered from 0."""
        return {"shared": 0, "per-rank": rank, "per-host": rank // self.nproc}[self.homes]


def _write_plan(run_root: Path, plan: dict[str, Any]) -> Path:
    run_root.mkdir(parents=True, exist_ok=True)
    path = run_root / "plan.json"
    path.write_text(json.dumps(plan, indent=1, sort_keys=True))
    return path


@contextlib.contextmanager
def busy_cores(count: int | None = None) -> Iterator[list[subprocess.Popen]]:
    """Keep every core busy while the block runs: ``count`` (default ``os.cpu_count()``)
    processes that loop forever, at the caller's priority, so the ranks' threads compete for
    CPU time as on a loaded node (a follower's poll, the leader's heartbeat and a store wait all
    get late). They are killed and reaped on the way out, whatever the block raised."""
    procs: list[subprocess.Popen] = []
    try:
        for _ in range(count or os.cpu_count() or 1):
            procs.append(subprocess.Popen([sys.executable, "-c", "while True: pass"],
                                          stdin=subprocess.DEVNULL))
        yield procs
    finally:
        for proc in procs:
            proc.kill()
        for proc in procs:
            proc.wait()


def copy_cache(template: Path, home: Path) -> None:
    """Copy an ``HF_HOME`` (its snapshot links are relative: they stay valid)."""
    shutil.copytree(template, home, symlinks=True, dirs_exist_ok=True)


class _ServedRepos:
    """A hub, as a scenario's ``setup`` uses it, that notes every ``add_repo`` call (its
    arguments), for :attr:`Group.concurrent_plain`'s second hub."""

    def __init__(self, hub: LoopbackHub) -> None:
        self._hub = hub
        self.added: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def add_repo(self, *args: Any, **kwargs: Any) -> Any:
        self.added.append((args, kwargs))
        return self._hub.add_repo(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._hub, name)


class Harness:
    """Runs groups (each side once, cached) for one module, on one hub."""

    def __init__(self, hub: LoopbackHub, root: Path, groups: Iterable[Group]) -> None:
        self.hub = hub
        self.root = root
        self.assets = root / "assets"
        self.groups = {g.name: g for g in groups}
        self._sides: dict[tuple[str, str], Job | BaseException] = {}
        self._served: dict[str, list[tuple[tuple[Any, ...], dict[str, Any]]]] = {}
        ctx = SetupContext(hub, self.assets, root)
        for group in self.groups.values():
            recorder = _ServedRepos(hub) if group.concurrent_plain else None
            for scenario in group.scenarios:
                if scenario.setup is not None:
                    scenario.setup(ctx if recorder is None else SetupContext(
                        recorder, self.assets, root))  # type: ignore[arg-type]
            if recorder is not None:
                self._served[group.name] = recorder.added

    def side(self, group_name: str, side: str) -> Job:
        """The finished job of ``side`` (``"plain"``, ``"plain-again"`` or a variant's name) of
        a group, run on first use; a job that failed to run fails every later call too."""
        key = (group_name, side)
        group = self.groups[group_name]
        if key not in self._sides and group.concurrent_plain and side != "plain-again":
            self._run_plain_alongside(group)
        if key not in self._sides:
            try:
                self._sides[key] = self._run(group, side)
            except BaseException as exc:  # noqa: BLE001 - cached: one timeout, not one per test
                self._sides[key] = exc
        result = self._sides[key]
        if isinstance(result, BaseException):
            raise AssertionError(f"{group_name} {side}: the job did not run: {result}")
        return result

    def _run_plain_alongside(self, group: Group) -> None:
        """Run ``group``'s plain side and its patched variant at once (``Group.concurrent_plain``),
        the plain one against a hub of its own serving the same repos."""
        (variant,) = group.variants
        with LoopbackHub(log_path=self.root / group.name / "plain-hub-requests.jsonl") as own:
            for args, kwargs in self._served[group.name]:
                own.add_repo(*args, **kwargs)
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                futures = {"plain": pool.submit(self._run, group, "plain", own),
                           variant: pool.submit(self._run, group, variant, self.hub)}
            for side, future in futures.items():
                try:
                    self._sides[group.name, side] = future.result()
                except BaseException as exc:  # noqa: BLE001 - as in side()
                    self._sides[group.name, side] = exc

    def _run(self, group: Group, side: str, hub: LoopbackHub | None = None) -> Job:
        hub = hub or self.hub
        run_root = self.root / group.name / side
        if side in ("plain", "plain-again"):
            extra = {"PATCHLOAD": "0"}
        else:
            extra = {"PATCHLOAD": "1", **group.variants[side]}
        homes = {r: run_root / f"hf-{group.cache_of(r)}" for r in range(group.world_size)}
        per_rank: dict[int, dict[str, Any]] = {r: {"env": {}} for r in range(group.world_size)}
        if group.homes == "per-rank":
            for rank, home in homes.items():
                per_rank[rank]["env"]["HF_HOME"] = str(home)
        hub.clear_faults()
        ctx = RunContext(hub, run_root, self.assets, group.world_size, homes, per_rank)
        for scenario in group.scenarios:
            if scenario.per_run is not None:
                scenario.per_run(ctx)
        plan = {"run_root": str(run_root),
                "per_rank": {str(r): v for r, v in per_rank.items()},
                "steps": [s for scenario in group.scenarios for s in scenario.plan_steps()]}
        if group.process_group:
            plan["process_group"] = "gloo"
        env = job_env(hub.endpoint, homes[0], run_root / "out", **COMMON_ENV, **extra)
        with busy_cores() if group.busy_cores else contextlib.nullcontext():
            job = self._launch(group, run_root, plan, env, homes, hub)
        job.extra["side"] = side
        return job

    def _launch(self, group: Group, run_root: Path, plan: dict[str, Any], env: dict[str, str],
                homes: dict[int, Path], hub: LoopbackHub) -> Job:
        if group.hosts:
            return self._run_hosts(group, run_root, plan, env, homes)
        return run_torchrun(hub, "differential", [str(_write_plan(run_root, plan))],
                            nproc=group.nproc, env=env, timeout_s=JOB_TIMEOUT_S,
                            nnodes=max(1, group.nodes),
                            hosts="namespaced" if group.nodes else "shared-kernel")

    def _run_hosts(self, group: Group, run_root: Path, plan: dict[str, Any],
                   env: dict[str, str], homes: dict[int, Path]) -> Job:
        import torch.distributed as dist

        # The test barrier's store (the workers' MASTER_ADDR/MASTER_PORT); the ranks' own
        # process group meets elsewhere, as a spawn script's would.
        store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=JOB_TIMEOUT_S))
        plan["init_process_group"] = f"tcp://127.0.0.1:{free_port()}"
        plan_path = _write_plan(run_root, plan)
        cmds, envs = [], []
        for host in range(group.hosts):
            boot_id = run_root / f"boot-id-{host}"
            boot_id.write_text(f"{uuid.UUID(int=host + 1)}\n")
            envs.append({**env, **_srun_env(host, group.hosts),
                         "HF_HOME": str(homes[host * group.nproc]),
                         "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(store.port),
                         # gloo looks up its address by hostname, which the namespace changed
                         "GLOO_SOCKET_IFNAME": "lo",
                         "PLT_BOOT_ID_FILE": str(boot_id), "PLT_HOSTNAME": f"sim-host-{host}"})
            cmds.append([*HOST_NAMESPACES, "sh", "-c", _HOST_SETUP, "host", sys.executable,
                         str(WORKERS / "differential_hosts.py"), str(host), str(group.hosts),
                         str(group.nproc), str(plan_path)])
        try:
            return run_processes(self.hub, cmds, envs, out_dir=run_root / "out",
                                 timeout_s=JOB_TIMEOUT_S)
        finally:
            del store


# A simulated host: its own hostname (patchload's same-host test), PID namespace (the other
# host's pids are not visible) and boot id (what the shm transport checks before attaching).
HOST_NAMESPACES: Final = ("unshare", "--mount", "--uts", "--pid", "--fork", "--mount-proc",
                          "--propagation", "private")
_HOST_SETUP: Final = ('mount --bind "$PLT_BOOT_ID_FILE" /proc/sys/kernel/random/boot_id '
                      '&& hostname "$PLT_HOSTNAME" && exec "$@"')


def hosts_unavailable() -> str | None:
    """Why simulated hosts cannot run here (not root, no ``unshare``), or None."""
    if shutil.which("unshare") is None:
        return "no unshare(1) on this machine"
    probe = subprocess.run([*HOST_NAMESPACES, "sh", "-c", "mount --bind /dev/null "
                            "/proc/sys/kernel/random/boot_id && hostname sim-probe"],
                           capture_output=True, text=True, timeout=30)
    if probe.returncode != 0:
        return f"cannot create namespaces: {probe.stderr.strip()[:200]}"
    return None


def _srun_env(host: int, hosts: int) -> dict[str, str]:
    """What ``srun --nodes H --ntasks-per-node 1`` gives its task on node ``host``."""
    layout = f"1(x{hosts})"
    return {"SLURM_JOB_ID": "4242", "SLURM_STEP_ID": "0", "SLURM_PROCID": str(host),
            "SLURM_LOCALID": "0", "SLURM_NODEID": str(host), "SLURM_NTASKS": str(hosts),
            "SLURM_STEP_NUM_TASKS": str(hosts), "SLURM_NNODES": str(hosts),
            "SLURM_JOB_NUM_NODES": str(hosts), "SLURM_NTASKS_PER_NODE": "1",
            "SLURM_TASKS_PER_NODE": layout, "SLURM_STEP_TASKS_PER_NODE": layout,
            "SLURM_NODELIST": f"sim-host-[0-{hosts - 1}]"}


# --- comparison ---------------------------------------------------------------------------------

_SHA256: Final = re.compile(r"\b([0-9a-f]{12})[0-9a-f]{52}\b")


def _short(value: Any, limit: int = 240) -> str:
    text = _SHA256.sub(r"\1..", json.dumps(value, sort_keys=True, default=str))
    return text if len(text) <= limit else text[:limit] + "..."


def deep_diff(plain: Any, other: Any, path: str = "") -> list[str]:
    """``path: plain X, patched Y`` for every leaf where two JSON values differ."""
    if isinstance(plain, dict) and isinstance(other, dict):
        out = []
        for key in sorted(set(plain) | set(other), key=str):
            sub = f"{path}.{key}" if path else str(key)
            if key not in other:
                out.append(f"{sub}: only in plain ({_short(plain[key], 120)})")
            elif key not in plain:
                out.append(f"{sub}: only in patched ({_short(other[key], 120)})")
            else:
                out += deep_diff(plain[key], other[key], sub)
        return out
    if isinstance(plain, list) and isinstance(other, list) and len(plain) == len(other) \
            and any(isinstance(v, (dict, list)) for v in plain):
        out = []
        for i, (a, b) in enumerate(zip(plain, other)):
            out += deep_diff(a, b, f"{path}[{i}]")
        return out
    if plain != other:
        return [f"{path}: plain {_short(plain)}, patched {_short(other)}"]
    return []


def error_diff(plain: dict[str, Any], other: dict[str, Any]) -> list[str]:
    """The class (same name, and an instance of the plain class) and the message, separately."""
    out = []
    plain_class = plain["mro"][0]
    if other["type"] != plain["type"] or plain_class not in other["mro"]:
        out.append(f"error class: plain {plain['type']}, patched {other['type']} "
                   f"(isinstance of plain {plain['type']}: {plain_class in other['mro']}; "
                   f"patchload follower: {other['follower']})")
    if other["message"] != plain["message"]:
        out.append(f"error message: plain {_short(plain['message'], 400)}, "
                   f"patched {_short(other['message'], 400)}")
    return out


def _fold_tensors(lines: list[str], keep: int = 3) -> list[str]:
    """Keep the first few per-tensor lines; count the others (a wrong checkpoint differs in
    every tensor)."""
    tensors = [line for line in lines if line.startswith("fingerprint.tensors.")]
    if len(tensors) <= keep + 1:
        return lines
    folded = f"fingerprint.tensors: {len(tensors) - keep} more tensors differ"
    rest = [line for line in lines if line not in tensors]
    return tensors[:keep] + [folded] + rest


def record_diff(plain: dict[str, Any], other: dict[str, Any]) -> list[str]:
    """Differences between one rank's records of one step."""
    if plain.get("skipped") or other.get("skipped"):
        return [] if plain.get("skipped") == other.get("skipped") else \
            [f"skipped: plain {plain.get('skipped', False)}, patched {other.get('skipped', False)}"]
    if "attempts" not in other:
        return ["no record (the rank did not get through this step)"]
    out = []
    plain_attempts, other_attempts = plain["attempts"], other["attempts"]
    if len(plain_attempts) != len(other_attempts):
        out.append(f"attempts: plain {len(plain_attempts)} "
                   f"({[a['ok'] for a in plain_attempts]}), patched {len(other_attempts)} "
                   f"({[a['ok'] for a in other_attempts]})")
    for i, (a, b) in enumerate(zip(plain_attempts, other_attempts)):
        tag = f"attempt {i}: " if len(plain_attempts) > 1 or len(other_attempts) > 1 else ""
        if a["ok"] and b["ok"]:
            found = _fold_tensors(deep_diff(a["obs"], b["obs"]))
        elif a["ok"] != b["ok"]:
            found = [f"plain {'succeeded' if a['ok'] else 'failed'}, patched "
                     f"{'succeeded' if b['ok'] else 'failed'}: "
                     + (_short(b["error"]["type"] + ": " + b["error"]["message"], 400)
                        if not b["ok"] else _short(a["error"]["type"] + ": "
                                                   + a["error"]["message"], 400))]
        else:
            found = error_diff(a["error"], b["error"])
        found += deep_diff({k: a.get(k) for k in ("rng", "rand")},
                           {k: b.get(k) for k in ("rng", "rand")})
        out += [tag + line for line in found]
    return out


def _window(job: Job, step: str, to_end: bool) -> list[Request]:
    if not any(step in r.get("steps", {}) for r in job.ranks.values()):
        return []  # no rank got there: the step records say so
    if not to_end:
        requests = job.window(step)
    else:
        start = min(r["steps"][step]["t0"] for r in job.ranks.values() if step in r["steps"])
        requests = [r for r in job.requests if r.time >= start]
    return [r for r in requests if r.path not in _NOT_A_RANKS]


def rank_of(job: Job, request: Request) -> int | None:
    """The rank that sent ``request``: its ``origin/rank-N``, else the rank whose transformers
    session id its User-Agent names (transformers' own ``HfApi`` calls replace the User-Agent)."""
    if request.rank is not None:
        return request.rank
    for rank, report in job.ranks.items():
        if report.get("session_id") and f"session_id/{report['session_id']}" in (
                request.user_agent or ""):
            return rank
    return None


def requests_per_rank(job: Job, step: str, to_end: bool = False) -> dict[int | None, int]:
    return dict(sorted(collections.Counter(rank_of(job, r) for r in _window(job, step, to_end)
                                           ).items(), key=lambda kv: (kv[0] is None, kv[0])))


def _requests_by_rank(job: Job, step: str, to_end: bool) -> str:
    """``rank: METHOD path status, ...`` for a step's requests (what a failed count shows)."""
    by_rank = collections.defaultdict(list)
    for r in _window(job, step, to_end):
        by_rank[rank_of(job, r)].append(f"{r.method} {r.path} {r.status}")
    return _short({str(rank): lines for rank, lines in by_rank.items()}, 2000)


def request_kinds(job: Job, step: str, to_end: bool = False) -> set[tuple[str, str, int]]:
    """The distinct ``(method, path, status)`` of a step's requests, whoever sent them."""
    return {(r.method, r.path, r.status) for r in _window(job, step, to_end)}


def request_diff(plain: Job, other: Job, group: Group, scenario: Scenario, *,
                 self_check: bool) -> list[str]:
    """The scenario's request rule, per step (see :class:`Requests`). ``self_check``: ``other``
    is a second plain run; then what the rule compares against must be reproducible: the counts
    per rank with a cache per rank; with a shared cache, where which rank finds a file already
    downloaded is a matter of timing, the distinct requests made."""
    out = []
    for step in scenario.step_names():
        to_end = scenario.requests_to_end
        want = requests_per_rank(plain, step, to_end)
        got = requests_per_rank(other, step, to_end)
        line = f"{step} requests per rank: plain {want}, patched {got}"
        if self_check:
            if scenario.requests is Requests.PER_RANK:
                if want != got:
                    out.append(line + " (two plain runs differ)")
            else:
                kinds = request_kinds(plain, step, to_end) ^ request_kinds(other, step, to_end)
                if kinds:
                    out.append(f"{step}: two plain runs made different requests: "
                               f"{_short(sorted(kinds), 600)}")
            continue
        if None in got:
            out.append(line + ": requests from no known rank")
        if sum(got.values()) > sum(want.values()) + scenario.extra_requests:
            out.append(line + ": more in all than plain; plain made "
                       + _requests_by_rank(plain, step, to_end) + "; patched made "
                       + _requests_by_rank(other, step, to_end))
        if scenario.requests is Requests.ONE_PER_CACHE:
            senders = collections.defaultdict(list)
            for rank in got:
                if rank is not None:
                    senders[group.cache_of(rank)].append(rank)
            if any(len(ranks) > 1 for ranks in senders.values()):
                out.append(line + ": followers made requests")
        if scenario.requests is Requests.PER_RANK:
            more = [r for r in got if r is not None and got[r] > want.get(r, 0)]
            if more:
                out.append(line + f": ranks {more} made more than plain")
    return out


def scenario_diff(plain: Job, other: Job, group: Group, scenario: Scenario, *,
                  self_check: bool = False, limit: int = 40) -> list[str]:
    """Every difference, per rank and step, between two runs of a group, for one scenario
    (``self_check``: ``other`` is a second plain run)."""
    out = []
    for job, label, installed in ((plain, "plain", False), (other, "patched", not self_check)):
        if any(rc != 0 for rc in job.returncodes):
            out.append(f"{label} job failed: {job.describe()[-3000:]}")
        out += [f"{label} rank {rank} wrote no report"
                for rank in range(group.world_size) if rank not in job.ranks]
        for rank, report in sorted(job.ranks.items()):
            if "crash" in report:
                out.append(f"{label} rank {rank} crashed: {report['crash'][-2000:]}")
            elif report.get("installed") is not installed:
                out.append(f"{label} rank {rank}: patchload installed={report.get('installed')}")
        if out and label == "plain":
            return ["the plain run itself failed (a harness problem):"] + out
    for step in scenario.step_names():
        for rank in range(group.world_size):
            want = plain.ranks[rank]["steps"][step]
            got = other.ranks.get(rank, {}).get("steps", {}).get(step, {})
            out += [f"rank {rank} {step}: {line}" for line in record_diff(want, got)]
    out += request_diff(plain, other, group, scenario, self_check=self_check)
    return out[:limit] + ([f"... {len(out) - limit} more"] if len(out) > limit else [])
