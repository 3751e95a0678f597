"""Golden files: outputs that a behaviour-neutral refactor must leave byte-identical.

``PLT_REGENERATE_GOLDEN=1`` writes the files instead of comparing (run it on each transformers
line whose file differs, then review and commit the diff).
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Final

import pytest

GOLDEN_DIR: Final = Path(__file__).resolve().parent / "golden"
REGENERATE_VAR: Final = "PLT_REGENERATE_GOLDEN"


def check_golden(name: str, text: str, *, how: str) -> None:
    """Compare ``text`` with ``tests/golden/<name>`` byte for byte (UTF-8), or write it there
    when ``PLT_REGENERATE_GOLDEN=1``.

    Args:
        name: the file name under ``tests/golden``.
        text: what the test produced now.
        how: the command that regenerates it, for the failure message.
    """
    path = GOLDEN_DIR / name
    data = text.encode("utf-8")
    if os.environ.get(REGENERATE_VAR) == "1":
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        print(f"{REGENERATE_VAR}=1: wrote {path}")
        return
    hint = (f"If the change is intended, regenerate with `{REGENERATE_VAR}=1 {how}` (on each "
            "transformers line) and commit the reviewed diff.")
    if not path.exists():
        pytest.fail(f"golden file {path} is missing. {hint}")
    expected = path.read_bytes()
    if data != expected:
        diff = "".join(difflib.unified_diff(
            expected.decode("utf-8", "replace").splitlines(keepends=True),
            text.splitlines(keepends=True), f"golden/{name}", "now"))
        pytest.fail(f"output differs from the golden file {path}:\n{diff}\n{hint}",
                    pytrace=False)
