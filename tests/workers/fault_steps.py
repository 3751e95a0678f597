"""Rank worker for tests/test_faults.py: run a plan of load steps, each with its own injected fault.

Usage: ``fault_steps.py PLAN.json``. The plan is ``{"repos": {repo_id: folder}, "steps": [...]}``;
each step is a dict:

* ``name``: the step's name (key in the report); ``repo``: the repo to load; ``kwargs``: extra
  ``from_pretrained`` arguments (``dtype`` given as a string such as ``"bfloat16"``);
  ``call``: ``model`` (``AutoModelForCausalLM``, default) or ``download`` (``hf_hub_download`` of
  ``filename``).
* ``ranks``: the ranks that take part (default: every rank still alive); the others skip it.
  The barriers around a step count only these ranks, so a rank killed in one step is simply
  left out of the next ones.
* ``leader``: make this rank the leader: it calls first, the others wait until it announced its
  call, then 0.5 s more (patchload's leader is the first rank to claim the call).
* ``delay_s``: ``{rank: seconds}`` to sleep before calling (after the leader logic).
* ``on_open``: ``"kill"`` or ``"MemoryError"``: the first rank that opens a checkpoint file of
  ``repo`` (``safetensors.safe_open``; only a leader does) SIGKILLs itself or raises.
* ``kill_after_publish``: the rank that publishes a successful outcome for ``repo`` waits until
  rank ``attached_rank`` returned from its own call, then SIGKILLs itself.
* ``remote_leader``: the followers take the leader for one on another node, so they cannot
  watch its pid and must notice its death by its heartbeat stopping.
* ``late_rank``: this rank calls only after the step's leader process is dead.
* ``self_kill``: ``{"rank": r, "after_s": s}``: rank r SIGKILLs itself s seconds into its call.
* ``exits_first``: this rank exits with status 0 at the step (leave it out of ``ranks``); a
  first step, so that it made no call before.
* ``truncate_cached``: (rank 0, before the call, no load) truncate the cached blob of every
  ``*.safetensors`` file of ``repo`` to half its size.
* ``kind``: ``threads``: three threads of each rank load ``repo`` at once (each call is matched
  with the same-numbered call of the other ranks), each checking its weights; ``loop``:
  ``loops`` loads of ``repo`` in a row, alternating the checkpoint's dtype and ``bfloat16`` (a
  converting load), each checked and dropped, sampling open file descriptors, threads and RSS
  before the first and after every load.
* ``gate``: ``{"dir": path, "count": n}``: before the call, rank 0 creates a file named after
  its job in ``dir`` and every rank waits until ``n`` such files exist (jobs start together).
* ``init_pg_timeout_s``: before the call, ``init_process_group("gloo")`` with this timeout (once);
  after the call, an ``all_reduce`` and a ``barrier`` on it (the sum is reported).
* ``env``: ``{PATCHLOAD_*: value}`` configuration for this step only (e.g. the collective
  transport), as if read from the environment at install time.
* ``flock``: ``"enosys"`` (``fcntl.flock`` fails with ``ENOSYS``, as on some NFS mounts) or
  ``"noop"`` (it returns at once without locking, as on some Lustre/GPFS mounts), in every rank
  during the call.
* ``enospc``: ``{"rank": r, "after_bytes": n}``: in rank r only, writing a download's temporary
  ``*.incomplete`` file under ``kwargs["cache_dir"]`` fails with ``ENOSPC`` once n bytes are in
  it (a full disk where mounting a small tmpfs is not allowed).
* ``inspect_cache``: before the call, the step's first rank lists every file and link under
  ``kwargs["cache_dir"]`` (paths relative to it) into ``cache_before``.
* ``kill_in_broadcast``: ``{"rank": r, "bucket": b}``: rank r SIGKILLs itself just before bucket
  b of a collective broadcast (the leader while sending, a follower while receiving).

``PLT_HUB_WAIT_SCALE`` (the job's environment): huggingface_hub's sleeps between its retries
scaled (``_common.shorten_hub_waits``).

Every rank writes ``$PLT_OUT/rank-<RANK>.json`` after each step: per step, ``ok`` and a weight
check (every tensor of the checkpoint compared with the model, bitwise, after the same dtype
conversion) or the error (class, bases, message, leader rank); ``elapsed_s`` (call to return)
and ``t_end`` (wall clock at return).
"""

from __future__ import annotations

import os

os.environ["HF_HUB_USER_AGENT_ORIGIN"] = f"rank-{os.environ.get('RANK', '0')}"

import contextlib  # noqa: E402
import datetime  # noqa: E402
import errno  # noqa: E402
import fcntl  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import signal  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import _common  # noqa: E402
from _common import RANK, WORLD_SIZE  # noqa: E402

import patchload  # noqa: E402 - installs the patches
import psutil  # noqa: E402
import safetensors  # noqa: E402
import safetensors.torch  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import transformers  # noqa: E402
import transformers.modeling_utils  # noqa: E402, F401 - binds safe_open by name
from transformers import AutoModelForCausalLM  # noqa: E402

import patchload.coordination.protocol as coordinate  # noqa: E402
import patchload.transport.collective as collective  # noqa: E402
from patchload import _state  # noqa: E402
from patchload._config import load_config  # noqa: E402

transformers.logging.set_verbosity_error()
_common.shorten_hub_waits()  # PLT_HUB_WAIT_SCALE, where the job sets it


class Sync:
    """Barriers and flags over the launcher's TCPStore that count only the ranks of a step."""

    def __init__(self) -> None:
        base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                             is_master=False, timeout=datetime.timedelta(seconds=120))
        run = os.environ.get("TORCHELASTIC_RUN_ID", "") + os.environ.get(
            "TORCHELASTIC_RESTART_COUNT", "")
        self.store = dist.PrefixStore(f"plt-fault/{run}/", base)
        self.lock = threading.Lock()

    def set(self, key: str, value: str) -> None:
        with self.lock:
            self.store.set(key, value)

    def get(self, key: str) -> str | None:
        with self.lock:
            if not self.store.check([key]):
                return None
            return self.store.get(key).decode()

    def wait_key(self, key: str, timeout_s: float = 60.0) -> str:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            value = self.get(key)
            if value is not None:
                return value
            time.sleep(0.02)
        raise TimeoutError(f"[rank {RANK}] test flag {key!r} not set within {timeout_s} s")

    def barrier(self, name: str, ranks: list[int], timeout_s: float = 120.0) -> None:
        if len(ranks) <= 1:
            return
        with self.lock:
            self.store.add(f"barrier/{name}", 1)
        deadline = time.monotonic() + timeout_s
        while True:
            with self.lock:
                if int(self.store.add(f"barrier/{name}", 0)) >= len(ranks):
                    return
            if time.monotonic() > deadline:
                raise TimeoutError(f"[rank {RANK}] test barrier {name} timed out")
            time.sleep(0.02)


SYNC = Sync()
_STEP: dict[str, Any] = {}  # the step running now (read by the hooks)
_ORIGINAL_SAFE_OPEN = safetensors.safe_open


def _hook_safe_open() -> None:
    """Wrap ``safe_open`` wherever it is bound by name: record opens, apply ``on_open``."""
    original = _ORIGINAL_SAFE_OPEN

    def safe_open(filename: Any, *args: Any, **kwargs: Any) -> Any:
        step = dict(_STEP)
        _STEP.setdefault("opened", []).append(os.path.basename(str(filename)))
        action = step.get("on_open")
        if action and _repo_dir(step["repo"]) in str(filename):
            if action == "kill":
                SYNC.set(f"dying/{step['name']}", str(os.getpid()))
                os.kill(os.getpid(), signal.SIGKILL)
            if action == "MemoryError":
                raise MemoryError(f"injected: cannot allocate the tensors of {filename}")
        return original(filename, *args, **kwargs)

    for module in list(sys.modules.values()):
        if module is not None and getattr(module, "safe_open", None) is original:
            module.safe_open = safe_open


def _repo_dir(repo: str) -> str:
    return "models--" + repo.replace("/", "--")


def _hook_publish() -> None:
    original = coordinate.publish

    def publish(call: Any, outcome: dict[str, Any]) -> None:
        original(call, outcome)
        step = dict(_STEP)
        if (step.get("kill_after_publish") and outcome.get("ok")
                and repr(step["repo"]) in call.what and "from_pretrained" in call.what):
            SYNC.wait_key(f"returned/{step['name']}/{step['attached_rank']}", 60.0)
            SYNC.set(f"dying/{step['name']}", str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)

    coordinate.publish = publish


def _hook_broadcast() -> None:
    """Apply ``kill_in_broadcast`` and ``raise_in_broadcast`` (a ``MemoryError``, not a
    transport error): wrap the collective transport's one-operation runner."""
    original = collective._run

    def run(group: Any, action: str, started: float, launch: Any) -> None:
        kill = _STEP.get("kill_in_broadcast")
        if (kill and int(kill["rank"]) == RANK
                and action.startswith(f"broadcast of bucket {kill['bucket']}/")):
            SYNC.set(f"dying/{_STEP['name']}", str(os.getpid()))
            os.kill(os.getpid(), signal.SIGKILL)
        fail = _STEP.get("raise_in_broadcast")
        if (fail and int(fail["rank"]) == RANK
                and action.startswith(f"broadcast of bucket {fail['bucket']}/")):
            raise MemoryError(f"injected: cannot receive bucket {fail['bucket']}")
        original(group, action, started, launch)

    collective._run = run


class _FullDisk:
    """A file whose writes fail with ``ENOSPC`` once ``limit`` bytes are in it."""

    def __init__(self, inner: Any, path: Path, limit: int) -> None:
        self._inner, self._path, self._left = inner, path, limit

    def write(self, data: Any) -> int:
        if len(data) > self._left:
            self._inner.write(bytes(data[:self._left]))
            self._inner.flush()
            self._left = 0
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self._path))
        self._left -= len(data)
        return self._inner.write(data)

    def __enter__(self) -> _FullDisk:
        return self

    def __exit__(self, *exc: Any) -> None:
        self._inner.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)


@contextlib.contextmanager
def _faults_for(step: dict[str, Any]) -> Any:
    """Install the step's ``env``, ``flock`` and ``enospc`` faults in this rank for the call."""
    restore: list[Any] = []
    if step.get("env"):
        _state.set_active(True, load_config({**os.environ, **step["env"]}))
        restore.append(lambda: _state.set_active(True, load_config()))
    kind = step.get("flock")
    if kind:
        original_flock = fcntl.flock

        def flock(fd: Any, operation: int) -> None:
            if kind == "enosys":
                raise OSError(errno.ENOSYS, os.strerror(errno.ENOSYS))

        fcntl.flock = flock
        restore.append(lambda: setattr(fcntl, "flock", original_flock))
    full = step.get("enospc")
    if full and int(full["rank"]) == RANK:
        original_open = Path.open
        root = str(step["kwargs"]["cache_dir"])

        def open_(self: Path, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
            handle = original_open(self, mode, *args, **kwargs)
            if str(self).startswith(root) and self.name.endswith(".incomplete") and "w" in mode:
                return _FullDisk(handle, self, int(full["after_bytes"]))
            return handle

        Path.open = open_  # type: ignore[method-assign]
        restore.append(lambda: setattr(Path, "open", original_open))
    try:
        yield
    finally:
        for undo in reversed(restore):
            undo()


def _dtype(kwargs: dict[str, Any]) -> dict[str, Any]:
    out = dict(kwargs)
    if isinstance(out.get("dtype"), str) and out["dtype"] != "auto":
        out["dtype"] = getattr(torch, out["dtype"])
    return out


def check_weights(model: Any, folder: str) -> dict[str, Any]:
    """Compare every checkpoint tensor with the model's, bitwise, after the model's dtype
    conversion. Returns ``{"checked": n, "mismatched": [names]}``."""
    expected: dict[str, torch.Tensor] = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        expected.update(safetensors.torch.load(path.read_bytes()))
    state = model.state_dict()
    mismatched = [name for name, tensor in expected.items()
                  if name not in state or not torch.equal(state[name],
                                                          tensor.to(state[name].dtype))]
    # Forward pass: the weights are usable (mapped pages readable), not just comparable.
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([[1, 5, 9, 2]])).logits
    return {"checked": len(expected), "mismatched": mismatched,
            "finite": bool(torch.isfinite(logits).all())}


def _truncate_cached(repo: str) -> list[str]:
    from huggingface_hub import constants

    done = []
    root = Path(constants.HF_HUB_CACHE) / _repo_dir(repo) / "snapshots"
    for link in root.glob("*/*.safetensors"):
        blob = link.resolve()
        size = blob.stat().st_size
        os.truncate(blob, size // 2)
        # Skipped by the suite's final cache check (tests/_leftovers.py).
        blob.with_name(blob.name + ".damaged-on-purpose").touch()
        done.append(f"{link.name}: {size} -> {size // 2}")
    return done


def _wait_dead(pid: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.02)
    raise TimeoutError(f"[rank {RANK}] pid {pid} still alive after {timeout_s} s")


def _call(step: dict[str, Any], repos: dict[str, str]) -> Any:
    kwargs = _dtype(step.get("kwargs", {}))
    if step.get("call", "model") == "download":
        from huggingface_hub import hf_hub_download

        return hf_hub_download(step["repo"], step["filename"], **kwargs)
    return AutoModelForCausalLM.from_pretrained(step["repo"], **kwargs)


def _resources() -> dict[str, int]:
    gc.collect()
    proc = psutil.Process()
    links = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own fd is gone by now
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
    return {"fds": len(links), "threads": proc.num_threads(), "rss": proc.memory_info().rss,
            "memfds": sum(link.startswith("/memfd:patchload") for link in links),
            "python_threads": sorted(t.name for t in threading.enumerate())}


def _settle_threads(timeout_s: float = 5.0) -> None:
    """Wait (bounded) for patchload's background threads to end, as each does on its own once
    it has nothing to watch (the heartbeat, the leader's blob watcher, the leader watch, within
    their polling periods): a thread that never ends is still counted."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(
            t.name in ("patchload-heartbeat", "patchload-shares", "patchload-leader-watch",
                       "patchload-key-reaper")
            for t in threading.enumerate()):
        time.sleep(0.05)


def _threads(step: dict[str, Any], repos: dict[str, str], record: dict[str, Any]) -> None:
    results: list[dict[str, Any]] = [{"ok": False, "error": "did not finish"} for _ in range(3)]
    start = threading.Barrier(3)

    def run(i: int) -> None:
        start.wait()
        result = attempt(lambda: AutoModelForCausalLM.from_pretrained(step["repo"]))
        if result["ok"]:
            results[i] = {"ok": True, "weights": check_weights(result["value"],
                                                              repos[step["repo"]])}
        else:
            results[i] = {"ok": False, "error": result["error"]}

    threads = [threading.Thread(target=run, args=(i,), name=f"loader-{i}") for i in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    record["threads"] = results
    record["ok"] = all(r["ok"] for r in results)


def _loop(step: dict[str, Any], repos: dict[str, str], record: dict[str, Any]) -> None:
    samples = [_resources()]
    checks = []
    for i in range(int(step["loops"])):
        kwargs = {"dtype": torch.bfloat16} if i % 2 else {}
        model = AutoModelForCausalLM.from_pretrained(step["repo"], **kwargs)
        checks.append(check_weights(model, repos[step["repo"]]))
        del model
        if i == int(step["loops"]) - 1:  # the last sample: what the loads left behind
            _settle_threads()
        samples.append(_resources())
    record["samples"] = samples
    record["mismatched"] = sum(len(c["mismatched"]) for c in checks)
    record["ok"] = True


def attempt(fn: Any) -> dict[str, Any]:
    """``_common.attempt`` plus the traceback of a failure."""
    start = time.monotonic()
    try:
        value = fn()
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        error = _common.error_info(exc, start)
        error["traceback"] = traceback.format_exc()[-6000:]
        return {"ok": False, "error": error}
    return {"ok": True, "value": value, "elapsed_s": time.monotonic() - start}


def run_step(step: dict[str, Any], repos: dict[str, str], report: dict[str, Any]) -> None:
    name = step["name"]
    ranks = step.get("ranks", list(range(WORLD_SIZE)))
    if RANK == step.get("exits_first"):  # gone with status 0 before it made any call
        _common.write_report(report)
        os._exit(0)
    if RANK not in ranks:
        return
    SYNC.barrier(f"{name}/start", ranks)
    record: dict[str, Any] = {"pid": os.getpid()}
    report["steps"][name] = record
    kind = {"threads": _threads, "loop": _loop}.get(step.get("kind", ""))
    if kind is not None:
        record["t_call"] = time.time()
        kind(step, repos, record)
        record["t_end"] = time.time()
        _common.write_report(report)
        SYNC.barrier(f"{name}/end", ranks)
        return
    _STEP.clear()
    _STEP.update(step)
    if step.get("truncate_cached"):
        if RANK == ranks[0]:
            record["truncated"] = _truncate_cached(step["repo"])
        SYNC.barrier(f"{name}/end", ranks)
        return
    gate = step.get("gate")
    if gate:
        if RANK == 0:
            (Path(gate["dir"]) / f"job-{os.environ['MASTER_PORT']}").touch()
        deadline = time.monotonic() + 120
        while len(list(Path(gate["dir"]).iterdir())) < int(gate["count"]):
            if time.monotonic() > deadline:
                raise TimeoutError(f"[rank {RANK}] gate {gate} not reached")
            time.sleep(0.02)
    leader = step.get("leader")
    if leader is not None:
        if RANK == leader:
            SYNC.set(f"calling/{name}", "1")
        else:
            if step.get("remote_leader"):  # as if on another node: its pid cannot be watched
                coordinate.process_alive = lambda node, pid: True
            SYNC.wait_key(f"calling/{name}")
            time.sleep(0.5)
    if RANK == step.get("late_rank"):
        _wait_dead(int(SYNC.wait_key(f"dying/{name}")))
        record["called_after_leader_died"] = True
    time.sleep(float(step.get("delay_s", {}).get(str(RANK), 0.0)))
    if step.get("init_pg_timeout_s") and not dist.is_initialized():
        dist.init_process_group("gloo", timeout=datetime.timedelta(
            seconds=float(step["init_pg_timeout_s"])))
    if step.get("inspect_cache") and RANK == ranks[0]:
        cache = Path(step["kwargs"]["cache_dir"])
        record["cache_before"] = sorted(str(p.relative_to(cache)) for p in cache.rglob("*")
                                        if p.is_file() or p.is_symlink())
    kill = step.get("self_kill")
    if kill and int(kill["rank"]) == RANK:
        threading.Timer(float(kill["after_s"]), os.kill, (os.getpid(), signal.SIGKILL)).start()
    record["t_call"] = time.time()
    with _faults_for(step):
        result = attempt(lambda: _call(step, repos))
    record["t_end"] = time.time()
    SYNC.set(f"returned/{name}/{RANK}", "1")
    record["opened"] = list(_STEP.get("opened", []))
    if result["ok"]:
        record["ok"] = True
        record["elapsed_s"] = result["elapsed_s"]
        value = result["value"]
        if not isinstance(value, str):
            if step.get("wait_leader_dead"):  # use the weights after the leader is gone
                _wait_dead(int(SYNC.wait_key(f"dying/{name}")))
                record["used_after_leader_died"] = True
            record["weights"] = check_weights(value, repos[step["repo"]])
            del value
    else:
        record["ok"] = False
        record["error"] = result["error"]
        record["elapsed_s"] = result["error"]["elapsed_s"]
    result = None
    if step.get("init_pg_timeout_s"):
        total = torch.ones(1)
        dist.all_reduce(total)
        dist.barrier()
        record["all_reduce"] = float(total)
    _common.write_report(report)
    SYNC.barrier(f"{name}/end", [r for r in ranks if r not in step.get("dies", [])])


def body(report: dict[str, Any]) -> None:
    plan = json.loads(Path(sys.argv[1]).read_text())
    _hook_safe_open()
    _hook_publish()
    _hook_broadcast()
    report["installed"] = patchload.is_installed()
    for step in plan["steps"]:
        run_step(step, plan["repos"], report)
        _common.write_report(report)
    report["t_done"] = time.time()  # then the process exits (atexit hooks run)


if __name__ == "__main__":
    _common.main(body)
