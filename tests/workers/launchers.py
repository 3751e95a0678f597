"""Rank worker of tests/test_launchers.py: the same checks under whichever launcher started it.

Usage: ``launchers.py --tag T --steps a,b,... [--spawn N]``; arguments a launcher adds (the
deepspeed launcher's ``--local_rank``) are ignored. ``--spawn N``: this process is the user's
script that starts N ranks with ``torch.multiprocessing.spawn``; each initialises a gloo process
group (``PLT_PG_PORT``) before loading anything.

The rank comes from ``patchload.topology()`` (no ``RANK`` under SLURM or Open MPI); reports go
to ``$PLT_OUT/rank-<rank>.json``. Steps are separated by a barrier over the test's own TCPStore
(``PLT_STORE_PORT``), never patchload's store. Steps, each a ``from_pretrained`` of its own repo id:

* ``load``: ``AutoModelForCausalLM`` of ``launch/<T>``.
* ``remote``: ``AutoConfig`` then ``AutoModel`` of ``remote/<T>`` with ``trust_remote_code=True``,
  then ``get_class_from_dynamic_module`` called directly on ``remote/<T>-direct`` while
  transformers' copies into its modules cache are slowed down (half, 0.5 s pause, rest).
* ``accelerate``: loads wrapped in ``PartialState().main_process_first()`` and
  ``Accelerator().main_process_first()`` (accelerate initialises the process group).
* ``zero3``: ``deepspeed.init_distributed`` (gloo), a ``HfDeepSpeedConfig`` with ZeRO stage 3,
  then a load of ``launch/<T>-zero3``; fingerprinted inside ``GatheredParameters``.

Before ``zero3``, every model loaded so far is loaded again plainly (``patchload.unpatch()``,
``local_files_only=True``: no request) as the reference its fingerprint must equal.
"""

from __future__ import annotations

import argparse
import datetime
import json
import logging
import socket
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

OUT = Path(os.environ["PLT_OUT"])


class _Barrier:
    """All ranks of the job meet here (the test's TCPStore; not patchload's)."""

    def __init__(self, tag: str, world_size: int) -> None:
        import torch.distributed as dist

        base = dist.TCPStore("127.0.0.1", int(os.environ["PLT_STORE_PORT"]), is_master=False,
                             timeout=datetime.timedelta(seconds=120))
        self._store = dist.PrefixStore(f"plt/{tag}/", base)
        self._world_size = world_size
        self._count = 0

    def __call__(self) -> None:
        self._count += 1
        key = f"b{self._count}"
        self._store.add(key, 1)
        deadline = time.monotonic() + 120
        while int(self._store.add(key, 0)) < self._world_size:
            if time.monotonic() > deadline:
                raise TimeoutError(f"test barrier {key} timed out")
            time.sleep(0.01)


class _Lines(logging.Handler):
    """Keeps patchload's log lines (the step-aside INFO line is asserted)."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


class _SlowCopies:
    """``shutil`` whose ``copyfile`` writes half the file, pauses 0.5 s, then writes the rest."""

    def __getattr__(self, name: str) -> Any:
        return getattr(shutil, name)

    @staticmethod
    def copyfile(src: Any, dst: Any, **kwargs: Any) -> Any:
        data = Path(src).read_bytes()
        with open(dst, "wb") as handle:
            handle.write(data[: len(data) // 2])
            handle.flush()
            time.sleep(0.5)
            handle.write(data[len(data) // 2:])
        return dst


def _gathered_fingerprint(model: Any) -> dict[str, Any]:
    import deepspeed

    import _common

    with deepspeed.zero.GatheredParameters(list(model.parameters()), modifier_rank=None):
        return _common.fingerprint(model)


def run(args: argparse.Namespace) -> None:
    """One rank's steps; writes its report (a crash is reported, then re-raised)."""
    import patchload

    topology = patchload.topology()
    # Before huggingface_hub is imported: the loopback hub attributes requests by this.
    os.environ["HF_HUB_USER_AGENT_ORIGIN"] = f"rank-{topology.rank}"
    import _common

    report: dict[str, Any] = {"rank": topology.rank, "pid": os.getpid(), "steps": {},
                              "host": socket.gethostname(), "pidns": _common._pid_namespace(),
                              "topology": _topology_dict(topology)}
    if os.environ.get("PLT_RECORD_ATTACHES") == "1":
        report["attached"], report["scopes"] = [], []
        _common._record_attaches(report["attached"], report["scopes"])
    try:
        _steps(args, report)
    except BaseException:
        import traceback

        report["crash"] = traceback.format_exc()
        raise
    finally:
        path = OUT / f"rank-{topology.rank}.json"
        path.with_suffix(".tmp").write_text(json.dumps(report, default=str, sort_keys=True))
        os.replace(path.with_suffix(".tmp"), path)


def _topology_dict(topology: Any) -> dict[str, Any]:
    return {"rank": topology.rank, "world_size": topology.world_size,
            "local_rank": topology.local_rank, "local_world_size": topology.local_world_size,
            "node": topology.node, "launcher": topology.launcher}


def _steps(args: argparse.Namespace, report: dict[str, Any]) -> None:
    import _common
    import patchload
    from patchload.coordination.store import job_store

    lines = _Lines()
    logging.getLogger("patchload").addHandler(lines)
    if logging.getLogger("patchload").level != logging.DEBUG:  # PLT_RECORD_ATTACHES: kept
        logging.getLogger("patchload").setLevel(logging.INFO)
    import transformers
    from transformers import AutoConfig, AutoModel, AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    topology = patchload.topology()
    barrier = _Barrier(args.tag, topology.world_size)
    counter = _common.SafetensorsCounter()
    steps = [s for s in args.steps.split(",") if s]
    loaded: dict[str, tuple[Any, str, dict[str, Any]]] = {}  # step -> (class, repo, kwargs)

    def load(name: str, cls: Any, repo: str, sync: bool = True, **kwargs: Any) -> Any:
        with _common.step(report, name, barrier if sync else None) as record:
            record["store"] = job_store().kind
            mark = counter.snapshot()
            model = cls.from_pretrained(repo, **kwargs)
            record["checkpoint"] = counter.since(mark)
            record["topology"] = _topology_dict(patchload.topology())
        record["fingerprint"] = _common.fingerprint(model)
        loaded[name] = (cls, repo, kwargs)
        return model

    if "load" in steps:
        load("load", AutoModelForCausalLM, f"launch/{args.tag}")
    if "remote" in steps:
        repo = f"remote/{args.tag}"
        with _common.step(report, "remote_config", barrier) as record:
            record["store"] = job_store().kind
            config = AutoConfig.from_pretrained(repo, trust_remote_code=True)
        record["class"] = type(config).__name__
        load("remote", AutoModel, repo, trust_remote_code=True)
        from transformers import dynamic_module_utils

        # Called directly, nothing but patchload orders the ranks' writes and reads of the
        # modules cache; slow copies make a reader that does not wait see a half-written file.
        dynamic_module_utils.shutil = _SlowCopies()
        with _common.step(report, "remote_direct", barrier) as record:
            record["store"] = job_store().kind
            cls = dynamic_module_utils.get_class_from_dynamic_module(
                "modeling_remote_toy.RemoteToyModel", f"{repo}-direct")
        dynamic_module_utils.shutil = shutil
        record["class"] = cls.__name__
    if "accelerate" in steps:
        from accelerate import Accelerator, PartialState

        state = PartialState(cpu=True)
        report["accelerate"] = {"distributed_type": str(state.distributed_type),
                                "process_index": state.process_index,
                                "num_processes": state.num_processes}
        # No test barrier inside: the other ranks wait in accelerate's own barrier meanwhile.
        # The models are kept past the block, as a script does (a leader's model freed before
        # its followers reach the call is not shared: they would load from the cache).
        barrier()
        with state.main_process_first():
            first = load("partial_state_first", AutoModelForCausalLM,
                         f"launch/{args.tag}-pfirst", sync=False)
        barrier()
        with Accelerator(cpu=True).main_process_first():
            second = load("accelerator_first", AutoModelForCausalLM,
                          f"launch/{args.tag}-afirst", sync=False)
        barrier()
        del first, second
    # The reference: the same calls, plain, from this rank's cache.
    barrier()
    patchload.unpatch()
    for name, (cls, repo, kwargs) in loaded.items():
        plain = cls.from_pretrained(repo, local_files_only=True, **kwargs)
        report["steps"][name]["reference"] = _common.fingerprint(plain)
    patchload.patch()
    if "zero3" in steps:
        import deepspeed
        import torch.distributed as dist
        from transformers.integrations import HfDeepSpeedConfig

        # deepspeed's CPU accelerator would JIT-compile an optional C++ shared-memory allreduce
        # at init (a compiler and minutes); plain torch collectives do the same job here.
        sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
        if not dist.is_initialized():
            deepspeed.init_distributed(dist_backend="gloo")
        # transformers sees ZeRO-3 while this object lives (a weak reference).
        ds_config = HfDeepSpeedConfig({"train_micro_batch_size_per_gpu": 1,
                                       "zero_optimization": {"stage": 3}})
        with _common.step(report, "zero3", barrier) as record:
            record["store"] = job_store().kind
            first_line = len(lines.lines)
            mark = counter.snapshot()
            model = AutoModelForCausalLM.from_pretrained(f"launch/{args.tag}-zero3")
            record["checkpoint"] = counter.since(mark)
            record["log"] = lines.lines[first_line:]
        record["fingerprint"] = _gathered_fingerprint(model)
        record["zero3"] = ds_config.is_zero3()
    barrier()
    report["log"] = lines.lines


def _spawned(index: int, world_size: int, args: argparse.Namespace) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{os.environ['PLT_PG_PORT']}",
                            rank=index, world_size=world_size)
    try:
        run(args)
    finally:
        dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tag", required=True)
    parser.add_argument("--steps", default="")
    parser.add_argument("--spawn", type=int, default=0)
    args, _ = parser.parse_known_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    if args.spawn:
        import torch.multiprocessing as mp

        mp.spawn(_spawned, args=(args.spawn, args), nprocs=args.spawn, join=True)
    else:
        run(args)


if __name__ == "__main__":
    main()
