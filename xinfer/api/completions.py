"""/v1/completions: prompts as text or token ids, several per request."""
from __future__ import annotations

import asyncio

from sanic import Sanic

from xinfer.api.protocol import completion_prompts, parse_body, sampling_params
from xinfer.api.state import ApiState
from xinfer.api.streaming import respond


def register(app: Sanic, s: ApiState, protected) -> None:
    @app.post("/v1/completions")
    @protected
    async def completions(request):
        s.admit()
        body = parse_body(request)
        s.check_model(body.get("model"))
        params = sampling_params(body, chat=False, max_n=s.opts.max_n)
        prompts = await asyncio.get_running_loop().run_in_executor(None, completion_prompts, s.tok, body)
        s.check(prompts, params)
        return await respond(s, request, body, prompts, params, None, chat=False)
