"""Speculative decoding: which method a server runs, n-gram drafts, and the draft model's checks.

A step verifies a sequence's k drafts with its last token in one forward of k + 1 rows
(ops/speculative.py decides what is accepted). The scheduler reserves the drafts' KV slots
and gives back the rejected ones; the n-gram drafts are proposed here, by the scheduler, which
holds every sequence's tokens; a draft model runs in the worker (xinfer/workers/drafter.py).

MTP heads (a checkpoint's own next-token-prediction layers) propose in the worker too
(xinfer/workers/mtp.py); the families whose heads load are MTP_ARCHITECTURES.
"""
from __future__ import annotations

import numpy as np

from xinfer import hybrid
from xinfer.errors import ModelLoadError

METHODS = ("ngram", "draft", "mtp")
_MTP_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers")
# The families whose MTP heads xinfer loads (xinfer/models/mtp.py): kept here, without importing
# the models, for the scheduler process; tests/test_mtp.py checks each has the head.
MTP_ARCHITECTURES = ("DeepseekV3ForCausalLM", "Glm4MoeForCausalLM", "Glm4MoeLiteForCausalLM")


def has_mtp(model_cfg: dict) -> bool:
    return any(model_cfg.get(k) for k in _MTP_KEYS)


def mtp_supported(model_cfg: dict) -> bool:
    return has_mtp(model_cfg) and any(a in MTP_ARCHITECTURES for a in model_cfg.get("architectures") or [])


def method(config, model_cfg: dict) -> str | None:
    """The method this engine runs, or None when speculation is off. The default: a draft model
    when one is given, else the model's MTP head where it has one xinfer loads, else n-grams."""
    if not config.num_speculative_tokens:
        return None
    if config.speculative_method:
        return config.speculative_method
    if config.draft_model:
        return "draft"
    return "mtp" if mtp_supported(model_cfg) else "ngram"


def check(config, info) -> None:
    """Start-up checks of the speculative settings against the model (and the draft model's files)."""
    hybrid.check(config, info.config)
    m = method(config, info.config)
    if m is None:
        return
    if m == "mtp":
        why = None
        if not has_mtp(info.config):
            why = "the model has no MTP layers"
        elif not mtp_supported(info.config):
            why = (f"its config declares MTP layers, but xinfer does not load MTP heads for "
                   f"{info.config.get('model_type', 'this family')} yet (it does for {', '.join(MTP_ARCHITECTURES)})")
        elif not _has_mtp_weights(info):
            why = "its config declares MTP layers, but the checkpoint has no weights for them"
        if why:
            raise ModelLoadError(f"--speculative-method mtp: {why}; use ngram or --draft-model")
    if m == "draft":
        if not config.draft_model:
            raise ModelLoadError("--speculative-method draft needs --draft-model PATH")
        check_draft(info, config.draft_model)


def check_draft(info, draft: str):
    """The draft model must read and write the target's tokens: the same vocabulary."""
    from xinfer.loader import load_model_info
    dinfo = load_model_info(draft)
    cfg = dinfo.config
    if "dflash_config" in cfg or any("DFlash" in a for a in cfg.get("architectures") or []):
        raise ModelLoadError(f"--draft-model {draft}: DFlash drafts (which read the target's hidden states) "
                             "are not supported; use a standalone model with the target's tokenizer")
    a, b = info.tokenizer, dinfo.tokenizer
    if a is not None and b is not None:
        if a.tok.get_vocab(with_added_tokens=True) != b.tok.get_vocab(with_added_tokens=True):
            raise ModelLoadError(f"--draft-model {draft}: its tokenizer is not the target's "
                                 f"({b.vocab_size} tokens against {a.vocab_size}); a draft must share the vocabulary")
    elif cfg["vocab_size"] != info.config["vocab_size"]:
        raise ModelLoadError(f"--draft-model {draft}: vocab_size {cfg['vocab_size']} is not the target's "
                             f"{info.config['vocab_size']}")
    return dinfo


def _has_mtp_weights(info) -> bool:
    """Whether the checkpoint stores the first MTP depth (its eh_proj, after the decoder's layers):
    some conversions and quantized repacks drop them."""
    n = info.config["num_hidden_layers"]
    if info.kind == "gguf":
        return f"blk.{n}.nextn.eh_proj.weight" in info.gguf.tensor_names
    if info.kind != "hf":
        return True  # random weights
    from safetensors import safe_open

    from xinfer.loader.hf import safetensors_files
    for f in safetensors_files(info.path):
        with safe_open(str(f), "np") as st:
            if f"model.layers.{n}.eh_proj.weight" in st.keys():
                return True
    return False


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def ngram_propose(tokens: list[int], k: int, nmin: int, nmax: int) -> list[int]:
    """Prompt lookup: the tokens that followed the most recent earlier occurrence of the longest
    suffix (nmax down to nmin tokens long) of `tokens`; [] when no suffix occurred before."""
    L = len(tokens)
    if k <= 0 or L <= nmin:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    for n in range(min(nmax, L - 1), nmin - 1, -1):
        # windows starting at i < L - n: each has at least one token after it, before the suffix ends
        win = np.lib.stride_tricks.sliding_window_view(arr[:L - 1], n)
        hits = np.flatnonzero((win == arr[L - n:]).all(axis=1))
        if hits.size:
            i = int(hits[-1]) + n
            return tokens[i:i + k]
    return []
