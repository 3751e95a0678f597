"""What a rank says about a coordinated call, and what an interrupt does to one.

N=3, ``PATCHLOAD_LOG_LEVEL=INFO``, a script that calls ``logging.basicConfig(level=INFO)`` after
``import patchload``, a download the hub throttles to a few seconds: every rank prints one line
(once, not again through the root handler) per top-level call saying whether it led or whom it
followed (followers: no request), and a follower that waits past ``PATCHLOAD_PROGRESS_WARNING``
warns periodically with the leader's progress in its cache.

Interrupts (SIGINT; SIGTERM with a handler raising ``SystemExit(3)``) on the leader while it
downloads, or on a follower while it waits for it: three plain ranks around a TCPStore hosted
here (no agent: a rank that exits leaves the others running), run with ``PATCHLOAD=0`` and
patched (both weight transports); every rank must end as the plain rank did (exit status,
what it raised, the model's bytes), and the interrupted follower within 2 s.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from _launch import free_port, job_env, run_torchrun, start_ranks, wait_ranks

from patchload.testing import Fault, LoopbackHub, models

SIZE_BYTES = 109_248  # tiny_llama's model.safetensors (seed 0): about 4 s at 24 KB/s


@pytest.mark.timeout(300)
def test_each_rank_says_what_it_did_and_a_waiting_follower_warns(
        hub: LoopbackHub, tmp_path: Path) -> None:
    folder = models.tiny_llama(tmp_path / "repo", with_tokenizer=False)
    assert (folder / "model.safetensors").stat().st_size == SIZE_BYTES
    hub.add_repo("sig/slow", folder)
    hub.add_fault(Fault(repo_id="sig/slow", path="model.safetensors", method="GET",
                        throttle_bytes_per_s=24_000))
    env = job_env(hub.endpoint, tmp_path / "hf", tmp_path / "out", PATCHLOAD_LOG_LEVEL="INFO",
                  PATCHLOAD_PROGRESS_WARNING="1")
    job = run_torchrun(hub, "signals", ["--basic-config"], nproc=3, env=env,
                       timeout_s=240).check_ok()
    log = "\n".join(job.outputs)

    def lines(pattern: str) -> list[str]:
        return re.findall(pattern, log, flags=re.M)

    download = r"hf_hub_download\('sig/slow', 'model\.safetensors'\)"
    config = r"AutoConfig\.from_pretrained\('sig/slow'\)"
    for what in (download, config):
        # Once each, whatever the format, then in patchload's.
        assert len(lines(rf"\[rank 0/3\] {what}: led it \(node scope\), in ")) == 1, log
        assert len(lines(rf"INFO patchload \[rank 0/3\] {what}: led it \(node scope\), "
                         r"in ")) == 1, log
        for rank in (1, 2):
            followed = (rf"\[rank {rank}/3\] {what}: followed rank 0: no request, "
                        r"(?:\d+ answered from its record, )?in ")
            assert len(lines(followed)) == 1, log
            assert len(lines(rf"INFO patchload {followed}")) == 1, log
    # Followers of the slow download warn while they wait, with the leader's progress.
    for rank in (1, 2):
        warnings = lines(rf"WARNING patchload \[rank {rank}/3\] {download} \(leader rank 0\): "
                         r"still waiting for the leader, alive and beating \(\d+ s so far; no "
                         r"bound on the total wait\); [\d.]+ MiB of its files in the cache, [\d.]+ MiB/s")
        assert len(warnings) >= 1, log
    # Only rank 0 asked the hub for anything.
    assert {r.rank for r in job.requests} == {0}, job.requests
    paths = {report["path"] for report in job.ranks.values()}
    assert len(paths) == 1


@pytest.mark.timeout(300)
def test_a_call_rank0_never_makes_costs_at_most_the_grace(hub: LoopbackHub,
                                                           tmp_path: Path) -> None:
    """Rank 0 never makes the call and never opens the store (alive, in no collective, until
    the others made theirs, so it shows nothing: no call, no collective, no exit published):
    after ``PATCHLOAD_CLAIM_GRACE`` (the fallback bound, 2 s here) the first of the others to
    claim it leads; every rank gets the config, one rank asks the hub. (A rank 0 that exits
    instead is not waited for: test_faults.py's
    ``test_rank0_gone_before_its_first_call_is_not_waited_for``.)"""
    hub.add_repo("sig/alone", models.tiny_llama(tmp_path / "repo", with_tokenizer=False))
    env = job_env(hub.endpoint, tmp_path / "hf", tmp_path / "out", PATCHLOAD_CLAIM_GRACE="2")
    job = run_torchrun(hub, "signals", ["--without-rank0"], nproc=3, env=env,
                       timeout_s=240).check_ok()
    reports = {rank: job.ranks[rank] for rank in (1, 2)}
    assert reports[1]["config"] == reports[2]["config"]
    # The grace, plus a config load on a loaded 2-core machine.
    assert all(2.0 <= r["elapsed_s"] < 2.0 + 10.0 for r in reports.values()), reports
    assert len({r.rank for r in job.requests if r.repo_id == "sig/alone"}) == 1, job.requests


# --- interrupts ---------------------------------------------------------------------------------

_SIGNALS = {"sigterm": signal.SIGTERM, "sigint": signal.SIGINT}
# The leader's download of the weights: the signal lands inside it (about 1 s in, here). A test
# fails unless the signal went at least 1 s before the earliest stall's end, counted from when
# this process saw the stall begin (a poll, 0.05 s, after it did).
_STALL_S = 10.0


@pytest.mark.timeout(60)
def test_a_store_wait_leaves_at_once_on_a_signal_and_wakes_its_helper() -> None:
    """A store wait on the main thread runs a signal handler within a slice (0.25 s), not when
    the store's C++ wait returns; the exception propagates unchanged; ``wake`` ends the
    helper's wait, which is joined: no thread is left inside a store request."""
    import torch.distributed as dist

    from patchload.coordination.store import JobStore

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False)
    store = JobStore(dist.PrefixStore("t/", client), "agent", threading.RLock())
    stop = SystemExit(3)

    def handler(signum: int, frame: Any) -> None:
        raise stop

    woken: list[float] = []

    def wake() -> None:
        woken.append(time.monotonic())
        store.store.set("key", "")

    previous = signal.signal(signal.SIGUSR1, handler)
    try:
        timer = threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGUSR1))
        timer.start()
        start = time.monotonic()
        with pytest.raises(SystemExit) as caught:
            store.wait_for("key", 30.0, wake=wake)
        elapsed = time.monotonic() - start
    finally:
        signal.signal(signal.SIGUSR1, previous)
    print(f"store wait left {elapsed - 0.5:.2f} s after the signal")
    assert caught.value is stop and caught.value.code == 3
    assert elapsed < 0.5 + 1.5, elapsed
    assert len(woken) == 1
    assert not [t for t in threading.enumerate() if t.name == "patchload-store-wait"]
    # The client it used is back for the next wait, which still works.
    assert store.wait_for("key", 5.0)


def _interrupt_job(hub: LoopbackHub, folder: Path, root: Path, *, target: int, kind: str,
                   patched: bool, transport: str = "shm") -> dict[str, Any]:
    """Three ranks load one model; rank ``target`` gets signal ``kind`` while rank 0's download
    of the weights is stalled (rank 0 leads, when patched; plain, each rank has a cache of its
    own, so rank 0 makes that request whatever the others do): once the hub has stalled it and,
    for a follower, once that follower waits for rank 0 (plain: once its own download is
    stalled too). Returns the return codes, the reports, ``latency_s``: from the signal to
    the target's raise, and ``stall_left_s``: the least any stalled download still had to go
    when the signal was sent (each stall's start taken as when this process saw it hit)."""
    import torch.distributed as dist

    repo = f"sig/int-{target}-{kind}"  # a plain job's and its patched jobs' (name_or_path)
    hub.add_repo(repo, folder)
    # Plain, the target's own download too (a follower makes none).
    faults = [hub.add_fault(Fault(repo_id=repo, path="model.safetensors", method="GET",
                                  rank=rank, times=1, stall_s=_STALL_S))
              for rank in sorted({0, target} if not patched else {0})]
    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, world_size=-1, is_master=True,
                          wait_for_workers=False)
    out = root / "out"
    env = job_env(hub.endpoint, root / "hf", out, PATCHLOAD="1" if patched else "0",
                  PATCHLOAD_TRANSPORT=transport, PATCHLOAD_LOG_LEVEL="DEBUG",
                  HF_HUB_DOWNLOAD_TIMEOUT="60", PLT_OWN_CACHE="0" if patched else "1")
    t0 = time.time()
    procs, logs = start_ranks("signals", ["--interrupt", repo], world_size=3, store_port=port,
                              env=env)
    try:
        deadline = time.monotonic() + 180

        seen: dict[int, float] = {}  # fault index: when its hit was first seen

        def ready() -> bool:
            for i, fault in enumerate(faults):
                if i not in seen and hub.fault_hits(fault):
                    seen[i] = time.time()
            if len(seen) < len(faults):
                return False
            if target == 0 or not patched:
                return True
            return "following" in logs[target].read_text(errors="replace")

        while not ready():
            # Rank 0 (stalled) and the target must still run; another plain rank may be done.
            assert time.monotonic() < deadline and all(
                procs[r].poll() is None for r in {0, target}), [p.poll() for p in procs]
            time.sleep(0.05)
        if target != 0 and patched:
            time.sleep(1.0)  # into the wait that follows the line
        sent = time.time()
        os.kill(procs[target].pid, _SIGNALS[kind])
        # No request of the job is read: no wait for the interrupted leader's stalled one.
        job = wait_ranks(hub, procs, logs, t0, timeout_s=180, settle_s=0.0)
    finally:
        del store
    raised = job.ranks.get(target, {}).get("raised")
    return {"returncodes": job.returncodes, "ranks": job.ranks, "job": job,
            "latency_s": None if raised is None else raised["t_raised"] - sent,
            "stall_left_s": min(seen.values()) + _STALL_S - sent}


def _ending(report: dict[str, Any]) -> Any:
    """How a rank ended: what it raised (class, code), or the model it loaded."""
    if "raised" in report:
        return ("raised", report["raised"]["type"], report["raised"]["code"])
    return ("loaded", report.get("fingerprint"))


_PLAIN: dict[tuple[int, str], dict[str, Any]] = {}


@pytest.mark.timeout(900)
@pytest.mark.parametrize("transport", ["shm", "collective"])
@pytest.mark.parametrize("kind", ["sigterm", "sigint"])
@pytest.mark.parametrize("target", [0, 1], ids=["leader", "follower"])
def test_an_interrupted_rank_ends_as_plain_and_the_others_too(
        hub: LoopbackHub, tmp_path: Path, target: int, kind: str, transport: str) -> None:
    """SIGTERM (a handler raising ``SystemExit(3)``) or SIGINT on the leader while it
    downloads, or on a follower while it waits for it: every rank ends as with ``PATCHLOAD=0``
    (exit status, what it raised, the bytes of its model). The leader's interrupt is never
    raised on the followers (they make the call plainly); a follower's own leaves its wait at
    once (< 2 s here, on a loaded 2-core machine; plain: at once)."""
    folder = models.tiny_llama(tmp_path / "repo", with_tokenizer=False)
    if (target, kind) not in _PLAIN:
        _PLAIN[target, kind] = _interrupt_job(hub, folder, tmp_path / "plain", target=target,
                                              kind=kind, patched=False)
    plain = _PLAIN[target, kind]
    patched = _interrupt_job(hub, folder, tmp_path / "patched", target=target, kind=kind,
                             patched=True, transport=transport)
    print(f"{kind} on rank {target} ({transport}): raised {patched['latency_s']} s after the "
          f"signal (plain: {plain['latency_s']} s); return codes {patched['returncodes']} "
          f"(plain: {plain['returncodes']}); stall left when signalled "
          f"{patched['stall_left_s']:.1f} s (plain: {plain['stall_left_s']:.1f} s)")
    # The signal landed inside the stalled download(s), in both runs.
    for run in (plain, patched):
        assert run["stall_left_s"] > 1.0, (run["stall_left_s"], run["job"].describe())
    expected_rc = 3 if kind == "sigterm" else -signal.SIGINT
    assert plain["returncodes"][target] == expected_rc, plain["job"].describe()
    assert patched["returncodes"] == plain["returncodes"], patched["job"].describe()
    for rank in range(3):
        assert _ending(patched["ranks"][rank]) == _ending(plain["ranks"][rank]), \
            (rank, patched["job"].describe())
    assert patched["latency_s"] is not None and patched["latency_s"] < 2.0, patched["latency_s"]
