"""Whether a model load shares its weights, and through which transport.

Steps aside (downloads still coordinated, weights loaded plainly, one INFO line says why) where a
broadcast is unsafe or pointless: ``PATCHLOAD_BROADCAST=0``, DeepSpeed ZeRO-3, a ``device_map``
other than the CPU, quantized loads, tensor parallelism, GGUF files, a user ``state_dict``
(transformers' and diffusers' ``from_pretrained`` keyword arguments alike: the registry's
:attr:`patchload._libraries.LibraryFacts.unsafe_kwargs`). No I/O.
"""

from __future__ import annotations

from typing import Any, Final

from .. import _state
from .._errors import ConfigError
from .._libraries import facts
from ..coordination.protocol import Call
from ..transport.registry import transports

__all__ = ["chosen_transport", "step_aside_reason", "transport_of"]

# from_pretrained keyword arguments under which building the model runs collectives on every
# rank: the call cannot run on a leader first (its collectives would wait for followers that
# wait for it).
_COLLECTIVE_KWARGS: Final = ("tp_plan", "tp_size", "distributed_config", "device_mesh")
_CPU_MAPS: Final = (None, "cpu", {"": "cpu"})


def step_aside_reason(kwargs: dict[str, Any]) -> tuple[str | None, bool]:
    """Why weights are not shared for this call (None: they are), and whether building the
    model runs collectives (then every rank runs the call at once; only its downloads are
    coordinated, one hub call at a time)."""
    try:
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled
    except ImportError:  # transformers moved it: ZeRO-3 cannot be on
        is_deepspeed_zero3_enabled = None
    if is_deepspeed_zero3_enabled is not None and is_deepspeed_zero3_enabled():
        return "DeepSpeed ZeRO-3 is enabled (model construction runs collectives)", True
    for name in _COLLECTIVE_KWARGS:
        if kwargs.get(name) is not None:
            return f"{name} is set (model construction runs collectives)", True
    if not _state.config().broadcast:
        return "PATCHLOAD_BROADCAST=0", False
    # from_pretrained keyword arguments under which patchload does not share weights: those the
    # patch registry gives (``LibraryFacts.unsafe_kwargs``, handed down by install()).
    for name in facts().unsafe_kwargs:
        value = kwargs.get(name)
        if value is not None and value is not False:  # diffusers passes use_flashpack=False
            return f"{name} is set", False
    device_map = kwargs.get("device_map")
    if str(device_map) not in {str(m) for m in _CPU_MAPS}:
        return f"device_map={device_map!r} is not the CPU", False
    return None, False


def chosen_transport() -> Any:
    """The transport ``PATCHLOAD_TRANSPORT`` names (None: ``auto``).

    Raises:
        ConfigError: no transport is registered under that name (a package removed since the
            variable was read).
    """
    name = _state.config().transport
    if name == "auto":
        return None
    transport = transports().get(name)
    if transport is None:
        from .._topology import current_topology

        raise ConfigError("PATCHLOAD_TRANSPORT", name,
                          " / ".join(("auto", *transports().names())),
                          rank=current_topology().rank)
    return transport


def transport_of(call: Call) -> Any:
    """The transport of a load call: the one ``PATCHLOAD_TRANSPORT`` names where its scope is
    the call's; else a job-scope load is a broadcast (to every rank, or to the other nodes'
    leaders) and a node-scope one shares memory."""
    chosen = chosen_transport()
    if chosen is not None and chosen.scope == call.scope:
        return chosen
    return transports().get("collective" if call.scope == "job" else "shm")
