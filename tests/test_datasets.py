"""``datasets.load_dataset`` under torchrun: one rank resolves, downloads and prepares; the others
make no request, build nothing, and get what their plain call gets.

Differential: the same 3-rank job (``tests/workers/datasets_load.py``, one ``load_dataset`` per
step, barriers between steps) runs plain (``PATCHLOAD=0``, one shared cache: every rank resolves
and downloads, one of them builds each split, the others wait for its lock) and patched, cold
and then warm; each rank's result (rows, features, split sizes, fingerprint, Arrow files under
``HF_HOME``, info) or exception class is compared with the same rank's plain one. The loopback
hub's log says which rank sent which request; each rank counts the ``ArrowWriter`` objects its
call created.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from _launch import Job, check_same_error_everywhere, job_env, run_torchrun
from patchload.testing import Fault, LoopbackHub, Request

pytest.importorskip("datasets", reason="datasets is not installed (the `test` extra has it)")
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="torchrun jobs: Linux only")

# The errors come first, on a cold cache: a data file pattern that matches nothing in a repo
# whose data is cached already ends in datasets' "couldn't find cache" fallback instead.
ERRORS = ("missing_file", "missing_repo", "file_404")
LOADS = ("parquet", "csv", "json", "text_config", "revision", "local", "own_cache_dir",
         "features")
STEPS = (*ERRORS, *LOADS, "streaming")
JOB_TIMEOUT_S = 240


def _write_repos(root: Path) -> dict[str, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    parquet = root / "parquet" / "data"
    parquet.mkdir(parents=True)
    pq.write_table(pa.table({"text": ["a", "b", "c"], "label": [0, 1, 0]}),
                   parquet / "train-00000-of-00001.parquet")
    pq.write_table(pa.table({"text": ["d", "e"], "label": [1, 1]}),
                   parquet / "test-00000-of-00001.parquet")
    csv = root / "csv"
    csv.mkdir()
    (csv / "train.csv").write_text("text,label\nx,1\ny,0\nz,1\n")
    (csv / "README.md").write_text("---\nlicense: mit\n---\n# a csv dataset\n")
    json_data = root / "json" / "data"
    json_data.mkdir(parents=True)
    (json_data / "a.jsonl").write_text('{"a": 1, "b": "x"}\n{"a": 2, "b": "y"}\n')
    configs = root / "configs"
    for name, text in (("first", "one\ntwo\n"), ("second", "three\nfour\nfive\n")):
        (configs / name).mkdir(parents=True)
        (configs / name / f"{name}.txt").write_text(text)
    (configs / "README.md").write_text(
        "---\nconfigs:\n- config_name: first\n  data_files: first/*.txt\n"
        "- config_name: second\n  data_files: second/*.txt\n---\n")
    (root / "local.csv").write_text("q,w\n1,2\n3,4\n")
    return {"org/ds-parquet": root / "parquet", "org/ds-csv": csv, "org/ds-json": root / "json",
            "org/ds-configs": configs, "org/ds-404": root / "parquet"}


@pytest.fixture(scope="module")
def ds_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The dataset repos' folders, and ``local.csv`` (a local data file)."""
    return tmp_path_factory.mktemp("ds-repos")


@pytest.fixture(scope="module")
def ds_hub(ds_root: Path) -> Any:
    repos = _write_repos(ds_root)
    with LoopbackHub(log_path=ds_root / "requests.jsonl") as hub:
        for repo_id, folder in repos.items():
            hub.add_repo(repo_id, folder, repo_type="dataset")
        # Listed in the tree, 404 when fetched.
        hub.add_fault(Fault(repo_id="org/ds-404", path="data/*", status=404))
        yield hub


def _run(hub: LoopbackHub, root: Path, home: Path, out: Path, *args: str, **extra: str) -> Job:
    env = job_env(hub.endpoint, home, out, PLT_LOCAL_CSV=str(root / "local.csv"),
                  PLT_CSV_COMMIT=hub.commit_of("org/ds-csv", repo_type="dataset"),
                  PLT_DS_CACHE=str(home / "own-datasets-cache"), **extra)
    job = run_torchrun(hub, "datasets_load", ["--steps", ",".join(STEPS), *args], nproc=3,
                       env=env, timeout_s=JOB_TIMEOUT_S)
    assert job.returncodes == [0], "\n".join(job.outputs)
    return job


@pytest.fixture(scope="module")
def jobs(ds_hub: LoopbackHub, ds_root: Path,
         tmp_path_factory: pytest.TempPathFactory) -> dict[str, Job]:
    """``plain`` (PATCHLOAD=0), then ``cold`` and ``warm`` (patched, one cache for both)."""
    root = tmp_path_factory.mktemp("ds-jobs")
    return {
        "plain": _run(ds_hub, ds_root, root / "plain-home", root / "plain", PATCHLOAD="0"),
        "cold": _run(ds_hub, ds_root, root / "home", root / "cold"),
        "warm": _run(ds_hub, ds_root, root / "home", root / "warm"),
    }


def _record(job: Job, rank: int, step: str) -> dict[str, Any]:
    return job.ranks[rank]["steps"][step]


def _step_requests(job: Job, step: str, rank: int) -> list[Request]:
    record = _record(job, rank, step)
    return [r for r in job.requests if r.rank == rank and record["t0"] <= r.time <= record["t1"]]


@pytest.mark.timeout(3 * JOB_TIMEOUT_S)
@pytest.mark.parametrize("cache", ["cold", "warm"])
@pytest.mark.parametrize("step", LOADS + ("streaming",))
def test_every_rank_loads_what_its_plain_call_loads(jobs: dict[str, Job], cache: str,
                                                    step: str) -> None:
    for rank in range(3):
        plain, patched = _record(jobs["plain"], rank, step), _record(jobs[cache], rank, step)
        assert plain.get("ok"), (rank, plain.get("error"))
        assert patched.get("ok"), (rank, patched.get("error"))
        # rows, features, split sizes, fingerprints, Arrow files (paths), info
        assert patched["value"] == plain["value"], (rank, step)


@pytest.mark.timeout(3 * JOB_TIMEOUT_S)
@pytest.mark.parametrize("cache", ["cold", "warm"])
@pytest.mark.parametrize("step", LOADS)
def test_followers_make_no_request_and_build_nothing(jobs: dict[str, Job], cache: str,
                                                     step: str) -> None:
    job = jobs[cache]
    for rank in (1, 2):
        assert _step_requests(job, step, rank) == [], (rank, step)
        assert _record(job, rank, step)["arrow_writes"] == [], (rank, step)
        assert any("followed rank 0: no request" in line
                   for line in _record(job, rank, step)["lines"]), _record(job, rank, step)
    leader_writes = _record(job, 0, step)["arrow_writes"]
    plain_writes = sorted(w for rank in range(3)
                          for w in _record(jobs["plain"], rank, step)["arrow_writes"])
    # The builder runs once: on the leader, cold; nowhere, warm.
    assert sorted(leader_writes) == (plain_writes if cache == "cold" else []), step
    if cache == "cold" and step != "local":
        assert _step_requests(job, step, 0), "the leader made the requests"


@pytest.mark.timeout(3 * JOB_TIMEOUT_S)
@pytest.mark.parametrize("step", ERRORS)
def test_leader_error_reaches_every_rank_as_the_plain_class(jobs: dict[str, Job],
                                                            step: str) -> None:
    errors = check_same_error_everywhere(jobs["cold"], step)
    for rank in range(3):
        plain = _record(jobs["plain"], rank, step)
        assert not plain.get("ok"), (rank, step)
        assert errors[rank]["type"] == plain["error"]["type"], (rank, step)
        assert plain["error"]["mro"][0] in errors[rank]["mro"]


@pytest.mark.timeout(3 * JOB_TIMEOUT_S)
def test_streaming_steps_aside(jobs: dict[str, Job]) -> None:
    for rank in range(3):
        assert _step_requests(jobs["cold"], "streaming", rank), rank  # every rank streams
        assert not any("load_dataset" in line
                       for line in _record(jobs["cold"], rank, "streaming")["lines"])


@pytest.mark.timeout(3 * JOB_TIMEOUT_S)
def test_patchload_off_leaves_datasets_alone(jobs: dict[str, Job]) -> None:
    for rank, report in jobs["plain"].ranks.items():
        assert not report["installed"] and not report["load_dataset_patched"], rank
        for step in LOADS:
            if step != "local":
                assert _step_requests(jobs["plain"], step, rank), (rank, step)


@pytest.mark.timeout(2 * JOB_TIMEOUT_S)
def test_other_datasets_cache_falls_back_to_a_plain_call(
        ds_hub: LoopbackHub, jobs: dict[str, Job],
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """Ranks with one hub cache but a datasets cache each: a follower cannot use the leader's
    Arrow files; it warns once and makes the plain call (its own requests and build)."""
    root = tmp_path_factory.mktemp("ds-own")
    env = job_env(ds_hub.endpoint, root / "home", root / "out")
    job = run_torchrun(ds_hub, "datasets_load", ["--steps", "parquet",
                                                 "--per-rank-datasets-cache"],
                       nproc=3, env=env, timeout_s=JOB_TIMEOUT_S)
    assert job.returncodes == [0], "\n".join(job.outputs)
    for rank in (1, 2):
        record = _record(job, rank, "parquet")
        assert record.get("ok"), record.get("error")
        value = record["value"]["splits"]["train"]
        want = _record(jobs["plain"], rank, "parquet")["value"]["splits"]["train"]
        assert value["rows"] == want["rows"] and value["fingerprint"] == want["fingerprint"]
        assert value["files"] == [f"<home>/datasets-rank-{rank}/org___ds-parquet/default/0.0.0/"
                                  + want["files"][0].rsplit("/", 2)[-2] + "/ds-parquet-train.arrow"]
        warnings = [line for line in record["lines"] if "making the call plainly" in line]
        assert len(warnings) == 1 and "caches" in warnings[0], record["lines"]
        assert len(record["arrow_writes"]) == 2, record["arrow_writes"]


@pytest.mark.timeout(3 * JOB_TIMEOUT_S)
def test_a_plain_call_after_a_failed_follow_raises_the_plain_class(
        ds_hub: LoopbackHub, tmp_path_factory: pytest.TempPathFactory) -> None:
    """One relative ``data_files`` pattern, a working directory per rank, rank 2's folder
    empty: followers cannot use the leader's result and make the call plainly. Rank 2 raises
    what its plain call raises (``DatasetGenerationError``): the plain call runs outside the
    handler of the follower's own failure, whose ``__context__`` datasets would unwrap
    (``SchemaInferenceError`` before)."""
    root = tmp_path_factory.mktemp("ds-cwd")
    classes = {}
    for mode, on in (("plain", "0"), ("patched", "1")):
        env = job_env(ds_hub.endpoint, root / f"{mode}-home", root / mode, PATCHLOAD=on)
        job = run_torchrun(ds_hub, "datasets_load", ["--steps", "rank_glob", "--per-rank-cwd"],
                           nproc=3, env=env, timeout_s=JOB_TIMEOUT_S)
        assert job.returncodes == [0], "\n".join(job.outputs)
        records = [_record(job, rank, "rank_glob") for rank in range(3)]
        classes[mode] = [None if r.get("ok") else r["error"]["type"] for r in records]
    assert classes["patched"] == classes["plain"], classes
    assert classes["plain"][2] is not None and classes["plain"][:2] == [None, None], classes
