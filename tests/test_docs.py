"""The README and docs/ stay what a new user needs: small, first things first, in step with the code."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def _config_doc():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("config_doc", ROOT / "scripts" / "config_doc.py")
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    return module


def test_readme_is_small_and_starts_with_what_a_user_copies() -> None:
    text = README.read_text()
    size = len(text.encode())
    assert size <= 12 * 1024, f"README.md is {size} bytes, more than 12 KiB: move detail to docs/"
    first_screen = "\n".join(text.splitlines()[:60])
    for needed in ("import patchload", "make demo", "make test"):
        assert needed in first_screen, f"{needed!r} is not on README.md's first screen (60 lines)"
    # Exactly the two set-up commands: the demo and the tests.
    commands = re.findall(r"^make \w+", text, flags=re.M)
    assert commands == ["make demo", "make test"], commands


def test_every_docs_link_resolves() -> None:
    for page in [README, *sorted((ROOT / "docs").glob("*.md"))]:
        for target in re.findall(r"\]\(((?:docs/)?[\w./-]+\.md)\)", page.read_text()):
            path = (page.parent / target) if page != README else ROOT / target
            assert path.exists(), f"{page.relative_to(ROOT)} links to {target}, which is missing"


def test_configuration_table_is_generated_from_config() -> None:
    doc = ROOT / "docs" / "configuration.md"
    module = _config_doc()
    assert doc.read_text() == module.render(doc.read_text()), (
        "docs/configuration.md's variable table differs from patchload.Config: run "
        "`.venv/bin/python scripts/config_doc.py`")
    from patchload._config import _VARIABLES

    for name in _VARIABLES:
        assert f"| `{name}` |" in doc.read_text(), f"{name} has no row in docs/configuration.md"
