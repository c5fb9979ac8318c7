"""Two request fields of vLLM's (issue 15): `prompt_logprobs` in the response, checked against the
offline Engine and transformers' own distribution, and a request's own `chat_template`
(--trust-request-chat-template), sandboxed, time-boxed and size-capped."""
import time
from types import SimpleNamespace

import pytest
import torch

from tests.conftest import make_chat_model, start_server, stop_server
from tests.test_api import call
from tests.test_request_surface import HI, PLAIN_TEMPLATE

QA = "{% for m in messages %}Q: {{ m.content }}{% endfor %} A:"
LOOP = "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}"


@pytest.fixture(scope="module")
def srv(tiny_llama_path, tmp_path_factory):
    """The tiny model with its character tokenizer (one token per character), request templates trusted."""
    path = make_chat_model(tiny_llama_path, tmp_path_factory.mktemp("tiny_fields") / "model", PLAIN_TEMPLATE)
    proc, base, _ = start_server("--m", path, "--num-kv-blocks", "64", "--trust-request-chat-template")
    from openai import OpenAI
    yield SimpleNamespace(base=base, path=path, client=OpenAI(base_url=base + "/v1", api_key="none", max_retries=0))
    stop_server(proc)


@pytest.fixture(scope="module")
def offline(srv):
    from xinfer import Engine, EngineConfig, SamplingParams
    e = Engine(EngineConfig(model=srv.path, num_kv_blocks=64))
    yield lambda ids: e.generate([ids], SamplingParams(max_tokens=1, prompt_logprobs=2))[0].prompt_logprobs
    e.close()


def _ids(srv, **body):
    status, out = call(srv.base, "/tokenize", body)
    assert status == 200, out
    return out["tokens"]


def _check(got, ids, want, ref, text):
    """`got` (the response's prompt_logprobs of `text`) against the offline Engine's entries and the
    reference log-softmax rows (row i - 1 scores token i)."""
    assert len(got) == len(ids) and got[0] is None and want[0] is None
    for i in range(1, len(ids)):
        tid, (lp, _, rank), row = ids[i], want[i], ref[i - 1]
        mine = got[i][str(tid)]
        assert mine["logprob"] == pytest.approx(lp, abs=1e-5) and mine["rank"] == rank
        assert mine["logprob"] == pytest.approx(row[tid].item(), abs=1e-3)
        assert rank == int((row >= row[tid]).sum())  # vLLM's rank: its place in the sorted distribution
        ranked = {v["rank"]: v["logprob"] for v in got[i].values()}  # the token and the top 2
        assert sorted(ranked) == sorted({1, 2, rank})
        assert [ranked[1], ranked[2]] == pytest.approx(row.topk(2).values.tolist(), abs=1e-3)
    assert "".join(e[str(t)]["decoded_token"] for t, e in zip(ids[1:], got[1:])) == text[1:]


def _reference(path, ids):
    from transformers import AutoModelForCausalLM
    with torch.no_grad():
        logits = AutoModelForCausalLM.from_pretrained(path)(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def test_prompt_logprobs_in_completions_and_chat(srv, offline):
    c = srv.client
    prompt = "The quick brown fox"
    ids = _ids(srv, prompt=prompt)
    r = c.completions.create(model="m", prompt=prompt, max_tokens=1, extra_body={"prompt_logprobs": 2})
    ref = _reference(srv.path, ids)
    _check(r.choices[0].prompt_logprobs, ids, offline(ids), ref, prompt)
    # each choice carries its prompt's (vLLM's place in a completion); n siblings the same
    two = c.completions.create(model="m", prompt=[prompt, "ab"], max_tokens=1, n=2, extra_body={"prompt_logprobs": 2})
    assert [len(ch.prompt_logprobs) for ch in two.choices] == [len(ids), len(ids), 2, 2]
    assert two.choices[1].prompt_logprobs == two.choices[0].prompt_logprobs == r.choices[0].prompt_logprobs
    # chat: one list for the request's prompt, at the top of the response
    chat_ids = _ids(srv, messages=HI)
    ch = c.chat.completions.create(model="m", messages=HI, max_tokens=1, extra_body={"prompt_logprobs": 2})
    assert ch.usage.prompt_tokens == len(chat_ids) and not hasattr(ch.choices[0], "prompt_logprobs")
    _check(ch.prompt_logprobs, chat_ids, offline(chat_ids), _reference(srv.path, chat_ids), "Hi\n")
    # prompt_logprobs 0: the prompt token alone; not asked: no field
    zero = call(srv.base, "/v1/completions", {"prompt": prompt, "max_tokens": 1, "prompt_logprobs": 0})[1]
    assert [list(e) for e in zero["choices"][0]["prompt_logprobs"][1:]] == [[str(t)] for t in ids[1:]]
    plain = call(srv.base, "/v1/completions", {"prompt": prompt, "max_tokens": 1})[1]
    assert "prompt_logprobs" not in plain["choices"][0]


def test_prompt_logprobs_with_stream_is_a_400_as_in_vllm(srv):
    for path, body in (("/v1/completions", {"prompt": "ab"}), ("/v1/chat/completions", {"messages": HI})):
        status, err = call(srv.base, path, {**body, "max_tokens": 1, "stream": True, "prompt_logprobs": 1})
        assert status == 400 and err["error"]["param"] == "prompt_logprobs"
    status, _ = call(srv.base, "/v1/completions", {"prompt": "ab", "max_tokens": 1, "stream": True,
                                                   "prompt_logprobs": 0})
    assert status == 200


def test_request_chat_template_is_used(srv):
    assert srv.client.chat.completions.create(model="m", messages=HI, max_tokens=1).usage.prompt_tokens == len("Hi\n")
    r = srv.client.chat.completions.create(model="m", messages=HI, max_tokens=1, extra_body={"chat_template": QA})
    assert r.usage.prompt_tokens == len("Q: Hi A:")
    status, out = call(srv.base, "/tokenize", {"messages": HI, "chat_template": QA, "return_token_strs": True})
    assert status == 200 and "".join(out["token_strs"]) == "Q: Hi A:"
    # vLLM also reads it from chat_template_kwargs
    status, out = call(srv.base, "/tokenize", {"messages": HI, "chat_template_kwargs": {"chat_template": QA},
                                               "return_token_strs": True})
    assert status == 200 and "".join(out["token_strs"]) == "Q: Hi A:"


def test_request_chat_template_limits(srv):
    def chat(template, where="chat_template"):
        body = {"messages": HI, "max_tokens": 1}
        body.update({where: template} if where == "chat_template" else {where: {"chat_template": template}})
        return call(srv.base, "/v1/chat/completions", body)

    t = time.monotonic()
    status, err = chat(LOOP)
    assert status == 400 and "ran past" in err["error"]["message"] and time.monotonic() - t < 5
    assert chat(QA)[0] == 200  # the server answers the next request
    status, err = chat("x" * (64 * 1024 + 1))
    assert status == 400 and err["error"]["param"] == "chat_template"
    assert chat("x" * (64 * 1024 + 1), "chat_template_kwargs")[0] == 400
    status, err = chat("{% for m in messages %}{{ m.content }")
    assert status == 400 and "does not compile" in err["error"]["message"] and "line 1" in err["error"]["message"]
    for bomb in ("{{ 'a' * 10 ** 9 }}", "{{ 10 ** (10 ** 8) }}", "{{ range(10 ** 6) | list }}",
                 "{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}",
                 "{% set ns = namespace(s='a') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}"):
        assert chat(bomb)[0] == 400, bomb
    assert chat(QA)[0] == 200
