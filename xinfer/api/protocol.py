"""OpenAI request parsing and error bodies."""
from __future__ import annotations

import json

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


def parse_tools(body: dict) -> tuple[list[dict] | None, str | None]:
    """The request's tools and what tool_choice asks: None (no parsing), "auto",
    "required", or a function name."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none", "auto"):
            raise ApiError("'tool_choice' needs 'tools'", param="tool_choice")
        return None, None
    if not isinstance(tools, list) or not all(
            isinstance(t, dict) and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)
            for t in tools):
        raise ApiError("'tools' must be a list of {\"type\": \"function\", \"function\": {\"name\": ...}}",
                       param="tools")
    names = [t["function"]["name"] for t in tools]
    if choice is None or choice == "auto":
        return tools, "auto" if tools else None
    if choice == "none":
        return tools, None
    if choice == "required":
        return tools, "required"
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise ApiError(f"tool_choice names {name!r}, which is not in 'tools' ({', '.join(names)})",
                           param="tool_choice")
        return tools, name
    raise ApiError("'tool_choice' must be \"none\", \"auto\", \"required\" or "
                   "{\"type\": \"function\", \"function\": {\"name\": ...}}", param="tool_choice")


def chat_text(tok, body: dict, tools: list[dict] | None, thinking_default: bool, describe_tools: bool = True) -> str:
    """The request's messages rendered by the model's chat template; `describe_tools`: tell a model
    whose template ignores tools about them (not when tool_choice is "none")."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError("'messages' must be a non-empty list", param="messages")
    norm = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ApiError(f"messages[{i}] must be an object with a 'role'", param="messages")
        content = m.get("content")
        if isinstance(content, list):  # content parts: only text is understood by a text model
            texts = []
            for part in content:
                if not isinstance(part, dict) or part.get("type") != "text":
                    kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                    raise ApiError(f"messages[{i}]: content parts of type {kind!r} are not supported by this "
                                   "model (text only)", param="messages")
                texts.append(str(part.get("text", "")))
            content = "".join(texts)
        elif content is not None and not isinstance(content, str):
            raise ApiError(f"messages[{i}].content must be a string or a list of parts", param="messages")
        msg = {**m, "content": content if content is not None else ""}
        if m.get("tool_calls") is not None:
            msg["tool_calls"] = _history_calls(m["tool_calls"], i)
        norm.append(msg)
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise ApiError("'chat_template_kwargs' must be an object", param="chat_template_kwargs")
    # Names the renderer passes itself (and ones that would switch tokenization) can't be set by a client.
    kwargs = {k: v for k, v in kwargs.items() if k not in (
        "messages", "tools", "add_generation_prompt", "bos_token", "eos_token", "tokenize", "add_special_tokens")}
    thinking = kwargs.pop("enable_thinking", body.get("enable_thinking", body.get("thinking", thinking_default)))
    if isinstance(thinking, dict):  # {"type": "enabled" | "disabled"}
        thinking = thinking.get("type") != "disabled"
    kwargs["enable_thinking"] = bool(thinking)
    if tools and describe_tools and "tools" not in (tok.chat_template or ""):
        norm = _describe_tools(norm, tools)
    return tok.apply_chat_template(norm, tools=tools, **kwargs)


def _describe_tools(messages: list[dict], tools: list[dict]) -> list[dict]:
    """A template that does not render tools: tell the model about them in the system
    message, and how to call one (the `json` parser reads that reply)."""
    text = ("You can call these functions:\n" + json.dumps([t["function"] for t in tools], ensure_ascii=False) +
            '\nTo call one, reply with only a JSON object: {"name": <function name>, "arguments": <object>}.')
    if messages[0]["role"] == "system":
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + text}] + messages[1:]
    return [{"role": "system", "content": text}] + messages


def _history_calls(calls, i) -> list[dict]:
    """Assistant tool calls sent back in the history: templates want arguments as objects."""
    if not isinstance(calls, list):
        raise ApiError(f"messages[{i}].tool_calls must be a list", param="messages")
    out = []
    for c in calls:
        fn = c.get("function") if isinstance(c, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ApiError(f"messages[{i}].tool_calls entries need function.name", param="messages")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                raise ApiError(f"messages[{i}].tool_calls: arguments are not valid JSON", param="messages") from None
        out.append({**c, "function": {**fn, "arguments": args}, "name": fn["name"], "arguments": args})
    return out


def completion_prompts(tok, body: dict) -> list[list[int]]:
    p = body.get("prompt")
    if tok is None and (isinstance(p, str) or isinstance(p, list) and p and isinstance(p[0], str)):
        raise ApiError("this model has no tokenizer: send the prompt as token ids", param="prompt")
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
    return prompts  # token ids and lengths are checked with the rest (check_request)


_FLOATS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")


def sampling_params(body: dict, chat: bool = True, max_n: int = 16) -> SamplingParams:
    if body.get("stream_options") is not None and not body.get("stream"):
        raise ApiError("'stream_options' is only allowed with 'stream': true", param="stream_options")
    if body.get("n") is not None and isinstance(body["n"], int) and body["n"] > max_n:
        raise ApiError(f"n must be <= {max_n} on this server, got {body['n']}", param="n")
    kw = {}
    if chat:
        top = body.get("top_logprobs")
        if top is not None:
            top = _num(body, "top_logprobs", int)
            if not 0 <= top <= 20:
                raise ApiError(f"top_logprobs must be in [0, 20], got {top}", param="top_logprobs")
            if not body.get("logprobs"):
                raise ApiError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        if body.get("logprobs"):
            kw["logprobs"] = top or 0
    elif body.get("logprobs") is not None:
        kw["logprobs"] = _num(body, "logprobs", int)
        if not 0 <= kw["logprobs"] <= 20:
            raise ApiError(f"logprobs must be in [0, 20], got {kw['logprobs']}", param="logprobs")
        if body.get("echo"):
            kw["prompt_logprobs"] = kw["logprobs"]
    if body.get("prompt_logprobs") is not None:
        kw["prompt_logprobs"] = _num(body, "prompt_logprobs", int)
    if body.get("skip_special_tokens") is not None:
        kw["skip_special_tokens"] = bool(body["skip_special_tokens"])
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
        ids = body["stop_token_ids"]
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ApiError("'stop_token_ids' must be a list of token ids", param="stop_token_ids")
        kw["stop_token_ids"] = ids
    if body.get("ignore_eos") is not None:
        kw["ignore_eos"] = bool(body["ignore_eos"])
    if body.get("logit_bias"):
        try:
            kw["logit_bias"] = {int(k): float(v) for k, v in body["logit_bias"].items()}
        except (ValueError, AttributeError, TypeError, OverflowError):
            raise ApiError("'logit_bias' must map token ids to numbers", param="logit_bias") from None
    return SamplingParams(**kw)  # its values are checked with the rest (check_request)


def _num(body, name, kind):
    v = body[name]
    if isinstance(v, bool) or not isinstance(v, (int, float)) or (kind is int and not float(v).is_integer()):
        raise ApiError(f"'{name}' must be {'an integer' if kind is int else 'a number'}", param=name)
    return kind(v)


def usage(prompt_tokens: int, completion_tokens: int, cached: int, reasoning: int = 0) -> dict:
    u = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
         "total_tokens": prompt_tokens + completion_tokens}
    if cached:
        u["prompt_tokens_details"] = {"cached_tokens": cached}
    if reasoning:
        u["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return u
