"""What the whole suite must leave behind: a consistent hub cache and nothing of patchload's.

Checked once, after the last test (``conftest.py::suite_leaves_nothing_behind``):

* every blob of every Hugging Face cache the tests filled (under pytest's base temp directory)
  holds exactly what the hub served: its name is the hub's ETag, the sha256 of the content for
  LFS files and the git blob sha1 otherwise (``patchload.testing.hub``), which also pins its
  size; every snapshot link points at an existing blob. A blob a test damaged on purpose carries
  a ``<blob>.damaged-on-purpose`` file next to it and is skipped.
* the pytest process holds no patchload memfd (fd or mapping) and runs no patchload thread;
* no rank process is left running; no file is left in the rank processes' private directory
  (under the suite's own ``TMPDIR``), and no scope marker (``.patchload-scope-*``) in any cache.
"""

from __future__ import annotations

import gc
import hashlib
import os
import threading
from pathlib import Path

import psutil

DAMAGED_SUFFIX = ".damaged-on-purpose"


def _etags(path: Path) -> tuple[str, str]:
    sha256, sha1 = hashlib.sha256(), hashlib.sha1(b"blob %d\0" % path.stat().st_size)
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            sha256.update(chunk)
            sha1.update(chunk)
    return sha256.hexdigest(), sha1.hexdigest()


def cache_problems(root: Path) -> list[str]:
    """Blobs under ``root`` whose content is not what their name (the hub's ETag) says, and
    snapshot links to no blob. Partial downloads (``*.incomplete``) are not entries: ignored."""
    problems = []
    for blobs in root.rglob("blobs"):
        if not blobs.is_dir() or not blobs.parent.name.startswith(("models--", "datasets--")):
            continue
        for blob in blobs.iterdir():
            if blob.name.endswith((".incomplete", DAMAGED_SUFFIX)) or \
                    blob.with_name(blob.name + DAMAGED_SUFFIX).exists():
                continue
            if blob.name not in _etags(blob):
                problems.append(f"{blob}: content ({blob.stat().st_size} bytes) does not match "
                                "its ETag")
        for link in (blobs.parent / "snapshots").rglob("*"):
            if link.is_symlink() and not link.exists():
                problems.append(f"{link}: dangling snapshot link")
    return problems


def private_files(tmp: Path) -> list[str]:
    """The entries of patchload's private directory under ``tmp`` (a ``TMPDIR``), if any."""
    path = tmp / f"patchload-{os.getuid()}"
    return sorted(str(p) for p in path.iterdir()) if path.is_dir() else []


def process_leftovers() -> list[str]:
    """patchload memfds, patchload threads and child processes of this process."""
    gc.collect()
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:  # the listing's own fd
            continue
        if target.startswith("/memfd:patchload"):
            found.append(f"fd {fd} -> {target}")
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
        found += [f"mapping {line.split()[-2]}" for line in f if "/memfd:patchload" in line]
    found += [f"thread {t.name}" for t in threading.enumerate() if "patchload" in t.name]
    found += [f"child process {p.pid}: {' '.join(p.cmdline())[:200]}"
              for p in psutil.Process().children(recursive=True) if p.is_running()
              and p.status() != psutil.STATUS_ZOMBIE and not _resource_tracker(p)]
    return found


def _resource_tracker(process: psutil.Process) -> bool:
    # multiprocessing's helper, started once by whatever in this process first needs it (a
    # library imported by a test); it lives as long as this process by design.
    return "multiprocessing.resource_tracker" in " ".join(process.cmdline())


def scope_markers(root: Path) -> list[str]:
    return [str(p) for p in root.rglob(".patchload-scope-*")]
