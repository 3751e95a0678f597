"""Leader: share a loaded model's weights through its load's transport.

The leader ran the original call; every parameter and buffer (persistent or not) of the model it
returned goes to the transport (the Protocol of :mod:`patchload.transport.base`: shared memory
inside a node, a broadcast across nodes), described for the followers (entries, class, headers,
loading info, conversions, dtype plan, inference and "loaded" marks) in the published payload.
Unless the load was zero-copy (followers map the checkpoint files themselves) or the model cannot
be shared as it is (quantized, off the CPU, keys a follower initialises itself).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from .._compat import initialized_by_follower
from .._logging import get_logger
from ..coordination.call import Mode
from ..coordination.protocol import Call
from ..transport.tensors import entries_of
from .policy import transport_of

if TYPE_CHECKING:
    import torch

__all__ = ["model_of", "share_weights"]

logger = get_logger(__name__)


def model_of(result: Any) -> torch.nn.Module | None:
    """The model a ``from_pretrained`` returned (transformers or diffusers, with or without
    ``output_loading_info``), or None."""
    import torch

    model = result[0] if isinstance(result, tuple) and result else result
    return model if isinstance(model, torch.nn.Module) else None


def _post_load_reason(model: torch.nn.Module, entries: list[list[Any]],
                      unique: list[torch.Tensor]) -> str | None:
    if getattr(model, "hf_quantizer", None) is not None or getattr(
            model.config, "quantization_config", None) is not None:
        return "the checkpoint is quantized"
    for index, tensor in enumerate(unique):
        if tensor.device.type != "cpu":
            name = next(e[0] for e in entries if e[2] == index)
            return f"{name} is on {tensor.device}, not the CPU"
    return None


def share_weights(result: Any, call: Call, mode: Mode
           ) -> tuple[dict[str, Any], Callable[[], None] | None]:
    """Leader: share the loaded model's tensors; returns the payload and a post-publish step."""
    model = model_of(result)
    if model is None:
        return {}, None
    transport = transport_of(call)
    if mode.load.alongside:
        transport.discard(model, mode.load)
        logger.info("%s: not sharing weights: a zero-copy load, followers map the checkpoint "
                    "files themselves", call.prefix())
        return {"weights": None, "reason": "followers map the checkpoint files"}, None
    entries, unique = entries_of(model)
    reason = _post_load_reason(model, entries, unique)
    if reason is None and initialized_by_follower(mode.load.loading_info or {}) is None:
        reason = "keys missing from the checkpoint are initialised inside the step followers skip"
    if reason is not None:
        unique.clear()  # discarding re-points them; no reference may outlive that here
        transport.discard(model, mode.load)
        logger.info("%s: not sharing weights: %s; followers load them plainly",
                    call.prefix(), reason)
        return {"weights": None, "reason": reason}, None
    info = {"entries": entries, "class": f"{type(model).__module__}.{type(model).__qualname__}",
            "headers": mode.load.headers,
            "loading_info": mode.load.loading_info, "transport": transport.name,
            "conversions": mode.load.conversions, "dtype_plan": mode.load.dtype_plan,
            # Inference tensors (made inside torch.inference_mode() on the loading thread):
            # followers make theirs so too.
            "inference": [i for i, t in enumerate(unique) if t.is_inference()],
            # transformers' "loaded" mark, where the leader's tensors carry it (followers mark
            # every tensor they receive while loading, then set these).
            "marked": {str(i): t._is_hf_initialized for i, t in enumerate(unique)
                       if hasattr(t, "_is_hf_initialized")}}
    try:
        payload, after = transport.share(call, model, entries, unique, mode.load)
    except BaseException:
        transport.discard(model, mode.load)
        raise
    info.update(payload)
    return {"weights": info}, after
