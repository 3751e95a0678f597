"""What a rank says about a coordinated call: one INFO line each, and a WARNING while it waits.

N=3, ``PATCHLOAD_LOG_LEVEL=INFO``, a script that calls ``logging.basicConfig(level=INFO)`` after
``import patchload``, a download the hub throttles to a few seconds: every rank prints one line
(once, not again through the root handler) per top-level call saying whether it led or whom it
followed (followers: no request), and a follower that waits past ``PATCHLOAD_PROGRESS_WARNING``
warns periodically with the leader's progress in its cache.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from _launch import job_env, run_torchrun

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
            followed = rf"\[rank {rank}/3\] {what}: followed rank 0: no request, in "
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
    """Rank 0 never makes the call: after ``PATCHLOAD_CLAIM_GRACE`` (2 s here) the lowest of the
    others that claims it leads; every rank gets the config, one rank asks the hub."""
    hub.add_repo("sig/alone", models.tiny_llama(tmp_path / "repo", with_tokenizer=False))
    env = job_env(hub.endpoint, tmp_path / "hf", tmp_path / "out", PATCHLOAD_CLAIM_GRACE="2")
    job = run_torchrun(hub, "signals", ["--without-rank0"], nproc=3, env=env,
                       timeout_s=240).check_ok()
    reports = {rank: job.ranks[rank] for rank in (1, 2)}
    assert reports[1]["config"] == reports[2]["config"]
    # The grace, plus a config load on a loaded 2-core machine.
    assert all(2.0 <= r["elapsed_s"] < 2.0 + 10.0 for r in reports.values()), reports
    assert len({r.rank for r in job.requests if r.repo_id == "sig/alone"}) == 1, job.requests
