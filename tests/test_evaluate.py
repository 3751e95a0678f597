"""``evaluate.load`` under torchrun: one rank fetches the metric module; the others send no
request and get the metric their plain call gets.

Differential: the same 3-rank job (``tests/workers/evaluate_load.py``, one ``evaluate.load``
and one ``compute()`` per step, barriers between steps) runs plain (``PATCHLOAD=0``) and
patched, each on a cold cache of its own; each rank's metric (module, class, module hash) and
``compute()`` output, or exception class, is compared with the same rank's plain one. The
loopback hub serves the metric modules as spaces (``evaluate-metric/accuracy``, with a relative
import, and the community module ``org/exact_match``); its log says which rank sent which
request, and each rank counts every request it sent through ``requests`` (evaluate's download
counter asks S3, which the sandbox cannot reach: a connection error, as plain).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

from _launch import Job, check_same_error_everywhere, job_env, run_torchrun
from patchload.testing import LoopbackHub, Request

pytest.importorskip("evaluate", reason="evaluate is not installed (the `test` extra has it)")
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="torchrun jobs: Linux only")

LOADS = ("accuracy", "accuracy_again", "community")
STEPS = ("missing", *LOADS)  # the error first, on a cold cache
JOB_TIMEOUT_S = 240

_ACCURACY = '''"""Accuracy (a test module: the fraction of predictions equal to their references)."""
import datasets
import evaluate

from .helpers import fraction_equal


class Accuracy(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="accuracy", citation="", inputs_description="",
            features=datasets.Features({"predictions": datasets.Value("int32"),
                                        "references": datasets.Value("int32")}))

    def _compute(self, predictions, references):
        return {"accuracy": fraction_equal(predictions, references)}
'''
_HELPERS = '''def fraction_equal(predictions, references):
    return sum(p == r for p, r in zip(predictions, references)) / len(references)
'''
_EXACT_MATCH = '''"""Exact match count (a test community module)."""
import datasets
import evaluate


class ExactMatch(evaluate.Metric):
    def _info(self):
        return evaluate.MetricInfo(
            description="exact matches", citation="", inputs_description="",
            features=datasets.Features({"predictions": datasets.Value("int32"),
                                        "references": datasets.Value("int32")}))

    def _compute(self, predictions, references):
        return {"matches": sum(p == r for p, r in zip(predictions, references))}
'''


@pytest.fixture(scope="module")
def eval_hub(tmp_path_factory: pytest.TempPathFactory) -> Any:
    root = tmp_path_factory.mktemp("eval-repos")
    accuracy, exact = root / "accuracy", root / "exact_match"
    accuracy.mkdir()
    exact.mkdir()
    (accuracy / "accuracy.py").write_text(_ACCURACY)
    (accuracy / "helpers.py").write_text(_HELPERS)
    (accuracy / "README.md").write_text("---\ntitle: Accuracy\nsdk: gradio\n---\n")
    (exact / "exact_match.py").write_text(_EXACT_MATCH)
    with LoopbackHub(log_path=root / "requests.jsonl") as hub:
        hub.add_repo("evaluate-metric/accuracy", accuracy, repo_type="space")
        hub.add_repo("org/exact_match", exact, repo_type="space")
        yield hub


def _run(hub: LoopbackHub, root: Path, name: str, **extra: str) -> Job:
    env = job_env(hub.endpoint, root / f"{name}-home", root / name, **extra)
    job = run_torchrun(hub, "evaluate_load", ["--steps", ",".join(STEPS)], nproc=3, env=env,
                       timeout_s=JOB_TIMEOUT_S)
    assert job.returncodes == [0], "\n".join(job.outputs)
    return job


@pytest.fixture(scope="module")
def jobs(eval_hub: LoopbackHub, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Job]:
    """``plain`` (PATCHLOAD=0) and ``patched``, each on a cold cache of its own."""
    root = tmp_path_factory.mktemp("eval-jobs")
    return {"plain": _run(eval_hub, root, "plain", PATCHLOAD="0"),
            "patched": _run(eval_hub, root, "patched")}


def _record(job: Job, rank: int, step: str) -> dict[str, Any]:
    return job.ranks[rank]["steps"][step]


def _hub_requests(job: Job, step: str, rank: int) -> list[Request]:
    record = _record(job, rank, step)
    return [r for r in job.requests if r.rank == rank and record["t0"] <= r.time <= record["t1"]]


@pytest.mark.timeout(3 * JOB_TIMEOUT_S)
@pytest.mark.parametrize("step", LOADS)
def test_every_rank_gets_the_metric_its_plain_call_gets(jobs: dict[str, Job], step: str) -> None:
    for rank in range(3):
        plain, patched = _record(jobs["plain"], rank, step), _record(jobs["patched"], rank, step)
        assert plain.get("ok"), (rank, plain.get("error"))
        assert patched.get("ok"), (rank, patched.get("error"))
        # module and class (the module path names the module hash), name, compute() output
        assert patched["value"] == plain["value"], (rank, step)


@pytest.mark.timeout(3 * JOB_TIMEOUT_S)
@pytest.mark.parametrize("step", LOADS)
def test_followers_send_no_request(jobs: dict[str, Job], step: str) -> None:
    job = jobs["patched"]
    for rank in (1, 2):
        record = _record(job, rank, step)
        assert record["sent"] == [], (rank, step)
        assert _hub_requests(job, step, rank) == [], (rank, step)
        assert any("followed rank 0: no request" in line for line in record["lines"]), record
        plain = _record(jobs["plain"], rank, step)
        assert plain["sent"] and _hub_requests(jobs["plain"], step, rank), (rank, step)
    # The leader sends what plain ranks send (which of them downloads a file is a race).
    leader = _record(job, 0, step)["sent"]
    assert leader and set(leader) <= {request for rank in range(3)
                                      for request in _record(jobs["plain"], rank, step)["sent"]}


@pytest.mark.timeout(3 * JOB_TIMEOUT_S)
def test_missing_metric_reaches_every_rank_as_the_plain_class(jobs: dict[str, Job]) -> None:
    errors = check_same_error_everywhere(jobs["patched"], "missing")
    for rank in range(3):
        plain = _record(jobs["plain"], rank, "missing")
        assert not plain.get("ok"), rank
        assert errors[rank]["type"] == plain["error"]["type"] == "FileNotFoundError", rank
        # The message names the working directory, each job's own.
        assert (errors[rank]["message"].replace(str(jobs["patched"].out_dir), "<cwd>")
                == plain["error"]["message"].replace(str(jobs["plain"].out_dir), "<cwd>")), rank
    # Rank 0 comes to this step 2 s late (the worker's LATE): the others wait for its attempt
    # and send nothing.
    for rank in (1, 2):
        assert errors[rank]["follower"] and errors[rank]["leader_rank"] == 0, errors[rank]
        assert _record(jobs["patched"], rank, "missing")["sent"] == [], rank


@pytest.mark.timeout(3 * JOB_TIMEOUT_S)
def test_patchload_off_leaves_evaluate_alone(jobs: dict[str, Job]) -> None:
    for rank, report in jobs["plain"].ranks.items():
        assert not report["installed"] and not report["factory_patched"], rank
    for rank, report in jobs["patched"].ranks.items():
        assert report["installed"] and report["factory_patched"], rank
