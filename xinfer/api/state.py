"""What the API routes share: the served model's facts, the flags, the metrics, the engine client
and the checks every generation route makes before it queues work (admission, model name, room)."""
from __future__ import annotations

import asyncio
import contextlib
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from xinfer.api.engine_client import EngineClient
from xinfer.api.metrics import Metrics
from xinfer.api.protocol import ApiError, decode, warn_unknown_fields
from xinfer.api.responses import TokenStrings
from xinfer.config import EngineConfig
from xinfer.sampling_params import check_request, tokenize_bad_words


HEAVY_JOBS = max(2, os.cpu_count() or 2)
_HEAVY = ThreadPoolExecutor(HEAVY_JOBS, thread_name_prefix="xinfer-heavy")


@dataclass
class ApiOptions:
    """`xinfer serve` flags of the API process (the engine's are in EngineConfig)."""
    api_key: str | None = None  # when set, every route but /, /health and /metrics needs it
    max_n: int = 16
    max_prompts: int = 256  # prompts in one /v1/completions request
    max_request_bytes: int = 8 << 20
    enforce_parser: str | None = None  # tool-call parser; None: chosen from the model
    disable_reasoning: bool = False  # the default of a request's `thinking` flag
    trust_request_chat_template: bool = False  # a request may bring its own chat template (else a 400)
    enable_tool_grammar: bool = False  # tool_choice auto: a call, once it opens, follows its schema
    reasoning_parser: str | None = None  # markers by name; None: from the chat template
    ssl_certfile: str | None = None  # with ssl_keyfile: HTTPS on the API port (and the --ui-server one)
    ssl_keyfile: str | None = None
    served_model_names: list[str] | None = None  # the first is listed and echoed; None: the model's own name
    strict_model_names: bool = False  # a request naming another model gets 404 (else any name is served)
    strict_max_tokens: bool = False  # max_tokens over the room left is a 400 (else clamped to it)
    access_log: bool = False  # one log line per request
    keepalive_s: float = 15.0  # SSE comment after this long without output
    request_timeout: float = 0.0  # a generation request still running after this long is ended (408); 0: off
    mcp_servers: dict | None = None  # name -> server spec (xinfer/api/mcp_servers.py load_config); None: no MCP
    mcp_max_rounds: int = 5  # rounds of MCP calls in one chat request
    mcp_timeout: float = 30.0  # seconds per MCP tool call
    embedding_model: str | None = None  # an HF encoder folder that serves /v1/embeddings; None: the served model
    embedding_pooling: str = "mean"  # its pooling: mean or cls
    # images in chat requests (xinfer/api/media.py): data: URLs always; http(s) and files only where allowed
    allowed_media_domains: list[str] | None = None  # hosts image URLs may be fetched from; None: no fetching
    allowed_local_media_path: str | None = None  # a folder image file paths may name; None: no files
    max_image_bytes: int = 20 << 20
    media_fetch_timeout: float = 10.0  # seconds for one image URL
    limit_mm_per_prompt: int = 4  # images in one request
    # HTTP-level limits (xinfer/api/guard.py)
    allowed_hosts: list[str] | None = None  # None: loopback names when bound to loopback, else any
    allowed_origins: list[str] = field(default_factory=list)  # cross-origin pages allowed to POST ("*": any)
    keep_alive_timeout: float = 5.0  # an idle connection is closed after this long
    request_read_timeout: float = 30.0  # a request's head and body must arrive within this
    max_connections_per_client: int | None = None  # None: 64 per address, loopback not counted; 0: no cap


@dataclass
class ApiState:
    """One per app, on app.ctx.state."""
    opts: ApiOptions
    tok: object  # the model's tokenizer; None for a model without one (token ids only)
    model_names: list[str]  # the served names: the first is listed and echoed, all answer /v1/models/{id}
    vocab_size: int
    template: str | None  # the chat template
    tool_parser: str
    markers: tuple[str, str] | None  # reasoning start/end markers
    strs: TokenStrings
    metrics: Metrics
    config: EngineConfig
    max_queued_requests: int  # beyond the running batch, before admit() answers 503
    hidden_size: int = 0  # the model's (the most /v1/embeddings' `dimensions` may be); 0: unknown
    client: EngineClient | None = None  # made when the server starts (its sockets need the loop)
    draining: bool = False
    active: int = 0  # generation requests admitted and not yet answered
    launched: bool = False  # under the supervisor: its SIGUSR1 says every process is ready
    mcp: object = None  # the running MCP servers (xinfer/api/mcp_servers.Servers), made when the server starts
    embedder: object = None  # --embedding-model's EmbedBatcher (xinfer/api/embed_batcher.py); None: not given
    vision: object = None  # a vision model's image processor (xinfer/mm/); None: the model takes text only

    async def offload(self, fn, *args):
        """Run heavy work (templates, tokenizing, large responses) off the event loop, at most
        HEAVY_JOBS at once: /health and the streams keep answering while a huge prompt is tokenized."""
        return await asyncio.get_running_loop().run_in_executor(_HEAVY, fn, *args)

    @contextlib.contextmanager
    def admitted(self):
        """A generation request, from its first byte to its last: 503 with Retry-After while loading,
        draining or full. Counted from admission, not from when it reaches the engine: 500 clients
        arriving at once are all still being tokenized when the limit must already hold."""
        self._admit()
        self.active += 1
        try:
            yield
        finally:
            self.active -= 1

    def _admit(self) -> None:
        c = self.client
        if c.ready is None or c.dead or self.draining or not self.launched:
            reason, why, retry = ("draining", "shutting down", 5) if self.draining else ("loading", "not ready", 5)
        elif self.active >= self.config.max_num_seqs + self.max_queued_requests:
            reason, why, retry = "full", f"full: too many requests queued (limit {self.max_queued_requests})", 1
        else:
            return
        self.metrics.reject(reason)
        raise ApiError(f"the server is {why}; retry later", status=503, kind="service_unavailable",
                       retry_after=retry)

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    @property
    def max_model_len(self) -> int:
        """The engine's context once it is ready (capped by what its KV cache holds), else the configured one."""
        ready = self.client.ready if self.client is not None else None
        return ready.max_model_len if ready is not None else self.config.max_model_len

    def read(self, request, kind: type):
        """A generation route's body: decoded into `kind` (a 400 at fault), its unknown fields logged,
        its model name checked."""
        body = decode(request.body, kind)
        warn_unknown_fields(request.body, kind)
        self.check_model(body.model)
        return body

    def check_model(self, name, strict: bool | None = None) -> None:
        """A single-model server answers any name (as llama-server does), unless --strict-model-names."""
        strict = self.opts.strict_model_names if strict is None else strict
        if strict and name is not None and name not in self.model_names and name != "default":
            raise ApiError(f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                           status=404, kind="not_found_error", param="model", code="model_not_found")

    def check(self, prompts, params) -> None:
        """The one check of a request before it is queued (the engine core trusts it): sampling
        params, token ids, room in the context and in the KV cache. A max_tokens over the room left
        is cut to it (llama-server) unless --strict-max-tokens (vLLM's 400)."""
        ready = self.client.ready
        tokenize_bad_words(self.tok, params)
        for ids in prompts:
            check_request(ids, params, self.vocab_size, self.max_model_len, ready.num_blocks or None,
                          ready.block_size, clamp=not self.opts.strict_max_tokens)

    def need_tokenizer(self) -> None:
        if self.tok is None:
            raise ApiError("this model has no tokenizer: send token ids to /v1/completions", param="prompt")
