"""transformers' ``from_pretrained`` of everything but model weights: configs, tokenizers,
processors, feature extractors, image and video processors, generation configs and their Auto
classes, wrapped at their ``from_pretrained``, so one call (revision resolution, metadata
requests, every file) runs on the leader and followers rerun it from the cache.

Model classes are patched in :mod:`patchload.patches.transformers.modeling`; transformers' peft
integration (``PeftAdapterMixin.load_adapter``) in :mod:`patchload.patches.peft`.
"""

from __future__ import annotations

from typing import Final

from ..._patching import Patch
from .._wrappers import entry_points

__all__ = ["entry_point_patches"]

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
)


def entry_point_patches() -> list[Patch]:
    """The patches of transformers' non-model ``from_pretrained`` entry points."""
    return entry_points(_ENTRY_POINTS)
