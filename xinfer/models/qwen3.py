"""Qwen3: Llama with per-head RMSNorm on queries and keys."""
from xinfer.models.llama import LlamaForCausalLM
from xinfer.models.qwen2 import Qwen2ForCausalLM
from xinfer.models.registry import register


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
    sliding_window = Qwen2ForCausalLM.sliding_window


register("Qwen3ForCausalLM", Qwen3ForCausalLM)
