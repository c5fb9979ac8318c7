"""Every environment variable xinfer reads, in one place (read when asked, so tests can set them)."""
from __future__ import annotations

import os


def _flag(name: str, default: bool) -> bool:
    v = os.environ.get(name)
    if v is None or not v.strip():
        return default
    return v.strip().lower() not in ("0", "false", "no", "off")


LAUNCH = "XINFER_LAUNCH"  # set by the supervisor for its children: where they report Started / Failed


def launch_address() -> str | None:
    return os.environ.get(LAUNCH) or None


def api_key() -> str | None:
    """XINFER_API_KEY: the default of --api-key."""
    return os.environ.get("XINFER_API_KEY") or None


def chat_logger() -> bool:
    """XINFER_CHAT_LOGGER=1: append each chat turn to ./log/chat-YYYYMMDD.jsonl."""
    return os.environ.get("XINFER_CHAT_LOGGER") == "1"


def strict_tool_call() -> bool:
    """XINFER_STRICT_TOOL_CALL=1: drop tool calls that do not match the request's schema."""
    return _flag("XINFER_STRICT_TOOL_CALL", False)


def quant_max_rows() -> int | None:
    """XINFER_QUANT_MAX_ROWS: the largest batch that reads GGUF blocks (more rows use the GEMMs);
    default: where the GEMMs were measured to catch up (ops/quant.py MAX_ROWS)."""
    v = os.environ.get("XINFER_QUANT_MAX_ROWS")
    return int(v) if v else None


def cpu_decode() -> bool:
    """XINFER_CPU_DECODE=0: the op-by-op decode step instead of the one-call C step."""
    return os.environ.get("XINFER_CPU_DECODE", "1") != "0"


def qgemm() -> bool:
    """XINFER_QGEMM=0: GGUF Q4_K / Q6_K / Q8_0 weights take ops/quant.py's blocks and a float copy, as
    before ops/qgemm.py (for comparisons)."""
    return os.environ.get("XINFER_QGEMM") != "0"


def cpu_kernels() -> bool:
    """XINFER_CPU_KERNELS=0: do not build or use ops/cpu_kernels.c."""
    return os.environ.get("XINFER_CPU_KERNELS") != "0"


def cpu_march() -> str | None:
    """XINFER_CPU_MARCH: -march for the CPU kernels (default: native, or the level XINFER_CPU_ISA forces)."""
    return os.environ.get("XINFER_CPU_MARCH") or None


def cpu_matmul() -> str | None:
    """XINFER_CPU_MATMUL: what --cpu-matmul auto means (default: the CPU's fast path, ops/cpu_isa.py
    fast_matmul); the test suite sets float32 so its reference checks stay exact on every CPU."""
    return os.environ.get("XINFER_CPU_MATMUL") or None


def cpu_isa() -> str | None:
    """XINFER_CPU_ISA: a lower vector-unit level to run at (ops/cpu_isa.py), to test its paths."""
    return os.environ.get("XINFER_CPU_ISA") or None


def cache_dir() -> str:
    """XINFER_CACHE_DIR: where built kernels are kept (default ~/.cache/xinfer)."""
    return os.environ.get("XINFER_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "xinfer")


def onednn() -> bool:
    """XINFER_ONEDNN=0: float32 matmuls through MKL instead of oneDNN."""
    return os.environ.get("XINFER_ONEDNN", "1") != "0"


def mamba_snapshot_stride_blocks() -> int:
    """XINFER_MAMBA_SNAPSHOT_STRIDE_BLOCKS: hybrid models with prefix caching snapshot a sequence's
    recurrent state every this many full blocks (default 1; xinfer/hybrid.py)."""
    v = int(os.environ.get("XINFER_MAMBA_SNAPSHOT_STRIDE_BLOCKS") or 1)
    if v < 1:
        raise ValueError(f"XINFER_MAMBA_SNAPSHOT_STRIDE_BLOCKS must be at least 1, not {v}")
    return v


def triton_interpret() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def hf_cache_dirs() -> list[str]:
    """Where a Hugging Face model id is looked up, first match wins."""
    env = os.environ
    dirs = [env.get("HF_HUB_CACHE"), env.get("HUGGINGFACE_HUB_CACHE"),
            env.get("HF_HOME") and os.path.join(env["HF_HOME"], "hub"),
            os.path.expanduser("~/.cache/huggingface/hub")]
    return list(dict.fromkeys(d for d in dirs if d))


def c_compiler() -> str | None:
    """CC: the compiler for the CPU kernels (else cc or gcc on PATH)."""
    return os.environ.get("CC") or None


def cpu_graphs() -> bool:
    """XINFER_CPU_GRAPHS=1: decode graphs on the CPU through their stand-in (xinfer/workers/graphs.py
    Rerun), which runs the bookkeeping of CUDA graphs where there is no GPU (tests)."""
    return _flag("XINFER_CPU_GRAPHS", False)


def cpu_pipeline() -> bool:
    """XINFER_CPU_PIPELINE=1: pipelined steps (xinfer/workers/pipeline.py) on the CPU too, where they
    gain nothing but run the same bookkeeping as on CUDA (tests)."""
    return _flag("XINFER_CPU_PIPELINE", False)


def triton_ops() -> bool:
    """XINFER_TRITON_OPS=1: the fused Triton norm, activation and rotary kernels (ops/triton_fused.py)
    on the CPU too, through the interpreter (tests); on CUDA they run whenever Triton is installed."""
    return _flag("XINFER_TRITON_OPS", False)
