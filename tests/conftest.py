"""Fixtures of the multi-rank tests: tiny repos, one loopback hub, the plain-load reference.

The hub runs in the pytest process for the whole session and serves every repo the tests use
(several ids may serve the same folder, so that each call of a job touches a repo of its own and
the request log says which rank fetched it). Faults are attached to dedicated repo ids, so they
never affect other tests. Jobs run one after another; each reads the requests that arrived while
it ran.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path
from typing import Any

import pytest

from patchload.testing import Fault, LoopbackHub

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _leftovers  # noqa: E402
from _launch import Job, job_env, run_plain, run_torchrun  # noqa: E402


# Every case the load worker knows (see tests/workers/load.py).
LOAD_CASES = ("llama", "llama_tied", "llama_sharded", "bf16_default", "bf16_bf16", "bf16_auto",
              "t5_fp16", "t5_bf16", "gpt2", "bert", "custom", "mismatch")

# A bigger bf16 llama (load case "big_as_f32"), for memory figures.
BIG_LLAMA = "org/llama-big-bf16"
# Cases the plain reference also runs, for tests of their own (the two-node test).
REFERENCE_ONLY_CASES = ("big_as_f32",)

# Concurrent-load repos (tests/test_load.py): fp32 llamas with untied weights, one loaded per
# thread at once (transformers 5's default dtype and weight tying are process-wide while a model
# is built, so only such loads are deterministic in threads, plain).
CONCURRENT_REPOS = ("cc/llama-a", "cc/llama-b", "cc/llama-sharded")

# Download-test repos: one per call of the download worker (all serve the tiny llama folder).
DOWNLOAD_REPOS = ("dl/pair", "dl/file", "dl/snap", "dl/config", "dl/gen")

# Fault repos (a missing repo needs no registration: the hub answers RepoNotFound).
GATED = "err/gated"
ERR500 = "err/server-error"
CORRUPT = "err/corrupt"
TRUNCATED = "err/truncated"
RATELIMITED = ("rl/pair", "rl/file")  # 429 faults added by the test that uses them
STALLED = "stall/pair"
MISSING = "err/does-not-exist"


@pytest.fixture(scope="session", autouse=True)
def suite_leaves_nothing_behind(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """Give the suite's rank processes a temporary directory of their own (``TMPDIR``: so
    patchload's private directory is the suite's, not shared with anything else running on the
    machine); after the last test, check that the caches hold what the hub served and nothing of
    patchload's is left (memfds, threads, rank processes, private files, scope markers); see
    _leftovers.py."""
    root = tmp_path_factory.getbasetemp()
    tempfile.gettempdir()  # this process keeps the machine's: pinned before TMPDIR changes
    ranks_tmp = root / "ranks-tmp"
    ranks_tmp.mkdir()
    previous = os.environ.get("TMPDIR")
    os.environ["TMPDIR"] = str(ranks_tmp)
    yield
    if previous is None:
        del os.environ["TMPDIR"]
    else:
        os.environ["TMPDIR"] = previous
    problems = _leftovers.cache_problems(root) + _leftovers.process_leftovers()
    problems += [f"left in patchload's private directory: {p}"
                 for p in _leftovers.private_files(ranks_tmp)]
    problems += [f"scope marker left: {p}" for p in _leftovers.scope_markers(root)]
    print(f"\nsuite_leaves_nothing_behind: checked the caches under {root}: "
          f"{len(problems)} problem(s)")
    assert not problems, "\n".join(problems)


@pytest.fixture(scope="session")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Repo folders written once for the session (tiny models; the real all-MiniLM-L6-v2)."""
    import torch

    from patchload.testing import models

    root = tmp_path_factory.mktemp("repos")
    llama = models.tiny_llama(root / "llama")
    out = {
        "org/llama": llama,
        "org/llama-tied": models.tiny_llama(root / "llama-tied", tie_word_embeddings=True,
                                            seed=1),
        "org/llama-sharded": models.tiny_llama(root / "llama-sharded", max_shard_size="20KB",
                                               seed=2),
        "org/llama-bf16": models.tiny_llama(root / "llama-bf16", dtype=torch.bfloat16, seed=3),
        # 64 MB in bf16, 127 MB loaded as fp32: big enough for a rank's peak memory to be
        # measured against (Python's own allocations in a load are a few MB).
        BIG_LLAMA: models.tiny_llama(root / "llama-big-bf16", dtype=torch.bfloat16,
                                     hidden_size=768, num_layers=6, with_tokenizer=False,
                                     seed=6),
        "org/t5": models.tiny_t5(root / "t5"),
        "org/gpt2": models.tiny_gpt2(root / "gpt2"),
        "org/bert": models.tiny_bert(root / "bert"),
        "org/custom": models.tiny_custom(root / "custom"),
        models.MINILM_REPO_ID: models.minilm(root / "minilm"),
    }
    for seed, repo in enumerate(CONCURRENT_REPOS, start=7):
        out[repo] = models.tiny_llama(root / repo.replace("/", "--"), seed=seed,
                                      with_tokenizer=False,
                                      max_shard_size="20KB" if "sharded" in repo else None)
    for repo in DOWNLOAD_REPOS + RATELIMITED + (GATED, ERR500, STALLED):
        out[repo] = llama
    corrupt = root / "corrupt"
    models.tiny_llama(corrupt, with_tokenizer=False, seed=4)
    size = (corrupt / "model.safetensors").stat().st_size
    (corrupt / "model.safetensors").write_bytes(b"\x7fgarbage, not a safetensors file" * 64)
    out[CORRUPT] = corrupt
    truncated = root / "truncated"
    models.tiny_llama(truncated, with_tokenizer=False, seed=5)
    data = (truncated / "model.safetensors").read_bytes()
    (truncated / "model.safetensors").write_bytes(data[: size // 2])
    out[TRUNCATED] = truncated
    return out


@pytest.fixture(scope="session")
def hub(folders: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The session's loopback hub, serving every folder, with the permanent faults."""
    log = tmp_path_factory.mktemp("hub") / "requests.jsonl"
    with LoopbackHub(log_path=log) as running:
        for repo_id, folder in folders.items():
            running.add_repo(repo_id, folder)
        running.add_fault(Fault(repo_id=GATED, status=401))
        running.add_fault(Fault(repo_id=ERR500, status=500))
        # Slow enough that the leader is still downloading when the test kills it.
        running.add_fault(Fault(repo_id=STALLED, path="model.safetensors", method="GET",
                                throttle_bytes_per_s=2000))
        yield running


@pytest.fixture(scope="session")
def reference_job(hub: LoopbackHub, tmp_path_factory: pytest.TempPathFactory) -> Job:
    """Plain loads: one process, world size 1, ``PATCHLOAD=0``; every load case (both variants
    of the mismatch case), the SGD step and MiniLM."""
    root = tmp_path_factory.mktemp("reference")
    env = job_env(hub.endpoint, root / "hf", root / "out", PATCHLOAD="0")
    job = run_plain(hub, "load", ["--cases", ",".join(LOAD_CASES + REFERENCE_ONLY_CASES),
                                  "--reference", "--minilm"],
                    env=env, timeout_s=240).check_ok()
    report = job.ranks[0]
    assert report["installed"] is False
    for name, record in report["steps"].items():
        assert "error" not in record, f"plain load of {name} failed: {record['error']}"
    return job


@pytest.fixture(scope="session")
def reference(reference_job: Job) -> dict[str, Any]:
    """The plain-load report: ``reference["steps"][case]["fingerprint"]``."""
    return reference_job.ranks[0]


@pytest.fixture(scope="session")
def errors_job(hub: LoopbackHub, tmp_path_factory: pytest.TempPathFactory) -> Job:
    """N=3: calls whose leader meets 404, 401, 500, a corrupt or a truncated checkpoint
    (``tests/workers/errors.py``), one after another. huggingface_hub's backoff between its
    retries of the 500 is a tenth of its default (``PLT_HUB_WAIT_SCALE``): the same retries
    and requests, 2.3 s asleep per file instead of 23 s."""
    root = tmp_path_factory.mktemp("errors")
    env = job_env(hub.endpoint, root / "hf", root / "out", PLT_HUB_WAIT_SCALE="0.1")
    return run_torchrun(hub, "errors", [], nproc=3, env=env, timeout_s=240).check_ok()
