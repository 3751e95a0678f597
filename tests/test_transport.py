"""Tests of patchload.transport: shm (memfd blob / file mapping), collective (private gloo group).

Every test spawns real processes (``multiprocessing`` spawn), coordinates them through a
``TCPStore`` served by the test process (plus a ``FileStore`` in ``tmp_path``), joins them with a
deadline and terminates leftovers. Several checks share one spawned job, because spawning and
importing torch costs seconds per process.

Workers report through ``<result_dir>/<rank>.json``; an exception in a worker is written there as
a traceback and fails the test with it.
"""

from __future__ import annotations

import datetime
import gc
import hashlib
import json
import math
import multiprocessing
import os
import pickle
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

import pytest
import torch
import torch.distributed as dist

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"),
                                reason="memfd and /proc are Linux only")

MEMFD_LINK = "/memfd:patchload"
JOIN_DEADLINE_S = 90.0
STORE_TIMEOUT_S = 60.0


# --- process helpers ----------------------------------------------------------------------------


def _client(port: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, is_master=False,
                         timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S))


def _wait_key(store: dist.Store, key: str,
              procs: dict[int, multiprocessing.Process] | None = None) -> str:
    """Wait for ``key``; with ``procs`` (rank -> worker), stop early when one of them failed."""
    if procs is None:
        store.wait([key], datetime.timedelta(seconds=STORE_TIMEOUT_S))
        return store.get(key).decode()
    deadline = time.monotonic() + STORE_TIMEOUT_S
    while not store.check([key]):
        failed = {rank: p.exitcode for rank, p in procs.items() if p.exitcode}
        if failed:
            raise AssertionError(f"waiting for {key!r}: workers exited with codes {failed}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"waiting for {key!r}: timed out after {STORE_TIMEOUT_S} s")
        time.sleep(0.05)
    return store.get(key).decode()


def _worker(job: str, rank: int, args: dict[str, Any]) -> None:
    """Spawned entry point: run ``job`` and write its JSON report, or the traceback."""
    result_path = Path(args["result_dir"]) / f"{rank}.json"
    try:
        report = _JOBS[job](rank, args)
    except BaseException:
        result_path.write_text(json.dumps({"error": traceback.format_exc()}))
        raise
    result_path.write_text(json.dumps({"ok": True, **(report or {})}))


def _run_job(job: str, nprocs: int, args: dict[str, Any], tmp_path: Path, *,
             during: Callable[[list[multiprocessing.Process]], None] | None = None,
             expected_exitcodes: dict[int, int] | None = None) -> list[dict[str, Any]]:
    """Spawn ``nprocs`` workers, optionally run ``during(processes)``, join them with a deadline.

    Returns every rank's report; fails on a worker error, a wrong exit code or the deadline.
    """
    result_dir = tmp_path / f"results-{job}"
    result_dir.mkdir()
    args = {**args, "result_dir": str(result_dir)}
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_worker, args=(job, rank, args), daemon=True)
             for rank in range(nprocs)]
    for p in procs:
        p.start()
    during_error: BaseException | None = None
    try:
        if during is not None:
            try:
                during(procs)
            except Exception as err:  # report the workers' errors first: they are the cause
                during_error = err
        # After a failure seen by ``during``, the others would only wait for it: stop them now.
        deadline = time.monotonic() + (JOIN_DEADLINE_S if during_error is None else 0.0)
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [rank for rank, p in enumerate(procs) if p.is_alive()]
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(5)
            if p.is_alive():
                p.kill()
                p.join(5)
    reports = []
    for rank in range(nprocs):
        path = result_dir / f"{rank}.json"
        reports.append(json.loads(path.read_text()) if path.exists() else {})
    errors = {rank: r["error"] for rank, r in enumerate(reports) if "error" in r}
    assert not errors, "worker errors:\n" + "\n".join(f"rank {k}:\n{v}" for k, v in errors.items())
    if during_error is not None:
        raise during_error
    assert not hung, f"ranks {hung} still running after {JOIN_DEADLINE_S} s"
    expected_exitcodes = expected_exitcodes or {}
    codes = {rank: p.exitcode for rank, p in enumerate(procs)}
    wanted = {rank: expected_exitcodes.get(rank, 0) for rank in range(nprocs)}
    assert codes == wanted, f"exit codes {codes}, expected {wanted}"
    return reports


@pytest.fixture()
def tcp_store() -> dist.TCPStore:
    """A TCPStore served by the test process; workers connect to ``store.port``."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S))
    yield store
    del store


def _memfd_holders(pids: list[int]) -> dict[int, list[str]]:
    """For each live pid, its fds and mappings that are patchload memfds."""
    found: dict[int, list[str]] = {}
    for pid in pids:
        hits = []
        try:
            for name in os.listdir(f"/proc/{pid}/fd"):
                try:
                    link = os.readlink(f"/proc/{pid}/fd/{name}")
                except OSError:
                    continue
                if link.startswith(MEMFD_LINK):
                    hits.append(f"fd {name}")
            with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
                hits += [line.strip() for line in f if MEMFD_LINK in line]
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue  # exited (or a zombie): holds nothing
        if hits:
            found[pid] = hits
    return found


def _bytes(t: torch.Tensor) -> bytes:
    """The tensor's values as raw bytes, in C order (bitwise comparison, NaN payloads included)."""
    c = t.detach().contiguous().reshape(-1)
    return bytes(c.view(torch.uint8).numpy()) if c.numel() else b""


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and _bytes(a) == _bytes(b)


# --- collective ---------------------------------------------------------------------------------

BUCKET_BYTES = 4096


def _collective_tensors() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    nan_payload = torch.tensor([0x7FC00001, 0x7FA00000, 0xFFC00123], dtype=torch.int64)
    fp32 = torch.randn(37, 5, generator=g)
    fp32.view(-1)[:3] = nan_payload.to(torch.int32).view(torch.float32)  # odd NaN bit patterns
    return {
        "fp32": fp32,
        "bf16": torch.randn(19, 3, generator=g).to(torch.bfloat16),
        "fp16": torch.randn(7, generator=g).to(torch.float16),
        "int64": torch.randint(-2**62, 2**62, (11,), generator=g, dtype=torch.int64),
        "bool": torch.rand(13, generator=g) > 0.5,
        "scalar": torch.tensor(3.25, dtype=torch.float64),
        "empty": torch.empty(0, 4),
        "large": torch.randn(3 * BUCKET_BYTES // 4 + 17, generator=g),  # 3+ buckets of chunks
        "transposed": torch.arange(60, dtype=torch.int32).reshape(6, 10).T,  # not contiguous
        "after_large": torch.randn(5, generator=g).to(torch.bfloat16),
    }


def _broadcast_and_check(store: dist.Store, rank: int, tag: str) -> dict[str, Any]:
    from patchload.transport import TensorMeta, meta_of
    from patchload.transport import collective

    expected = _collective_tensors()
    with collective.private_group(store, group_rank=rank, group_size=3, tag=tag,
                                  timeout_s=30) as group:
        if rank == 0:
            store.set(f"metas/{tag}", json.dumps([meta_of(t).to_json() for t in expected.values()]))
            out = collective.broadcast(group, list(expected.values()), src_group_rank=0,
                                       is_src=True, bucket_bytes=BUCKET_BYTES)
            return {"same_objects": all(a is b for a, b in zip(out, expected.values()))}
        metas = [TensorMeta.from_json(m) for m in json.loads(_wait_key(store, f"metas/{tag}"))]
        out = collective.broadcast(group, metas, src_group_rank=0, is_src=False,
                                   bucket_bytes=BUCKET_BYTES)
    mismatched = [name for (name, t), o in zip(expected.items(), out) if not _same(t, o)]
    storages = {o.untyped_storage().data_ptr() for o in out if o.numel()}
    return {"mismatched": mismatched, "all_contiguous": all(o.is_contiguous() for o in out),
            "own_storages": len(storages) == sum(1 for o in out if o.numel()),
            "devices": sorted({str(o.device) for o in out})}


def _job_collective(rank: int, args: dict[str, Any]) -> dict[str, Any]:
    tcp = _client(args["port"])
    # Phase 1: no default process group anywhere; the store is a FileStore.
    before_init = dist.is_initialized()
    file_store = dist.FileStore(args["file_store"], 3)
    without = _broadcast_and_check(file_store, rank, "no-default-pg")

    # Phase 2: the user initialised a default group; ours must not issue anything on it.
    dist.init_process_group("gloo", store=dist.PrefixStore("user", tcp), rank=rank, world_size=3)
    default = dist.distributed_c10d._get_default_group()
    seq_before = default._get_sequence_number_for_group()
    with_default = _broadcast_and_check(dist.PrefixStore("job", tcp), rank, "with-default-pg")
    seq_after = default._get_sequence_number_for_group()
    total = torch.tensor([rank + 1])
    dist.all_reduce(total)  # the user's own collectives still line up
    dist.destroy_process_group()
    return {"before_init": before_init, "without": without, "with": with_default,
            "seq_unchanged": seq_before == seq_after, "user_allreduce": int(total)}


@pytest.mark.timeout(150)
def test_collective_broadcast_bitwise_with_and_without_default_group(tmp_path, tcp_store):
    reports = _run_job("collective", 3, {"port": tcp_store.port,
                                         "file_store": str(tmp_path / "filestore")}, tmp_path)
    for rank, report in enumerate(reports):
        assert report["before_init"] is False
        assert report["seq_unchanged"], f"rank {rank} issued collectives on the default group"
        assert report["user_allreduce"] == 6
        for phase in ("without", "with"):
            result = report[phase]
            if rank == 0:
                assert result == {"same_objects": True}
            else:
                assert result == {"mismatched": [], "all_contiguous": True, "own_storages": True,
                                  "devices": ["cpu"]}, (rank, phase)


def _job_collective_errors(rank: int, args: dict[str, Any]) -> dict[str, Any]:
    from patchload.transport import TransportError, meta_of
    from patchload.transport import collective

    store = dist.PrefixStore("errors", _client(args["port"]))
    tensors = [torch.arange(10, dtype=torch.float32), torch.ones(3, dtype=torch.bfloat16)]
    metas = [meta_of(t) for t in tensors]
    report: dict[str, Any] = {}

    def attempt(group: collective.PrivateGroup, my_metas: list[Any]) -> dict[str, Any]:
        started = time.monotonic()
        try:
            collective.broadcast(group, tensors if rank == 0 else my_metas, src_group_rank=0,
                                 is_src=rank == 0, bucket_bytes=1024)
        except TransportError as err:
            clone = pickle.loads(pickle.dumps(err))
            return {"type": type(err).__name__, "message": str(err), "rank": err.rank,
                    "timeout": isinstance(err, TimeoutError), "chained": err.__cause__ is not None,
                    "elapsed_s": time.monotonic() - started,
                    "pickles": type(clone) is type(err) and str(clone) == str(err)}
        return {"type": None}

    # 1. Rank 2 describes other tensors: every member fails at once, nobody hangs.
    wrong = [metas[0], meta_of(torch.ones(4, dtype=torch.bfloat16))]
    with collective.private_group(store, group_rank=rank, group_size=3, tag="mismatch",
                                  timeout_s=20) as group:
        report["mismatch"] = attempt(group, wrong if rank == 2 else metas)

    # 2. The source stalls: receivers time out after about timeout_s.
    group = collective.private_group(store, group_rank=rank, group_size=3, tag="stall",
                                     timeout_s=2)
    if rank == 0:
        time.sleep(3.5)
    else:
        report["stall"] = attempt(group, metas)
    group.close()

    # 3. The source dies after the group formed: receivers fail fast, well before the timeout.
    group = collective.private_group(store, group_rank=rank, group_size=3, tag="dead",
                                     timeout_s=30)
    if rank == 0:
        os._exit(3)
    report["dead"] = attempt(group, metas)
    group.close()
    return report


@pytest.mark.timeout(150)
def test_collective_errors_mismatch_timeout_dead_peer(tmp_path, tcp_store):
    reports = _run_job("collective_errors", 3, {"port": tcp_store.port}, tmp_path,
                       expected_exitcodes={0: 3})
    for rank in range(3):
        if rank == 0:
            continue  # exited on purpose; its report was never written
        report = reports[rank]
        mismatch = report["mismatch"]
        assert mismatch["type"] == "TransportError" and not mismatch["timeout"]
        assert "describe different tensors" in mismatch["message"]
        assert f"group rank {rank}/3" in mismatch["message"] and "'mismatch'" in mismatch["message"]
        assert mismatch["rank"] == rank and mismatch["pickles"]

        stall = report["stall"]
        assert stall["type"] == "TransportTimeout" and stall["timeout"] and stall["chained"]
        assert 1.5 < stall["elapsed_s"] < 10, stall
        assert "'stall'" in stall["message"] and "timed out" in stall["message"]

        dead = report["dead"]
        assert dead["type"] == "TransportError" and not dead["timeout"] and dead["chained"]
        assert dead["elapsed_s"] < 15, dead
        assert "'dead'" in dead["message"]


def test_collective_argument_errors():
    from patchload.transport import TensorMeta
    from patchload.transport import collective

    store = dist.HashStore()
    with pytest.raises(ValueError, match="accepted values"):
        collective.private_group(store, group_rank=0, group_size=1, tag="x", timeout_s=5,
                                 backend="mpi")
    with pytest.raises(ValueError, match="group_rank"):
        collective.private_group(store, group_rank=1, group_size=1, tag="x", timeout_s=5)
    with collective.private_group(store, group_rank=0, group_size=1, tag="solo",
                                  timeout_s=5) as group:
        with pytest.raises(ValueError, match="is_src"):
            collective.broadcast(group, [], src_group_rank=0, is_src=False, bucket_bytes=16)
        tensors = [torch.arange(5), torch.empty(0)]
        assert collective.broadcast(group, tensors, src_group_rank=0, is_src=True,
                                    bucket_bytes=16) == tensors
    with pytest.raises(ValueError, match="closed"):
        collective.broadcast(group, tensors, src_group_rank=0, is_src=True, bucket_bytes=16)
    with pytest.raises(ValueError, match="nbytes"):
        TensorMeta.from_json({"shape": [2], "dtype": "bfloat16", "nbytes": 3})


@pytest.mark.timeout(60)
def test_a_blocked_store_wait_holds_up_no_other_threads_request_nor_the_heartbeat(tcp_store):
    """A private group's rendezvous waits in the store for the members still to come; on the
    client the process's other threads use, it held up each of their requests until it ended
    (an ``add`` took the group's whole timeout): under ``PATCHLOAD_TRANSPORT=collective`` with
    loads in threads, the members the rendezvous waited for waited on those requests (issue 30
    item 6). The heartbeat, likewise, beats on a client no other request shares."""
    import threading

    from patchload._config import Config
    from patchload._topology import Topology
    from patchload.coordination import beats, protocol
    from patchload.coordination.store import JobStore
    from patchload.transport import TransportError, collective

    client = _client(tcp_store.port)
    errors: list[BaseException] = []

    def rendezvous() -> None:  # member 1 never comes: it waits out its 3 s timeout
        try:
            collective.private_group(client, group_rank=0, group_size=2,
                                     tag=f"lonely-{time.monotonic()}", timeout_s=3)
        except TransportError as err:
            errors.append(err)

    thread = threading.Thread(target=rendezvous)
    thread.start()
    time.sleep(0.5)  # inside its wait for member 1
    start = time.monotonic()
    client.add("other-thread", 1)
    took = time.monotonic() - start
    thread.join(10)
    assert len(errors) == 1 and isinstance(errors[0], TransportError), errors
    assert took < 1.0, f"an add() behind the rendezvous took {took:.1f} s"

    job = JobStore(client, "agent", threading.RLock())
    call = protocol.Call("t/heartbeat-client/", "load()", "job",
                         Topology(0, 2, 0, 2, 0, "torchrun"), Config(), job)
    assert job.heartbeat_client() is job.heartbeat_client() is not client
    waiter = threading.Thread(target=_blocked_wait, args=(client,))
    waiter.start()
    time.sleep(0.5)
    start = time.monotonic()
    beats.beat(call, heartbeat=True)
    took = time.monotonic() - start
    waiter.join(10)
    assert took < 1.0, f"a heartbeat beside a wait on the shared client took {took:.1f} s"
    assert int(tcp_store.add("t/heartbeat-client/beat", 0)) == 1


def _blocked_wait(store: dist.Store) -> None:
    """A wait on ``store`` that times out after 3 s (a key nobody sets)."""
    try:
        store.wait(["never-set"], datetime.timedelta(seconds=3))
    except RuntimeError:  # DistStoreError: the timeout
        pass


def test_plan_splits_large_tensors_and_packs_small_ones():
    from patchload.transport import TensorMeta
    from patchload.transport.collective import _plan

    # Whole tensors start at 64-byte aligned offsets in their bucket (as in a blob).
    metas = [TensorMeta((n,), "uint8", n) for n in (3, 4, 0, 300, 2, 70, 2)]
    assert _plan(metas, 128) == [[(0, 0, 3, 0), (1, 0, 4, 64)], [(3, 0, 128, 0)],
                                 [(3, 128, 128, 0)], [(3, 256, 44, 0)], [(4, 0, 2, 0)],
                                 [(5, 0, 70, 0)], [(6, 0, 2, 0)]]


# --- shm ----------------------------------------------------------------------------------------


def _shm_extra_tensors() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(99)
    return [
        torch.randn(33, 17, generator=g).to(torch.bfloat16),
        torch.randn(9, generator=g).to(torch.float16),
        torch.arange(-5, 20, dtype=torch.int64),
        torch.rand(21, generator=g) > 0.5,
        torch.tensor(2.5),                                   # 0-d
        torch.empty(0, 4),                                   # empty
        torch.randn(8, 12, generator=g).T,                   # dense, not contiguous: stride kept
        torch.randn(6, 8, generator=g)[:, ::2],              # gaps: stored contiguous
    ]


def _maps_of_self(needle: str) -> list[str]:
    with open("/proc/self/maps", encoding="utf-8", errors="replace") as f:
        return [line.strip() for line in f if needle in line]


def _job_shm(rank: int, args: dict[str, Any]) -> dict[str, Any]:
    from safetensors.torch import load_file, save_file

    from patchload.transport import shm

    store = _client(args["port"])
    report: dict[str, Any] = {"pid": os.getpid()}
    if rank == 0:
        store.set("pid/0", str(os.getpid()))
        dev_shm_before = sorted(os.listdir("/dev/shm"))
        clean = load_file(args["clean_file"])            # zero-copy: views of a file mapping
        dirty = load_file(args["dirty_file"])
        dirty["mod"].add_(1)                             # COW'd pages: must not be shared by path
        tensors = [clean["w32"], clean["wbf"], dirty["mod"], *_shm_extra_tensors()]
        expected = [t.clone() for t in tensors]
        seen: list[tuple[int, bool]] = []
        descriptor, replacements = shm.share(
            tensors, on_shared=lambda i, r: seen.append((i, _same(r, expected[i]))))
        kinds = [e["kind"] for e in descriptor["tensors"]]
        fd = descriptor["fd"]
        try:
            os.pwrite(fd, b"x", 0)
            write_errno = 0
        except OSError as err:
            write_errno = err.errno
        try:
            os.ftruncate(fd, 1)
            truncate_errno = 0
        except OSError as err:
            truncate_errno = err.errno
        import errno as errno_mod
        import fcntl

        report.update(
            kinds=kinds,
            callback_order=[i for i, _ in seen], callback_values_ok=all(ok for _, ok in seen),
            replacements_ok=all(_same(r, e) for r, e in zip(replacements, expected)),
            file_replacements_are_inputs=[replacements[i] is tensors[i] for i in (0, 1)],
            strides_kept=[tuple(r.stride()) == tuple(t.stride()) for r, t in
                          zip(replacements, tensors)],
            blob_link=os.readlink(f"/proc/self/fd/{fd}"),
            write_eperm=write_errno == errno_mod.EPERM,
            truncate_eperm=truncate_errno == errno_mod.EPERM,
            seals=fcntl.fcntl(fd, fcntl.F_GET_SEALS),
            dev_shm_unchanged=sorted(os.listdir("/dev/shm")) == dev_shm_before,
            file_paths=[f["path"] for f in descriptor["files"]],
        )
        save_file({str(i): e.contiguous() for i, e in enumerate(expected)}, args["expected_file"])
        store.set("descriptor", json.dumps(descriptor))
        del tensors, seen
        _wait_key(store, "written/1")
        report["leader_isolated"] = all(_same(r, e) for r, e in zip(replacements, expected))
        store.set("leader_checked", "1")
        _wait_key(store, "detached/1")
        _wait_key(store, "detached/2")
        shm.release(descriptor)
        shm.release(descriptor)                          # idempotent
        del replacements, clean, dirty, expected
    else:
        store.set(f"pid/{rank}", str(os.getpid()))
        descriptor = json.loads(_wait_key(store, "descriptor"))
        out = shm.attach(descriptor)
        saved = load_file(args["expected_file"])
        expected = [saved[str(i)] for i in range(len(saved))]
        report["attach_ok"] = all(_same(o, e) for o, e in zip(out, expected))
        report["strides"] = [list(o.stride()) == e["stride"]
                             for o, e in zip(out, descriptor["tensors"])]
        report["file_mapped"] = bool(_maps_of_self(args["clean_file"]))
        report["blob_mapped"] = bool(_maps_of_self(MEMFD_LINK))
        if rank == 1:
            out[0][0, 0] = 12345.0                       # a file-backed region
            out[3].fill_(7)                              # a blob region (bf16)
            report["own_write_visible"] = float(out[0][0, 0]) == 12345.0 and bool(
                (out[3] == 7).all())
            store.set("written/1", "1")
        else:
            _wait_key(store, "written/1")
            report["isolated"] = all(_same(o, e) for o, e in zip(out, expected))
            # The blob itself, read through the leader's fd, still holds the original bytes.
            entry = descriptor["tensors"][3]
            with open(f"/proc/{descriptor['pid']}/fd/{descriptor['fd']}", "rb") as f:
                f.seek(entry["offset"])
                raw = f.read(entry["meta"]["nbytes"])
            report["blob_unchanged"] = raw == _bytes(expected[3])
            store.set("follower_checked", "1")
        _wait_key(store, "leader_checked")
        _wait_key(store, "follower_checked")
        del out
    gc.collect()
    report["self_memfd_after_detach"] = _maps_of_self(MEMFD_LINK)
    store.set(f"detached/{rank}", "1")
    _wait_key(store, "checked")
    return report


@pytest.mark.timeout(150)
def test_shm_share_attach_bitwise_cow_sealed_and_freed(tmp_path, tcp_store):
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(7)
    clean_file = tmp_path / "clean.safetensors"
    dirty_file = tmp_path / "dirty.safetensors"
    save_file({"w32": torch.randn(300, 70, generator=g),
               "wbf": torch.randn(50, 40, generator=g).to(torch.bfloat16)}, str(clean_file))
    save_file({"mod": torch.randn(5000, generator=g)}, str(dirty_file))
    digests = {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in (clean_file, dirty_file)}
    holders: dict[int, list[str]] = {}

    def check_freed(procs: list[multiprocessing.Process]) -> None:
        for rank in range(3):
            _wait_key(tcp_store, f"detached/{rank}", dict(enumerate(procs)))
        holders.update(_memfd_holders([p.pid for p in procs] + [os.getpid()]))
        tcp_store.set("checked", "1")

    reports = _run_job("shm", 3, {"port": tcp_store.port, "clean_file": str(clean_file),
                                  "dirty_file": str(dirty_file),
                                  "expected_file": str(tmp_path / "expected.safetensors")},
                       tmp_path, during=check_freed)
    leader, first, second = reports
    n = 3 + len(_shm_extra_tensors())
    assert leader["kinds"][:3] == ["file", "file", "blob"]
    assert leader["kinds"][3:] == ["blob"] * 5 + ["empty", "blob", "blob"]
    assert leader["file_paths"] == [str(clean_file)]
    assert leader["callback_order"] == list(range(n)) and leader["callback_values_ok"]
    assert leader["replacements_ok"] and leader["file_replacements_are_inputs"] == [True, True]
    assert leader["strides_kept"] == [True] * (n - 1) + [False]   # only the gapped one changes
    assert leader["blob_link"].startswith(MEMFD_LINK)
    assert leader["write_eperm"] and leader["truncate_eperm"]
    assert leader["seals"] == 1 | 2 | 4 | 8
    assert leader["dev_shm_unchanged"]
    assert leader["leader_isolated"]
    for follower in (first, second):
        assert follower["attach_ok"] and follower["strides"] == [True] * n
        assert follower["file_mapped"] and follower["blob_mapped"]
    assert first["own_write_visible"]
    assert second["isolated"] and second["blob_unchanged"]
    for report in reports:
        assert report["self_memfd_after_detach"] == []
    assert holders == {}, f"memfds still held after detach: {holders}"
    assert {p: hashlib.sha256(p.read_bytes()).hexdigest() for p in digests} == digests


def _leader_dead(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


def _job_shm_leader_killed(rank: int, args: dict[str, Any]) -> dict[str, Any]:
    from safetensors.torch import load_file

    from patchload.transport import LeaderGoneError, TransportError, shm

    store = _client(args["port"])
    expected = _shm_extra_tensors()[:4]
    if rank == 0:
        clean = load_file(args["clean_file"])
        descriptor, _ = shm.share([*expected, clean["w32"]])
        store.set("descriptor", json.dumps(descriptor))
        _wait_key(store, "attached/1")
        os.kill(os.getpid(), signal.SIGKILL)
    descriptor = json.loads(_wait_key(store, "descriptor"))
    pid = descriptor["pid"]
    report: dict[str, Any] = {}
    if rank == 1:
        out = shm.attach(descriptor)
        store.set("attached/1", "1")
    deadline = time.monotonic() + 30
    while not _leader_dead(pid):
        if time.monotonic() > deadline:
            raise TimeoutError(f"leader {pid} still alive")
        time.sleep(0.05)
    if rank == 1:
        clean = load_file(args["clean_file"])
        report["works_after_kill"] = (all(_same(o, e) for o, e in zip(out, expected))
                                      and _same(out[4], clean["w32"]))
        out[0].fill_(1)                                  # COW still works with the leader gone
        report["write_after_kill"] = bool((out[0] == 1).all())
        del out, clean
        gc.collect()
        report["self_memfd_after_detach"] = _maps_of_self(MEMFD_LINK)
    else:
        try:
            shm.attach(descriptor)
            report["late_attach"] = "no error"
        except LeaderGoneError as err:
            report["late_attach"] = type(err).__name__
            report["message"] = str(err)
            report["is_file_not_found"] = isinstance(err, FileNotFoundError)
            report["is_transport_error"] = isinstance(err, TransportError)
            report["pickles"] = str(pickle.loads(pickle.dumps(err))) == str(err)
    store.set(f"detached/{rank}", "1")
    _wait_key(store, "checked")
    return report


@pytest.mark.timeout(150)
def test_shm_leader_killed(tmp_path, tcp_store):
    from safetensors.torch import save_file

    clean_file = tmp_path / "clean.safetensors"
    save_file({"w32": torch.randn(100, 100)}, str(clean_file))
    holders: dict[int, list[str]] = {}
    pids: dict[str, int] = {}

    def check_freed(procs: list[multiprocessing.Process]) -> None:
        for rank in (1, 2):
            _wait_key(tcp_store, f"detached/{rank}", {1: procs[1], 2: procs[2]})
        pids["leader"] = procs[0].pid
        holders.update(_memfd_holders([p.pid for p in procs] + [os.getpid()]))
        tcp_store.set("checked", "1")

    reports = _run_job("shm_leader_killed", 3, {"port": tcp_store.port,
                                                "clean_file": str(clean_file)},
                       tmp_path, during=check_freed, expected_exitcodes={0: -signal.SIGKILL})
    first, second = reports[1], reports[2]
    assert first["works_after_kill"] and first["write_after_kill"]
    assert first["self_memfd_after_detach"] == []
    assert second["late_attach"] == "LeaderGoneError"
    assert second["is_file_not_found"] and second["is_transport_error"] and second["pickles"]
    assert f"pid {pids['leader']}" in second["message"] and "exited" in second["message"]
    assert holders == {}, f"memfds still held after detach: {holders}"


def test_shm_share_frees_each_original_after_its_callback():
    import weakref

    import numpy as np

    from patchload.transport import shm

    arrays = [np.full(100_000, i, dtype=np.float32) for i in range(4)]
    alive = [weakref.ref(a) for a in arrays]            # dies with the tensor's storage
    tensors = [torch.from_numpy(a) for a in arrays]
    del arrays
    seen: list[list[bool]] = []

    def on_shared(index: int, replacement: torch.Tensor) -> None:
        tensors[index] = replacement                    # what the caller does with its params
        seen.append([ref() is not None for ref in alive])

    descriptor, _ = shm.share(tensors, on_shared=on_shared)
    try:
        # Once the caller dropped entry i in its callback, nothing else holds the original.
        assert seen == [[False, True, True, True], [False, False, True, True],
                        [False, False, False, True], [False] * 4]
        assert [float(t[0]) for t in tensors] == [0.0, 1.0, 2.0, 3.0]
    finally:
        shm.release(descriptor)


def test_shm_empty_tensors_keep_whether_their_storage_can_be_resized(tmp_path):
    """An empty checkpoint tensor (safetensors maps it: ``resize_`` raises) reaches followers
    as one that cannot be resized either; a new empty tensor as one that can."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from patchload.transport import shm

    save_file({"none": torch.empty(0, 5)}, str(tmp_path / "e.safetensors"))
    with safe_open(str(tmp_path / "e.safetensors"), framework="pt") as f:
        mapped = f.get_slice("none")[...]
    descriptor, _ = shm.share([mapped, torch.empty(0, 3)])
    try:
        got = shm.attach(json.loads(json.dumps(descriptor)))
        assert [t.shape for t in got] == [(0, 5), (0, 3)]
        assert [t.untyped_storage().resizable() for t in got] == [False, True]
    finally:
        shm.release(descriptor)


def test_shm_share_seals_the_arena_in_place_and_gives_back_what_no_tensor_kept():
    import fcntl

    from patchload.transport import shm
    from patchload.transport.arena import BlobArena

    arena = BlobArena(8_000_000)
    converted = arena.take((1000, 100), torch.float32)
    converted.copy_(torch.arange(100_000, dtype=torch.bfloat16).view(1000, 100))
    dropped = arena.take((1_000_000,), torch.float32)   # a converter's input, say
    dropped.fill_(7)
    del dropped
    tensors = [converted, torch.randn(3, 5), torch.empty(0)]
    del converted
    expected = [t.clone() for t in tensors]
    arena_fd = arena.fd

    descriptor, _ = shm.share(tensors, on_shared=lambda i, r: tensors.__setitem__(i, r),
                              arena=arena)
    try:
        assert descriptor["fd"] == arena_fd and arena.fd is None      # the arena is the blob
        assert [e["kind"] for e in descriptor["tensors"]] == ["blob", "blob", "empty"]
        assert descriptor["tensors"][0]["offset"] == 0                 # not copied
        assert fcntl.fcntl(arena_fd, 1034) & 8                         # F_SEAL_WRITE
        # The dropped 4 MB were given back: the memfd holds the kept tensors only.
        assert os.fstat(arena_fd).st_blocks * 512 < 500_000
        for mine, theirs, want in zip(tensors, shm.attach(descriptor), expected):
            assert torch.equal(mine, want) and torch.equal(theirs, want)
        assert not tensors[0].untyped_storage().nbytes() > descriptor["nbytes"]
    finally:
        shm.release(descriptor)


def test_shm_share_copies_into_a_new_blob_when_the_arena_is_still_writable_elsewhere():
    from patchload.transport import shm
    from patchload.transport.arena import BlobArena

    arena = BlobArena(4096)
    weight = arena.take((10,), torch.float32)
    weight.fill_(3)
    kept_view = weight[2:4]                                            # a writer we cannot see
    tensors = [weight]
    del weight
    descriptor, _ = shm.share(tensors, on_shared=lambda i, r: tensors.__setitem__(i, r),
                              arena=arena)
    try:
        assert arena.fd is None and descriptor["fd"] is not None
        assert torch.equal(kept_view, torch.full((2,), 3.0))          # its holder lost nothing
        kept_view.fill_(9)                                             # reaches neither copy
        assert torch.equal(tensors[0], torch.full((10,), 3.0))
        assert torch.equal(shm.attach(descriptor)[0], torch.full((10,), 3.0))
    finally:
        shm.release(descriptor)


def test_shm_share_grows_the_arena_when_the_load_wrote_more_than_the_skeleton_holds():
    from patchload.transport import shm
    from patchload.transport.arena import BlobArena

    arena = BlobArena(4096)                    # sized from the skeleton
    converted = arena.take((512,), torch.float32)
    converted.copy_(torch.arange(512.0))
    tensors = [converted, torch.arange(10_000.0)]  # e.g. a mismatched, larger checkpoint tensor
    del converted
    fd = arena.fd
    descriptor, _ = shm.share(tensors, on_shared=lambda i, r: tensors.__setitem__(i, r),
                              arena=arena)
    try:
        assert descriptor["fd"] == fd and descriptor["copied_bytes"] == 40_000
        assert [torch.equal(t, w) for t, w in zip(shm.attach(descriptor),
                                                  [torch.arange(512.0), torch.arange(10_000.0)])
                ] == [True, True]
    finally:
        shm.release(descriptor)


def test_leader_whose_share_fails_holds_no_writable_shared_mapping(monkeypatch):
    """A forked child (a DataLoader worker) must not write into the leader's weights, as with a
    plain load's private memory: a failed share leaves the model out of the arena."""
    from patchload.coordination.load_state import LoadState
    from patchload.transport import shm
    from patchload.transport.node_shm import ShmWeights

    class FakeCall:
        what = "from_pretrained('x')"

        def prefix(self) -> str:
            return "[rank 0/2]"

    model = torch.nn.Linear(100, 100)
    transport = ShmWeights()
    state = LoadState()
    transport.prepare(FakeCall(), model, state)  # type: ignore[arg-type]
    for name in ("weight", "bias"):
        setattr(model, name, torch.nn.Parameter(state.arena.take(
            getattr(model, name).shape, torch.float32).copy_(getattr(model, name).detach())))
    expected = [t.detach().clone() for t in model.parameters()]
    arena = state.arena
    assert all(arena.owns(t) for t in model.parameters())

    def no_space(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shm, "_share_in_arena", no_space)
    from patchload.transport.tensors import entries_of

    entries, unique = entries_of(model)
    try:
        transport.share(FakeCall(), model, entries, unique, state)  # type: ignore[arg-type]
    except OSError:
        transport.discard(model, state)  # what weights/share.py's share_weights does
    else:
        raise AssertionError("share did not fail")
    assert not any(arena.owns(t) for t in model.parameters())
    del unique, arena
    gc.collect()
    with open("/proc/self/maps", encoding="utf-8") as maps:
        shared_writable = [line for line in maps if "memfd:patchload" in line
                           and line.split()[1][3] == "s"]
    assert shared_writable == []
    assert [torch.equal(t, w) for t, w in zip(model.parameters(), expected)] == [True, True]


def test_shm_rejects_non_cpu_and_bad_descriptors(tmp_path):
    from patchload.transport import ShmAttachError, shm

    with pytest.raises(ValueError, match="strided CPU"):
        shm.share([torch.empty(2, device="meta")])
    with pytest.raises(TypeError):
        shm.share([object()])  # type: ignore[list-item]
    descriptor, replacements = shm.share([torch.empty(0), torch.empty(3, 0)])
    assert descriptor["fd"] is None and [r.shape for r in shm.attach(descriptor)] == [
        torch.Size([0]), torch.Size([3, 0])]
    descriptor, _ = shm.share([torch.arange(4)])
    try:
        with pytest.raises(ShmAttachError, match="another host"):
            shm.attach({**descriptor, "node": "elsewhere"})
        with pytest.raises(ValueError, match="version"):
            shm.attach({**descriptor, "version": 99})
    finally:
        shm.release(descriptor)


def test_transport_meta_roundtrip():
    from patchload.transport import TensorMeta, dtype_from_str, meta_of

    meta = meta_of(torch.empty(2, 3, dtype=torch.bfloat16))
    assert meta == TensorMeta((2, 3), "bfloat16", 12)
    assert TensorMeta.from_json(json.loads(json.dumps(meta.to_json()))) == meta
    assert dtype_from_str("torch.bool") is torch.bool
    with pytest.raises(ValueError, match="unknown torch dtype"):
        dtype_from_str("Tensor")
    assert math.prod(meta.shape) == 6


_JOBS: dict[str, Callable[[int, dict[str, Any]], dict[str, Any]]] = {
    "collective": _job_collective,
    "collective_errors": _job_collective_errors,
    "shm": _job_shm,
    "shm_leader_killed": _job_shm_leader_killed,
}


# --- zero-copy loads alongside the leader (patchload.transport.mapped_files) --------------------


def _checkpoint(path: Path) -> dict[str, torch.Tensor]:
    """A safetensors file whose header lists its keys out of order, with several dtypes, a 0-d
    and an empty tensor."""
    from safetensors.torch import save_file

    tensors = {"zeta.weight": torch.arange(12, dtype=torch.float32).reshape(3, 4),
               "alpha.bias": torch.tensor([1.5, -2.0], dtype=torch.bfloat16),
               "mid.count": torch.tensor(7, dtype=torch.int64),
               "mid.mask": torch.tensor([True, False, True]),
               "none.weight": torch.empty(0, 5, dtype=torch.float32)}
    save_file(tensors, str(path))
    return tensors


def test_followers_map_the_described_checkpoint_as_safetensors_reads_it(tmp_path):
    """What a follower hands transformers in place of safetensors' handles: the same keys in the
    same order, and per key a tensor equal to ``get_slice(key)[...]`` in bytes, dtype, shape,
    storage size and offset, and inference mode, made in the thread that asks for it."""
    from safetensors import safe_open

    from patchload.transport.mapped_files import describe, mapped_state_dict

    path = tmp_path / "model.safetensors"
    _checkpoint(path)
    layout = describe([str(path)])
    assert layout is not None
    json.dumps(layout)  # announced through the store
    state = mapped_state_dict(json.loads(json.dumps(layout)), [str(path)])
    with safe_open(str(path), framework="pt") as f:
        assert list(state) == list(f.keys())
        for key in f.keys():
            plain, mine = f.get_slice(key), state[key]
            assert mine.get_shape() == plain.get_shape() and mine.get_dtype() == plain.get_dtype()
            want, got = plain[...], mine[...]
            assert (got.dtype, got.shape, got.stride(), got.storage_offset()) == \
                (want.dtype, want.shape, want.stride(), want.storage_offset()), key
            assert got.untyped_storage().nbytes() == want.untyped_storage().nbytes(), key
            assert got.untyped_storage().resizable() == want.untyped_storage().resizable(), key
            assert got.view(-1).view(torch.uint8).tolist() == \
                want.view(-1).view(torch.uint8).tolist(), key
            with torch.inference_mode():
                assert mine[...].is_inference() == plain[...].is_inference() is True
            assert torch.equal(mine[1:], plain[1:]) if got.dim() else True
    state["zeta.weight"][...].add_(1)  # copy-on-write: the file keeps its bytes
    with safe_open(str(path), framework="pt") as f:
        assert torch.equal(f.get_tensor("zeta.weight"), torch.arange(12.).reshape(3, 4))


def test_followers_map_only_the_very_files_the_leader_described(tmp_path):
    from patchload.transport.mapped_files import describe, mapped_state_dict

    path, other = tmp_path / "model.safetensors", tmp_path / "other.safetensors"
    _checkpoint(path)
    _checkpoint(other)
    layout = describe([str(path)])
    assert mapped_state_dict(layout, [str(other)]) is None  # not described
    os.utime(path, ns=(1, 1))  # changed since the leader described it
    assert mapped_state_dict(layout, [str(path)]) is None
    # Files the leader cannot describe exactly are not described at all: they load as before.
    raw = path.read_bytes()
    (tmp_path / "cut.safetensors").write_bytes(raw[:-8])
    assert describe([str(tmp_path / "cut.safetensors")]) is None
    assert describe([str(path), str(tmp_path / "model.bin")]) is None
    assert describe([str(tmp_path / "absent.safetensors")]) is None


def test_a_load_runs_alongside_only_where_every_tensor_stays_a_view_of_its_file(tmp_path):
    """The decision both leader and follower make from a transformers 5 load's arguments."""
    transformers = pytest.importorskip("transformers")
    if transformers.__version__.startswith("4."):
        pytest.skip("transformers 4.x: followers take the leader's tensors (no state-dict step)")
    from transformers.core_model_loading import Concatenate, WeightConverter, WeightRenaming

    from patchload.transport.mapped_files import describe, maps_as_plain

    path = tmp_path / "model.safetensors"
    from safetensors.torch import save_file

    save_file({"a.weight": torch.ones(2, 2), "b.bias": torch.zeros(2),
               "c.count": torch.tensor(3)}, str(path))
    layout, files = describe([str(path)]), [str(path)]

    class LoadConfig:  # the fields of transformers' LoadStateDictConfig the decision reads
        def __init__(self, **fields: Any) -> None:
            self.dtype, self.dtype_plan, self.device_map = torch.float32, {}, None
            self.hf_quantizer, self.disable_mmap = None, False
            self.weight_mapping = [WeightRenaming("gamma", "weight")]
            self.__dict__.update(fields)

    assert maps_as_plain(None, files, LoadConfig(), layout)
    assert maps_as_plain(None, files, LoadConfig(device_map={"": "cpu"}), layout)
    for reason in ({"dtype": torch.bfloat16}, {"dtype_plan": {"wo": torch.float16}},
                   {"device_map": {"": "meta"}}, {"hf_quantizer": object()},
                   {"disable_mmap": True},
                   {"weight_mapping": [WeightConverter(["a.*"], "b", operations=[Concatenate(dim=0)])]}):
        assert not maps_as_plain(None, files, LoadConfig(**reason), layout), reason
    assert not maps_as_plain({"a.weight": torch.ones(2, 2)}, files, LoadConfig(), layout)
    assert not maps_as_plain(None, files, LoadConfig(), None)
    delattr(config := LoadConfig(), "weight_mapping")  # transformers 4's
    assert not maps_as_plain(None, files, config, layout)
