"""Where a node leader's converting load writes its tensors: straight into the blob it will share.

A converting load (``dtype`` differs from the checkpoint's) makes every tensor anew. Without an
arena, the leader converts into private memory and then copies each tensor into the shared blob
(one more pass over the model's bytes, and both copies alive while it goes). A
:class:`BlobArena` is a memfd sized for the whole model, mapped ``MAP_SHARED`` and writable: the
conversion writes into it (``dest.copy_(src)``, bitwise what ``src.to(dtype)`` gives), and
:func:`patchload.transport.shm.share` then describes those tensors by their offset instead of
copying them, writes the few others (non-persistent buffers, converter outputs) into its free
space, re-points the leader's tensors at a ``MAP_PRIVATE`` mapping of it, drops the writable
mapping and seals the memfd. Bytes written and not kept are given back (hole punching).

Linux only. Nothing here is collective.
"""

from __future__ import annotations

import ctypes
import math
import os
import threading
import weakref
from typing import Final, Iterable, Sequence

import torch

from .._logging import get_logger

__all__ = ["BlobArena", "aligned", "capacity_for"]

logger = get_logger(__name__)

ALIGN_BYTES: Final = 64
_FALLOC_FL_KEEP_SIZE: Final = 0x01
_FALLOC_FL_PUNCH_HOLE: Final = 0x02


def aligned(offset: int) -> int:
    """``offset`` rounded up to the blob's alignment (64 bytes)."""
    return (offset + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


def capacity_for(sizes: Iterable[int]) -> int:
    """Bytes of a blob holding tensors of ``sizes`` bytes one after another, each aligned."""
    end = 0
    for nbytes in sizes:
        end = aligned(end) + nbytes
    return end


class BlobArena:
    """A memfd of ``capacity`` bytes, created on the first :meth:`take`, handed out front to
    back (64-byte aligned) under a lock (transformers may materialise from a thread pool).

    The fd is closed when the arena is garbage-collected, unless :func:`patchload.transport.
    shm.share` took it over (:meth:`hand_over`).
    """

    def __init__(self, capacity: int) -> None:
        self.capacity = int(capacity)
        self.used = 0  # bytes handed out, alignment included
        self.fd: int | None = None
        self.writable: torch.UntypedStorage | None = None  # the MAP_SHARED mapping
        self.base: int | None = None  # its address, kept once it is dropped (see owns)
        self._lock = threading.Lock()
        self._closer: weakref.finalize | None = None

    def take(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor | None:
        """A contiguous tensor of ``shape`` and ``dtype`` in the arena (uninitialised), or None
        when it does not fit or the memfd cannot be made (the caller allocates privately)."""
        nbytes = math.prod(shape) * dtype.itemsize
        with self._lock:
            start = aligned(self.used)
            if nbytes == 0 or start + nbytes > self.capacity:
                return None
            if self.fd is None and not self._open():
                return None
            self.used = start + nbytes
            storage = self.writable
        assert storage is not None
        return torch.empty(0, dtype=dtype).set_(storage, start // dtype.itemsize, tuple(shape))

    def _open(self) -> bool:
        try:
            fd = os.memfd_create("patchload", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError as err:
            logger.debug("no arena for the conversion (%s): converting into private memory", err)
            self.capacity = 0
            return False
        self._closer = weakref.finalize(self, os.close, fd)
        try:
            os.ftruncate(fd, self.capacity)
            self.writable = torch.UntypedStorage.from_file(f"/proc/self/fd/{fd}", shared=True,
                                                           nbytes=self.capacity)
        except (OSError, RuntimeError) as err:
            self._closer()
            logger.debug("no arena for the conversion (%s): converting into private memory", err)
            self.capacity = 0
            return False
        self.fd = fd
        self.base = self.writable.data_ptr()
        return True

    def owns(self, tensor: torch.Tensor) -> bool:
        """Whether ``tensor`` views this arena's writable mapping (also once the arena dropped
        it or closed: the tensor then keeps the mapping alive)."""
        return self.base is not None and tensor.untyped_storage().data_ptr() == self.base

    def offset_of(self, tensor: torch.Tensor) -> int:
        """Byte offset of an owned tensor's first element in the memfd."""
        assert self.base is not None
        return tensor.data_ptr() - self.base

    def punch(self, kept: list[tuple[int, int]]) -> int:
        """Give back the pages of ``[0, used)`` outside the ``(start, end)`` ranges in ``kept``
        (written, then dropped: a converter's inputs, a mismatched tensor). Returns the bytes
        punched; 0 when the kernel refuses (the pages then stay until the blob goes)."""
        if self.fd is None:
            return 0
        page = os.sysconf("SC_PAGE_SIZE")
        punched, cursor = 0, 0
        for start, end in sorted(kept) + [(self.used, self.used)]:
            hole_start = (cursor + page - 1) // page * page
            hole_end = start // page * page
            if hole_end > hole_start:
                if not _punch_hole(self.fd, hole_start, hole_end - hole_start):
                    return punched
                punched += hole_end - hole_start
            cursor = max(cursor, end)
        return punched

    def hand_over(self) -> int:
        """The fd, now owned by the caller (it is no longer closed with the arena)."""
        assert self.fd is not None and self._closer is not None
        self._closer.detach()
        fd, self.fd = self.fd, None
        return fd

    def drop_writable(self) -> bool:
        """Forget the writable mapping; returns whether it is gone (nothing else held it)."""
        if self.writable is None:
            return True
        from torch.multiprocessing.reductions import StorageWeakRef

        ref = StorageWeakRef(self.writable)
        self.writable = None
        return bool(ref.expired())

    def close(self) -> None:
        """Drop the writable mapping and close the fd (tensors still viewing the mapping keep
        it, as private memory of this process). Idempotent."""
        self.drop_writable()
        if self.fd is not None:
            os.close(self.hand_over())


def _punch_hole(fd: int, offset: int, length: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        fallocate = libc.fallocate
        fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    except (OSError, AttributeError):
        return False
    return fallocate(fd, _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE, offset, length) == 0
