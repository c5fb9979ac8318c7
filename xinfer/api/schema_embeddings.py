"""The body of /v1/embeddings (OpenAI's) as a bounded msgspec struct, as schema.py's are; the
number of inputs (--max-prompts-per-request) and empty ones are checked after decoding
(xinfer/api/embeddings.py), the token ids and lengths by check_request."""
from __future__ import annotations

from typing import Annotated, Literal

from msgspec import Meta

from xinfer.api.schema import I64_MAX, Body, TokenId

# One string, one token list, or a list of either (protocol: one form per request)
EmbeddingInput = str | Annotated[list[str | TokenId | list[TokenId]], Meta(min_length=1)]


class EmbeddingRequest(Body, kw_only=True):
    input: EmbeddingInput
    encoding_format: Literal["float", "base64"] = "float"  # base64: little-endian float32 bytes
    dimensions: Annotated[int, Meta(ge=1, le=I64_MAX)] | None = None  # <= the model's hidden size
    user: Annotated[str, Meta(max_length=1024)] | None = None  # accepted, ignored
