"""Fault injection: every rank succeeds with correct weights, or all raise the same class, fast.

Real processes on CPU (gloo), a loopback hub with faults per repo id, one worker
(``tests/workers/fault_steps.py``) running a plan of steps per job, several cases per job to keep
the module under five minutes on two cores. Five jobs, each a module-scoped fixture run once:

* ``hub_job`` (torchrun, 3 ranks): hub faults on the leader (404 for an indexed shard, a
  connection reset mid-body once and for good, a body stalled past ``HF_HUB_DOWNLOAD_TIMEOUT``),
  a leader whose load raises ``MemoryError``, a stale lock and partial download in the cache, a
  truncated shard in the cache.
* ``kill_job`` (5 plain ranks around a TCPStore hosted here, so that killing one leaves the
  others running; no ``CAP_DAC_OVERRIDE``, so a 0555 directory stops root too): a read-only
  ``cache_dir``, ``PATCHLOAD_TIMEOUT`` shorter than the download, the leader SIGKILLed after
  publishing, a follower SIGKILLed while waiting, the leader SIGKILLed while reading the
  checkpoint (same host: pid watched; simulated other host: heartbeat only), and a retry from
  the cache the killed leader filled.
* ``shared_home`` (two torchrun jobs at once on one ``HF_HOME``): both load the same repos; one
  of them also runs a download longer than its process group's timeout and three loading
  threads per rank.
* ``four_ranks`` (4 plain ranks): a disk full (``ENOSPC``) under the leader, on a real small
  tmpfs where mounting is allowed and injected into the leader's writes everywhere, then a load
  into the same cache once there is room; 50 loads in a row watching file descriptors, memfds,
  threads and RSS; the collective transport with a follower, then the leader, SIGKILLed
  mid-broadcast.
* in-process checks of what patchload reads from the store and of the files it creates, and
  (as root) of what another user can reach of them.
"""

from __future__ import annotations

import ast
import concurrent.futures
import ctypes
import errno
import hashlib
import json
import os
import select
import shutil
import signal
import stat
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _faults as F  # noqa: E402
from _faults import Job, step_records  # noqa: E402
from patchload.testing import Fault  # noqa: E402

PATCHLOAD_SRC = Path(__file__).resolve().parents[1] / "patchload"

HEARTBEAT_S = 1.0
STALLED_DOWNLOAD_TIMEOUT_S = 1  # HF_HUB_DOWNLOAD_TIMEOUT in hub_job
# hub_job: huggingface_hub's pauses between its retries (1 s before resuming a broken download;
# its 1-8 s backoff) scaled by this (tests/workers/_common.py: shorten_hub_waits): the same
# retries and requests, less time asleep.
HUB_WAIT_SCALE = 0.1
KILL_JOB_TIMEOUT_S = 4.0  # PATCHLOAD_TIMEOUT in kill_job


# --- fixtures -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return F.make_folders(tmp_path_factory.mktemp("fault-repos"))


@pytest.fixture(scope="module")
def fault_hub(folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Any:
    hub = F.start_hub(folders, tmp_path_factory.mktemp("fault-hub") / "requests.jsonl")
    get_model = {"path": "model.safetensors", "method": "GET"}
    for fault in (
        Fault(repo_id="f/shard404", path="model-00002-*", status=404),
        # The leader fails only after its followers arrived (they inherit its failure; a rank
        # that arrives after a failed attempt makes one of its own).
        Fault(repo_id="f/enospc-injected", path="config.json", method="GET", stall_s=2.0,
              times=1),
        Fault(repo_id="f/abort-once", abort_after_bytes=30_000, times=1, **get_model),
        Fault(repo_id="f/reset", abort_after_bytes=30_000, times=1, **get_model),
        Fault(repo_id="f/reset", abort_after_bytes=0, **get_model),
        # Each attempt's body stalls 10 s, well past HF_HUB_DOWNLOAD_TIMEOUT (1 s): the client
        # gives up on every one; the hub's handler of each is done 10 s later (it was 120 s:
        # the later jobs on this hub then waited out their request-log settle on them).
        Fault(repo_id="f/stall", stall_s=10, **get_model),
        Fault(repo_id="f/slow", throttle_bytes_per_s=14_000, **get_model),  # ~8 s
        Fault(repo_id="f/kill-follower", throttle_bytes_per_s=50_000, **get_model),  # ~2 s
        Fault(repo_id="f/pg-timeout", throttle_bytes_per_s=10_000, **get_model),  # ~11 s
        Fault(repo_id="f/shared-home", throttle_bytes_per_s=50_000, **get_model),  # ~2 s
        Fault(repo_id="f/bcast-kill-waiting", throttle_bytes_per_s=35_000, **get_model),  # ~3 s
    ):
        hub.add_fault(fault)
    yield hub
    hub.close()


def _stale_cache(hf_home: Path, repo: str, folder: Path) -> dict[str, Path]:
    """What a download SIGKILLed mid-body leaves in the cache: its lock file and partial blobs
    (old and new ``huggingface_hub`` naming), here with garbage bytes."""
    data = (folder / "model.safetensors").read_bytes()
    etag = hashlib.sha256(data).hexdigest()  # the hub's ETag for a .safetensors (LFS) file
    name = "models--" + repo.replace("/", "--")
    lock = hf_home / "hub" / ".locks" / name / f"{etag}.lock"
    blobs = hf_home / "hub" / name / "blobs"
    partials = [blobs / f"{etag}.incomplete", blobs / f"{etag}.0badf00d.incomplete"]
    for path in (lock, *partials):
        path.parent.mkdir(parents=True, exist_ok=True)
    lock.write_bytes(b"")
    for partial in partials:
        partial.write_bytes(b"\xffgarbage from a killed download" * 100)
    return {"lock": lock, "blob": blobs / etag, "size": len(data)}


@pytest.fixture(scope="module")
def hub_job(fault_hub: Any, folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory,
            ) -> tuple[Job, dict[str, Path]]:
    root = tmp_path_factory.mktemp("hub-job")
    stale = _stale_cache(root / "hf", "f/stale-lock", folders["f/stale-lock"])
    steps = [
        {"name": "shard404", "repo": "f/shard404", "leader": 0},
        {"name": "abort_once", "repo": "f/abort-once", "leader": 0},
        {"name": "reset", "repo": "f/reset", "leader": 0},
        {"name": "stall", "repo": "f/stall", "leader": 0},
        {"name": "memory_error", "repo": "f/memerr", "leader": 0, "on_open": "MemoryError"},
        {"name": "stale_lock", "repo": "f/stale-lock"},
        {"name": "flock_enosys", "repo": "f/flock-enosys", "flock": "enosys"},
        {"name": "flock_noop", "repo": "f/flock-noop", "flock": "noop"},
        {"name": "cache_ok", "repo": "f/corrupt-cache"},
        {"name": "truncate", "repo": "f/corrupt-cache", "truncate_cached": True},
        {"name": "cache_corrupt", "repo": "f/corrupt-cache"},
    ]
    job = F.run_plan_torchrun(fault_hub, folders, steps, root=root, nproc=3, timeout_s=150,
                              PATCHLOAD_TIMEOUT="60", PATCHLOAD_HEARTBEAT=str(HEARTBEAT_S),
                              HF_HUB_DOWNLOAD_TIMEOUT=str(STALLED_DOWNLOAD_TIMEOUT_S),
                              PLT_HUB_WAIT_SCALE=str(HUB_WAIT_SCALE))
    job.check_ok()
    return job, stale


def _drop_dac_capabilities() -> None:
    """preexec_fn: drop CAP_DAC_OVERRIDE, CAP_DAC_READ_SEARCH and CAP_FOWNER from the bounding
    set, so that after exec even uid 0 obeys file modes (a 0555 directory is read-only)."""
    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2, 3):
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP) failed")


def _can_drop_capabilities() -> bool:
    probe = subprocess.run([sys.executable, "-c", "pass"], preexec_fn=_drop_dac_capabilities,
                           capture_output=True, timeout=60, check=False)
    return probe.returncode == 0


@pytest.fixture(scope="module")
def kill_job(fault_hub: Any, folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory,
             ) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("kill-job")
    read_only = root / "read-only-cache"
    read_only.mkdir()
    read_only.chmod(0o555)
    preexec = None
    readonly_skip = None
    if os.geteuid() == 0:
        if _can_drop_capabilities():
            preexec = _drop_dac_capabilities
        else:
            readonly_skip = "running as root without CAP_SETPCAP: a 0555 directory stops nobody"
    steps: list[dict[str, Any]] = []
    if readonly_skip is None:
        steps.append({"name": "read_only", "repo": "f/readonly", "leader": 0,
                      "kwargs": {"cache_dir": str(read_only)}})
    steps += [
        {"name": "timeout", "repo": "f/slow", "leader": 0},
        {"name": "kill_published", "repo": "f/kill-published", "kwargs": {"dtype": "bfloat16"},
         "leader": 0, "kill_after_publish": True, "attached_rank": 1, "late_rank": 2,
         "wait_leader_dead": True, "dies": [0]},
        {"name": "kill_follower", "repo": "f/kill-follower", "ranks": [1, 2, 3, 4], "leader": 2,
         "self_kill": {"rank": 4, "after_s": 0.8}, "dies": [4]},
        {"name": "kill_read", "repo": "f/kill-read", "ranks": [1, 2, 3], "leader": 1,
         "on_open": "kill", "dies": [1]},
        {"name": "kill_remote", "repo": "f/kill-remote", "ranks": [2, 3], "leader": 3,
         "remote_leader": True, "on_open": "kill", "dies": [3]},
        {"name": "retry", "repo": "f/kill-read", "ranks": [2]},
    ]
    job = F.run_plan_plain(fault_hub, folders, steps, root=root, world_size=5, timeout_s=150,
                           preexec_fn=preexec, PATCHLOAD_TIMEOUT=str(KILL_JOB_TIMEOUT_S),
                           PATCHLOAD_HEARTBEAT=str(HEARTBEAT_S),
                           # Steps name their leader (rank 0 is not in some): no grace for it.
                           PATCHLOAD_CLAIM_GRACE="0")
    return {"job": job, "readonly_skip": readonly_skip, "read_only": read_only}


@pytest.fixture(scope="module")
def shared_home(fault_hub: Any, folders: dict[str, Path],
                tmp_path_factory: pytest.TempPathFactory) -> list[Job]:
    root = tmp_path_factory.mktemp("shared-home")
    hf_home = root / "hf"
    gate = root / "gate"
    gate.mkdir()
    common = [
        {"name": "shared", "repo": "f/shared-home", "gate": {"dir": str(gate), "count": 2}},
        {"name": "pg_timeout", "repo": "f/pg-timeout", "init_pg_timeout_s": 5},
    ]
    plans = [
        (3, common + [{"name": "threads", "repo": "f/threads", "kind": "threads"}]),
        (2, common),
    ]
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(F.run_plan_torchrun, fault_hub, folders, steps,
                               root=root / f"job{i}", nproc=nproc, timeout_s=170,
                               hf_home=hf_home, PATCHLOAD_TIMEOUT="120",
                               PATCHLOAD_HEARTBEAT=str(HEARTBEAT_S))
                   for i, (nproc, steps) in enumerate(plans)]
        jobs = [f.result() for f in futures]
    for job in jobs:
        job.check_ok()
    return jobs


COLLECTIVE = {"PATCHLOAD_TRANSPORT": "collective", "PATCHLOAD_BUCKET_MB": "0.01"}  # 10 KiB buckets
TMPFS_BYTES = 32 * 1024  # fits the config files, not the 109 kB checkpoint
ENOSPC_AFTER_BYTES = 30_000


def _mount_small_tmpfs(path: Path) -> str | None:
    """Mount a ``TMPFS_BYTES`` tmpfs on ``path``; None, or why it cannot be done here."""
    if os.geteuid() != 0:
        return "not root: cannot mount a small tmpfs (the injected ENOSPC case still runs)"
    path.mkdir()
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES},mode=0755",
                               "tmpfs", str(path)], capture_output=True, text=True, timeout=30,
                              check=False)
    except OSError as err:  # no mount(8) here
        return f"cannot run mount ({err}): the injected ENOSPC case runs"
    if done.returncode != 0:
        return f"mount -t tmpfs failed ({done.stderr.strip()}): the injected ENOSPC case runs"
    return None


@pytest.fixture(scope="module")
def four_ranks(fault_hub: Any, folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory,
               ) -> Any:
    """4 plain ranks: a disk full under the leader (a real small tmpfs where mounting is
    allowed, and an injected ``ENOSPC`` everywhere), 50 loads in a row, then the collective
    transport with a follower raising its own error mid-broadcast, a follower, then the leader,
    SIGKILLed mid-broadcast."""
    root = tmp_path_factory.mktemp("four-ranks")
    tmpfs = root / "tmpfs-cache"
    tmpfs_skip = _mount_small_tmpfs(tmpfs)
    injected = root / "injected-cache"
    steps: list[dict[str, Any]] = []
    if tmpfs_skip is None:
        steps.append({"name": "enospc", "repo": "f/enospc", "leader": 0,
                      "kwargs": {"cache_dir": str(tmpfs)}})
    steps += [
        {"name": "enospc_injected", "repo": "f/enospc-injected", "leader": 0,
         "kwargs": {"cache_dir": str(injected)},
         "enospc": {"rank": 0, "after_bytes": ENOSPC_AFTER_BYTES}},
        {"name": "enospc_retry", "repo": "f/enospc-injected", "inspect_cache": True,
         "kwargs": {"cache_dir": str(injected)}},
        {"name": "loop", "repo": "f/loop", "kind": "loop", "loops": 50},
        {"name": "bcast", "repo": "f/bcast", "env": COLLECTIVE},
        # Its own error, not a transport's: it must not join the spent broadcast again.
        {"name": "bcast_raise_follower", "repo": "f/bcast-raise-follower", "leader": 0,
         "env": {**COLLECTIVE, "PATCHLOAD_GROUP_TIMEOUT": "20"},
         "raise_in_broadcast": {"rank": 2, "bucket": 2}},
        {"name": "bcast_kill_follower", "repo": "f/bcast-kill-follower", "leader": 0,
         "env": COLLECTIVE, "kill_in_broadcast": {"rank": 3, "bucket": 2}, "dies": [3]},
        {"name": "bcast_kill_leader", "repo": "f/bcast-kill-leader", "ranks": [0, 1, 2],
         "leader": 0, "env": COLLECTIVE, "kill_in_broadcast": {"rank": 0, "bucket": 2},
         "dies": [0]},
    ]
    try:
        job = F.run_plan_plain(fault_hub, folders, steps, root=root, world_size=4, timeout_s=200,
                               PATCHLOAD_TIMEOUT="60", PATCHLOAD_HEARTBEAT=str(HEARTBEAT_S))
        yield {"job": job, "tmpfs": tmpfs, "tmpfs_skip": tmpfs_skip, "injected": injected}
    finally:
        if tmpfs_skip is None:
            subprocess.run(["umount", "-l", str(tmpfs)], timeout=30, check=False)


@pytest.fixture(scope="module")
def collective_member_killed_waiting(fault_hub: Any, folders: dict[str, Path],
                                     tmp_path_factory: pytest.TempPathFactory) -> Job:
    """3 plain ranks, the collective transport: rank 2 SIGKILLs itself while it waits for the
    leader's (throttled, ~3 s) download."""
    steps = [{"name": "bcast_kill_waiting", "repo": "f/bcast-kill-waiting", "leader": 0,
              "env": COLLECTIVE, "self_kill": {"rank": 2, "after_s": 0.8}, "dies": [2]}]
    return F.run_plan_plain(fault_hub, folders, steps,
                            root=tmp_path_factory.mktemp("bcast-kill-waiting"), world_size=3,
                            timeout_s=120, PATCHLOAD_HEARTBEAT=str(HEARTBEAT_S))


# --- assertions ---------------------------------------------------------------------------------

def assert_weights_ok(record: dict[str, Any], what: str) -> None:
    assert record["ok"], f"{what}: {record.get('error')}"
    weights = record["weights"]
    assert weights["checked"] > 0 and not weights["mismatched"] and weights["finite"], \
        f"{what}: wrong weights {weights}"


def assert_same_failure(job: Job, step: str, ranks: list[int], *, leader: int,
                        within_s: float, cause: str | None = None) -> dict[int, dict[str, Any]]:
    """Every rank of ``step`` raised the leader's class and message; followers' notes name the
    leader rank (and ``cause``); the step's span is at most ``within_s`` seconds. A rank
    that arrived after the leader's attempt had failed made an attempt of its own, as its plain
    call would: it raised the same class and message itself."""
    records = step_records(job, step)
    assert sorted(records) == ranks, F.describe(job, [step])
    errors = {rank: rec.get("error") for rank, rec in records.items()}
    assert all(errors.values()), f"{step}: some rank succeeded: {errors}"
    assert len({e["type"] for e in errors.values()}) == 1, f"{step}: classes differ: {errors}"
    assert not errors[leader]["follower"], f"{step}: rank {leader} was not the leader: {errors}"
    leader_message = errors[leader]["message"]
    for rank, error in errors.items():
        if rank == leader:
            continue
        if not error["follower"]:  # its own attempt
            assert error["message"] == leader_message, (rank, error["message"], leader_message)
            continue
        # The leader's attempt, or that of a rank which arrived after it failed.
        followed = error["leader_rank"]
        assert followed in attempt_leaders(errors), error
        assert error["rank_attr"] == rank, error
        assert error["message"] == leader_message, (rank, error["message"], leader_message)
        assert any(f"leader rank {followed}" in note for note in error["notes"]), error
        if cause is not None:
            # in the leader's message, or where transformers' message hides it, in the note
            assert any(cause in text for text in [error["message"], *error["notes"]]), error
    assert F.step_span_s(job, step) <= within_s, \
        f"{step}: took {F.step_span_s(job, step):.1f} s > {within_s} s"
    return errors


def attempt_leaders(errors: dict[int, dict[str, Any]]) -> set[int]:
    """The ranks that led an attempt of a failed step (the rest followed one of them)."""
    return {rank for rank, error in errors.items() if not error["follower"]}


def assert_only_leader_requested(job: Job, repo: str, leader: int | set[int]) -> None:
    leaders = {leader} if isinstance(leader, int) else leader
    ranks = {r.rank for r in job.requests if r.repo_id == repo}
    assert ranks <= leaders, f"{repo}: requests from ranks {ranks}, expected only {leaders}"


# --- hub faults on the leader -----------------------------------------------------------------

@pytest.mark.timeout(240)
def test_404_for_a_shard_named_in_the_index(hub_job: tuple[Job, Any]) -> None:
    job, _ = hub_job
    errors = assert_same_failure(job, "shard404", [0, 1, 2], leader=0, within_s=10)
    assert errors[1]["isinstance"]["OSError"]
    assert_only_leader_requested(job, "f/shard404", attempt_leaders(errors))
    shard = [r for r in job.requests if r.repo_id == "f/shard404"
             and r.filename == "model-00002-of-00007.safetensors"]
    assert [r.status for r in shard] == [404] * len(attempt_leaders(errors)), shard


@pytest.mark.timeout(240)
def test_connection_reset_once_mid_body_is_resumed(hub_job: tuple[Job, Any]) -> None:
    job, _ = hub_job
    for rank, record in step_records(job, "abort_once").items():
        assert_weights_ok(record, f"rank {rank}")
    assert_only_leader_requested(job, "f/abort-once", 0)
    body = F.gets(job, "f/abort-once", "model.safetensors")
    # The cut GET, then one retry that completes.
    assert [r.bytes_sent for r in body] == [30_000, body[-1].bytes_sent] and \
        body[-1].bytes_sent > 30_000, body


@pytest.mark.timeout(240)
def test_connection_reset_for_good_fails_every_rank(hub_job: tuple[Job, Any]) -> None:
    job, _ = hub_job
    # huggingface_hub retries 5 times, 1 s apart (0.1 s here: HUB_WAIT_SCALE); followers learn
    # the outcome at once.
    errors = assert_same_failure(job, "reset", [0, 1, 2], leader=0, within_s=20,
                                 cause="RemoteProtocolError")
    assert_only_leader_requested(job, "f/reset", attempt_leaders(errors))


@pytest.mark.timeout(240)
def test_body_stalled_past_the_download_timeout(hub_job: tuple[Job, Any]) -> None:
    job, _ = hub_job
    # 6 attempts of (1 s read timeout + 1 s pause, 0.1 s here) instead of the 10 s stall each.
    errors = assert_same_failure(job, "stall", [0, 1, 2], leader=0, within_s=30,
                                 cause="Timeout")
    assert_only_leader_requested(job, "f/stall", attempt_leaders(errors))


@pytest.mark.timeout(240)
def test_leader_memory_error_reaches_followers_as_memory_error(hub_job: tuple[Job, Any]) -> None:
    job, _ = hub_job
    errors = assert_same_failure(job, "memory_error", [0, 1, 2], leader=0, within_s=5)
    for error in errors.values():
        assert "MemoryError" in error["mro"], error
    assert all(e["elapsed_s"] < 2 * HEARTBEAT_S + 2 for e in errors.values()), errors


@pytest.mark.timeout(240)
def test_stale_lock_and_partial_download_left_by_a_killed_process(
        hub_job: tuple[Job, dict[str, Path]]) -> None:
    job, stale = hub_job
    records = step_records(job, "stale_lock")
    assert sorted(records) == [0, 1, 2]
    for rank, record in records.items():
        assert_weights_ok(record, f"rank {rank}")
    assert stale["blob"].stat().st_size == stale["size"]
    assert len(F.gets(job, "f/stale-lock", "model.safetensors")) == 1


@pytest.mark.timeout(240)
def test_truncated_shard_in_the_cache_fails_every_rank_alike(hub_job: tuple[Job, Any]) -> None:
    job, _ = hub_job
    for rank, record in step_records(job, "cache_ok").items():
        assert_weights_ok(record, f"rank {rank}")
    errors = assert_same_failure(job, "cache_corrupt", [0, 1, 2], leader=0, within_s=5)
    assert errors[0]["type"] == "SafetensorError"
    # The leader read the truncated shard, and so did each rank that arrived after its attempt
    # failed (its own attempt, as its plain call would); no follower of an attempt read it.
    openers = {rank for rank, rec in step_records(job, "cache_corrupt").items()
               if rec.get("opened")}
    assert openers == attempt_leaders(errors), F.describe(job, ["cache_corrupt"])


# --- process, filesystem and timing faults (plain ranks) --------------------------------------

@pytest.mark.timeout(240)
def test_read_only_cache_dir(kill_job: dict[str, Any]) -> None:
    if kill_job["readonly_skip"]:
        print(f"SKIPPED read-only cache: {kill_job['readonly_skip']}")
        pytest.skip(kill_job["readonly_skip"])
    job = kill_job["job"]
    # transformers turns the leader's PermissionError into an OSError that does not say why;
    # followers name the root cause.
    errors = assert_same_failure(job, "read_only", [0, 1, 2, 3, 4], leader=0, within_s=10,
                                 cause="caused on the leader by PermissionError")
    assert all(e["isinstance"]["OSError"] for e in errors.values()), errors
    assert not any(kill_job["read_only"].iterdir())


@pytest.mark.timeout(240)
def test_timeout_shorter_than_the_download(kill_job: dict[str, Any]) -> None:
    job = kill_job["job"]
    records = step_records(job, "timeout")
    assert sorted(records) == [0, 1, 2, 3, 4], F.describe(job, ["timeout"])
    assert_weights_ok(records[0], "leader")
    assert records[0]["elapsed_s"] > KILL_JOB_TIMEOUT_S + 1  # the download really was longer
    for rank in (1, 2, 3, 4):
        error = records[rank]["error"]
        assert error["type"] == "PatchloadTimeout" and error["isinstance"]["TimeoutError"], error
        assert error["leader_rank"] == 0 and "leader rank 0" in error["message"], error
        assert "PATCHLOAD_TIMEOUT" in error["message"], error
        assert KILL_JOB_TIMEOUT_S - 0.5 <= error["elapsed_s"] <= KILL_JOB_TIMEOUT_S + 3, error
    assert_only_leader_requested(job, "f/slow", 0)


@pytest.mark.timeout(240)
def test_leader_killed_after_publishing(kill_job: dict[str, Any]) -> None:
    """Followers that attached keep working after the leader is gone; a follower that comes
    later cannot attach to the dead leader's blob and loads from the cache (with a warning)."""
    job = kill_job["job"]
    assert job.returncodes[0] == -9
    records = step_records(job, "kill_published")
    assert sorted(records) == [1, 2, 3, 4], F.describe(job, ["kill_published"])
    for rank, record in records.items():
        assert_weights_ok(record, f"rank {rank}")
        assert record["used_after_leader_died"]
    assert records[1]["opened"] == []  # took the leader's weights, read no checkpoint
    assert records[2]["called_after_leader_died"] and records[2]["opened"]
    assert "cannot attach to the tensors shared by pid" in job.outputs[2]
    assert_only_leader_requested(job, "f/kill-published", 0)


@pytest.mark.timeout(240)
def test_follower_killed_while_waiting(kill_job: dict[str, Any]) -> None:
    job = kill_job["job"]
    assert job.returncodes[4] == -9
    records = step_records(job, "kill_follower")
    assert sorted(records) == [1, 2, 3], F.describe(job, ["kill_follower"])
    for rank, record in records.items():
        assert_weights_ok(record, f"rank {rank}")
    assert records[2]["opened"] and not records[1]["opened"] and not records[3]["opened"]
    assert_only_leader_requested(job, "f/kill-follower", 2)
    # At exit the leader does not wait for the dead follower (a zombie until the test reaps it;
    # 60 s before) and waits for ranks that never came 5 s in all, not 5 s per shared blob.
    exit_delay_s = job.extra["exited_at"][2] - job.ranks[2]["t_done"]
    assert exit_delay_s < 12, f"rank 2 took {exit_delay_s:.1f} s to exit"


@pytest.mark.timeout(240)
def test_rank0_gone_before_its_first_call_is_not_waited_for(
        fault_hub: Any, folders: dict[str, Path], tmp_path: Path) -> None:
    """Rank 0 exits (status 0: torchrun lets the others go on) before it makes any call, so it
    never published a state or a pid; the others load at once, not after PATCHLOAD_CLAIM_GRACE
    (120 s) per call: it is not among the processes torchrun started on this node any more.
    One of them leads (its requests), the other follows, each with the checkpoint's weights."""
    steps = [{"name": "gone", "repo": "f/rank0-gone", "ranks": [1, 2], "exits_first": 0},
             {"name": "again", "repo": "f/ok", "ranks": [1, 2]}]
    job = F.run_plan_torchrun(fault_hub, folders, steps, root=tmp_path, nproc=3, timeout_s=200)
    assert job.returncodes == [0], "\n".join(job.outputs)
    for step in ("gone", "again"):
        records = step_records(job, step)
        assert sorted(records) == [1, 2], F.describe(job, [step])
        for rank, record in records.items():
            assert_weights_ok(record, f"rank {rank} {step}")
            assert record["elapsed_s"] < 30, (rank, step, record["elapsed_s"])
        opened = [rank for rank, record in records.items() if record["opened"]]
        assert len(opened) == 1, (step, opened)


@pytest.mark.timeout(240)
def test_leader_killed_while_reading_the_checkpoint(kill_job: dict[str, Any]) -> None:
    """Same host: followers watch the leader's pid and notice its death at once."""
    job = kill_job["job"]
    assert job.returncodes[1] == -9
    for rank in (2, 3):
        error = step_records(job, "kill_read")[rank]["error"]
        assert error["type"] == "LeaderFailedError" and error["leader_rank"] == 1, error
        assert "is gone" in error["message"] and "leader rank 1" in error["message"], error
        assert error["elapsed_s"] < 2, error


@pytest.mark.timeout(240)
def test_remote_leader_killed_is_noticed_by_its_heartbeat(kill_job: dict[str, Any]) -> None:
    """Another host (simulated): no pid to watch, the heartbeat stops; noticed after two
    ``PATCHLOAD_HEARTBEAT`` periods, not at ``PATCHLOAD_TIMEOUT``."""
    job = kill_job["job"]
    assert job.returncodes[3] == -9
    error = step_records(job, "kill_remote")[2]["error"]
    assert error["type"] == "LeaderFailedError" and error["leader_rank"] == 3, error
    assert "no heartbeat" in error["message"] and "leader rank 3" in error["message"], error
    assert 2 * HEARTBEAT_S <= error["elapsed_s"] <= 2 * HEARTBEAT_S + 3, error


@pytest.mark.timeout(240)
def test_cache_left_by_a_leader_killed_mid_load_still_serves(kill_job: dict[str, Any]) -> None:
    job = kill_job["job"]
    assert job.returncodes[2] == 0, job.describe()
    assert_weights_ok(step_records(job, "retry")[2], "retry")
    assert len(F.gets(job, "f/kill-read", "model.safetensors")) == 1


def _blob_state(hub_cache: Path, repo: str, folder: Path,
                files: list[str] | None = None) -> dict[str, Any]:
    """What the cache under ``hub_cache`` holds of ``repo``'s ``model.safetensors``: the complete
    blob (its size and sha256, or None), leftover partial files, snapshot links to it. With
    ``files`` (paths relative to ``hub_cache``, listed earlier), presence only, from the list."""
    data = (folder / "model.safetensors").read_bytes()
    etag = hashlib.sha256(data).hexdigest()  # the hub's ETag (and blob name) of an LFS file
    entry = "models--" + repo.replace("/", "--")
    if files is not None:
        mine = [f for f in files if f.startswith(entry + "/")]
        return {"blob": f"{entry}/blobs/{etag}" in mine or None,
                "partials": [f for f in mine if f.endswith(".incomplete")],
                "links": [f for f in mine if f.endswith("/model.safetensors")]}
    blob = hub_cache / entry / "blobs" / etag
    return {
        "served": (len(data), etag),
        "blob": ((blob.stat().st_size, hashlib.sha256(blob.read_bytes()).hexdigest())
                 if blob.exists() else None),
        "partials": sorted(p.name for p in (hub_cache / entry).glob("blobs/*.incomplete")),
        "links": sorted(str(p) for p in (hub_cache / entry).glob("snapshots/*/model.safetensors")),
    }


@pytest.mark.timeout(300)
def test_disk_full_while_the_leader_writes_a_blob(four_ranks: dict[str, Any],
                                                  folders: dict[str, Path]) -> None:
    """ENOSPC on the leader: every rank raises the leader's OSError naming it and the cause; the
    cache holds no blob, partial file or link for the checkpoint; once there is room, the same
    cache loads."""
    job = four_ranks["job"]
    retry = step_records(job, "enospc_retry")
    # The injected cache as the retry found it, right after the failure.
    cases = [("enospc_injected", "f/enospc-injected", four_ranks["injected"],
              retry[0]["cache_before"])]
    if four_ranks["tmpfs_skip"]:
        print(f"SKIPPED the real small tmpfs: {four_ranks['tmpfs_skip']}")
    else:
        cases.append(("enospc", "f/enospc", four_ranks["tmpfs"], None))
    for step, repo, cache, listed in cases:
        errors = assert_same_failure(job, step, [0, 1, 2, 3], leader=0, within_s=10,
                                     cause="No space left on device")
        assert all(e["isinstance"]["OSError"] for e in errors.values()), errors
        state = _blob_state(cache, repo, folders[repo], listed)
        assert state["blob"] is None and not state["partials"] and not state["links"], state
        records = step_records(job, step).values()
        lo, hi = min(r["t_call"] for r in records), max(r["t_end"] for r in records)
        assert {r.rank for r in job.requests if r.repo_id == repo and lo <= r.time <= hi} \
            <= attempt_leaders(errors)
    for rank, record in retry.items():
        assert_weights_ok(record, f"retry rank {rank}")
    state = _blob_state(four_ranks["injected"], "f/enospc-injected", folders["f/enospc-injected"])
    assert state["blob"] == state["served"] and not state["partials"], state


@pytest.mark.timeout(240)
def test_flock_unsupported_or_silently_not_locking(hub_job: tuple[Job, Any],
                                                   folders: dict[str, Path]) -> None:
    """``fcntl.flock`` raising ENOSYS, or returning without locking, in every rank: the store
    still lets one rank download, once, into one correct blob."""
    job, _ = hub_job
    hub_cache = job.out_dir.parent / "hf" / "hub"
    for step, repo in (("flock_enosys", "f/flock-enosys"), ("flock_noop", "f/flock-noop")):
        records = step_records(job, step)
        assert sorted(records) == [0, 1, 2], F.describe(job, [step])
        for rank, record in records.items():
            assert_weights_ok(record, f"{step} rank {rank}")
        assert len(F.gets(job, repo, "model.safetensors")) == 1, F.gets(job, repo)
        assert len({r.rank for r in F.gets(job, repo)}) == 1, F.gets(job, repo)
        state = _blob_state(hub_cache, repo, folders[repo])
        assert state["blob"] == state["served"] and not state["partials"], state
        assert len(state["links"]) == 1, state


@pytest.mark.timeout(300)
def test_collective_transport_loads(four_ranks: dict[str, Any]) -> None:
    job = four_ranks["job"]
    records = step_records(job, "bcast")
    assert sorted(records) == [0, 1, 2, 3], F.describe(job, ["bcast"])
    for rank, record in records.items():
        assert_weights_ok(record, f"rank {rank}")
    assert sum(bool(r["opened"]) for r in records.values()) == 1, records  # one reader


@pytest.mark.timeout(300)
def test_follower_killed_while_receiving_a_broadcast(four_ranks: dict[str, Any]) -> None:
    """gloo reports the dead member at once: the leader keeps its model, the other followers
    warn naming the dead rank and load from the cache the leader filled."""
    job = four_ranks["job"]
    assert job.returncodes[3] == -9, job.describe()
    records = step_records(job, "bcast_kill_follower")
    assert sorted(records) == [0, 1, 2], F.describe(job, ["bcast_kill_follower"])
    for rank, record in records.items():
        assert_weights_ok(record, f"rank {rank}")
    assert F.step_span_s(job, "bcast_kill_follower") < 10
    for rank in (1, 2):
        assert records[rank]["opened"], records[rank]  # fell back to the checkpoint
        assert "rank 3 is gone" in job.outputs[rank], job.outputs[rank][-3000:]
    assert_only_leader_requested(job, "f/bcast-kill-follower", 0)


@pytest.mark.timeout(300)
def test_leader_killed_while_broadcasting(four_ranks: dict[str, Any]) -> None:
    """The leader dies mid-broadcast: followers notice at once, warn naming it, and load from
    the cache it filled (it published success only after its own load)."""
    job = four_ranks["job"]
    assert job.returncodes[0] == -9, job.describe()
    records = step_records(job, "bcast_kill_leader")
    assert sorted(records) == [1, 2], F.describe(job, ["bcast_kill_leader"])
    for rank, record in records.items():
        assert_weights_ok(record, f"rank {rank}")
        assert record["opened"], record
        assert "leader rank 0 failed (rank 0 is gone" in job.outputs[rank], \
            job.outputs[rank][-3000:]
    # 5 s of it: the leader waits that long for rank 3 (dead) to arrive before broadcasting.
    assert F.step_span_s(job, "bcast_kill_leader") < 15
    assert_only_leader_requested(job, "f/bcast-kill-leader", 0)


@pytest.mark.timeout(300)
def test_follower_whose_receive_raises_loads_plainly_at_once(four_ranks: dict[str, Any]) -> None:
    """A member whose receive raises an error of its own (``MemoryError`` in bucket 2) leaves
    the broadcast, warns and loads from the cache; it does not join the broadcast again (whose
    rendezvous is spent: it would wait out the group's timeout, 20 s here, several times)."""
    job = four_ranks["job"]
    records = step_records(job, "bcast_raise_follower")
    assert sorted(records) == [0, 1, 2, 3], F.describe(job, ["bcast_raise_follower"])
    for rank, record in records.items():
        assert_weights_ok(record, f"rank {rank}")
    assert records[2]["opened"], records[2]  # its own plain load
    assert "MemoryError: injected: cannot receive bucket 2" in job.outputs[2], \
        job.outputs[2][-3000:]
    assert F.step_span_s(job, "bcast_raise_follower") < 15
    assert_only_leader_requested(job, "f/bcast-raise-follower", {0, 2})


@pytest.mark.timeout(240)
def test_collective_member_killed_while_waiting_costs_the_others_nothing(
        collective_member_killed_waiting: Job) -> None:
    """A member that died before the broadcast (while the leader downloaded) is not made a
    member of the private group: the others do not wait for it (the group's timeout is
    ``PATCHLOAD_GROUP_TIMEOUT``, 300 s), and rank 1 still receives the weights."""
    job = collective_member_killed_waiting
    assert job.returncodes[2] == -9, job.describe()
    records = step_records(job, "bcast_kill_waiting")
    assert sorted(records) == [0, 1], F.describe(job, ["bcast_kill_waiting"])
    for rank, record in records.items():
        assert_weights_ok(record, f"rank {rank}")
    assert not records[1]["opened"], records[1]  # received by broadcast, not read
    # The ~3 s download and the broadcast; not the group's 300 s timeout.
    assert F.step_span_s(job, "bcast_kill_waiting") < 20, F.describe(job, ["bcast_kill_waiting"])
    assert_only_leader_requested(job, "f/bcast-kill-waiting", 0)


# --- concurrency and resources ----------------------------------------------------------------

@pytest.mark.timeout(240)
def test_two_jobs_share_one_hf_home(shared_home: list[Job]) -> None:
    for i, job in enumerate(shared_home):
        for step in ("shared", "pg_timeout"):
            for rank, record in step_records(job, step).items():
                assert_weights_ok(record, f"job {i} rank {rank} {step}")
    spans = [(min(r["t_call"] for r in step_records(job, "shared").values()),
              max(r["t_end"] for r in step_records(job, "shared").values()))
             for job in shared_home]
    assert spans[0][0] < spans[1][1] and spans[1][0] < spans[0][1], f"no overlap: {spans}"
    requests = {r for job in shared_home for r in job.requests}
    for repo in ("f/shared-home", "f/pg-timeout"):
        fetched = F.gets_per_file(r for r in requests if r.repo_id == repo)
        print(f"{repo}: successful GETs per file in both jobs: {dict(fetched)}")
        assert fetched and max(fetched.values()) <= 2, fetched


@pytest.mark.timeout(240)
def test_download_longer_than_the_process_group_timeout(shared_home: list[Job]) -> None:
    for job in shared_home:
        records = step_records(job, "pg_timeout")
        assert len(records) == len(job.ranks)
        assert max(r["elapsed_s"] for r in records.values()) > 6  # beyond the 5 s group timeout
        for record in records.values():
            assert record["all_reduce"] == len(job.ranks)  # the group still works afterwards


@pytest.mark.timeout(240)
def test_three_threads_of_one_rank_load_the_same_repo(shared_home: list[Job]) -> None:
    for rank, record in step_records(shared_home[0], "threads").items():
        for i, result in enumerate(record["threads"]):
            assert_weights_ok(result, f"rank {rank} thread {i}")


@pytest.mark.timeout(300)
def test_fifty_loads_in_a_row_with_four_ranks_release_what_they_take(
        four_ranks: dict[str, Any]) -> None:
    """Alternating zero-copy and converting (memfd-shared) loads: open fds, patchload memfds,
    threads and RSS come back to where they started."""
    records = step_records(four_ranks["job"], "loop")
    assert sorted(records) == [0, 1, 2, 3], F.describe(four_ranks["job"], ["loop"])
    for rank, record in records.items():
        assert record["mismatched"] == 0
        samples = record["samples"]
        assert len(samples) == 51
        first, warm, last = samples[0], samples[2], samples[-1]
        fds = [s["fds"] for s in samples]
        # A leader keeps at most the blobs of loads its followers are still taking.
        assert max(fds[5:]) <= first["fds"] + 3, f"rank {rank}: open fds {fds}"
        assert max(s["memfds"] for s in samples) <= 2, f"rank {rank}: {samples}"
        assert last["threads"] <= first["threads"] + 1, \
            f"rank {rank}: threads {[s['threads'] for s in samples]}, {last['python_threads']}"
        assert last["rss"] - warm["rss"] < 32 * 2**20, f"rank {rank}: RSS {samples}"



_FILE_STORE_USER = """
import atexit, sys


@atexit.register  # before patchload's own hooks, so it runs after them
def after_patchload():
    try:
        store.store.check(["hello"])
        print("a client of the store is still open", flush=True)
    except RuntimeError as err:
        print(err, flush=True)


from patchload.coordination.store import job_store

store = job_store()  # held to the end, as a user's objects may hold it
with store.lock:
    store.store.set("hello", "1")
store.wait_for("hello", 5.0)  # a second client, kept for the next wait
print(store.kind, flush=True)
sys.stdin.read()  # exits when the test closes stdin
"""


@pytest.mark.timeout(120)
def test_node_local_store_file_is_removed_by_the_last_process_out(tmp_path: Path) -> None:
    """Without a launcher store, ranks share a FileStore in patchload's private directory; it
    outlives the first rank to exit and goes with the last, even when another was SIGKILLed
    (it never counts itself out). A rank closes its clients of the file before it counts
    itself out: a FileStore writes to its file when destroyed, and one destroyed after the last
    rank removed the file recreated it (left behind; a later client read garbage from it)."""
    from _launch import job_env

    env = job_env("http://127.0.0.1:9", tmp_path / "hf", tmp_path / "out",
                  TMPDIR=str(tmp_path), WORLD_SIZE="3", LOCAL_WORLD_SIZE="3")
    procs = [subprocess.Popen([sys.executable, "-c", _FILE_STORE_USER], text=True,
                              env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
             for r in range(3)]
    try:
        assert [p.stdout.readline().strip() for p in procs] == ["file"] * 3  # type: ignore
        private = tmp_path / f"patchload-{os.getuid()}"
        (store_file,) = private.iterdir()
        procs[2].kill()
        procs[2].wait(timeout=30)
        for i, proc in enumerate(procs[:2]):
            out, _ = proc.communicate("", timeout=60)
            assert proc.returncode == 0
            assert out.strip() == "patchload's job store was closed at interpreter exit (check)"
            assert store_file.exists() == (i == 0), f"after {i + 1} of 2 exited"
        assert not any(private.iterdir())
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


_STORE_PROBE = """
import sys
from patchload.coordination.store import job_store
store = job_store()
with store.lock:
    seen = store.store.check(["probe"])
    store.store.set("probe", "from an earlier job")
print(store.kind, seen, flush=True)
sys.stdin.read()
"""


@pytest.mark.timeout(120)
def test_node_local_store_of_a_killed_job_is_not_read_by_the_next(tmp_path: Path) -> None:
    """Ranks started by hand from one parent (the same job name) and all SIGKILLed leave their
    node-local store file behind; the next job of that name finds every user gone, drops it and
    starts clean (it never sees the dead job's claims)."""
    from _launch import job_env

    env = job_env("http://127.0.0.1:9", tmp_path / "hf", tmp_path / "out",
                  TMPDIR=str(tmp_path), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")

    def start() -> list[subprocess.Popen]:
        return [subprocess.Popen([sys.executable, "-c", _STORE_PROBE], text=True,
                                 env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE)
                for r in range(2)]

    first = start()
    try:
        lines = sorted(p.stdout.readline().strip() for p in first)  # type: ignore[union-attr]
        assert lines == ["file False", "file True"], lines
        for proc in first:
            proc.kill()
            proc.wait(timeout=30)
        (store_file,) = (tmp_path / f"patchload-{os.getuid()}").glob("store-*")
        second = start()
        first += second
        lines = sorted(p.stdout.readline().strip() for p in second)  # type: ignore[union-attr]
        assert lines == ["file False", "file True"], lines  # one of the new job saw it first
        for proc in second:
            proc.communicate("", timeout=60)
            assert proc.returncode == 0
        assert not store_file.exists()
    finally:
        for proc in first:
            if proc.poll() is None:
                proc.kill()
                proc.wait()


# --- security ---------------------------------------------------------------------------------

def _sources() -> list[Path]:
    return sorted(p for p in PATCHLOAD_SRC.rglob("*.py") if "testing" not in p.parts)


def test_nothing_from_the_store_is_unpickled_or_executed() -> None:
    banned_modules = {"pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve", "yaml"}
    banned_calls = {"eval", "exec", "compile", "__import__", "import_module", "loads"}
    found = []
    for path in _sources():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name.split(".")[0] for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [(node.module or "").split(".")[0]]
            else:
                names = []
            found += [f"{path.name}:{node.lineno} imports {n}" for n in names
                      if n in banned_modules]
            if isinstance(node, ast.Call):
                func = node.func
                name = func.id if isinstance(func, ast.Name) else getattr(func, "attr", "")
                owner = ast.unparse(func.value) if isinstance(func, ast.Attribute) else ""
                # _errors.py imports the module of a leader's exception class, but only from a
                # fixed list of packages the patched calls raise from (see
                # test_unit.py::test_follower_exception_imports_only_known_packages).
                # The doctor (__main__.py) imports the modules of patchload's own patch list;
                # datasets.py a fixed tuple of modules a follower imports while it waits
                # (patches/datasets.py::_STREAMING_IMPORTS), never a name read from a store.
                allowed_import = name == "import_module" and path.name in (
                    "_errors.py", "__main__.py", "datasets.py")
                if name in banned_calls and not (name == "loads" and owner == "json") and not (
                        name == "compile" and owner == "re") and not allowed_import:
                    found.append(f"{path.name}:{node.lineno} calls {ast.unparse(func)}")
                if name == "load" and owner == "torch":
                    found.append(f"{path.name}:{node.lineno} calls torch.load (unpickles)")
    assert not found, found


def test_store_values_are_parsed_as_json_only() -> None:
    """Every value patchload reads from a store goes through ``json.loads`` or ``int``."""
    text = {p.name: p.read_text() for p in _sources()}
    for name, source in text.items():
        for line in source.splitlines():
            if ".store.get(" in line and "json.loads" not in line and "int(" not in line:
                pytest.fail(f"{name}: store value used unparsed: {line.strip()}")


def test_files_patchload_creates_are_private_and_not_followed(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from patchload.coordination import scope as _scope, store as _store

    # The private directory: 0700, owned by us; when open to others or a symlink, not used: a
    # fresh 0700 one instead (the process's fallback, reset here after each check).
    monkeypatch.setattr(_store.tempfile, "gettempdir", lambda: str(tmp_path))
    monkeypatch.setattr(_store, "_FALLBACK_DIR", None)
    monkeypatch.setattr(_store.atexit, "register", lambda *a, **k: None)
    private = _store.private_dir()
    assert stat.S_IMODE(os.lstat(private).st_mode) == 0o700
    private.chmod(0o755)
    fallback = _store.private_dir()
    assert fallback != private and stat.S_IMODE(os.lstat(fallback).st_mode) == 0o700
    _store._FALLBACK_DIR = None
    shutil.rmtree(private)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    private.symlink_to(elsewhere)
    assert _store.private_dir() not in (private, elsewhere, fallback)
    _store._FALLBACK_DIR = None
    private.unlink()

    # The scope marker (rank 0, several nodes): 0600, created with O_NOFOLLOW.
    cache = tmp_path / "hub"
    monkeypatch.setattr(_scope.atexit, "register", lambda *a, **k: None)
    marker = _scope._write_marker(cache, "nonce1")
    assert marker.name == ".patchload-scope-nonce1"
    assert stat.S_IMODE(os.lstat(marker).st_mode) == 0o600
    # A symlink planted where the marker goes is not followed (its target is not truncated).
    target = tmp_path / "victim"
    target.write_text("keep me")
    marker.unlink()
    marker.symlink_to(target)
    with pytest.raises(OSError) as info:
        _scope._write_marker(cache, "nonce1")
    assert info.value.errno == errno.ELOOP
    assert target.read_text() == "keep me"
    marker.unlink()  # the planted link; nothing of patchload may outlive the suite


def test_every_file_patchload_creates_is_opened_with_o_nofollow() -> None:
    for path in _sources():
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and ast.unparse(node.func) == "os.open"
                    and "O_CREAT" in ast.unparse(node)):
                assert "O_NOFOLLOW" in ast.unparse(node), f"{path.name}:{node.lineno}"
            if isinstance(node, ast.Call) and ast.unparse(node.func) in ("open", "Path.open"):
                mode = ast.unparse(node.args[1]) if len(node.args) > 1 else "'r'"
                assert not any(c in mode for c in "wax+"), \
                    f"{path.name}:{node.lineno}: open() for writing follows symlinks"


VICTIM_UID, OTHER_UID = 65533, 65534


def _in_child_as(uid: int, fn: Callable[[int], dict[str, Any]], *, hold: bool = False,
                 ) -> tuple[int, dict[str, Any], int | None]:
    """Fork; the child drops to ``uid`` (and gid), runs ``fn(write_fd)`` and reports its dict as
    one JSON line. With ``hold`` it then stays alive until the returned fd is closed.

    Returns:
        (child pid, its report, the fd whose closing releases it or None).
    """
    report_r, report_w = os.pipe()
    hold_r, hold_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child never returns into pytest
        code = 0
        try:
            os.close(report_r)
            os.close(hold_w)
            os.setgroups([])
            os.setgid(uid)
            os.setuid(uid)
            out = fn(report_w)
        except BaseException as err:  # noqa: BLE001 - reported to the test
            out, code = {"crash": repr(err)}, 1
        os.write(report_w, (json.dumps(out) + "\n").encode())
        if hold:
            os.read(hold_r, 1)
        os._exit(code)
    os.close(report_w)
    os.close(hold_r)
    ready, _, _ = select.select([report_r], [], [], 60)
    if not ready:
        os.close(hold_w)
        _reap(pid, 0.0)
        pytest.fail(f"child {pid} (uid {uid}) did not report within 60 s")
    with os.fdopen(report_r) as f:
        report = json.loads(f.readline())
    if not hold:
        os.close(hold_w)
        _reap(pid)
    assert "crash" not in report, report
    return pid, report, hold_w if hold else None


def _reap(pid: int, within_s: float = 30.0) -> None:
    """Wait for child ``pid`` to exit, SIGKILLing it after ``within_s`` seconds."""
    deadline = time.monotonic() + within_s
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return
        time.sleep(0.02)


def _errno_of(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except OSError as err:
        return errno.errorcode[err.errno] if err.errno else repr(err)
    return "allowed"


@pytest.mark.timeout(120)
def test_another_user_cannot_reach_blobs_or_private_files(tmp_path: Path) -> None:
    """Users A and B on one node: B cannot open A's memfd blob through /proc (nor attach to
    it), list, read, create or replace anything in A's private directory (its FileStore), or
    make A use a directory B planted."""
    if os.geteuid() != 0:
        reason = "needs root to run two users (setuid); not root here"
        print(f"SKIPPED: {reason}")
        pytest.skip(reason)
    # Import now what the children use: after setuid they may not read the interpreter's files.
    import encodings.ascii  # noqa: F401
    import tempfile

    import torch
    import torch.distributed  # noqa: F401

    from patchload.coordination import store as _store
    from patchload.transport import shm

    shared = Path(tempfile.mkdtemp(prefix="plt-users-"))  # /tmp-like: 1777, reachable by both
    shared.chmod(0o1777)
    planted_root = shared / "planted"
    planted_root.mkdir(mode=0o1777)
    planted_root.chmod(0o1777)
    try:
        def plant(_: int) -> dict[str, Any]:
            planted = planted_root / f"patchload-{VICTIM_UID}"
            planted.mkdir()
            planted.chmod(0o777)
            return {"planted": str(planted)}

        _in_child_as(OTHER_UID, plant)

        def victim(_: int) -> dict[str, Any]:
            import torch
            import torch.distributed as dist

            tempfile.tempdir = str(planted_root)
            private = _store.private_dir()  # not the planted one: a fresh private directory
            store = dist.FileStore(str(private / "store-test"), -1)
            store.set("k", "v")
            descriptor, _ = shm.share([torch.arange(4096, dtype=torch.float32) * 3])
            return {"planted": str(planted_root / f"patchload-{VICTIM_UID}"),
                    "owner": os.stat(private).st_uid, "private": str(private),
                    "mode": oct(os.stat(private).st_mode & 0o777), "descriptor": descriptor,
                    "files": sorted(p.name for p in private.iterdir())}

        victim_pid, victim_info, release = _in_child_as(VICTIM_UID, victim, hold=True)
        try:
            assert victim_info["private"].startswith(victim_info["planted"] + "-"), victim_info
            assert victim_info["owner"] == VICTIM_UID
            assert victim_info["mode"] == "0o700" and "store-test" in victim_info["files"]
            descriptor = victim_info["descriptor"]
            assert descriptor.get("fd") is not None, descriptor  # a memfd blob, not a file

            def attacker(_: int) -> dict[str, Any]:
                private = Path(victim_info["private"])
                mine = shared / "mine"
                mine.write_bytes(b"planted")
                return {
                    "open_blob": _errno_of(lambda: os.open(
                        f"/proc/{descriptor['pid']}/fd/{descriptor['fd']}", os.O_RDONLY)),
                    "attach_blob": _errno_of(lambda: shm.attach(descriptor)),
                    "list_private": _errno_of(lambda: os.listdir(private)),
                    "read_store": _errno_of(lambda: (private / "store-test").read_bytes()),
                    "create_in_private": _errno_of(lambda: os.open(
                        private / "x", os.O_CREAT | os.O_WRONLY | os.O_NOFOLLOW, 0o600)),
                    "replace_store": _errno_of(lambda: os.replace(mine, private / "store-test")),
                    "remove_private": _errno_of(lambda: os.rename(private, shared / "moved")),
                }

            _, attempts, _ = _in_child_as(OTHER_UID, attacker)
            print(f"uid {OTHER_UID} against uid {VICTIM_UID}'s patchload files: {attempts}")
            assert all(result in ("EACCES", "EPERM") for result in attempts.values()), attempts
            # Root (this process) can attach: the blob was there to be refused.
            assert descriptor["pid"] == victim_pid
            expected = torch.arange(4096, dtype=torch.float32) * 3
            assert shm.attach(descriptor)[0].equal(expected)
        finally:
            os.close(release)  # type: ignore[arg-type]
            _reap(victim_pid)
    finally:
        shutil.rmtree(shared, ignore_errors=True)
