"""Download once: under torchrun one rank fetches each file, the others make no request at all.

Real processes only: torchrun jobs on CPU (gloo) against the session's loopback hub, whose request
log attributes each request to a rank (``HF_HUB_USER_AGENT_ORIGIN=rank-N``). Each job runs
several calls (``tests/workers/download.py``: model, tokenizer, ``hf_hub_download``,
``snapshot_download``, ``AutoConfig``, ``GenerationConfig``, one repo each, barriers between
them) and several tests read one module-scoped job. Faults live on repo ids of their own.
"""

from __future__ import annotations

import collections
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

import _nodes
from _launch import (Job, check_same_error_everywhere, diff_fingerprints, free_port,
                     gets_per_file, job_env, request_signature, run_plain, run_torchrun,
                     start_ranks, wait_ranks)
from conftest import DOWNLOAD_REPOS, MISSING
from patchload.testing import Fault, LoopbackHub

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="torchrun jobs with /proc and memfd: Linux only")

FILES = ("config.json", "model.safetensors", "tokenizer.json")
STEPS = ("model", "tokenizer", *(f"hf_hub_download:{f}" for f in FILES), "snapshot", "config",
         "generation")
STEP_REPO = {"model": "pair", "tokenizer": "pair", "snapshot": "snap", "config": "config",
             "generation": "gen", **{f"hf_hub_download:{f}": "file" for f in FILES}}
JOB_TIMEOUT_S = 240


def _env(hub: LoopbackHub, root: Path, **extra: str) -> dict[str, str]:
    return job_env(hub.endpoint, root / "hf", root / "out", **extra)


def _ranks_with_requests(requests: list[Any]) -> set[int | None]:
    return {r.rank for r in requests}


def _values(job: Job, step: str) -> dict[int, Any]:
    out = {}
    for rank, report in sorted(job.ranks.items()):
        record = report["steps"][step]
        assert record.get("ok"), f"rank {rank} step {step}: {record.get('error')}"
        out[rank] = record["value"]
    return out


def _assert_same_on_every_rank(job: Job, step: str) -> dict[int, Any]:
    values = _values(job, step)
    first = next(iter(values.values()))
    for rank, value in values.items():
        if step == "model":
            assert diff_fingerprints(value["fingerprint"], first["fingerprint"]) == [], rank
        else:
            assert value == first, f"step {step}: rank {rank} got {value}, rank 0 {first}"
    return values


# --- jobs ---------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def cold_job(hub: LoopbackHub, tmp_path_factory: pytest.TempPathFactory) -> Job:
    """N=3, cold cache, no process group ever: every entry point once."""
    root = tmp_path_factory.mktemp("cold")
    return run_torchrun(hub, "download", ["--init", "never"], nproc=3, env=_env(hub, root),
                        timeout_s=JOB_TIMEOUT_S).check_ok()


@pytest.fixture(scope="module")
def rank0_first_job(hub: LoopbackHub, tmp_path_factory: pytest.TempPathFactory) -> Job:
    """N=3, ``init_process_group`` before the calls, each call made as
    ``if rank == 0: call(); dist.barrier(); if rank != 0: call()``."""
    root = tmp_path_factory.mktemp("rank0first")
    return run_torchrun(hub, "download", ["--init", "before", "--pattern", "rank0first"],
                        nproc=3, env=_env(hub, root), timeout_s=JOB_TIMEOUT_S).check_ok()


@pytest.fixture(scope="module")
def ratelimited_job(hub: LoopbackHub, tmp_path_factory: pytest.TempPathFactory) -> Job:
    """N=3, ``init_process_group`` after the calls; the hub answers the leader's first GET of the
    weights, and its first metadata request of the config, with 429 + ``Retry-After: 1``."""
    root = tmp_path_factory.mktemp("ratelimited")
    hub.add_fault(Fault(repo_id="rl/pair", path="model.safetensors", method="GET", status=429,
                        retry_after_s=1, times=1))
    hub.add_fault(Fault(repo_id="rl/file", path="config.json", method="GET", status=429,
                        retry_after_s=1, times=1))
    return run_torchrun(hub, "download", ["--init", "after", "--prefix", "rl/", "--steps",
                                          "model,tokenizer,hf_hub_download:config.json"],
                        nproc=3, env=_env(hub, root), timeout_s=JOB_TIMEOUT_S).check_ok()


def _two_nodes(hub: LoopbackHub, root: Path, *, shared_home: bool, hosts: str) -> Job:
    """Namespaced nodes (``tests/_nodes.py``) with their own caches use one path on both, each
    on the node's private disk; on this host's one kernel view, two directories."""
    if hosts == "namespaced" and (reason := _nodes.unavailable()):
        pytest.skip(reason)
    out = root / "out"
    if shared_home:
        homes = [root / "hf-shared"] * 2
    elif hosts == "namespaced":
        homes = [_nodes.NODE_LOCAL / "hf"] * 2
    else:
        homes = [root / "hf-node0", root / "hf-node1"]
        # A marker an earlier job left (stopped by SIGTERM) in node 1's cache never counts.
        stale = homes[1] / "hub" / ".locks" / ".patchload-scope-0123456789abcdef"
        stale.parent.mkdir(parents=True)
        stale.touch()
    envs = [job_env(hub.endpoint, home, out, PLT_RECORD_ATTACHES="1") for home in homes]
    job = run_torchrun(hub, "download", ["--init", "never"], nproc=2, nnodes=2, env=envs,
                       timeout_s=JOB_TIMEOUT_S, hosts=hosts).check_ok()
    if not shared_home and hosts != "namespaced":
        stale.unlink()  # not patchload's: the suite-end check looks for markers left behind
    job.extra["hosts"] = hosts
    return job


@pytest.fixture(scope="module", params=_nodes.HOSTS)
def two_nodes_own_homes(request: pytest.FixtureRequest, hub: LoopbackHub,
                        tmp_path_factory: pytest.TempPathFactory) -> Job:
    """2 simulated nodes x 2 ranks (two torchrun agents, static rendezvous), one HF_HOME each;
    the nodes share this host's kernel view, or each has its own namespaces."""
    return _two_nodes(hub, tmp_path_factory.mktemp("nodes-own"), shared_home=False,
                      hosts=request.param)


@pytest.fixture(scope="module", params=_nodes.HOSTS)
def two_nodes_shared_home(request: pytest.FixtureRequest, hub: LoopbackHub,
                          tmp_path_factory: pytest.TempPathFactory) -> Job:
    """2 simulated nodes x 2 ranks on one HF_HOME (a shared filesystem); scope left on auto;
    shared kernel view or namespaced nodes."""
    return _two_nodes(hub, tmp_path_factory.mktemp("nodes-shared"), shared_home=True,
                      hosts=request.param)


@pytest.fixture(scope="module")
def closed_port_job(hub: LoopbackHub, tmp_path_factory: pytest.TempPathFactory) -> Job:
    """N=3 with ``HF_ENDPOINT`` naming a port nobody listens on (huggingface_hub's backoff
    between its retries a tenth of its default, as in ``errors_job``)."""
    root = tmp_path_factory.mktemp("closed-port")
    env = job_env(f"http://127.0.0.1:{free_port()}", root / "hf", root / "out",
                  PLT_HUB_WAIT_SCALE="0.1")
    return run_torchrun(hub, "errors", ["--steps", "closed_port_model"], nproc=3, env=env,
                        timeout_s=JOB_TIMEOUT_S).check_ok()


@pytest.fixture(scope="module")
def unpatched_job(hub: LoopbackHub, tmp_path_factory: pytest.TempPathFactory) -> Job:
    """N=3 with ``PATCHLOAD=0``, each rank on its own HF_HOME (so its requests do not depend on
    how the ranks race for one cache)."""
    root = tmp_path_factory.mktemp("unpatched")
    return run_torchrun(hub, "download", ["--per-rank-home"], nproc=3,
                        env=_env(hub, root, PATCHLOAD="0"), timeout_s=JOB_TIMEOUT_S).check_ok()


@pytest.fixture(scope="module")
def single_process_jobs(hub: LoopbackHub, tmp_path_factory: pytest.TempPathFactory
                        ) -> dict[str, Job]:
    """World size 1 (plain ``python download.py``, no launcher), patched and unpatched."""
    jobs = {}
    for label, switch in (("unpatched", "0"), ("patched", "1")):
        root = tmp_path_factory.mktemp(f"single-{label}")
        jobs[label] = run_plain(hub, "download", [], env=_env(hub, root, PATCHLOAD=switch),
                                timeout_s=JOB_TIMEOUT_S).check_ok()
    return jobs


# --- 1. cold cache, N=3 ---------------------------------------------------------------------------
# Also in the transformers 4.x subset (``-m tf4``, see the Makefile).

@pytest.mark.tf4
@pytest.mark.timeout(300)
def test_cold_cache_each_file_fetched_once(cold_job: Job, folders: dict[str, Path]) -> None:
    gets = gets_per_file(cold_job.requests)
    assert gets, cold_job.describe()
    assert {count for count in gets.values()} == {1}, gets
    # Every file the direct calls ask for, and every file of the snapshot, came down once.
    served = sorted(p.relative_to(folders["dl/snap"]).as_posix()
                    for p in folders["dl/snap"].rglob("*") if p.is_file())
    assert sorted(f for (repo, f) in gets if repo == "dl/snap") == served
    assert sorted(f for (repo, f) in gets if repo == "dl/file") == [
        "config.json", "model.safetensors", "tokenizer.json"]
    pair = {f for (repo, f) in gets if repo == "dl/pair"}
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= pair
    assert {repo for (repo, _) in gets} == set(DOWNLOAD_REPOS)


@pytest.mark.tf4
@pytest.mark.timeout(300)
def test_cold_cache_followers_make_zero_requests(cold_job: Job) -> None:
    assert all(r.rank is not None for r in cold_job.requests), \
        [r for r in cold_job.requests if r.rank is None]
    for step in STEPS:
        window = cold_job.window(step)
        ranks = _ranks_with_requests(window)
        # Rank 0 leads every call it makes (deterministic leadership: coordination.rank0).
        assert ranks == {0}, f"{step}: requests by ranks {ranks}: {window}"
        repos = {r.repo_id for r in window}
        assert repos == {"dl/" + STEP_REPO[step]}, f"{step}: {repos}"
    # Every request of the job fell inside one of the steps' windows.
    in_windows = sum(len(cold_job.window(step)) for step in STEPS)
    assert in_windows == len(cold_job.requests)


@pytest.mark.tf4
@pytest.mark.timeout(300)
def test_cold_cache_every_rank_gets_the_same_result(cold_job: Job,
                                                    reference: dict[str, Any]) -> None:
    for step in STEPS:
        _assert_same_on_every_rank(cold_job, step)
    model = _values(cold_job, "model")[0]["fingerprint"]
    assert model["tensors"] == reference["steps"]["llama"]["fingerprint"]["tensors"]
    assert model["name_or_path"] == "dl/pair"
    assert _values(cold_job, "tokenizer")[0]["ids"]


# --- 6, 7: rank-0-first pattern; init_process_group before / after / never ------------------------

@pytest.mark.timeout(300)
def test_rank0_first_then_barrier_completes(rank0_first_job: Job) -> None:
    for step in STEPS:
        _assert_same_on_every_rank(rank0_first_job, step)
        window = rank0_first_job.window(step)
        assert _ranks_with_requests(window) == {0}, f"{step}: {window}"
    assert {r.rank for r in rank0_first_job.requests} == {0}
    assert {count for count in gets_per_file(rank0_first_job.requests).values()} == {1}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("when", ["never", "before", "after"])
def test_init_process_group_before_after_or_never(when: str, request: pytest.FixtureRequest
                                                  ) -> None:
    job: Job = request.getfixturevalue({"never": "cold_job", "before": "rank0_first_job",
                                        "after": "ratelimited_job"}[when])
    for rank, report in job.ranks.items():
        assert report["installed"] is True
        if when == "never":
            assert "all_reduce" not in report
        else:  # the user's own group still works after patchload's calls
            assert report["all_reduce"] == report["expected_all_reduce"], rank
        for step, record in report["steps"].items():
            assert record.get("ok"), f"rank {rank} {step}: {record.get('error')}"
    for step in job.ranks[0]["steps"]:
        assert _ranks_with_requests(job.window(step)) == {0}, step


# --- 5. 429 + Retry-After --------------------------------------------------------------------------

@pytest.mark.timeout(300)
def test_rate_limited_leader_retries_followers_wait(ratelimited_job: Job) -> None:
    job = ratelimited_job
    rl_steps = ("model", "tokenizer", "hf_hub_download:config.json")
    for step in rl_steps:
        _assert_same_on_every_rank(job, step)
    limited = [r for r in job.requests if r.status == 429]
    assert sorted((r.repo_id, r.filename) for r in limited) == [
        ("rl/file", "config.json"), ("rl/pair", "model.safetensors")]
    for hit in limited:
        # The same rank (the leader) retried after Retry-After and got the file.
        retries = [r for r in job.requests if (r.repo_id, r.filename, r.method) ==
                   (hit.repo_id, hit.filename, "GET") and r.status == 200]
        assert [r.rank for r in retries] == [hit.rank], (hit, retries)
        assert retries[0].time - hit.time >= 0.9, (hit, retries)
    for step in rl_steps:
        assert _ranks_with_requests(job.window(step)) == {0}, step
    assert {count for count in gets_per_file(job.requests).values()} == {1}


# --- 2. two simulated nodes ---------------------------------------------------------------------

def _node(rank: int) -> int:
    return rank // 2


def _check_nodes(job: Job) -> None:
    """The ranks ran on the hosts the job asked for, and no follower attached to shared
    memory of another node (the model step's followers on each node attach to their node's)."""
    node_of = {rank: _node(rank) for rank in job.ranks}
    _nodes.check_hosts(job.ranks, node_of, job.extra["hosts"])
    _nodes.check_attached_within_nodes(job.ranks, node_of)


@pytest.mark.timeout(300)
def test_two_nodes_own_caches_fetch_once_per_node(two_nodes_own_homes: Job) -> None:
    job = two_nodes_own_homes
    assert sorted(job.ranks) == [0, 1, 2, 3]
    _check_nodes(job)
    # The job decided once: every rank, node-local caches.
    assert {rank: report["scopes"] for rank, report in job.ranks.items()} == \
        {rank: ["node"] for rank in range(4)}
    for rank, report in job.ranks.items():
        assert f"node {_node(rank)}/2" in report["topology"], report["topology"]
    for step in STEPS:
        _assert_same_on_every_rank(job, step)
        window = job.window(step)
        per_node = collections.defaultdict(set)
        for r in window:
            per_node[_node(r.rank)].add(r.rank)
        assert sorted(per_node) == [0, 1], f"{step}: {window}"
        # Each node's lowest rank leads its node's calls.
        assert dict(per_node) == {0: {0}, 1: {2}}, f"{step}: {dict(per_node)}"
    per_node_gets = collections.Counter((_node(r.rank), r.repo_id, r.filename)
                                        for r in job.requests
                                        if r.method == "GET" and r.filename and r.status == 200)
    assert set(per_node_gets.values()) == {1}, per_node_gets
    files = {(repo, f) for (_, repo, f) in per_node_gets}
    assert {(n, repo, f) for n in (0, 1) for (repo, f) in files} == set(per_node_gets)


@pytest.mark.timeout(300)
def test_two_nodes_shared_cache_fetch_once_in_all(two_nodes_shared_home: Job) -> None:
    job = two_nodes_shared_home
    assert sorted(job.ranks) == [0, 1, 2, 3]
    _check_nodes(job)
    assert {rank: report["scopes"] for rank, report in job.ranks.items()} == \
        {rank: ["job"] for rank in range(4)}
    for step in STEPS:
        _assert_same_on_every_rank(job, step)
        window = job.window(step)
        assert _ranks_with_requests(window) == {0}, f"{step}: {window}"
    assert {count for count in gets_per_file(job.requests).values()} == {1}


# --- 3, 13. errors on the leader -------------------------------------------------------------------

# Steps whose plain call fails at once (the 500 and closed-port steps first go through
# huggingface_hub's own retries with backoff, about 23 s per lookup, on the leader as in a plain
# call; with peft installed, transformers' from_pretrained first looks up adapter_config.json
# too, so the plain call retries twice: about 46 s).
FAST_FAILURES = ("missing_model", "missing_file", "gated_model", "gated_file", "corrupt_model",
                 "truncated_model")
EXPECTED_CLASS = {"missing_model": "OSError", "missing_file": "RepositoryNotFoundError",
                  "gated_model": "OSError", "gated_file": "GatedRepoError",
                  "server_error_model": "OSError", "closed_port_model": "OSError"}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("step", ["missing_model", "missing_file", "gated_model", "gated_file",
                                  "server_error_model", "closed_port_model"])
def test_leader_error_reaches_every_rank(step: str, request: pytest.FixtureRequest) -> None:
    job: Job = request.getfixturevalue("closed_port_job" if step == "closed_port_model"
                                       else "errors_job")
    errors = check_same_error_everywhere(job, step)
    assert {e["type"] for e in errors.values()} == {EXPECTED_CLASS[step]}
    # Bounded, not a speed figure: huggingface_hub retries a 500 or a closed port with backoff
    # (about 23 s a file by default, 2.3 s in these jobs: PLT_HUB_WAIT_SCALE; and with peft
    # installed transformers also looks up adapter_config.json); the bound leaves room for a
    # loaded machine. Followers still raise within 10 s of the leader (checked above).
    limit_s = 10.0 if step in FAST_FAILURES else 120.0
    assert max(e["elapsed_s"] for e in errors.values()) < limit_s, errors
    # Followers never touch the network: the leaders alone made the step's requests (a rank
    # that arrived after an attempt failed leads one of its own, as its plain call would).
    window = job.window(step)
    leaders = {r for r, e in errors.items() if not e["follower"]}
    assert _ranks_with_requests(window) <= leaders, window
    if step == "closed_port_model":
        assert window == []  # nothing reached the hub
    else:
        assert window, step


@pytest.mark.timeout(300)
def test_missing_repo_message(errors_job: Job) -> None:
    for rank, report in errors_job.ranks.items():
        assert MISSING in report["steps"]["missing_model"]["error"]["message"]
        assert "Repository Not Found" in report["steps"]["missing_file"]["error"]["message"]


# --- 4. leader SIGKILLed mid-download --------------------------------------------------------------

@pytest.mark.timeout(180)
def test_leader_killed_mid_download_followers_raise(hub: LoopbackHub, tmp_path: Path) -> None:
    import torch.distributed as dist

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    env = _env(hub, tmp_path, PATCHLOAD_HEARTBEAT="1")
    t0 = time.time()
    procs, logs = start_ranks("download", ["--prefix", "stall/", "--steps", "model",
                                           "--no-barrier"],
                              world_size=3, store_port=port, env=env)
    killed = None
    deadline = time.monotonic() + 90
    try:
        while killed is None and time.monotonic() < deadline:
            for rank, proc in enumerate(procs):
                try:
                    files = psutil.Process(proc.pid).open_files()
                except psutil.Error:
                    continue
                if any(f.path.endswith(".incomplete") for f in files):
                    os.kill(proc.pid, signal.SIGKILL)
                    killed = (rank, time.time())
                    break
            time.sleep(0.05)
        assert killed is not None, "no rank started downloading the weights"
        job = wait_ranks(hub, procs, logs, t0, timeout_s=90)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        del store
    leader, t_kill = killed
    assert job.returncodes[leader] == -signal.SIGKILL
    followers = [r for r in range(3) if r != leader]
    for rank in followers:
        assert job.returncodes[rank] == 0, job.describe()
        record = job.ranks[rank]["steps"]["model"]
        assert not record.get("ok"), record
        error = record["error"]
        assert error["type"] == "LeaderFailedError", error
        assert error["leader_rank"] == leader, error
        assert f"leader rank {leader}" in error["message"], error
        assert error["t_raised"] - t_kill < 30.0, (error, t_kill)
    # Only the leader asked the hub for anything.
    assert {r.rank for r in job.requests} == {leader}, job.requests


# --- 8. PATCHLOAD=0 and world size 1 ---------------------------------------------------------------

@pytest.mark.timeout(300)
def test_patchload_off_each_rank_requests_like_unpatched(unpatched_job: Job,
                                                         single_process_jobs: dict[str, Job]
                                                         ) -> None:
    expected = request_signature(single_process_jobs["unpatched"].requests)
    assert expected
    for rank in range(3):
        report = unpatched_job.ranks[rank]
        assert report["installed"] is False
        mine = request_signature(r for r in unpatched_job.requests if r.rank == rank)
        assert mine == expected, f"rank {rank}: {mine - expected} extra, {expected - mine} missing"
    for step in STEPS:
        _assert_same_on_every_rank(unpatched_job, step)


@pytest.mark.timeout(300)
def test_world_size_1_identical_to_unpatched(single_process_jobs: dict[str, Job]) -> None:
    plain, patched = single_process_jobs["unpatched"], single_process_jobs["patched"]
    assert plain.ranks[0]["installed"] is False and patched.ranks[0]["installed"] is True
    assert request_signature(patched.requests) == request_signature(plain.requests)
    for step in STEPS:
        a, b = plain.ranks[0]["steps"][step], patched.ranks[0]["steps"][step]
        assert a.get("ok") and b.get("ok"), (a.get("error"), b.get("error"))
        if step == "model":
            assert diff_fingerprints(b["value"]["fingerprint"], a["value"]["fingerprint"]) == []
        else:
            assert a["value"] == b["value"], step
