"""API process <-> engine core messages (one ZMQ PUSH/PULL pair each way)."""
from __future__ import annotations

import msgspec

from xinfer.sampling_params import SamplingParams


class GenerateRequest(msgspec.Struct, array_like=True, tag="gen"):
    request_id: str
    prompt_ids: bytes  # int32 token ids
    params: SamplingParams


class Abort(msgspec.Struct, array_like=True, tag="abort"):
    request_id: str


class Ready(msgspec.Struct, array_like=True, tag="ready"):
    model: str
    max_model_len: int


class Output(msgspec.Struct, array_like=True):
    request_id: str
    index: int  # which of the request's n choices
    token_ids: bytes
    text: str
    finish_reason: str | None
    num_cached_tokens: int
    logprobs: list[tuple[float, list[tuple[int, float]]]] = []


class Outputs(msgspec.Struct, array_like=True, tag="outs"):
    items: list[Output]


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


class RequestError(msgspec.Struct, array_like=True, tag="err"):
    request_id: str
    message: str


ToEngine = GenerateRequest | Abort
FromEngine = Ready | Outputs | RequestError | Stats
