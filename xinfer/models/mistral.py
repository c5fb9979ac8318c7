"""Mistral: Llama with an optional sliding window on every layer."""
from xinfer.models.llama import LlamaForCausalLM
from xinfer.models.registry import register


class MistralForCausalLM(LlamaForCausalLM):
    def sliding_window(self, cfg, idx):
        return cfg.get("sliding_window")


register("MistralForCausalLM", MistralForCausalLM)
