"""GGUF (llama.cpp) checkpoints: an HF-style config, HF-named float32 tensors and a tokenizer.

The file is memory-mapped (xinfer/loader/gguf_file.py); tensors are dequantized one at a time, with
what llama.cpp's convert_hf_to_gguf.py changed undone (llama Q/K row permutation, Gemma's
norm offset), so they equal the original Hugging Face weights up to quantization error.
"""
from __future__ import annotations

import logging
import os
import re
from typing import TYPE_CHECKING, Iterator

import numpy as np
from gguf import TokenType
from gguf.quants import dequantize
from tokenizers import Tokenizer, processors

from xinfer.errors import ModelLoadError
from xinfer.loader import gguf_hybrid
from xinfer.loader.gguf_arch import (ARCH_BLOCK_TENSORS, ARCHITECTURES, BLOCK_TENSORS, EXPERT_TENSORS, GLOBAL_TENSORS,
                                     WHOLE_TENSORS, arch_config)
from ops.block_types import BLOCK_TYPES
from xinfer.loader.gguf_file import GGUFFile
from xinfer.loader.lazy import Lazy
from xinfer.loader.gguf_tokenizer import add_special_tokens, byte_level_tokenizer, sentencepiece_tokenizer

if TYPE_CHECKING:
    import torch

log = logging.getLogger("xinfer.loader.gguf")

# nextn: an MTP depth's own; no suffix: a whole tensor (the hybrids' ssm_a)
_BLOCK_RE = re.compile(r"blk\.(\d+)\.((?:nextn\.)?\w+)(?:\.(weight|bias))?")
_GLOBAL_RE = re.compile(r"(\w+)\.(weight|bias)")

# From llama.cpp's llama-vocab.cpp, which treats these as end of generation whatever the file says.
_END_OF_TURN_TOKENS = {"<|eot_id|>", "<|eom_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>",
                       "<EOT>", "<end_of_utterance>", "<|return|>", "<|call|>"}
_REQUIRED = object()


class GGUFModel:
    def __init__(self, path: str):
        self.path = path
        self._reader = _open_reader(path)
        arch = self._meta("general.architecture")
        if arch not in ARCHITECTURES:
            raise ModelLoadError(f"GGUF file {path} has unsupported architecture {arch!r}; "
                                 f"supported: {', '.join(ARCHITECTURES)}")
        self.arch = arch
        self.config = self._build_config()
        self.bos_token_id = self._meta("tokenizer.ggml.bos_token_id", None)
        self.eos_token_id = self._meta("tokenizer.ggml.eos_token_id", None)
        self.chat_template = self._meta("tokenizer.chat_template", None)
        self.add_bos_token = bool(self._meta("tokenizer.ggml.add_bos_token", self._default_add_bos()))
        self.tokenizer = self._build_tokenizer()
        self.eog_token_ids = self._end_of_generation_ids()

    @property
    def quantized(self) -> bool:
        """Some matrices are stored in a block type the CPU kernels read (ops/quant.py)."""
        return any(t.tensor_type.name in BLOCK_TYPES for t in self._reader.tensors)

    @property
    def tensor_names(self) -> set[str]:
        return {t.name for t in self._reader.tensors}

    def quantized_blocks(self, keep=None, drop: bool = False) -> Iterator[tuple[str, str, np.ndarray, tuple[int, int]]]:
        """(checkpoint name, GGUF type, raw blocks [rows, bytes], (rows, cols)) of every matrix in a
        block type the CPU kernels read, rows in the order `tensors()` gives them. `drop`: each
        tensor's pages leave this process's mapping once the consumer is done with the blocks (they
        were copied, as ops/qgemm.py packs them)."""
        for name, t in self._named_tensors(keep):
            if t.tensor_type.name not in BLOCK_TYPES:
                continue
            if not isinstance(name, str) and len(t.shape) == 3:  # an expert stack: its experts' rows one after another
                rows = int(t.shape[2]) * int(t.shape[1])
                stack = f"model.layers.{name[1]}.mlp.experts.{EXPERT_TENSORS[name[2]]}_stack.{name[3]}"
                yield stack, t.tensor_type.name, np.asarray(t.data).reshape(rows, -1), (rows, int(t.shape[0]))
                continue
            if not isinstance(name, str) or len(t.shape) != 2:
                continue
            if self.arch in gguf_hybrid.HYBRID_ARCHS and not gguf_hybrid.keeps_blocks(self.arch, self.config, t.name):
                continue
            shape = (int(t.shape[1]), int(t.shape[0]))
            blocks = np.asarray(t.data).reshape(shape[0], -1)
            yield name, t.tensor_type.name, self._fix_rows(name, blocks), shape
            if drop:
                self._reader.drop(t)

    def drop_pages(self) -> None:
        """The file's pages out of this process's mapping (xinfer/loader/gguf_file.py drop): every
        tensor has been copied or repacked by now."""
        self._reader.drop()

    def _fix_rows(self, name: str, w: np.ndarray) -> np.ndarray:
        """llama.cpp stores llama's Q/K rows permuted (see unpermute_qk)."""
        if self.arch == "llama" and (".self_attn.q_proj." in name or ".self_attn.k_proj." in name):
            key = "num_attention_heads" if ".q_proj." in name else "num_key_value_heads"
            w = unpermute_qk(w, self.config[key])
        if self.arch in gguf_hybrid.HYBRID_ARCHS:
            w = gguf_hybrid.fix_rows(self.arch, self.config, name, w)
        return w

    # ---- metadata and config

    def _meta(self, key: str, default=_REQUIRED):
        value = self._reader.fields.get(key)
        if value is None:
            if default is _REQUIRED:
                raise ModelLoadError(f"GGUF file {self.path} lacks metadata key {key!r}")
            return default
        return value

    def _build_config(self) -> dict:
        a = self.arch + "."
        hf_class, model_type = ARCHITECTURES[self.arch]
        name = f"{self._meta('general.name', '')} {self._meta('general.basename', '')}".lower()
        if self.arch == "llama" and "mistral" in name:
            # llama.cpp files Mistral models under the llama architecture.
            hf_class, model_type = "MistralForCausalLM", "mistral"
        hidden = self._meta(a + "embedding_length")
        heads = self._meta(a + "attention.head_count")
        tensors = {t.name: t for t in self._reader.tensors}
        tensor_names = set(tensors)
        q = tensors.get("blk.0.attn_q.weight")
        head_dim = int(q.shape[1]) // heads if q is not None else hidden // heads
        cfg = {
            "architectures": [hf_class],
            "model_type": model_type,
            "hidden_size": hidden,
            "intermediate_size": self._meta(a + "feed_forward_length", None),
            "num_hidden_layers": self._meta(a + "block_count"),
            "num_attention_heads": heads,
            "num_key_value_heads": self._meta(a + "attention.head_count_kv", heads),
            "head_dim": self._meta(a + "attention.key_length", head_dim),
            "rms_norm_eps": self._meta(a + "attention.layer_norm_rms_epsilon", 1e-6),
            "rope_theta": self._meta(a + "rope.freq_base", 10000.0),
            "max_position_embeddings": self._meta(a + "context_length", 2048),
            "vocab_size": self._meta(a + "vocab_size", None) or len(self._meta("tokenizer.ggml.tokens", [])),
            "tie_word_embeddings": "output.weight" not in tensor_names,
            "bos_token_id": self._meta("tokenizer.ggml.bos_token_id", None),
            "eos_token_id": self._meta("tokenizer.ggml.eos_token_id", None),
            "pad_token_id": self._meta("tokenizer.ggml.padding_token_id", None),
            "hidden_act": "silu",
            "attention_bias": "blk.0.attn_q.bias" in tensor_names,
            "use_qk_norm": "blk.0.attn_q_norm.weight" in tensor_names,
        }
        scaling = self._meta(a + "rope.scaling.type", "none")
        if scaling in ("linear", "yarn"):
            cfg["rope_scaling"] = {"rope_type": scaling, "factor": self._meta(a + "rope.scaling.factor", 1.0)}
            orig = self._meta(a + "rope.scaling.original_context_length", None)
            if orig:
                cfg["rope_scaling"]["original_max_position_embeddings"] = orig
        if "rope_freqs.weight" in tensor_names:
            cfg["rope_scaling"] = self._llama3_rope_scaling(tensors["rope_freqs.weight"], cfg)
        rot = self._meta(a + "rope.dimension_count", None)
        if rot:
            cfg["partial_rotary_factor"] = rot / cfg["head_dim"]
        if self.arch == "phi3":
            cfg["sliding_window"] = self._meta(a + "attention.sliding_window", 0) or None  # 0: none (Phi-4)
            if "rope_factors_long.weight" in tensor_names:  # LongRoPE: the factors travel as tensors
                long, short = (self._dequantize(t, t.data, (int(t.n_elements),)).tolist()
                               for t in (tensors["rope_factors_long.weight"], tensors["rope_factors_short.weight"]))
                cfg["rope_scaling"] = {
                    "rope_type": "longrope", "long_factor": long, "short_factor": short,
                    "original_max_position_embeddings": self._meta(a + "rope.scaling.original_context_length"),
                    "attention_factor": self._meta(a + "rope.scaling.attn_factor", None)}
        cfg.update(arch_config(self.arch, self._meta, cfg))
        if self.arch in gguf_hybrid.HYBRID_ARCHS:
            cfg.update(gguf_hybrid.config(self.arch, self._meta, cfg, tensor_names))
        if self.arch == "gemma3":
            n_layers = cfg["num_hidden_layers"]
            # llama.cpp hard-codes these for gemma3: every 6th layer is global, local rope base 10000.
            pattern = self._meta(a + "attention.sliding_window_pattern", 6)
            cfg.update(
                hidden_act="gelu_pytorch_tanh",
                hidden_activation="gelu_pytorch_tanh",
                sliding_window=self._meta(a + "attention.sliding_window", None),
                sliding_window_pattern=pattern,
                layer_types=["full_attention" if (i + 1) % pattern == 0 else "sliding_attention"
                             for i in range(n_layers)],
                rope_local_base_freq=10000.0,
                # llama.cpp scales queries by 1/sqrt(head_dim), except 27B (62 layers): 1/sqrt(hidden/heads)
                query_pre_attn_scalar=hidden // heads if n_layers == 62 else cfg["head_dim"],
                final_logit_softcapping=self._meta(a + "final_logit_softcapping", None),
                attn_logit_softcapping=self._meta(a + "attn_logit_softcapping", None),
            )
        return cfg

    def _llama3_rope_scaling(self, t, cfg: dict) -> dict | None:
        """Llama 3.1+ files hold the per-frequency rope divisors, not the HF rope_scaling that made them.
        Recover it, assuming Meta's low/high frequency factors and original context (all Llama 3 releases)."""
        freqs = self._dequantize(t, t.data, (int(t.n_elements),))
        scaling = {"rope_type": "llama3", "factor": float(freqs.max()), "low_freq_factor": 1.0,
                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
        if np.allclose(llama3_rope_factors(cfg["rope_theta"], cfg["head_dim"], scaling), freqs, rtol=1e-4):
            return scaling
        log.warning("%s: rope_freqs.weight does not match Llama 3 rope scaling; ignoring it", self.path)
        return None

    def _default_add_bos(self) -> bool:
        # llama.cpp's defaults when the file does not say: SentencePiece vocabularies and Llama 3 add BOS.
        if self._meta("tokenizer.ggml.model", None) == "llama":
            return True
        return self._meta("tokenizer.ggml.pre", None) in ("llama3", "llama-v3", "llama-bpe")

    def _end_of_generation_ids(self) -> list[int]:
        """EOS plus the end-of-turn tokens llama.cpp also stops on: the ones the file names, and
        control tokens spelled like a known end of turn (Gemma 3 files name only <eos>)."""
        ids = [self._meta(f"tokenizer.ggml.{k}_token_id", None) for k in ("eos", "eot", "eom")]
        tokens = self._meta("tokenizer.ggml.tokens")
        ids += [i for i, t in enumerate(tokens) if t in _END_OF_TURN_TOKENS]
        return list(dict.fromkeys(i for i in ids if i is not None))

    # ---- tensors

    def _named_tensors(self, keep=None):
        """(checkpoint name, GGUF tensor) of every tensor a model loads; expert stacks named by block.
        `keep(name)`: only those (a pipeline stage's), the others not read."""
        if keep is not None:
            for name, t in self._named_tensors():
                if keep(name if isinstance(name, str) else f"model.layers.{name[1]}.mlp.experts"):
                    yield name, t
            return
        block_names = ARCH_BLOCK_TENSORS.get(self.arch, BLOCK_TENSORS)
        for t in self._reader.tensors:
            m = _BLOCK_RE.fullmatch(t.name)
            if m and m[2] in EXPERT_TENSORS:
                yield m, t
            elif m and m[3] and m[2] in block_names:
                yield f"model.layers.{m[1]}.{block_names[m[2]]}.{m[3]}", t
            elif m and m[2] in WHOLE_TENSORS:
                yield f"model.layers.{m[1]}.{WHOLE_TENSORS[m[2]]}", t
            elif (g := _GLOBAL_RE.fullmatch(t.name)) and g[1] in GLOBAL_TENSORS:
                yield f"{GLOBAL_TENSORS[g[1]]}.{g[2]}", t
            else:
                log.debug("%s: skipping tensor %s", self.path, t.name)

    def tensors(self, keep=None, lazy: bool = False, skip=()) -> Iterator[tuple[str, torch.Tensor]]:
        """`keep(name)`: only those; `lazy`: matrices as loader.lazy.Lazy, dequantized when (and as
        far as) a loader needs them (a tensor-parallel rank's part); `skip`: names not read (held as
        blocks already)."""
        import torch  # only the model worker reads tensors; the tokenizer side stays torch-free

        for name, t in self._named_tensors(keep):
            if isinstance(name, str) and name in skip:
                continue
            if lazy and isinstance(name, str) and len(t.shape) == 2 and self.arch not in gguf_hybrid.HYBRID_ARCHS:
                part = self._lazy(name, t)
                if part is not None:
                    yield name, part
                    continue
            if not isinstance(name, str):  # an expert stack: one tensor per expert
                m = name
                shape = (int(t.shape[1]), int(t.shape[0]))
                for e in range(t.data.shape[0]):
                    name = f"model.layers.{m[1]}.mlp.experts.{e}.{EXPERT_TENSORS[m[2]]}.{m[3]}"
                    yield name, torch.from_numpy(self._dequantize(t, t.data[e], shape))
                continue
            w = self._fix_rows(name, self._dequantize(t, t.data, tuple(int(d) for d in reversed(t.shape))))
            if self.arch == "gemma3" and t.name.endswith("norm.weight"):
                w -= 1.0  # the converter stores Gemma's (1 + w) RMSNorm scale as w + 1
            elif self.arch in gguf_hybrid.HYBRID_ARCHS:
                w = gguf_hybrid.fix_values(self.arch, self.config, t.name, w)
            yield name, torch.from_numpy(w)

    def _lazy(self, name: str, t) -> Lazy | None:
        import torch
        from ops.quant import QuantWeight

        shape = (int(t.shape[1]), int(t.shape[0]))
        kind = t.tensor_type.name
        if kind in QuantWeight.DIRECT:
            q = QuantWeight.from_gguf(kind, self._fix_rows(name, np.asarray(t.data).reshape(shape[0], -1)), shape)

            def read(window):
                rows, cols = window
                part = q.narrow(0, rows.start, rows.stop - rows.start)
                try:
                    return part.narrow(1, cols.start, cols.stop - cols.start).dequantize()
                except ValueError:  # columns that cut a block: the rows whole, then those columns
                    return part.dequantize()[:, cols]
            return Lazy(shape, read)
        if kind in ("F32", "F16"):
            data = self._fix_rows(name, np.asarray(t.data).reshape(shape))
            return Lazy(shape, lambda window: torch.from_numpy(np.array(data[window], dtype=np.float32)))
        return None

    def _dequantize(self, t, data: np.ndarray, shape: tuple[int, ...]) -> np.ndarray:
        from ops.quant import QuantWeight
        if t.tensor_type.name in QuantWeight.DIRECT and len(shape) == 2:
            # Bit-equal to gguf's dequantizer (tests/test_cpu_kernels.py), four times faster: it
            # is most of a worker's (re)start on a small quantized model.
            return QuantWeight.from_gguf(t.tensor_type.name, data.reshape(shape[0], -1), shape).dequantize().numpy()
        try:
            w = dequantize(data, t.tensor_type)
        except NotImplementedError:
            raise ModelLoadError(f"GGUF file {self.path}: tensor {t.name} has type {t.tensor_type.name}, "
                                 "which cannot be dequantized") from None
        w = w.reshape(shape).astype(np.float32, copy=False)
        # F32 tensors come back as views of the read-only memory map.
        return w.copy() if not w.flags.writeable else w

    # ---- tokenizer

    def _build_tokenizer(self) -> Tokenizer:
        kind = self._meta("tokenizer.ggml.model")
        tokens = self._meta("tokenizer.ggml.tokens")
        types = self._meta("tokenizer.ggml.token_type", None) or [TokenType.NORMAL] * len(tokens)
        if kind == "gpt2":
            pre = self._meta("tokenizer.ggml.pre", "default")
            tok = byte_level_tokenizer(tokens, self._meta("tokenizer.ggml.merges"), pre)
        elif kind == "llama":
            unk_id = self._meta("tokenizer.ggml.unknown_token_id", None)
            unk = tokens[unk_id] if unk_id is not None else "<unk>"
            tok = sentencepiece_tokenizer(tokens, self._meta("tokenizer.ggml.scores", None), unk,
                                          gemma=self.arch.startswith("gemma"),
                                          add_space_prefix=self._meta("tokenizer.ggml.add_space_prefix", True))
        else:
            raise ModelLoadError(f"GGUF file {self.path} has tokenizer model {kind!r}; supported: gpt2, llama")
        add_special_tokens(tok, tokens, types, byte_level=kind == "gpt2")
        add_eos = bool(self._meta("tokenizer.ggml.add_eos_token", False))
        single, specials = ["$A"], []
        if self.add_bos_token and self.bos_token_id is not None:
            single.insert(0, tok.id_to_token(self.bos_token_id))
            specials.append((single[0], self.bos_token_id))
        if add_eos and self.eos_token_id is not None:
            single.append(tok.id_to_token(self.eos_token_id))
            specials.append((single[-1], self.eos_token_id))
        if specials:
            pair = single + [p if p != "$A" else "$B:1" for p in single]
            tok.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)
        return tok


def load_gguf(path: str) -> GGUFModel:
    return GGUFModel(path)


def _open_reader(path: str) -> GGUFFile:
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise ModelLoadError(f"cannot open GGUF file {path}: {e.strerror or e}") from None
    if magic != b"GGUF":
        raise ModelLoadError(f"{path} is not a GGUF file (starts with {magic!r}, expected b'GGUF')")
    try:
        return GGUFFile(path)
    except EOFError as e:
        raise ModelLoadError(f"truncated GGUF file {path}: {e}") from None
    except Exception as e:  # a file that ends early or is damaged fails in many ways
        raise ModelLoadError(f"truncated or corrupt GGUF file {path} ({size} bytes): {e}") from None


def unpermute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's `permute` of llama Q/K rows (HF half-split rotary -> interleaved pairs)."""
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def permute_qk(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf `permute` (used by tests to round-trip)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(theta: float, head_dim: int, scaling: dict) -> np.ndarray:
    """The rope_freqs.weight llama.cpp's converter writes for an HF "llama3" rope_scaling."""
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * np.pi / inv_freq
    factor, old_ctx = scaling["factor"], scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    smooth = (old_ctx / wavelen - low) / (high - low)
    mid = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < old_ctx / high, 1.0, np.where(wavelen > old_ctx / low, factor, mid))


# ---- tokenizers
