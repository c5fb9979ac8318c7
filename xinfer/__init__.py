"""xinfer: an LLM inference and serving engine."""
from xinfer.config import EngineConfig
from xinfer.engine import Delta, Engine, RequestOutput
from xinfer.errors import InvalidRequestError, ModelLoadError, XinferError
from xinfer.sampling_params import SamplingParams

__all__ = ["Engine", "EngineConfig", "SamplingParams", "RequestOutput", "Delta",
           "XinferError", "ModelLoadError", "InvalidRequestError"]
__version__ = "0.1.0"
