"""The loaded models that map the node's shared copy: weights about to be written leave it for
private memory, as a plain load.

The shm transport (:mod:`patchload.transport.node_shm`) tracks here every model whose tensors it
mapped a blob into.

A model whose tensors map the node's shared blob reads its weights for free, but every page a
rank writes is copied on its first write, one 4 KiB fault at a time (about 2 s per GB on the
development machine, against 0.4 s per GB for one bulk copy), and the shared copy stays in memory
beside the private ones for as long as any rank maps it. Training writes every weight: DDP's
construction broadcasts rank 0's parameters and buffers into the others, and an optimizer's
step writes the parameters it was given.

So the two calls that announce those writes, ``DistributedDataParallel(module)`` and
``Optimizer.add_param_group`` (every optimizer's constructor calls it) with parameters that
require a gradient (patched by :func:`patchload.weights.writes.write_patches`, which calls
:meth:`MappedModels.before_writes`), first copy every tensor of the affected loaded model that
maps a shared blob into private memory of this rank, in bulk, and drop the mapping. Once every
rank of the node has done so (and the leader closed the blob's fd) the shared copy is gone and
the node holds what a plain load gives: one private copy per rank. A model only read
(inference, evaluation, frozen weights under adapters) keeps mapping the shared copy.

Whatever ends a model's use of the shared copy on a rank (those two calls, a move to a device or
to ``torch.device("cpu", 0)`` as the HF Trainer's on CPU, a ``.to(other dtype)``, ``del model``),
one INFO line of that rank says so once, with the cause as far as it can be told and the bytes
copied out: a thread of the process looks every ``_WATCH_S`` seconds (no store request) whether
the model's tensors still map the blob, while any tracked model does.

The copy changes no value, shape, stride, dtype or object identity: every ``Parameter`` and
buffer keeps its Python object (``tensor.data = copy``), so the references DDP, an optimizer or
the user already hold see the private bytes (only ``data_ptr()`` and the storage change, as a
plain load's addresses differ anyway). A model whose mapped bytes are reachable some other way
(a ``weight[:10]`` view or a ``untyped_storage()`` object the user kept), that holds inference
tensors, or that is copied inside ``torch.inference_mode()`` is not copied: its pages are then
copied on write, one INFO line says why. A raw ``data_ptr()`` kept by user code cannot be seen.
"""

from __future__ import annotations

import itertools
import sys
import threading
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Iterable

from .._background import Loop
from .._logging import get_logger

if TYPE_CHECKING:
    import torch

__all__ = ["MappedModels"]

logger = get_logger(__name__)

_WATCH_S: Final = 0.5  # how often the tracked models' mappings are looked at (no store request)


@dataclass(eq=False)
class _Mapped:
    model: weakref.ref[Any]
    storage_ptrs: frozenset[int]  # data_ptr of each storage viewing this rank's mapping of a blob
    mappings: list[Any]  # StorageWeakRef of those storages: the mapping goes with the last
    prefix: str
    nbytes: int  # bytes of those storages
    dtype: Any  # the model's first tensor's dtype when loaded (to name a conversion)
    cause: str | None = None  # set once patchload itself copied the model out
    copied_bytes: int = 0  # what that copy took out

    def live(self) -> bool:
        return self.model() is not None and not self.unmapped()

    def unmapped(self) -> bool:
        """Whether no storage of this rank views the blob through this model any more."""
        return all(m.expired() for m in self.mappings)


class MappedModels:
    """The loaded models of this process whose tensors map a shared blob. Thread-safe."""

    def __init__(self) -> None:
        self._mapped: list[_Mapped] = []  # not yet copied out (nor refused) by before_writes
        self._watched: list[_Mapped] = []  # until the shared copy ended for them on this rank
        self._lock = threading.Lock()
        self._watcher = Loop("patchload-mapped", period_s=_WATCH_S,
                             busy=lambda: bool(self._watched), step=self._watch,
                             lock=self._lock)

    def add(self, model: Any, storages: list[torch.UntypedStorage], prefix: str) -> None:
        """Track ``model``, whose tensors have ``storages`` (one per tensor, each viewing this
        rank's ``MAP_PRIVATE`` mapping of a blob), and watch for the end of that. Not
        collective."""
        from torch.multiprocessing.reductions import StorageWeakRef

        first = next(itertools.chain(model.parameters(), model.buffers()), None)
        mapped = _Mapped(weakref.ref(model), frozenset(s.data_ptr() for s in storages),
                         [StorageWeakRef(s) for s in storages], prefix,
                         sum(s.nbytes() for s in storages),
                         None if first is None else first.dtype)
        with self._lock:
            self._mapped.append(mapped)
            self._watched.append(mapped)
            self._watcher.ensure()

    def stop_at_exit(self) -> None:
        """Stop and join the watcher (at most ``JOIN_AT_EXIT_S``): nothing is logged at exit."""
        self._watcher.stop()

    def _watch(self) -> None:
        """While a tracked model maps a blob: log each end of the shared copy (see the module
        docstring)."""
        with self._lock:
            watched = list(self._watched)
        for mapped in watched:
            if mapped.unmapped() and not self._watcher.stopping:
                self._ended(mapped)

    def _ended(self, mapped: _Mapped) -> None:
        """The one INFO line saying that ``mapped``'s model no longer maps the node's shared
        copy on this rank."""
        with self._lock:
            if mapped not in self._watched:
                return  # already said
            self._watched.remove(mapped)
        cause, copied = _cause(mapped)
        logger.info("%s: the node's shared copy of the weights ended on this rank (%s): %d bytes "
                    "copied out", mapped.prefix, cause, copied)

    def __bool__(self) -> bool:
        return bool(self._mapped)

    def before_writes(self, tensors: Iterable[torch.Tensor], why: str) -> None:
        """Copy every tracked model that maps the storage of any of ``tensors`` into private
        memory (see the module docstring). Not collective; costs one bulk copy of those models.
        """
        with self._lock:
            self._mapped = [m for m in self._mapped if m.live()]
            if not self._mapped:
                return
            by_ptr = {ptr: m for m in self._mapped for ptr in m.storage_ptrs}
        hit: list[_Mapped] = []
        for tensor in tensors:
            mapped = by_ptr.get(_storage_ptr(tensor))
            if mapped is not None and mapped not in hit:
                hit.append(mapped)
        for mapped in hit:
            with self._lock:
                if mapped not in self._mapped:
                    continue  # another thread copied it
                self._mapped.remove(mapped)
            model = mapped.model()
            if model is None:
                continue
            try:
                copied = _copy_out(model, mapped, why)
            except Exception as err:  # noqa: BLE001 - values are equal either way: go on mapped
                logger.warning("%s: %s; copying its weights out of the node's shared copy "
                               "failed (%s: %s): pages are copied as they are written instead",
                               mapped.prefix, why, type(err).__name__, err)
                continue
            del model
            if copied is not None:
                mapped.cause, mapped.copied_bytes = f"{why}, before they are written", copied
                if mapped.unmapped():  # at once, as a plain load's memory would be now
                    self._ended(mapped)


def _cause(mapped: _Mapped) -> tuple[str, int]:
    """What ended ``mapped``'s use of the shared copy, as far as it can be told, and the bytes
    copied out. Reads one tensor of the model (from the watcher thread: no iteration)."""
    if mapped.cause is not None:
        return mapped.cause, mapped.copied_bytes
    model = mapped.model()
    if model is None:
        return "the model was freed", 0
    try:
        first = next(itertools.chain(model.parameters(), model.buffers()), None)
    except Exception:  # noqa: BLE001 - the model changing under this thread: cause unknown
        first = None
    del model
    if first is None:
        return "its tensors left the shared copy", mapped.nbytes
    converted = first.dtype != mapped.dtype
    if first.device.type != "cpu":
        cause = f"moved to {first.device}" + (f" as {first.dtype}" if converted else "")
    elif converted:
        cause = f"converted to {first.dtype}"
    else:
        cause = ("copied into new CPU tensors, as by Module.to(torch.device('cpu', 0)) in the "
                 "HF Trainer")
    return cause, mapped.nbytes


def _storage_ptr(tensor: Any) -> int | None:
    """The data pointer of a dense CPU tensor's storage; None for any other tensor (meta, a
    device, sparse, a DTensor or other wrapper subclass: none of them views a blob)."""
    import torch

    if (type(tensor) not in (torch.Tensor, torch.nn.Parameter) or tensor.device.type != "cpu"
            or tensor.layout != torch.strided):
        return None
    return tensor.untyped_storage().data_ptr()


def _python_refs_of_a_fresh_storage() -> int:
    """``sys.getrefcount`` of the storage object of a live tensor, held by one local name only
    (torch keeps references of its own; counted the same way as in :func:`_copy_out`)."""
    import torch

    tensor = torch.empty(1)
    storage = tensor.untyped_storage()
    return sys.getrefcount(storage)


def _held_elsewhere(views: list[torch.Tensor], sharing: dict[int, int]) -> bool:
    """Whether a storage of ``views`` is held by more than those views (another view, or its
    storage object, kept by the user): copying the views out would then free nothing."""
    import torch

    fresh = _python_refs_of_a_fresh_storage()
    checked: set[int] = set()
    for view in views:
        storage = view.untyped_storage()
        ptr = storage.data_ptr()
        if ptr in checked:
            continue
        checked.add(ptr)
        # Each view holds one reference to its storage, and so does `storage` itself; a storage
        # object the user holds is this same Python object, with more Python references.
        if (torch._C._storage_Use_Count(storage._cdata) - sharing[ptr] - 1 > 0
                or sys.getrefcount(storage) > fresh):
            return True
    return False


def _copy_out(model: Any, mapped: _Mapped, why: str) -> int | None:
    """Copy ``model``'s tensors that view ``mapped`` into private memory; returns the bytes
    copied, or None when it would not keep what the model's users see (logged)."""
    import torch

    seen: set[int] = set()
    views: list[torch.Tensor] = []
    sharing: dict[int, int] = {}  # storage data_ptr -> how many of the views have that storage
    for _, tensor in list(model.named_parameters(remove_duplicate=False)) + list(
            model.named_buffers(remove_duplicate=False)):
        ptr = _storage_ptr(tensor)
        if id(tensor) not in seen and ptr in mapped.storage_ptrs:
            seen.add(id(tensor))
            views.append(tensor)
            sharing[ptr] = sharing.get(ptr, 0) + 1  # type: ignore[index]
    if not views:
        return 0
    reason = None
    if _held_elsewhere(views, sharing):
        reason = "other views of them, or their storage, are held"
    elif torch.is_inference_mode_enabled() or any(v.is_inference() for v in views):
        reason = "inference tensors are involved (a copy would change is_inference())"
    if reason is not None:
        logger.info("%s: %s; its weights stay mapped from the node's shared copy, and pages are "
                    "copied as they are written: %s", mapped.prefix, why, reason)
        return None
    copied = 0
    with torch.no_grad():
        for tensor in views:
            private = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype)
            private.copy_(tensor)
            tensor.data = private
            copied += private.numel() * private.element_size()
    del views, private
    logger.debug("%s: %s: copied %d bytes of weights out of the node's shared copy into this "
                 "rank's private memory (a plain load's layout) before they are written",
                 mapped.prefix, why, copied)
    return copied
