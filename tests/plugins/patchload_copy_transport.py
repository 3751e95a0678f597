"""A weight transport of the tests' own, registered as an installed package would register one
(``tests/plugins/patchload_copy_transport-0.1.dist-info``: an entry point in the group
``patchload.transports``), to show that a new transport is one package plus one registry line.

``copy`` hands every follower a private copy: the node leader serialises its tensors with
safetensors into one key of the job's store; each follower reads that key and loads its own
tensors from the bytes. Nothing is shared, so a follower's memory is a plain rank's; only tiny
models belong in a store. The key stays until the job's store goes (the test's jobs are short).
"""

from __future__ import annotations

from typing import Any, Callable


class CopyWeights:
    """The ``"copy"`` transport (see the module docstring)."""

    name = "copy"
    scope = "node"
    verb = "copied"
    collective = False

    def prepare(self, call: Any, model: Any, state: Any) -> None:
        """Nothing to set up: the leader loads as a plain rank does."""

    def discard(self, model: Any, state: Any) -> None:
        """Nothing was set up."""

    def share(self, call: Any, model: Any, entries: list[list[Any]], tensors: list[Any],
              state: Any) -> tuple[dict[str, Any], Callable[[], None] | None]:
        """Leader: one store key holding every tensor (safetensors bytes, by index)."""
        from safetensors.torch import save

        key = f"plt-copy/{call.key}"
        # clone(): safetensors refuses tensors that share a storage (views of one file mapping).
        call.store.store.set(key, save({str(i): t.detach().clone().contiguous()
                                        for i, t in enumerate(tensors)}))
        return {"key": key, "count": len(tensors)}, None

    def receive(self, call: Any, weights: dict[str, Any],
                state: Any) -> list[Any] | None:
        """Follower: its own tensors, loaded from the leader's bytes."""
        from safetensors.torch import load

        loaded = load(bytes(call.store.store.get(weights["key"])))
        return [loaded[str(i)] for i in range(weights["count"])]

    def abandon(self, call: Any, weights: dict[str, Any], state: Any) -> None:
        """Nothing: the leader waits for no follower."""

    def settle(self, call: Any, model: Any, weights: dict[str, Any], tensors: list[Any]) -> None:
        """Nothing: the follower's tensors are its own."""
