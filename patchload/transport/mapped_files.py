"""Zero-copy loads: followers map the checkpoint files themselves, alongside the leader.

Where a load leaves every tensor a view of its safetensors file (the checkpoint's dtypes are the
loaded ones, on the CPU, with key renames only), a plain rank's weights already are the page
cache's pages, one copy for the node. Taking them from the leader then saves no memory, and
waiting for its load adds its whole time to the follower's. So the node leader describes its
checkpoint files when it announces them (:func:`describe`: each tensor's dtype, shape and byte
range, from the safetensors header, and the file's identity), and a follower whose load is such
a load (:func:`maps_as_plain`) maps the same files (``MAP_PRIVATE``: the same pages, copy-on-write)
and hands transformers those tensors (:func:`mapped_state_dict`) in place of the file handles it
would open, so the rest of its load is transformers' own, run alongside the leader's. The
follower makes no request and reads no header; it touches the file's pages as a plain load does.

transformers 5.x only (its ``_load_pretrained_model`` reads a safetensors checkpoint through
handles it opens itself, or takes a state dict). Linux only. Nothing here is collective.
"""

from __future__ import annotations

import json
import math
import os
import struct
from typing import TYPE_CHECKING, Any, Final, Sequence

from .._logging import get_logger

if TYPE_CHECKING:
    import torch

__all__ = ["MappedSlice", "describe", "maps_as_plain", "mapped_state_dict"]

logger = get_logger(__name__)

# The safetensors format's dtype names (https://huggingface.co/docs/safetensors, "Format");
# a file with any other is not described.
_DTYPES: Final = {"F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
                  "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8",
                  "BOOL": "bool", "F8_E4M3": "float8_e4m3fn", "F8_E5M2": "float8_e5m2"}
_HEADER_MAX_BYTES: Final = 100 * 2**20  # safetensors refuses larger headers too


def describe(paths: Sequence[str] | None) -> dict[str, Any] | None:
    """Leader: the layout of safetensors checkpoint files, for followers to map them.

    Args:
        paths: the checkpoint files the load resolved, in order.

    Returns:
        ``{"pid": <this process>, "files": [{"path", "dev", "ino", "size", "mtime_ns",
        "tensors": [[key, dtype, shape, begin, end], ...]}, ...]}`` (real paths; byte offsets
        in the file; keys sorted as safetensors' ``keys()`` lists them), or None when a file is
        not a safetensors file this can describe (logged at DEBUG).
    """
    if not isinstance(paths, (list, tuple)) or not paths or not all(
            isinstance(p, (str, os.PathLike)) and str(p).endswith(".safetensors") for p in paths):
        return None
    files = []
    for path in paths:
        try:
            files.append(_describe_file(os.path.realpath(path)))
        except (OSError, ValueError, KeyError, TypeError) as err:
            logger.debug("not describing %s for followers to map: %s", path, err)
            return None
    return {"pid": os.getpid(), "files": files}


def _describe_file(path: str) -> dict[str, Any]:
    from . import dtype_from_str

    with open(path, "rb") as f:
        st = os.fstat(f.fileno())
        (length,) = struct.unpack("<Q", f.read(8))
        if length > _HEADER_MAX_BYTES:
            raise ValueError(f"a {length}-byte header")
        header = json.loads(f.read(length))
    start = 8 + length
    tensors = []
    for key in sorted(k for k in header if k != "__metadata__"):
        entry = header[key]
        begin, end = (start + int(x) for x in entry["data_offsets"])
        if end > st.st_size:
            raise ValueError(f"{key} ends at byte {end} of a {st.st_size}-byte file")
        dtype, shape = _DTYPES[entry["dtype"]], [int(n) for n in entry["shape"]]
        if begin > end or math.prod(shape) * dtype_from_str(dtype).itemsize != end - begin:
            raise ValueError(f"{key}: {end - begin} bytes for shape {shape} of {dtype}")
        tensors.append([key, dtype, shape, begin, end])
    return {"path": path, "dev": st.st_dev, "ino": st.st_ino, "size": st.st_size,
            "mtime_ns": st.st_mtime_ns, "tensors": tensors}


def maps_as_plain(state_dict: Any, checkpoint_files: Sequence[str] | None, load_config: Any,
                  layout: dict[str, Any] | None) -> bool:
    """Whether a transformers 5 ``_load_pretrained_model`` with these arguments leaves every
    checkpoint tensor a view of its file: safetensors files, described in ``layout``, read
    through mmap, on the CPU, unquantised, with key renames only (no conversion that makes new
    tensors) and every floating-point tensor already in the load's dtype (and in every dtype of
    its ``keep_in_fp32`` plan). Decided the same way by the leader and by its followers, from
    the same arguments (part of the call's key) and the same layout.
    """
    if layout is None or state_dict is not None or not checkpoint_files:
        return False
    if not hasattr(load_config, "weight_mapping") or getattr(load_config, "disable_mmap", False):
        return False  # transformers 4, or a load that reads files into private memory
    if getattr(load_config, "hf_quantizer", None) is not None:
        return False
    device_map = getattr(load_config, "device_map", None)
    if device_map is not None and any(str(d) != "cpu" for d in device_map.values()):
        return False
    try:
        from transformers import modeling_utils
        from transformers.core_model_loading import WeightRenaming
    except ImportError:
        return False
    on_mount = getattr(modeling_utils, "_is_on_hf_mount", None)
    if on_mount is not None and any(on_mount(f) for f in checkpoint_files):
        return False  # read with open().read() there
    if any(type(c) is not WeightRenaming for c in (load_config.weight_mapping or ())):
        return False
    dtype = str(getattr(load_config, "dtype", None)).removeprefix("torch.")
    plan = getattr(load_config, "dtype_plan", None) or {}
    if any(str(d).removeprefix("torch.") != dtype for d in plan.values()):
        return False
    return all(entry[1] == dtype for file in layout["files"] for entry in file["tensors"]
               if entry[1].startswith(("float", "bfloat")))


def mapped_state_dict(layout: dict[str, Any], checkpoint_files: Sequence[str]
                      ) -> dict[str, MappedSlice] | None:
    """Follower: the checkpoint's tensors, mapped from the files the leader described, as
    transformers 5 gets them from safetensors' mmap: by key in the order of ``checkpoint_files``
    and, in each, of its sorted keys; each a :class:`MappedSlice`, materialised when transformers
    asks for it.

    Returns:
        The state dict, or None (logged at DEBUG) when this rank's files are not the ones the
        leader described (another path, or a file changed since) or cannot be mapped.
    """
    from . import TransportError
    from .shm import map_file

    described = {file["path"]: file for file in layout["files"]}
    state: dict[str, MappedSlice] = {}
    for path in checkpoint_files:
        file = described.get(os.path.realpath(path))
        if file is None:
            logger.debug("%s is not a file the leader described: not mapping it", path)
            return None
        try:
            region = map_file(int(layout["pid"]), file)
        except TransportError as err:
            logger.debug("not mapping %s: %s", path, err)
            return None
        for key, dtype, shape, begin, end in file["tensors"]:
            state[key] = MappedSlice(region, dtype, shape, begin, end)
    return state


class MappedSlice:
    """One checkpoint tensor in a mapped file, standing in for safetensors' ``PySafeSlice``
    (``get_shape``, ``get_dtype``, indexing): ``slice[...]`` makes the tensor, in the calling
    thread as safetensors does (an inference tensor inside ``torch.inference_mode()``), a
    contiguous CPU tensor with a storage of its own (exactly its bytes, the file's pages
    copy-on-write); another index slices that tensor.

    Attributes:
        nbytes: the tensor's size in bytes.
    """

    def __init__(self, region: Any, dtype: str, shape: list[int], begin: int, end: int) -> None:
        self._region, self._dtype, self._shape, self._begin = region, dtype, shape, begin
        self.nbytes = end - begin

    def get_shape(self) -> list[int]:
        """The tensor's shape."""
        return list(self._shape)

    def get_dtype(self) -> str:
        """The safetensors name of its dtype (``"F32"``, ``"BF16"``, ...)."""
        return next(k for k, v in _DTYPES.items() if v == self._dtype)

    def __getitem__(self, index: Any) -> torch.Tensor:
        import torch

        from . import dtype_from_str
        from .shm import contiguous_stride, empty_tensor, tensor_view

        dtype, stride = dtype_from_str(self._dtype), contiguous_stride(self._shape)
        inference = torch.is_inference_mode_enabled()
        if self.nbytes == 0:
            tensor = empty_tensor(self._shape, stride, dtype, resizable=False,
                                  inference=inference)
        else:
            tensor = tensor_view(self._region, self._begin, dtype, self._shape, stride,
                                 inference=inference)
        return tensor if index is Ellipsis else tensor[index]
