"""/v1/chat/completions: the chat template, tool-call and reasoning parsing set up per request."""
from __future__ import annotations

import uuid

from sanic import Sanic

from xinfer.api.protocol import chat_text, decode, parse_tools, sampling_params, warn_unknown_fields
from xinfer.api.schema import ChatRequest
from xinfer.api.state import ApiState
from xinfer.api.streaming import respond
from xinfer.ipc.text import ParseSpec
from xinfer.parsers import get_tool_parser, starts_in_reasoning


def register(app: Sanic, s: ApiState, protected) -> None:
    @app.post("/v1/chat/completions", ctx_body=ChatRequest)
    @protected
    async def chat_completions(request):
        with s.admitted():
            body = decode(request.body, ChatRequest)
            warn_unknown_fields(request.body, ChatRequest)
            s.check_model(body.model)
            params = sampling_params(body, chat=True, max_n=s.opts.max_n)
            ids, spec = await s.offload(_prepare, s, body)
            s.check([ids], params)
            return await respond(s, request, body, [ids], params, spec, chat=True)


def _prepare(s: ApiState, body: ChatRequest) -> tuple[list[int], ParseSpec]:
    """(prompt ids, what the parser process does with the output) for a chat request."""
    s.need_tokenizer()
    tools, choice = parse_tools(body)
    text = chat_text(s.tok, body, tools, not s.opts.disable_reasoning, describe_tools=choice is not None)
    spec = ParseSpec(reasoning=s.markers, id_prefix="call_" + uuid.uuid4().hex[:24])
    if choice is not None:
        # A model whose template has no call format of its own is asked for plain JSON.
        spec.tool_parser = s.tool_parser if s.tool_parser != "passthrough" else "json"
        spec.tools = tools
        if choice != "auto":
            prefix = get_tool_parser(spec.tool_parser).forced_prefix(None if choice == "required" else choice)
            if prefix:
                spec.prefix = prefix
                text += prefix
            spec.single_call = choice != "required"
    spec.in_reasoning = bool(s.markers) and starts_in_reasoning(text, s.markers)
    return s.tok.encode(text, add_special_tokens=False), spec
