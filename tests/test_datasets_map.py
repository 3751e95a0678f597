"""``Dataset.map`` / ``filter`` under torchrun: a map with a cache file runs its function on
the node's leader only; the other ranks load the leader's cache file and get what their plain
call gets. Every map ``datasets`` would not reuse a cache file for runs on every rank, as plain.

Differential: the same 3-rank job (``tests/workers/datasets_map.py``: one ``load_dataset``,
then one map per step, barriers between steps) runs plain (``PATCHLOAD=0``), patched on a cold
cache and patched again on that warm cache; each rank's result (fingerprint, rows, features,
content hash, cache files under ``HF_HOME``) or exception class is compared with the same rank's
plain one. Each rank counts its function's calls in a file the function appends to.
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path
from typing import Any

import pytest

import _nodes
from _launch import (Job, check_same_error_everywhere, free_port, job_env, run_torchrun,
                     start_ranks, wait_ranks)
from patchload.testing import LoopbackHub

pytest.importorskip("datasets", reason="datasets is not installed (the `test` extra has it)")
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="torchrun jobs: Linux only")

# The function runs on the leader only.
# ``after_rank0``: ranks 1-2 start once rank 0's map returned (its cache file exists then).
COORDINATED = ("tokenize", "filter", "dict_map", "chained", "num_proc", "after_rank0",
               "hashed")
# datasets reuses no cache file for these (a random fingerprint, no cache file, a forced
# recompute): every rank computes, as plain.
PLAIN = ("unhashable", "in_memory", "no_cache_reuse")
STEPS = (*COORDINATED, *PLAIN, "no_update", "raises")
WHY = {"unhashable": "random fingerprint", "in_memory": "no cache file",
       "no_cache_reuse": "load_from_cache_file=False"}
JOB_TIMEOUT_S = 240
NPROC = 3
TRAIN_ROWS, TEST_ROWS = 40, 3  # the repo _write_repo builds
# Rows each coordinated step's function sees on a cold cache ("chained" maps train twice,
# "dict_map" both splits).
ROWS_MAPPED = {"tokenize": TRAIN_ROWS, "filter": TRAIN_ROWS, "dict_map": TRAIN_ROWS + TEST_ROWS,
               "chained": 2 * TRAIN_ROWS, "num_proc": TRAIN_ROWS, "after_rank0": TRAIN_ROWS,
               "hashed": TRAIN_ROWS}


def _write_repo(root: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = root / "map" / "data"
    data.mkdir(parents=True)
    texts = [f"text number {i}" + "!" * (i % 5) for i in range(TRAIN_ROWS)]
    pq.write_table(pa.table({"text": texts, "label": [i % 3 for i in range(TRAIN_ROWS)]}),
                   data / "train-00000-of-00001.parquet")
    pq.write_table(pa.table({"text": ["ab", "cd", "ef"], "label": [1, 2, 4]}),
                   data / "test-00000-of-00001.parquet")
    return root / "map"


@pytest.fixture(scope="module")
def map_hub(tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("ds-map-repo")
    folder = _write_repo(root)
    with LoopbackHub(log_path=root / "requests.jsonl") as hub:
        hub.add_repo("org/ds-map", folder, repo_type="dataset")
        hub.add_repo("org/ds-first", folder, repo_type="dataset")
        yield hub


def _run(hub: LoopbackHub, home: Path, out: Path, steps: tuple[str, ...] = STEPS,
         **extra: str) -> Job:
    out.mkdir(parents=True, exist_ok=True)
    env = job_env(hub.endpoint, home, out, **extra)
    job = run_torchrun(hub, "datasets_map", ["--steps", ",".join(steps)], nproc=NPROC, env=env,
                       timeout_s=JOB_TIMEOUT_S)
    assert job.returncodes == [0], "\n".join(job.outputs)
    return job


@pytest.fixture(scope="module")
def jobs(map_hub: LoopbackHub, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Job]:
    """``plain`` (PATCHLOAD=0), then ``cold`` and ``warm`` (patched, one cache for both)."""
    root = tmp_path_factory.mktemp("ds-map-jobs")
    return {
        "plain": _run(map_hub, root / "plain-home", root / "plain", PATCHLOAD="0"),
        "cold": _run(map_hub, root / "home", root / "cold"),
        "warm": _run(map_hub, root / "home", root / "warm"),
    }


def _record(job: Job, rank: int, step: str) -> dict[str, Any]:
    return job.ranks[rank]["steps"][step]


@pytest.mark.timeout(3 * JOB_TIMEOUT_S)
@pytest.mark.parametrize("cache", ["cold", "warm"])
@pytest.mark.parametrize("step", COORDINATED + PLAIN + ("no_update",))
def test_every_rank_maps_what_its_plain_call_maps(jobs: dict[str, Job], cache: str,
                                                  step: str) -> None:
    for rank in range(NPROC):
        plain, patched = _record(jobs["plain"], rank, step), _record(jobs[cache], rank, step)
        assert plain.get("ok"), (rank, plain.get("error"))
        assert patched.get("ok"), (rank, patched.get("error"))
        want, got = copy.deepcopy(plain["value"]), copy.deepcopy(patched["value"])
        if step in ("unhashable", "no_cache_reuse"):
            # A random fingerprint (and cache file) per call, plain or patched.
            for split in (want, got):
                for one in split.get("splits", {"": split.get("dataset")}).values():
                    one.pop("fingerprint"), one.pop("files")
        # fingerprint, rows, features, content hash, cache files (paths)
        assert got == want, (rank, step, cache)


@pytest.mark.timeout(3 * JOB_TIMEOUT_S)
@pytest.mark.parametrize("step", COORDINATED)
def test_the_function_runs_on_the_leader_only(jobs: dict[str, Job], step: str) -> None:
    cold = jobs["cold"]
    # Once per row the step maps, as a lone process on a cold cache (plain ranks race for the
    # splits of a DatasetDict: which one computes which split is timing, so no plain count).
    assert _record(cold, 0, step)["calls"] == ROWS_MAPPED[step], step
    for rank in range(1, NPROC):
        record = _record(cold, rank, step)
        assert record["calls"] == 0, (rank, step)
        assert any("followed its leader: loaded its cache file" in line
                   for line in record["lines"]), record["lines"]
    for rank in range(NPROC):  # warm: every rank loads the cache file, as plain does
        assert _record(jobs["warm"], rank, step)["calls"] == 0, (rank, step)


@pytest.mark.timeout(3 * JOB_TIMEOUT_S)
def test_a_coordinated_map_hashes_its_arguments_as_often_as_plain(jobs: dict[str, Job]) -> None:
    """datasets hashes a map's function and arguments once per call (its fingerprint); the
    probe's fingerprint is handed to the real call, so a patched rank hashes no more than a
    plain one (a function holding a large tokenizer takes a second or more to hash)."""
    for rank in range(NPROC):
        plain = _record(jobs["plain"], rank, "hashed")["hashes"]
        assert plain == 1, (rank, plain)
        for cache in ("cold", "warm"):
            assert _record(jobs[cache], rank, "hashed")["hashes"] == plain, (rank, cache)


@pytest.mark.timeout(3 * JOB_TIMEOUT_S)
@pytest.mark.parametrize("step", PLAIN)
def test_maps_datasets_would_not_cache_run_on_every_rank(jobs: dict[str, Job],
                                                         step: str) -> None:
    for rank in range(NPROC):
        record = _record(jobs["cold"], rank, step)
        assert record["calls"] == _record(jobs["plain"], rank, step)["calls"] > 0, (rank, step)
        assert not any("followed" in line for line in record["lines"]), record["lines"]
        assert any("Dataset.map: not coordinated" in line and WHY[step] in line
                   for line in record["lines"]), record["lines"]


@pytest.mark.timeout(3 * JOB_TIMEOUT_S)
def test_a_function_that_returns_nothing_runs_on_every_rank(jobs: dict[str, Job]) -> None:
    """datasets writes no cache file for it: each follower computes after its leader, as
    plain."""
    for rank in range(NPROC):
        record = _record(jobs["cold"], rank, "no_update")
        plain_calls = _record(jobs["plain"], rank, "no_update")["calls"]
        assert record["calls"] == plain_calls == TRAIN_ROWS, rank
        if rank:
            assert any("it wrote no cache file: computed here" in line
                       for line in record["lines"]), record["lines"]


@pytest.mark.timeout(3 * JOB_TIMEOUT_S)
def test_a_map_that_raises_on_the_leader_raises_the_plain_class_everywhere(
        jobs: dict[str, Job]) -> None:
    errors = check_same_error_everywhere(jobs["cold"], "raises")
    for rank in range(NPROC):
        plain = _record(jobs["plain"], rank, "raises")
        assert not plain.get("ok") and errors[rank]["type"] == plain["error"]["type"], rank
        assert plain["error"]["mro"][0] in errors[rank]["mro"]
    # The function ran once on each rank that led an attempt, never on a follower.
    assert [_record(jobs["cold"], r, "raises")["calls"] for r in range(NPROC)] == [
        0 if errors[r]["follower"] else 1 for r in range(NPROC)]
    assert [errors[r]["follower"] for r in range(NPROC)] == [False, True, True]


@pytest.mark.timeout(3 * JOB_TIMEOUT_S)
def test_patchload_off_leaves_map_alone(jobs: dict[str, Job]) -> None:
    for rank, report in jobs["plain"].ranks.items():
        assert not report["installed"] and not report["map_patched"], rank
    for rank, report in jobs["cold"].ranks.items():
        assert report["installed"] and report["map_patched"], rank


@pytest.mark.timeout(2 * JOB_TIMEOUT_S)
def test_leader_killed_during_map(map_hub: LoopbackHub,
                                  tmp_path_factory: pytest.TempPathFactory) -> None:
    """Rank 0 SIGKILLed inside its map's function: the other ranks end with the plain result
    (they compute, as plain ranks do) within 10 s of the kill."""
    import time

    import torch.distributed as dist

    root = tmp_path_factory.mktemp("ds-map-kill")
    results = {}
    for mode, extra in (("plain", {"PATCHLOAD": "0"}), ("patched", {})):
        out = root / mode
        env = job_env(map_hub.endpoint, root / f"home-{mode}", out, **extra)
        port = free_port()
        store = dist.TCPStore("127.0.0.1", port, world_size=-1, is_master=True,
                              wait_for_workers=False)
        try:
            t0 = time.time()
            procs, logs = start_ranks("datasets_map", ["--steps", "leader_killed"],
                                      world_size=NPROC, store_port=port, env=env)
            job = wait_ranks(map_hub, procs, logs, t0, JOB_TIMEOUT_S)
        finally:
            del store
        assert job.returncodes[0] == -9 and job.returncodes[1:] == [0] * (NPROC - 1), \
            "\n".join(job.outputs)
        results[mode] = (job, float((out / "killed-at").read_text()))
    (plain, _), (patched, killed_at) = results["plain"], results["patched"]
    assert sum(_record(patched, r, "leader_killed")["calls"] for r in range(1, NPROC)) >= TRAIN_ROWS
    for rank in range(1, NPROC):
        want, got = _record(plain, rank, "leader_killed"), _record(patched, rank, "leader_killed")
        assert want.get("ok") and got.get("ok"), (rank, got.get("error"))
        assert got["value"] == want["value"], rank
        # It computes (40 calls), or loads the file another follower computed first (0), as a
        # plain rank after another does.
        assert got["calls"] in (0, TRAIN_ROWS), rank
        assert got["t1"] - killed_at < 10.0, (rank, got["t1"] - killed_at)
        warnings = [line for line in got["lines"] if "making the map plainly here" in line]
        assert len(warnings) == 1 and "is gone" in warnings[0], got["lines"]


@pytest.mark.timeout(2 * JOB_TIMEOUT_S)
def test_per_rank_datasets_caches_map_each_their_own(
        map_hub: LoopbackHub, jobs: dict[str, Job],
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """Each rank with its own ``HF_DATASETS_CACHE``: the cache files differ, so do the keys;
    every rank computes into its own cache, as plain, without waiting for rank 0."""
    root = tmp_path_factory.mktemp("ds-map-own")
    job = _run(map_hub, root / "home", root / "out", ("tokenize",),
               PLT_PER_RANK_DATASETS_CACHE="1")
    for rank in range(NPROC):
        record = _record(job, rank, "tokenize")
        assert record.get("ok"), record.get("error")
        got = record["value"]["dataset"]
        want = _record(jobs["plain"], rank, "tokenize")["value"]["dataset"]
        assert got["content"] == want["content"] and got["features"] == want["features"]
        assert got["files"][0].startswith(f"<home>/datasets-rank-{rank}/"), got["files"]
        assert record["calls"] == TRAIN_ROWS, rank
        assert not any("followed" in line for line in record["lines"]), record["lines"]
        assert record["elapsed_s"] < 30, record["elapsed_s"]


@pytest.fixture(scope="module")
def trainer_jobs(map_hub: LoopbackHub, tmp_path_factory: pytest.TempPathFactory
                 ) -> dict[str, Job]:
    """The ``trainer_first`` step alone (after the job's first load), plain and patched, each
    on a cold cache."""
    root = tmp_path_factory.mktemp("ds-map-trainer")
    return {"plain": _run(map_hub, root / "plain-home", root / "plain", ("trainer_first",),
                          PATCHLOAD="0"),
            "patched": _run(map_hub, root / "home", root / "patched", ("trainer_first",))}


@pytest.mark.timeout(3 * JOB_TIMEOUT_S)
def test_a_trainer_scripts_main_process_first_preprocessing_equals_plain(
        trainer_jobs: dict[str, Job]) -> None:
    """``load_dataset`` and a tokenizer map inside ``TrainingArguments.main_process_first()``
    (rank 0 first, the others in the user's ``dist.barrier()``): no deadlock, every rank's
    dataset equals its plain one, the followers send no request and run no function."""
    for rank in range(NPROC):
        plain = _record(trainer_jobs["plain"], rank, "trainer_first")
        patched = _record(trainer_jobs["patched"], rank, "trainer_first")
        assert plain.get("ok"), (rank, plain.get("error"))
        assert patched.get("ok"), (rank, patched.get("error"))
        assert patched["value"] == plain["value"], rank
    patched = trainer_jobs["patched"]
    assert _record(patched, 0, "trainer_first")["calls"] > 0
    assert [_record(patched, r, "trainer_first")["calls"] for r in range(1, NPROC)] == [0, 0]
    senders = {r.rank for r in patched.window("trainer_first")}
    assert senders == {0}, senders
    # Plain, the ranks after rank 0 ask the hub too (datasets resolves the repo online).
    assert {r.rank for r in trainer_jobs["plain"].window("trainer_first")} > {0}


# --- two nodes ----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def node_jobs(map_hub: LoopbackHub, tmp_path_factory: pytest.TempPathFactory
              ) -> dict[tuple[str, str], Job]:
    """Two namespaced nodes of two ranks (the first load, then ``tokenize``), plain and patched,
    on one ``HF_HOME`` the nodes share (job scope) and on a node-local one each (node scope)."""
    if reason := _nodes.unavailable():
        pytest.skip(f"simulated nodes need root and unshare(1): {reason}")
    root = tmp_path_factory.mktemp("ds-map-nodes")
    jobs = {}
    for layout in ("shared", "node-local"):
        for side, extra in (("plain", {"PATCHLOAD": "0"}), ("patched", {})):
            home = _nodes.NODE_LOCAL / "hf" if layout == "node-local" \
                else root / f"{layout}-{side}-home"
            out = root / f"{layout}-{side}"
            out.mkdir(parents=True)
            job = run_torchrun(map_hub, "datasets_map", ["--steps", "tokenize"], nproc=2,
                               nnodes=2, env=job_env(map_hub.endpoint, home, out, **extra),
                               timeout_s=JOB_TIMEOUT_S, hosts="namespaced")
            assert job.returncodes == [0, 0], "\n".join(job.outputs)
            jobs[layout, side] = job
    return jobs


@pytest.mark.timeout(6 * JOB_TIMEOUT_S)
@pytest.mark.parametrize("layout,senders", [("shared", {0}), ("node-local", {0, 2})])
def test_two_nodes_load_once_per_cache_and_map_once_per_node(
        node_jobs: dict[tuple[str, str], Job], layout: str, senders: set[int]) -> None:
    """On two nodes ``load_dataset`` asks the hub once per cache (rank 0 alone where the nodes
    share one ``HF_HOME``, each node's rank 0 with a node-local one) and the map's function
    runs on each node's rank 0 only (a map is node-scoped: docs/datasets.md; with a shared
    ``HF_HOME`` the node leader that comes second may find the other's cache file, whichever
    node's it is); every rank's dataset equals its plain one."""
    plain, patched = node_jobs[layout, "plain"], node_jobs[layout, "patched"]
    for rank in range(4):
        want, got = _record(plain, rank, "tokenize"), _record(patched, rank, "tokenize")
        assert want.get("ok") and got.get("ok"), (rank, want.get("error"), got.get("error"))
        assert got["value"] == want["value"], (layout, rank)
    calls = [_record(patched, r, "tokenize")["calls"] for r in range(4)]
    assert calls[1] == calls[3] == 0, calls
    if layout == "node-local":
        assert calls[0] == calls[2] == TRAIN_ROWS, calls
    else:
        # A node leader loads the other node's cache file where it is written by then, as a
        # plain rank does: which node maps first is timing (CI saw node 1's first: [0, 0, 40, 0]).
        assert calls[0] in (0, TRAIN_ROWS) and calls[2] in (0, TRAIN_ROWS), calls
        assert TRAIN_ROWS in (calls[0], calls[2]), calls
    assert {r.rank for r in patched.window("load")} == senders
    assert {r.rank for r in plain.window("load")} == {0, 1, 2, 3}
