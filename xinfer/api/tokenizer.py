"""/tokenize, /detokenize and /tokenizer_info: the served model's tokenizer, without generating."""
from __future__ import annotations

import asyncio
import functools

from sanic import Sanic, response

from xinfer.api.protocol import ApiError, chat_text, parse_body, parse_tools
from xinfer.api.state import ApiState


def register(app: Sanic, s: ApiState, protected) -> None:
    @app.post("/tokenize")
    @protected
    async def tokenize(request):
        body = parse_body(request)
        s.need_tokenizer()
        tok = s.tok
        loop = asyncio.get_running_loop()
        if body.get("messages") is not None:
            tools, _ = parse_tools(body)
            text = await loop.run_in_executor(None, chat_text, tok, body, tools, not s.opts.disable_reasoning)
            ids = tok.encode(text, add_special_tokens=bool(body.get("add_special_tokens", False)))
        elif isinstance(body.get("prompt"), str):
            ids = await loop.run_in_executor(None, functools.partial(
                tok.encode, body["prompt"], add_special_tokens=bool(body.get("add_special_tokens", True))))
        else:
            raise ApiError("send 'prompt' (a string) or 'messages'", param="prompt")
        out = {"count": len(ids), "max_model_len": s.max_model_len, "tokens": ids}
        if body.get("return_token_strs"):
            out["token_strs"] = [s.strs(t) for t in ids]
        return response.json(out)

    @app.post("/detokenize")
    @protected
    async def detokenize(request):
        body = parse_body(request)
        s.need_tokenizer()
        ids = body.get("tokens")
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ApiError("'tokens' must be a list of token ids", param="tokens")
        bad = [t for t in ids if not 0 <= t < s.vocab_size]
        if bad:
            raise ApiError(f"unknown token id {bad[0]} (vocabulary size {s.vocab_size})", param="tokens")
        skip = bool(body.get("skip_special_tokens", True))
        return response.json({"prompt": s.tok.decode(ids, skip_special_tokens=skip)})

    @app.get("/tokenizer_info")
    @protected
    async def tokenizer_info(request):
        s.need_tokenizer()
        tok, markers = s.tok, s.markers
        return response.json({
            "model": s.model_name, "vocab_size": s.vocab_size, "max_model_len": s.max_model_len,
            "bos_token": tok.bos_token or None, "bos_token_id": tok.bos_token_id,
            "eos_token": tok.eos_token or None, "eos_token_ids": tok.eos_token_ids,
            "add_bos_token": tok.add_bos, "chat_template": s.template,
            "tool_parser": s.tool_parser, "reasoning_markers": list(markers) if markers else None})
