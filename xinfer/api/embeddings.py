"""/v1/embeddings (OpenAI's): one L2-normalised vector per input, the served model's final hidden
states pooled as --pooling says. Each input is a prefill-only request through the same scheduler
as a generation (SamplingParams.embed); `dimensions` truncates and renormalises here. With
--embedding-model, that encoder answers instead (embed_batcher.py), the generation engine untouched."""
from __future__ import annotations

import base64
import uuid

import msgspec
import numpy as np
from sanic import Sanic, response

from xinfer.api.protocol import ApiError, decode, warn_unknown_fields
from xinfer.api.schema_embeddings import EmbeddingRequest
from xinfer.api.state import ApiState
from xinfer.api.streaming import merged
from xinfer.errors import InvalidRequestError
from xinfer.sampling_params import embedding_params


def register(app: Sanic, s: ApiState, protected) -> None:
    @app.post("/v1/embeddings", ctx_body=EmbeddingRequest)
    @protected
    async def embeddings(request):
        with s.admitted():
            body = decode(request.body, EmbeddingRequest)
            warn_unknown_fields(request.body, EmbeddingRequest)
            e = s.embedder
            if e is None or body.model != e.name:
                s.check_model(body.model)
            hidden = e.model.hidden_size if e is not None else s.hidden_size
            if body.dimensions is not None and hidden and body.dimensions > hidden:
                raise ApiError(f"dimensions must be <= {hidden} (the model's hidden size), got "
                               f"{body.dimensions}", param="dimensions")
            if e is not None:
                return await _by_embedding_model(s, e, body)
            prompts = await s.offload(_inputs, s, body)
            params = embedding_params()
            for i, ids in enumerate(prompts):  # the check every request gets; its words name the input
                try:
                    s.check([ids], params)
                except InvalidRequestError as e:
                    raise ApiError(f"input[{i}]: {e}", param="input", code=e.code) from None
            vecs: list[bytes] = [b""] * len(prompts)
            # as /v1/completions' prompts: a running batch's worth at a time, --request-timeout over all
            async for i, o in merged(s, "embd-" + uuid.uuid4().hex, prompts, params, None):
                if o is not None and o.finish_reason:
                    vecs[i] = o.embedding
            raw = await s.offload(_answer, s.model_name, body, prompts, vecs)
            return response.raw(raw, content_type="application/json")


async def _by_embedding_model(s: ApiState, e, body: EmbeddingRequest):
    """--embedding-model: its tokenizer, its limits (each input checked by the model), its batcher."""
    prompts = await s.offload(_inputs, s, body, e.model)
    for i, ids in enumerate(prompts):
        e.model.check(ids, f"input[{i}]")  # InvalidRequestError: a 400 naming the input
    vecs = [v.tobytes() for v in (await e.embed(prompts)).astype("<f4")]
    raw = await s.offload(_answer, e.name, body, prompts, vecs)
    return response.raw(raw, content_type="application/json")


def _inputs(s: ApiState, body: EmbeddingRequest, model=None) -> list[list[int]]:
    """The inputs as token ids: one string, one token list, or a list of either; `model`: the
    --embedding-model that tokenizes (else the served model's tokenizer)."""
    x = body.input
    if isinstance(x, str) or all(isinstance(t, int) for t in x):
        x = [x]
    if not (all(isinstance(t, str) for t in x) or all(isinstance(t, list) for t in x)):
        raise ApiError("'input' must be a string, a list of strings, a token list or a list of token lists",
                       param="input")
    if len(x) > s.opts.max_prompts:
        raise ApiError(f"'input' holds {len(x)} inputs; this server takes up to {s.opts.max_prompts} per request "
                       "(--max-prompts-per-request)", param="input")
    empty = next((i for i, t in enumerate(x) if not t), None)
    if empty is not None:
        raise ApiError(f"input[{empty}] is empty", param="input")
    if isinstance(x[0], list):
        return x  # token ids and lengths are checked with the rest (check_request)
    if model is not None:
        return model.encode(x)
    if s.tok is None:
        raise ApiError("this model has no tokenizer: send the input as token ids", param="input")
    return [s.tok.encode(t) for t in x]


def _answer(model: str, body: EmbeddingRequest, prompts, vecs: list[bytes]) -> bytes:
    data = []
    for i, raw in enumerate(vecs):
        if not raw:
            raise RuntimeError(f"no embedding came back for input[{i}]")
        v = np.frombuffer(raw, dtype="<f4")
        if body.dimensions is not None:  # OpenAI's shortening: the first N, back to unit length
            v = v[:body.dimensions]
            v = v / max(float(np.linalg.norm(v)), 1e-12)
        v = v.astype("<f4")
        emb = base64.b64encode(v.tobytes()).decode() if body.encoding_format == "base64" else v.tolist()
        data.append({"object": "embedding", "index": i, "embedding": emb})
    n = sum(len(p) for p in prompts)
    return msgspec.json.encode({"object": "list", "data": data, "model": model,
                                "usage": {"prompt_tokens": n, "total_tokens": n}})
