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

A load whose every tensor stays a view of its file (``mode.load.alongside``, see
:func:`patchload.transport.mapped_files.maps_as_plain`: a leader's or its followers' zero-copy
load) has nothing for the pool's threads to do: each ``tensor[...]`` is a view and ``.to`` returns
it. Its tensors are materialised in the calling thread instead (transformers' own deferred path, as
with ``HF_DEACTIVATE_ASYNC_LOAD``), but only where that thread's torch state is a new thread's
(:func:`state_of_a_new_thread`): a tensor made under the caller's ``torch.inference_mode()`` would
be an inference tensor, where the pool's is not. Measured (fp32 models loaded as fp32, 2 ranks on 2
cores, while its followers waited): a leader's threads switched context about 1,000 times in the
pool's 80-100 ms, and the load took 1.1-1.2x a plain one (500 MB and 1 GB); in the calling thread,
20 times and 0.9-1.0x. One worker thread instead of the pool's two still took 1.17x.
"""

from __future__ import annotations

import threading
from typing import Any, Callable

from ..._patching import Patch
from ...coordination.call import current_mode

__all__ = ["convert_patches", "state_of_a_new_thread"]

_CPU = ("None", "cpu")  # str() of the device transformers passes


def _spawn_materialize(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...],
                       kwargs: dict[str, Any]) -> Any:
    """``transformers.core_model_loading.spawn_materialize``: in the calling thread for a load
    of views (``mode.load.materialise_here``), converting into the arena for a leader's
    converting load."""
    mode = current_mode()
    if mode is not None and mode.load.materialise_here and len(args) == 4:
        return wrapped(None, *args[1:], **kwargs)
    arena = mode.load.arena if mode is not None and mode.lead else None
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


def _torch_state() -> tuple[Any, ...]:
    # What of this thread's torch state a tensor made in it can depend on: grad and inference
    # mode, the dispatch keys it includes and excludes (inference mode, autocast, functorch,
    # no_dispatch, a Python dispatch mode), the torch function and dispatch mode stacks (a
    # default device, a user's mode).
    import torch  # here, not at module level: `import patchload` must not import torch

    C = torch._C
    return (torch.is_grad_enabled(), torch.is_inference_mode_enabled(),
            str(C._dispatch_tls_local_include_set()), str(C._dispatch_tls_local_exclude_set()),
            C._len_torch_function_stack(), C._len_torch_dispatch_stack(),
            C._is_torch_function_enabled())


def state_of_a_new_thread() -> bool:
    """Whether this thread's torch state (grad and inference mode, dispatch keys, mode stacks)
    is a new thread's, as in transformers' loading pool: tensors materialised here are then
    what the pool's would be. False where torch does not expose that state or no thread can
    start (the pool then runs as in a plain load). Not collective; starts one short-lived
    thread."""
    seen: list[tuple[Any, ...]] = []
    try:
        here = _torch_state()
        thread = threading.Thread(target=lambda: seen.append(_torch_state()),
                                  name="patchload-torch-state")
        thread.start()
        thread.join()
    except (AttributeError, RuntimeError):  # a torch without these accessors; no new thread
        return False
    return seen == [here]


def convert_patches() -> list[Patch]:
    """The patch on how a coordinated load materialises checkpoint tensors."""
    return [Patch("transformers.core_model_loading", "spawn_materialize", _spawn_materialize)]
