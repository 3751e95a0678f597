"""Shared by the worker scripts the multi-rank tests run (one process per rank).

A worker must set ``HF_HUB_USER_AGENT_ORIGIN=rank-<RANK>`` before importing huggingface_hub or
transformers (the hub's request log attributes requests by it); importing this module does not
import either. Each rank writes one JSON report to ``$PLT_OUT/rank-<RANK>.json``; a crash is
reported there too (``{"crash": traceback}``) before the process exits non-zero.
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import hashlib
import json
import logging
import os
import re
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator

# A launcher sets RANK; a rank a test starts by other means (a child of a user's
# torch.multiprocessing.spawn, which sets no variable) is told its rank by PLT_RANK.
RANK = int(os.environ.get("PLT_RANK") or os.environ.get("RANK", "0"))
WORLD_SIZE = int(os.environ.get("PLT_WORLD_SIZE") or os.environ.get("WORLD_SIZE", "1"))
OUT = Path(os.environ["PLT_OUT"])


def report_path(rank: int = RANK) -> Path:
    return OUT / f"rank-{rank}.json"


def write_report(report: dict[str, Any]) -> None:
    tmp = report_path().with_suffix(".tmp")
    tmp.write_text(json.dumps(report, default=str, sort_keys=True))
    os.replace(tmp, report_path())


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


_ATTACHED = re.compile(r"attached \d+ tensors shared by pid (\d+)")
_SCOPE = re.compile(r"download scope (node|job) \(auto")


def _record_attaches(attached: list[int], scopes: list[str]) -> None:
    """Append to ``attached`` the pid named by each of patchload's "attached N tensors shared
    by pid P" debug lines in this process, and to ``scopes`` each download scope it decided
    (a log record factory: no handler is added, so what reaches stderr is unchanged; the
    ``patchload`` logger is set to DEBUG unless the job set ``PATCHLOAD_LOG_LEVEL``)."""
    if not os.environ.get("PATCHLOAD_LOG_LEVEL"):
        logging.getLogger("patchload").setLevel(logging.DEBUG)
    make = logging.getLogRecordFactory()

    def factory(*args: Any, **kwargs: Any) -> logging.LogRecord:
        record = make(*args, **kwargs)
        if record.name.startswith("patchload") and (
                "attached" in str(record.msg) or "download scope" in str(record.msg)):
            try:
                message = record.getMessage()
            except (TypeError, ValueError):
                message = ""
            if found := _ATTACHED.search(message):
                attached.append(int(found.group(1)))
            if found := _SCOPE.search(message):
                scopes.append(found.group(1))
        return record

    logging.setLogRecordFactory(factory)


def main(body: Callable[[dict[str, Any]], None], *,
         skip_finalization: bool | Callable[[], bool] = False) -> None:
    """Run ``body(report)`` and write the report; on a crash, write the traceback and exit 1.

    ``skip_finalization``: once the report is written, run the exit handlers (patchload's
    included) and leave without finalizing the interpreter (a callable: asked once ``body``
    returned). For workers that ran a gloo process
    group: torch's teardown of gloo work objects during interpreter finalization can abort a
    process that already finished ("terminate called without an active exception", see
    pytorch/pytorch#179291 and #190489), which would fail the job after its work is done.
    """
    report: dict[str, Any] = {"rank": RANK, "pid": os.getpid(), "host": socket.gethostname(),
                              "pidns": _pid_namespace(), "steps": {}}
    if os.environ.get("PLT_RECORD_ATTACHES") == "1":
        report["attached"], report["scopes"] = [], []
        _record_attaches(report["attached"], report["scopes"])
    try:
        body(report)
    except BaseException:  # noqa: BLE001 - reported, then the process fails
        report["crash"] = traceback.format_exc()
        write_report(report)
        sys.stdout.flush()
        os._exit(1)
    write_report(report)
    if skip_finalization() if callable(skip_finalization) else skip_finalization:
        atexit._run_exitfuncs()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def shorten_hub_waits() -> None:
    """``PLT_HUB_WAIT_SCALE`` (e.g. ``0.1``): huggingface_hub's sleeps between its own retries
    scaled by it: the backoff of ``http_backoff`` (1, 2, 4, 8, 8 s for a 500 or a refused
    connection) and the 1 s pause before ``http_get`` resumes a broken download. The same
    retries, the same requests, less time asleep. Call after importing huggingface_hub (the
    rank's ``HF_HUB_USER_AGENT_ORIGIN`` set); no-op when the variable is unset."""
    raw = os.environ.get("PLT_HUB_WAIT_SCALE")
    if not raw:
        return
    import types

    from huggingface_hub import file_download
    from huggingface_hub.utils import _http

    scale = float(raw)
    # http_stream_backoff (huggingface_hub 1.x; absent from 0.x) is a contextmanager around
    # the function whose defaults count.
    for name in ("http_backoff", "http_stream_backoff"):
        fn = getattr(getattr(_http, name, None), "__wrapped__", getattr(_http, name, None))
        if fn is not None:
            fn.__kwdefaults__.update(base_wait_time=scale * 1, max_wait_time=scale * 8)
    real = file_download.time
    shim = types.ModuleType("time")
    shim.__dict__.update(vars(real))
    shim.sleep = lambda seconds: real.sleep(seconds * scale)  # type: ignore[attr-defined]
    file_download.time = shim  # type: ignore[attr-defined]


# --- synchronisation between steps (not patchload's: a test-only prefix in the agent store) -----

class Barrier:
    """A barrier over the launcher's TCPStore (torchrun's agent store, or the test's own), usable
    with or without a process group. No-op at world size 1."""

    def __init__(self, name: str = "plt-barrier") -> None:
        self._store = None
        self._name = name
        self._count = 0
        if WORLD_SIZE > 1:
            import torch.distributed as dist

            base = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                                 is_master=False, timeout=datetime.timedelta(seconds=120))
            run = os.environ.get("TORCHELASTIC_RUN_ID", "") + os.environ.get(
                "TORCHELASTIC_RESTART_COUNT", "")
            self._store = dist.PrefixStore(f"{name}/{run}/", base)

    @property
    def store(self) -> Any:
        return self._store

    def __call__(self, timeout_s: float = 120.0) -> None:
        if self._store is None:
            return
        self._count += 1
        key = f"b{self._count}"
        self._store.add(key, 1)
        deadline = time.monotonic() + timeout_s
        while int(self._store.add(key, 0)) < WORLD_SIZE:
            if time.monotonic() > deadline:
                raise TimeoutError(f"[rank {RANK}] test barrier {key} timed out")
            time.sleep(0.01)


@contextlib.contextmanager
def step(report: dict[str, Any], name: str, barrier: Barrier | None) -> Iterator[dict[str, Any]]:
    """Time one step (``t0``/``t1`` wall clock, ``elapsed_s``); barriers before and after it so
    the hub log can be cut into per-step windows."""
    if barrier is not None:
        barrier()
    record: dict[str, Any] = {"t0": time.time()}
    start = time.monotonic()
    try:
        yield record
    finally:
        record["elapsed_s"] = time.monotonic() - start
        record["t1"] = time.time()
        report["steps"][name] = record
    if barrier is not None:
        barrier()


@contextlib.contextmanager
def patchload_lines(loggers: tuple[str, ...] = ("patchload.coordination.call",)
                    ) -> Iterator[list[str]]:
    """The INFO lines patchload logs for its top-level calls in this thread during the block
    ("led it", "followed rank 0: ..."; ``loggers``: the loggers to collect from), collected by
    a handler on each logger: what reaches stderr is unchanged (the loggers' handlers and, below
    WARNING, nothing prints)."""
    lines: list[str] = []
    thread = threading.get_ident()

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if record.thread == thread:
                lines.append(record.getMessage())

    logs = [logging.getLogger(name) for name in loggers]
    handler = Collect(logging.INFO)
    levels = [log.level for log in logs]
    for log in logs:
        log.addHandler(handler)
        if log.getEffectiveLevel() > logging.INFO:
            log.setLevel(logging.INFO)
    try:
        yield lines
    finally:
        for log, level in zip(logs, levels):
            log.removeHandler(handler)
            log.setLevel(level)


@contextlib.contextmanager
def threads_started() -> Iterator[list[str]]:
    """The threads started in this process during the block, each named by the function that
    started it and the thread's name: ``convert_and_load_state_dict_in_model:ThreadPoolExecutor-
    3_0`` is transformers 5's loading pool (its checkpoint step), anything else another
    (a pool downloading shards, patchload's heartbeat)."""
    names: list[str] = []
    original = threading.Thread.start

    def start(thread: threading.Thread) -> None:
        frame = sys._getframe(1)
        while frame is not None and frame.f_code.co_name != "convert_and_load_state_dict_in_model":
            frame = frame.f_back
        names.append(("convert_and_load_state_dict_in_model:" if frame is not None else "")
                     + thread.name)
        original(thread)

    threading.Thread.start = start  # type: ignore[method-assign]
    try:
        yield names
    finally:
        threading.Thread.start = original  # type: ignore[method-assign]


def error_info(exc: BaseException, start: float) -> dict[str, Any]:
    """What a test needs to know about an exception: class, bases, message, when."""
    import patchload

    return {
        "type": type(exc).__name__,
        "module": type(exc).__module__,
        "mro": [c.__name__ for c in type(exc).__mro__],
        "message": str(exc)[-4000:],
        "notes": [str(note) for note in getattr(exc, "__notes__", None) or []],
        "follower": isinstance(exc, patchload.LeaderFailedError),
        "leader_rank": getattr(exc, "leader_rank", None),
        "rank_attr": getattr(exc, "rank", None),
        "elapsed_s": time.monotonic() - start,
        "t_raised": time.time(),
        "isinstance": {name: isinstance(exc, cls) for name, cls in _error_classes().items()},
    }


def _error_classes() -> dict[str, type]:
    from huggingface_hub import errors

    return {"OSError": OSError, "TimeoutError": TimeoutError,
            "HfHubHTTPError": errors.HfHubHTTPError,
            "RepositoryNotFoundError": errors.RepositoryNotFoundError,
            "GatedRepoError": errors.GatedRepoError,
            "LocalEntryNotFoundError": errors.LocalEntryNotFoundError}


def attempt(fn: Callable[[], Any]) -> dict[str, Any]:
    """Run ``fn``; ``{"ok": True, "value": ...}`` or ``{"ok": False, "error": error_info}``."""
    start = time.monotonic()
    try:
        value = fn()
    except Exception as exc:  # noqa: BLE001 - the test inspects it
        return {"ok": False, "error": error_info(exc, start)}
    return {"ok": True, "value": value, "elapsed_s": time.monotonic() - start}


# --- fingerprints ---------------------------------------------------------------------------------

def tensor_sha(t: Any) -> str:
    """sha256 of a CPU tensor's raw bytes (any dtype, contiguous copy if needed)."""
    import torch

    d = t.detach()
    if d.numel() == 0:
        return hashlib.sha256(b"").hexdigest()
    raw = d.contiguous().reshape(-1).view(torch.uint8)
    return hashlib.sha256(raw.numpy().tobytes()).hexdigest()


def _jsonable(obj: Any) -> Any:
    return json.loads(json.dumps(obj, default=str, sort_keys=True))


def module_fingerprint(model: Any) -> dict[str, Any]:
    """Every named parameter and buffer (persistent or not, tied names included): dtype, shape,
    stride, device, requires_grad, sha256 of the bytes, whether it is an inference tensor,
    transformers' ``_is_hf_initialized`` mark, its storage as user code sees it (offset
    in it, its size: what ``torch.save`` of the tensor writes); the tie groups; the groups of
    distinct tensors that share one storage; the training flags."""
    tensors: dict[str, Any] = {}
    groups: dict[int, list[str]] = {}
    storages: dict[int, dict[int, str]] = {}  # storage data_ptr -> tensor id -> first name
    for kind, named in (("param", model.named_parameters(remove_duplicate=False)),
                        ("buffer", model.named_buffers(remove_duplicate=False))):
        for name, t in named:
            storage = t.untyped_storage() if t.device.type != "meta" else None
            tensors[name] = {"kind": kind, "dtype": str(t.dtype), "shape": list(t.shape),
                             "stride": list(t.stride()), "device": str(t.device),
                             "requires_grad": bool(t.requires_grad), "sha256": tensor_sha(t),
                             "inference": t.is_inference(),
                             "marked": getattr(t, "_is_hf_initialized", None),
                             "storage": None if storage is None else [t.storage_offset(),
                                                                      storage.nbytes()]}
            groups.setdefault(id(t), []).append(name)
            if storage is not None and storage.nbytes():
                storages.setdefault(storage.data_ptr(), {}).setdefault(id(t), name)
    return {
        "class": type(model).__name__,
        "tensors": tensors,
        "ties": sorted(sorted(g) for g in groups.values() if len(g) > 1),
        "shared_storages": sorted(sorted(g.values()) for g in storages.values() if len(g) > 1),
        "training": bool(model.training),
        "training_modules": sorted(n for n, m in model.named_modules() if m.training),
    }


def _saved_names(model: Any) -> list[str] | None:
    """The names ``save_pretrained`` writes (transformers 5 reverses the key conversions the
    load applied, which it kept on the model); None where transformers has no such step."""
    try:
        from transformers.core_model_loading import revert_weight_conversion
    except ImportError:
        return None
    return sorted(revert_weight_conversion(model, model.state_dict()))


def fingerprint(model: Any) -> dict[str, Any]:
    """:func:`module_fingerprint` of a transformers model, plus its dtype, configs, name,
    ``_keep_in_fp32_modules`` and the tensor names ``save_pretrained`` would write."""
    generation = getattr(model, "generation_config", None)
    return {
        **module_fingerprint(model),
        "saved_names": _saved_names(model),
        "dtype": str(model.dtype),
        "config": _jsonable(model.config.to_dict()),
        "generation_config": _jsonable(generation.to_dict()) if generation is not None else None,
        "name_or_path": model.name_or_path,
        "keep_in_fp32": _jsonable(getattr(model, "_keep_in_fp32_modules", None)),
    }


# --- memory ------------------------------------------------------------------------------------

def _status_bytes(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)


@contextlib.contextmanager
def peak_memory() -> Iterator[dict[str, int]]:
    """This process's resident memory during the block, in bytes: ``{"before", "peak"}``
    (``VmRSS`` at the start; ``VmHWM`` at the end, after resetting it at the start through
    ``/proc/self/clear_refs``). Resident memory counts the shared memory this process touched
    (a blob it wrote or read) as well as its private pages."""
    with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
        f.write("5")  # resets the high-water mark to the current RSS
    figures = {"before": _status_bytes("VmRSS")}
    try:
        yield figures
    finally:
        figures["peak"] = _status_bytes("VmHWM")


# --- checkpoint reads ---------------------------------------------------------------------------

class SafetensorsCounter:
    """Counts ``safetensors.safe_open`` calls (files opened) and tensor reads (``get_tensor`` or
    indexing a ``get_slice``) from now on, in every module that bound ``safe_open`` by name
    (transformers does: ``from safetensors import safe_open``)."""

    def __init__(self) -> None:
        import safetensors

        self.opens: list[str] = []
        self.reads = 0
        self._lock = threading.Lock()
        original = safetensors.safe_open
        counter = self

        class _Slice:
            def __init__(self, inner: Any) -> None:
                self._inner = inner

            def __getitem__(self, item: Any) -> Any:
                with counter._lock:
                    counter.reads += 1
                return self._inner[item]

            def __getattr__(self, name: str) -> Any:
                return getattr(self._inner, name)

        class _File:
            def __init__(self, inner: Any) -> None:
                self._inner = inner

            def __enter__(self) -> Any:
                self._inner.__enter__()
                return self

            def __exit__(self, *exc: Any) -> Any:
                return self._inner.__exit__(*exc)

            def get_tensor(self, name: str) -> Any:
                with counter._lock:
                    counter.reads += 1
                return self._inner.get_tensor(name)

            def get_slice(self, name: str) -> Any:
                return _Slice(self._inner.get_slice(name))

            def __getattr__(self, name: str) -> Any:
                return getattr(self._inner, name)

        def safe_open(filename: Any, *args: Any, **kwargs: Any) -> Any:
            with counter._lock:
                counter.opens.append(os.path.basename(str(filename)))
            return _File(original(filename, *args, **kwargs))

        self.rebound: list[str] = []
        for name, module in list(sys.modules.items()):
            if module is not None and getattr(module, "safe_open", None) is original:
                setattr(module, "safe_open", safe_open)
                self.rebound.append(name)

    def snapshot(self) -> tuple[int, int]:
        with self._lock:
            return len(self.opens), self.reads

    def since(self, mark: tuple[int, int]) -> dict[str, Any]:
        with self._lock:
            return {"opens": len(self.opens) - mark[0], "reads": self.reads - mark[1],
                    "files": self.opens[mark[0]:]}
