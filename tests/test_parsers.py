"""Tool-call and reasoning parsers: recorded outputs of each model family, parsed whole and
streamed in many chunkings, must give the same content and calls."""
import json
import logging
import random
import re
import time

import msgspec
import pytest

from xinfer.ipc.text import ToolCallChunk
from xinfer.parsers import (
    TOOL_PARSERS,
    ReasoningParser,
    ToolParser,
    check_arguments,
    choose_tool_parser,
    get_tool_parser,
    reasoning_markers,
    starts_in_reasoning,
)

PREFIX = "call_0123456789abcdef01234567"

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {
            "city": {"type": "string"},
            "days": {"type": "integer"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "search", "description": "Web search",
        "parameters": {"type": "object", "properties": {
            "query": {"type": "string"},
            "limit": {"type": ["integer", "null"]},
            "exact": {"type": "boolean"},
            "score": {"type": "number"},
            "filters": {"type": "object"},
            "sites": {"type": "array", "items": {"type": "string"}}},
            "required": ["query"]}}},
    {"type": "function", "function": {
        "name": "write_file", "description": "Write a file",
        "parameters": {"type": "object", "properties": {
            "path": {"type": "string"}, "content": {"type": "string"}},
            "required": ["path", "content"]}}},
]


def chunkings(text):
    yield "whole", [text]
    yield "chars", list(text)
    for size in (2, 3, 7):
        yield f"fixed{size}", [text[i:i + size] for i in range(0, len(text), size)]
    for seed in range(4):  # token-sized random pieces
        rng, pieces, i = random.Random(seed), [], 0
        while i < len(text):
            n = rng.randint(1, 9)
            pieces.append(text[i:i + n])
            i += n
        yield f"random{seed}", pieces


def run(parser: ToolParser, chunks):
    content, deltas = [], []
    for chunk in chunks:
        c, d = parser.feed(chunk)
        content.append(c)
        deltas += d
    c, d = parser.finish()
    content.append(c)
    deltas += d
    return "".join(content), assemble(deltas)


def assemble(deltas):
    """Deltas into [(id, name, arguments)], checking the streaming contract on the way."""
    calls: dict[int, list] = {}
    for d in deltas:
        assert isinstance(d, ToolCallChunk)
        if d.index not in calls:
            assert d.index == len(calls), "indices are 0, 1, ... in order"
            assert d.id and d.name
            calls[d.index] = [d.id, d.name, d.arguments]
        else:
            assert d.id is None and d.name is None
            calls[d.index][2] += d.arguments
    return [tuple(v) for v in calls.values()]


def check(family, text, content, calls, **kw):
    """Every chunking gives `content` and `calls` ([(name, args dict)]) exactly."""
    cls = get_tool_parser(family)
    for label, chunks in chunkings(text):
        got_content, got_calls = run(cls(tools=TOOLS, id_prefix=PREFIX, **kw), chunks)
        assert got_content == content, label
        assert [(n, a) for _, n, a in got_calls] == [
            (n, json.dumps(a, ensure_ascii=False)) for n, a in calls], label
        ids = [i for i, _, _ in got_calls]
        assert len(set(ids)) == len(ids) and all(len(i) >= 9 for i in ids)


W = "get_weather"

SAMPLES = {
    "qwen": [
        (("I'll check the weather in Tokyo for you.\n<tool_call>\n"
         '{"name": "get_weather", "arguments": {"city": "東京", "days": 3}}\n</tool_call>'),
         "I'll check the weather in Tokyo for you.\n", [(W, {"city": "東京", "days": 3})]),
        (('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>\n'
         '<tool_call>\n{"name": "search", "arguments": {"query": "Louvre hours 🎨"}}\n</tool_call>'),
         "", [(W, {"city": "Paris", "unit": "celsius"}), ("search", {"query": "Louvre hours 🎨"})]),
        # bad JSON (missing brace): the whole block comes back as content
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>',
         '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}\n</tool_call>', []),
        # a broken block, then prose, then a good call (index 0: the broken one is no call)
        (('<tool_call>\nnot json at all\n</tool_call>\nRetrying. <tool_call>\n'
         '{"name": "search", "arguments": {"query": "x"}}\n</tool_call>\n'),
         "<tool_call>\nnot json at all\n</tool_call>\nRetrying. ", [("search", {"query": "x"})]),
        # cut off by max_tokens
        ('Sure.<tool_call>\n{"name": "get_weather", "argu', 'Sure.<tool_call>\n{"name": "get_weather", "argu', []),
        ("The answer is 42. <tool_ca", "The answer is 42. <tool_ca", []),
        ("Use a < b, <b>bold</b> and <tool>.", "Use a < b, <b>bold</b> and <tool>.", []),
        # arguments sent as an encoded string, and no arguments at all
        (('<tool_call>\n{"name": "search", "arguments": "{\\"query\\": \\"q\\"}"}\n</tool_call>\n'
         '<tool_call>\n{"name": "get_weather"}\n</tool_call>'),
         "", [("search", {"query": "q"}), (W, {})]),
    ],
    "qwen_coder": [
        (("I'll write the file.\n\n<tool_call>\n<function=write_file>\n<parameter=path>\n/tmp/a.py\n</parameter>\n"
         '<parameter=content>\ndef f():\n    return "héllo"\n\n</parameter>\n</function>\n</tool_call>'),
         "I'll write the file.\n\n",
         [("write_file", {"path": "/tmp/a.py", "content": 'def f():\n    return "héllo"\n'})]),
        (("<tool_call>\n<function=get_weather>\n<parameter=city>\nSan Francisco\n</parameter>\n"
         "<parameter=days>\n5\n</parameter>\n</function>\n</tool_call>\n"
         "<tool_call>\n<function=search>\n<parameter=query>\n42\n</parameter>\n<parameter=limit>\n10\n</parameter>\n"
         "<parameter=exact>\nTrue\n</parameter>\n<parameter=score>\n0.5\n</parameter>\n"
         '<parameter=filters>\n{"lang": "en"}\n</parameter>\n<parameter=sites>\n["a.org", "b.org"]\n</parameter>\n'
         "<parameter=extra>\n7\n</parameter>\n</function>\n</tool_call>"),
         "", [(W, {"city": "San Francisco", "days": 5}),
              ("search", {"query": "42", "limit": 10, "exact": True, "score": 0.5, "filters": {"lang": "en"},
                          "sites": ["a.org", "b.org"], "extra": "7"})]),
        # a value that does not convert stays text
        (("<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
         "<parameter=days>\na few\n</parameter>\n</function>\n</tool_call>"),
         "", [(W, {"city": "Oslo", "days": "a few"})]),
        ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n",
         "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n", []),
        ("<tool_call>\nhello\n</tool_call>", "<tool_call>\nhello\n</tool_call>", []),
        # Qwen3-Coder sometimes falls back to Hermes JSON inside the block
        ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Kyiv"}}\n</tool_call>', "", [(W, {"city": "Kyiv"})]),
    ],
    "llama": [
        ('{"name": "get_weather", "parameters": {"city": "São Paulo", "days": 2}}',
         "", [(W, {"city": "São Paulo", "days": 2})]),
        (('<|python_tag|>{"name": "search", "parameters": {"query": "llama 3.1 release"}}; '
         '{"name": "get_weather", "arguments": {"city": "Oslo"}}'),
         "", [("search", {"query": "llama 3.1 release"}), (W, {"city": "Oslo"})]),
        ("The capital of France is Paris.", "The capital of France is Paris.", []),
        ('{"answer": 42, "unit": "m"}', '{"answer": 42, "unit": "m"}', []),
        ('{"name": "get_weather", "parameters": {"city": "Oslo"}', '{"name": "get_weather", "parameters": {"city": "Oslo"}', []),
        ('<|python_tag|>brave_search.call(query="weather")', '<|python_tag|>brave_search.call(query="weather")', []),
        ("Answer: 3 <|python_t", "Answer: 3 <|python_t", []),
    ],
    "mistral": [
        (('[TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}, "id": "a1b2c3d4e"}, '
         '{"name": "search", "arguments": {"query": "météo"}}]'),
         "", [(W, {"city": "Paris", "unit": "celsius"}), ("search", {"query": "météo"})]),
        (('Let me look that up.[TOOL_CALLS]get_weather[ARGS]{"city": "Zürich"}'
         '[TOOL_CALLS]search[ARGS]{"query": "Zürich events", "limit": 5}'),
         "Let me look that up.", [(W, {"city": "Zürich"}), ("search", {"query": "Zürich events", "limit": 5})]),
        ('[TOOL_CALLS]get_weather[CALL_ID]Ab3dE5gH9[ARGS]{"city": "Rome"}', "", [(W, {"city": "Rome"})]),
        ("[TOOL_CALLS]Sorry, I cannot do that.", "[TOOL_CALLS]Sorry, I cannot do that.", []),
        ("Done. [TOOL_CA", "Done. [TOOL_CA", []),
        ('[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"', '[TOOL_CALLS]get_weather[ARGS]{"city": "Rome"', []),
        ('[TOOL_CALLS][{"city": "Rome"}]', '[TOOL_CALLS][{"city": "Rome"}]', []),
        # no [ARGS] within a name's length: prose, and a real call after it still parses
        ("[TOOL_CALLS]" + "x" * 300 + '[ARGS]{}[TOOL_CALLS]search[ARGS]{"query": "q"}',
         "[TOOL_CALLS]" + "x" * 300 + "[ARGS]{}", [("search", {"query": "q"})]),
    ],
    "pythonic": [
        (("[get_weather(city=\"Köln\", days=3), search(query='best \"ramen\"', "
         'filters={"lang": "ja", "open": True}, sites=["a.jp"], limit=None)]'),
         "", [(W, {"city": "Köln", "days": 3}),
              ("search", {"query": 'best "ramen"', "filters": {"lang": "ja", "open": True}, "sites": ["a.jp"],
                          "limit": None})]),
        ("[get_time()]", "", [("get_time", {})]),
        ("[get_weather(city=input())]", "[get_weather(city=input())]", []),
        ("The list [1, 2, 3] is sorted.", "The list [1, 2, 3] is sorted.", []),
        ('[get_weather(city="Oslo"', '[get_weather(city="Oslo"', []),
        ('[get_weather("Oslo")]', '[get_weather("Oslo")]', []),
    ],
    "deepseek": [
        (("我来查一下。<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
         '{"city": "北京"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>search\n```json\n'
         '{"query": "天气"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
         "我来查一下。", [(W, {"city": "北京"}), ("search", {"query": "天气"})]),
        (('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}'
         "<｜tool▁call▁end｜><｜tool▁calls▁end｜>"), "", [(W, {"city": "Paris"})]),
        # the model stopped after the last call, before the section's closing marker
        ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Lyon"}<｜tool▁call▁end｜>',
         "", [(W, {"city": "Lyon"})]),
        ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": <｜tool▁call▁end｜><｜tool▁calls▁end｜>',
         '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": <｜tool▁call▁end｜><｜tool▁calls▁end｜>',
         []),
        ("Okay<｜tool▁calls", "Okay<｜tool▁calls", []),
    ],
    "json": [
        ('{"name": "get_weather", "arguments": {"city": "Lisbon"}}', "", [(W, {"city": "Lisbon"})]),
        ('  \n[{"name": "get_weather", "parameters": {"city": "Lisbon"}}, {"name": "search", "arguments": {"query": "café"}}]\n',
         "", [(W, {"city": "Lisbon"}), ("search", {"query": "café"})]),
        ("Hello there!", "Hello there!", []),
        ('{"name": "get_weather", "arguments": ', '{"name": "get_weather", "arguments": ', []),
        ("[]", "[]", []),
        ('{"name": "get_weather", "arguments": {"city": "Faro"}}\nThat is all.', "\nThat is all.", [(W, {"city": "Faro"})]),
    ],
    "passthrough": [
        ('<tool_call>\n{"name": "x"}\n</tool_call>', '<tool_call>\n{"name": "x"}\n</tool_call>', []),
        ("  hi ", "  hi ", []),
    ],
}

CASES = [(family, i, *sample) for family, samples in SAMPLES.items() for i, sample in enumerate(samples)]


@pytest.mark.parametrize("family,i,text,content,calls", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_recorded_outputs(family, i, text, content, calls):
    check(family, text, content, calls)


@pytest.mark.parametrize("family", sorted(SAMPLES))
def test_mixed_outputs_agree_across_chunkings(family):
    """Samples glued together (with prose between) have no expected answer written down, but
    every chunking must agree with the whole parse."""
    rng = random.Random(family)
    texts = [t for t, _, _ in SAMPLES[family]]
    for _ in range(12):
        text = rng.choice(["", "Okay. ", "\n"]).join(rng.sample(texts, min(3, len(texts))))
        cls = get_tool_parser(family)
        want = run(cls(tools=TOOLS, id_prefix=PREFIX), [text])
        for label, chunks in chunkings(text):
            assert run(cls(tools=TOOLS, id_prefix=PREFIX), chunks) == want, (label, text)


def test_registry_and_errors():
    assert set(TOOL_PARSERS) == {"json", "qwen", "qwen_coder", "llama", "mistral", "pythonic", "deepseek", "passthrough",
                                 "glm45_moe", "glm47_moe", "step3", "kimik2", "minimax_m2"}
    for name, cls in TOOL_PARSERS.items():
        assert get_tool_parser(name) is cls and issubclass(cls, ToolParser) and cls.name == name
    assert get_tool_parser("hermes").name == "qwen"  # vLLM's name of the same format
    with pytest.raises(ValueError) as e:
        get_tool_parser("bogus")
    for name in TOOL_PARSERS:
        assert name in str(e.value)


def test_content_streams_early():
    p = get_tool_parser("qwen")(id_prefix=PREFIX)
    assert p.feed("Let me check. <tool") == ("Let me check. ", [])
    assert p.feed("box> ok") == ("<toolbox> ok", [])
    c, calls = p.feed('<tool_call>\n{"name": "a", "arguments": {}}\n</tool_call>')
    assert c == "" and [d.name for d in calls] == ["a"]
    assert p.finish() == ("", [])
    p = get_tool_parser("mistral")(id_prefix=PREFIX)
    assert p.feed("Hi [TOOL") == ("Hi ", [])
    assert p.feed("S] x") == ("[TOOLS] x", [])


def test_long_call_streams_in_linear_time():
    big = 'line "quoted" \\ and ünïcode\n' * 1500
    text = '<tool_call>\n' + json.dumps({"name": "write_file", "arguments": {"path": "a", "content": big}}) + '\n</tool_call>'
    p = get_tool_parser("qwen")(id_prefix=PREFIX)
    start = time.perf_counter()
    content, calls = run(p, list(text))
    assert time.perf_counter() - start < 2.0
    assert content == "" and json.loads(calls[0][2])["content"] == big


def test_delta_travels_as_msgpack():
    d = ToolCallChunk(0, 0, PREFIX + "-0", W, '{"city": "東京"}')
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(d), type=ToolCallChunk) == d


def test_ids():
    p = get_tool_parser("qwen")(id_prefix=PREFIX)
    _, calls = run(p, ['<tool_call>{"name": "a"}</tool_call><tool_call>{"name": "b"}</tool_call>'])
    assert [i for i, _, _ in calls] == [PREFIX + "-0", PREFIX + "-1"]
    # a short prefix gets a random suffix: still unique per request and long enough
    a = run(get_tool_parser("json")(), ['{"name": "a"}'])[1][0][0]
    b = run(get_tool_parser("json")(), ['{"name": "a"}'])[1][0][0]
    assert a != b and len(a) >= 9 and a.startswith("call_")
    m = run(get_tool_parser("mistral")(id_prefix=PREFIX), ["[TOOL_CALLS]a[ARGS]{}[TOOL_CALLS]b[ARGS]{}"])[1]
    assert all(re.fullmatch(r"[A-Za-z0-9]{9}", i) for i, _, _ in m) and m[0][0] != m[1][0]


FORCED = [
    ("qwen", W, '{"city": "Paris"}}\n</tool_call>'),
    ("qwen", None, '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'),
    ("qwen_coder", W, "<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"),
    ("qwen_coder", None, "<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"),
    ("json", W, '{"city": "Paris"}}'),
    ("json", None, '"get_weather", "arguments": {"city": "Paris"}}'),
    ("llama", W, '{"city": "Paris"}}'),
    ("llama", None, '"get_weather", "parameters": {"city": "Paris"}}'),
    ("mistral", W, '{"city": "Paris"}}]'),
    ("mistral", None, 'get_weather[ARGS]{"city": "Paris"}'),
    ("pythonic", W, 'city="Paris")]'),
    ("pythonic", None, 'get_weather(city="Paris")]'),
    ("deepseek", W, '{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
    ("deepseek", None, 'get_weather<｜tool▁sep｜>{"city": "Paris"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'),
]


@pytest.mark.parametrize("family,function,continuation", FORCED)
def test_forced_prefix_round_trip(family, function, continuation):
    prefix = get_tool_parser(family).forced_prefix(function)
    assert prefix
    check(family, continuation, "", [(W, {"city": "Paris"})], prefix=prefix)


def test_forced_prefix_failure_and_passthrough():
    assert get_tool_parser("passthrough").forced_prefix(None) is None
    assert get_tool_parser("pythonic").forced_prefix("not a name") is None
    # the model broke the forced call: its own text comes back, the prefix does not
    prefix = get_tool_parser("qwen").forced_prefix(W)
    check("qwen", "oops, no JSON", "oops, no JSON", [], prefix=prefix)
    check("qwen", '{"city": }}\n</tool_call>\nok', '{"city": }}\n</tool_call>\nok', [], prefix=prefix)
    # "arguments": null counts as no arguments
    check("qwen", 'null}\n</tool_call>\nok', "\nok", [(W, {})], prefix=prefix)


STRICT_TEXT = ('<tool_call>\n{"name": "launch_rocket", "arguments": {}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_weather", "arguments": {"city": 5}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Bern", "wind": true}}\n</tool_call>\n'
               '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Bern", "unit": "celsius"}}\n</tool_call>')


def test_strict_mode(monkeypatch, caplog):
    monkeypatch.delenv("XINFER_STRICT_TOOL_CALL", raising=False)
    check("qwen", STRICT_TEXT, "", [("launch_rocket", {}), (W, {"city": 5}), (W, {"city": "Bern", "wind": True}),
                                    (W, {"city": "Bern", "unit": "celsius"})])
    monkeypatch.setenv("XINFER_STRICT_TOOL_CALL", "1")
    with caplog.at_level(logging.WARNING, logger="xinfer.parsers"):
        check("qwen", STRICT_TEXT, "", [(W, {"city": "Bern", "unit": "celsius"})])
    text = caplog.text
    assert "launch_rocket" in text and "expected string" in text and "wind" in text
    # no tools declared: nothing can match
    p = get_tool_parser("qwen")(id_prefix=PREFIX)
    assert run(p, ['<tool_call>{"name": "get_weather"}</tool_call>']) == ("", [])


def test_check_arguments():
    weather = TOOLS[0]["function"]["parameters"]
    search = TOOLS[1]["function"]["parameters"]
    assert check_arguments({"city": "Bern"}, weather) is None
    assert check_arguments({"city": "Bern", "days": 2, "unit": "fahrenheit"}, weather) is None
    assert check_arguments({"anything": 1}, None) is None
    assert check_arguments({"x": 1}, {}) is None
    assert "required" in check_arguments({"days": 2}, weather)
    assert "expected integer" in check_arguments({"city": "Bern", "days": 2.5}, weather)
    assert "expected integer" in check_arguments({"city": "Bern", "days": True}, weather)
    assert "not one of" in check_arguments({"city": "Bern", "unit": "kelvin"}, weather)
    assert "unexpected property" in check_arguments({"city": "Bern", "x": 1}, weather)
    assert check_arguments({"query": "q", "limit": None, "score": 1, "filters": {"a": [1]}}, search) is None
    assert "arguments.limit" in check_arguments({"query": "q", "limit": "3"}, search)
    assert "arguments.sites[1]" in check_arguments({"query": "q", "sites": ["a", 2]}, search)
    nested = {"type": "object", "properties": {"loc": {"type": "object", "properties": {
        "lat": {"type": "number"}}, "required": ["lat"], "additionalProperties": False}}}
    assert check_arguments({"loc": {"lat": 1.5}}, nested) is None
    assert "arguments.loc" in check_arguments({"loc": {"lon": 1}}, nested)
    assert "expected object" in check_arguments({"loc": [1]}, nested)
    extra = {"type": "object", "additionalProperties": {"type": "string"}}
    assert check_arguments({"a": "b"}, extra) is None and check_arguments({"a": 1}, extra)
    either = {"anyOf": [{"type": "string"}, {"type": "integer"}]}
    assert check_arguments({"x": 1}, {"properties": {"x": either}}) is None
    assert check_arguments({"x": []}, {"properties": {"x": either}})


# Pieces of the real chat templates, as shipped in each model's tokenizer_config.json.
QWEN25 = ("{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {{- \"\\n\\n# Tools\\n\\nYou may call one or more "
          "functions to assist with the user query.\\n\\nYou are provided with function signatures within "
          "<tools></tools> XML tags:\\n<tools>\" }}\n    {%- for tool in tools %}\n        {{- \"\\n\" }}\n"
          "        {{- tool | tojson }}\n    {%- endfor %}\n    {{- \"\\n</tools>\\n\\nFor each function call, return "
          "a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n"
          "{\\\"name\\\": <function-name>, \\\"arguments\\\": <args-json-object>}\\n</tool_call><|im_end|>\\n\" }}")
QWEN3 = QWEN25 + ("{%- if reasoning_content %}{{- '<|im_start|>' + message.role + '\\n<think>\\n' + "
                  "reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}{%- endif %}"
                  "{%- if enable_thinking is defined and enable_thinking is false %}"
                  "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}")
QWEN3_CODER = ("{%- if tools is iterable and tools | length > 0 %}{{- \"\\n\\n# Tools\\n\\nYou have access to the "
               "following functions:\\n\\n\" }}{{- \"<tools>\" }}...{{- '\\n\\nIf you choose to call a function "
               "ONLY reply in the following format with NO suffix:\\n\\n<tool_call>\\n<function=example_function_name>"
               "\\n<parameter=example_parameter_1>\\nvalue_1\\n</parameter>\\n</function>\\n</tool_call>' }}")
LLAMA31 = ("{%- if builtin_tools is defined or tools is not none %}\n    {{- \"Environment: ipython\\n\" }}\n"
           "{%- endif %}\n    {{- 'Given the following functions, please respond with a JSON for a function call '"
           " }}\n    {{- 'with its proper arguments that best answers the given prompt.\\n\\n' }}\n    {{- 'Respond in "
           "the format {\"name\": function name, \"parameters\": dictionary of argument name and its value}.' }}\n"
           "{%- if builtin_tools is defined and tool_call.name in builtin_tools %}\n"
           "{{- '<|python_tag|>' + tool_call.name + '.call(' }}")
MISTRAL = ("{%- if message['role'] == 'user' %}{%- if tools is not none and (message == user_messages[-1]) %}"
           "{{- '[AVAILABLE_TOOLS] [' }}...{{- '[/AVAILABLE_TOOLS]' }}{%- endif %}"
           "{%- elif message.tool_calls is defined and message.tool_calls is not none %}{{- '[TOOL_CALLS] [' }}")
DEEPSEEK_V3 = ("{%- if message['role'] == 'assistant' and 'tool_calls' in message %}{%- for tool in "
               "message['tool_calls'] %}{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + "
               "'<｜tool▁sep｜>' + tool['function']['name'] + '\\n' + '```json' + '\\n' + "
               "tool['function']['arguments'] + '\\n' + '```' + '<｜tool▁call▁end｜>'}}{%- endfor %}")
LLAMA32_PYTHONIC = ("{{- \"If you decide to invoke any of the function(s), you MUST put it in the format of "
                    "[func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]\" }}")
SMOLLM2 = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
           "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
           "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
           "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
GENERIC_TOOLS = "{% if tools %}You can use these tools: {{ tools | tojson }}{% endif %}{{ messages }}"


def test_choose_tool_parser():
    assert choose_tool_parser("Qwen2ForCausalLM", QWEN25) == "qwen"
    assert choose_tool_parser("Qwen3ForCausalLM", QWEN3) == "qwen"
    assert choose_tool_parser("Qwen3MoeForCausalLM", QWEN3_CODER) == "qwen_coder"
    assert choose_tool_parser("LlamaForCausalLM", LLAMA31) == "llama"
    assert choose_tool_parser("LlamaForCausalLM", LLAMA32_PYTHONIC) == "pythonic"
    assert choose_tool_parser("MistralForCausalLM", MISTRAL) == "mistral"
    assert choose_tool_parser("DeepseekV3ForCausalLM", DEEPSEEK_V3) == "deepseek"
    assert choose_tool_parser("LlamaForCausalLM", SMOLLM2) == "passthrough"
    assert choose_tool_parser("LlamaForCausalLM", GENERIC_TOOLS) == "json"
    # no template: the architecture, where it says something
    assert choose_tool_parser("Qwen2ForCausalLM", None) == "qwen"
    assert choose_tool_parser("LlamaForCausalLM", None) == "passthrough"
    assert choose_tool_parser(None, None) == "passthrough"
    assert choose_tool_parser("LlamaForCausalLM", SMOLLM2, enforce="llama") == "llama"
    with pytest.raises(ValueError, match="qwen_coder"):
        choose_tool_parser("LlamaForCausalLM", SMOLLM2, enforce="nope")


def test_reasoning_markers():
    assert reasoning_markers(QWEN3) == ("<think>", "</think>")
    assert reasoning_markers(QWEN25) is None
    assert reasoning_markers(None) is None
    assert reasoning_markers("{{- '[THINK]' + thinking + '[/THINK]' }}") == ("[THINK]", "[/THINK]")
    assert reasoning_markers("{{ '◁think▷' + reasoning + '◁/think▷' }}") == ("◁think▷", "◁/think▷")
    think = ("<think>", "</think>")
    assert starts_in_reasoning("<｜User｜>2+2?<｜Assistant｜><think>\n", think)
    assert not starts_in_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n", think)
    assert not starts_in_reasoning("<|im_start|>assistant\n", think)
    assert not starts_in_reasoning("<think>", None)


def reason(text, chunks=None, **kw):
    p = ReasoningParser(**kw)
    r, c = [], []
    for chunk in chunks or [text]:
        a, b = p.feed(chunk)
        r.append(a)
        c.append(b)
    a, b = p.finish()
    return "".join(r + [a]), "".join(c + [b])


REASONING = [
    ("<think>\nThe user wants 2+2.\n</think>\n\nThe answer is 4.", {}, "\nThe user wants 2+2.\n", "The answer is 4."),
    ("Okay, 2+2 is 4.\n</think>\n\n4", {"in_reasoning": True}, "Okay, 2+2 is 4.\n", "4"),
    ("thinking forever and then </thi", {"in_reasoning": True}, "thinking forever and then </thi", ""),
    ("A<think>x</think>B<think>y</think>\n\nC\n\nD", {}, "xy", "ABC\n\nD"),
    ("No reasoning here, <b>bold</b> <thi", {}, "", "No reasoning here, <b>bold</b> <thi"),
    ("</think>stray end", {}, "", "</think>stray end"),
    ("[THINK]Let me see… 東京[/THINK]\nTokyo.", {"start": "[THINK]", "end": "[/THINK]"}, "Let me see… 東京", "Tokyo."),
    ("◁think▷hmm◁/think▷ok", {"start": "◁think▷", "end": "◁/think▷"}, "hmm", "ok"),
    ("<think>\n\n</think>\n\n", {}, "\n\n", ""),
]


@pytest.mark.parametrize("text,kw,reasoning,content", REASONING)
def test_reasoning(text, kw, reasoning, content):
    for label, chunks in chunkings(text):
        assert reason(text, chunks, **kw) == (reasoning, content), label


def test_reasoning_streams_early_and_holds_split_markers():
    p = ReasoningParser()
    assert p.feed("<th") == ("", "")
    assert p.feed("ink>abc</") == ("abc", "")
    assert p.feed("thi") == ("", "")
    assert p.feed("nk>\n") == ("", "")
    assert p.feed("\nHi <") == ("", "Hi ")
    assert p.feed("b>") == ("", "<b>")
    assert p.finish() == ("", "")


def test_reasoning_then_tools_chain():
    """The parser process runs reasoning first and feeds its content to the tool parser."""
    text = ("<think>\nThe user wants Tokyo's weather; call get_weather.\n</think>\n\n"
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "東京"}}\n</tool_call>')
    for label, chunks in chunkings(text):
        rp, tp = ReasoningParser(), get_tool_parser("qwen")(tools=TOOLS, id_prefix=PREFIX)
        reasoning, content, deltas = "", "", []
        for chunk in chunks:
            r, c = rp.feed(chunk)
            c, d = tp.feed(c)
            reasoning, content, deltas = reasoning + r, content + c, deltas + d
        r, c = rp.finish()
        c, d = tp.feed(c)
        c2, d2 = tp.finish()
        reasoning, content, deltas = reasoning + r, content + c + c2, deltas + d + d2
        assert reasoning == "\nThe user wants Tokyo's weather; call get_weather.\n", label
        assert content == "" and assemble(deltas) == [(PREFIX + "-0", W, '{"city": "東京"}')], label
