"""The KV cache's size in bytes and its allocation, one pair of tensors per attention layer."""
from __future__ import annotations

import logging

from pathlib import Path

import numpy as np
import torch

from ops import kv_quant, turbo_quant
from xinfer import hybrid, spec
from xinfer.config import EngineConfig
from xinfer.workers.batch import forward

log = logging.getLogger("xinfer.worker")

CALIBRATION = Path(__file__).resolve().parent.parent / "configs" / "calibration.txt"


def kv_bytes_per_token(cfg: dict, dtype: torch.dtype | str) -> int:
    """`dtype`: the cache's storage dtype or turbo format (kv_quant.storage_dtype); scales included."""
    if cfg.get("kv_lora_rank"):  # MLA: one latent and rotary key per token stand for both K and V
        return cfg["num_hidden_layers"] * kv_quant.head_bytes(cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"], dtype)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    kv_heads = cfg.get("num_key_value_heads") or cfg["num_attention_heads"]
    return 2 * hybrid.num_kv_layers(cfg) * kv_heads * kv_quant.head_bytes(head_dim, dtype)


def kv_block_bytes(config: EngineConfig, cfg: dict, dtype: torch.dtype, draft_cfg: dict | None = None) -> int:
    """`dtype`: the model's (--kvcache-dtype may store K/V in another); `draft_cfg`: a draft model's
    config, whose KV lives in the same blocks."""
    dtype = kv_quant.storage_dtype(config.kvcache_dtype, dtype)
    per_token = kv_bytes_per_token(cfg, dtype) + (kv_bytes_per_token(draft_cfg, dtype) if draft_cfg else 0)
    return per_token * config.block_size


def alloc_kv(model, config: EngineConfig, num_blocks: int, dtype: torch.dtype, backend: str, device: torch.device,
             quiet: bool = False) -> None:
    """Each attention layer's K and V caches [num_blocks, block_size, kv heads, head dim] in
    --kvcache-dtype's storage dtype (`dtype`: the model's)."""
    model_dtype, dtype = dtype, kv_quant.storage_dtype(config.kvcache_dtype, dtype)
    kv_quant.check_backend(config.kvcache_dtype, dtype, model_dtype, backend)
    layers = model.attention_layers()
    a = layers[0]
    shape = (num_blocks, config.block_size, a.num_kv_heads, a.head_dim)
    for layer in layers:
        layer.k_cache = kv_quant.alloc(shape, dtype, device)
        # kv_shared (MLA): the one cached latent is read as both K and V
        shared = getattr(layer, "kv_shared", False)
        layer.v_cache = layer.k_cache if shared else kv_quant.alloc(shape, dtype, device)
    n = sum(1 if getattr(ly, "kv_shared", False) else 2 for ly in layers)
    if not quiet:
        log.info("KV cache: %d blocks of %d tokens, %d tokens in all, %s (%.2f GiB)", num_blocks,
                 config.block_size, num_blocks * config.block_size, str(dtype).removeprefix("torch."),
                 n * np.prod(shape[:-1]) * kv_quant.head_bytes(a.head_dim, dtype) / (1 << 30))


def copy_slots(models, copies: list[tuple[int, int, int]], block_size: int, device) -> None:
    """Before a step, StepPlan.kv_copies: the first n slots of block src into block dst (src, dst,
    n), in every attention layer of `models` (the target's, and a drafter's whose KV the same blocks
    hold)."""
    src = [s * block_size + j for s, d, n in copies if s != d for j in range(n)]
    dst = [d * block_size + j for s, d, n in copies if s != d for j in range(n)]
    if not src:  # its own block back from the free list: the slots hold it already
        return
    src, dst = (torch.tensor(x, dtype=torch.long, device=device) for x in (src, dst))
    for model in models:
        for layer in model.attention_layers():
            kv_quant.copy(layer.k_cache, src, dst)
            if layer.v_cache is not layer.k_cache:  # MLA's one latent cache
                kv_quant.copy(layer.v_cache, src, dst)


@torch.inference_mode()
def calibrate_key_shift(runner, info) -> None:
    """turbo caches store keys less their mean (ops/turbo_quant.py): measured once on a fixed text,
    512 tokens prefilled as 64-token sequences into the empty cache (free again afterwards), so the
    shift does not depend on the cache's size (unless it holds under 64 tokens)."""
    window = min(64, runner.num_blocks * runner.block_size, runner.config.max_model_len or 64)
    if info.tokenizer is not None:
        ids = info.tokenizer.encode(CALIBRATION.read_text())[:512]
    else:  # a folder without a tokenizer: a fixed spread of ids
        ids = [(7919 * i + 13) % runner.vocab_size for i in range(512)]
    blocks = list(range(spec.blocks_needed(window, runner.block_size)))

    def run():
        for start in range(0, len(ids), window):
            forward(runner.model, runner.backend, runner.device, runner.block_size,
                    [(blocks, 0, ids[start:start + window])])
    layers = turbo_quant.calibrate_key_shift(runner.model.attention_layers(), run)
    log.info("turbo KV cache: key shift calibrated for %d layers on %d tokens", layers, len(ids))
