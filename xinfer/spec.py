"""Speculative decoding: which method a server runs, n-gram drafts, and the draft model's checks.

A step verifies a sequence's k drafts with its last token in one forward of k + 1 rows
(ops/speculative.py decides what is accepted). The scheduler reserves the drafts' KV slots
and gives back the rejected ones; the n-gram drafts are proposed here, by the scheduler, which
holds every sequence's tokens; a draft model runs in the worker (xinfer/workers/drafter.py).

MTP heads: no family xinfer loads carries them yet (DeepSeek-V3 `num_nextn_predict_layers`,
Qwen3.5 / Qwen3-Next `mtp_num_hidden_layers`). Adding them is one proposer in the worker,
like the Drafter, fed the target's last hidden states; the verification side is shared.
"""
from __future__ import annotations

import numpy as np

from xinfer.errors import ModelLoadError

METHODS = ("ngram", "draft", "mtp")
_MTP_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers")


def has_mtp(model_cfg: dict) -> bool:
    return any(model_cfg.get(k) for k in _MTP_KEYS)


def method(config, model_cfg: dict) -> str | None:
    """The method this engine runs, or None when speculation is off."""
    if not config.num_speculative_tokens:
        return None
    if config.speculative_method:
        return config.speculative_method
    return "draft" if config.draft_model else "ngram"


def check(config, info) -> None:
    """Start-up checks of the speculative settings against the model (and the draft model's files)."""
    m = method(config, info.config)
    if m is None:
        return
    if m == "mtp":
        why = ("its config declares MTP layers, but xinfer does not load MTP heads for "
               f"{info.config.get('model_type', 'this family')} yet" if has_mtp(info.config)
               else "the model has no MTP layers")
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
