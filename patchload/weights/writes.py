"""The patches of the two calls that announce writes to loaded weights.

``DistributedDataParallel(module)`` and ``Optimizer.add_param_group`` (every optimizer's
constructor calls it) with parameters that require a gradient first copy the loaded models among
their tensors out of the node's shared copy into private memory of this rank
(:meth:`patchload.transport.mapped_models.MappedModels.before_writes`, whose module docstring
says why and what the copy keeps). The models are the shm transport's, handed in by the caller.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable

from .._logging import get_logger
from .._patching import Patch

if TYPE_CHECKING:
    import torch

    from ..transport.mapped_models import MappedModels

__all__ = ["write_patches"]

logger = get_logger(__name__)


def write_patches(mapped: MappedModels) -> list[Patch]:
    """The patches of the two calls that announce writes to loaded weights, each copying the
    ``mapped`` models among their tensors out first (see the module docstring)."""

    def before_ddp(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...],
                   kwargs: dict[str, Any]) -> Any:
        # DistributedDataParallel.__init__: its broadcast writes every parameter and buffer of
        # the module on ranks other than 0, and training follows.
        module = args[0] if args else kwargs.get("module")
        if mapped and module is not None:
            before_writes(lambda: list(module.parameters()) + list(module.buffers()),
                          "wrapped in DistributedDataParallel")
        return wrapped(*args, **kwargs)

    def after_param_group(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...],
                          kwargs: dict[str, Any]) -> Any:
        # Optimizer.add_param_group: its step will write the group's parameters that require a
        # gradient.
        result = wrapped(*args, **kwargs)
        if mapped:
            before_writes(lambda: [p for p in instance.param_groups[-1]["params"]
                                   if p.requires_grad], f"given to {type(instance).__name__}")
        return result

    def before_writes(tensors: Callable[[], list[torch.Tensor]], why: str) -> None:
        # Never raises into the user's call (an argument the wrapped call itself rejects, say):
        # the model then stays on copy-on-write, with equal values either way.
        try:
            mapped.before_writes(tensors(), why)
        except Exception as err:  # noqa: BLE001
            logger.debug("%s: not copying shared weights out: %s: %s", why, type(err).__name__,
                         err)

    return [Patch("torch.nn.parallel.distributed", "DistributedDataParallel.__init__",
                  before_ddp),
            Patch("torch.optim.optimizer", "Optimizer.add_param_group", after_param_group)]
