"""The offline Engine's chat with images: the same content parts as the API (`image_url` with a
data: URL or a file path, `image_base64`), and `{"type": "image", "image": <PIL image or path>}`."""
from __future__ import annotations

import base64
import urllib.parse

from PIL import Image

from xinfer.mm.base import PromptImageError, decode

IMAGE_TYPES = ("image", "image_url", "image_base64")


def chat_prompt(tok, processor, messages: list[dict], **template_kwargs) -> list[int]:
    """The conversation's prompt ids; with images, a Prompt carrying them."""
    norm, images = [], []
    for m in messages:
        content = m.get("content")
        if isinstance(content, list):
            if any(p.get("type") in IMAGE_TYPES for p in content):
                images += [_image(p, len(images) + k) for k, p in enumerate(
                    q for q in content if q.get("type") in IMAGE_TYPES)]
                content = [{"type": "image"} if p.get("type") in IMAGE_TYPES
                           else {"type": "text", "text": p.get("text", "")} for p in content]
            else:
                content = "".join(p.get("text", "") for p in content)
            m = {**m, "content": content}
        norm.append(m)
    if images and processor is None:
        raise PromptImageError("this model takes no images (text only)")
    ids = tok.encode_chat(norm, **template_kwargs)
    return ids if processor is None else processor.with_images(ids, images)


def _image(part: dict, i: int):
    src = part.get(part["type"])
    if isinstance(src, dict):
        src = src.get("url")
    if isinstance(src, Image.Image):
        return src
    if isinstance(src, bytes):
        return decode(src, i)
    if not isinstance(src, str) or not src:
        raise PromptImageError(f"image {i}: give a PIL image, a file path or a data: URL")
    if src.startswith("data:"):
        head, _, payload = src.partition(",")
        data = base64.b64decode(payload) if head.endswith(";base64") else urllib.parse.unquote_to_bytes(payload)
        return decode(data, i)
    path = urllib.parse.unquote(urllib.parse.urlparse(src).path) if src.startswith("file:") else src
    with open(path, "rb") as f:
        return decode(f.read(), i)
