"""The wrapper of a model class's ``from_pretrained`` (transformers' or diffusers'): load once.

Unless a reason to step aside applies (:mod:`patchload.weights.policy`), the call is coordinated
with the hooks of a model load: the leader runs the original call and shares the weights
(:mod:`~patchload.weights.share`), followers rerun it and receive them
(:mod:`~patchload.weights.receive`), node-scoped loads through the node leaders
(:mod:`~patchload.weights.hierarchy`). The steps of the call that read checkpoint files are the
library's patches (:mod:`patchload.patches.transformers.modeling`,
:mod:`patchload.patches.diffusers`).
"""

from __future__ import annotations

import contextvars
from typing import Any, Callable

from .._compat import warm_conversions
from .._logging import get_logger
from ..coordination.call import Hooks, coordinated, current_mode
from .hierarchy import NodeLeadersLoad
from .policy import chosen_transport, step_aside_reason
from .receive import abandon_weights, settle_weights
from .share import share_weights

__all__ = ["from_pretrained"]

logger = get_logger(__name__)

# True inside a from_pretrained that runs on every rank at once (collective construction).
_ALONE: contextvars.ContextVar[bool] = contextvars.ContextVar("patchload_alone", default=False)


def from_pretrained(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...],
                    kwargs: dict[str, Any]) -> Any:
    """The wrapt wrapper of a model class's ``from_pretrained`` (transformers or diffusers):
    weights from the node's leader, unless a reason to step aside applies."""
    owner = instance if isinstance(instance, type) else type(instance)
    name = f"{owner.__module__}.{owner.__qualname__}.from_pretrained"
    source = args[0] if args else kwargs.get("pretrained_model_name_or_path")
    what = f"{owner.__name__}.from_pretrained({source!r})"
    mode = current_mode()
    if mode is not None and mode.loads_model:  # e.g. the model class's call inside an Auto call
        return coordinated(name, wrapped, args, kwargs, Hooks(what))
    if _ALONE.get():  # the model class's call inside an Auto call that stepped aside
        return wrapped(*args, **kwargs)
    reason, collective = step_aside_reason(kwargs)
    if reason is not None:
        logger.info("%s: weights not shared (%s): downloads coordinated, each rank loads its own",
                    what, reason)
        if collective:  # every rank runs the call at once; each hub call inside is coordinated
            token = _ALONE.set(True)
            try:
                return wrapped(*args, **kwargs)
            finally:
                _ALONE.reset(token)
        return coordinated(name, wrapped, args, kwargs, Hooks(what))
    chosen = chosen_transport()
    if chosen is not None and chosen.scope == "job":
        return coordinated(name, wrapped, args, kwargs, Hooks(
            what, scope="job", share=share_weights, settle=settle_weights,
            abandon=abandon_weights, idle=warm_conversions))
    return coordinated(name, wrapped, args, kwargs, Hooks(
        what, scope="node", share=share_weights, settle=settle_weights, abandon=abandon_weights,
        idle=warm_conversions, lead_with=NodeLeadersLoad(name, wrapped, what)))
