"""Phi-3 / Phi-4: Llama whose checkpoints store qkv_proj and gate_up_proj fused (they load whole),
with LongRoPE scaling (ops/rotary.py), partial rotary (Phi-4-mini) and Phi-3-mini's sliding window."""
from xinfer.models.llama import LlamaForCausalLM
from xinfer.models.registry import register


class Phi3ForCausalLM(LlamaForCausalLM):
    def sliding_window(self, cfg, idx):
        return cfg.get("sliding_window") or None


register("Phi3ForCausalLM", Phi3ForCausalLM)
