"""One file per architecture family; importing this package registers them all."""
from xinfer.models import (  # noqa: F401
    bert, deepseek_v3, gemma3, gemma3_vision, glm4, glm4_moe, llama, mistral, mistral3, phi3, qwen2, qwen3, qwen3_5,
    qwen3_moe, qwen3_next, qwen3_vl)
from xinfer.models.registry import ENCODERS, MODELS, model_class  # noqa: F401
