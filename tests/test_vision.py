"""Images in, text out, on a tiny random Qwen3-VL built by transformers: the processor's pixel values
and the logits of image+text prompts (two images in one prompt, chunked prefill across an image,
12 decode steps, the next turn with a prefix-cache hit) equal transformers'; different images
never share KV; the chat API takes the three image part forms and refuses what it won't read."""
import base64
import io
import json

import numpy as np
import pytest
import torch
import transformers as tf
from PIL import Image
from tokenizers import Tokenizer, decoders
from tokenizers.models import BPE
from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
    Qwen2VLImageProcessorPil,
)

from tests.conftest import start_server, stop_server
from tests.test_webui import browser, idle, js, wait_for  # noqa: F401 (browser: the fixture)
from xinfer import Engine, EngineConfig, SamplingParams
from xinfer.api.protocol import ApiError, chat_text
from xinfer.api.schema import ChatRequest
from xinfer.mm import processor_for

START, PAD, END = 128, 129, 130  # <|vision_start|> <|image_pad|> <|vision_end|>
TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.content is string %}{{ m.content }}{% else %}{% for p in m.content %}"
    "{% if p.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>{% else %}{{ p.text }}{% endif %}"
    "{% endfor %}{% endif %}\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _image(w, h, seed, mode="RGB"):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 4), dtype=np.uint8), "RGBA").convert(mode)


def _png(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def _data_url(img) -> str:
    return "data:image/png;base64," + base64.b64encode(_png(img)).decode()


def _tokenizer(dest):
    chars = [chr(c) for c in range(32, 127)] + ["\n"] + [chr(c) for c in range(0xC0, 0xC0 + 30)]
    vocab = {"<s>": 0, "</s>": 1, **{ch: i + 2 for i, ch in enumerate(chars)}}
    specials = ["<|vision_start|>", "<|image_pad|>", "<|vision_end|>", "<|im_start|>"]
    vocab.update({t: 128 + i for i, t in enumerate(specials)})
    tok = Tokenizer(BPE(vocab=vocab, merges=[], unk_token="?"))
    tok.add_special_tokens(["<s>", "</s>"] + specials)
    tok.decoder = decoders.Fuse()
    tok.save(str(dest / "tokenizer.json"))
    (dest / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE, "bos_token": "<s>"}))


def _build(tmp_path_factory, moe: bool = False):
    """(folder, the transformers model, its image processor): 3 vision blocks with DeepStack after
    the first two, 8-pixel patches, a 4x4 learned position grid; M-RoPE sections 2/3/3."""
    torch.manual_seed(0)
    text = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                                 "mrope_interleaved": True})
    if moe:
        text.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1)
    vision = dict(depth=3, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=8, spatial_merge_size=2,
                  temporal_patch_size=2, out_hidden_size=64, num_position_embeddings=16,
                  deepstack_visual_indexes=[0, 1])
    conf, cls = ((tf.Qwen3VLMoeConfig, tf.Qwen3VLMoeForConditionalGeneration) if moe
                 else (tf.Qwen3VLConfig, tf.Qwen3VLForConditionalGeneration))
    model = cls(conf(text_config=text, vision_config=vision, image_token_id=PAD, video_token_id=131,
                     vision_start_token_id=START, vision_end_token_id=END)).eval()
    with torch.no_grad():  # random init leaves norms at 1 and biases at 0: make every weight matter
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    path = tmp_path_factory.mktemp("qwen3_vl_moe" if moe else "qwen3_vl")
    model.save_pretrained(path)
    hp = Qwen2VLImageProcessorPil(patch_size=8, merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3,
                                  image_std=[0.5] * 3, size={"shortest_edge": 32 * 32, "longest_edge": 64 * 64})
    hp.save_pretrained(path)
    _tokenizer(path)
    return str(path), model, hp


@pytest.fixture(scope="module")
def vl(tmp_path_factory):
    return _build(tmp_path_factory)


def test_pixel_values_match_transformers(vl):
    path, _, hp = vl
    proc = processor_for(_config(path))
    for w, h, mode in [(50, 37, "RGB"), (300, 120, "RGBA"), (13, 20, "L"), (64, 64, "P"), (7, 700, "RGB")]:
        img = _image(w, h, w * h, mode)
        want = hp(images=[img], return_tensors="np")
        im = proc.prepare(img)
        got = proc.pixel_values(im)
        assert tuple(im.grid) == tuple(want["image_grid_thw"][0]), (w, h, mode)
        assert got.shape == want["pixel_values"].shape
        assert np.abs(got - want["pixel_values"]).max() < 1e-5


def _config(path):
    from xinfer.loader.hf import load_config
    return load_config(path)


def _engine(path):
    return Engine(EngineConfig(model=path, block_size=4, num_kv_blocks=400, prefill_chunk_size=8,
                               max_num_batched_tokens=24, max_num_seqs=8))


@pytest.fixture(scope="module")
def engine(vl):
    eng = _engine(vl[0])
    yield eng
    eng.close()


def _run(eng, prompts, steps=12):
    """[(seq, [logits row per sampled token])] of prompts given as (token ids, PIL images)."""
    proc = eng.vision
    orig, rows = eng.runner.model.compute_logits, []

    def hook(hidden):
        out = orig(hidden)
        rows.append(out.clone())
        return out
    eng.runner.model.compute_logits = hook
    per_seq, orig_update = {}, eng.scheduler.update

    def update(result):
        got = rows.pop() if result.seq_ids else None
        for i, sid in enumerate(result.seq_ids):
            per_seq.setdefault(sid, []).append(got[i])
        return orig_update(result)
    eng.scheduler.update = update
    try:
        seqs = []
        for ids, imgs in prompts:
            ims = [proc.prepare(i) for i in imgs]
            seqs += eng.core.add_request(f"r{len(seqs)}", proc.expand(list(ids), ims),
                                         SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True), ims)
        while eng.has_unfinished():
            eng.step()
    finally:
        eng.runner.model.compute_logits, eng.scheduler.update = orig, orig_update
    return [(s, torch.stack(per_seq[s.seq_id])) for s in seqs]


def _reference(vl, seq, imgs):
    _, model, hp = vl
    full = torch.tensor([seq.prompt_ids + seq.output_ids])
    kw = {}
    if imgs:
        px = hp(images=imgs, return_tensors="pt")
        kw = dict(pixel_values=px["pixel_values"], image_grid_thw=px["image_grid_thw"],
                  mm_token_type_ids=(full == PAD).int())
    with torch.no_grad():
        return model(input_ids=full, **kw).logits[0, len(seq.prompt_ids) - 1:-1]


def _check_logits(vl, engine):
    a, b = _image(56, 40, 1), _image(30, 30, 2)
    prompts = [([5, 6, 7, START, PAD, END, 9, 10, 11, START, PAD, END, 20, 21], [a, b]),  # two images
               ([40, 41, 42, 43, 44], []),  # text only, in the same batch
               ([START, PAD, END, 33], [b])]  # an image first
    for (seq, got), (_, imgs) in zip(_run(engine, prompts), prompts):
        want = _reference(vl, seq, imgs)
        assert got.shape == want.shape
        assert (got - want).abs().max().item() < 1e-4
        assert torch.equal(got.argmax(-1), torch.tensor(seq.output_ids))


def test_logits_match_transformers(vl, engine):
    _check_logits(vl, engine)


def test_moe_logits_match_transformers(tmp_path_factory):
    vl = _build(tmp_path_factory, moe=True)
    eng = _engine(vl[0])
    try:
        _check_logits(vl, eng)
    finally:
        eng.close()


def test_next_turn_hits_the_prefix_cache_and_images_never_share_kv(vl, engine):
    a, c = _image(48, 48, 3), _image(48, 48, 4)  # same size: the same tokens, different pixels
    prompt = [7, 8, 9, 10, START, PAD, END, 11, 12, 13]
    (first, _), = _run(engine, [(prompt, [a])], steps=4)
    turn = prompt + first.output_ids + [50, 51]
    (second, got), = _run(engine, [(turn, [a])])
    assert second.num_cached_tokens >= 16  # the image's blocks were reused
    assert (got - _reference(vl, second, [a])).abs().max().item() < 1e-4
    (other, got), = _run(engine, [(turn, [c])])
    assert other.num_cached_tokens <= other.prompt_ids.index(PAD)  # nothing past the other image's start
    assert (got - _reference(vl, other, [c])).abs().max().item() < 1e-4


def test_offline_chat_takes_image_parts(vl, engine):
    img = _image(40, 40, 6)
    out, = engine.chat([{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image", "image": img}]}],
                       SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert out.prompt_token_ids.count(PAD) == 4  # 40x40 -> 32x32 pixels, 4x4 patches, 2x2 merged
    again, = engine.chat([{"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url",
                          "image_url": {"url": _data_url(img)}}]}], SamplingParams(temperature=0, max_tokens=4))
    assert again.token_ids == out.token_ids

    class Seq:
        prompt_ids, output_ids = out.prompt_token_ids, out.token_ids
    assert torch.equal(_reference(vl, Seq, [img]).argmax(-1), torch.tensor(out.token_ids))


def test_text_only_model_refuses_image_parts():
    from xinfer.api.protocol import decode
    body = decode(json.dumps({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "data:,"}}]}]}).encode(), ChatRequest)
    with pytest.raises(ApiError, match="not supported by this model"):
        chat_text(None, body, None, False)


# ---- the server ----

@pytest.fixture(scope="module")
def server(vl):
    proc, base, _ = start_server("--m", vl[0], "--kv-cache-gb", "0.05", "--limit-mm-per-prompt", "2")
    yield base
    stop_server(proc)


def _post(base, path, body):
    import urllib.error
    import urllib.request
    req = urllib.request.Request(base + path, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def _chat(base, part, text="what is it?"):
    return _post(base, "/v1/chat/completions", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": text}, part]}], "max_tokens": 3, "temperature": 0})


def test_api_image_part_forms(vl, server):
    img = _image(40, 24, 5)
    url = _data_url(img)
    forms = [{"type": "image_url", "image_url": {"url": url}}, {"type": "image_url", "image_url": url},
             {"type": "image_base64", "image_base64": url}]
    answers = [_chat(server, f) for f in forms]
    assert all(code == 200 for code, _ in answers), answers
    assert len({a["choices"][0]["message"]["content"] for _, a in answers}) == 1  # the same image each time
    usage = {a["usage"]["prompt_tokens"] for _, a in answers}
    assert len(usage) == 1
    # the image's tokens count: <|vision_start|>, one per merged 2x2 block of patches, <|vision_end|>
    image_tokens = int(vl[2](images=[img], return_tensors="np")["image_grid_thw"][0].prod()) // 4
    text = _post(server, "/tokenize", {"messages": [{"role": "user", "content": "what is it?"}],
                                       "add_special_tokens": False})[1]["count"]
    assert usage == {text + 2 + image_tokens}
    counted = _post(server, "/tokenize", {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "what is it?"}, forms[0]]}], "add_special_tokens": False})[1]["count"]
    assert usage == {counted}


@pytest.mark.parametrize("part, why", [
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(b"\x89PNG junk").decode()}},
     "image"),
    ({"type": "image_url", "image_url": {"url": "data:image/png;base64," + base64.b64encode(
        _png(_image(8, 8, 0))[:60]).decode()}}, "corrupt"),
    ({"type": "image_url", "image_url": {"url": "http://127.0.0.1:1/cat.png"}}, "does not fetch"),
    ({"type": "image_url", "image_url": {"url": "/etc/passwd"}}, "does not read image files"),
    ({"type": "image_url", "image_url": {}}, "url"),
])
def test_api_bad_images_are_400_and_the_next_request_is_fine(server, part, why):
    code, body = _chat(server, part)
    assert code == 400 and why in body["error"]["message"] and body["error"]["type"] == "invalid_request_error"
    assert _chat(server, {"type": "image_url", "image_url": _data_url(_image(16, 16, 9))})[0] == 200


def test_api_too_many_images(server):
    url = _data_url(_image(16, 16, 1))
    parts = [{"type": "image_url", "image_url": url}] * 3
    code, body = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": parts}],
                                                        "max_tokens": 1})
    assert code == 400 and "--limit-mm-per-prompt" in body["error"]["message"]
    code, _ = _post(server, "/v1/chat/completions", {"messages": [{"role": "user", "content": parts[:2]}],
                                                     "max_tokens": 1})
    assert code == 200


def test_chat_page_attaches_an_image(server, browser):  # noqa: F811 (the imported fixture)
    """Headless Chromium (tests/test_webui.py's browser): the image button shows for a vision model, an
    attached image is a thumbnail in the conversation and reaches the model as a data: URL."""
    browser.get(server + "/")
    wait_for(lambda: browser.find_element("id", "attach").is_displayed(), 15, "the image button")
    png = base64.b64encode(_png(_image(24, 24, 7))).decode()
    js(browser, "const b = Uint8Array.from(atob(arguments[0]), (c) => c.charCodeAt(0));"
                "attach([new File([b], 'a.png', {type: 'image/png'})]);", png)
    wait_for(lambda: js(browser, "return document.querySelectorAll('#attached img').length") == 1, 10, "the thumbnail")
    browser.find_element("id", "input").send_keys("what is it?")
    browser.find_element("id", "send").click()
    wait_for(lambda: idle(browser) and js(browser, "return document.querySelectorAll('.msg.assistant').length"),
             60, "the reply")
    assert js(browser, "return document.querySelectorAll('.msg.user img.thumb').length") == 1
    assert js(browser, "return document.querySelectorAll('#attached img').length") == 0
    assert js(browser, "return document.querySelectorAll('.msg .error').length") == 0
    assert js(browser, "return state.history[0].content[1].image_url.url").startswith("data:image/png;base64,")
