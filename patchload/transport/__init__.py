"""How tensor bytes move from a leader to its followers.

:mod:`patchload.transport.base` states the transport Protocol that :mod:`patchload.weights`
dispatches on; one backend per module implements it, each holding its own state:

- :mod:`patchload.transport.node_shm` (``"shm"``): inside one node, over the byte mover
  :mod:`patchload.transport.shm` (``share`` / ``attach``, neither collective). The node leader
  writes the tensors into one sealed memfd blob (or points at the checkpoint file it already
  maps); local followers map it copy-on-write, so the node holds one physical copy.
- :mod:`patchload.transport.job_collective` (``"collective"``): across nodes, over the byte mover
  :mod:`patchload.transport.collective` (``private_group`` + ``broadcast``, collective over the
  group). Bucketed broadcasts over a private process group built from a store, never on the
  default group.

The byte movers move bytes only. The caller hands them an ordered list of unique tensors (tied
weights already deduplicated) and carries their JSON-able description (:class:`TensorMeta`, the
shm descriptor) through a ``torch.distributed.Store`` itself. Nothing read from a store or a blob
is ever unpickled.

This package imports no torch at import time; the backends do.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping

from patchload._errors import PatchloadError

if TYPE_CHECKING:
    import torch

__all__ = [
    "TensorMeta",
    "TransportError",
    "TransportTimeout",
    "ShmAttachError",
    "LeaderGoneError",
    "meta_of",
    "dtype_from_str",
]


@dataclass(frozen=True, slots=True)
class TensorMeta:
    """What a receiver needs to allocate one tensor: its shape, dtype and size.

    Attributes:
        shape: the tensor's sizes; ``()`` for a 0-d tensor.
        dtype: the dtype's name without the ``torch.`` prefix, e.g. ``"bfloat16"``.
        nbytes: ``numel * element_size``, in bytes.
    """

    shape: tuple[int, ...]
    dtype: str
    nbytes: int

    def to_json(self) -> dict[str, Any]:
        """JSON-able form: ``{"shape": [...], "dtype": str, "nbytes": int}``."""
        return {"shape": list(self.shape), "dtype": self.dtype, "nbytes": self.nbytes}

    @classmethod
    def from_json(cls, obj: Mapping[str, Any]) -> TensorMeta:
        """Inverse of :meth:`to_json`; validates types and the size.

        Raises:
            ValueError: a field is missing or mistyped, the dtype is unknown, or ``nbytes`` is
                not ``numel * element_size``.
        """
        try:
            shape = tuple(int(s) for s in obj["shape"])
            dtype = obj["dtype"]
            nbytes = int(obj["nbytes"])
        except (KeyError, TypeError, ValueError) as err:
            raise ValueError(f"not a TensorMeta description: {obj!r}") from err
        if not isinstance(dtype, str) or any(s < 0 for s in shape):
            raise ValueError(f"not a TensorMeta description: {obj!r}")
        meta = cls(shape, dtype, nbytes)
        expected = math.prod(shape) * dtype_from_str(dtype).itemsize
        if expected != nbytes:
            raise ValueError(f"TensorMeta {obj!r}: nbytes should be {expected}")
        return meta


def dtype_from_str(name: str) -> torch.dtype:
    """The ``torch.dtype`` named ``name`` (``"bfloat16"`` or ``"torch.bfloat16"``).

    Raises:
        ValueError: ``name`` is not a torch dtype.
    """
    import torch

    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r}")
    return dtype


def meta_of(t: torch.Tensor) -> TensorMeta:
    """The :class:`TensorMeta` of ``t`` (any device, any layout with a size)."""
    return TensorMeta(tuple(t.shape), str(t.dtype).removeprefix("torch."),
                      t.numel() * t.element_size())


class TransportError(PatchloadError):
    """Moving tensor bytes failed: a peer died, a mapping could not be made, descriptions differ.

    Attributes:
        rank: the rank that raised, in the numbering the message names (group rank for
            collectives), or None when unknown.
        cause: the underlying error's text.
    """

    def __init__(self, message: str, *, rank: int | None = None, cause: str = "") -> None:
        super().__init__(message, rank=rank)
        self.cause = cause

    # PatchloadError.__reduce__ rebuilds through ``cls.__new__(cls)``, which CPython refuses for
    # classes that also derive from OSError (TimeoutError, FileNotFoundError): "RuntimeError.__new__
    # (X) is not safe". Rebuild through the constructor instead, then restore the attributes.
    def __reduce__(self) -> tuple[Any, ...]:
        state = dict(self.__dict__)
        if isinstance(self, OSError):
            state["errno"] = self.errno
        return (type(self), (str(self.args[0]) if self.args else "",), state)

    def __setstate__(self, state: dict[str, Any]) -> None:
        for name, value in state.items():
            setattr(self, name, value)


class TransportTimeout(TransportError, TimeoutError):
    """A collective did not complete within its timeout (a peer stalled or never came)."""


class ShmAttachError(TransportError, OSError):
    """A follower could not map the node leader's shared tensors (permissions, other host, ...).

    ``errno`` is the underlying ``OSError``'s errno when there is one.
    """


class LeaderGoneError(ShmAttachError, FileNotFoundError):
    """The node leader's process, or the blob it published, no longer exists.

    A follower that attached before keeps working; one that attaches after gets this error.
    """

