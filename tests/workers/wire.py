"""Rank worker: ``AutoModelForCausalLM.from_pretrained`` of the tiny llama, recording every
write patchload makes to its job store (see tests/test_wire.py).

Usage: ``wire.py --loads f32,bf16``: one load per name, each a step of its own (barriers around
it): ``f32`` as saved (float32; on one node its followers map the checkpoint files), ``bf16``
with ``dtype=torch.bfloat16`` (converted on the leader: shared through a blob or a broadcast).

The recorder wraps ``torch.distributed.PrefixStore``'s Python-level write methods (``set``,
``compare_set``, ``add``, ``delete_key``, ``append``, ``multi_set``) and keeps the calls made
on a job store of patchload's (the stores ``patchload.coordination.store._make`` returns),
with the key (below the job's namespace) and, for ``set``/``compare_set``/``multi_set``, the
value written.
Nothing patchload does changes: the wrappers call the original methods with the same
arguments, ``_make`` is wrapped only to learn which stores are patchload's, and C++ callers of
a store (a private gloo group's rendezvous) bypass the Python-level wrappers.
The report holds the records in this process's order (``store_writes``), each tagged with the
step it was made in (``step``; ``None`` outside the steps).
"""

from __future__ import annotations

import os

os.environ["HF_HUB_USER_AGENT_ORIGIN"] = f"rank-{os.environ.get('RANK', '0')}"

import argparse  # noqa: E402
import threading  # noqa: E402
from typing import Any  # noqa: E402

import _common  # noqa: E402

import torch.distributed as dist  # noqa: E402

_WRITES = ("set", "compare_set", "add", "delete_key", "append", "multi_set")


class StoreRecorder:
    """Records the writes made through patchload's job stores in this process."""

    def __init__(self) -> None:
        self.records: list[dict[str, Any]] = []
        self.step: str | None = None  # the worker's step now, for every thread's records
        self._stores: list[Any] = []  # patchload's PrefixStores (compared by identity)
        self._lock = threading.Lock()

    def install(self) -> None:
        """Wrap the store methods and patchload's store factory (call after ``import
        patchload``, before its first coordinated call)."""
        from patchload.coordination import store

        if store.opened_stores():
            raise RuntimeError("a job store was made before the recorder was installed")
        make = store._make

        def recording_make(*args: Any, **kwargs: Any) -> Any:
            job = make(*args, **kwargs)
            with self._lock:
                self._stores.append(job.store)
            return job

        store._make = recording_make
        for name in _WRITES:
            setattr(dist.PrefixStore, name, self._wrap(name, getattr(dist.PrefixStore, name)))

    def _ours(self, obj: Any) -> bool:
        with self._lock:
            return any(obj is s for s in self._stores)

    def _wrap(self, name: str, original: Any) -> Any:
        recorder = self

        def method(self: Any, *args: Any, **kwargs: Any) -> Any:
            if recorder._ours(self):
                record: dict[str, Any] = {"op": name, "step": recorder.step}
                if name == "multi_set":
                    record["keys"] = list(args[0])
                    record["values"] = [_text(v) for v in args[1]]
                else:
                    record["key"] = args[0]
                if name == "set":
                    record["value"] = _text(args[1])
                elif name == "compare_set":
                    record["expected"], record["value"] = _text(args[1]), _text(args[2])
                elif name == "add":
                    record["amount"] = int(args[1])
                recorder.records.append(record)  # list.append: atomic under the GIL
            return original(self, *args, **kwargs)

        method.__name__ = name
        return method


def _text(value: Any) -> str:
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else str(value)


LOADS = {"f32": {}, "bf16": {"dtype": "bfloat16"}}


def body(report: dict[str, Any]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--loads", required=True, help=f"comma-separated, of {sorted(LOADS)}")
    args = parser.parse_args()

    import patchload

    recorder = StoreRecorder()
    recorder.install()
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    transformers.logging.set_verbosity_error()
    barrier = _common.Barrier()
    for name in args.loads.split(","):
        kwargs = {k: getattr(torch, v) for k, v in LOADS[name].items()}
        with _common.step(report, name, barrier) as record, \
                _common.patchload_lines() as lines:
            recorder.step = name
            result = _common.attempt(
                lambda: AutoModelForCausalLM.from_pretrained("org/llama", **kwargs))
            recorder.step = None
        record["error"] = None if result["ok"] else result["error"]
        record["patchload"] = lines
        del result
    report["installed"] = patchload.is_installed()
    report["store_writes"] = recorder.records


if __name__ == "__main__":
    _common.main(body)
