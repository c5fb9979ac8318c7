"""Request bodies are decoded once into typed structs with a bound on every field (xinfer/api/schema.py):
each input that once reached code not written for it (a 500, a hang, a crash further down) now gets
a 4xx OpenAI error naming the field, and the next valid request still works. Plus /openapi.json and
the tool-call parsers on deeply nested model output."""
import json
import time
import urllib.error
import urllib.request

import pytest

from tests.conftest import start_server, stop_server
from xinfer.parsers import TOOL_PARSERS, get_tool_parser


@pytest.fixture(scope="module")
def base():
    proc, url, _ = start_server("--kv-cache-gb", "0.2", "--max-n", "4", "--max-prompts-per-request", "8")
    yield url
    stop_server(proc)


def call(base, path, body=None, raw: bytes | None = None, method=None):
    data = raw if raw is not None else json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(base + path, data=data, headers={"Content-Type": "application/json"},
                                 method=method)
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


MSGS = [{"role": "user", "content": "Hi"}]
CHAT = "/v1/chat/completions"
DEEP = 10_000

# (path, body as JSON or raw bytes, the param the 400 names; None: the body as a whole)
BAD = [
    (CHAT, {"messages": MSGS, "min_tokens": -10_000_000_000}, "min_tokens"),
    (CHAT, {"messages": MSGS, "min_p": 1e11}, "min_p"),
    (CHAT, {"messages": MSGS, "presence_penalty": 1e10}, "presence_penalty"),
    (CHAT, {"messages": MSGS, "max_tokens": 2**64}, "max_tokens"),
    (CHAT, {"messages": MSGS, "seed": 2**63}, "seed"),
    (CHAT, {"messages": MSGS, "seed": -(2**63) - 1}, "seed"),
    (CHAT, {"messages": MSGS, "n": 2**64}, "n"),
    (CHAT, {"messages": MSGS, "top_k": 2**63}, "top_k"),
    ("/v1/completions", {"prompt": "x", "logprobs": 2**64}, "logprobs"),
    (CHAT, {"messages": MSGS, "n": 3000.0}, "n"),
    (CHAT, {"messages": MSGS, "n": 1e9}, "n"),
    (CHAT, {"messages": MSGS, "n": 5}, "n"),  # over --max-n
    (CHAT, {"messages": MSGS, "stop": ["a"] * 17}, "stop"),
    (CHAT, {"messages": MSGS, "logit_bias": {"x": 1}}, "logit_bias"),
    (CHAT, {"messages": MSGS, "stream": True, "stream_options": "x"}, "stream_options"),
    (CHAT, {"messages": MSGS, "stream": True, "stream_options": [1]}, "stream_options"),
    (CHAT, {"messages": MSGS, "chat_template_kwargs": {"a-b": 1}}, "chat_template_kwargs"),
    (CHAT, {"messages": MSGS, "tool_choice": "sometimes"}, "tool_choice"),
    ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 1}', "prompt"),
    (CHAT, b'{"messages": [{"role": "user", "content": "x"}], "stop": ["ok", "\\udc00"]}', "stop"),
    (CHAT, b'{"messages": [{"role": "user", "content": "x\\ud83d"}]}', "messages"),
    ("/tokenize", b'{"prompt": "\\ud800"}', "prompt"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    (CHAT, b'{"a":' * DEEP + b"1" + b"}" * DEEP, None),
    (CHAT, b"[" * DEEP + b"]" * DEEP, None),
    (CHAT, {"messages": MSGS, "extra": json.loads("[" * 500 + "]" * 500)}, None),
    (CHAT, {"messages": MSGS, "tools": [{"type": "function", "function": {
        "name": "f", "parameters": json.loads('{"a":' * 100 + "1" + "}" * 100)}}]}, None),
]


def _ok(base):
    status, body = call(base, CHAT, {"messages": MSGS, "max_tokens": 1})
    assert status == 200 and body["choices"][0]["message"]["role"] == "assistant"


@pytest.mark.parametrize("path,body,param", BAD, ids=range(len(BAD)))
def test_bad_body_is_a_400_naming_the_field_then_a_valid_request_works(base, path, body, param):
    raw = body if isinstance(body, bytes) else None
    status, err = call(base, path, None if raw else body, raw=raw)
    assert status == 400, err
    assert set(err["error"]) == {"message", "type", "param", "code"} and err["error"]["message"]
    assert err["error"]["param"] == param, err
    _ok(base)


def test_too_many_prompts_is_a_fast_400(base):
    t0 = time.monotonic()
    status, err = call(base, "/v1/completions", {"prompt": ["x"] * 20_000, "max_tokens": 1})
    assert status == 400 and err["error"]["param"] == "prompt" and "8" in err["error"]["message"]
    assert time.monotonic() - t0 < 5
    status, ok = call(base, "/v1/completions", {"prompt": ["x"] * 8, "max_tokens": 1})
    assert status == 200 and len(ok["choices"]) == 8


def test_template_kwargs_naming_the_renderers_own_arguments_are_dropped(base):
    for kwargs in ({"self": 1}, {"messages": [], "add_generation_prompt": False, "bos_token": "x"}):
        status, body = call(base, CHAT, {"messages": MSGS, "max_tokens": 1, "temperature": 0,
                                         "chat_template_kwargs": kwargs})
        assert status == 200, body
    plain = call(base, "/tokenize", {"messages": MSGS})[1]
    assert call(base, "/tokenize", {"messages": MSGS, "chat_template_kwargs": {"self": 1}})[1] == plain


def test_completions_without_max_tokens_get_16(base):
    status, body = call(base, "/v1/completions", {"prompt": "Once upon a time", "ignore_eos": True})
    assert status == 200 and body["usage"]["completion_tokens"] == 16


def test_openapi_document_names_every_route_with_its_body(base):
    status, doc = call(base, "/openapi.json")
    assert status == 200 and doc["openapi"].startswith("3.")
    posts = {p for p, ops in doc["paths"].items() if "post" in ops}
    assert posts == {CHAT, "/v1/completions", "/tokenize", "/detokenize", "/v1/embeddings", "/v1/responses",
                     "/v1/messages", "/v1/messages/count_tokens"}
    assert {"/health", "/v1/models", "/v1/models/{model_id}", "/openapi.json"} <= set(doc["paths"])
    chat = doc["paths"][CHAT]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert "$ref" not in json.dumps(doc["paths"])  # each request schema stands alone
    assert chat["required"] == ["messages"]
    assert chat["properties"]["temperature"]["anyOf"][0] == {"type": "number", "minimum": 0, "maximum": 100}
    assert "get" not in doc["paths"][CHAT] and "requestBody" not in doc["paths"]["/health"]["get"]


@pytest.mark.parametrize("name", list(TOOL_PARSERS))
@pytest.mark.parametrize("text", ["[" * 1000, '{"a":' * 1000, "[" * 1000 + "]" * 1000,
                                  '{"name": "f", "arguments": ' + '{"a":' * 1000 + "1" + "}" * 1001,
                                  "<tool_call>" + "[" * 1000 + "]" * 1000 + "</tool_call>",
                                  "[TOOL_CALLS]" + '{"a":' * 1000 + "1" + "}" * 1000],
                         ids=["open", "objects", "closed", "deep-args", "qwen", "mistral"])
def test_tool_parsers_give_deeply_nested_output_back_as_content(name, text):
    p = get_tool_parser(name)()
    content, calls = p.feed(text)
    rest, more = p.finish()
    assert calls + more == [] and content + rest == text


def test_health_answers_fast_while_a_5mb_prompt_is_tokenized(base):
    """Tokenizing (GIL released) and encoding the 1.4M-id answer run off the event loop."""
    import statistics
    import threading
    import time
    prompt = "hello world, this is a test. " * 170_000  # 4.9 MB
    result = {}

    def big():
        result["r"] = call(base, "/tokenize", {"prompt": prompt})

    t = threading.Thread(target=big)
    t.start()
    times = []
    time.sleep(0.2)  # the upload is read first; then the tokenizer runs for a second or more
    while t.is_alive():
        t0 = time.perf_counter()
        assert call(base, "/health")[0] == 200
        times.append(time.perf_counter() - t0)
        time.sleep(0.02)
    t.join()
    status, body = result["r"]
    assert status == 200 and body["count"] > 1_000_000
    print(f"/health during a 5 MB tokenize: {len(times)} calls, median {statistics.median(times) * 1e3:.1f} ms, "
          f"max {max(times) * 1e3:.1f} ms")
    assert len(times) >= 5 and statistics.median(times) < 0.05 and max(times) < 0.25
