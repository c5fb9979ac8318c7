"""Which quantized format an HF folder holds, read from `config.json` `quantization_config` (and
ModelOpt's `hf_quant_config.json`), so a folder xinfer cannot load fails at start-up naming its
format instead of failing later on a tensor name or dtype."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from xinfer.errors import ModelLoadError
from xinfer.loader import hf

# What loads (each dequantized at load, xinfer/loader/dequant.py); the rest is only named.
SUPPORTED = ("fp8 with weight_block_size", "fp8 per-tensor or per-channel", "gptq (4 or 8 bits)", "awq (4 bits, gemm)",
             "NVFP4 (modelopt)", "FP8 (modelopt)", "compressed-tensors nvfp4-pack-quantized, mxfp4-pack-quantized, "
             "pack-quantized (WNA4/8), float-quantized (FP8), int-quantized (INT8)")


@dataclass
class QuantScheme:
    method: str  # a key of xinfer/loader/dequant.FORMATS
    block: tuple[int, int] | None = None  # fp8: weight_block_size; scaled: a block structure if any
    bits: int = 4
    group_size: int = -1
    zero_offset: int = 0  # gptq v1 stores each zero point minus one
    raw: dict = field(default_factory=dict, repr=False)


# formats whose linears the CPU block kernels read as they are (xinfer/loader/dequant.py blocks_of)
BLOCK_METHODS = ("gptq", "awq", "wna16", "nvfp4", "nvfp4_ct", "mxfp4_ct")


def detect(folder: str) -> QuantScheme | None:
    """None for a float checkpoint; ModelLoadError for a quantized format that does not load."""
    p = Path(folder)
    top = hf.read_json(p / "config.json")
    qc = top.get("quantization_config") or (top.get("text_config") or {}).get("quantization_config")
    if not qc and (p / "hf_quant_config.json").is_file():  # ModelOpt exports keep it apart
        q = hf.read_json(p / "hf_quant_config.json").get("quantization") or {}
        qc = {"quant_method": "modelopt", **q}
    if not qc:
        return None
    name = describe(qc)
    scheme = _scheme(qc)
    if scheme is None:
        raise ModelLoadError(f"{folder} holds a {name} checkpoint, which xinfer does not load yet; "
                             f"quantized formats it loads: {', '.join(SUPPORTED)} (or use a float or GGUF checkpoint)")
    return scheme


def describe(qc: dict) -> str:
    """The format's name as users know it, e.g. 'NVFP4 (modelopt)', 'compressed-tensors pack-quantized (WNA16)'."""
    method = str(qc.get("quant_method", "unknown")).lower()
    formats = _ct_formats(qc) if method == "compressed-tensors" else []
    if method == "mxfp4" or any("mxfp4" in f for f in formats):
        return "MXFP4" + (" (compressed-tensors)" if formats else "")
    if method == "modelopt":
        return f"{qc.get('quant_algo', 'unknown')} (modelopt)"
    if method == "compressed-tensors":
        names = {"nvfp4-pack-quantized": "nvfp4-pack-quantized (NVFP4)", "pack-quantized": "pack-quantized (WNA16)",
                 "float-quantized": "float-quantized (FP8)"}
        return "compressed-tensors " + (", ".join(names.get(f, f) for f in formats) or "(no format)")
    if method == "fp8":
        bs = qc.get("weight_block_size")
        return f"fp8 with weight_block_size {list(bs)}" if bs else "fp8 per-tensor (no weight_block_size)"
    if method in ("gptq", "awq"):
        extra = f", {qc.get('version')}" if method == "awq" and qc.get("version") else ""
        return f"{method} ({qc.get('bits', '?')} bits{extra})"
    return repr(method)


def _ct_formats(qc: dict) -> list[str]:
    groups = qc.get("config_groups") or {}
    found = [qc.get("format")] + [g.get("format") for g in groups.values() if isinstance(g, dict)]
    return list(dict.fromkeys(str(f).lower() for f in found if f))


def _scheme(qc: dict) -> QuantScheme | None:
    method = str(qc.get("quant_method", "")).lower()
    if method == "fp8" and qc.get("weight_block_size"):
        bs = tuple(int(x) for x in qc["weight_block_size"])
        return QuantScheme("fp8", block=bs, raw=qc) if len(bs) == 2 else None
    if method == "fp8":  # one weight_scale per tensor (or per output row)
        return QuantScheme("scaled", raw=qc)
    if method == "modelopt":
        algo = str(qc.get("quant_algo", "")).upper()
        return {"NVFP4": QuantScheme("nvfp4", raw=qc), "FP8": QuantScheme("scaled", raw=qc)}.get(algo)
    if method == "compressed-tensors":
        return _ct_scheme(qc)
    bits, gs = int(qc.get("bits", 4)), int(qc.get("group_size", -1))
    if method == "gptq" and bits in (4, 8):
        # gptq v1 (AutoGPTQ) writes zero points minus one; gptqmodel's v2 writes them as they are
        v2 = str(qc.get("checkpoint_format", "gptq")).lower() == "gptq_v2"
        return QuantScheme("gptq", bits=bits, group_size=gs, zero_offset=0 if v2 else 1, raw=qc)
    if method == "awq" and bits == 4 and str(qc.get("version", "gemm")).lower() == "gemm" \
            and qc.get("zero_point", True):
        return QuantScheme("awq", bits=bits, group_size=gs, raw=qc)
    return None


def _ct_scheme(qc: dict) -> QuantScheme | None:
    """compressed-tensors: every config group in one format, with its weights' settings."""
    formats = _ct_formats(qc)
    groups = [g for g in (qc.get("config_groups") or {}).values() if isinstance(g, dict)]
    w = (groups[0].get("weights") or {}) if groups else {}
    if len(formats) != 1 or any((g.get("weights") or {}) != w for g in groups):
        return None
    fmt = formats[0]
    if fmt == "nvfp4-pack-quantized":
        return QuantScheme("nvfp4_ct", raw=qc)
    if fmt == "mxfp4-pack-quantized":
        return QuantScheme("mxfp4_ct", raw=qc)
    if fmt in ("float-quantized", "int-quantized", "naive-quantized"):
        bs = w.get("block_structure")
        return QuantScheme("scaled", block=tuple(int(x) for x in bs) if bs else None, raw=qc)
    if fmt == "pack-quantized" and int(w.get("num_bits", 4)) in (4, 8):
        gs = int(w.get("group_size") or -1) if w.get("strategy", "group") == "group" else -1
        return QuantScheme("wna16", bits=int(w.get("num_bits", 4)), group_size=gs, raw=qc)
    return None
