"""Rank worker of tests/test_runtime.py: what ``uninstall()`` leaves of an install, and a second
install in the same process.

Usage (under torchrun, 2 ranks): ``runtime.py``; the report goes to ``$PLT_OUT/rank-<rank>.json``.

Every rank, once ``patchload``, torch and transformers are imported (before any call), notes its
fds, its threads and the agent store's key count; then, in install 1, ``AutoConfig`` and a
converting ``bfloat16`` load of ``org/llama`` (the node's shared blob: a memfd on rank 0, its
share, the mapped-model watcher, the heartbeat), keeping the model; ``uninstall()``; the same
facts again (what is left of install 1: patchload's threads, its store clients, memfds, fds,
store keys); ``install()``; ``AutoTokenizer`` (files nobody fetched yet) and the same load again,
with patchload's INFO lines; the two models' weights are compared.
"""

from __future__ import annotations

import gc
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import _common  # noqa: E402

_BARRIERS = 8


def _socket_ports() -> dict[str, int]:
    """socket inode -> remote port of this host's TCP sockets."""
    ports: dict[str, int] = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            ports[fields[9]] = int(fields[2].rsplit(":", 1)[1], 16)
    return ports


def _fds() -> dict[str, str]:
    """fd -> what it is: ``memfd:<name>``, ``socket:<remote port>``, or its link's target."""
    ports = _socket_ports()
    fds: dict[str, str] = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # the listing's own fd
        if target.startswith("/memfd:"):
            target = "memfd:" + target[len("/memfd:"):]
        elif target.startswith("socket:["):
            target = f"socket:{ports.get(target[8:-1], 'unknown')}"
        fds[fd] = target
    return fds


def _patchload_threads(wait_s: float = 0.0) -> list[str]:
    deadline = time.monotonic() + wait_s
    while True:
        names = sorted(t.name for t in threading.enumerate()
                       if t.is_alive() and t.name.startswith("patchload"))
        if not names or time.monotonic() > deadline:
            return names
        time.sleep(0.05)


def body(report: dict[str, Any]) -> None:
    os.environ["HF_HUB_USER_AGENT_ORIGIN"] = f"rank-{_common.RANK}"
    import patchload
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from patchload import _runtime
    from patchload.coordination import store as job_stores

    barrier = _common.Barrier("plt-runtime")
    for i in range(1, _BARRIERS + 1):  # every barrier key exists before any count of keys
        barrier.store.add(f"b{i}", 0)
    base = barrier.store.underlying_store  # the agent store
    barrier()

    report["before"] = {"fds": _fds(), "threads": _patchload_threads(),
                        "keys": int(base.num_keys())}
    barrier()

    first = _runtime.current()
    AutoConfig.from_pretrained("org/llama")
    model = AutoModelForCausalLM.from_pretrained("org/llama", dtype=torch.bfloat16)
    report["install1"] = {"fds": _fds(), "threads": _patchload_threads(),
                          "stores": len(job_stores.opened_stores())}
    stores = job_stores.opened_stores()
    barrier()  # both ranks done with install 1's calls

    patchload.uninstall()
    barrier()
    ours = torch.distributed.PrefixStore(f"patchload/{job_stores._namespace()}/", base)
    gc.collect()
    report["after_uninstall"] = {
        "installed": patchload.is_installed(),
        "fds": _fds(), "threads": _patchload_threads(wait_s=3.0),
        "keys": int(base.num_keys()),
        "rank_keys": {key: bool(ours.check([key]))
                      for key in ("ranks/0/state", "ranks/credentials")},
        "stores_closed": [type(job.store).__name__ == "_ClosedStore" for job in stores],
        "first_closed": first.closed,
        "current_is_first": _runtime._CURRENT is first,
    }
    barrier()  # every rank counted the keys before anyone installs again

    patchload.install()
    with _common.patchload_lines() as lines:
        AutoTokenizer.from_pretrained("org/llama")
        again = AutoModelForCausalLM.from_pretrained("org/llama", dtype=torch.bfloat16)
    report["install2"] = {
        "installed": patchload.is_installed(),
        "lines": lines,
        "same_weights": all(torch.equal(a, b) for a, b in zip(model.state_dict().values(),
                                                              again.state_dict().values())),
        "new_runtime": _runtime.current() is not first,
    }
    barrier()


if __name__ == "__main__":
    _common.main(body)
