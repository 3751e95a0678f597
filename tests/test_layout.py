"""Guards for the refactor (REDESIGN.md §3.4 step 0a): what patchload installs, which of its
modules import which, and what ``import patchload`` pulls in.

Three checks, each a fact of today's code that a move must keep, or may only improve:

- the patches: what ``patchload._patches()`` declares, in order, and what lands once the
  patched libraries are imported, in landing order (``tests/golden/patches*.txt``);
- the layers: an AST import graph of ``patchload/`` against the layer rule, with an allow-list
  of today's upward edges and import cycles that may only shrink;
- the import probe: whether ``import patchload`` imports torch and transformers.
"""

from __future__ import annotations

import ast
import importlib.metadata
import json
import subprocess
import sys
from collections import Counter, defaultdict
from pathlib import Path
from typing import Final, Iterable

import pytest

from _golden import check_golden
from _launch import REPO_ROOT, job_env

pytestmark = [pytest.mark.tf4, pytest.mark.timeout(240)]

PACKAGE: Final = REPO_ROOT / "patchload"
TRANSFORMERS_MAJOR: Final = int(importlib.metadata.version("transformers").split(".")[0])


def _env(tmp_path: Path) -> dict[str, str]:
    # No hub is contacted: the endpoint is a closed port, the caches are the test's own.
    return job_env("http://127.0.0.1:9", tmp_path / "hf", tmp_path / "out")


def _run(code: str, tmp_path: Path) -> str:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=200, env=_env(tmp_path), cwd=tmp_path)
    assert proc.returncode == 0, f"probe failed:\n{proc.stdout}\n{proc.stderr}"
    return proc.stdout


# -------------------------------------------------------------------------------------------
# a. The patches, declared and landed

# In a fresh process: patchload first (as a user's script does), then huggingface_hub and
# transformers, then every module a patch targets, in declaration order, for each patched
# library that is installed (what doctor does for huggingface_hub and transformers). The
# landing order follows the libraries' own import order, so it is deterministic for one set of
# installed versions.
_PATCHES_PROBE: Final = r"""
import importlib, importlib.util, sys
import patchload
from patchload._patching import installed_patches
import huggingface_hub, transformers
declared = patchload._patches()
for patch in declared:
    if importlib.util.find_spec(patch.module.split(".")[0]) is None:
        continue
    try:
        importlib.import_module(patch.module)
    except ImportError:
        pass  # not in this version of the library: listed as pending
lines = []
for p in declared:
    flags = (" rebind_aliases" if p.rebind_aliases else "") + (" expand" if p.expand else "")
    lines.append(f"declared {p.module}:{p.path or '*'}{flags}")
lines += [f"landed {name}" for name in installed_patches()]
lines += [f"pending {p.module}:{p.path or '*'}" for p in declared if p.module not in sys.modules]
print("\n".join(lines))
"""


def _patches_golden() -> str:
    # The landed list differs between transformers lines (other classes, other modules; the
    # tf4 venv also lacks diffusers and peft, whose patches stay pending there).
    return "patches-tf4.txt" if TRANSFORMERS_MAJOR == 4 else "patches.txt"


def test_patches_match_golden_list(tmp_path):
    """A move that drops, renames or reorders a patch (declared or landed) fails here. So does
    an upgrade of a patched library that adds or moves what a patch expands to (the Auto
    classes): regenerate the file then, and check its diff names only the library's change."""
    out = _run(_PATCHES_PROBE, tmp_path)
    assert any(line.startswith("landed ") for line in out.splitlines()), out
    check_golden(_patches_golden(), out, how="pytest tests/test_layout.py -k patches")


# -------------------------------------------------------------------------------------------
# b. The layers

# Today's modules in the layers of REDESIGN.md §3.2, lowest first. A module may import only
# modules of its own layer or of a lower one. A module missing here fails the test: place it.
# (After the moves of §3.4 the layers become folders: weights/, patches/, and so on.)
FOUNDATION, COORDINATION, TRANSPORT, WEIGHTS, PATCHES, TOP, TESTING = range(7)
LAYER_NAMES: Final = ("foundation", "coordination", "transport", "weights", "patches", "top",
                      "testing")
LAYERS: Final[dict[str, int]] = {
    # foundation: settings, ranks, errors, library differences, the install's state, patching,
    # background threads
    "patchload._config": FOUNDATION,
    "patchload._topology": FOUNDATION,
    "patchload._errors": FOUNDATION,
    "patchload._compat": FOUNDATION,
    "patchload._state": FOUNDATION,
    "patchload._patching": FOUNDATION,
    "patchload._logging": FOUNDATION,
    "patchload._background": FOUNDATION,
    "patchload._runtime": FOUNDATION,
    "patchload._landing": FOUNDATION,
    # the patch registry's facts, handed down by install()
    "patchload._libraries": FOUNDATION,
    # coordination: ranks agree on one call through the store
    "patchload.coordination": COORDINATION,
    "patchload.coordination.beats": COORDINATION,
    "patchload.coordination.call": COORDINATION,
    "patchload.coordination.calls": COORDINATION,
    "patchload.coordination.credentials": COORDINATION,
    "patchload.coordination.followers": COORDINATION,
    "patchload.coordination.identity": COORDINATION,
    "patchload.coordination.key": COORDINATION,
    "patchload.coordination.keys": COORDINATION,
    "patchload.coordination.reaper": COORDINATION,
    "patchload.coordination.load_state": COORDINATION,
    "patchload.coordination.offline_notes": COORDINATION,
    "patchload.coordination.protocol": COORDINATION,
    "patchload.coordination.rank0": COORDINATION,
    "patchload.coordination.replay": COORDINATION,
    "patchload.coordination.rng": COORDINATION,
    "patchload.coordination.sampler": COORDINATION,
    "patchload.coordination.scope": COORDINATION,
    "patchload.coordination.store": COORDINATION,
    # transport: how bytes move
    "patchload.transport": TRANSPORT,
    "patchload.transport.arena": TRANSPORT,
    "patchload.transport.base": TRANSPORT,
    "patchload.transport.collective": TRANSPORT,
    "patchload.transport.job_collective": TRANSPORT,
    "patchload.transport.mapped_files": TRANSPORT,
    "patchload.transport.mapped_models": TRANSPORT,
    "patchload.transport.node_shm": TRANSPORT,
    "patchload.transport.registry": TRANSPORT,
    "patchload.transport.shares": TRANSPORT,
    "patchload.transport.shm": TRANSPORT,
    "patchload.transport.tensors": TRANSPORT,
    # weights/: load once, library-neutral
    "patchload.weights": WEIGHTS,
    "patchload.weights.hierarchy": WEIGHTS,
    "patchload.weights.load": WEIGHTS,
    "patchload.weights.policy": WEIGHTS,
    "patchload.weights.receive": WEIGHTS,
    "patchload.weights.share": WEIGHTS,
    "patchload.weights.writes": WEIGHTS,
    # the root patch module not moved yet (main_process_first for user code: to the top)
    "patchload._first": WEIGHTS,
    # patches/: one module per library, and their registry
    "patchload.patches": PATCHES,
    "patchload.patches.datasets": PATCHES,
    "patchload.patches.datasets_map": PATCHES,
    "patchload.patches.diffusers": PATCHES,
    "patchload.patches.evaluate": PATCHES,
    "patchload.patches._wrappers": PATCHES,
    "patchload.patches.hub": PATCHES,
    "patchload.patches.hub_api": PATCHES,
    "patchload.patches.peft": PATCHES,
    "patchload.patches.sentence_transformers": PATCHES,
    "patchload.patches.transformers": PATCHES,
    "patchload.patches.transformers.entry_points": PATCHES,
    "patchload.patches.transformers.materialize": PATCHES,
    "patchload.patches.transformers.modeling": PATCHES,
    "patchload.patches.transformers.remote_code": PATCHES,
    # top: the public API and doctor
    "patchload": TOP,
    "patchload.__main__": TOP,
    # public test helpers: no module of the library may import them
    "patchload.testing": TESTING,
    "patchload.testing.hub": TESTING,
    "patchload.testing.models": TESTING,
}

# Today's upward edges (importer, imported): each may only go away. Delete a line when its edge
# is gone (the test says which); never add one. None is left.
ALLOWED_UPWARD: Final = frozenset()

# Today's import cycles (strongly connected sets of modules, counting every kind of import):
# None left. Delete an entry when its cycle is gone; never add one.
ALLOWED_CYCLES: Final = frozenset()

KINDS: Final = ("module", "deferred", "type")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.Module, name: str, is_package: bool,
             modules: set[str]) -> Iterable[tuple[str, str]]:
    """``(imported, kind)`` for each patchload import in ``tree``. ``kind``: ``module`` (runs at
    import), ``deferred`` (inside a function body) or ``type`` (under ``if TYPE_CHECKING``).

    ``from a import b`` counts as an import of ``a.b`` when that is a module, else of ``a``. The
    packages that Python imports on the way (``patchload`` for ``patchload._state``) are not
    counted, nor imports by string (``importlib.import_module``)."""
    package = name if is_package else name.rpartition(".")[0]

    def targets(node: ast.stmt) -> Iterable[str]:
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                parent = ".".join(base + ([node.module] if node.module else []))
            else:
                parent = node.module or ""
            for alias in node.names:
                sub = f"{parent}.{alias.name}"
                yield sub if sub in modules else parent

    def walk(node: ast.AST, kind: str) -> Iterable[tuple[str, str]]:
        for child in ast.iter_child_nodes(node):
            yield from walk_one(child, kind)

    def walk_one(child: ast.AST, kind: str) -> Iterable[tuple[str, str]]:
        if isinstance(child, (ast.Import, ast.ImportFrom)):
            for target in targets(child):
                if target.split(".")[0] == "patchload":
                    yield target, kind
            return
        if isinstance(child, ast.If) and _is_type_checking(child.test):
            for stmt in child.body:
                yield from walk_one(stmt, "type")
            for stmt in child.orelse:
                yield from walk_one(stmt, kind)
            return
        inner = kind
        if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) and kind == "module":
            inner = "deferred"  # runs when the function is called, not at import
        yield from walk(child, inner)

    yield from walk(tree, "module")


def _graph() -> dict[tuple[str, str], set[str]]:
    """Every import edge between patchload modules: ``(importer, imported) -> kinds``."""
    paths = {_module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}
    edges: dict[tuple[str, str], set[str]] = defaultdict(set)
    for name, path in paths.items():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for imported, kind in _imports(tree, name, path.name == "__init__.py", set(paths)):
            if imported != name:
                edges[(name, imported)].add(kind)
    return dict(edges)


def _cycles(edges: Iterable[tuple[str, str]]) -> set[frozenset[str]]:
    """The strongly connected sets of more than one module (Tarjan, iterative)."""
    graph: dict[str, list[str]] = defaultdict(list)
    for a, b in sorted(edges):
        graph[a].append(b)
        graph.setdefault(b, [])
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[frozenset[str]] = set()
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(graph[root]))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(graph[child])))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                members = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    members.add(member)
                    if member == node:
                        break
                if len(members) > 1:
                    found.add(frozenset(members))
    return found


def test_import_graph_sees_every_kind():
    """The graph parser itself: each kind of import is found (else the checks below would pass
    vacuously), on edges known to exist today."""
    edges = _graph()
    counts = Counter(kind for kinds in edges.values() for kind in kinds)
    print(f"patchload import edges by kind: {dict(sorted(counts.items()))}")
    assert "module" in edges[("patchload._state", "patchload._config")]
    assert "deferred" in edges[("patchload", "patchload.patches")]
    assert "type" in edges[("patchload.coordination.beats", "patchload.coordination.calls")]
    assert all(counts[kind] > 0 for kind in KINDS), counts


def test_every_module_has_a_layer():
    modules = {_module_name(p) for p in PACKAGE.rglob("*.py")}
    assert not modules - set(LAYERS), (
        f"place these modules in a layer in tests/test_layout.py LAYERS: "
        f"{sorted(modules - set(LAYERS))}")
    assert not set(LAYERS) - modules, (
        f"LAYERS names modules that no longer exist; delete them: "
        f"{sorted(set(LAYERS) - modules)}")


def test_layers_import_only_downwards():
    """foundation <- coordination <- transport <- weights <- top (<- testing): a module imports
    only its own layer or lower ones, at module level, in a function or under TYPE_CHECKING."""
    edges = _graph()
    upward = {edge: kinds for edge, kinds in edges.items()
              if LAYERS.get(edge[0], TOP) < LAYERS.get(edge[1], TOP)}

    def describe(edge: tuple[str, str]) -> str:
        a, b = edge
        return (f"{a} ({LAYER_NAMES[LAYERS[a]]}) imports {b} ({LAYER_NAMES[LAYERS[b]]}), "
                f"{'/'.join(sorted(upward.get(edge, ())))}")

    new = sorted(set(upward) - ALLOWED_UPWARD)
    gone = sorted(ALLOWED_UPWARD - set(upward))
    problems = [f"new upward import: {describe(e)}; import downwards instead (move the code "
                "to the lower layer, or pass what is needed in)" for e in new]
    problems += [f"allow-listed upward import {a} -> {b} no longer exists: delete its line from "
                 "ALLOWED_UPWARD in tests/test_layout.py" for a, b in gone]
    assert not problems, "\n".join(problems)


def test_no_new_import_cycles():
    """No cycle among patchload modules, counting deferred and TYPE_CHECKING imports, except
    today's allow-listed ones."""
    cycles = _cycles(_graph())
    new = [sorted(c) for c in cycles - ALLOWED_CYCLES]
    gone = [sorted(c) for c in ALLOWED_CYCLES - cycles]
    problems = [f"new import cycle among {c}" for c in new]
    problems += [f"allow-listed import cycle {c} no longer exists: delete it from "
                 "ALLOWED_CYCLES in tests/test_layout.py" for c in gone]
    assert not problems, "\n".join(problems)


# -------------------------------------------------------------------------------------------
# c. What `import patchload` imports

_IMPORT_PROBE: Final = r"""
import json, sys, time
start = time.perf_counter()
import patchload
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, **{name: name in sys.modules
                  for name in ("torch", "transformers", "huggingface_hub", "wrapt",
                               "patchload.coordination", "patchload._patching")}}))
"""

# The patches land at the first import of a third-party package after `import patchload`
# (patchload._landing.LandOnFirstImport), or at once when one was imported before; each case in
# a fresh process. `psutil` and `wrapt`: packages the landing imports itself, while the import
# system is finding them (imported once, their spec kept).
_LANDING_PROBE: Final = r"""
import json, sys
case = sys.argv[1]
if case == "before":
    import psutil
import patchload
armed = any(type(f).__name__ == "LandOnFirstImport" for f in sys.meta_path)
landed_at_import = "wrapt" in sys.modules
if case == "uninstalled":
    patchload.uninstall()
if case in ("psutil", "wrapt"):
    module = __import__(case)
    user = "patchload.coordination.identity" if case == "psutil" else "patchload._patching"
    same = (sys.modules[case] is module is getattr(sys.modules[user], case)
            and module.__spec__.origin == module.__file__)
else:
    same = None
import huggingface_hub.file_download
from patchload._patching import installed_patches
print(json.dumps({"armed": armed, "landed_at_import": landed_at_import, "same": same,
                  "installed": patchload.is_installed(),
                  "left_meta_path": not any(type(f).__name__ == "LandOnFirstImport"
                                            for f in sys.meta_path),
                  "landed": sorted({n.split(".")[0] for n in installed_patches()})}))
"""


def test_import_probe(tmp_path):
    facts = json.loads(_run(_IMPORT_PROBE, tmp_path).splitlines()[-1])
    print(f"import patchload: {facts['seconds']:.2f} s; torch imported: {facts['torch']}, "
          f"transformers imported: {facts['transformers']}, huggingface_hub imported: "
          f"{facts['huggingface_hub']}")
    # A script that only imports patchload (or imports it before torch) pays no torch import:
    # every `import torch` of the package is inside the function that needs it.
    assert facts["torch"] is False, facts
    assert facts["transformers"] is False, facts
    assert facts["huggingface_hub"] is False, facts
    # Nor wrapt and the patch modules: they are imported when the patches land (the import
    # takes some 25 ms instead of 130-200 ms on a 2-core machine; not asserted: too noisy there).
    assert facts["wrapt"] is False, facts
    assert facts["patchload.coordination"] is False, facts
    assert facts["patchload._patching"] is False, facts


@pytest.mark.parametrize("case", ["after", "before", "psutil", "wrapt", "uninstalled"])
def test_patches_land_at_the_first_third_party_import(tmp_path, case):
    proc = subprocess.run([sys.executable, "-c", _LANDING_PROBE, case], capture_output=True,
                          text=True, timeout=200, env=_env(tmp_path), cwd=tmp_path)
    assert proc.returncode == 0, f"probe failed:\n{proc.stdout}\n{proc.stderr}"
    facts = json.loads(proc.stdout.splitlines()[-1])
    assert facts["left_meta_path"], facts
    if case == "uninstalled":  # nothing lands, and the trigger is gone
        assert (facts["installed"], facts["landed"]) == (False, []), facts
        return
    assert facts["installed"] and "huggingface_hub" in facts["landed"], facts
    assert facts["armed"] == (case != "before"), facts
    assert facts["landed_at_import"] == (case == "before"), facts
    if case in ("psutil", "wrapt"):
        assert facts["same"] is True, facts
