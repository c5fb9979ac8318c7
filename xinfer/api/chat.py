"""/v1/chat/completions: the chat template, tool-call and reasoning parsing set up per request."""
from __future__ import annotations

import uuid

from sanic import Sanic

from xinfer.api import mcp_chat
from xinfer.api.constraints import after_reasoning, checked, for_tools, requested
from xinfer.api.media import load_images, with_images
from xinfer.api.protocol import chat_text, parse_tools, sampling_params
from xinfer.api.schema import ChatRequest
from xinfer.api.state import ApiState
from xinfer.api.streaming import respond
from xinfer.ipc.text import ParseSpec
from xinfer.parsers import get_tool_parser, starts_in_reasoning


def register(app: Sanic, s: ApiState, protected) -> None:
    mcp_chat.install(app, s)  # --mcp-config / --mcp-command: the server runs MCP tools for the model

    @app.post("/v1/chat/completions", ctx_body=ChatRequest)
    @protected
    async def chat_completions(request):
        with s.admitted():
            body = s.read(request, ChatRequest)
            if mcp_chat.applies(s, body):
                return await mcp_chat.respond(s, request, body, prepare)
            params = sampling_params(body, chat=True, max_n=s.opts.max_n)
            ids, spec = await s.offload(prepare, s, body, params)
            s.check([ids], params)
            return await respond(s, request, body, [ids], params, spec, chat=True)


def prepare(s: ApiState, body: ChatRequest, params) -> tuple[list[int], ParseSpec]:
    """(prompt ids, what the parser process does with the output) for a chat request; sets the
    request's grammar (params.structured) for a forced tool call or a structured output."""
    s.need_tokenizer()
    tools, choice = parse_tools(body)
    images = load_images(s, body) if s.vision is not None else []
    text = chat_text(s.tok, body, tools, not s.opts.disable_reasoning, describe_tools=choice is not None,
                     trust_template=s.opts.trust_request_chat_template, images=s.vision is not None)
    spec = ParseSpec(reasoning=s.markers, id_prefix="call_" + uuid.uuid4().hex[:24])
    tool_grammar, asked = None, requested(body)
    if choice is not None:
        # A model whose template has no call format of its own is asked for plain JSON.
        spec.tool_parser = s.tool_parser if s.tool_parser != "passthrough" else "json"
        spec.tools = tools
        parser = get_tool_parser(spec.tool_parser)
        parallel = body.parallel_tool_calls is not False
        if choice != "auto" or (s.opts.enable_tool_grammar and asked is None):
            tool_grammar = for_tools(parser, tools, choice, parallel)
        if choice != "auto" and tool_grammar is None:  # no grammar for this family: force the opening
            prefix = parser.forced_prefix(None if choice == "required" else choice)
            if prefix:
                spec.prefix = prefix
                text += prefix
        spec.single_call = choice not in ("auto", "required") or not parallel
        spec.held = tool_grammar is not None and choice != "auto" and parser.ARGS_STYLE == "json"
    spec.in_reasoning = bool(s.markers) and starts_in_reasoning(text, s.markers)
    so = tool_grammar or asked
    if so is not None and spec.in_reasoning:
        so = after_reasoning(so, s.markers[1])
    params.structured = checked(so)
    ids = s.tok.encode(text, add_special_tokens=False)
    return (ids if s.vision is None else with_images(s, ids, images)), spec
