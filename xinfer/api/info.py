"""The routes about the server itself: the chat page, health, metrics, version, the model list and
the OpenAPI document."""
from __future__ import annotations

from pathlib import Path

from sanic import Sanic, response

from xinfer import __version__
from xinfer.api.schema import openapi
from xinfer.api.state import ApiState

WEB_PAGE = Path(__file__).parent / "web" / "index.html"


def register(app: Sanic, s: ApiState, protected) -> None:
    @app.get("/")
    async def index(request):
        return await response.file(WEB_PAGE, mime_type="text/html")

    @app.get("/health")
    async def health(request):
        c = s.client
        status = ("dead" if c.dead else "draining" if s.draining else
                  "ok" if c.ready is not None and s.launched else "loading")
        return response.json({"status": status}, status=200 if status == "ok" else 503)

    @app.get("/metrics")
    async def prometheus(request):
        return response.raw(s.metrics.render(), content_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/version")
    @protected
    async def version(request):
        return response.json({"version": __version__})

    @app.get("/v1/models")
    @protected
    async def models(request):
        extra = [_embedder_card(s)] if s.embedder is not None else []
        return response.json({"object": "list", "data": [_model_card(s)] + extra})

    @app.get("/openapi.json")
    @protected
    async def openapi_json(request):
        # Every route the app has, each POST with the struct its handler decodes (the route's ctx.body).
        routes = [(r.uri, r.methods, getattr(r.ctx, "body", None)) for r in request.app.router.routes]
        return response.json(openapi(routes, __version__, secured=bool(s.opts.api_key)))

    @app.get("/v1/models/<model_id:path>")
    @protected
    async def model(request, model_id):
        if s.embedder is not None and model_id == s.embedder.name:
            return response.json(_embedder_card(s))
        s.check_model(model_id, strict=True)  # a listing: only the served names (aliases) exist
        return response.json(_model_card(s))


def _model_card(s: ApiState) -> dict:
    card = {"id": s.model_name, "object": "model", "created": 0, "owned_by": "xinfer",
            "max_model_len": s.max_model_len}
    if s.vision is not None:  # the chat page shows its image button for these
        card["input_modalities"] = ["text", "image"]
    return card


def _embedder_card(s: ApiState) -> dict:
    """--embedding-model's: it answers /v1/embeddings only."""
    return {"id": s.embedder.name, "object": "model", "created": 0, "owned_by": "xinfer",
            "max_model_len": s.embedder.model.max_len}
