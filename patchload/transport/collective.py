"""Broadcast tensors over a private process group: across nodes, or into GPU memory.

:func:`private_group` builds a gloo (CPU) or NCCL (CUDA) backend straight from a store, under the
key prefix ``patchload/pg/<tag>/``. It never touches, needs or reorders the default process group,
so it works before, after or without the user's ``init_process_group``.

:func:`broadcast` sends an ordered list of tensors from one group member to all others as flat
``uint8`` buckets: one ``broadcast`` per bucket of at most ``bucket_bytes``; a tensor larger than a
bucket goes alone, in chunks. Receivers allocate each tensor just before its first bucket arrives,
so their peak is the received bytes plus one bucket. Bytes are copied verbatim: any dtype, bitwise
exact (NaN payloads included).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Final, MutableMapping, Sequence

import torch
import torch.distributed as dist

from patchload._logging import get_logger
from patchload.transport import (
    TensorMeta,
    TransportError,
    TransportTimeout,
    dtype_from_str,
    meta_of,
)
from patchload.transport.arena import aligned

__all__ = ["PrivateGroup", "private_group", "broadcast"]

logger = get_logger(__name__)

BACKENDS: Final = ("gloo", "nccl")
STORE_PREFIX: Final = "patchload/pg"

# An error raised this close to the timeout (as a fraction of it) is reported as a timeout.
_TIMEOUT_FRACTION: Final = 0.9


class _GroupAdapter(logging.LoggerAdapter):
    def process(self, msg: Any,
                kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        return f"{self.extra['prefix']} {msg}", kwargs  # type: ignore[index]


@dataclass(slots=True)
class PrivateGroup:
    """A process group of patchload's own, outside ``torch.distributed``'s group registry.

    Use it as a context manager, or call :meth:`close`; a closed group cannot be used again.

    Attributes:
        backend: the torch backend object (``ProcessGroupGloo`` or ``ProcessGroupNCCL``).
        backend_name: ``"gloo"`` or ``"nccl"``.
        group_rank: this process's rank in the group, ``0 <= group_rank < group_size``.
        group_size: the number of member processes.
        tag: the name that made the group's store keys unique.
        timeout_s: the timeout of every operation, in seconds.
        closed: True after :meth:`close`.
    """

    backend: Any
    backend_name: str
    group_rank: int
    group_size: int
    tag: str
    timeout_s: float
    closed: bool = False
    log: logging.LoggerAdapter = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.log = _GroupAdapter(logger, {"prefix": self.describe()})

    def describe(self) -> str:
        """``"[group rank r/size, tag 't']"``, the prefix of this group's messages."""
        return f"[group rank {self.group_rank}/{self.group_size}, tag {self.tag!r}]"

    def close(self) -> None:
        """Shut the backend down and release its connections. Not collective; idempotent.

        Raises nothing: a failure to shut down is logged as a WARNING.
        """
        if self.closed:
            return
        self.closed = True
        try:
            self.backend.shutdown()
        except RuntimeError as err:  # already broken by a dead peer: nothing left to release
            self.log.warning("shutting down the private %s group failed: %s",
                             self.backend_name, err)
        self.backend = None

    def __enter__(self) -> PrivateGroup:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def private_group(
    store: dist.Store,
    *,
    group_rank: int,
    group_size: int,
    tag: str,
    timeout_s: float,
    backend: str = "gloo",
) -> PrivateGroup:
    """Build a private process group from ``store``. **Collective** over its members.

    Every member calls it with the same ``tag``, ``group_size`` and ``backend`` and its own
    ``group_rank``; it returns once all members have connected (rendezvous through
    ``PrefixStore("patchload/pg/<tag>", store.clone())``: a client of the group's own, so that
    its blocking waits never hold up other threads' requests on ``store``). The default process
    group is neither required nor used: this works with or without
    ``torch.distributed.init_process_group``.

    gloo is built with ``ProcessGroupGloo(store, rank, size, timeout)``, which picks its network
    interface like ``init_process_group`` does (``GLOO_SOCKET_IFNAME``, else the address the
    hostname resolves to). NCCL is built with ``ProcessGroupNCCL(store, rank, size, options)``
    and uses the current CUDA device: call ``torch.cuda.set_device`` first.

    Args:
        store: a job-wide store reachable by every member (``TCPStore``, ``FileStore``,
            ``PrefixStore``, ``HashStore`` inside one process).
        group_rank: this process's rank in the new group.
        group_size: the number of members.
        tag: unique per group created in the job (the rendezvous keys are never deleted, so a
            reused tag meets stale keys), identical on every member.
        timeout_s: seconds that creation and each later operation may take before failing.
        backend: ``"gloo"`` (CPU tensors) or ``"nccl"`` (CUDA tensors).

    Returns:
        The :class:`PrivateGroup`; close it when done.

    Raises:
        ValueError: a bad argument (the message lists the accepted values).
        TransportTimeout: not all members connected within ``timeout_s``.
        TransportError: the backend failed to connect (or the store to clone its client), or
            NCCL is not available.
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not valid: accepted values are {BACKENDS}")
    if not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size ({group_size!r}) must be a positive int")
    if not isinstance(group_rank, int) or not 0 <= group_rank < group_size:
        raise ValueError(f"group_rank ({group_rank!r}) must be in [0, group_size={group_size})")
    if not tag:
        raise ValueError("tag must be a non-empty string")
    if not timeout_s > 0:
        raise ValueError(f"timeout_s ({timeout_s!r}) must be > 0 seconds")

    timeout = datetime.timedelta(seconds=timeout_s)
    where = f"[group rank {group_rank}/{group_size}, tag {tag!r}]"
    started = time.monotonic()
    try:
        # A client of its own: the rendezvous blocks in the store until every member has come,
        # and a blocked request holds up every other request on its client (this process's
        # other threads', their heartbeat's), which may be what the missing members wait for.
        prefix_store = dist.PrefixStore(f"{STORE_PREFIX}/{tag}", store.clone())
        if backend == "gloo":
            pg = dist.ProcessGroupGloo(prefix_store, group_rank, group_size, timeout)
        else:
            nccl = getattr(dist, "ProcessGroupNCCL", None)
            if nccl is None or not dist.is_nccl_available():
                raise TransportError(f"{where} cannot create an NCCL group: this torch build has "
                                     "no NCCL", rank=group_rank, cause="NCCL not available")
            options = nccl.Options()
            options.is_high_priority_stream = False
            options._timeout = timeout
            pg = nccl(prefix_store, group_rank, group_size, options)
    except RuntimeError as err:
        if isinstance(err, TransportError):
            raise
        raise _wrap(err, f"{where} creating the private {backend} group", started, timeout_s,
                    group_rank) from err
    group = PrivateGroup(pg, backend, group_rank, group_size, tag, timeout_s)
    group.log.debug("private %s group ready in %.3f s", backend, time.monotonic() - started)
    return group


def broadcast(
    group: PrivateGroup,
    tensors_or_metas: Sequence[torch.Tensor] | Sequence[TensorMeta],
    *,
    src_group_rank: int,
    is_src: bool,
    bucket_bytes: int,
    device: str | torch.device = "cpu",
    allocate: Callable[[TensorMeta], torch.Tensor | None] | None = None,
) -> list[torch.Tensor]:
    """Send tensors from one member to all others. **Collective** over ``group``.

    Mirrors ``torch.distributed.broadcast`` with ``group_src``, for a list of tensors. Every
    member calls it with the same ``src_group_rank``, ``bucket_bytes`` and the same tensor list
    (the source's tensors, everyone else's metas), in the same order relative to other calls on
    ``group``. A first small ``allreduce`` checks that all members describe the same tensors and
    bucket size, so a mismatch fails on every member instead of hanging or corrupting.

    Args:
        group: from :func:`private_group`.
        tensors_or_metas: on the source, the strided tensors to send (any device; copied to
            ``device`` bucket by bucket when they are elsewhere or not contiguous); on receivers,
            one :class:`TensorMeta` (or its JSON form) per tensor.
        src_group_rank: the sender's rank in ``group`` (not its global rank).
        is_src: whether this process is the sender; must equal
            ``group.group_rank == src_group_rank``.
        bucket_bytes: the most bytes one broadcast carries; > 0.
        device: where buckets and received tensors live: ``"cpu"`` for gloo, this process's CUDA
            device for NCCL.
        allocate: receivers: where a tensor is received (``allocate(meta)``: an uninitialised
            contiguous tensor of the meta's shape and dtype on ``device``, or None for a fresh
            one), e.g. a node leader's blob arena.

    Returns:
        On the source, its input tensors (unchanged, same objects). On receivers, contiguous
        tensors on ``device``, one per meta (freshly allocated, each with its own storage, unless
        ``allocate`` gave one), bitwise equal to the source's.

    Raises:
        ValueError: bad arguments, or ``is_src`` disagrees with the group rank.
        TransportTimeout: an operation did not complete within the group's timeout (a member
            stalled or never called).
        TransportError: a member died or the connection broke, or the members' tensor lists or
            bucket sizes differ. After either, close the group: its state is undefined.
    """
    if group.closed:
        raise ValueError(f"{group.describe()} broadcast on a closed group")
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes ({bucket_bytes!r}) must be > 0")
    if not 0 <= src_group_rank < group.group_size:
        raise ValueError(f"src_group_rank ({src_group_rank}) must be in [0, {group.group_size})")
    if is_src != (group.group_rank == src_group_rank):
        raise ValueError(f"{group.describe()} is_src={is_src} but src_group_rank is "
                         f"{src_group_rank}")
    device = torch.device(device)

    sources: list[torch.Tensor] = []
    if is_src:
        for index, t in enumerate(tensors_or_metas):
            if not isinstance(t, torch.Tensor) or t.layout != torch.strided:
                raise ValueError(f"{group.describe()} source entry {index} is not a strided "
                                 "tensor")
            sources.append(t.detach())
        metas = [meta_of(t) for t in sources]
    else:
        metas = [m if isinstance(m, TensorMeta) else TensorMeta.from_json(m)  # type: ignore
                 for m in tensors_or_metas]
    dtypes = [dtype_from_str(m.dtype) for m in metas]
    plan = _plan(metas, bucket_bytes)

    started = time.monotonic()
    _check_agreement(group, metas, bucket_bytes, src_group_rank, device, started)

    outputs: list[torch.Tensor | None] = [None] * len(metas)
    if not is_src:
        for i, m in enumerate(metas):
            if m.nbytes == 0:
                outputs[i] = torch.empty(m.shape, dtype=dtypes[i], device=device)
    scratch: torch.Tensor | None = None
    staged: tuple[int, torch.Tensor] | None = None
    total = 0
    for number, bucket in enumerate(plan):
        length = _length(bucket)
        total += length
        if not is_src:
            for i, start, _, _ in bucket:
                if start == 0:
                    given = allocate(metas[i]) if allocate is not None else None
                    outputs[i] = (given if given is not None else
                                  torch.empty(metas[i].shape, dtype=dtypes[i], device=device))
        direct = None
        if len(bucket) == 1:
            i, start, n, _ = bucket[0]
            owner = sources[i] if is_src else outputs[i]
            if owner.is_contiguous() and owner.device == device:  # type: ignore[union-attr]
                direct = _bytes_of(owner)[start:start + n]  # type: ignore[arg-type]
        elif not is_src:
            direct = _laid_out_as(bucket, outputs, length)
        if direct is not None:
            buffer = direct
        else:
            if scratch is None:
                scratch = torch.empty(max(_length(b) for b in plan), dtype=torch.uint8,
                                      device=device)
            buffer = scratch[:length]
            if is_src:
                for i, start, n, offset in bucket:
                    if staged is None or staged[0] != i:  # a chunked tensor is staged once
                        staged = (i, _bytes_of(sources[i].contiguous()))
                    buffer[offset:offset + n].copy_(staged[1][start:start + n])
                    if start + n == metas[i].nbytes:
                        staged = None
        _run(group, f"broadcast of bucket {number + 1}/{len(plan)} ({length} bytes) from group "
             f"rank {src_group_rank}", started,
             lambda: group.backend.broadcast([buffer], _broadcast_options(src_group_rank, group)))
        if not is_src and direct is None:
            for i, start, n, offset in bucket:
                received = _bytes_of(outputs[i])  # type: ignore[arg-type]
                received[start:start + n].copy_(buffer[offset:offset + n])
    group.log.debug("broadcast %d tensors, %d bytes in %d buckets from group rank %d in %.3f s",
                    len(metas), total, len(plan), src_group_rank, time.monotonic() - started)
    if is_src:
        return list(tensors_or_metas)  # type: ignore[arg-type]
    return outputs  # type: ignore[return-value]


# --- helpers ------------------------------------------------------------------------------------

# A bucket is a list of pieces (tensor index, first byte in the tensor, byte count, bucket offset).
# Whole tensors in a bucket start at 64-byte aligned offsets, as in a blob (see _laid_out_as).
_Piece = tuple[int, int, int, int]


def _length(bucket: list[_Piece]) -> int:
    return max(offset + n for _, _, n, offset in bucket)


def _laid_out_as(bucket: list[_Piece], outputs: list[torch.Tensor | None],
                 length: int) -> torch.Tensor | None:
    """The bytes the bucket's received tensors occupy, when they lie in one storage exactly as
    in the bucket (a blob arena allocated them in order): the bucket is received there, with no
    scratch copy. None otherwise."""
    first = outputs[bucket[0][0]]
    if first is None or not first.is_contiguous():
        return None
    storage, base = first.untyped_storage(), first.data_ptr()
    for i, _, _, offset in bucket:
        out = outputs[i]
        if (out is None or not out.is_contiguous() or out.untyped_storage().data_ptr()
                != storage.data_ptr() or out.data_ptr() - base != offset):
            return None
    start = base - storage.data_ptr()
    if start + length > storage.nbytes():
        return None
    return torch.empty(0, dtype=torch.uint8, device=first.device).set_(storage, start, (length,))


def _plan(metas: Sequence[TensorMeta], bucket_bytes: int) -> list[list[_Piece]]:
    """Deterministic packing of the tensors' bytes into buckets, computed alike on every member."""
    buckets: list[list[_Piece]] = []
    current: list[_Piece] = []
    filled = 0
    for i, m in enumerate(metas):
        if m.nbytes == 0:
            continue
        if m.nbytes > bucket_bytes:
            if current:
                buckets.append(current)
                current, filled = [], 0
            for start in range(0, m.nbytes, bucket_bytes):
                buckets.append([(i, start, min(bucket_bytes, m.nbytes - start), 0)])
            continue
        start = aligned(filled)
        if current and start + m.nbytes > bucket_bytes:
            buckets.append(current)
            current, start = [], 0
        current.append((i, 0, m.nbytes, start))
        filled = start + m.nbytes
    if current:
        buckets.append(current)
    return buckets


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    """1-D ``uint8`` view of contiguous ``t``'s bytes (same device, shares memory)."""
    return t.reshape(-1).view(torch.uint8)


def _broadcast_options(src_group_rank: int, group: PrivateGroup) -> dist.BroadcastOptions:
    options = dist.BroadcastOptions()
    options.rootRank = src_group_rank
    options.rootTensor = 0
    options.timeout = datetime.timedelta(seconds=group.timeout_s)
    return options


def _check_agreement(group: PrivateGroup, metas: Sequence[TensorMeta], bucket_bytes: int,
                     src_group_rank: int, device: torch.device, started: float) -> None:
    """All members must describe the same transfer: compare a fingerprint with one allreduce."""
    text = json.dumps([bucket_bytes, src_group_rank, [m.to_json() for m in metas]])
    fingerprint = int.from_bytes(hashlib.blake2b(text.encode(), digest_size=7).digest(), "big")
    values = torch.tensor([fingerprint, -fingerprint], dtype=torch.int64, device=device)
    options = dist.AllreduceOptions()
    options.reduceOp = dist.ReduceOp.MAX
    options.timeout = datetime.timedelta(seconds=group.timeout_s)
    _run(group, "checking that all members describe the same tensors", started,
         lambda: group.backend.allreduce([values], options))
    high, low = values.tolist()
    if high != fingerprint or -low != fingerprint:
        raise TransportError(f"{group.describe()} broadcast from group rank {src_group_rank}: "
                             f"members describe different tensors or bucket sizes (this member: "
                             f"{len(metas)} tensors, {sum(m.nbytes for m in metas)} bytes, "
                             f"bucket_bytes={bucket_bytes})", rank=group.group_rank,
                             cause="fingerprint mismatch")


def _run(group: PrivateGroup, action: str, started: float, launch: Any) -> None:
    """Launch one backend operation and wait for it, turning failures into TransportError."""
    op_started = time.monotonic()
    try:
        work = launch()
        work.wait(datetime.timedelta(seconds=group.timeout_s))
    except RuntimeError as err:
        raise _wrap(err, f"{group.describe()} {action}", op_started, group.timeout_s,
                    group.group_rank, total_s=time.monotonic() - started) from err


def _wrap(err: BaseException, action: str, started: float, timeout_s: float, rank: int, *,
          total_s: float | None = None) -> TransportError:
    elapsed = time.monotonic() - started
    total = f", {total_s:.1f} s into the transfer" if total_s is not None else ""
    if elapsed >= _TIMEOUT_FRACTION * timeout_s:
        return TransportTimeout(f"{action}: timed out after {elapsed:.1f} s (timeout {timeout_s} s"
                                f"{total}); a member stalled or never called: {err}",
                                rank=rank, cause=str(err))
    return TransportError(f"{action}: failed after {elapsed:.1f} s{total}; a member died or the "
                          f"connection broke: {err}", rank=rank, cause=str(err))
