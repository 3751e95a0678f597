"""Load once: followers receive the leader's weights and end bitwise identical to a plain load.

Real processes only: torchrun jobs on CPU (gloo) run ``tests/workers/load.py``, which loads every
case (tiny llama tied/untied/sharded/bf16, T5 fp16/bf16, GPT-2, BERT, the custom model with a
non-persistent buffer, mismatched dtypes across ranks) and reports a fingerprint of each model
(sha256 of every named parameter and buffer, dtypes, ties, flags, configs) plus the safetensors
files it opened. The reference is a plain load in a ``PATCHLOAD=0`` process (conftest).
"""

from __future__ import annotations

import math
import re
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

import _nodes
from _launch import (TRANSFORMERS_4, Job, check_same_error_everywhere, diff_fingerprints,
                     follower_checkpoint, job_env, request_signature, run_plain, run_torchrun,
                     step_records)
from conftest import CONCURRENT_REPOS, LOAD_CASES, REFERENCE_ONLY_CASES

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="torchrun jobs with /proc and memfd: Linux only")

JOB_TIMEOUT_S = 240
N = 3


def _env(hub: Any, root: Path, **extra: str) -> dict[str, str]:
    return job_env(hub.endpoint, root / "hf", root / "out", **extra)


# The shm job's tests are also the transformers 4.x subset (``-m tf4``, see the Makefile).
@pytest.fixture(scope="module", params=[pytest.param("shm", marks=pytest.mark.tf4), "collective"])
def transport_job(request: pytest.FixtureRequest, hub: Any,
                  tmp_path_factory: pytest.TempPathFactory) -> Job:
    """N=3: every load case, then (process group initialised after the loads) an SGD step and
    copy-on-write checks, then a tail where only rank 0 loads; with the default transport
    (shared memory) or ``PATCHLOAD_TRANSPORT=collective``."""
    root = tmp_path_factory.mktemp(f"load-{request.param}")
    extra = {"PATCHLOAD_TRANSPORT": "collective"} if request.param == "collective" else {}
    job = run_torchrun(hub, "load", ["--cases", ",".join(LOAD_CASES), "--extras",
                                     "--rank0-tail"],
                       nproc=N, env=_env(hub, root, **extra), timeout_s=JOB_TIMEOUT_S)
    job.extra["transport"] = request.param
    return job.check_ok()


@pytest.fixture(scope="module")
def minilm_job(hub: Any, tmp_path_factory: pytest.TempPathFactory) -> Job:
    """N=3: the real all-MiniLM-L6-v2 through SentenceTransformer, then AutoModel."""
    root = tmp_path_factory.mktemp("minilm")
    return run_torchrun(hub, "load", ["--minilm"], nproc=N, env=_env(hub, root),
                        timeout_s=JOB_TIMEOUT_S).check_ok()


@pytest.fixture(scope="module")
def broadcast_off_job(hub: Any, tmp_path_factory: pytest.TempPathFactory) -> Job:
    """N=3 with ``PATCHLOAD_BROADCAST=0``: downloads coordinated, every rank reads weights."""
    root = tmp_path_factory.mktemp("broadcast-off")
    return run_torchrun(hub, "load", ["--cases", "llama,llama_tied,llama_sharded,custom"],
                        nproc=N, env=_env(hub, root, PATCHLOAD_BROADCAST="0"),
                        timeout_s=JOB_TIMEOUT_S).check_ok()


@pytest.fixture(scope="module")
def single_process_job(hub: Any, tmp_path_factory: pytest.TempPathFactory) -> Job:
    """World size 1 (plain ``python load.py``), patched: same calls as the reference."""
    root = tmp_path_factory.mktemp("load-single")
    return run_plain(hub, "load", ["--cases", ",".join(LOAD_CASES + REFERENCE_ONLY_CASES),
                                   "--reference", "--minilm"],
                     env=_env(hub, root), timeout_s=JOB_TIMEOUT_S).check_ok()


# --- 9. bitwise equality with a plain load, both transports -------------------------------------

@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", LOAD_CASES)
def test_every_rank_equals_plain_load(transport_job: Job, reference: dict[str, Any],
                                      case: str) -> None:
    for rank, record in step_records(transport_job, case).items():
        want = reference["steps"][record["ref"]]
        diffs = diff_fingerprints(record["fingerprint"], want["fingerprint"])
        assert diffs == [], f"rank {rank} {case} ({transport_job.extra['transport']}):\n" + \
            "\n".join(diffs)
        assert record["tied"] == want["tied"], (rank, case)


@pytest.mark.tf4
@pytest.mark.timeout(400)
def test_cases_cover_what_they_claim(reference: dict[str, Any]) -> None:
    steps = reference["steps"]
    assert steps["llama_tied"]["tied"] is True and steps["llama"]["tied"] is False
    assert ["lm_head.weight", "model.embed_tokens.weight"] in \
        steps["llama_tied"]["fingerprint"]["ties"]
    assert len(steps["llama_sharded"]["checkpoint"]["files"]) > 1
    dtypes = {case: {t["dtype"] for t in steps[case]["fingerprint"]["tensors"].values()}
              for case in ("bf16_default", "bf16_bf16", "bf16_auto", "t5_fp16", "t5_bf16")}
    assert "torch.bfloat16" in dtypes["bf16_bf16"] and "torch.bfloat16" in dtypes["bf16_auto"]
    # T5 keeps ``wo`` in fp32 in an fp16 load (``_keep_in_fp32_modules``), not in a bf16 one
    for case, half, wo in (("t5_fp16", "torch.float16", "torch.float32"),
                           ("t5_bf16", "torch.bfloat16", "torch.bfloat16")):
        tensors = steps[case]["fingerprint"]["tensors"]
        assert {t["dtype"] for n, t in tensors.items() if n.endswith("wo.weight")} == {wo}, case
        assert half in dtypes[case]
    assert "wo" in steps["t5_fp16"]["fingerprint"]["keep_in_fp32"]
    custom = steps["custom"]["fingerprint"]["tensors"]
    assert custom["scale"]["kind"] == "buffer" and custom["offset"]["kind"] == "buffer"
    assert steps["llama_as_bf16"]["fingerprint"]["dtype"] == "torch.bfloat16"
    assert steps["llama_f32"]["fingerprint"]["dtype"] == "torch.float32"


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", LOAD_CASES)
def test_followers_read_no_checkpoint_and_make_no_requests(transport_job: Job,
                                                           case: str) -> None:
    records = step_records(transport_job, case)
    readers = sorted(r for r, rec in records.items() if rec["checkpoint"]["reads"])
    non_readers = sorted(set(records) - set(readers))
    # Rank 0 leads every call it makes (coordination.rank0), run after run.
    if case == "mismatch":  # rank 2 (bf16) leads alone; ranks 0 and 1 (fp32) share rank 0
        assert readers == [0, 2], records
    else:
        assert readers == [0], {r: rec["checkpoint"] for r, rec in records.items()}
    expected = follower_checkpoint(records[readers[0]]["checkpoint"]["files"])
    for rank in non_readers:
        assert records[rank]["checkpoint"] == expected, rank
    # The leaders (the readers) made every request of the step; followers none.
    window = transport_job.window(case)
    assert {r.rank for r in window} <= set(readers), (case, window)
    assert window, case


# Cases whose load leaves every tensor a view of its safetensors file on transformers 5 (the
# checkpoint's dtype is the loaded one, key renames only): followers inside a node map the
# checkpoint files themselves, alongside the leader; every other follower takes the leader's
# tensors. (``mismatch``: ranks 0 and 1 load fp32 from an fp32 checkpoint; rank 2 leads alone.)
ALONGSIDE_CASES = ("llama", "llama_tied", "llama_sharded", "bf16_default", "bf16_bf16",
                   "bf16_auto", "gpt2", "bert", "custom", "mismatch")
_ALONGSIDE = "bytes of weights mapped from the checkpoint files"


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", LOAD_CASES)
def test_zero_copy_followers_load_alongside_their_leader(transport_job: Job, case: str) -> None:
    """A zero-copy load's followers (shm, transformers 5) map the checkpoint files the leader
    described and run transformers' own checkpoint step, while the leader loads: its leader
    shares nothing. Converting loads, transformers 4 and the collective transport take the
    leader's tensors. (Equality with plain and "no checkpoint read" are the tests above.)"""
    records = step_records(transport_job, case)
    alongside = (transport_job.extra["transport"] == "shm" and not TRANSFORMERS_4
                 and case in ALONGSIDE_CASES)
    for rank, record in records.items():
        lines = "\n".join(record["patchload"])
        if "followed rank" not in lines:
            continue
        assert ("bytes of weights mapped" in lines or "bytes of weights received" in lines), \
            (rank, lines)
        assert (_ALONGSIDE in lines) == alongside, (case, rank, lines)
    followers = [r for r, rec in records.items() if "followed rank" in "".join(rec["patchload"])]
    assert len(followers) == (1 if case == "mismatch" else N - 1), (case, followers)


@pytest.fixture(scope="module")
def slow_leader_job(hub: Any, tmp_path_factory: pytest.TempPathFactory) -> Job:
    """N=3, ``load.py --slow-leader``: rank 0 sleeps after reading its generation config (after
    the weights), then fails before reading it."""
    root = tmp_path_factory.mktemp("slow-leader")
    return run_torchrun(hub, "load", ["--slow-leader"], nproc=N, env=_env(hub, root),
                        timeout_s=JOB_TIMEOUT_S).check_ok()


@pytest.mark.tf4
@pytest.mark.timeout(400)
def test_followers_finish_their_load_while_the_leader_finishes_its_own(
        slow_leader_job: Job, reference: dict[str, Any]) -> None:
    """Where followers load alongside their leader (zero-copy), what the load reads after the
    weights (the generation config) is read once the leader's same hub call returned, not once
    its whole load did: rank 0 sleeps 3 s after reading it, and its followers have read theirs
    by then. Every rank's model equals plain."""
    records = step_records(slow_leader_job, "slow_after_weights")
    for rank, record in records.items():
        assert diff_fingerprints(record["fingerprint"],
                                 reference["steps"]["llama"]["fingerprint"]) == [], rank
    if TRANSFORMERS_4:
        pytest.skip("transformers 4: followers take the leader's tensors, after its outcome "
                    "(nothing runs alongside it); equality with plain checked above")
    leader_returned = records[0]["returned"]
    for rank in range(1, N):
        assert _ALONGSIDE in "\n".join(records[rank]["patchload"]), (rank, records[rank])
        ahead = leader_returned - records[rank]["generation_config_read"]
        assert ahead > 1.5, f"rank {rank} read its generation config {ahead:.2f} s before " \
                            "the leader returned (it sleeps 3 s after reading its own)"


@pytest.mark.tf4
@pytest.mark.timeout(400)
def test_a_leader_failing_after_its_weights_fails_its_followers_alike(
        slow_leader_job: Job) -> None:
    """Rank 0 raises after its weights (before its generation config): followers, which may
    have loaded every weight alongside it, raise its error as a plain load would."""
    errors = check_same_error_everywhere(slow_leader_job, "fails_after_weights", within_s=5)
    for rank, error in errors.items():
        assert error["type"] == "RuntimeError", (rank, error)
        assert error["message"] == "injected: rank 0 fails after its weights", (rank, error)
        assert rank == 0 or error["leader_rank"] == 0 and \
            "failed on the leader; this is its error" in error["notes"][0], (rank, error)


def _pool_threads(record: dict[str, Any]) -> list[str]:
    return [name for name in record["threads"]
            if name.startswith("convert_and_load_state_dict_in_model:")]


@pytest.mark.timeout(400)
@pytest.mark.parametrize("case", LOAD_CASES)
def test_a_load_of_views_materialises_in_the_calling_thread(transport_job: Job,
                                                            reference: dict[str, Any],
                                                            case: str) -> None:
    """Where every tensor stays a view of its file (the zero-copy loads above), the leader and
    its followers materialise them without transformers' loading pool: its threads would only
    contend for the GIL (1.1-1.2x a plain load's time at N = 2 on 2 cores). Every other
    leader uses the pool as a plain load does (its followers take its tensors)."""
    if TRANSFORMERS_4:
        pytest.skip("transformers 4 has no loading pool")
    views = transport_job.extra["transport"] == "shm" and case in ALONGSIDE_CASES
    for rank, record in step_records(transport_job, case).items():
        assert _pool_threads(reference["steps"][record["ref"]]), \
            (case, "the plain load started no loading thread")
        # mismatch: rank 2 alone converts to bf16
        if views and record["ref"] != "llama_as_bf16":
            assert _pool_threads(record) == [], (case, rank, record["threads"])
        elif "followed rank" not in "".join(record["patchload"]):  # a leader, or alone
            assert _pool_threads(record), (case, rank, record["threads"])


# --- 11. training step, ties, copy-on-write ---------------------------------------------------------

@pytest.mark.timeout(400)
def test_sgd_step_identical_on_every_rank(transport_job: Job, reference: dict[str, Any]) -> None:
    want = reference["steps"]["sgd"]
    for rank, report in transport_job.ranks.items():
        got = report["steps"]["sgd"]
        assert got["tied"] is True, rank
        assert got["loss"] == want["loss"], rank
        assert diff_fingerprints(got["fingerprint"], want["fingerprint"]) == [], rank


@pytest.mark.timeout(400)
def test_write_on_one_rank_is_private(transport_job: Job) -> None:
    cow = {rank: report["cow"] for rank, report in transport_job.ranks.items()}
    for round_name in ("follower_writes", "leader_writes"):
        rounds = {rank: c[round_name] for rank, c in cow.items()}
        writer = rounds[0]["writer"]
        assert all(r["writer"] == writer for r in rounds.values())
        assert len(rounds[0]["readers"]) == 1, rounds[0]
        leader = rounds[0]["readers"][0]
        assert (writer == leader) == (round_name == "leader_writes")
        befores = {r["before"]["embed"] for r in rounds.values()}
        assert len(befores) == 1, "ranks started from different weights"
        for rank, r in rounds.items():
            if rank == writer:
                assert r["after"]["embed"] != r["before"]["embed"]
                assert r["after"]["head"] != r["before"]["head"]
            else:
                assert r["after"] == r["before"], f"rank {writer}'s write showed on rank {rank}"


# --- 12. rank-0-only, broadcast off, mismatched arguments ----------------------------------------

@pytest.mark.timeout(400)
def test_rank0_alone_loads_and_the_job_ends(transport_job: Job, reference: dict[str, Any]
                                            ) -> None:
    for rank, report in transport_job.ranks.items():
        if rank != 0:
            assert report["tail"] == "exited"
    tail = transport_job.ranks[0]["steps"]["tail"]
    assert diff_fingerprints(tail["fingerprint"], reference["steps"]["gpt2"]["fingerprint"]) == []
    assert tail["elapsed_s"] < 30, tail


@pytest.mark.timeout(400)
def test_broadcast_off_coordinates_downloads_only(broadcast_off_job: Job,
                                                  reference: dict[str, Any]) -> None:
    job = broadcast_off_job
    for case in ("llama", "llama_tied", "llama_sharded", "custom"):
        records = step_records(job, case)
        for rank, record in records.items():
            assert diff_fingerprints(record["fingerprint"],
                                     reference["steps"][case]["fingerprint"]) == [], (rank, case)
            assert record["checkpoint"]["opens"] >= 1 and record["checkpoint"]["reads"] > 0, \
                (rank, case, record["checkpoint"])  # every rank reads its own weights
        window = job.window(case)
        assert len({r.rank for r in window}) == 1, (case, window)


# --- concurrent loads in threads (issue 30 item 6) ------------------------------------------------

CONCURRENT_ROUNDS = 2


@pytest.fixture(scope="module")
def concurrent_jobs(hub: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Job]:
    """N=3, each rank loading CONCURRENT_REPOS at once (main thread and two threads of its
    own), CONCURRENT_ROUNDS rounds: plain, and patched with ``PATCHLOAD_TRANSPORT=collective``
    (every call a broadcast over a private gloo group built from the store, while the process's
    other threads wait on the store and its heartbeat beats). The group timeout is cut to 60 s,
    so a job that stalls on it still ends within the test's bound."""
    jobs = {}
    for side, extra in (("plain", {"PATCHLOAD": "0"}),
                        ("collective", {"PATCHLOAD_TRANSPORT": "collective",
                                        "PATCHLOAD_GROUP_TIMEOUT": "60"})):
        root = tmp_path_factory.mktemp(f"concurrent-{side}")
        jobs[side] = run_torchrun(hub, "load", ["--concurrent", ",".join(CONCURRENT_REPOS),
                                                "--rounds", str(CONCURRENT_ROUNDS)],
                                  nproc=N, env=_env(hub, root, **extra),
                                  timeout_s=JOB_TIMEOUT_S).check_ok()
    return jobs


@pytest.mark.timeout(600)
def test_concurrent_loads_in_threads_equal_plain_in_bounded_time(
        concurrent_jobs: dict[str, Job]) -> None:
    """Every rank's every concurrent load equals the plain run's, and no round takes more than
    20 s beyond the plain one's: no thread's store wait (a private group's rendezvous among
    them) holds up another thread's store requests or the heartbeat (which stalled every round
    until the group timeout, then failed followers with "no heartbeat")."""
    plain, patched = concurrent_jobs["plain"], concurrent_jobs["collective"]
    for number in range(CONCURRENT_ROUNDS):
        step = f"concurrent-{number}"
        want, got = step_records(plain, step), step_records(patched, step)
        for rank in range(N):
            for repo in CONCURRENT_REPOS:
                a, b = want[rank]["repos"][repo], got[rank]["repos"][repo]
                assert a["ok"], (rank, step, repo, a)
                assert b["ok"], f"rank {rank} {step} {repo}: {b.get('error')}"
                assert diff_fingerprints(b["fingerprint"], a["fingerprint"]) == [], \
                    (rank, step, repo)
        slowest = {side: max(r["elapsed_s"] for r in records.values())
                   for side, records in (("plain", want), ("collective", got))}
        print(f"{step}: slowest rank {slowest['plain']:.1f} s plain, "
              f"{slowest['collective']:.1f} s collective")
        assert slowest["collective"] < slowest["plain"] + 20, (step, slowest)


# --- 10. the real all-MiniLM-L6-v2 ---------------------------------------------------------------

@pytest.mark.tf4
@pytest.mark.timeout(400)
def test_minilm_embeddings_identical_and_equal_to_plain(minilm_job: Job,
                                                        reference: dict[str, Any]) -> None:
    want_st = reference["steps"]["minilm_st"]
    want_auto = reference["steps"]["minilm_auto"]
    for rank, report in minilm_job.ranks.items():
        st, auto = report["steps"]["minilm_st"], report["steps"]["minilm_auto"]
        assert st["embeddings_sha256"] == want_st["embeddings_sha256"], rank
        assert auto["hidden_sha256"] == want_auto["hidden_sha256"], rank
        assert diff_fingerprints(st["fingerprint"], want_st["fingerprint"]) == [], rank
        assert diff_fingerprints(auto["fingerprint"], want_auto["fingerprint"]) == [], rank


def _minilm_records(job: Job, step: str) -> dict[int, dict[str, Any]]:
    return {rank: report["steps"][step] for rank, report in sorted(job.ranks.items())}


@pytest.mark.tf4
@pytest.mark.timeout(400)
@pytest.mark.parametrize("step", ["minilm_st", "minilm_auto"])
def test_minilm_followers_read_no_tensor_and_make_no_requests(minilm_job: Job,
                                                              step: str) -> None:
    records = _minilm_records(minilm_job, step)
    readers = [r for r, rec in records.items() if rec["checkpoint"]["reads"]]
    assert len(readers) == 1, {r: rec["checkpoint"] for r, rec in records.items()}
    for rank, record in records.items():
        if rank not in readers:
            assert record["checkpoint"]["reads"] == 0, (rank, record["checkpoint"])
    window = minilm_job.window(step)
    assert {r.rank for r in window} <= set(readers), window
    if step == "minilm_st":
        assert window


@pytest.mark.tf4
@pytest.mark.timeout(400)
@pytest.mark.parametrize("step", ["minilm_st", "minilm_auto"])
def test_minilm_followers_open_no_checkpoint(minilm_job: Job, step: str) -> None:
    """Followers open no checkpoint file (transformers 4.x: only to read its header)."""
    records = _minilm_records(minilm_job, step)
    readers = [r for r, rec in records.items() if rec["checkpoint"]["reads"]]
    assert len(readers) == 1, {r: rec["checkpoint"] for r, rec in records.items()}
    expected = follower_checkpoint(records[readers[0]]["checkpoint"]["files"])
    for rank, record in records.items():
        if rank not in readers:
            assert record["checkpoint"] == expected, (rank, record["checkpoint"])


# --- 13. corrupt checkpoint on the leader ---------------------------------------------------------

@pytest.mark.timeout(300)
@pytest.mark.parametrize("step", ["corrupt_model", "truncated_model"])
def test_corrupt_checkpoint_every_rank_raises_the_same(errors_job: Job, step: str) -> None:
    errors = check_same_error_everywhere(errors_job, step)
    assert max(e["elapsed_s"] for e in errors.values()) < 10.0, errors
    assert {e["type"] for e in errors.values()} == {"SafetensorError"}


# --- hierarchy: two simulated nodes ---------------------------------------------------------------

NODE_CASES = ("llama_tied", "bf16_auto", "custom", "llama_as_bf16", "big_as_f32")


@pytest.fixture(scope="module", params=[(cache, hosts) for hosts in _nodes.HOSTS
                                        for cache in ("shared-cache", "own-caches")],
                ids=lambda p: "-".join(p))
def two_nodes_job(request: pytest.FixtureRequest, hub: Any,
                  tmp_path_factory: pytest.TempPathFactory) -> Job:
    """2 simulated nodes x 2 ranks (two torchrun agents) loading NODE_CASES, on one HF_HOME (a
    shared filesystem) or one HF_HOME per node; everything else on auto. The nodes share this
    host's kernel view, or each runs in namespaces of its own (``tests/_nodes.py``: own
    hostname, pids, /proc, /tmp, /dev/shm; its own cache is then one path on each node's
    private disk)."""
    cache, hosts = request.param
    if hosts == "namespaced" and (reason := _nodes.unavailable()):
        pytest.skip(reason)
    root = tmp_path_factory.mktemp(f"load-{cache}-{hosts}")
    if cache == "shared-cache":
        homes = [root / "hf"] * 2
    elif hosts == "namespaced":
        homes = [_nodes.NODE_LOCAL / "hf"] * 2
    else:
        homes = [root / "hf-node0", root / "hf-node1"]
    # Broadcast buckets far smaller than the big case's model, as the default 256 MiB ones are
    # beside real models (a sender stages one bucket at a time in private memory).
    envs = [job_env(hub.endpoint, home, root / "out", PLT_RECORD_ATTACHES="1",
                    PATCHLOAD_LOG_LEVEL="DEBUG", PATCHLOAD_BUCKET_MB="16") for home in homes]
    job = run_torchrun(hub, "load", ["--cases", ",".join(NODE_CASES)], nproc=2, nnodes=2,
                       env=envs, timeout_s=JOB_TIMEOUT_S, hosts=hosts)
    job.extra.update(cache=cache, hosts=hosts)
    return job.check_ok()


@pytest.mark.timeout(400)
def test_two_nodes_read_the_checkpoint_once_per_cache(two_nodes_job: Job,
                                                      reference: dict[str, Any]) -> None:
    """Shared cache: one rank reads, the other node's leader receives it by broadcast and
    shares it in its node. Own caches: each node's leader reads its own disk. Either way,
    followers attach only to shared memory of their own node, and on each node one does."""
    node_of = {rank: rank // 2 for rank in two_nodes_job.ranks}
    _nodes.check_hosts(two_nodes_job.ranks, node_of, two_nodes_job.extra["hosts"])
    attached = _nodes.check_attached_within_nodes(two_nodes_job.ranks, node_of)
    for node in (0, 1):
        assert any(attached[r] for r in attached if node_of[r] == node), (node, attached)
    for case in NODE_CASES:
        records = step_records(two_nodes_job, case)
        for rank, record in records.items():
            want = reference["steps"][record["ref"]]["fingerprint"]
            assert diff_fingerprints(record["fingerprint"], want) == [], (rank, case)
        readers = sorted(r for r, rec in records.items() if rec["checkpoint"]["opens"])
        if two_nodes_job.extra["cache"] == "shared-cache":
            assert len(readers) == 1, (case, {r: rec["checkpoint"] for r, rec in records.items()})
        else:
            assert sorted(node_of[r] for r in readers) == [0, 1], (case, readers)
        window = two_nodes_job.window(case)
        assert {r.rank for r in window} <= set(readers), (case, window)
    output = "\n".join(two_nodes_job.outputs)
    shares = {rank: re.findall(rf"\[rank {rank}/4\][^\n]*: shared \d+ tensors \((\d+) bytes\) "
                               r"with this node's ranks \((\d+) bytes copied", output)
              for rank in (0, 2)}
    reading = (0,) if two_nodes_job.extra["cache"] == "shared-cache" else (0, 2)
    # With own caches each node leader reads its disk: a zero-copy load's followers map the
    # checkpoint files alongside it (it shares nothing); the node leader that receives a
    # broadcast shares every load in its node.
    shared_cases = NODE_CASES if two_nodes_job.extra["cache"] == "shared-cache" else \
        tuple(c for c in NODE_CASES if c not in ALONGSIDE_CASES)
    for case in NODE_CASES:
        for rank in (1, 3):
            lines = "\n".join(step_records(two_nodes_job, case)[rank]["patchload"])
            assert (_ALONGSIDE in lines) == (case not in shared_cases), (case, rank, lines)
    if two_nodes_job.extra["cache"] == "shared-cache":
        # Node 1's leader received the broadcast straight into the blob it shares: the node
        # holds one copy of the model, never a private one beside the blob. Only its own
        # non-persistent buffers are copied there (each rank computes those itself, as plain).
        assert len(shares[2]) == len(NODE_CASES), output[-3000:]
        assert all(10 * int(copied) < int(total) for total, copied in shares[2]), shares
    # A node leader that reads its disk (with the shared cache, the one that then broadcasts
    # to the other node) converts (llama_as_bf16, big_as_f32) straight into its node's blob:
    # only what the load did not make there (non-persistent buffers) is copied.
    for rank in reading:
        assert len(shares[rank]) == len(shared_cases), output[-3000:]
        assert all(10 * int(copied) < int(total) for total, copied in shares[rank]), shares
    # The node leaders' peak memory in the big converting load (bf16 on disk, 127 MB as fp32):
    # one copy of the model, never a private one beside the blob. Node 1's leader with the
    # shared cache receives the broadcast straight into its blob; every other node leader
    # downloads and reads its node's disk, converting into its blob (and, with the shared
    # cache, broadcasting from there), its resident memory then also counting the checkpoint's
    # file pages it read (half the model) and the download's buffers.
    records = step_records(two_nodes_job, "big_as_f32")
    loaded = _loaded_bytes(records[0]["fingerprint"])
    peaks = {rank: (records[rank]["memory"]["peak"] - records[rank]["memory"]["before"]) / loaded
             for rank in (0, 2)}
    print(f"{two_nodes_job.extra}: node leaders' peak memory in the load, x the model "
          f"({loaded / 2**20:.0f} MiB): "
          + ", ".join(f"rank {r}: {x:.2f}x" for r, x in peaks.items()))
    readers_bound = 1.1 + 0.5 + 0.1
    for rank, peak in peaks.items():
        receives = rank == 2 and two_nodes_job.extra["cache"] == "shared-cache"
        assert peak <= (1.1 if receives else readers_bound), (rank, peaks)


def _loaded_bytes(fingerprint: dict[str, Any]) -> int:
    """The bytes of a model's tensors (tied names counted once), from its fingerprint."""
    import torch

    tied = {name for group in fingerprint["ties"] for name in group[1:]}
    return sum(math.prod(t["shape"]) * getattr(torch, t["dtype"].removeprefix("torch.")).itemsize
               for name, t in fingerprint["tensors"].items() if name not in tied)


# --- two jobs on one node ------------------------------------------------------------------------

@pytest.mark.timeout(400)
def test_two_jobs_on_one_node_see_only_their_own_blobs(hub: Any, reference: dict[str, Any],
                                                       tmp_path: Path) -> None:
    """Two torchrun jobs at once on one HF_HOME, converting loads (memfd blobs) and zero-copy
    ones (the checkpoint files mapped alongside): each follower attaches only to tensors shared
    by a rank of its own job (the debug line names the sharing pid), and every rank equals a
    plain load."""
    cases = ("llama_as_bf16", "llama_tied")
    jobs: dict[str, Job] = {}

    def run(name: str) -> None:
        env = job_env(hub.endpoint, tmp_path / "hf", tmp_path / name, PATCHLOAD_LOG_LEVEL="DEBUG")
        jobs[name] = run_torchrun(hub, "load", ["--cases", ",".join(cases)], nproc=2, env=env,
                                  timeout_s=JOB_TIMEOUT_S)

    threads = [threading.Thread(target=run, args=(name,)) for name in ("a", "b")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for name, job in jobs.items():
        job.check_ok()
        own_pids = {report["pid"] for report in job.ranks.values()}
        attached = {int(pid) for text in job.outputs
                    for pid in re.findall(r"attached \d+ tensors shared by pid (\d+)", text)}
        assert attached, f"job {name}: no follower attached to shared tensors\n" + \
            job.describe()
        assert attached <= own_pids, (name, attached, own_pids)
        for case in cases:
            for rank, record in step_records(job, case).items():
                want = reference["steps"][record["ref"]]["fingerprint"]
                assert diff_fingerprints(record["fingerprint"], want) == [], (name, rank, case)


# --- 8. world size 1 -----------------------------------------------------------------------------

@pytest.mark.timeout(400)
def test_world_size_1_identical_to_plain_load(single_process_job: Job,
                                              reference_job: Job) -> None:
    got, want = single_process_job.ranks[0], reference_job.ranks[0]
    assert got["installed"] is True
    assert sorted(got["steps"]) == sorted(want["steps"])
    for step, record in want["steps"].items():
        if "fingerprint" in record:
            assert diff_fingerprints(got["steps"][step]["fingerprint"],
                                     record["fingerprint"]) == [], step
        if "checkpoint" in record:
            assert got["steps"][step]["checkpoint"] == record["checkpoint"], step
    assert request_signature(single_process_job.requests) == \
        request_signature(reference_job.requests)
