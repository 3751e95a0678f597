"""Fault table: what each rank sees, and how fast, when something breaks during a load.

    .venv/bin/python benchmarks/fault_table.py            # prints one markdown table

Runs three jobs of ``tests/workers/fault_steps.py`` (the worker of ``tests/test_faults.py``)
against a loopback hub serving a tiny Llama, one fault per step:

* a torchrun job of 3 ranks (``PATCHLOAD_HEARTBEAT=1``, ``HF_HUB_DOWNLOAD_TIMEOUT=1``): hub faults
  on the leader, broken ``flock`` and a corrupt cache;
* 4 plain ranks around a TCPStore hosted here (``PATCHLOAD_TIMEOUT=4``, ``PATCHLOAD_HEARTBEAT=1``),
  so that a SIGKILLed rank leaves the others running (torchrun's agent would stop them all);
* 4 more plain ranks: a disk full under the leader, then the collective transport with a
  follower, then the leader, SIGKILLed mid-broadcast.

Columns: the fault; per rank, ``ok`` (weights checked bitwise against the checkpoint) or the
exception class it raised (``L`` marks the leader, ``killed`` a rank SIGKILLed on purpose); the
seconds from the first rank's call to the last rank's return.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import _faults as F  # noqa: E402
from patchload.testing import Fault  # noqa: E402

GET_MODEL = {"path": "model.safetensors", "method": "GET"}
FAULTS = (
    Fault(repo_id="f/shard404", path="model-00002-*", status=404),
    Fault(repo_id="f/abort-once", abort_after_bytes=30_000, times=1, **GET_MODEL),
    Fault(repo_id="f/reset", abort_after_bytes=30_000, times=1, **GET_MODEL),
    Fault(repo_id="f/reset", abort_after_bytes=0, **GET_MODEL),
    Fault(repo_id="f/stall", stall_s=120, **GET_MODEL),
    Fault(repo_id="f/slow", throttle_bytes_per_s=14_000, **GET_MODEL),
    Fault(repo_id="f/kill-follower", throttle_bytes_per_s=50_000, **GET_MODEL),
)

# (step, description of the fault) in table order.
HUB_STEPS = [
    ({"name": "shard404", "repo": "f/shard404", "leader": 0},
     "hub answers 404 for a shard named in the index"),
    ({"name": "abort_once", "repo": "f/abort-once", "leader": 0},
     "connection reset once mid-body (30 kB of 109 kB)"),
    ({"name": "reset", "repo": "f/reset", "leader": 0},
     "connection reset mid-body, then on every retry"),
    ({"name": "stall", "repo": "f/stall", "leader": 0},
     "body stalls 120 s, HF_HUB_DOWNLOAD_TIMEOUT=1"),
    ({"name": "memory_error", "repo": "f/memerr", "leader": 0, "on_open": "MemoryError"},
     "leader's checkpoint read raises MemoryError"),
    ({"name": "flock_enosys", "repo": "f/flock-enosys", "flock": "enosys"},
     "`flock` fails with ENOSYS on every rank"),
    ({"name": "flock_noop", "repo": "f/flock-noop", "flock": "noop"},
     "`flock` returns without locking on every rank"),
    ({"name": "cache_ok", "repo": "f/corrupt-cache"}, None),
    ({"name": "truncate", "repo": "f/corrupt-cache", "truncate_cached": True}, None),
    ({"name": "cache_corrupt", "repo": "f/corrupt-cache"},
     "cached safetensors file truncated to half"),
]
KILL_STEPS = [
    ({"name": "timeout", "repo": "f/slow", "leader": 0},
     "download of ~8 s, PATCHLOAD_TIMEOUT=4"),
    ({"name": "kill_published", "repo": "f/kill-published", "kwargs": {"dtype": "bfloat16"},
      "leader": 0, "kill_after_publish": True, "attached_rank": 1, "late_rank": 2,
      "wait_leader_dead": True, "dies": [0]},
     "leader SIGKILLed after publishing (rank 2 calls after its death)"),
    ({"name": "kill_follower", "repo": "f/kill-follower", "ranks": [1, 2, 3], "leader": 2,
      "self_kill": {"rank": 3, "after_s": 0.8}, "dies": [3]},
     "follower SIGKILLed while waiting"),
    ({"name": "kill_remote", "repo": "f/kill-remote", "ranks": [1, 2], "leader": 1,
      "remote_leader": True, "on_open": "kill", "dies": [1]},
     "leader on 'another host' SIGKILLed while reading (heartbeat only)"),
]

COLLECTIVE = {"PATCHLOAD_TRANSPORT": "collective", "PATCHLOAD_BUCKET_MB": "0.01"}


def _four_steps(cache_dir: Path) -> list[tuple[dict[str, Any], str | None]]:
    return [
        ({"name": "enospc", "repo": "f/enospc-injected", "leader": 0,
          "kwargs": {"cache_dir": str(cache_dir)}, "enospc": {"rank": 0, "after_bytes": 30_000}},
         "disk full (ENOSPC) while the leader writes the checkpoint's blob"),
        ({"name": "bcast_kill_follower", "repo": "f/bcast-kill-follower", "leader": 0,
          "env": COLLECTIVE, "kill_in_broadcast": {"rank": 3, "bucket": 2}, "dies": [3]},
         "collective transport: follower SIGKILLed while receiving"),
        ({"name": "bcast_kill_leader", "repo": "f/bcast-kill-leader", "ranks": [0, 1, 2],
          "leader": 0, "env": COLLECTIVE, "kill_in_broadcast": {"rank": 0, "bucket": 2},
          "dies": [0]},
         "collective transport: leader SIGKILLed while broadcasting (rank 3 already dead)"),
    ]


def _cell(job: Any, step: dict[str, Any], rank: int) -> str:
    record = job.ranks.get(rank, {}).get("steps", {}).get(step["name"])
    if record is None or "ok" not in record:
        return "killed" if rank in step.get("dies", []) else "-"
    if record["ok"]:
        weights = record.get("weights") or {}
        text = "ok" if weights.get("checked") and not weights.get("mismatched") else "WRONG"
        # A follower that read the checkpoint loaded on its own (the leader's weights were gone).
        own_load = step.get("leader") not in (None, rank) and record.get("opened")
        leader = bool(record.get("opened")) and not own_load
        text += " (own load from the cache)" if own_load else ""
    else:
        text = record["error"]["type"]
        leader = record["error"]["leader_rank"] is None
    return text + (" L" if leader else "")


def _rows(job: Any, steps: list[tuple[dict[str, Any], str | None]], world: int) -> list[str]:
    rows = []
    for step, what in steps:
        if what is None:
            continue
        cells = " · ".join(f"r{r}: {_cell(job, step, r)}" for r in range(world)
                           if r in step.get("ranks", range(world)))
        span = F.step_span_s(job, step["name"]) if F.step_records(job, step["name"]) else 0.0
        rows.append(f"| {what} | {cells} | {span:.1f} |")
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--keep", action="store_true", help="keep the work directory")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="patchload-faults-"))
    started = time.monotonic()
    try:
        folders = F.make_folders(root / "repos")
        hub = F.start_hub(folders, root / "requests.jsonl")
        for fault in FAULTS:
            hub.add_fault(fault)
        try:
            hub_job = F.run_plan_torchrun(
                hub, folders, [s for s, _ in HUB_STEPS], root=root / "hub", nproc=3,
                timeout_s=240, PATCHLOAD_TIMEOUT="60", PATCHLOAD_HEARTBEAT="1",
                HF_HUB_DOWNLOAD_TIMEOUT="1")
            kill_job = F.run_plan_plain(
                hub, folders, [s for s, _ in KILL_STEPS], root=root / "kill", world_size=4,
                timeout_s=240, PATCHLOAD_TIMEOUT="4", PATCHLOAD_HEARTBEAT="1")
            four_steps = _four_steps(root / "full-disk-cache")
            four_job = F.run_plan_plain(
                hub, folders, [s for s, _ in four_steps], root=root / "four", world_size=4,
                timeout_s=240, PATCHLOAD_TIMEOUT="60", PATCHLOAD_HEARTBEAT="1")
        finally:
            hub.close()
        lines = ["| fault | what each rank saw | seconds until every rank returned |",
                 "| --- | --- | ---: |"]
        lines += _rows(hub_job, HUB_STEPS, 3)
        lines += _rows(kill_job, KILL_STEPS, 4)
        lines += _rows(four_job, four_steps, 4)
        print("\n".join(lines))
        print(f"\n(3-rank torchrun job and two jobs of 4 plain ranks on {_cpus()} CPUs; whole run "
              f"{time.monotonic() - started:.0f} s)")
    finally:
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)
    return 0


def _cpus() -> int:
    import os

    return len(os.sched_getaffinity(0))


if __name__ == "__main__":
    sys.exit(main())
