"""How a coordinated load materialises checkpoint tensors: in the calling thread when they stay
views of their files, straight into the blob to share when a node leader converts them.

transformers 5 materialises every checkpoint tensor through ``core_model_loading.
spawn_materialize`` (in its loading thread pool, or deferred): ``tensor[...]`` then
``.to(device, dtype)``. Inside a leader's load whose transport prepared an arena
(:meth:`patchload.transport.node_shm.ShmWeights.prepare`), a plain renamed tensor on the CPU
whose dtype changes is instead converted into a region of the arena (``dest.copy_(src)``: the
same kernel, so the same bytes, as ``.to``). Sharing then copies nothing
(:func:`patchload.transport.shm.share`). Everything else (no conversion, a weight converter's
inputs, sharding, another device, no room left) is materialised exactly as transformers does.

A load whose every tensor stays a view of its file (``mode.used["alongside"]``, see
:func:`patchload._alongside.maps_as_plain`: a leader's or its followers' zero-copy load) has
nothing for the pool's threads to do: each ``tensor[...]`` is a view and ``.to`` returns it.
Its tensors are materialised in the calling thread instead (transformers' own deferred path,
as with ``HF_DEACTIVATE_ASYNC_LOAD``): the same tensors, with no threads contending for the GIL.
Measured (fp32 models loaded as fp32, 2 ranks on 2 cores, while its followers waited): a
leader's threads switched context about 1,000 times in the pool's 80-100 ms, and the load took
1.1-1.2x a plain one (500 MB and 1 GB); in the calling thread, 20 times and 0.9-1.0x.
"""

from __future__ import annotations

from typing import Any, Callable

from ._patching import Patch
from .coordination.call import current_mode

__all__ = ["convert_patches"]

_CPU = ("None", "cpu")  # str() of the device transformers passes


def _spawn_materialize(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...],
                       kwargs: dict[str, Any]) -> Any:
    """``transformers.core_model_loading.spawn_materialize``: in the calling thread for a load
    of views, converting into the arena for a leader's converting load."""
    mode = current_mode()
    if mode is not None and mode.used.get("alongside") and len(args) == 4:
        return wrapped(None, *args[1:], **kwargs)
    arena = mode.used.get("arena") if mode is not None and mode.lead else None
    if arena is None or len(args) != 4 or kwargs.get("sharding_op") is not None \
            or kwargs.get("tensor_idx") is not None:  # a converter's input: not kept as is
        return wrapped(*args, **kwargs)
    thread_pool, tensor, device, dtype = args
    if dtype is None or str(device) not in _CPU:
        return wrapped(*args, **kwargs)
    from transformers import core_model_loading

    def job() -> Any:
        src = tensor[...]  # what transformers materialises first (a view of the file mapping)
        if src.dtype != dtype and src.device.type == "cpu" and src.is_contiguous():
            dest = arena.take(src.shape, dtype)
            if dest is not None:
                return dest.copy_(src)
        return core_model_loading._materialize_copy(src, device, dtype)

    return thread_pool.submit(job) if thread_pool is not None else job


def convert_patches() -> list[Patch]:
    """The patch on how a coordinated load materialises checkpoint tensors."""
    return [Patch("transformers.core_model_loading", "spawn_materialize", _spawn_materialize)]
