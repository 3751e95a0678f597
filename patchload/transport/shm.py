"""Share CPU tensors inside one node: one physical copy, mapped copy-on-write by every rank.

The node leader calls :func:`share`. A tensor that is already a clean view of a file mapping (the
zero-copy safetensors load) is described by its file path and byte offset and not copied. Every
other tensor is written into ONE memfd blob (``memfd_create``, 64-byte aligned regions), which is
then sealed against writes, shrinking and growing. The leader keeps the blob's fd open in a
module-level registry and publishes a JSON-able descriptor; it does not wait for followers.

Followers on the same node call :func:`attach`: it opens ``/proc/<leader pid>/fd/<fd>`` (or the
file), checks it is the very inode the leader described, and maps it ``MAP_PRIVATE``. Pages stay
shared until someone writes; a write gives the writer a private page and changes nothing for the
others. No named file is created in ``/dev/shm``; the blob vanishes with its last fd or mapping.

Every tensor made from a mapping (a follower's, and the leader's replacements) has a storage of
its own, exactly its bytes at storage offset 0, as a plain load's tensors have: what a user sees
of a storage (``torch.save`` of one tensor, ``untyped_storage().nbytes()``, transformers' shared
tensor checks) is what a plain load gives. Those storages keep the one mapping alive; it is
unmapped when the last of them goes.

Linux only (``memfd_create``, ``/proc``). Neither function is collective and neither uses
``torch.distributed``.
"""

from __future__ import annotations

import bisect
import ctypes
import fcntl
import mmap
import os
import stat
import threading
from dataclasses import dataclass
from typing import Any, Callable, Final, Mapping, Sequence

import numpy
import torch

from patchload import _runtime
from patchload._logging import get_logger
from patchload.coordination.identity import node_id
from patchload.transport.arena import BlobArena, aligned
from patchload.transport import (
    LeaderGoneError,
    ShmAttachError,
    TensorMeta,
    dtype_from_str,
    meta_of,
)

__all__ = ["share", "attach", "release", "map_file", "tensor_view", "empty_tensor",
           "contiguous_stride"]

logger = get_logger(__name__)

DESCRIPTOR_VERSION: Final = 2
MEMFD_NAME: Final = "patchload"

_F_ADD_SEALS: Final = getattr(fcntl, "F_ADD_SEALS", 1033)
_F_GET_SEALS: Final = getattr(fcntl, "F_GET_SEALS", 1034)
_F_SEAL_SEAL: Final = getattr(fcntl, "F_SEAL_SEAL", 1)
_F_SEAL_SHRINK: Final = getattr(fcntl, "F_SEAL_SHRINK", 2)
_F_SEAL_GROW: Final = getattr(fcntl, "F_SEAL_GROW", 4)
_F_SEAL_WRITE: Final = getattr(fcntl, "F_SEAL_WRITE", 8)
_SEALS: Final = _F_SEAL_WRITE | _F_SEAL_SHRINK | _F_SEAL_GROW | _F_SEAL_SEAL

_MAX_IO_BYTES: Final = 1 << 30  # one pwrite/pread call; Linux caps a call near 2 GiB

class _OpenBlobs:
    """The blobs this install published and keeps open for followers: fd -> size in bytes
    (released by their shares, :class:`patchload.transport.shares.OpenShares`)."""

    def __init__(self) -> None:
        self.sizes: dict[int, int] = {}
        self.lock = threading.Lock()


def _open_blobs() -> _OpenBlobs:
    return _runtime.current().part(_OpenBlobs)


@dataclass(frozen=True, slots=True)
class _Mapping:
    start: int
    end: int
    private: bool
    writable: bool
    file_offset: int
    path: str


# A pagemap entry's top byte -> 1 if the page was written by this process: present (0x80) and
# not file-backed (0x20), or swapped (0x40).
_WRITTEN: Final = bytes(int((v & 0xA0) == 0x80 or bool(v & 0x40)) for v in range(256))


def share(
    tensors: Sequence[torch.Tensor],
    *,
    on_shared: Callable[[int, torch.Tensor], None] | None = None,
    arena: BlobArena | None = None,
) -> tuple[dict[str, Any], list[torch.Tensor]]:
    """Publish CPU tensors to the processes of this node (node leader role).

    For each tensor, in order:

    - empty (``numel() == 0``): described by its meta only; the replacement is the tensor itself.
    - a dense view of ``arena`` (a converting load wrote it there): described as ``{"kind":
      "blob", "offset": <its offset in the arena>}``; nothing is copied.
    - a clean view of a private or read-only *file* mapping (safetensors' zero-copy load), with no
      page of it modified in this process (checked in ``/proc/self/pagemap``): described as
      ``{"kind": "file", "file": <index into descriptor["files"]>, "offset": <byte offset in the
      file>}``; the replacement is the tensor itself, nothing is copied.
    - anything else: copied into one memfd blob (the arena's free space when it fits, else a new
      memfd, into which the arena's tensors are then copied too) at a 64-byte aligned offset.

    The replacement of a blob tensor is a view, with the same shape, dtype and (for dense
    tensors) stride, of a ``MAP_PRIVATE`` mapping of the blob, so the leader shares the blob's
    pages too. A non-dense tensor (one with gaps or overlaps) is stored contiguous and its
    replacement is contiguous.

    Peak memory: the blob is written one tensor at a time and ``on_shared`` is called right after
    each write. ``tensors[i]`` is read only when entry ``i`` is written, and no reference to it is
    kept once ``on_shared(i, ...)`` returns. So a caller that passes a list it owns and, in
    ``on_shared``, re-points its parameter to the replacement and overwrites ``tensors[i]`` needs
    the model's bytes plus about one tensor (plus a temporary contiguous copy of a non-dense
    tensor), not twice the model. With an arena, converted tensors are not copied at all; arena
    bytes that no tensor uses are given back before sealing.

    The blob's fd stays open in this process until :func:`release`, so that followers can open
    ``/proc/<pid>/fd/<fd>``; the blob itself lives until its last fd or mapping is gone.

    Args:
        tensors: strided CPU tensors, any dtype; ``requires_grad`` is ignored (bytes are read
            through ``detach()``). Tied tensors must already be deduplicated: each entry is
            shared separately.
        on_shared: called as ``on_shared(index, replacement)`` for every tensor, in order, as
            soon as its replacement holds the data. Exceptions propagate and abort the share
            (the blob is closed).
        arena: where the caller's load wrote converted tensors (:class:`BlobArena`); its fd
            becomes the blob's (or is closed, when a new memfd had to be made instead).

    Returns:
        ``(descriptor, replacements)``. ``descriptor`` is JSON-able:
        ``{"version", "pid", "node", "fd", "nbytes", "dev", "ino", "files": [...],
        "tensors": [...], "copied_bytes"}``; ``fd`` is None when no tensor is in a blob;
        ``copied_bytes`` counts what was copied into it (not what an arena already held).
        ``replacements`` holds one tensor per input.

    Raises:
        TypeError: an entry is not a tensor.
        ValueError: an entry is not a strided CPU tensor.
        OSError: ``memfd_create``, ``ftruncate``, ``pwrite`` or sealing failed (e.g. ``ENOMEM``,
            ``ENOSPC`` under a memory cgroup limit).
    """
    _check(tensors)
    if arena is not None and arena.fd is None:
        arena = None  # nothing was converted into it
    entries, files, staged = _describe(tensors, arena)
    descriptor: dict[str, Any] = {
        "version": DESCRIPTOR_VERSION, "pid": os.getpid(), "node": node_id(),
        "fd": None, "nbytes": 0, "dev": None, "ino": None, "files": files, "tensors": entries,
        "copied_bytes": 0,
    }
    if arena is not None and any(e["kind"] == "blob" for e in entries):
        blob_bytes = _place(entries, staged, start=arena.used)
        replacements, sealed = _share_in_arena(tensors, entries, staged, descriptor,
                                               blob_bytes, arena, on_shared)
        if sealed:
            return descriptor, replacements
        # Something still holds the writable mapping, so the arena cannot be sealed: copy from
        # the leader's private views of it into a new blob.
        tensors = replacements
        del replacements
        entries, files, _ = _describe(tensors, None)
        descriptor.update(tensors=entries, files=files, copied_bytes=0)
    if arena is not None:
        arena.close()
    blob_bytes = _place(entries, set(), start=0)

    if blob_bytes == 0:
        replacements: list[torch.Tensor] = []
        for index, t in enumerate(tensors):
            replacements.append(t)
            if on_shared is not None:
                on_shared(index, t)
        _log_summary(descriptor)
        return descriptor, replacements

    fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.ftruncate(fd, blob_bytes)
        replacements = _fill(fd, blob_bytes, tensors, entries, set(), descriptor, on_shared)
        fcntl.fcntl(fd, _F_ADD_SEALS, _SEALS)
        st = os.fstat(fd)
    except BaseException:
        os.close(fd)
        raise
    _register(fd, blob_bytes)
    descriptor.update(fd=fd, nbytes=blob_bytes, dev=st.st_dev, ino=st.st_ino)
    _log_summary(descriptor)
    return descriptor, replacements


def _check(tensors: Sequence[torch.Tensor]) -> None:
    # A function of its own: a loop variable left in share() would keep the last original alive.
    for index, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"share: entry {index} is a {type(t).__name__}, not a torch.Tensor")
        if t.device.type != "cpu" or t.layout != torch.strided:
            raise ValueError(f"share: entry {index} is a {t.layout} tensor on {t.device}; only "
                             "strided CPU tensors can be shared through shared memory")


def _describe(tensors: Sequence[torch.Tensor], arena: BlobArena | None
              ) -> tuple[list[dict[str, Any]], list[dict[str, Any]], set[int]]:
    """Each tensor's entry (kind, stride; arena offsets for those in ``arena``), the files, and
    the indices of the tensors already in the arena."""
    mappings = _read_maps()
    starts = [m.start for m in mappings]
    files: list[dict[str, Any]] = []
    file_index: dict[str, int] = {}
    pagemap_ok = True
    entries: list[dict[str, Any]] = []
    staged: set[int] = set()
    written: dict[int, bytes] = {}  # mapping start -> which of its pages were written
    for index, t in enumerate(tensors):
        t = t.detach()
        entry: dict[str, Any] = {"meta": meta_of(t).to_json()}
        entries.append(entry)
        if t.numel() == 0:
            # A checkpoint's empty tensor cannot be resized (safetensors maps it), a new one can.
            entry.update(kind="empty", stride=list(t.stride()),
                         resizable=t.untyped_storage().resizable())
            continue
        dense = _is_dense(t)
        if dense and arena is not None and arena.owns(t):
            entry.update(kind="blob", offset=arena.offset_of(t), stride=list(t.stride()))
            staged.add(index)
            continue
        if dense and pagemap_ok:
            found = _file_region(t, mappings, starts)
            if found is not None:
                mapping, offset = found
                clean = _pages_unmodified(written, mapping, t.data_ptr(),
                                          t.numel() * t.element_size())
                if clean is None:
                    pagemap_ok = False
                    logger.warning("cannot read /proc/self/pagemap: file-backed tensors are "
                                   "copied into the shared blob instead of shared in place")
                elif clean:
                    file_no = file_index.get(mapping.path)
                    if file_no is None:
                        info = _file_identity(mapping.path)
                        if info is not None:
                            file_no = file_index[mapping.path] = len(files)
                            files.append(info)
                    end = offset + t.numel() * t.element_size()
                    if file_no is not None and end <= files[file_no]["size"]:
                        entry.update(kind="file", file=file_no, offset=offset,
                                     stride=list(t.stride()))
                        continue
        entry.update(kind="blob", offset=None,
                     stride=list(t.stride()) if dense else contiguous_stride(t.shape))
    return entries, files, staged


def _place(entries: list[dict[str, Any]], staged: set[int], *, start: int) -> int:
    """Give every blob entry not in ``staged`` an offset from ``start`` on; returns the blob's
    end (0 when there is no blob entry)."""
    end = cursor = start
    for index, entry in enumerate(entries):
        if entry["kind"] != "blob":
            continue
        nbytes = TensorMeta.from_json(entry["meta"]).nbytes
        if index not in staged:
            entry["offset"] = cursor = aligned(cursor)
            cursor += nbytes
        end = max(end, cursor, entry["offset"] + nbytes)
    return end if any(e["kind"] == "blob" for e in entries) else 0


def _share_in_arena(tensors: Sequence[torch.Tensor], entries: list[dict[str, Any]],
                    staged: set[int], descriptor: dict[str, Any], blob_bytes: int,
                    arena: BlobArena, on_shared: Callable[[int, torch.Tensor], None] | None
                    ) -> tuple[list[torch.Tensor], bool]:
    """:func:`share` with the arena as the blob: the replacements, and whether the arena was
    sealed (False when its writable mapping is still held elsewhere: the replacements are then
    private views of an unsealed memfd, for the caller to copy into a new blob, and whatever
    holds the writable mapping still sees every byte it saw).

    Each tensor not yet in the arena is written after its end (which grows the memfd when the
    load wrote more than the skeleton's bytes) and re-pointed at once, as in :func:`share`: the
    leader never holds a private original beside its copy longer than one tensor."""
    fd = arena.fd
    assert fd is not None
    if blob_bytes > arena.capacity:
        os.ftruncate(fd, blob_bytes)
    replacements = _fill(fd, blob_bytes, tensors, entries, staged, descriptor, on_shared)
    if not arena.drop_writable():
        logger.debug("the arena's writable mapping is still held: copying into a new blob")
        return replacements, False
    # Nothing but the private mapping sees the memfd now: give back what no tensor uses.
    kept = [(e["offset"], e["offset"] + TensorMeta.from_json(e["meta"]).nbytes)
            for e in entries if e["kind"] == "blob"]
    punched = arena.punch(kept)
    os.ftruncate(fd, blob_bytes)
    fcntl.fcntl(fd, _F_ADD_SEALS, _SEALS)
    st = os.fstat(fd)
    _register(arena.hand_over(), blob_bytes)
    descriptor.update(fd=fd, nbytes=blob_bytes, dev=st.st_dev, ino=st.st_ino)
    logger.debug("converted tensors were written in place: %d of %d blob tensors copied, "
                 "%d unused bytes given back", len(kept) - len(staged), len(kept), punched)
    _log_summary(descriptor)
    return replacements, True


def _fill(fd: int, blob_bytes: int, tensors: Sequence[torch.Tensor],
          entries: list[dict[str, Any]], staged: set[int], descriptor: dict[str, Any],
          on_shared: Callable[[int, torch.Tensor], None] | None) -> list[torch.Tensor]:
    """Write each blob tensor not in ``staged`` at its offset and hand over its replacement (a
    view of a private mapping of the blob) at once, in order; returns the replacements."""
    # Mapped before writing: a private mapping sees the file's writes until a page is COW'd,
    # and nothing touches these pages before they are written.
    region = _private_mapping(f"/proc/self/fd/{fd}", blob_bytes)
    replacements: list[torch.Tensor] = []
    for index, entry in enumerate(entries):
        if entry["kind"] == "blob" and index not in staged:
            descriptor["copied_bytes"] += _write(fd, tensors[index], entry)
        replacement = _replacement(region, tensors[index], entry)
        replacements.append(replacement)
        if on_shared is not None:
            on_shared(index, replacement)
        del replacement
    return replacements


def _write(fd: int, tensor: torch.Tensor, entry: dict[str, Any]) -> int:
    """Write one tensor's bytes at its entry's offset; returns the byte count."""
    src = tensor.detach()
    if not _is_dense(src):
        src = src.contiguous()
    nbytes = src.numel() * src.element_size()
    _pwrite_all(fd, src.data_ptr(), nbytes, entry["offset"])
    return nbytes


def _replacement(region: numpy.ndarray, tensor: torch.Tensor,
                 entry: dict[str, Any]) -> torch.Tensor:
    if entry["kind"] != "blob":
        return tensor
    return tensor_view(region, entry["offset"], tensor.dtype, tensor.shape, entry["stride"],
                 inference=tensor.is_inference())


def _register(fd: int, blob_bytes: int) -> None:
    blobs = _open_blobs()
    with blobs.lock:
        blobs.sizes[fd] = blob_bytes


def attach(descriptor: Mapping[str, Any]) -> list[torch.Tensor]:
    """Map the tensors a node leader shared (follower role), copy-on-write.

    Each memfd or file region is mapped once, ``MAP_PRIVATE``, and read lazily: no byte is
    copied, the pages are the leader's page-cache pages until this process writes to one. A write
    is invisible to the leader, to other followers and to the blob or file.

    Args:
        descriptor: what :func:`share` returned on the leader, after a JSON round trip.

    Returns:
        One CPU tensor per shared tensor, in order, with the leader's shape, dtype and stride,
        each with a storage of its own (like a zero-copy safetensors load's); those of one blob
        or one file view one mapping of it. None is an inference tensor, even inside
        ``torch.inference_mode()``.

    Raises:
        LeaderGoneError: the leader process has exited, or closed the blob (:func:`release`),
            or its pid now names another process. The message names the leader pid.
        ShmAttachError: the descriptor comes from another host or boot, the blob is not sealed,
            a shared file changed since the leader described it, or ``/proc/<pid>/fd`` cannot be
            opened (another user, ptrace restrictions). The message names the leader pid.
        ValueError: the descriptor is malformed or of another version.
    """
    try:
        version = descriptor["version"]
        pid = int(descriptor["pid"])
        entries = list(descriptor["tensors"])
        files = list(descriptor["files"])
    except (KeyError, TypeError, ValueError) as err:
        raise ValueError(f"not a patchload shm descriptor: {err!r}") from err
    if version != DESCRIPTOR_VERSION:
        raise ValueError(f"shm descriptor version {version!r}, expected {DESCRIPTOR_VERSION}")
    if descriptor.get("node") != node_id():
        raise ShmAttachError(f"cannot attach to tensors shared by pid {pid}: they were shared on "
                             "another host, in another PID namespace or before a reboot; shm "
                             "works inside one node only", cause="node differs")

    blob: numpy.ndarray | None = None
    if descriptor.get("fd") is not None:
        blob = _map_blob(pid, int(descriptor["fd"]), int(descriptor["nbytes"]),
                         descriptor.get("dev"), descriptor.get("ino"))
    file_regions: dict[int, numpy.ndarray] = {}
    out: list[torch.Tensor] = []
    for index, entry in enumerate(entries):
        meta = TensorMeta.from_json(entry["meta"])
        dtype = dtype_from_str(meta.dtype)
        kind = entry.get("kind")
        if kind == "empty":
            out.append(empty_tensor(meta.shape, entry["stride"], dtype,
                                    resizable=entry.get("resizable", True)))
            continue
        if kind == "blob":
            if blob is None:
                raise ValueError(f"shm descriptor entry {index} is a blob region but no blob fd")
            region = blob
        elif kind == "file":
            file_no = int(entry["file"])
            region = file_regions.get(file_no)
            if region is None:
                region = file_regions[file_no] = map_file(pid, files[file_no])
        else:
            raise ValueError(f"shm descriptor entry {index} has unknown kind {kind!r}")
        offset = int(entry["offset"])
        extent = _extent_bytes(meta.shape, entry["stride"], dtype.itemsize)
        if offset % dtype.itemsize or offset < 0 or offset + extent > len(region):
            raise ValueError(f"shm descriptor entry {index}: region [{offset}, "
                             f"{offset + extent}) does not fit its {len(region)} bytes")
        out.append(tensor_view(region, offset, dtype, meta.shape, entry["stride"]))
    logger.debug("attached %d tensors shared by pid %d (blob %d bytes, %d files)", len(out), pid,
                 int(descriptor.get("nbytes") or 0), len(files))
    return out


def release(descriptor: Mapping[str, Any]) -> None:
    """Close the blob fd this process keeps open for followers (leader role).

    Followers that already attached keep working, and so do the leader's replacement tensors
    (mappings outlive the fd); followers that attach later get :class:`LeaderGoneError`.
    Idempotent; does nothing for a descriptor published by another process or without a blob.
    """
    fd = descriptor.get("fd")
    if fd is None or descriptor.get("pid") != os.getpid():
        return
    blobs = _open_blobs()
    with blobs.lock:
        if blobs.sizes.pop(int(fd), None) is None:
            return
    os.close(int(fd))
    logger.debug("released shared blob fd %d", fd)


# --- leader helpers -----------------------------------------------------------------------------


def contiguous_stride(shape: Sequence[int]) -> list[int]:
    """The strides (in elements) of a contiguous tensor of ``shape``."""
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return stride[::-1]


def _is_dense(t: torch.Tensor) -> bool:
    """True when ``t``'s elements fill ``[data_ptr, data_ptr + nbytes)`` exactly once."""
    if t.is_contiguous():
        return True
    expected = 1
    for size, stride in sorted(((s, st) for s, st in zip(t.shape, t.stride()) if s != 1),
                               key=lambda pair: pair[1]):
        if stride != expected:
            return False
        expected *= size
    return True


def _read_maps() -> list[_Mapping]:
    """This process's file mappings, sorted, with adjacent pieces of one file merged."""
    out: list[_Mapping] = []
    with open("/proc/self/maps", encoding="utf-8", errors="surrogateescape") as f:
        for line in f:
            at = line.find(" /")
            if at < 0:  # anonymous memory
                continue
            at += 1
            path = line[at:].rstrip("\n")
            base = path[path.rfind("/") + 1:]
            # Shared libraries (hundreds of lines, never a checkpoint) are skipped before parsing.
            if base.endswith(".so") or ".so." in base or path.endswith(" (deleted)") \
                    or path.startswith("/memfd:"):
                continue
            parts = line[:at].split()
            if len(parts) < 5:
                continue
            start, end = (int(x, 16) for x in parts[0].split("-"))
            perms = parts[1]
            m = _Mapping(start, end, perms[3] == "p", perms[1] == "w", int(parts[2], 16), path)
            prev = out[-1] if out else None
            if (prev is not None and prev.end == m.start and prev.path == m.path
                    and prev.private == m.private and prev.writable == m.writable
                    and prev.file_offset + (prev.end - prev.start) == m.file_offset):
                out[-1] = _Mapping(prev.start, m.end, m.private, m.writable, prev.file_offset,
                                   m.path)
            else:
                out.append(m)
    return out


def _file_region(t: torch.Tensor, mappings: list[_Mapping],
                 starts: list[int]) -> tuple[_Mapping, int] | None:
    """The file mapping holding all of dense ``t`` and its byte offset in the file, if any."""
    address = t.data_ptr()
    nbytes = t.numel() * t.element_size()
    i = bisect.bisect_right(starts, address) - 1
    if i < 0:
        return None
    m = mappings[i]
    if address + nbytes > m.end:
        return None
    # A writable shared mapping lets the leader change the file under the followers later.
    if m.writable and not m.private:
        return None
    offset = m.file_offset + (address - m.start)
    if offset % t.element_size():
        return None
    return m, offset


def _pages_unmodified(written: dict[int, bytes], mapping: _Mapping, address: int,
                      nbytes: int) -> bool | None:
    """Whether no page of ``[address, address + nbytes)`` (inside ``mapping``) is private
    (COW'd or swapped) memory.

    Reads ``/proc/self/pagemap`` once per mapping, cached in ``written``: bit 63 present, bit 62
    swapped, bit 61 file-backed. A page that is present and not file-backed, or swapped, was
    written by this process. Returns None when pagemap cannot be read.
    """
    page = mmap.PAGESIZE
    if mapping.start not in written:
        size = (mapping.end - mapping.start) // page * 8
        raw = bytearray()
        try:
            with open("/proc/self/pagemap", "rb", buffering=0) as f:
                while len(raw) < size:
                    chunk = os.pread(f.fileno(), size - len(raw),
                                     mapping.start // page * 8 + len(raw))
                    if not chunk:
                        return None
                    raw += chunk
        except OSError:
            return None
        # Each entry's top byte (little-endian) holds the three bits: one flag byte per page.
        written[mapping.start] = bytes(raw[7::8]).translate(_WRITTEN)
    first = (address - mapping.start) // page
    last = (address + nbytes - 1 - mapping.start) // page
    return written[mapping.start].find(b"\x01", first, last + 1) < 0


def _file_identity(path: str) -> dict[str, Any] | None:
    """``{"path", "dev", "ino", "size", "mtime_ns"}`` of a regular file, or None."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    return {"path": path, "dev": st.st_dev, "ino": st.st_ino, "size": st.st_size,
            "mtime_ns": st.st_mtime_ns}


def _pwrite_all(fd: int, address: int, nbytes: int, offset: int) -> None:
    view = memoryview((ctypes.c_char * nbytes).from_address(address)).cast("B")
    done = 0
    while done < nbytes:
        done += os.pwrite(fd, view[done:done + _MAX_IO_BYTES], offset + done)


def _log_summary(descriptor: Mapping[str, Any]) -> None:
    kinds = [e["kind"] for e in descriptor["tensors"]]
    logger.debug("shared %d tensors: %d in place in %d files, %d in a %d-byte blob (fd %s)",
                 len(kinds), kinds.count("file"), len(descriptor["files"]), kinds.count("blob"),
                 descriptor["nbytes"], descriptor["fd"])


# --- shared helpers -----------------------------------------------------------------------------


def _private_mapping(path: str, nbytes: int) -> numpy.ndarray:
    """``path``'s first ``nbytes`` mapped ``MAP_PRIVATE`` (copy-on-write), as a writable uint8
    array; the array keeps the mapping alive."""
    storage = torch.UntypedStorage.from_file(path, shared=False, nbytes=nbytes)
    return torch.empty(0, dtype=torch.uint8).set_(storage).numpy()


def _extent_bytes(shape: Sequence[int], stride: Sequence[int], itemsize: int) -> int:
    """Bytes from a non-empty strided tensor's first element to the end of its last one."""
    return (1 + sum((size - 1) * step for size, step in zip(shape, stride))) * itemsize


def tensor_view(region: numpy.ndarray, offset_bytes: int, dtype: torch.dtype,
                shape: Sequence[int], stride: Sequence[int], *, inference: bool = False
                ) -> torch.Tensor:
    """A non-empty tensor at ``offset_bytes`` of ``region`` with a storage of its own (a plain
    load's layout: exactly its bytes, storage offset 0) that keeps the region alive; an
    inference tensor only when ``inference`` says so, whatever the caller's
    ``torch.inference_mode``."""
    extent = _extent_bytes(shape, stride, dtype.itemsize)
    with torch.inference_mode(inference):
        storage = torch.frombuffer(region[offset_bytes:offset_bytes + extent],
                                   dtype=torch.uint8).untyped_storage()
        return torch.empty(0, dtype=dtype).set_(storage, 0, tuple(shape), tuple(stride))


def empty_tensor(shape: Sequence[int], stride: Sequence[int], dtype: torch.dtype, *,
                 resizable: bool, inference: bool = False) -> torch.Tensor:
    """A tensor with no elements, its storage of 0 bytes resizable or not (safetensors' empty
    tensors are views of its mapping: ``resize_`` raises on them, as on a mapped one here); an
    inference tensor only when ``inference`` says so."""
    with torch.inference_mode(inference):
        if resizable:
            return torch.empty_strided(tuple(shape), tuple(stride), dtype=dtype)
        storage = torch.from_numpy(numpy.empty(0, dtype=numpy.uint8)).untyped_storage()
        return torch.empty(0, dtype=dtype).set_(storage, 0, tuple(shape), tuple(stride))


# --- follower helpers ---------------------------------------------------------------------------


def _leader_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state not in ("Z", "X")


def _map_blob(pid: int, fd: int, nbytes: int, dev: Any, ino: Any) -> numpy.ndarray:
    path = f"/proc/{pid}/fd/{fd}"
    try:
        own = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError as err:
        if _leader_alive(pid):
            cause = f"leader process {pid} has closed blob fd {fd} (released or exiting)"
        else:
            cause = f"leader process {pid} has exited"
        exc = LeaderGoneError(f"cannot attach to the tensors shared by pid {pid}: {cause}",
                              cause=str(err))
        exc.errno = err.errno
        raise exc from err
    except OSError as err:
        exc2 = ShmAttachError(f"cannot attach to the tensors shared by pid {pid}: opening {path} "
                              f"failed ({err.strerror}); followers must run as the same user "
                              "on the same node, with /proc/<pid>/fd readable",
                              cause=str(err))
        exc2.errno = err.errno
        raise exc2 from err
    try:
        st = os.fstat(own)
        if (st.st_dev, st.st_ino) != (dev, ino):
            raise LeaderGoneError(f"cannot attach to the tensors shared by pid {pid}: fd {fd} "
                                  "there is no longer the shared blob (the leader exited and "
                                  "its pid or fd was reused)", cause="inode differs")
        seals = fcntl.fcntl(own, _F_GET_SEALS)
        if seals & _F_SEAL_WRITE == 0 or st.st_size != nbytes:
            raise ShmAttachError(f"cannot attach to the tensors shared by pid {pid}: blob fd {fd} "
                                 f"is not sealed or not {nbytes} bytes (seals {seals:#x}, size "
                                 f"{st.st_size})", cause="blob not sealed")
        return _private_mapping(f"/proc/self/fd/{own}", nbytes)
    finally:
        os.close(own)


def map_file(pid: int, info: Mapping[str, Any]) -> numpy.ndarray:
    """The whole file ``info["path"]`` mapped ``MAP_PRIVATE`` (as a uint8 array that keeps the
    mapping alive), once checked to be the very file ``info`` describes (``dev``, ``ino``,
    ``size``, ``mtime_ns``, as the leader with pid ``pid`` saw it).

    Raises:
        ShmAttachError: the file cannot be opened, or is another file than described.
    """
    path = str(info["path"])
    try:
        own = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as err:
        exc = ShmAttachError(f"cannot attach to the tensors shared by pid {pid}: opening its "
                             f"checkpoint file {path!r} failed ({err.strerror})", cause=str(err))
        exc.errno = err.errno
        raise exc from err
    try:
        st = os.fstat(own)
        expected = (info["dev"], info["ino"], info["size"], info["mtime_ns"])
        if (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns) != expected:
            raise ShmAttachError(f"cannot attach to the tensors shared by pid {pid}: its "
                                 f"checkpoint file {path!r} changed since it was shared",
                                 cause="file identity differs")
        return _private_mapping(f"/proc/self/fd/{own}", st.st_size)
    finally:
        os.close(own)
