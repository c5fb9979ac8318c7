"""/v1/completions: prompts as text or token ids, several per request."""
from __future__ import annotations


from sanic import Sanic

from xinfer.api.constraints import checked, requested
from xinfer.api.protocol import completion_prompts, sampling_params
from xinfer.api.schema import CompletionRequest
from xinfer.api.state import ApiState
from xinfer.api.streaming import respond


def register(app: Sanic, s: ApiState, protected) -> None:
    @app.post("/v1/completions", ctx_body=CompletionRequest)
    @protected
    async def completions(request):
        with s.admitted():
            body = s.read(request, CompletionRequest)
            params = sampling_params(body, chat=False, max_n=s.opts.max_n)
            params.structured = requested(body)
            prompts = await s.offload(_prepare, s, body, params)
            s.check(prompts, params)
            return await respond(s, request, body, prompts, params, None, chat=False)


def _prepare(s: ApiState, body, params) -> list[list[int]]:
    checked(params.structured)
    return completion_prompts(s.tok, body, s.opts.max_prompts)
