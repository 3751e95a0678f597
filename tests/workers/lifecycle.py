"""Rank worker of tests/test_lifecycle.py: what patchload leaves alive between a job's phases.

Usage: ``lifecycle.py regroup`` or ``lifecycle.py teacher``; reports go to
``$PLT_OUT/rank-<rank>.json``.

* ``regroup`` (the user's script; starts 2 ranks with ``torch.multiprocessing.spawn``): each
  rank runs ``init_process_group`` (gloo, ``tcp://127.0.0.1:$PLT_PG_PORT``),
  ``AutoConfig.from_pretrained("org/llama")``, ``destroy_process_group()`` and a garbage
  collection (it reports whether the first group's store object is gone: nothing holds it),
  then a second group on ``$PLT_PG_PORT2`` and an ``all_reduce`` (reported). Not the same port:
  torch 2.13 keeps serving it after ``destroy_process_group``, with the first group's keys, and
  a second group there hangs now and then without patchload too.
* ``teacher`` (under a launcher): only rank 0 loads ``org/llama`` as ``bfloat16`` (a converting
  load: a shared blob), then ``del model`` and ``gc.collect()``; it reports its shared-memory
  fds and their bytes before and once they are gone (at most 15 s), how long that took, and how
  long its interpreter took to exit (the other ranks never make the call).
* ``forked`` (under a launcher): every rank loads ``AutoConfig.from_pretrained("org/llama")``,
  then a child it forks (``multiprocessing``'s fork context, as a ``DataLoader`` worker) makes
  the same call, then the rank loads the tokenizer. It reports the child's config, what patchload
  logged in the child, whether the child counts as a forked worker, and the rank's own INFO line
  for the tokenizer (the child left the rank's call keys alone).
* ``ended`` (under a launcher, ``PATCHLOAD_LOG_LEVEL=INFO``): every rank loads ``org/llama`` as
  ``bfloat16`` (a converting load: the node's shared copy) three times, and each time ends its
  use of the shared copy another way: ``model.to(torch.float16)``, ``model.to(torch.device("cpu",
  0))`` (what the HF Trainer does on CPU), ``del model`` and ``gc.collect()``; after each it waits
  1.5 s (patchload looks every 0.5 s) and keeps the model (but the last) to the end. The log
  lines are asserted.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import sys
import time
import weakref
from pathlib import Path

OUT = Path(os.environ["PLT_OUT"])


def _write(rank: int, report: dict) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / f"rank-{rank}.json").write_text(json.dumps(report, sort_keys=True))


def _regroup_rank(index: int, world_size: int) -> None:
    os.environ["HF_HUB_USER_AGENT_ORIGIN"] = f"rank-{index}"
    import patchload  # noqa: F401 - installs the patches (unless PATCHLOAD=0)
    import torch
    import torch.distributed as dist
    from datetime import timedelta

    init = f"tcp://127.0.0.1:{os.environ['PLT_PG_PORT']}"
    dist.init_process_group("gloo", init_method=init, rank=index, world_size=world_size,
                            timeout=timedelta(seconds=30))
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained("org/llama")
    first_store = weakref.ref(dist.distributed_c10d._get_default_store())
    dist.destroy_process_group()
    gc.collect()
    store_freed = first_store() is None
    second = f"tcp://127.0.0.1:{os.environ['PLT_PG_PORT2']}"
    dist.init_process_group("gloo", init_method=second, rank=index, world_size=world_size,
                            timeout=timedelta(seconds=30))
    value = torch.tensor([float(index + 1)])
    dist.all_reduce(value)
    dist.destroy_process_group()
    _write(index, {"model_type": config.model_type, "sum": value.item(),
                   "store_freed": store_freed})


def _memfds() -> dict[str, int]:
    """This process's open memfds (patchload's blobs): how many, and their bytes."""
    count = size = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("/memfd:"):
                count += 1
                size += os.fstat(int(fd)).st_size
        except OSError:
            continue
    return {"count": count, "bytes": size}


def _teacher() -> None:
    rank = int(os.environ["RANK"])
    exit_log = OUT / f"exit-{rank}.json"
    # Registered before patchload's own handlers, so it runs after them (atexit is LIFO).
    atexit.register(lambda: exit_log.write_text(json.dumps({"t_exit": time.time()})))
    os.environ["HF_HUB_USER_AGENT_ORIGIN"] = f"rank-{rank}"
    import patchload  # noqa: F401
    import torch

    report: dict = {}
    if rank == 0:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained("org/llama", dtype=torch.bfloat16)
        report["param_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
        report["loaded"] = _memfds()
        del model
        gc.collect()
        freed_at = time.time()
        # rank 1 never makes the call: it is waited for until 5 s after the share, no longer
        while _memfds()["count"] and time.time() < freed_at + 15:
            time.sleep(0.1)
        report["freed"] = _memfds()
        report["freed_after_s"] = time.time() - freed_at
    report["t_end"] = time.time()
    _write(rank, report)


def _in_child(conn: object) -> None:
    import logging

    import patchload._state

    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    log = logging.getLogger("patchload")
    log.addHandler(Collect(logging.DEBUG))
    log.setLevel(logging.DEBUG)
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained("org/llama").to_dict()
    conn.send({"config": config, "lines": lines,  # type: ignore[attr-defined]
               "forked_worker": patchload._state.forked_worker()})


def _forked() -> None:
    import multiprocessing

    import _common

    rank = int(os.environ["RANK"])
    os.environ["HF_HUB_USER_AGENT_ORIGIN"] = f"rank-{rank}"
    import patchload  # noqa: F401
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained("org/llama").to_dict()
    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_in_child, args=(child,))
    proc.start()
    got = parent.recv() if parent.poll(60) else {"error": "the child sent nothing in 60 s"}
    proc.join(30)
    with _common.patchload_lines() as lines:
        AutoTokenizer.from_pretrained("org/llama")
    _write(rank, {"config": config, "child": got, "child_exit": proc.exitcode,
                  "tokenizer_lines": lines})


def _ended() -> None:
    rank = int(os.environ["RANK"])
    os.environ["HF_HUB_USER_AGENT_ORIGIN"] = f"rank-{rank}"
    import patchload  # noqa: F401
    import torch
    from transformers import AutoModelForCausalLM

    kept = []
    for end in ("float16", "cpu:0", "del"):
        print(f"[rank {rank}] step {end}", file=sys.stderr, flush=True)
        model = AutoModelForCausalLM.from_pretrained("org/llama", dtype=torch.bfloat16)
        if end == "float16":
            model.to(torch.float16)
        elif end == "cpu:0":
            model.to(torch.device("cpu", 0))
        else:
            del model
            gc.collect()
        time.sleep(1.5)
        if end != "del":
            kept.append(model)
    _write(rank, {"steps": 3})


def main() -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    if sys.argv[1] == "regroup":
        import torch.multiprocessing as mp

        mp.spawn(_regroup_rank, args=(2,), nprocs=2, join=True)
    elif sys.argv[1] == "teacher":
        _teacher()
    elif sys.argv[1] == "forked":
        _forked()
    elif sys.argv[1] == "ended":
        _ended()
    else:
        raise SystemExit(f"unknown mode {sys.argv[1]!r}")


if __name__ == "__main__":
    main()
