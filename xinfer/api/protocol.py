"""OpenAI request parsing and error bodies: a body is decoded once into its struct (schema.py),
then turned into what the engine and the chat template take."""
from __future__ import annotations

import json
import logging
import re

import msgspec

from xinfer.api.schema import MAX_TEMPLATE, Sampling, ThinkingConfig, ToolCall
from xinfer.loader.tokenizer import TEMPLATE_OWN_NAMES
from xinfer.parsers.base import MAX_DEPTH, too_deep  # one nesting bound for bodies and model output
from xinfer.sampling_params import SamplingParams

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat runs up to the context

log = logging.getLogger("xinfer.api")


class ApiError(Exception):
    def __init__(self, message: str, status: int = 400, kind: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code
        self.retry_after = retry_after

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


# ---- decoding ----

def decode(raw: bytes | None, kind: type):
    """The body as a `kind` struct, or a 400 whose param is the top-level field at fault (the
    message names the whole path, e.g. 'messages[0].content')."""
    raw = raw or b""
    too_nested = f"request body is nested deeper than {MAX_DEPTH} levels"
    try:
        body = msgspec.json.decode(raw, type=kind)
    except msgspec.ValidationError as e:
        raise _invalid(str(e)) from None
    except msgspec.DecodeError as e:
        raise _lone_surrogate(raw) or ApiError(f"request body is not valid JSON: {e}") from None
    except RecursionError:  # deeper than msgspec's stack
        raise ApiError(too_nested) from None
    if too_deep(raw, MAX_DEPTH):  # what msgspec took into Any fields (tool schemas, template kwargs)
        raise ApiError(too_nested)
    return body


_KEYS = msgspec.json.Decoder(dict[str, msgspec.Raw])  # the top level only: its values stay undecoded
_UNKNOWN_SEEN: set[str] = set()
_UNKNOWN_MAX = 256  # names come from clients: remembered (and logged) up to this many


def warn_unknown_fields(raw: bytes | None, kind: type) -> None:
    """Top-level fields the server ignores, each name logged once per process: a client that
    thinks it set something (a parameter of another server) can find out why nothing changed."""
    if len(_UNKNOWN_SEEN) >= _UNKNOWN_MAX:
        return
    try:
        keys = _KEYS.decode(raw or b"")
    except msgspec.DecodeError:  # decode() has accepted it; this only goes wrong on odd input
        return
    new = sorted(keys.keys() - set(kind.__struct_fields__) - _UNKNOWN_SEEN)
    for name in new[:_UNKNOWN_MAX - len(_UNKNOWN_SEEN)]:
        _UNKNOWN_SEEN.add(name)
        log.warning("request field %r is not supported and is ignored (logged once)", name[:80])


def _invalid(msg: str) -> ApiError:
    what, _, where = msg.partition(" - at ")
    m = re.search(r"`\$\.?([^`]*)`$", where)
    path = m.group(1) if m else ""
    if where.startswith("`key`"):
        what += " (a key)"
    if path:
        return ApiError(f"'{path}': {what}", param=_top(path))
    missing = re.fullmatch(r"Object missing required field `(\w+)`", what)
    return ApiError(what if missing else f"request body: {what}", param=missing and missing.group(1))


def _top(path: str) -> str:
    return re.match(r"[^.\[]*", path).group()


_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def _lone_surrogate(raw: bytes) -> ApiError | None:
    """msgspec rejects an unpaired UTF-16 surrogate escape ("\\ud800") as truncated or malformed
    input: say what it is, and where (Python's json keeps such a surrogate in the string)."""
    if not _SURROGATE_ESCAPE.search(raw):
        return None
    try:
        todo = [("", json.loads(raw))]
    except (ValueError, RecursionError):
        return None
    while todo:
        path, v = todo.pop()
        if isinstance(v, str):
            if _SURROGATE.search(v):
                path = _SURROGATE.sub(lambda m: f"\\u{ord(m.group()):04x}", path)  # the path may hold it too
                msg = f"'{path}'" if path else "request body"
                return ApiError(f"{msg}: a lone UTF-16 surrogate (\\ud800-\\udfff) is not valid Unicode",
                                param=_top(path) or None)
        elif isinstance(v, dict):
            for k, x in reversed(v.items()):
                key_path = f"{path}.{k}" if path else k
                todo.append((key_path, k if _SURROGATE.search(k) else x))  # a bad key: report it as the value
        elif isinstance(v, list):
            todo.extend((f"{path}[{i}]", x) for i, x in reversed(list(enumerate(v))))
    return None


# ---- chat: tools and the template ----

def parse_tools(body) -> tuple[list[dict] | None, str | None]:
    """The request's tools (as the template takes them) and what tool_choice asks: None (no
    parsing), "auto", "required", or a function name."""
    choice = body.tool_choice
    if body.tools is None:
        if choice not in (None, "none", "auto"):
            raise ApiError("'tool_choice' needs 'tools'", param="tool_choice")
        return None, None
    tools = msgspec.to_builtins(body.tools)
    if choice is None or choice == "auto":
        return tools, "auto" if tools else None
    if choice in ("none", "required"):
        return tools, None if choice == "none" else choice
    names = [t.function.name for t in body.tools]
    if choice.function.name not in names:
        raise ApiError(f"tool_choice names {choice.function.name!r}, which is not in 'tools' ({', '.join(names)})",
                       param="tool_choice")
    return tools, choice.function.name


def chat_text(tok, body, tools: list[dict] | None, thinking_default: bool, describe_tools: bool = True,
              trust_template: bool = False, images: bool = False) -> str:
    """The request's messages rendered by the model's chat template (or the request's own, with
    `trust_template`); `describe_tools`: tell a model whose template ignores tools about them (not
    when tool_choice is "none"); `images`: the model takes image parts (the template places them)."""
    norm = []
    for i, m in enumerate(body.messages):
        content = m.content
        if isinstance(content, list):  # content parts: only text is understood by a text model
            known = ("text", "image_url", "image_base64") if images else ("text",)
            bad = next((p.type for p in content if p.type not in known), None)
            if bad is not None:
                raise ApiError(f"messages[{i}]: content parts of type {bad!r} are not supported by this "
                               f"model ({'text and images' if images else 'text'} only)", param="messages")
            if any(p.type != "text" for p in content):  # as HF processors hand parts to the template
                content = [{"type": "text", "text": p.text or ""} if p.type == "text" else {"type": "image"}
                           for p in content]
            else:
                content = "".join(p.text or "" for p in content)
        msg = {**msgspec.to_builtins(m), "content": content or ""}
        if m.tool_calls:
            msg["tool_calls"] = _history_calls(m.tool_calls, i)
        norm.append(msg)
    template = _own_template(body, trust_template)
    kwargs = _template_kwargs(body.chat_template_kwargs or {})
    effort_off = False if body.reasoning_effort == "none" else None  # as vLLM and llama-server read it
    thinking = next((v for v in (kwargs.pop("enable_thinking", None), body.enable_thinking, body.thinking,
                                 effort_off) if v is not None), thinking_default)
    if isinstance(thinking, dict):  # {"type": "enabled" | "disabled"}, in chat_template_kwargs
        thinking = thinking.get("type") != "disabled"
    elif isinstance(thinking, ThinkingConfig):
        thinking = thinking.type != "disabled"
    kwargs["enable_thinking"] = bool(thinking)
    if tools and describe_tools and "tools" not in (template or tok.chat_template or ""):
        norm = _describe_tools(norm, tools)
    if not body.continue_final_message:
        return tok.apply_chat_template(norm, body.add_generation_prompt is not False, tools=tools,
                                       chat_template=template, **kwargs)
    if body.add_generation_prompt:
        raise ApiError("'continue_final_message' needs 'add_generation_prompt': false", param="continue_final_message")
    last = norm[-1]
    if last["role"] != "assistant" or not last["content"]:
        raise ApiError("'continue_final_message' needs a last message from the assistant with content",
                       param="continue_final_message")
    text = tok.apply_chat_template(norm, False, tools=tools, chat_template=template, **kwargs)
    end = text.rfind(last["content"])
    # The template closes the turn after the content (an end-of-turn token): the reply goes on from there.
    return text[:end + len(last["content"])] if end >= 0 else text


def _own_template(body, trusted: bool) -> str | None:
    """The request's own chat template: the field, or chat_template_kwargs' (vLLM reads both, that
    one first). It is code the server runs, so only with --trust-request-chat-template (as vLLM)."""
    source = (body.chat_template_kwargs or {}).get("chat_template")
    source = body.chat_template if source is None else source
    if source is None:
        return None
    if not trusted:
        raise ApiError("this server does not take a request's own 'chat_template': start it with "
                       "--trust-request-chat-template to allow one", param="chat_template")
    if not isinstance(source, str) or len(source) > MAX_TEMPLATE:
        raise ApiError(f"'chat_template' must be a string of at most {MAX_TEMPLATE} characters",
                       param="chat_template")
    return source


# Besides the renderer's own names, these would switch how the prompt is tokenized.
_NOT_TEMPLATE_KWARGS = TEMPLATE_OWN_NAMES | {"tokenize", "add_special_tokens"}


def _template_kwargs(kwargs: dict) -> dict:
    """chat_template_kwargs as template variables: names the server sets itself are dropped (as
    documented: they can't change the prompt's shape); a key no template can name is a 400."""
    bad = next((k for k in kwargs if not k.isidentifier()), None)
    if bad is not None:
        raise ApiError(f"chat_template_kwargs: {bad!r} is not a template variable name", param="chat_template_kwargs")
    return {k: v for k, v in kwargs.items() if k not in _NOT_TEMPLATE_KWARGS}


def _describe_tools(messages: list[dict], tools: list[dict]) -> list[dict]:
    """A template that does not render tools: tell the model about them in the system
    message, and how to call one (the `json` parser reads that reply)."""
    text = ("You can call these functions:\n" + json.dumps([t["function"] for t in tools], ensure_ascii=False) +
            '\nTo call one, reply with only a JSON object: {"name": <function name>, "arguments": <object>}.')
    if messages[0]["role"] == "system":
        return [{**messages[0], "content": messages[0]["content"] + "\n\n" + text}] + messages[1:]
    return [{"role": "system", "content": text}] + messages


def _history_calls(calls: list[ToolCall], i: int) -> list[dict]:
    """Assistant tool calls sent back in the history: templates want arguments as objects."""
    out = []
    for c in calls:
        args = c.function.arguments
        if isinstance(args, str):
            args = _arguments(args, i)
        args = {} if args is None else args
        call = msgspec.to_builtins(c)
        out.append({**call, "function": {**call["function"], "arguments": args}, "name": c.function.name,
                    "arguments": args})
    return out


def _arguments(text: str, i: int):
    if not text.strip():
        return {}
    if not too_deep(text, MAX_DEPTH):
        try:
            return msgspec.json.decode(text)
        except (msgspec.DecodeError, RecursionError):
            pass
    raise ApiError(f"messages[{i}].tool_calls: arguments are not valid JSON (or nested deeper than {MAX_DEPTH} "
                   "levels)", param="messages")


# ---- completions: prompts ----

def completion_prompts(tok, body, max_prompts: int) -> list[list[int]]:
    """The prompts as token ids: one string, one token list, or a list of either (up to max_prompts)."""
    p = body.prompt
    if isinstance(p, str):
        p = [p]
    elif p and all(isinstance(x, int) for x in p):
        p = [p]
    if not p or not (all(isinstance(x, str) for x in p) or all(isinstance(x, list) and x for x in p)):
        raise ApiError("'prompt' must be a string, a list of strings, a token list or a list of token lists",
                       param="prompt")
    if len(p) > max_prompts:
        raise ApiError(f"'prompt' holds {len(p)} prompts; this server takes up to {max_prompts} per request "
                       "(--max-prompts-per-request)", param="prompt")
    if body.suffix:
        raise ApiError("'suffix' is not supported", param="suffix")
    if not isinstance(p[0], str):
        return p  # token ids and lengths are checked with the rest (check_request)
    if tok is None:
        raise ApiError("this model has no tokenizer: send the prompt as token ids", param="prompt")
    return [tok.encode(x) for x in p]


# ---- sampling ----

_PASSED = ("n", "min_tokens", "temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
           "repetition_penalty", "seed", "stop_token_ids", "ignore_eos", "skip_special_tokens",
           "include_stop_str_in_output", "allowed_token_ids", "bad_words")


def sampling_params(body: Sampling, chat: bool = True, max_n: int = 16) -> SamplingParams:
    """The request's SamplingParams; their values are checked with the rest (check_request)."""
    if body.stream_options is not None and not body.stream:
        raise ApiError("'stream_options' is only allowed with 'stream': true", param="stream_options")
    if body.n is not None and body.n > max_n:
        raise ApiError(f"n must be <= {max_n} on this server, got {body.n}", param="n")
    kw = {name: getattr(body, name) for name in _PASSED if getattr(body, name) is not None}
    if chat:
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
        if body.logprobs:
            kw["logprobs"] = body.top_logprobs or 0
    elif body.logprobs is not None:
        kw["logprobs"] = body.logprobs
        if body.echo:
            kw["prompt_logprobs"] = body.logprobs
    if body.prompt_logprobs is not None:
        if body.stream and body.prompt_logprobs > 0:  # vLLM's rule: they come with the whole response
            raise ApiError("'prompt_logprobs' are not available with 'stream': true", param="prompt_logprobs")
        kw["prompt_logprobs"] = body.prompt_logprobs
    mt = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
    kw["max_tokens"] = mt if mt is not None else None if chat else COMPLETION_MAX_TOKENS
    if body.stop is not None:
        kw["stop"] = [body.stop] if isinstance(body.stop, str) else body.stop
    if body.logit_bias:
        kw["logit_bias"] = body.logit_bias
    return SamplingParams(**kw)


def usage(prompt_tokens: int, completion_tokens: int, cached: int, reasoning: int = 0) -> dict:
    u = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
         "total_tokens": prompt_tokens + completion_tokens}
    if cached:
        u["prompt_tokens_details"] = {"cached_tokens": cached}
    if reasoning:
        u["completion_tokens_details"] = {"reasoning_tokens": reasoning}
    return u
