"""Gemma 3 and Mistral 3 with images, on tiny random models built by transformers: the processors'
pixel values and prompt tokens equal transformers', and so do the logits of an image prompt batched
with a text-only one (Gemma 3: an image's tokens see each other both ways, with chunks smaller than
an image, a sliding window inside it, and a prefix-cache hit that ends inside it); the attention
mask of the bidirectional spans on its own; the chat API takes an image for each family."""
import json

import numpy as np
import pytest
import torch
import transformers as tf
from tokenizers import Tokenizer, decoders
from tokenizers.models import BPE
from transformers.models.gemma3.image_processing_pil_gemma3 import (
    Gemma3ImageProcessorPil,
)
from transformers.models.pixtral.image_processing_pil_pixtral import (
    PixtralImageProcessorPil,
)

from ops.attention import AttnMetadata, TorchBackend
from tests.conftest import start_server, stop_server
from tests.test_vision import _data_url, _image, _post, _run
from xinfer import Engine, EngineConfig
from xinfer.ipc.media import ImageData, whole_images
from xinfer.loader import load_model_info
from xinfer.mm import processor_for

NEWLINES = ["\n" * k for k in range(1, 5)]
G_BOI, G_IMG, G_EOI = 128, 129, 130
M_IMG, M_BREAK, M_END = 128, 129, 130
TEMPLATE = (
    "{% for m in messages %}<turn>{{ m.role }}\n"
    "{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
    "{% if p.type == 'image' %}IMAGE{% else %}{{ p.text }}{% endif %}"
    "{% endfor %}{% endif %}\n{% endfor %}{% if add_generation_prompt %}<turn>assistant\n{% endif %}")


def _tokenizer(dest, specials, image):
    chars = [chr(c) for c in range(32, 127)] + ["\n"]
    vocab = {"<s>": 0, "</s>": 1, **{ch: i + 2 for i, ch in enumerate(chars)}}
    vocab.update({t: 128 + i for i, t in enumerate(specials + ["<turn>"] + NEWLINES[1:])})
    tok = Tokenizer(BPE(vocab=vocab, merges=[], unk_token="?"))
    tok.add_special_tokens(["<s>", "</s>"] + specials + ["<turn>"])
    tok.add_tokens(NEWLINES[1:])  # runs of newlines are one token each, as in Gemma's vocabulary
    tok.decoder = decoders.Fuse()
    tok.save(str(dest / "tokenizer.json"))
    (dest / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE.replace("IMAGE", image),
                                                            "bos_token": "<s>"}))
    return tok


def _perturb(model):
    with torch.no_grad():  # random init leaves norms at 1 and biases at 0: make every weight matter
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


TEXT = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    """64x64 images in 8-pixel patches: 64 patches pooled to 16 soft tokens; a 6-token window on
    the sliding layers, shorter than an image."""
    torch.manual_seed(0)
    text = tf.Gemma3TextConfig(**TEXT, sliding_window=6, query_pre_attn_scalar=24,
                               layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    vision = tf.SiglipVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                                   image_size=64, patch_size=8, vision_use_head=False)
    model = _perturb(tf.Gemma3ForConditionalGeneration(tf.Gemma3Config(
        text_config=text, vision_config=vision, mm_tokens_per_image=16, boi_token_index=G_BOI,
        image_token_index=G_IMG, eoi_token_index=G_EOI)))
    path = tmp_path_factory.mktemp("gemma3_vl")
    model.save_pretrained(path)
    hp = Gemma3ImageProcessorPil(size={"height": 64, "width": 64})
    hp.save_pretrained(path)
    tok = _tokenizer(path, ["<start_of_image>", "<image_soft_token>", "<end_of_image>"], "<start_of_image>")
    return str(path), model, hp, tok


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    """8-pixel patches merged 2x2, longest edge 64 pixels: up to 4x4 [IMG] tokens an image."""
    torch.manual_seed(1)
    vision = tf.PixtralVisionConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                                    image_size=64, patch_size=8, head_dim=16, hidden_act="silu")
    model = _perturb(tf.Mistral3ForConditionalGeneration(tf.Mistral3Config(
        text_config=tf.MistralConfig(**TEXT, sliding_window=None), vision_config=vision, image_token_index=M_IMG,
        spatial_merge_size=2, multimodal_projector_bias=True, tie_word_embeddings=False)))
    path = tmp_path_factory.mktemp("mistral3")
    model.save_pretrained(path)
    hp = PixtralImageProcessorPil(patch_size=16, size={"longest_edge": 64})
    hp.save_pretrained(path)
    tok = _tokenizer(path, ["[IMG]", "[IMG_BREAK]", "[IMG_END]"], "[IMG]")
    return str(path), model, hp, tok


def _engine(path):
    return Engine(EngineConfig(model=path, block_size=4, num_kv_blocks=400, prefill_chunk_size=8,
                               max_num_batched_tokens=24, max_num_seqs=8))


SIZES = [(50, 37, "RGB"), (300, 120, "RGBA"), (13, 20, "L"), (64, 64, "P"), (7, 200, "RGB")]


def test_gemma_pixel_values_and_prompt_match_transformers(gemma):
    path, _, hp, tok = gemma
    info = load_model_info(path)
    proc = processor_for(info.config, info.tokenizer)
    for w, h, mode in SIZES:
        img = _image(w, h, w * h, mode)
        got = proc.pixel_values(proc.prepare(img))
        want = hp(images=[img], return_tensors="np")["pixel_values"][0]
        assert got.shape == want.shape and np.abs(got - want).max() < 1e-5
    # the placeholder expands as transformers' processor writes it into the text, newlines merged
    for text in ["ab\nX\ncd", "X\n\nz", "XX", "a X b"]:
        rendered = text.replace("X", "<start_of_image>")
        ids = info.tokenizer.encode(rendered, add_special_tokens=False)
        ims = [proc.prepare(_image(8, 8, i)) for i in range(text.count("X"))]
        got = proc.expand(ids, ims)
        seq = "\n\n<start_of_image>" + "<image_soft_token>" * 16 + "<end_of_image>\n\n"
        assert got == tok.encode(text.replace("X", seq), add_special_tokens=False).ids, text
        assert [got[i.offset:i.offset + i.length] for i in ims] == [[G_IMG] * 16] * len(ims)


def test_mistral_pixel_values_and_prompt_match_transformers(mistral):
    path, _, hp, _ = mistral
    info = load_model_info(path)
    proc = processor_for(info.config, info.tokenizer)
    for w, h, mode in SIZES:
        img = _image(w, h, w * h, mode)
        im = proc.prepare(img)
        want = hp(images=[img], return_tensors="np")
        assert (im.height, im.width) == tuple(want["image_sizes"][0])
        got = proc.pixel_values(im)
        assert got.shape == want["pixel_values"][0].shape and np.abs(got - want["pixel_values"][0]).max() < 1e-5
        toks, _ = proc.replacement(im)
        rows, cols = im.height // 16, im.width // 16
        assert toks == ([M_IMG] * cols + [M_BREAK]) * (rows - 1) + [M_IMG] * cols + [M_END]
        assert im.length == len(toks)


def _gemma_reference(model, seq, imgs, hp):
    full = torch.tensor([seq.prompt_ids + seq.output_ids])
    kw = {}
    if imgs:
        kw = dict(pixel_values=hp(images=imgs, return_tensors="pt")["pixel_values"],
                  token_type_ids=(full == G_IMG).long())
    with torch.no_grad():
        return model(input_ids=full, **kw).logits[0, len(seq.prompt_ids) - 1:-1]


def _mistral_reference(model, seq, imgs, hp):
    full = torch.tensor([seq.prompt_ids + seq.output_ids])
    kw = {}
    if imgs:
        px = hp(images=imgs, return_tensors="pt")
        kw = dict(pixel_values=px["pixel_values"], image_sizes=px["image_sizes"])
    with torch.no_grad():
        return model(input_ids=full, **kw).logits[0, len(seq.prompt_ids) - 1:-1]


def _close(got, want, seq):
    assert got.shape == want.shape
    assert (got - want).abs().max().item() < 1e-4
    assert torch.equal(got.argmax(-1), torch.tensor(seq.output_ids))


def test_gemma_logits_match_transformers(gemma):
    path, model, hp, _ = gemma
    a, b = _image(56, 40, 1), _image(30, 30, 2)
    prompts = [([5, 6, 7, G_BOI, 9, 10, 11, G_BOI, 20, 21], [a, b]),  # two images, each longer than a chunk
               ([40, 41, 42, 43, 44], []),  # text only, in the same batch
               ([G_BOI, 33], [b])]  # an image first
    eng = _engine(path)
    try:
        for (seq, got), (_, imgs) in zip(_run(eng, prompts), prompts):
            _close(got, _gemma_reference(model, seq, imgs, hp), seq)
        # the next request shares the first's blocks up to inside its second image: the rest of that
        # image is computed with the cached part's K/V and sees its own later tokens
        _run(eng, [([7, 8, 9, G_BOI, 11], [a])], steps=2)
        (seq, got), = _run(eng, [([7, 8, 9, G_BOI, 60, 61], [a])], steps=4)
        assert seq.prompt_ids.index(G_IMG) < seq.num_cached_tokens < seq.prompt_ids.index(G_EOI)
        _close(got, _gemma_reference(model, seq, [a], hp), seq)
    finally:
        eng.close()


def test_mistral_logits_match_transformers(mistral):
    path, model, hp, _ = mistral
    a, b = _image(64, 40, 3), _image(20, 50, 4)
    prompts = [([5, 6, M_IMG, 9, 10, M_IMG, 20], [a, b]), ([40, 41, 42], []), ([M_IMG, 33], [b])]
    eng = _engine(path)
    try:
        for (seq, got), (_, imgs) in zip(_run(eng, prompts), prompts):
            _close(got, _mistral_reference(model, seq, imgs, hp), seq)
    finally:
        eng.close()


def test_bidirectional_spans_mask_and_chunks():
    """Rows in a span see the whole span (and nothing past the window); a chunk never ends inside a
    whole image: cut back to its start, or on to its end."""
    torch.manual_seed(0)
    bs, n, hkv, d = 4, 12, 1, 8
    k_cache, v_cache = torch.randn(4, bs, hkv, d), torch.randn(4, bs, hkv, d)
    q = torch.randn(n - 2, 2, d)  # the last 10 of 12 positions, span [3, 9)
    meta = AttnMetadata(torch.tensor([0, n - 2], dtype=torch.int32), torch.tensor([n], dtype=torch.int32),
                        torch.tensor([[0, 1, 2]], dtype=torch.int32), torch.zeros(n - 2, dtype=torch.long),
                        [n - 2], [n], bs, bidirectional=[[(3, 9)]])
    out = TorchBackend().forward(q, k_cache, v_cache, meta, 0.5, sliding_window=5)
    k, v = k_cache.reshape(-1, hkv, d)[:n, 0], v_cache.reshape(-1, hkv, d)[:n, 0]
    for r in range(n - 2):
        p = r + 2
        seen = [j for j in range(n) if (j <= p or 3 <= p < 9 and 3 <= j < 9) and j > p - 5]
        w = torch.softmax((q[r] @ k[seen].T) * 0.5, -1)
        assert torch.allclose(out[r], w @ v[seen], atol=1e-5), r
    im = ImageData(b"", 5, 10, 1, 1, b"", whole=True)
    assert whole_images([im], 0, 8) == 5 and whole_images([im], 5, 8) == 10 and whole_images([im], 7, 3) == 8
    assert whole_images([im], 0, 20) == 20 and whole_images([ImageData(b"", 5, 10, 1, 1, b"")], 0, 8) == 8


# ---- the server ----

@pytest.mark.parametrize("family", ["gemma", "mistral"])
def test_api_takes_an_image(family, request):
    path, _, _, _ = request.getfixturevalue(family)
    info = load_model_info(path)
    img = _image(40, 24, 5)
    part = {"type": "image_url", "image_url": {"url": _data_url(img)}}
    msgs = [{"role": "user", "content": [{"type": "text", "text": "what is it?"}, part]}]
    want = len(processor_for(info.config, info.tokenizer).with_images(
        info.tokenizer.encode_chat([{"role": "user", "content": [{"type": "text", "text": "what is it?"},
                                                                 {"type": "image"}]}]), [img]))
    proc, base, _ = start_server("--m", path, "--kv-cache-gb", "0.05")
    try:
        code, body = _post(base, "/v1/chat/completions", {"messages": msgs, "max_tokens": 3, "temperature": 0})
        assert code == 200, body
        assert body["usage"]["prompt_tokens"] == want
        assert _post(base, "/tokenize", {"messages": msgs})[1]["count"] == want
    finally:
        stop_server(proc)
