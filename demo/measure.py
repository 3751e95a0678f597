"""Measurement shared by the demo (``demo/run.py``) and the benchmark (``benchmarks/bench_load.py``).

* :class:`MemorySampler`: node memory in use (``MemTotal - MemAvailable`` from ``/proc/meminfo``)
  sampled every 50 ms in a thread; peaks over a time window, relative to a baseline.
* :func:`serve`: a :class:`patchload.testing.LoopbackHub` in this process with a request log.
* :func:`torchrun`: launches ``torchrun --standalone --nproc_per_node N script ...`` on a cold
  cache with ``demo/site/sitecustomize.py`` injected (per-rank hub origin, checkpoint bytes read,
  ``from_pretrained`` timing), under a hard timeout.
* :func:`hub_figures`, :func:`rank_figures`, :func:`results`: read back what a run produced.
* :func:`markdown_table`.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

REPO_ROOT = Path(__file__).resolve().parent.parent
SITE_DIR = Path(__file__).resolve().parent / "site"
_RESULT_RE = re.compile(r"RESULT (?=\{)")


# ------------------------------------------------------------------------------------------------
# Node memory
# ------------------------------------------------------------------------------------------------


def node_memory_used() -> int:
    """``MemTotal - MemAvailable`` in bytes: memory in use on this node, page cache excluded."""
    fields = {}
    with open("/proc/meminfo") as f:
        for line in f:
            name, value = line.split(":", 1)
            fields[name] = int(value.split()[0]) * 1024
    return fields["MemTotal"] - fields["MemAvailable"]


class MemorySampler:
    """Samples :func:`node_memory_used` every ``period_s`` seconds in a daemon thread."""

    def __init__(self, period_s: float = 0.05) -> None:
        self.period_s = period_s
        self.samples: list[tuple[float, int]] = []  # (time.time(), bytes)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="mem-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append((time.time(), node_memory_used()))
            self._stop.wait(self.period_s)

    def __enter__(self) -> MemorySampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def at(self, when: float) -> int:
        """The last sample taken at or before ``when`` (the first sample if none)."""
        best = self.samples[0][1]
        for t, used in self.samples:
            if t > when:
                break
            best = used
        return best

    def peak(self, start: float | None = None, end: float | None = None) -> int:
        """Largest sample in ``[start, end]`` (seconds since the epoch; open ends allowed)."""
        window = [u for t, u in self.samples
                  if (start is None or t >= start) and (end is None or t <= end)]
        return max(window) if window else 0


# ------------------------------------------------------------------------------------------------
# Hub
# ------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def serve(repos: dict[str, Path], log_path: Path, *, repo_type: str = "model") -> Iterator[Any]:
    """Serve ``repos`` (repo id -> folder, all of ``repo_type``: ``"model"``, ``"dataset"``) from
    a LoopbackHub in this process; yields the hub."""
    from patchload.testing.hub import LoopbackHub

    log_path.unlink(missing_ok=True)
    hub = LoopbackHub(log_path=log_path)
    for repo_id, folder in repos.items():
        hub.add_repo(repo_id, folder, repo_type=repo_type)
    hub.start()
    try:
        yield hub
    finally:
        hub.close()


def hub_figures(log_path: Path, since: float = 0.0) -> dict[str, Any]:
    """Requests and body bytes per rank (``None``: requests without a rank) from a hub log."""
    from patchload.testing.hub import read_request_log

    per_rank: dict[Any, dict[str, int]] = {}
    for req in read_request_log(log_path):
        if req.time < since:
            continue
        entry = per_rank.setdefault(req.rank, {"requests": 0, "bytes": 0})
        entry["requests"] += 1
        entry["bytes"] += req.bytes_sent
    return per_rank


# ------------------------------------------------------------------------------------------------
# Launch
# ------------------------------------------------------------------------------------------------


@dataclass
class Run:
    """One torchrun launch and what it left behind."""

    label: str
    nproc: int
    returncode: int
    output: str
    launched_at: float
    ended_at: float
    measure_dir: Path
    baseline_bytes: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def wall_s(self) -> float:
        return self.ended_at - self.launched_at


def run_env(*, endpoint: str, hf_home: Path, measure_dir: Path, patchload_on: bool,
            extra: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of a measured run: cold ``HF_HOME``, the loopback hub, the measurement
    ``sitecustomize`` on ``PYTHONPATH``, ``PATCHLOAD=0/1``."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("HF_", "PATCHLOAD", "TRANSFORMERS_", "HUGGINGFACE_"))}
    env.update({
        "HF_HOME": str(hf_home),
        "HF_ENDPOINT": endpoint,
        "HF_HUB_DISABLE_XET": "1",
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_PROGRESS_BARS": "1",
        "TRANSFORMERS_VERBOSITY": "error",
        "TOKENIZERS_PARALLELISM": "false",
        "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
        "PATCHLOAD": "1" if patchload_on else "0",
        "PATCHLOAD_MEASURE_DIR": str(measure_dir),
        "PYTHONPATH": os.pathsep.join([str(SITE_DIR), str(REPO_ROOT)]
                                      + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])),
    })
    env.update(extra or {})
    return env


def release_when_imported(sync: Path, nproc: int, hub: Any,
                          marks: dict[str, float]) -> Callable[[Any, float], None]:
    """A ``during`` callback for :func:`torchrun`: once every rank wrote ``<sync>/imported-<r>``
    it records the node's memory (``marks["baseline"]``, bytes) and the time
    (``marks["go"]``, seconds since the epoch), clears the hub's request log and writes
    ``<sync>/go``, which the ranks wait for. Returns without releasing if the job ends or the
    deadline (seconds since the epoch) passes first."""
    def release(proc: Any, deadline: float) -> None:
        imported = [sync / f"imported-{r}" for r in range(nproc)]
        while not all(p.exists() for p in imported):
            if proc.poll() is not None or time.time() > deadline:
                return
            time.sleep(0.01)
        time.sleep(0.3)  # let the last imports' memory settle
        marks["baseline"] = node_memory_used()
        marks["go"] = time.time()
        hub.clear_requests()
        (sync / "go").write_text("go")

    return release


def torchrun(label: str, script: Path, args: Sequence[str], *, nproc: int, env: dict[str, str],
             measure_dir: Path, timeout_s: float, sampler: MemorySampler | None = None,
             echo: bool = False,
             during: Callable[[subprocess.Popen, float], None] | None = None,
             wrapper: Sequence[str] = ()) -> Run:
    """Run ``torchrun --standalone --nproc_per_node nproc script args`` under a hard timeout.

    Args:
        wrapper: words put before the command (e.g. a shell that moves itself into a cgroup,
            then execs the rest).
        during: called in this thread right after the launch with the process and the deadline
            (``time.time()`` seconds); it must return by then (e.g. to release the ranks from a
            file barrier after taking a memory baseline).

    The whole process group is killed when ``timeout_s`` (seconds) passes; the run then has
    return code -9 and its output so far.
    """
    measure_dir.mkdir(parents=True, exist_ok=True)
    cmd = [*wrapper, sys.executable, "-m", "torch.distributed.run", "--standalone",
           f"--nproc_per_node={nproc}", str(script), *args]
    baseline = node_memory_used()
    launched = time.time()
    proc = subprocess.Popen(cmd, env=env, cwd=REPO_ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[str] = []

    def _pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if echo:
                sys.stdout.write(f"    [{label}] {line}")
                sys.stdout.flush()

    pump = threading.Thread(target=_pump, daemon=True)
    pump.start()
    try:
        if during is not None:
            during(proc, launched + timeout_s)
        rc = proc.wait(timeout=max(0.1, launched + timeout_s - time.time()))
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        rc = proc.wait()
        lines.append(f"\n[measure] killed after {timeout_s:.0f} s timeout\n")
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        raise
    pump.join(timeout=5)
    return Run(label, nproc, rc, "".join(lines), launched, time.time(), measure_dir,
               baseline_bytes=baseline)


def results(run: Run) -> dict[int, dict[str, Any]]:
    """The ``RESULT {json}`` line of each rank, by rank."""
    out = {}
    decoder = json.JSONDecoder()
    for match in _RESULT_RE.finditer(run.output):  # ranks share one pipe: lines may abut
        try:
            data, _ = decoder.raw_decode(run.output, match.end())
        except json.JSONDecodeError:
            continue
        if isinstance(data, dict) and "rank" in data:
            out[int(data["rank"])] = data
    return out


def rank_figures(run: Run) -> dict[int, dict[str, Any]]:
    """What ``demo/site/sitecustomize.py`` wrote for each rank, by rank."""
    out = {}
    for path in sorted(run.measure_dir.glob("rank-*.json")):
        data = json.loads(path.read_text())
        out[int(data["rank"])] = data
    return out


def model_ready_at(figures: dict[str, Any]) -> float | None:
    """When the rank's last top-level ``from_pretrained`` of a model returned (epoch seconds)."""
    calls = figures.get("from_pretrained") or []
    return calls[-1]["returned_at"] if calls else None


def joined_baseline(run: Run, figures: dict[int, dict[str, Any]], sampler: MemorySampler
                    ) -> tuple[int, str]:
    """The memory baseline of a run, in bytes, and what it is.

    The node memory at the moment the last rank's ``init_process_group`` returned (every rank has
    imported its libraries and joined) when all ranks recorded it, else the value just before
    torchrun started.
    """
    joined = [f.get("process_group_ready_at") for f in figures.values()]
    if figures and len(figures) == run.nproc and all(joined):
        return sampler.at(max(joined)), "joined"
    return run.baseline_bytes, "pre-launch"


# ------------------------------------------------------------------------------------------------
# Output
# ------------------------------------------------------------------------------------------------


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    """A GitHub markdown table."""
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |" for row in cells]
    lines.insert(1, "| " + " | ".join("-" * w for w in widths) + " |")
    return "\n".join(lines)
