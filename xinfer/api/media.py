"""Images in chat requests: where their bytes come from, what is refused, and the decode.

A part is `{"type": "image_url", "image_url": {"url": ...}}` (OpenAI), `{"type": "image_url",
"image_url": "..."}` or `{"type": "image_base64", "image_base64": "data:..."}`. `data:` URLs are
always read; http(s) URLs only from --allowed-media-domains (a server that fetches any URL a
client names is an SSRF hole into its own network), files only under --allowed-local-media-path.
Everything here runs in the API's thread pool (ApiState.offload), never on the event loop."""
from __future__ import annotations

import base64
import binascii
import os
import urllib.error
import urllib.parse
import urllib.request

from xinfer.api.protocol import ApiError
from xinfer.mm.base import Prompt, PromptImageError
from xinfer.mm.base import decode as mm_decode

IMAGE_PARTS = ("image_url", "image_base64")
MAX_REDIRECTS = 3


def image_parts(body) -> list:
    """The request's image parts, in the order the chat template renders them."""
    return [p for m in body.messages if isinstance(m.content, list) for p in m.content if p.type in IMAGE_PARTS]


def load_images(s, body) -> list:
    """The request's images decoded (PIL), in prompt order; a 400 for any the server won't read."""
    parts = image_parts(body)
    limit = s.opts.limit_mm_per_prompt
    if len(parts) > limit:
        raise ApiError(f"the request holds {len(parts)} images; this server takes up to {limit} per prompt "
                       "(--limit-mm-per-prompt)", param="messages")
    return [decode(read_source(s.opts, _url(p, i)), i) for i, p in enumerate(parts)]


def with_images(s, ids: list[int], images: list) -> Prompt:
    """Token ids with each image's placeholder expanded into its tokens, and the images attached."""
    try:
        return s.vision.with_images(ids, images)
    except PromptImageError as e:
        raise ApiError(str(e), param="messages") from None


def _url(part, i: int) -> str:
    src = part.image_base64 if part.type == "image_base64" else part.image_url
    if src is not None and not isinstance(src, str):
        src = src.url
    if not src:
        raise ApiError(f"image {i}: the part of type {part.type!r} has no {part.type!r} field", param="messages")
    return src


def read_source(opts, url: str) -> bytes:
    """The bytes an image part names."""
    limit = opts.max_image_bytes
    scheme = url.split(":", 1)[0].lower() if ":" in url[:16] else ""
    if scheme == "data":
        return _data_url(url, limit)
    if scheme in ("http", "https"):
        return _fetch(opts, url, limit)
    if scheme == "file" or (not scheme and url.startswith("/")):
        return _local(opts, urllib.parse.unquote(urllib.parse.urlparse(url).path) if scheme else url, limit)
    raise ApiError(f"image URL scheme {scheme or url[:16]!r} is not supported: send a data: URL "
                   "(or http(s)://, where the server allows it)", param="messages")


def _data_url(url: str, limit: int) -> bytes:
    head, sep, payload = url.partition(",")
    if not sep:
        raise ApiError("a data: URL needs a ',' before its payload", param="messages")
    if len(payload) * 3 // 4 > limit:
        raise _too_big(limit)
    if head.endswith(";base64"):
        try:
            data = base64.b64decode(payload, validate=False)
        except (binascii.Error, ValueError):
            raise ApiError("the data: URL's payload is not valid base64", param="messages") from None
    else:
        data = urllib.parse.unquote_to_bytes(payload)
    if len(data) > limit:
        raise _too_big(limit)
    return data


def _too_big(limit: int) -> ApiError:
    return ApiError(f"the image is larger than {limit} bytes (--max-image-bytes)", param="messages")


def _allowed_host(opts, url: str) -> bool:
    host = (urllib.parse.urlparse(url).hostname or "").lower().rstrip(".")
    return host in {d.lower().rstrip(".") for d in opts.allowed_media_domains or ()}


class _Redirects(urllib.request.HTTPRedirectHandler):
    """Every hop stays on an allowed domain (a redirect is the classic way round an allowlist)."""

    max_redirections = MAX_REDIRECTS

    def __init__(self, opts):
        self.opts = opts

    def redirect_request(self, req, fp, code, msg, headers, newurl):
        if not _allowed_host(self.opts, newurl) or urllib.parse.urlparse(newurl).scheme not in ("http", "https"):
            raise ApiError("the image URL redirects to a domain this server does not fetch from", param="messages")
        return super().redirect_request(req, fp, code, msg, headers, newurl)


def _fetch(opts, url: str, limit: int) -> bytes:
    if not opts.allowed_media_domains:
        raise ApiError("this server does not fetch image URLs: send the image as a data: URL (or start the "
                       "server with --allowed-media-domains)", param="messages")
    if not _allowed_host(opts, url):
        raise ApiError("the image URL's domain is not in --allowed-media-domains", param="messages")
    opener = urllib.request.build_opener(_Redirects(opts))
    try:
        with opener.open(urllib.request.Request(url, headers={"User-Agent": "xinfer"}),
                         timeout=opts.media_fetch_timeout) as r:
            declared = r.headers.get("Content-Length")
            if declared and declared.isdigit() and int(declared) > limit:
                raise _too_big(limit)
            data = r.read(limit + 1)
    except ApiError:
        raise
    except urllib.error.HTTPError as e:
        raise ApiError(f"fetching the image failed: HTTP {e.code}", param="messages") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        reason = getattr(e, "reason", None) or e
        raise ApiError(f"fetching the image failed: {reason}", param="messages") from None
    if len(data) > limit:
        raise _too_big(limit)
    return data


def _local(opts, path: str, limit: int) -> bytes:
    root = opts.allowed_local_media_path
    if not root:
        raise ApiError("this server does not read image files: send the image as a data: URL (or start the "
                       "server with --allowed-local-media-path)", param="messages")
    real, base = os.path.realpath(path), os.path.realpath(root)
    if os.path.commonpath([real, base]) != base or not os.path.isfile(real):
        raise ApiError("the image file is not a file under --allowed-local-media-path", param="messages")
    if os.path.getsize(real) > limit:
        raise _too_big(limit)
    with open(real, "rb") as f:
        return f.read(limit + 1)


def decode(data: bytes, i: int = 0):
    try:
        return mm_decode(data, i)
    except PromptImageError as e:
        raise ApiError(str(e), param="messages") from None
