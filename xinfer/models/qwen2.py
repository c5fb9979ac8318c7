"""Qwen2: Llama with biases on the Q/K/V projections."""
from xinfer.models.layers import Attention
from xinfer.models.llama import LlamaForCausalLM
from xinfer.models.registry import register


class Qwen2ForCausalLM(LlamaForCausalLM):
    def sliding_window(self, cfg, idx):
        # Qwen2 applies its window only to layers past max_window_layers, and only when enabled.
        if cfg.get("use_sliding_window") and idx >= cfg.get("max_window_layers", 0):
            return cfg.get("sliding_window")
        return None

    def make_attention(self, cfg, idx):
        return Attention(cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], self.head_dim,
                         self.make_rotary(cfg, idx), qkv_bias=True, sliding_window=self.sliding_window(cfg, idx))


register("Qwen2ForCausalLM", Qwen2ForCausalLM)
