"""Image preprocessing per vision-language family, as its Hugging Face image processor does it:
the API process resizes (Pillow) and expands each image's placeholder into its tokens; the
worker normalises and patchifies (numpy) before the encoder. No torch here: the API imports it."""
from __future__ import annotations

from xinfer.mm.base import ImageProcessor
from xinfer.mm.qwen_vl import QwenVLProcessor

PROCESSORS: dict[str, type[ImageProcessor]] = {
    "Qwen3VLForConditionalGeneration": QwenVLProcessor,
    "Qwen3VLMoeForConditionalGeneration": QwenVLProcessor,
}


def processor_for(cfg: dict) -> ImageProcessor | None:
    """The model's image processor; None for a model that takes no images (text only)."""
    mm = cfg.get("_mm") or {}
    if not mm.get("vision_config"):
        return None
    for arch in cfg.get("architectures") or []:
        if arch in PROCESSORS:
            return PROCESSORS[arch](cfg)
    return None
