"""Patches for hub downloads and for the ``from_pretrained`` of everything but model weights.

Also ``sentence_transformers``' model constructors (``SentenceTransformer``, ``CrossEncoder``,
``SparseEncoder``), whose followers then pass ``local_files_only=True``: they skip the hub's
``model_info`` call, so their model card does not name a base model (its ``local_files_only``,
which decides what a later save asks the hub, is the caller's again: :func:`_card_as_asked`).
Likewise diffusers' ``DiffusionPipeline.download`` (all of a pipeline's ``from_pretrained`` requests: the leader
makes the one snapshot download; followers skip ``model_info``) and scheduler
``from_pretrained``, and peft's
``PeftModel.from_pretrained``, ``load_adapter`` (also transformers' ``PeftAdapterMixin``),
``AutoPeftModel*.from_pretrained`` and ``PeftConfig.from_pretrained``.

``huggingface_hub``'s metadata calls (``file_exists``, ``model_info``, ...) are patched in
:mod:`patchload.patches.hub_api`.

``huggingface_hub.hf_hub_download`` and ``snapshot_download`` are wrapped where they are defined
and rebound wherever a module already imported them by name (``transformers.utils.hub``,
``huggingface_hub._snapshot_download``, ``huggingface_hub.repocard``, ...). Configs, tokenizers,
processors, feature extractors, image and video processors, generation configs and the Auto
classes are wrapped at their ``from_pretrained``, so one call (revision resolution, metadata
requests, every file) runs on the leader and followers rerun it from the cache.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Final

from .coordination.call import Hooks, coordinated
from ._patching import Patch

__all__ = ["hub_patches"]

# (module, attribute path) of every from_pretrained that fetches files but no weights.
_ENTRY_POINTS: Final = (
    ("transformers.configuration_utils", "PreTrainedConfig.from_pretrained"),
    ("transformers.configuration_utils", "PretrainedConfig.from_pretrained"),
    ("transformers.models.auto.configuration_auto", "AutoConfig.from_pretrained"),
    ("transformers.tokenization_utils_base", "PreTrainedTokenizerBase.from_pretrained"),
    ("transformers.models.auto.tokenization_auto", "AutoTokenizer.from_pretrained"),
    ("transformers.processing_utils", "ProcessorMixin.from_pretrained"),
    ("transformers.models.auto.processing_auto", "AutoProcessor.from_pretrained"),
    ("transformers.feature_extraction_utils", "FeatureExtractionMixin.from_pretrained"),
    ("transformers.models.auto.feature_extraction_auto", "AutoFeatureExtractor.from_pretrained"),
    ("transformers.image_processing_base", "ImageProcessingMixin.from_pretrained"),
    ("transformers.models.auto.image_processing_auto", "AutoImageProcessor.from_pretrained"),
    ("transformers.video_processing_utils", "BaseVideoProcessor.from_pretrained"),
    ("transformers.models.auto.video_processing_auto", "AutoVideoProcessor.from_pretrained"),
    ("transformers.generation.configuration_utils", "GenerationConfig.from_pretrained"),
    # Fetches modules.json and friends, and (unless local_files_only) the hub's model_info.
    ("sentence_transformers.base.model", "BaseModel.__init__"),
    # model_info, model_index.json, one snapshot_download: every request of a pipeline's
    # from_pretrained. Not from_pretrained itself: its followers would only start loading the
    # components once the leader had loaded them all, too late to join a collective broadcast.
    ("diffusers.pipelines.pipeline_utils", "DiffusionPipeline.download"),
    ("diffusers.schedulers.scheduling_utils", "SchedulerMixin.from_pretrained"),
    ("peft.config", "PeftConfigMixin.from_pretrained"),
    ("peft.peft_model", "PeftModel.from_pretrained"),
    ("peft.peft_model", "PeftModel.load_adapter"),
    # The adapter config, the base model (its weights shared on their own), a file_exists
    # check for a tokenizer, then PeftModel.from_pretrained.
    ("peft.auto", "_BaseAutoPeftModel.from_pretrained"),
)
# Entry points whose followers must not get local_files_only=True (see coordinated()).
_REJECTING_OFFLINE_KWARG: Final = (
    ("transformers.integrations.peft", "PeftAdapterMixin.load_adapter"),
)


_SOURCE_NAMES: Final = ("pretrained_model_name_or_path", "model_name_or_path", "model_id",
                        "peft_model_id")


def _first(args: tuple[Any, ...], kwargs: dict[str, Any], name: str, index: int) -> Any:
    return kwargs[name] if name in kwargs else (args[index] if len(args) > index else None)


def _hub_function(name: str) -> Callable[..., Any]:
    def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> Any:
        repo = _first(args, kwargs, "repo_id", 0)
        filename = _first(args, kwargs, "filename", 1) if name == "hf_hub_download" else None
        what = f"{name}({repo!r}" + (f", {filename!r})" if filename else ")")
        return coordinated(name, wrapped, args, kwargs, Hooks(what))

    return wrapper


def _source(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    """The repo id or path a call loads from, for messages: the first string or path argument
    (``PeftModel.from_pretrained`` takes the base model first)."""
    for value in (*args, *(kwargs.get(name) for name in _SOURCE_NAMES)):
        if isinstance(value, (str, os.PathLike)):
            return value
    return None


def _card_as_asked(instance: Any, kwargs: dict[str, Any]) -> Callable[[Any, Any], Any]:
    """A follower's ``settle`` for a sentence-transformers model: the model card it built
    (unless the caller gave one) records the ``local_files_only`` the caller asked for, not the
    follower's True (it decides what a later save looks up on the hub: datasets, base model)."""
    def settle(result: Any, mode: Any) -> Any:
        card = getattr(instance, "model_card_data", None)
        if (kwargs.get("model_card_data") is None and not mode.asked_offline
                and getattr(card, "local_files_only", None) is True):
            card.local_files_only = False
        return result

    return settle


def _entry_point(*, offline_kwarg: bool) -> Callable[..., Any]:
    def wrapper(wrapped: Callable[..., Any], instance: Any, args: tuple[Any, ...],
                kwargs: dict[str, Any]) -> Any:
        owner = instance if isinstance(instance, type) else type(instance)
        name = f"{owner.__module__}.{owner.__qualname__}.{wrapped.__name__}"
        settle = None
        if wrapped.__name__ == "__init__" and owner.__module__.startswith("sentence_transformers"):
            settle = _card_as_asked(instance, kwargs)
        what = f"{owner.__name__}.{wrapped.__name__}({_source(args, kwargs)!r})"
        return coordinated(name, wrapped, args, kwargs,
                           Hooks(what, settle=settle, offline_kwarg=offline_kwarg))

    return wrapper


def hub_patches() -> list[Patch]:
    """The patches for hub functions and non-model ``from_pretrained`` entry points."""
    patches = [
        Patch("huggingface_hub.file_download", "hf_hub_download",
              _hub_function("hf_hub_download"), rebind_aliases=True),
        Patch("huggingface_hub._snapshot_download", "snapshot_download",
              _hub_function("snapshot_download"), rebind_aliases=True),
        # transformers >= 5.2x resolves the revision (GET /api/models/<repo>) before any file:
        # inside a node leader of a job-scoped download it must be coordinated like the files.
        Patch("huggingface_hub.hf_api", "HfApi.resolve_revision",
              _hub_function("resolve_revision")),
        # The same, bound to hf_api's module-level HfApi at import, imported by name (diffusers).
        Patch("huggingface_hub.hf_api", "resolve_revision", _hub_function("resolve_revision"),
              rebind_aliases=True),
    ]
    patches += [Patch(module, path, _entry_point(offline_kwarg=True))
                for module, path in _ENTRY_POINTS]
    patches += [Patch(module, path, _entry_point(offline_kwarg=False))
                for module, path in _REJECTING_OFFLINE_KWARG]
    return patches
