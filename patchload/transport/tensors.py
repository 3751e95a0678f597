"""A loaded model's tensors by name: the entries published with its weights, and re-pointing.

An entry is ``[name, kind, index, requires_grad]``: every parameter and buffer name (tied ones
included, ``remove_duplicate=False``), ``kind`` ``"param"`` or ``"buffer"``, and the index of its
tensor among the model's unique tensors (tied names share one index).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["named_tensors", "entries_of", "Owners", "Repoint"]


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


class Owners:
    """Finds the submodule holding a parameter or buffer by its dotted name, as
    ``Module.get_submodule`` does, from one walk of the model's modules (a model has hundreds of
    tensors; resolving each name attribute by attribute costs milliseconds on the load's critical
    path). Built per use: a later step of the load may replace submodules."""

    def __init__(self, model: Any) -> None:
        self._model = model
        self._modules = dict(model.named_modules(remove_duplicate=False))

    def __call__(self, name: str) -> tuple[Any, str]:
        """The submodule holding ``name`` and its attribute name there."""
        module_path, _, attribute = name.rpartition(".")
        module = self._modules.get(module_path)
        if module is None:  # not reached by named_modules' walk: resolve it as torch does
            module = self._model.get_submodule(module_path)
        return module, attribute


class Repoint:
    """Makes the model's own tensor ``index`` (of ``entries``) use another tensor's bytes (equal
    values): a parameter keeps its object (``.data``), a buffer is replaced under every name it
    has. Built once per share, called once per tensor."""

    def __init__(self, model: Any, entries: list[list[Any]]) -> None:
        self._owner = Owners(model)
        self._names: dict[int, list[tuple[str, str]]] = {}
        for name, kind, index, _ in entries:
            self._names.setdefault(index, []).append((name, kind))

    def __call__(self, index: int, tensor: torch.Tensor) -> None:
        for name, kind in self._names.get(index, ()):
            module, attribute = self._owner(name)
            if kind == "param":
                module._parameters[attribute].data = tensor
                return  # one Parameter object serves every tied name
            old = module._buffers[attribute]
            if old is not None and hasattr(old, "_is_hf_initialized"):  # transformers' mark
                tensor._is_hf_initialized = old._is_hf_initialized
            module._buffers[attribute] = tensor
