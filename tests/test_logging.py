"""What patchload prints through ``logging`` in a script that configures logging itself or not.

Each case is a fresh interpreter: ``import patchload``, then (maybe) the script's own
``logging.basicConfig``, then one INFO and one WARNING event on a ``patchload`` module logger,
and a real warning at import (an unknown ``PATCHLOAD_*`` variable). The multi-rank counterpart
(one line per rank and event under torchrun with ``basicConfig``) is in ``tests/test_signals.py``.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.timeout(120)

_SCRIPT = """
import logging, sys
import patchload
{configure}
from patchload._logging import get_logger
log = get_logger("patchload.coordination.call")
log.info("%s: an info event %d", "[rank 0/1] model", 1)
log.warning("a warning event %d", 2)
patchload.install()  # a second install sets nothing up twice
log.info("%s: an info event %d", "[rank 0/1] model", 3)
log.warning("a warning event %d", 4)
print(patchload._logging.describe())
"""


def _run(configure: str, **env: str) -> tuple[list[str], str]:
    clean = {k: v for k, v in os.environ.items()
             if not k.startswith("PATCHLOAD") and k not in ("RANK", "WORLD_SIZE")}
    proc = subprocess.run([sys.executable, "-c", _SCRIPT.format(configure=configure)],
                          env={**clean, "PATCHLOAD_XYZZY": "1", **env}, capture_output=True,
                          text=True, timeout=100)
    assert proc.returncode == 0, proc.stderr
    return proc.stderr.splitlines(), proc.stdout


def _count(lines: list[str], text: str) -> int:
    return sum(text in line for line in lines)


def test_root_logger_at_info_gets_warnings_once_and_no_info():
    """The script's root handler at INFO: patchload's warnings reach it once, naming patchload
    and the rank; its INFO lines print nowhere without ``PATCHLOAD_LOG_LEVEL``."""
    lines, doctor = _run("logging.basicConfig(level=logging.INFO)")
    assert not any("info event" in line for line in lines), lines
    for n in (2, 4):
        assert [line for line in lines if f"a warning event {n}" in line] == [
            f"WARNING:patchload.coordination.call:patchload [rank 0/1] a warning event {n}"]
    assert _count(lines, "unknown variable PATCHLOAD_XYZZY") == 1, lines
    assert doctor.startswith("logging: the patchload logger at WARNING, no handler of its own")


def test_a_format_without_the_logger_name_still_names_patchload():
    """sentence-transformers' examples log ``%(asctime)s - %(message)s`` at INFO."""
    lines, _ = _run("logging.basicConfig(format='%(asctime)s - %(message)s', level=logging.INFO)")
    warnings = [line for line in lines if "a warning event" in line]
    assert len(warnings) == 2 and all(" - patchload [rank 0/1] a warning event " in line
                                      for line in warnings), lines
    assert not any("info event" in line for line in lines), lines


def test_no_logging_configured_warnings_reach_stderr():
    lines, _ = _run("")
    assert [line for line in lines if "event" in line] == [
        "patchload [rank 0/1] a warning event 2", "patchload [rank 0/1] a warning event 4"]
    assert _count(lines, "patchload [rank 0/1] unknown variable PATCHLOAD_XYZZY") == 1, lines


@pytest.mark.parametrize("configure", ["", "logging.basicConfig(level=logging.INFO)"])
def test_log_level_set_prints_each_event_once_in_patchload_s_format(configure):
    """``PATCHLOAD_LOG_LEVEL=INFO``: one handler of patchload's own, not propagated, so a root
    handler installed after ``import patchload`` does not print the same line again."""
    lines, doctor = _run(configure, PATCHLOAD_LOG_LEVEL="INFO")
    events = [line for line in lines if "event" in line]
    assert events == ["INFO patchload [rank 0/1] model: an info event 1",
                      "WARNING patchload [rank 0/1] a warning event 2",
                      "INFO patchload [rank 0/1] model: an info event 3",
                      "WARNING patchload [rank 0/1] a warning event 4"], lines
    assert doctor.startswith("logging: the patchload logger at INFO, to a handler of its own on "
                             "stderr (PATCHLOAD_LOG_LEVEL), not passed on to the root logger")


def test_an_error_that_names_its_rank_is_not_named_twice():
    """``logger.warning("%s: ...", err)`` where the error's message starts with its rank (every
    patchload error's does): the line names the rank once."""
    from patchload._logging import _named

    err = RuntimeError("[rank 1/3] Dataset.map(-> x) (leader rank 0): the leader failed")
    line = _named("%s: making the map plainly here", (err,)) % (err,)
    assert line.startswith("patchload [rank 1/3] Dataset.map"), line
    assert line.count("[rank 1/3]") == 1, line
