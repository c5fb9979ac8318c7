"""Image preprocessing per vision-language family, as its Hugging Face image processor does it:
the API process resizes (Pillow) and expands each image's placeholder into its tokens; the
worker normalises and patchifies (numpy) before the encoder. No torch here: the API imports it."""
from __future__ import annotations

from xinfer.mm.base import ImageProcessor
from xinfer.mm.gemma3 import Gemma3Processor
from xinfer.mm.pixtral import PixtralProcessor
from xinfer.mm.qwen_vl import QwenVLProcessor

PROCESSORS: dict[str, type[ImageProcessor]] = {
    "Qwen3VLForConditionalGeneration": QwenVLProcessor,
    "Qwen3VLMoeForConditionalGeneration": QwenVLProcessor,
    "Gemma3ForConditionalGeneration": Gemma3Processor,
    "Mistral3ForConditionalGeneration": PixtralProcessor,
}


def processor_for(cfg: dict, tok=None) -> ImageProcessor | None:
    """The model's image processor; None for a model that takes no images (text only). `tok`: its
    Tokenizer, which Gemma 3 and Mistral 3 read their image-framing tokens from."""
    mm = cfg.get("_mm") or {}
    if not mm.get("vision_config"):
        return None
    for arch in cfg.get("architectures") or []:
        if arch in PROCESSORS:
            return PROCESSORS[arch](cfg, tok)
    return None
