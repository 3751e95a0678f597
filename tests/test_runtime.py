"""One object per install (:mod:`patchload._runtime`).

* No module of ``patchload/`` keeps mutable state at module level outside the few kinds
  docs/architecture.md ("Conventions") allows: found by reading every module's AST (module-level
  assignments of mutable values, ``global`` statements, ``functools`` caches).
* In one 2-rank torchrun job: a coordinated call and a converting load (a shared blob), then
  ``uninstall()``: no thread, store client, memfd or other fd and no store key of that install
  is left; then ``install()`` again, and the second install's calls are coordinated and load the
  same weights.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path
from typing import Final, Iterator

import pytest

from _launch import REPO_ROOT, job_env, run_torchrun
from patchload.testing import LoopbackHub

PACKAGE: Final = REPO_ROOT / "patchload"

# Module-level names that hold state outside the Runtime, each with its reason. Keep it tiny:
# per-install state belongs to a part of patchload._runtime.Runtime.
ALLOWED: Final[dict[str, str]] = {
    # The one per-install global, and the lock guarding it.
    "_runtime._CURRENT": "the runtime in use: install() makes it, uninstall() ends it",
    "_runtime._LOCK": "guards _CURRENT",
    # Facts about the process that outlive an install.
    "_state._FORKED_FROM_RANK": "the rank this process was forked from (a fact of the process)",
    "coordination/store._FALLBACK_DIR": "this process's private directory when the shared one "
                                        "is unfit: one per process, removed at exit",
    "coordination/store._FALLBACK_LOCK": "guards _FALLBACK_DIR",
    "coordination/identity._identity": "kernel and node id, keyed by pid (lru_cache)",
    "coordination/key._signature": "the signatures of the patched functions (lru_cache): facts "
                                   "of the code, the same for every install",
    "coordination/replay.HISTORY": "mirrors huggingface_hub's own process-wide caches "
                                   "(HfFileSystem's), which an uninstall does not clear: a "
                                   "leader after a reinstall still answers from them",
    # A pure value.
    "__init__._config_at_import": "the (frozen) configuration read at import",
}

# Calls whose result is immutable or per context (never per install).
_PURE_CALLS: Final = {"frozenset", "tuple", "bytes", "getattr", "re.compile", "TypeVar",
                      "get_logger", "contextvars.ContextVar", "timedelta", "object"}


def _modules() -> Iterator[tuple[str, ast.Module]]:
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] == "testing":  # test helpers, not the library
            continue
        yield str(rel.with_suffix("")), ast.parse(path.read_text(), str(path))


def _mutable(node: ast.expr, annotation: ast.expr | None) -> bool:
    final = annotation is not None and "Final" in ast.unparse(annotation)
    if isinstance(node, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp, ast.SetComp)):
        return not final  # a Final table is a constant: never mutated
    if isinstance(node, ast.Call):
        return ast.unparse(node.func) not in _PURE_CALLS
    return False


def module_state() -> dict[str, str]:
    """``module.name`` -> what makes it state, for every module of patchload."""
    found: dict[str, str] = {}
    for module, tree in _modules():
        for node in tree.body:
            if isinstance(node, ast.Assign):
                targets, value, annotation = node.targets, node.value, None
            elif isinstance(node, ast.AnnAssign) and node.value is not None:
                targets, value, annotation = [node.target], node.value, node.annotation
            else:
                targets = []
            for target in targets:
                name = ast.unparse(target)
                if name != "__all__" and _mutable(value, annotation):
                    found[f"{module}.{name}"] = ast.unparse(value)[:80]
        for node in ast.walk(tree):
            if isinstance(node, ast.Global):
                for name in node.names:
                    found.setdefault(f"{module}.{name}", "global statement")
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                for decorator in node.decorator_list:
                    text = ast.unparse(decorator)
                    if "cache" in text and module.count("/") < 3:
                        found[f"{module}.{node.name}"] = f"@{text}"
    return found


def test_no_mutable_module_state_outside_the_runtime() -> None:
    found = module_state()
    unexpected = {name: why for name, why in found.items() if name not in ALLOWED}
    assert not unexpected, (
        "module-level state outside patchload._runtime.Runtime (make it a part of the runtime, "
        f"see docs/architecture.md 'Conventions'): {unexpected}")
    gone = sorted(set(ALLOWED) - set(found))
    assert not gone, f"ALLOWED names state that no longer exists; delete them: {gone}"


def test_the_scan_sees_each_kind(tmp_path: Path) -> None:
    tree = ast.parse("A = {}\nB: Final = {}\nC = Heartbeat()\nD = frozenset()\n"
                     "def f():\n    global E\n")
    node_a, node_b, node_c, node_d = tree.body[:4]
    assert _mutable(node_a.value, None)  # type: ignore[attr-defined]
    assert not _mutable(node_b.value, node_b.annotation)  # type: ignore[attr-defined]
    assert _mutable(node_c.value, None)  # type: ignore[attr-defined]
    assert not _mutable(node_d.value, None)  # type: ignore[attr-defined]


pytestmark_linux = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                      reason="multi-rank jobs need Linux")


@pytestmark_linux
@pytest.mark.timeout(300)
def test_uninstall_leaves_nothing_and_a_second_install_works(hub: LoopbackHub,
                                                             tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = job_env(hub.endpoint, tmp_path / "hf", out, PATCHLOAD_LOG_LEVEL="INFO")
    job = run_torchrun(hub, "runtime", [], nproc=2, env=env, timeout_s=240).check_ok()
    for rank, report in job.ranks.items():
        before, during, after = report["before"], report["install1"], report["after_uninstall"]
        context = (rank, report, job.outputs[0][-3000:])
        # Install 1 held something to end: a store client, and on rank 0 the shared blob.
        assert during["stores"] >= 1, context
        if rank == 0:
            assert any(v.startswith("memfd:") for v in during["fds"].values()), context
        # ... and after uninstall() none of it is left.
        assert after["installed"] is False, context
        assert after["threads"] == [], context
        assert after["stores_closed"] and all(after["stores_closed"]), context
        assert after["first_closed"] and not after["current_is_first"], context
        assert not [v for v in after["fds"].values() if v.startswith("memfd:")], context
        new = sorted(set(after["fds"].items()) - set(before["fds"].items()))
        # Left: only the library's own connections to the hub (httpx's keep-alive pool).
        hub_port = int(hub.endpoint.rsplit(":", 1)[1].strip("/"))
        assert all(target == f"socket:{hub_port}" for _, target in new), (new, context)
        assert len(after["fds"]) - len(before["fds"]) <= len(new), context
        # No key of install 1 is left in the job's store but the job's facts about its ranks:
        # rank 0's state (now "exited": the others stop waiting for it) and the credentials
        # digests every rank reported; its call keys and call sequence are gone.
        assert after["keys"] == before["keys"] + 2, context
        assert after["rank_keys"] == {"ranks/0/state": True, "ranks/credentials": True}, context
        # The second install coordinates again and loads the same weights.
        second = report["install2"]
        assert second["installed"] and second["new_runtime"] and second["same_weights"], context
    # Each call of install 2 was coordinated: one rank led it, the other followed.
    lines = [line for report in job.ranks.values() for line in report["install2"]["lines"]]
    for call in ("AutoTokenizer.from_pretrained('org/llama')",
                 "AutoModelForCausalLM.from_pretrained('org/llama')"):
        roles = sorted("led" if ": led it" in line else "followed" if ": followed" in line
                       else line for line in lines if f"{call}:" in line)
        assert roles == ["followed", "led"], (call, lines)
