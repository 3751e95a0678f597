"""Helpers of the fault-injection tests (tests/test_faults.py, benchmarks/fault_table.py).

A fault job is a set of real rank processes running ``tests/workers/fault_steps.py`` on a plan
(a list of steps, each with its own injected fault; see that worker's docstring), against a
:class:`LoopbackHub` whose faults are attached to dedicated repo ids. Two launchers:

* :func:`run_plan_torchrun`: ``python -m torch.distributed.run`` (the agent store);
* :func:`run_plan_plain`: plain processes with torchrun's variables set by hand and a
  ``TCPStore`` hosted here (``TORCHELASTIC_USE_AGENT_STORE=True``), for cases that SIGKILL a rank
  on purpose (torchrun's agent would tear the whole group down) or start ranks with fewer
  capabilities.

Every job has a hard deadline: leftovers are SIGKILLed and the test fails with their output.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable, Sequence

from _launch import (WORKERS, Job, _read_reports, _wait_all, free_port, job_env,
                     plain_rank_env, run_torchrun)
from _launch import gets_per_file  # noqa: F401 - re-exported for the tests
from patchload.testing import LoopbackHub

# Repo ids served by the fault hub: (id, folder kind). Each step of a plan touches its own id so
# that its faults and its request-log window are its own.
LLAMA_IDS = ("f/ok", "f/abort-once", "f/reset", "f/stall", "f/memerr", "f/kill-read",
             "f/kill-published", "f/kill-follower", "f/kill-remote", "f/slow", "f/corrupt-cache", "f/stale-lock",
             "f/readonly", "f/pg-timeout", "f/threads", "f/loop", "f/shared-home",
             "f/enospc", "f/enospc-injected", "f/flock-enosys", "f/flock-noop", "f/bcast",
             "f/bcast-kill-follower", "f/bcast-kill-leader", "f/bcast-kill-waiting",
             "f/bcast-raise-follower", "f/rank0-gone")
SHARDED_IDS = ("f/shard404", "f/sharded")


def make_folders(root: Path) -> dict[str, Path]:
    """Write the tiny repos once: ``llama`` (one 70 KB fp32 file), ``sharded`` (20 KB shards)."""
    from patchload.testing import models

    llama = models.tiny_llama(root / "llama", with_tokenizer=False, seed=11)
    sharded = models.tiny_llama(root / "sharded", with_tokenizer=False, max_shard_size="20KB",
                                seed=12)
    return {**{r: llama for r in LLAMA_IDS}, **{r: sharded for r in SHARDED_IDS}}


def start_hub(folders: dict[str, Path], log: Path) -> LoopbackHub:
    hub = LoopbackHub(log_path=log)
    hub.start()
    for repo_id, folder in folders.items():
        hub.add_repo(repo_id, folder)
    return hub


def write_plan(out_dir: Path, folders: dict[str, Path], steps: list[dict[str, Any]]) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    plan = out_dir / "plan.json"
    plan.write_text(json.dumps({"repos": {k: str(v) for k, v in folders.items()},
                                "steps": steps}, indent=1))
    return plan


def run_plan_torchrun(hub: LoopbackHub, folders: dict[str, Path], steps: list[dict[str, Any]],
                      *, root: Path, nproc: int, timeout_s: float, hf_home: Path | None = None,
                      **env: str) -> Job:
    """Run the plan under torchrun (``nproc`` ranks, one node)."""
    out = root / "out"
    plan = write_plan(out, folders, steps)
    job_vars = job_env(hub.endpoint, hf_home or root / "hf", out, **env)
    return run_torchrun(hub, "fault_steps", [str(plan)], nproc=nproc, env=job_vars,
                        timeout_s=timeout_s)


def run_plan_plain(hub: LoopbackHub, folders: dict[str, Path], steps: list[dict[str, Any]], *,
                   root: Path, world_size: int, timeout_s: float, hf_home: Path | None = None,
                   preexec_fn: Callable[[], None] | None = None, **env: str) -> Job:
    """Run the plan as ``world_size`` plain processes around a TCPStore hosted here.

    Args:
        preexec_fn: run in each rank's process before it execs (e.g. to drop capabilities).
    """
    import torch.distributed as dist

    out = root / "out"
    plan = write_plan(out, folders, steps)
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, world_size=-1, is_master=True,
                          wait_for_workers=False)
    base = job_env(hub.endpoint, hf_home or root / "hf", out, **env)
    t0 = time.time()
    start = time.monotonic()
    procs, logs = [], []
    for rank in range(world_size):
        rank_env = plain_rank_env(base, rank, world_size, port, run_id=f"fault-{port}")
        log = out / f"rank-{rank}.log"
        with open(log, "wb") as handle:
            procs.append(subprocess.Popen(
                [sys.executable, str(WORKERS / "fault_steps.py"), str(plan)], env=rank_env,
                stdout=handle, stderr=subprocess.STDOUT, cwd=out, start_new_session=True,
                preexec_fn=preexec_fn))
        logs.append(log)
    exited_at: dict[int, float] = {}
    try:
        while len(exited_at) < len(procs) and time.monotonic() < start + timeout_s:
            for rank, proc in enumerate(procs):
                if rank not in exited_at and proc.poll() is not None:
                    exited_at[rank] = time.time()
            time.sleep(0.05)
        returncodes, outputs = _wait_all(procs, logs, start + timeout_s)
    finally:
        del store
    requests = [r for r in hub.requests(settle_s=1.0) if r.time >= t0]
    return Job(returncodes, outputs, time.monotonic() - start, _read_reports(out), requests, out,
               extra={"exited_at": exited_at})


def step_outcomes(job: Job, step: str) -> dict[int, str]:
    """``{rank: "ok" | error class name}`` for the ranks that reported ``step``."""
    out = {}
    for rank, report in sorted(job.ranks.items()):
        record = report.get("steps", {}).get(step)
        if record is None or "ok" not in record:
            continue
        out[rank] = "ok" if record["ok"] else record["error"]["type"]
    return out


def step_records(job: Job, step: str) -> dict[int, dict[str, Any]]:
    return {rank: report["steps"][step] for rank, report in sorted(job.ranks.items())
            if step in report.get("steps", {}) and "ok" in report["steps"][step]}


def step_span_s(job: Job, step: str) -> float:
    """Seconds from the first rank's call to the last rank's return, for ``step``."""
    records = step_records(job, step).values()
    return max(r["t_end"] for r in records) - min(r["t_call"] for r in records)


def gets(job: Job, repo: str, filename: str | None = None) -> list[Any]:
    """The job's GET requests for files of ``repo`` (all statuses, aborted ones included)."""
    return [r for r in job.requests if r.method == "GET" and r.repo_id == repo
            and r.filename is not None and (filename is None or r.filename == filename)]


def describe(job: Job, steps: Sequence[str] = ()) -> str:
    lines = [job.describe()]
    for name in steps:
        lines.append(f"{name}: {json.dumps(step_records(job, name), default=str)[:3000]}")
    return "\n".join(lines)
