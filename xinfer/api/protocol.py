"""OpenAI request parsing and error bodies."""
from __future__ import annotations

import json

from xinfer.errors import InvalidRequestError
from xinfer.sampling_params import SamplingParams


class ApiError(Exception):
    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code
        self.retry_after = retry_after

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


def parse_body(request) -> dict:
    try:
        body = json.loads(request.body or b"")
    except ValueError as e:
        raise ApiError(f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ApiError("request body must be a JSON object")
    return body


def chat_prompt(tok, body: dict) -> list[int]:
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("'messages' must be a non-empty list", param="messages")
    norm = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise ApiError(f"messages[{i}] must be an object with a 'role'", param="messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text is understood by a text model
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    raise ApiError(f"messages[{i}]: only text content parts are supported by this model",
                                   param="messages")
                texts.append(part.get("text", ""))
            content = "".join(texts)
        norm.append({**m, "content": content if content is not None else ""})
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise ApiError("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    # Names the template renderer passes itself can't be overridden by a client.
    kwargs = {k: v for k, v in kwargs.items() if k not in ("messages", "tools", "add_generation_prompt",
                                                            "bos_token", "eos_token")}
    ids = tok.encode_chat(norm, tools=body.get("tools"), **kwargs)
    return ids


def completion_prompts(tok, body: dict, vocab_size: int) -> list[list[int]]:
    p = body.get("prompt")
    if isinstance(p, str):
        prompts = [tok.encode(p)]
    elif isinstance(p, list) and p and all(isinstance(x, int) for x in p):
        prompts = [p]
    elif isinstance(p, list) and p and all(isinstance(x, str) for x in p):
        prompts = [tok.encode(x) for x in p]
    elif isinstance(p, list) and p and all(isinstance(x, list) and x and all(isinstance(t, int) for t in x)
                                           for x in p):
        prompts = p
    else:
        raise ApiError("'prompt' must be a string, a list of strings, a token list or a list of token lists",
                       param="prompt")
    if body.get("suffix"):
        raise ApiError("'suffix' is not supported", param="suffix")
    for ids in prompts:
        bad = [t for t in ids if not 0 <= t < vocab_size]
        if bad:
            raise ApiError(f"unknown token id {bad[0]} (vocabulary size {vocab_size})", param="prompt")
        if not ids:
            raise ApiError("prompt is empty", param="prompt")
    return prompts


_FLOATS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


def sampling_params(body: dict, vocab_size: int) -> SamplingParams:
    kw = {}
    for name in _FLOATS:
        if body.get(name) is not None:
            kw[name] = _num(body, name, float)
    for name in ("n", "top_k", "min_tokens", "seed"):
        if body.get(name) is not None:
            kw[name] = _num(body, name, int)
    mt = body.get("max_completion_tokens", body.get("max_tokens"))
    if mt is not None:
        kw["max_tokens"] = _num({"max_tokens": mt}, "max_tokens", int)
    else:
        kw["max_tokens"] = None
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
            raise ApiError("'stop' must be a string or a list of strings", param="stop")
        kw["stop"] = stop
    if body.get("stop_token_ids"):
        kw["stop_token_ids"] = [int(t) for t in body["stop_token_ids"]]
    if body.get("ignore_eos") is not None:
        kw["ignore_eos"] = bool(body["ignore_eos"])
    if body.get("logit_bias"):
        try:
            kw["logit_bias"] = {int(k): float(v) for k, v in body["logit_bias"].items()}
        except (ValueError, AttributeError, TypeError):
            raise ApiError("'logit_bias' must map token ids to numbers", param="logit_bias") from None
    try:
        return SamplingParams(**kw).validate(vocab_size)
    except InvalidRequestError as e:
        raise ApiError(str(e), param=str(e).split(" ")[0]) from None


def _num(body, name, kind):
    v = body[name]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not float(v).is_integer()):
        raise ApiError(f"'{name}' must be {'an integer' if kind is int else 'a number'}", param=name)
    return kind(v)


def usage(prompt_tokens: int, completion_tokens: int, cached: int) -> dict:
    u = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
         "total_tokens": prompt_tokens + completion_tokens}
    if cached:
        u["prompt_tokens_details"] = {"cached_tokens": cached}
    return u
