"""patchload.main_process_first across 3 torchrun ranks: order, and the leader's error."""

from __future__ import annotations

from pathlib import Path

import pytest
from _launch import job_env, run_torchrun

from patchload.testing import LoopbackHub


@pytest.mark.timeout(240)
def test_main_process_first_orders_blocks_and_passes_the_leaders_error(
        hub: LoopbackHub, tmp_path: Path) -> None:
    env = job_env(hub.endpoint, tmp_path / "hf", tmp_path / "out", PATCHLOAD_HEARTBEAT="1")
    job = run_torchrun(hub, "first", [], nproc=3, env=env, timeout_s=180)
    assert job.returncodes == [0], job.describe()
    ranks = job.ranks
    assert sorted(ranks) == [0, 1, 2], job.describe()

    ordered = {r: rep["ordered"] for r, rep in ranks.items()}
    leaders = [r for r, o in ordered.items() if o["leads"]]
    assert len(leaders) == 1, ordered
    leader = ordered[leaders[0]]
    for rank, o in ordered.items():
        if rank != leaders[0]:
            assert o["entered"] >= leader["left"], (rank, ordered)

    failing = {r: rep["failing"] for r, rep in ranks.items()}
    assert all(f["raised"] == "ValueError" for f in failing.values()), failing
    originals = [r for r, f in failing.items() if not f["leader_failed"]]
    assert len(originals) == 1, failing
    for rank, f in failing.items():
        if rank not in originals:
            assert f["message"] == "preprocessing failed: bad shard 7", f
            assert any(f"leader rank {originals[0]}" in note for note in f["notes"]), f
            assert f["seconds"] < 10, f
