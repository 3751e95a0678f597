"""The CUDA paths (issue 29), through ``benchmarks/gpu_check.py``'s own checks.

On a machine with CUDA each case (``model.to("cuda")`` after a CPU load, ``device_map="cuda"``,
an fp32 checkpoint loaded as bf16 then moved) runs plain, with the shm and with the collective
transport, 2 ranks on a cold cache: every rank's weights on the device equal plain's bit for
bit, no more hub requests than plain, and rank 0's weights sent through patchload's collective
transport on an NCCL group arrive equal (where there is a GPU per rank; NCCL refuses two ranks
on one device). Without CUDA those tests are skipped with the reason,
and the script itself must say "no CUDA device" and exit 0.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import gpu_check  # noqa: E402


def _no_cuda() -> str | None:
    import torch

    if not torch.cuda.is_available():
        return "no CUDA device (torch.cuda.is_available() is False): the CUDA paths are not run"
    if not torch.distributed.is_nccl_available():
        return "this torch build has no NCCL"
    return None


@pytest.mark.timeout(120)
def test_gpu_check_without_cuda_says_so_and_succeeds() -> None:
    if not _no_cuda():
        pytest.skip("a CUDA device is present: the check runs for real")
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "gpu_check.py")],
                          capture_output=True, text=True, timeout=100, cwd=ROOT)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("no CUDA device"), done.stdout


@pytest.mark.timeout(4 * gpu_check.JOB_TIMEOUT_S)
@pytest.mark.parametrize("case", gpu_check.CASES)
def test_cuda_load_equals_plain(case: str, tmp_path: Path) -> None:
    reason = _no_cuda()
    if reason:
        pytest.skip(reason)
    rows, failures, _ = gpu_check.check(tmp_path, nproc=2, device="cuda", cases=(case,))
    assert failures == [], "\n".join(failures)
    assert len(rows) == len(gpu_check.MODES)
