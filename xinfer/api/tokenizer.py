"""/tokenize, /detokenize and /tokenizer_info: the served model's tokenizer, without generating."""
from __future__ import annotations

import msgspec
from sanic import Sanic, response

from xinfer.api.media import load_images, with_images
from xinfer.api.protocol import ApiError, chat_text, decode, parse_tools
from xinfer.api.schema import DetokenizeRequest, TokenizeRequest
from xinfer.api.state import ApiState


def register(app: Sanic, s: ApiState, protected) -> None:
    @app.post("/tokenize", ctx_body=TokenizeRequest)
    @protected
    async def tokenize(request):
        body = decode(request.body, TokenizeRequest)
        s.need_tokenizer()
        if body.messages is None and body.prompt is None:
            raise ApiError("send 'prompt' (a string) or 'messages'", param="prompt")
        return response.raw(await s.offload(_tokenize, s, body), content_type="application/json")

    @app.post("/detokenize", ctx_body=DetokenizeRequest)
    @protected
    async def detokenize(request):
        body = decode(request.body, DetokenizeRequest)
        s.need_tokenizer()
        bad = next((t for t in body.tokens if t >= s.vocab_size), None)
        if bad is not None:
            raise ApiError(f"unknown token id {bad} (vocabulary size {s.vocab_size})", param="tokens")
        text = await s.offload(s.tok.decode, body.tokens, body.skip_special_tokens)
        return response.json({"prompt": text})

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


def _tokenize(s: ApiState, body: TokenizeRequest) -> bytes:
    """The whole job, response bytes included, off the event loop (a 5 MB prompt is ~1.4M ids)."""
    tok, special = s.tok, body.add_special_tokens
    if body.messages is not None:
        tools, _ = parse_tools(body)
        images = load_images(s, body) if s.vision is not None else []
        text = chat_text(tok, body, tools, not s.opts.disable_reasoning,
                         trust_template=s.opts.trust_request_chat_template, images=s.vision is not None)
        ids = tok.encode(text, add_special_tokens=bool(special))
        if s.vision is not None:  # image tokens count as the engine counts them
            ids = list(with_images(s, ids, images))
    else:
        ids = tok.encode(body.prompt, add_special_tokens=special is not False)
    out = {"count": len(ids), "max_model_len": s.max_model_len, "tokens": ids}
    if body.return_token_strs:
        out["token_strs"] = [s.strs(t) for t in ids]
    return msgspec.json.encode(out)
