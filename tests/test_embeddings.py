"""/v1/embeddings and Engine.embed (issue 21): the pooled final hidden states (after the last norm)
against transformers' on the same weights, for --pooling last and mean, with prompts longer than
a prefill chunk and next to prefix-cache hits; the route through the real `openai` SDK; and on the
bundled chat model, paraphrases closer than unrelated text."""
import base64
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.conftest import make_chat_model, start_server, stop_server
from tests.test_api import call
from tests.test_request_surface import PLAIN_TEMPLATE

LONG = [3 + (i * 7) % 120 for i in range(40)]  # over --prefill-chunk-size 16: three chunks
PROMPTS = [LONG, [5, 6, 7], [9]]


def _reference(path, prompts, pooling):
    """transformers' final hidden states (LlamaModel's output is after its last norm), pooled, normalised."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    out = []
    with torch.no_grad():
        for ids in prompts:
            h = model.model(torch.tensor([ids])).last_hidden_state[0].float()
            out.append(torch.nn.functional.normalize(h[-1] if pooling == "last" else h.mean(0), dim=0).numpy())
    return out


@pytest.mark.parametrize("pooling", ["last", "mean"])
def test_offline_embed_matches_transformers(tiny_llama_path, pooling):
    from xinfer import Engine, EngineConfig, SamplingParams
    e = Engine(EngineConfig(model=tiny_llama_path, num_kv_blocks=64, prefill_chunk_size=16, pooling=pooling))
    try:
        want = _reference(tiny_llama_path, PROMPTS, pooling)
        for got, ref in zip(e.embed(PROMPTS), want):
            assert len(got) == 32 and np.abs(np.asarray(got) - ref).max() < 1e-4
        # The long prompt's blocks are in the prefix cache now, and a generation shares its first 32
        # tokens in the same steps: an embedding takes no prefix-cache hit, so it is unchanged.
        e.add_request(LONG[:32] + [4, 4], SamplingParams(max_tokens=4, temperature=0.0))
        again = e.embed([LONG])[0]
        assert np.abs(np.asarray(again) - want[0]).max() < 1e-4
        assert e.generate([LONG[:33]], SamplingParams(max_tokens=1))[0].num_cached_tokens == 32  # still cached
        assert not e.has_unfinished()
    finally:
        e.close()


def test_mean_pooling_survives_a_preemption_mid_prompt(tiny_llama_path):
    """Two 40-token prompts in 16-token chunks on a 5-block cache: the second is preempted after two
    chunks and recomputed from scratch; its running sum starts over with it."""
    from xinfer import Engine, EngineConfig
    # one step at a time: a step planned ahead never preempts (the second prompt would wait instead)
    e = Engine(EngineConfig(model=tiny_llama_path, num_kv_blocks=5, prefill_chunk_size=16, pooling="mean",
                            overlap_schedule="off"))
    try:
        prompts = [LONG, LONG[::-1]]
        got = e.embed(prompts)
        assert e.scheduler.num_preemptions >= 1
        for g, ref in zip(got, _reference(tiny_llama_path, prompts, "mean")):
            assert np.abs(np.asarray(g) - ref).max() < 1e-4
    finally:
        e.close()


def test_pooling_is_validated():
    from xinfer import EngineConfig
    with pytest.raises(ValueError, match="--pooling"):
        EngineConfig(pooling="max")


@pytest.fixture(scope="module")
def srv(tiny_llama_path, tmp_path_factory):
    """The tiny model with its character tokenizer (one token per character), mean pooling over
    16-token prefill chunks, at most 8 inputs a request."""
    path = make_chat_model(tiny_llama_path, tmp_path_factory.mktemp("tiny_embed") / "model", PLAIN_TEMPLATE)
    proc, base, _ = start_server("--m", path, "--num-kv-blocks", "64", "--pooling", "mean",
                                 "--prefill-chunk-size", "16", "--max-prompts-per-request", "8")
    from openai import OpenAI
    yield SimpleNamespace(base=base, path=path, client=OpenAI(base_url=base + "/v1", api_key="none", max_retries=0))
    stop_server(proc)


def test_embeddings_through_the_openai_sdk(srv):
    c = srv.client
    texts = ["ab", "hello world", "x"]
    r = c.embeddings.create(model="any-name", input=texts)  # the SDK asks for base64 and decodes it
    assert r.object == "list" and [d.index for d in r.data] == [0, 1, 2] and r.model
    vecs = np.array([d.embedding for d in r.data])
    assert vecs.shape == (3, 32) and np.allclose(np.linalg.norm(vecs, axis=1), 1, atol=1e-5)
    assert r.usage.prompt_tokens == r.usage.total_tokens == sum(len(t) for t in texts)  # one token a character
    floats = c.embeddings.create(model="m", input=texts, encoding_format="float")
    # (a batch may be split over steps differently each time: float32 GEMMs of other row counts
    # round the last bits differently, so equal within 1e-6, not to the bit)
    assert np.abs(np.array([d.embedding for d in floats.data]) - vecs).max() < 1e-6
    b64 = c.embeddings.create(model="m", input=texts[1], encoding_format="base64")
    assert isinstance(b64.data[0].embedding, str)
    assert np.abs(np.frombuffer(base64.b64decode(b64.data[0].embedding), dtype="<f4") - vecs[1]).max() < 1e-6
    # batch order: each input alone gives the same vector at its index
    for i, t in enumerate(texts):
        assert np.abs(np.array(c.embeddings.create(model="m", input=t).data[0].embedding) - vecs[i]).max() < 1e-6
    short = c.embeddings.create(model="m", input=texts, dimensions=8)
    cut = vecs[:, :8] / np.linalg.norm(vecs[:, :8], axis=1, keepdims=True)
    assert np.abs(np.array([d.embedding for d in short.data]) - cut).max() < 1e-6


def test_token_inputs_match_transformers_over_http(srv):
    c = srv.client
    r = c.embeddings.create(model="m", input=PROMPTS, encoding_format="float")
    want = _reference(srv.path, PROMPTS, "mean")
    assert r.usage.prompt_tokens == sum(len(p) for p in PROMPTS)
    for d, ref in zip(r.data, want):
        assert np.abs(np.asarray(d.embedding) - ref).max() < 1e-4
    one = c.embeddings.create(model="m", input=LONG, encoding_format="float")  # one token list
    assert len(one.data) == 1 and np.abs(np.asarray(one.data[0].embedding) - want[0]).max() < 1e-4
    status, toks = call(srv.base, "/tokenize", {"prompt": "hello world"})
    text = c.embeddings.create(model="m", input="hello world", encoding_format="float").data[0].embedding
    ids = c.embeddings.create(model="m", input=toks["tokens"], encoding_format="float").data[0].embedding
    assert status == 200 and text == ids


@pytest.mark.parametrize("body, param", [
    ({"input": []}, "input"),
    ({"input": [""]}, "input"),
    ({"input": ""}, "input"),
    ({"input": ["a", [1, 2]]}, "input"),
    ({"input": [[3, 4], []]}, "input"),
    ({"input": [3, 200]}, "input"),  # out of the 128-token vocabulary
    ({"input": [5] * 4096}, "input"),  # the whole context: no room
    ({"input": ["a"] * 9}, "input"),  # over --max-prompts-per-request
    ({"input": "a", "dimensions": 33}, "dimensions"),  # over the hidden size
    ({"input": "a", "dimensions": 0}, "dimensions"),
    ({"input": "a", "encoding_format": "hex"}, "encoding_format"),
])
def test_bad_input_is_a_400_then_a_request_works(srv, body, param):
    status, out = call(srv.base, "/v1/embeddings", {"model": "m", **body})
    assert status == 400 and out["error"]["param"] == param, out
    status, out = call(srv.base, "/v1/embeddings", {"model": "m", "input": ["ok", "fine"]})
    assert status == 200 and [d["index"] for d in out["data"]] == [0, 1] and len(out["data"][1]["embedding"]) == 32


def test_openai_sdk_raises_on_a_bad_request(srv):
    import openai
    with pytest.raises(openai.BadRequestError):
        srv.client.embeddings.create(model="m", input="a", dimensions=64)
    assert len(srv.client.embeddings.create(model="m", input="a").data[0].embedding) == 32


@pytest.mark.parametrize("pooling", ["mean", "last"])
def test_paraphrases_are_closer_than_unrelated_text(pooling):
    """The bundled SmolLM2-135M chat model is no embedding model, but either pooling ranks each
    paraphrase above every unrelated text here (measured: paraphrase cosines 0.92-0.95 against
    0.57-0.83 for the rest)."""
    from xinfer import Engine, EngineConfig
    texts = ["The cat is sleeping on the warm sofa.", "A kitten naps on the cozy couch.",
             "How do I bake bread at home?", "What is a simple recipe for homemade bread?",
             "The stock market fell sharply after the interest rate announcement.",
             "Quantum computers use qubits to perform calculations."]
    e = Engine(EngineConfig(pooling=pooling, kv_cache_gb=0.1))
    try:
        v = np.array(e.embed(texts))
    finally:
        e.close()
    sim = v @ v.T
    for a, b in ((0, 1), (2, 3)):
        others = [sim[a, j] for j in range(len(texts)) if j not in (a, b)]
        assert sim[a, b] > max(others) + 0.05, (pooling, a, sim[a].round(3))
