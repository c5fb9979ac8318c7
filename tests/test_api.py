"""The OpenAI-compatible API driven by the real `openai` SDK (sync, async, streaming) and raw HTTP:
response shapes, logprobs and echo against transformers, tokenizer routes, tool calls, reasoning,
auth, errors (each followed by a valid request) and exact metric counts."""
import asyncio
import json
import os
import subprocess
import sys
import urllib.error
import urllib.request

import pytest
import torch

from tests.conftest import make_chat_model, start_server, stop_server

WEATHER = [{"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]


@pytest.fixture(scope="module")
def api():
    proc, base, _ = start_server("--kv-cache-gb", "0.2", "--max-n", "4", "--max-request-bytes", "200000",
                                 "--sse-keepalive", "0.001")
    from openai import OpenAI
    client = OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    yield base, client, client.models.list().data[0].id
    stop_server(proc)


THINK_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and not enable_thinking %}"
    "<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}{% endif %}")


@pytest.fixture(scope="module")
def tiny(tiny_llama_path, tmp_path_factory):
    """A tiny model whose template opens a <think> block, behind an API key, with the chat logger on."""
    path = make_chat_model(tiny_llama_path, tmp_path_factory.mktemp("tiny_think"), THINK_TEMPLATE)
    logdir = tmp_path_factory.mktemp("chatlog")
    proc, base, _ = start_server("--m", path, "--kv-cache-gb", "0.05", "--api-key", "sesame",
                                 env={"XINFER_CHAT_LOGGER": "1"}, cwd=str(logdir))
    yield base, logdir
    stop_server(proc)


def call(base, path, body=None, key=None, raw: bytes | None = None, method=None):
    headers = {"Content-Type": "application/json"}
    if key:
        headers["Authorization"] = "Bearer " + key
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    req = urllib.request.Request(base + path, data=data, headers=headers, method=method)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            text = r.read().decode()
            return r.status, json.loads(text) if r.headers.get_content_type() == "application/json" else text
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def sse_events(base, body):
    """The raw lines of a streamed request (comments included)."""
    req = urllib.request.Request(base + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return [line.decode().rstrip("\n") for line in r if line.strip()]


# ---- routes and shapes ----

def test_models_routes(api):
    base, client, model = api
    assert client.models.retrieve(model).id == model
    from openai import NotFoundError
    with pytest.raises(NotFoundError):
        client.models.retrieve("no-such-model")
    # One model served: any name gets it (--strict-model-names: 404; tests/test_request_surface.py)
    r = client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=1)
    assert r.model == model
    status, v = call(base, "/version")
    assert status == 200 and v["version"]


def test_chat_sync_async_and_stream_agree(api):
    base, client, model = api
    from openai import AsyncOpenAI
    msgs = [{"role": "user", "content": [{"type": "text", "text": "Name a color."}]}]
    r = client.chat.completions.create(model=model, messages=msgs, max_completion_tokens=12, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.content

    async def run_async():
        a = AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
        out = await a.chat.completions.create(model=model, messages=msgs, max_tokens=12, temperature=0)
        await a.close()
        return out
    assert asyncio.run(run_async()).choices[0].message.content == r.choices[0].message.content

    chunks = list(client.chat.completions.create(model=model, messages=msgs, max_tokens=12, temperature=0,
                                                 n=2, stream=True, stream_options={"include_usage": True}))
    assert len({(c.id, c.created) for c in chunks}) == 1
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert {c.choices[0].index for c in chunks[:2]} == {0, 1} and chunks[0].choices[0].delta.role == "assistant"
    for i in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == i]
        assert sum(1 for ch in mine if ch.finish_reason) == 1 and mine[-1].finish_reason
        assert "".join(ch.delta.content or "" for ch in mine) == r.choices[0].message.content
    assert all(c.usage is None for c in chunks[:-1])
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 2 * r.usage.completion_tokens


def test_completion_prompt_forms(api):
    base, client, model = api
    _, tok = call(base, "/tokenize", {"prompt": "Once upon a time"})
    a = client.completions.create(model=model, prompt="Once upon a time", max_tokens=8, temperature=0)
    b = client.completions.create(model=model, prompt=tok["tokens"], max_tokens=8, temperature=0)
    assert a.object == "text_completion" and a.choices[0].text == b.choices[0].text
    assert a.usage.prompt_tokens == tok["count"]
    c = client.completions.create(model=model, prompt=["Once upon a time", "The sky is"], max_tokens=8,
                                  temperature=0, n=2)
    assert [ch.index for ch in c.choices] == [0, 1, 2, 3]
    assert c.choices[0].text == c.choices[1].text == a.choices[0].text
    d = client.completions.create(model=model, prompt=[tok["tokens"], tok["tokens"]], max_tokens=8, temperature=0)
    assert [ch.text for ch in d.choices] == [a.choices[0].text] * 2
    s = list(client.completions.create(model=model, prompt="Once upon a time", max_tokens=8, temperature=0,
                                       stream=True))
    assert "".join(ch.choices[0].text for ch in s) == a.choices[0].text
    assert sum(1 for ch in s if ch.choices[0].finish_reason) == 1


def test_keepalive_comments_and_done(api):
    base, _, model = api
    lines = sse_events(base, {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4,
                              "stream": True})
    assert any(line.startswith(": keep-alive") for line in lines)  # --sse-keepalive 0.001: before the 1st token
    assert lines[-1] == "data: [DONE]"


# ---- logprobs against transformers ----

def _reference_logprobs(smollm_hf, ids):
    with torch.no_grad():
        logits = smollm_hf(torch.tensor([ids])).logits[0].float()
    return torch.log_softmax(logits, dim=-1)


def test_echo_prompt_logprobs_match_transformers(api, smollm_hf):
    """lm-evaluation-harness loglikelihood: echo + max_tokens 1 + logprobs 1."""
    base, client, model = api
    prompt = "The capital of France is Paris, and the capital of Italy is"
    r = client.completions.create(model=model, prompt=prompt, max_tokens=1, logprobs=1, echo=True, temperature=0)
    ch = r.choices[0]
    _, tok = call(base, "/tokenize", {"prompt": prompt})
    ids = tok["tokens"]
    assert ch.text.startswith(prompt)
    lp = ch.logprobs
    assert len(lp.tokens) == len(ids) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    ref = _reference_logprobs(smollm_hf, ids)
    want = [ref[i, ids[i + 1]].item() for i in range(len(ids) - 1)]
    assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:len(ids)], want)) < 1e-3
    assert "".join(lp.tokens[:len(ids)]) == prompt and lp.text_offset[:2] == [0, len(lp.tokens[0])]
    # the generated token is the reference's argmax, with its logprob
    assert abs(lp.token_logprobs[-1] - ref[-1].max().item()) < 1e-3
    # n = 2: the siblings share the prompt's KV blocks; both echo the same scored prompt
    two = client.completions.create(model=model, prompt=prompt, max_tokens=1, logprobs=1, echo=True, n=2,
                                    temperature=0)
    for c in two.choices:
        assert c.logprobs.token_logprobs[1:len(ids)] == pytest.approx(lp.token_logprobs[1:len(ids)], abs=1e-4)
    # max_tokens 0: just the scored prompt
    z = client.completions.create(model=model, prompt=prompt, max_tokens=0, logprobs=0, echo=True)
    assert z.choices[0].text == prompt and z.choices[0].logprobs.token_logprobs[1:] == pytest.approx(
        lp.token_logprobs[1:len(ids)], abs=1e-5)


def test_chat_logprobs_match_transformers(api, smollm_hf):
    base, client, model = api
    msgs = [{"role": "user", "content": "Count to five."}]
    r = client.chat.completions.create(model=model, messages=msgs, max_tokens=6, temperature=0, logprobs=True,
                                       top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens and all(len(c.top_logprobs) == 3 for c in content)
    _, p = call(base, "/tokenize", {"messages": msgs, "add_generation_prompt": True})
    assert p["count"] == r.usage.prompt_tokens
    _, out = call(base, "/tokenize", {"prompt": "".join(c.token for c in content), "add_special_tokens": False})
    ref = _reference_logprobs(smollm_hf, p["tokens"] + out["tokens"])
    n = len(p["tokens"])
    for i, c in enumerate(content[:len(out["tokens"])]):
        assert abs(c.logprob - ref[n - 1 + i].max().item()) < 1e-3  # greedy: the top token
        assert c.top_logprobs[0].token == c.token and bytes(c.bytes) == c.token.encode()
    streamed = list(client.chat.completions.create(model=model, messages=msgs, max_tokens=6, temperature=0,
                                                   logprobs=True, stream=True))
    got = [t.logprob for s in streamed if s.choices and s.choices[0].logprobs for t in s.choices[0].logprobs.content]
    assert got == pytest.approx([c.logprob for c in content], abs=1e-4)  # prefix-cache hit: other sums


def test_prefix_hit_inside_a_block_matches_transformers(api, smollm_hf):
    """Two chats with one system prompt: the second reuses every shared token, past its last whole
    cached block too (the worker copies those slots), and its logprobs still match transformers."""
    base, client, model = api
    system = {"role": "system", "content": "You are Quill, a terse assistant of the lighthouse archive."}
    chats = [[system, {"role": "user", "content": q}] for q in ("Name a color.", "Name a fruit.")]
    client.chat.completions.create(model=model, messages=chats[0], max_tokens=2, temperature=0)
    r = client.chat.completions.create(model=model, messages=chats[1], max_tokens=6, temperature=0, logprobs=True)
    p = [call(base, "/tokenize", {"messages": c, "add_generation_prompt": True})[1]["tokens"] for c in chats]
    shared = next(i for i, (a, b) in enumerate(zip(*p)) if a != b)
    assert shared % 16 and r.usage.prompt_tokens_details.cached_tokens == shared
    content = r.choices[0].logprobs.content
    _, out = call(base, "/tokenize", {"prompt": "".join(c.token for c in content), "add_special_tokens": False})
    ref = _reference_logprobs(smollm_hf, p[1] + out["tokens"])
    for i, c in enumerate(content[:len(out["tokens"])]):
        assert abs(c.logprob - ref[len(p[1]) - 1 + i].max().item()) < 1e-3


# ---- tokenizer routes ----

def test_tokenize_detokenize_and_tokenizer_info(api, smollm_path):
    base, _, _ = api
    from xinfer.loader import load_model_info
    tok = load_model_info(smollm_path, "auto").tokenizer
    status, t = call(base, "/tokenize", {"prompt": "Hello world, héllo!"})
    assert status == 200 and t["tokens"] == tok.encode("Hello world, héllo!") and t["count"] == len(t["tokens"])
    assert t["max_model_len"] > 0
    _, d = call(base, "/detokenize", {"tokens": t["tokens"]})
    assert d["prompt"] == "Hello world, héllo!"
    status, e = call(base, "/detokenize", {"tokens": [10 ** 7]})
    assert status == 400 and "10000000" in e["error"]["message"]
    _, info = call(base, "/tokenizer_info")
    assert info["vocab_size"] == 49152 and info["eos_token"] and info["chat_template"]


# ---- errors: each bad input gets a 4xx OpenAI error, and the next valid request works ----

BAD = [
    ("/v1/chat/completions", b"{not json", 400, None),
    ("/v1/chat/completions", b"[1, 2]", 400, None),
    ("/v1/chat/completions", {"messages": "hi"}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"content": "no role"}]}, 400, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi " * 9000}]}, 400,  # over the context
     "max_tokens"),
    ("/v1/completions", {"prompt": [5, 10 ** 8]}, 400, "prompt"),
    ("/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logit_bias": {"5": 500}}, 400,
     "logit_bias"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": True,
                              "top_logprobs": 21}, 400, "top_logprobs"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "n": 5}, 400, "n"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "stream_options": {"include_usage": True}}, 400, "stream_options"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "tools": WEATHER,
                              "tool_choice": {"type": "function", "function": {"name": "nope"}}}, 400, "tool_choice"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": [{"type": "image_url",
                                                                          "image_url": {"url": "x"}}]}]}, 400,
     "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"}, 400,
     "temperature"),
    ("/v1/no/such/route", {}, 404, None),
    ("/v1/chat/completions", b'{"messages": "' + b"x" * 300_000 + b'"}', 413, None),
]


@pytest.mark.parametrize("path,body,status,param", BAD)
def test_bad_input_gets_an_openai_error_then_a_valid_request_works(api, path, body, status, param):
    base, _, model = api
    raw = body if isinstance(body, bytes) else None
    got, err = call(base, path, None if raw else body, raw=raw)
    assert got == status, err
    assert set(err["error"]) == {"message", "type", "param", "code"} and err["error"]["message"]
    if param:
        assert err["error"]["param"] == param
    ok, r = call(base, "/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "Hi"}],
                                                "max_tokens": 2})
    assert ok == 200 and r["choices"][0]["message"]["role"] == "assistant"


# ---- tool calls ----

def test_named_tool_choice_gives_a_tool_call_streamed_and_whole(api):
    base, client, model = api
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    choice = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(model=model, messages=msgs, tools=WEATHER, tool_choice=choice,
                                       max_tokens=48, temperature=0)
    calls = r.choices[0].message.tool_calls
    assert calls and calls[0].type == "function" and calls[0].function.name == "get_weather"
    assert len(calls[0].id) >= 9 and isinstance(json.loads(calls[0].function.arguments), dict)
    # a named function: the choice ends with that one call, like guided decoding would
    assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None
    chunks = list(client.chat.completions.create(model=model, messages=msgs, tools=WEATHER, tool_choice=choice,
                                                 max_tokens=48, temperature=0, stream=True))
    deltas = [tc for c in chunks if c.choices and c.choices[0].delta.tool_calls for tc in c.choices[0].delta.tool_calls]
    assert [d.id for d in deltas if d.id] and len([d.id for d in deltas if d.id]) == 1
    assert [d.function.name for d in deltas if d.function.name] == ["get_weather"]
    assert "".join(d.function.arguments or "" for d in deltas) == calls[0].function.arguments
    assert all(d.index == 0 for d in deltas)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]
    for c in chunks:
        if c.choices:
            assert c.choices[0].delta.tool_calls != [] and not c.choices[0].delta.content
    # The call and its result go back into the history.
    history = msgs + [{"role": "assistant", "content": None, "tool_calls": [calls[0].model_dump()]},
                      {"role": "tool", "tool_call_id": calls[0].id, "content": "18 C, sunny"}]
    again = client.chat.completions.create(model=model, messages=history, tools=WEATHER, max_tokens=8,
                                           temperature=0)
    assert again.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_tool_choice_none_keeps_the_plain_answer(api):
    base, client, model = api
    msgs = [{"role": "user", "content": "Say hello."}]
    plain = client.chat.completions.create(model=model, messages=msgs, max_tokens=8, temperature=0)
    none = client.chat.completions.create(model=model, messages=msgs, tools=WEATHER, tool_choice="none",
                                          max_tokens=8, temperature=0)
    assert none.choices[0].message.tool_calls is None
    assert none.choices[0].message.content == plain.choices[0].message.content  # SmolLM2's template has no tools


# ---- metrics ----

def _metrics(base):
    from prometheus_client.parser import text_string_to_metric_families
    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = s.name + ("{" + s.labels["finished_reason"] + "}" if "finished_reason" in s.labels else "")
            if s.name.endswith("_bucket"):
                continue
            out[key] = s.value
    return out


def test_metrics_counts_are_exact(api):
    base, client, model = api
    before = _metrics(base)
    n, m = 3, 7
    for i in range(n):
        client.completions.create(model=model, prompt=f"Item {i}:", max_tokens=m, temperature=0,
                                  extra_body={"ignore_eos": True})
    after = _metrics(base)

    def delta(name):
        return after[name] - before.get(name, 0)
    assert delta("xinfer:time_to_first_token_seconds_count") == n
    assert delta("xinfer:inter_token_latency_seconds_count") == n * (m - 1)
    assert delta("xinfer:generation_tokens_total") == n * m
    assert delta("xinfer:request_generation_tokens_sum") == n * m
    assert delta("xinfer:request_success_total{length}") == n
    assert delta("xinfer:e2e_request_latency_seconds_count") == n
    assert delta("xinfer:request_queue_time_seconds_count") == n
    assert delta("xinfer:request_prompt_tokens_count") == n
    assert delta("xinfer:prompt_tokens_total") == delta("xinfer:request_prompt_tokens_sum")
    assert after["xinfer:num_requests_running"] == 0


# ---- the tiny model: reasoning, auth, metric families before traffic, chat logger ----

FAMILIES = ["xinfer:num_requests_running", "xinfer:num_requests_waiting", "xinfer:kv_cache_usage_perc",
            "xinfer:prefix_cache_queries_total", "xinfer:prefix_cache_hits_total", "xinfer:num_preemptions_total",
            "xinfer:prompt_tokens_total", "xinfer:generation_tokens_total", "xinfer:request_success_total{stop}",
            "xinfer:time_to_first_token_seconds_count", "xinfer:inter_token_latency_seconds_count",
            "xinfer:e2e_request_latency_seconds_count", "xinfer:request_queue_time_seconds_count",
            "xinfer:request_prompt_tokens_count", "xinfer:request_generation_tokens_count"]


def test_every_metric_family_before_traffic_and_auth(tiny):
    base, _ = tiny
    m = _metrics(base)  # /metrics needs no key
    assert [f for f in FAMILIES if f not in m] == []
    assert call(base, "/health")[0] == 200
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    for key in (None, "wrong"):
        status, err = call(base, "/v1/chat/completions", body, key=key)
        assert status == 401 and err["error"]["type"] == "authentication_error"
        assert call(base, "/v1/models", key=key)[0] == 401
    assert call(base, "/v1/chat/completions", body, key="sesame")[0] == 200
    from openai import AuthenticationError, OpenAI
    with pytest.raises(AuthenticationError):
        OpenAI(base_url=base + "/v1", api_key="nope", max_retries=0).models.list()
    assert OpenAI(base_url=base + "/v1", api_key="sesame").models.list().data


def test_reasoning_split_and_thinking_flag(tiny):
    base, logdir = tiny
    from openai import OpenAI
    client = OpenAI(base_url=base + "/v1", api_key="sesame", max_retries=0)
    model = client.models.list().data[0].id
    msgs = [{"role": "user", "content": "think"}]
    # The template opened <think>: everything the model says before </think> is reasoning.
    r = client.chat.completions.create(model=model, messages=msgs, max_tokens=20, temperature=0)
    msg = r.choices[0].message
    assert msg.content == "" and len(msg.reasoning_content) > 0
    assert r.usage.completion_tokens_details.reasoning_tokens > 0
    chunks = list(client.chat.completions.create(model=model, messages=msgs, max_tokens=20, temperature=0,
                                                 stream=True))
    streamed = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or "" for c in chunks if c.choices)
    assert streamed == msg.reasoning_content
    # thinking off: the template closes the block, so the same model's words are content.
    for extra in ({"chat_template_kwargs": {"enable_thinking": False}}, {"thinking": False}):
        off = client.chat.completions.create(model=model, messages=msgs, max_tokens=20, temperature=0,
                                             extra_body=extra)
        assert off.choices[0].message.content and not getattr(off.choices[0].message, "reasoning_content", None)
    logs = list(logdir.glob("log/chat-*.jsonl"))
    lines = [json.loads(line) for p in logs for line in p.read_text().splitlines()]
    assert any(rec["messages"][0]["content"] == "think" and rec["choices"] for rec in lines)


def test_invalid_enforce_parser_fails_at_start_with_the_valid_names():
    r = subprocess.run([sys.executable, "-m", "xinfer.cli", "serve", "--enforce-parser", "bogus", "--port", "1"],
                       capture_output=True, text=True, timeout=120, env={**os.environ})
    assert r.returncode != 0 and "bogus" in r.stderr and "qwen" in r.stderr and "Traceback" not in r.stderr
