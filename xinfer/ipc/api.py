"""API process <-> engine core messages (one ZMQ PUSH/PULL pair each way)."""
from __future__ import annotations

import msgspec

from xinfer.ipc.media import ImageData
from xinfer.ipc.text import ParseSpec
from xinfer.sampling_params import SamplingParams


class GenerateRequest(msgspec.Struct, array_like=True, tag="gen"):
    request_id: str
    prompt_ids: bytes  # int32 token ids
    params: SamplingParams
    parse: ParseSpec | None = None
    images: list[ImageData] = []  # the prompt's images, their placeholders already expanded in prompt_ids


class Abort(msgspec.Struct, array_like=True, tag="abort"):
    request_id: str
    index: int = -1  # one choice, or -1: all of them


class Ready(msgspec.Struct, array_like=True, tag="ready"):
    model: str
    max_model_len: int
    pid: int = 0  # the engine core's: the API watches it
    num_blocks: int = 0  # the KV cache's size (so the API can refuse a request that can never fit)
    block_size: int = 16


class Stats(msgspec.Struct, array_like=True, tag="stats"):
    """Engine gauges and counters (counters are totals since start)."""
    num_running: int
    num_waiting: int
    kv_cache_usage: float
    prompt_tokens: int
    generation_tokens: int
    prefix_cache_hit_tokens: int
    preemptions: int
    worker_restarts: int
    restart_seconds: list[tuple[str, int, float]] = []  # per child: (restarts, seconds they took in all)
    spec_draft_tokens: int = 0  # speculative decoding: drafts verified, and how many were accepted
    spec_accepted_tokens: int = 0
    kv_cache_capacity_tokens: int = 0  # blocks x block size, in whatever --kvcache-dtype stores


class RequestError(msgspec.Struct, array_like=True, tag="err"):
    request_id: str
    message: str


ToEngine = GenerateRequest | Abort
FromEngine = Ready | RequestError | Stats  # text goes through the detokenizer and parser (ipc/text.py)
