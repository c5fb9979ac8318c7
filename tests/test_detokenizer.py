"""Incremental detokenization: multi-byte characters never split, stop strings found across tokens."""
import pytest

from xinfer.detokenizer import IncrementalDetokenizer
from xinfer.loader.gguf import load_gguf
from xinfer.loader.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tok(smollm_path):
    g = load_gguf(smollm_path)
    return Tokenizer(g.tokenizer, g.chat_template, g.bos_token_id, list(g.eog_token_ids))


TEXT = "Grüße 🙂 from Zürich — naïve café, 東京 and emoji 👍🏽 end."


def test_streamed_text_equals_full_decode(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    d = IncrementalDetokenizer(tok, tok.encode("Say:"), [])
    chunks = [d.add([t]) for t in ids] + [d.flush()]
    assert all("\ufffd" not in c for c in chunks)
    assert "".join(chunks) == tok.decode(ids) == TEXT


def test_stop_string_across_tokens(tok):
    ids = tok.encode("The answer is forty-two. Done.", add_special_tokens=False)
    d = IncrementalDetokenizer(tok, [], ["ty-tw"])
    out = ""
    for t in ids:
        out += d.add([t])
        if d.stopped:
            break
    out += d.flush()
    assert d.stopped == "ty-tw" and out == "The answer is for"


def test_stop_string_not_emitted_early(tok):
    d = IncrementalDetokenizer(tok, [], ["STOP"])
    ids = tok.encode("abc STO", add_special_tokens=False)
    out = "".join(d.add([t]) for t in ids)
    assert "STO" not in out  # held back: could be the start of the stop string
    assert out + d.flush() == "abc STO"
