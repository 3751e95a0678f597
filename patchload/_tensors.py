"""A loaded model's tensors by name: the entries published with its weights, and re-pointing.

An entry is ``[name, kind, index, requires_grad]``: every parameter and buffer name (tied ones
included, ``remove_duplicate=False``), ``kind`` ``"param"`` or ``"buffer"``, and the index of its
tensor among the model's unique tensors (tied names share one index).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["named_tensors", "entries_of", "owner", "repoint"]


def named_tensors(model: Any) -> list[tuple[str, torch.Tensor]]:
    """Every ``(name, tensor)`` of the model's parameters, then buffers, ties included."""
    return (list(model.named_parameters(remove_duplicate=False))
            + list(model.named_buffers(remove_duplicate=False)))


def entries_of(model: Any) -> tuple[list[list[Any]], list[torch.Tensor]]:
    """The model's entries (see the module docstring) and its unique tensors, in index order."""
    index_of: dict[int, int] = {}
    unique: list[torch.Tensor] = []
    entries: list[list[Any]] = []
    for kind, named in (("param", model.named_parameters(remove_duplicate=False)),
                        ("buffer", model.named_buffers(remove_duplicate=False))):
        for name, tensor in named:
            if id(tensor) not in index_of:
                index_of[id(tensor)] = len(unique)
                unique.append(tensor)
            entries.append([name, kind, index_of[id(tensor)], bool(tensor.requires_grad)])
    return entries, unique


def owner(model: Any, name: str) -> tuple[Any, str]:
    """The submodule holding the parameter or buffer ``name``, and its attribute name there."""
    module_path, _, attribute = name.rpartition(".")
    return (model.get_submodule(module_path) if module_path else model), attribute


def repoint(model: Any, entries: list[list[Any]], index: int, tensor: torch.Tensor) -> None:
    """Make the model's own tensor ``index`` use ``tensor``'s bytes (equal values): a parameter
    keeps its object (``.data``), a buffer is replaced under every name it has."""
    for name, kind, i, _ in entries:
        if i != index:
            continue
        module, attribute = owner(model, name)
        if kind == "param":
            module._parameters[attribute].data = tensor
            return  # one Parameter object serves every tied name
        module._buffers[attribute] = tensor
