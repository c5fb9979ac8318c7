"""One file per architecture family; importing this package registers them all."""
from xinfer.models import bert, gemma3, glm4, llama, mistral, phi3, qwen2, qwen3, qwen3_moe  # noqa: F401
from xinfer.models.registry import ENCODERS, MODELS, model_class  # noqa: F401
