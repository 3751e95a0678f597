"""torch's random-number state around a coordinated call: what a follower restores, and what it
takes from a leader whose call failed.

A plain rank draws random numbers while it builds a model (the weights a checkpoint does not
hold). A follower that runs its own part of the call draws the same; one that raises its
leader's error without running that part (it never built the model) would not. So a leader
whose call fails publishes, with its error, the state it started from (a digest) and the state
it ended in; a follower that started from the same state takes the end state, as its plain call
would have drawn the same numbers (same code, same seed). A follower seeded otherwise keeps its
own state.
"""

from __future__ import annotations

import base64
import hashlib
import sys
from typing import Any

__all__ = ["failure_state", "set_state", "state", "take_leaders"]


def state() -> Any:
    """torch's random-number state: the CPU generator's (a uint8 tensor of 5056 bytes), and
    every CUDA device's once CUDA is initialised (a load with ``device_map`` draws there); None
    without torch imported."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    return torch.random.get_rng_state(), cuda


def set_state(saved: Any) -> None:
    """Restore a :func:`state`."""
    if saved is not None:
        import torch

        cpu, cuda = saved
        torch.random.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


def _digest(saved: Any) -> str:
    cpu, cuda = saved
    sha = hashlib.sha256(cpu.numpy().tobytes())
    for device in cuda or ():
        sha.update(device.numpy().tobytes())
    return sha.hexdigest()


def failure_state(before: Any) -> dict[str, Any] | None:
    """On a leader whose call raised: JSON of the state it started from (``before``, a digest)
    and the state it ends in (base64 of each generator's bytes), about 7 KB; None without torch
    or without CUDA states to compare (a device initialised during the call)."""
    after = state()
    if before is None or after is None or (before[1] is None) != (after[1] is None):
        return None

    def encoded(tensor: Any) -> str:
        return base64.b64encode(tensor.numpy().tobytes()).decode("ascii")

    cpu, cuda = after
    return {"before": _digest(before), "cpu": encoded(cpu),
            "cuda": None if cuda is None else [encoded(device) for device in cuda]}


def take_leaders(published: dict[str, Any] | None, start: Any) -> bool:
    """On a follower raising its leader's error: where this rank started the call from the
    leader's state (``start``), take the state the leader's call ended in (``published``, from
    :func:`failure_state`). Returns whether it did. Never raises."""
    if not published or start is None:
        return False
    try:
        if (start[1] is None) != (published.get("cuda") is None) \
                or _digest(start) != published["before"]:
            return False
        import torch

        def decoded(text: str) -> Any:
            return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)

        cuda = published.get("cuda")
        set_state((decoded(published["cpu"]),
                   None if cuda is None else [decoded(device) for device in cuda]))
        return True
    except Exception:  # noqa: BLE001 - a malformed record: this rank keeps its own state
        return False
