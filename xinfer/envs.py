"""Every environment variable the engine reads, in one place (read when asked, so tests can set them);
the kernels' own are in ops/envs.py, which this module shares the cache folder with."""
from __future__ import annotations

import os

from ops.envs import cache_dir, flag  # noqa: F401  (cache_dir: the engine keeps its caches in the kernels' folder)

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
    return flag("XINFER_STRICT_TOOL_CALL", False)












def cpu_matmul() -> str | None:
    """XINFER_CPU_MATMUL: what --cpu-matmul auto means (default: the CPU's fast path, ops/cpu_isa.py
    fast_matmul); the test suite sets float32 so its reference checks stay exact on every CPU."""
    return os.environ.get("XINFER_CPU_MATMUL") or None








def mamba_snapshot_stride_blocks() -> int:
    """XINFER_MAMBA_SNAPSHOT_STRIDE_BLOCKS: hybrid models with prefix caching snapshot a sequence's
    recurrent state every this many full blocks (default 1; xinfer/hybrid.py)."""
    v = int(os.environ.get("XINFER_MAMBA_SNAPSHOT_STRIDE_BLOCKS") or 1)
    if v < 1:
        raise ValueError(f"XINFER_MAMBA_SNAPSHOT_STRIDE_BLOCKS must be at least 1, not {v}")
    return v




def hf_cache_dirs() -> list[str]:
    """Where a Hugging Face model id is looked up, first match wins."""
    env = os.environ
    dirs = [env.get("HF_HUB_CACHE"), env.get("HUGGINGFACE_HUB_CACHE"),
            env.get("HF_HOME") and os.path.join(env["HF_HOME"], "hub"),
            os.path.expanduser("~/.cache/huggingface/hub")]
    return list(dict.fromkeys(d for d in dirs if d))




def cpu_graphs() -> bool:
    """XINFER_CPU_GRAPHS=1: decode graphs on the CPU through their stand-in (xinfer/workers/graphs.py
    Rerun), which runs the bookkeeping of CUDA graphs where there is no GPU (tests)."""
    return flag("XINFER_CPU_GRAPHS", False)


def cpu_pipeline() -> bool:
    """XINFER_CPU_PIPELINE=1: pipelined steps (xinfer/workers/pipeline.py) on the CPU too, where they
    gain nothing but run the same bookkeeping as on CUDA (tests)."""
    return flag("XINFER_CPU_PIPELINE", False)

