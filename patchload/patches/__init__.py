"""The registry of patches: one module per library, one line per list of patches here.

Each :class:`LibraryPatches` line names a library's top-level package, the function returning
its patches (:class:`patchload._patching.Patch` objects, landed now or when the library is
imported) and what the layers below need to know of the library: the packages a follower may
import to rebuild its leader's exception, the argument names that name what a call loads from,
and the ``from_pretrained`` keyword arguments under which weights are not shared.
:func:`all_patches` returns every line's patches in registry order, which is the install order;
:func:`library_facts` the union of the facts, which :func:`patchload.install` hands down
(:mod:`patchload._libraries`: the lower layers may not import this package).

A library may have several lines, where its patches land at several points of the install order
(the order of the golden lists in ``tests/golden/patches*.txt``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Final

from .._libraries import LibraryFacts
from ..coordination.call import context_patches
from ..coordination.rank0 import collective_patches
from .datasets import datasets_patches
from .datasets_map import map_patches
from .diffusers import diffusers_patches, pipeline_patches
from .evaluate import evaluate_patches
from .hub import hub_patches
from .hub_api import hub_api_patches
from .peft import peft_patches
from .sentence_transformers import sentence_transformers_patches
from .transformers.entry_points import entry_point_patches
from .transformers.materialize import convert_patches
from .transformers.modeling import load_patches
from .transformers.remote_code import dynamic_module_patches

if TYPE_CHECKING:
    from .._patching import Patch

__all__ = ["LibraryPatches", "LIBRARIES", "all_patches", "library_facts"]


@dataclass(frozen=True)
class LibraryPatches:
    """The patches of one library (or one part of them), and what the layers below need to know
    of it.

    Attributes:
        package: the library's top-level import name, e.g. ``datasets``.
        patches: returns the library's patches; importing the library is left to the patches'
            post-import hooks (building them imports nothing).
        importable: top-level packages whose exceptions the library's patched calls raise: a
            follower that has not imported the module of its leader's exception class may
            import it from these (:mod:`patchload._errors`). Only these: nothing else named by
            the store is imported.
        source_names: argument names that name what a call loads from (a repo id or a local
            path): part of the call's key as a path (:mod:`patchload.coordination.key`), and
            named in messages.
        unsafe_kwargs: ``from_pretrained`` keyword arguments under which a model load does not
            share its weights (:mod:`patchload.weights.policy`).
    """

    package: str
    patches: Callable[[], list[Patch]]
    importable: tuple[str, ...] = ()
    source_names: tuple[str, ...] = ()
    unsafe_kwargs: tuple[str, ...] = ()


LIBRARIES: Final = (
    # hf_hub_download, snapshot_download, revision resolution; the HTTP clients it raises from.
    LibraryPatches(package="huggingface_hub", patches=hub_patches,
                   importable=("huggingface_hub", "httpx", "requests", "urllib3")),
    # Configs, tokenizers, processors, ...: every from_pretrained but a model's.
    LibraryPatches(package="transformers", patches=entry_point_patches,
                   importable=("transformers", "safetensors", "tokenizers"),
                   source_names=("pretrained_model_name_or_path",)),
    LibraryPatches(package="sentence_transformers", patches=sentence_transformers_patches,
                   importable=("sentence_transformers",), source_names=("model_name_or_path",)),
    # A pipeline's download and schedulers (its models: below).
    LibraryPatches(package="diffusers", patches=pipeline_patches),
    # Adapters and their configs, also through transformers' PeftAdapterMixin.
    LibraryPatches(package="peft", patches=peft_patches,
                   source_names=("model_id", "peft_model_id")),
    # trust_remote_code module files.
    LibraryPatches(package="transformers", patches=dynamic_module_patches),
    # PreTrainedModel.from_pretrained (and, first, torch's DDP / optimizer write announcements).
    LibraryPatches(package="transformers", patches=load_patches,
                   unsafe_kwargs=("quantization_config", "gguf_file", "tp_plan", "tp_size",
                                  "distributed_config", "device_mesh", "state_dict",
                                  "load_in_8bit", "load_in_4bit", "offload_folder",
                                  "key_mapping")),
    # Where a converting load's tensors are made.
    LibraryPatches(package="transformers", patches=convert_patches),
    # ModelMixin.from_pretrained and its checkpoint-reading steps.
    LibraryPatches(package="diffusers", patches=diffusers_patches,
                   unsafe_kwargs=("parallel_config", "use_flashpack", "dduf_entries")),
    # ThreadPoolExecutor.submit: a coordinated call's context carried into its worker threads.
    LibraryPatches(package="concurrent", patches=context_patches),
    # torch.distributed's collectives outside a coordinated call.
    LibraryPatches(package="torch", patches=collective_patches, importable=("torch",)),
    # HfApi's metadata calls (model_info, list_repo_tree, ...) made by user code.
    LibraryPatches(package="huggingface_hub", patches=hub_api_patches),
    LibraryPatches(package="datasets", patches=datasets_patches, importable=("datasets",)),
    # datasets' Dataset.map: a module of its own (load_dataset's HTTP record is another job).
    LibraryPatches(package="datasets", patches=map_patches),
    # evaluate's module fetch (evaluate.load): its requests go through `requests`, not httpx.
    LibraryPatches(package="evaluate", patches=evaluate_patches),
)


def all_patches() -> list[Patch]:
    """Every registered library's patches, in registry order (the install order)."""
    return [patch for library in LIBRARIES for patch in library.patches()]


def library_facts() -> LibraryFacts:
    """The union of the registered libraries' facts (first appearance order for the tuples)."""
    def union(field: str) -> tuple[str, ...]:
        return tuple(dict.fromkeys(name for library in LIBRARIES
                                   for name in getattr(library, field)))

    return LibraryFacts(importable=frozenset(union("importable")),
                        source_names=union("source_names"), unsafe_kwargs=union("unsafe_kwargs"))
