"""``python -m patchload doctor``: the lines a user reads, with and without a launcher."""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(180)

# Nothing of the pytest process's own launcher or settings may leak into the doctor's.
_STRIP_PREFIXES = ("PATCHLOAD", "TORCHELASTIC_", "SLURM_", "OMPI_", "PMIX_", "HF_")
_STRIP = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
          "MASTER_PORT", "LOCAL_SIZE", "CROSS_RANK", "CROSS_SIZE"}


def _env(tmp_path: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(_STRIP_PREFIXES) and k not in _STRIP}
    return {**env, "HF_HUB_CACHE": str(tmp_path / "hub"), **extra}


def _doctor(tmp_path: Path, **extra: str) -> list[str]:
    proc = subprocess.run([sys.executable, "-m", "patchload", "doctor"], capture_output=True,
                          text=True, timeout=150, env=_env(tmp_path, **extra))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    return proc.stdout.splitlines()


def _versions() -> str:
    v = importlib.metadata.version
    return (f"transformers {v('transformers')}, huggingface_hub {v('huggingface_hub')}, "
            f"torch {v('torch')}")


def test_no_launcher_full_report_with_every_patch(tmp_path):
    lines = _doctor(tmp_path)
    assert lines[:4] == ["patchload 0.1.0",
                         "topology: single process (no launcher variables found)",
                         "patchload: on (PATCHLOAD)",
                         "world size 1: every patched call passes straight through"]
    assert not any("(from none)" in line or line.startswith("rank ") for line in lines)
    assert "weights: shared with followers (PATCHLOAD_BROADCAST)" in lines
    assert ("waits: timeout none (no bound on the total wait), heartbeat 5 s, claim grace 120 s, "
            "exit wait 60 s, arrival window 5 s, group timeout 300 s, progress warning 60 s"
            ) in lines
    assert f"hub cache: {tmp_path / 'hub'}" in lines
    installed = lines.index(next(line for line in lines if line.startswith("patches installed:")))
    count = int(lines[installed].split(": ")[1])
    listed = lines[installed + 1:installed + 1 + count]
    # Patches that land only once their module is imported are listed too: the tokenizer's,
    # the processors', remote-code modules'.
    for name in ("huggingface_hub.file_download.hf_hub_download",
                 "transformers.modeling_utils.PreTrainedModel.from_pretrained",
                 "transformers.models.auto.modeling_auto.AutoModelForCausalLM.from_pretrained",
                 "transformers.tokenization_utils_base.PreTrainedTokenizerBase.from_pretrained",
                 "transformers.models.auto.tokenization_auto.AutoTokenizer.from_pretrained",
                 "transformers.models.auto.processing_auto.AutoProcessor.from_pretrained",
                 "transformers.dynamic_module_utils.get_cached_module_file"):
        assert f"  {name}" in listed, name
    # Other libraries' patches: pending until their module is imported.
    assert lines[installed + 1 + count] == ("patches pending: 19 (each lands when its module is "
                                            "first imported)")
    evaluate = "" if importlib.util.find_spec("evaluate") else " (evaluate is not installed)"
    assert ("  evaluate.loading.evaluation_module_factory: pending until evaluate.loading is "
            f"imported{evaluate}") in lines
    peft = "" if importlib.util.find_spec("peft") else " (peft is not installed)"
    assert ("  peft.peft_model.PeftModel.from_pretrained: pending until peft.peft_model is "
            f"imported{peft}") in lines
    diffusers = "" if importlib.util.find_spec("diffusers") else " (diffusers is not installed)"
    assert ("  diffusers.models.modeling_utils.ModelMixin.from_pretrained: pending until "
            f"diffusers.models.modeling_utils is imported{diffusers}") in lines


def test_the_logging_set_up_is_reported(tmp_path):
    """The doctor says where patchload's lines go: by default to the application's handlers
    (stderr where it sets none), at WARNING; with ``PATCHLOAD_LOG_LEVEL`` to a handler of its
    own that the root logger does not print again."""
    assert ("logging: the patchload logger at WARNING, no handler of its own: its lines go to "
            "the application's handlers, or to stderr where it configures none; "
            "PATCHLOAD_LOG_LEVEL=INFO adds one line per rank for each top-level call"
            ) in _doctor(tmp_path)
    assert ("logging: the patchload logger at INFO, to a handler of its own on stderr "
            "(PATCHLOAD_LOG_LEVEL), not passed on to the root logger: each line prints once"
            ) in _doctor(tmp_path, PATCHLOAD_LOG_LEVEL="INFO")


def test_disabled_says_off_and_lists_nothing(tmp_path):
    lines = _doctor(tmp_path, PATCHLOAD="0", PATCHLOAD_TIMEOUT="abc")
    assert lines[:5] == [
        "patchload 0.1.0",
        "topology: single process (no launcher variables found)",
        "patchload: off (PATCHLOAD=0): nothing is patched; every call runs as without patchload",
        f"hub cache: {tmp_path / 'hub'}",
        f"torch: {importlib.metadata.version('torch')}"]
    assert not any(line.startswith(("weights:", "transport:", "download scope:", "patches",
                                    "store:", "waits:")) for line in lines), lines


def _rank_line(rank: int, world: int, cache: Path, on: str = "on") -> str:
    return (rf"rank {rank}/{world}: pid \d+ on {re.escape(socket.gethostname())} \(local rank "
            rf"{rank}/{world}, node 0/1\), patchload {on}, hub cache {re.escape(str(cache))}, "
            + re.escape(_versions()))


@pytest.mark.parametrize("on", ["on", "off"])
def test_other_rank_prints_one_line(tmp_path, on):
    lines = _doctor(tmp_path, RANK="1", WORLD_SIZE="2", PATCHLOAD="1" if on == "on" else "0")
    assert len(lines) == 1, lines
    assert re.fullmatch(_rank_line(1, 2, tmp_path / "hub", on), lines[0]), lines[0]


def test_rank_zero_prints_the_report_and_its_own_rank_line(tmp_path):
    lines = _doctor(tmp_path, RANK="0", WORLD_SIZE="2")
    assert lines[1] == "topology: rank 0/2, local rank 0/2, node 0/1 (from torchrun)"
    assert re.fullmatch(_rank_line(0, 2, tmp_path / "hub"), lines[2]), lines[2]
    assert lines[3:6] == [
        "the other ranks print one such line each (compare host, hub cache, versions)",
        "patchload: on (PATCHLOAD)",
        "store: file (node-local: downloads coordinated per node only)"]
    assert any(line.startswith("patches installed: ") for line in lines)


def test_under_torchrun_one_report_per_job(tmp_path):
    """A real torchrun job of 2 ranks: rank 0's full report, rank 1's one line; no waiting."""
    logs = tmp_path / "logs"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--master_port", "0", "--redirects", "3", "--log-dir", str(logs), "--module",
         "patchload", "doctor"],
        capture_output=True, text=True, timeout=150, env=_env(tmp_path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = {int(p.parent.name): p.read_text().splitlines() for p in logs.rglob("stdout.log")}
    assert sorted(out) == [0, 1], out
    assert len(out[1]) == 1 and re.fullmatch(_rank_line(1, 2, tmp_path / "hub"), out[1][0])
    assert out[0][1] == "topology: rank 0/2, local rank 0/2, node 0/1 (from torchrun)"
    assert re.fullmatch(_rank_line(0, 2, tmp_path / "hub"), out[0][2]), out[0][2]
    assert "store: agent" in out[0]
    assert any(line.startswith("patches installed: ") for line in out[0])


def test_two_nodes_say_how_the_scope_is_decided_and_that_scope_wait_is_unused(tmp_path):
    """The ``auto`` scope is decided without waiting for any rank (issue 30): the report says
    so, and a ``PATCHLOAD_SCOPE_WAIT`` still set in the environment is named as unused."""
    lines = _doctor(tmp_path, RANK="0", WORLD_SIZE="2", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1",
                    PATCHLOAD_SCOPE_WAIT="30")
    assert ("download scope: auto (decided at the job's first patched call, waiting for no "
            "rank: job if every node has shown by then that it sees this hub cache, else node)"
            ) in lines, lines
    assert ("PATCHLOAD_SCOPE_WAIT=30: no longer used (the download scope is decided without "
            "waiting for any rank)") in lines, lines
    assert not any("SCOPE_WAIT" in line for line in _doctor(tmp_path, RANK="0", WORLD_SIZE="2"))
