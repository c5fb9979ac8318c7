"""The GLM-4.5 / 4.7, Step3, Kimi K2 and MiniMax-M2 tool-call families: outputs in each
family's documented format, parsed whole and streamed in many chunkings (one character at a
time, fixed sizes, seeded random pieces), must give the same content and calls."""
import json
import random

import pytest

from tests.test_parsers import PREFIX, TOOLS, W, check, run
from xinfer.parsers import TOOL_PARSERS, choose_tool_parser, get_tool_parser

NESTED = {"lang": "fr", "tags": ["musée", {"deep": [1, 2, {"ü": None}]}], "ok": True}
NESTED_JSON = json.dumps(NESTED, ensure_ascii=False)


def glm45(name, pairs):
    return f"<tool_call>{name}\n" + "".join(
        f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in pairs) + "</tool_call>"


def glm47(name, pairs):
    return f"<tool_call>{name}" + "".join(
        f"<arg_key>{k}</arg_key><arg_value>{v}</arg_value>" for k, v in pairs) + "</tool_call>"


S3 = "<｜tool_calls_begin｜>", "<｜tool_calls_end｜>", "<｜tool_call_begin｜>", "<｜tool_call_end｜>", "<｜tool_sep｜>"


def step3(*calls, close=True):
    b, e, cb, ce, sep = S3
    body = "".join(
        f'{cb}function{sep}<steptml:invoke name="{name}">' + "".join(
            f'<steptml:parameter name="{k}">{v}</steptml:parameter>' for k, v in pairs)
        + f"</steptml:invoke>{ce}" for name, pairs in calls)
    return b + body + (e if close else "")


K2 = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>", "<|tool_call_begin|>", "<|tool_call_end|>", "<|tool_call_argument_begin|>"


def kimi(*calls):
    b, e, cb, ce, arg = K2
    return b + "".join(f"{cb}functions.{name}:{i}{arg}{args}{ce}" for i, (name, args) in enumerate(calls)) + e


def minimax(*calls):
    return "<minimax:tool_call>\n" + "".join(
        f'<invoke name="{name}">\n' + "".join(f'<parameter name="{k}">{v}</parameter>\n' for k, v in pairs)
        + "</invoke>\n" for name, pairs in calls) + "</minimax:tool_call>"


WEATHER = [("city", "東京"), ("days", "3")]
SEARCH = [("query", "Louvre hours 🎨"), ("filters", NESTED_JSON), ("sites", '["a.fr", "b.fr"]')]
WEATHER_ARGS = {"city": "東京", "days": 3}
SEARCH_ARGS = {"query": "Louvre hours 🎨", "filters": NESTED, "sites": ["a.fr", "b.fr"]}
TEXT = "I'll check that for you.\n"

SAMPLES = {
    "glm45_moe": [
        (TEXT + glm45(W, WEATHER), TEXT, [(W, WEATHER_ARGS)]),
        (glm45(W, [("city", "Paris")]) + "\n" + glm45("search", SEARCH),
         "", [(W, {"city": "Paris"}), ("search", SEARCH_ARGS)]),
        # a tool with no schema: values that load as JSON are JSON, the rest text
        (glm45("lookup", [("id", "42"), ("note", "hi there"), ("tree", NESTED_JSON), ("n", "NaN")]) + "\nDone.",
         "\nDone.", [("lookup", {"id": 42, "note": "hi there", "tree": NESTED, "n": "NaN"})]),
        (glm45("get_time", []), "", [("get_time", {})]),
        # vLLM's test layout: a newline before the name, key and value on one line
        ("<tool_call>\nbash\n<arg_key>command</arg_key><arg_value>echo TOOL_OK</arg_value>\n</tool_call>",
         "", [("bash", {"command": "echo TOOL_OK"})]),
        # a pair with no <arg_value>: the block comes back verbatim
        ("<tool_call>get_weather\n<arg_key>city</arg_key>Paris</tool_call> ok",
         "<tool_call>get_weather\n<arg_key>city</arg_key>Paris</tool_call> ok", []),
        ("<tool_call>\n\n</tool_call>", "<tool_call>\n\n</tool_call>", []),
    ],
    "glm47_moe": [
        (TEXT + glm47(W, WEATHER), TEXT, [(W, WEATHER_ARGS)]),
        (glm47(W, [("city", "Paris")]) + glm47("search", SEARCH),
         "", [(W, {"city": "Paris"}), ("search", SEARCH_ARGS)]),
        (glm47("get_time", []) + " then text", " then text", [("get_time", {})]),
        ("<tool_call>get_weather<arg_key>city<arg_value>Paris</arg_value></tool_call>",
         "<tool_call>get_weather<arg_key>city<arg_value>Paris</arg_value></tool_call>", []),
        # cut off before </tool_call>: content, never lost
        ("Sure. <tool_call>get_weather<arg_key>city</arg_key>",
         "Sure. <tool_call>get_weather<arg_key>city</arg_key>", []),
    ],
    "step3": [
        (TEXT + step3((W, WEATHER)), TEXT, [(W, WEATHER_ARGS)]),
        (step3((W, [("city", "Paris")]), ("search", SEARCH)),
         "", [(W, {"city": "Paris"}), ("search", SEARCH_ARGS)]),
        # no closing <｜tool_calls_end｜>, but every call closed
        (step3(("get_time", []), close=False), "", [("get_time", {})]),
        # SGLang's layout: newlines around the calls and parameters
        ("<｜tool_calls_begin｜>\n<｜tool_call_begin｜>function<｜tool_sep｜><steptml:invoke name=\"run_code\">\n"
         "<steptml:parameter name=\"code\">if a < b: print(a)</steptml:parameter>\n"
         "<steptml:parameter name=\"lang\">python</steptml:parameter>\n</steptml:invoke><｜tool_call_end｜>\n"
         "<｜tool_calls_end｜>", "", [("run_code", {"code": "if a < b: print(a)", "lang": "python"})]),
        (step3((W, [("city", "Paris")])) + " Done.", " Done.", [(W, {"city": "Paris"})]),
        # an unclosed parameter: verbatim content
        ('<｜tool_calls_begin｜><｜tool_call_begin｜>function<｜tool_sep｜><steptml:invoke name="get_weather">'
         '<steptml:parameter name="city">Paris</steptml:invoke><｜tool_call_end｜><｜tool_calls_end｜>',
         '<｜tool_calls_begin｜><｜tool_call_begin｜>function<｜tool_sep｜><steptml:invoke name="get_weather">'
         '<steptml:parameter name="city">Paris</steptml:invoke><｜tool_call_end｜><｜tool_calls_end｜>', []),
    ],
    "kimik2": [
        (TEXT + kimi((W, json.dumps(WEATHER_ARGS, ensure_ascii=False))), TEXT, [(W, WEATHER_ARGS)]),
        (kimi((W, '{"city": "Paris"}'), ("search", json.dumps(SEARCH_ARGS))),
         "", [(W, {"city": "Paris"}), ("search", SEARCH_ARGS)]),
        # the singular section spelling, an id without "functions.", no arguments
        ("<|tool_call_section_begin|><|tool_call_begin|>get_time:0<|tool_call_argument_begin|>"
         "<|tool_call_end|><|tool_call_section_end|> ok", " ok", [("get_time", {})]),
        # broken JSON: verbatim content
        (kimi((W, '{"city": "Paris"')), kimi((W, '{"city": "Paris"')), []),
        (kimi((W, '["Paris"]')), kimi((W, '["Paris"]')), []),
    ],
    "minimax_m2": [
        (TEXT + minimax((W, WEATHER)), TEXT, [(W, WEATHER_ARGS)]),
        (minimax((W, [("city", "Paris")]), ("search", SEARCH)),
         "", [(W, {"city": "Paris"}), ("search", SEARCH_ARGS)]),
        (minimax(("write_file", [("path", "/tmp/a.py"), ("content", '\ndef f():\n    return "héllo"\n\n')]))
         + "\nDone.", "\nDone.", [("write_file", {"path": "/tmp/a.py", "content": 'def f():\n    return "héllo"\n'})]),
        ("<minimax:tool_call>\n<invoke name=\"get_weather\">\n<parameter name=\"city\">Paris\n</invoke>\n</minimax:tool_call>",
         "<minimax:tool_call>\n<invoke name=\"get_weather\">\n<parameter name=\"city\">Paris\n</invoke>\n</minimax:tool_call>", []),
        ("<minimax:tool_call>hello</minimax:tool_call>", "<minimax:tool_call>hello</minimax:tool_call>", []),
    ],
}

CASES = [(family, i, *sample) for family, samples in SAMPLES.items() for i, sample in enumerate(samples)]


@pytest.mark.parametrize("family,i,text,content,calls", CASES, ids=[f"{c[0]}-{c[1]}" for c in CASES])
def test_recorded_outputs(family, i, text, content, calls):
    check(family, text, content, calls)


def random_pieces(text, seed):
    rng, pieces, i = random.Random(seed), [], 0
    while i < len(text):
        n = rng.randint(1, 5)
        pieces.append(text[i:i + n])
        i += n
    return pieces


@pytest.mark.parametrize("family", sorted(SAMPLES))
def test_mixed_outputs_agree_across_chunkings(family):
    rng = random.Random(family)
    texts = [t for t, _, _ in SAMPLES[family]]
    cls = get_tool_parser(family)
    for _ in range(8):
        text = rng.choice(["", "Okay. ", "\n"]).join(rng.sample(texts, min(3, len(texts))))
        want = run(cls(tools=TOOLS, id_prefix=PREFIX), [text])
        assert run(cls(tools=TOOLS, id_prefix=PREFIX), list(text)) == want, text
        for seed in range(10, 16):
            assert run(cls(tools=TOOLS, id_prefix=PREFIX), random_pieces(text, seed)) == want, (seed, text)


def test_registry_and_vllm_names():
    for name in ("glm45_moe", "glm47_moe", "step3", "kimik2", "minimax_m2"):
        assert TOOL_PARSERS[name].name == name and get_tool_parser(name) is TOOL_PARSERS[name]
    for vllm, ours in {"glm45": "glm45_moe", "glm47": "glm47_moe", "step3": "step3",
                       "kimi_k2": "kimik2", "minimax_m2": "minimax_m2"}.items():
        assert get_tool_parser(vllm).name == ours


def test_content_streams_early():
    for family, marker in [("glm45_moe", "<tool_call>"), ("step3", S3[0]), ("kimik2", K2[0]),
                           ("minimax_m2", "<minimax:tool_call>")]:
        p = get_tool_parser(family)(id_prefix=PREFIX)
        assert p.feed("Let me check. " + marker[:-3]) == ("Let me check. ", [])
        assert p.feed("xx") == (marker[:-3] + "xx", [])


def test_too_deep_arguments_are_content():
    deep = "[" * 200 + "]" * 200
    text = kimi((W, '{"city": ' + deep + "}"))
    check("kimik2", text, text, [])
    # a GLM value nested too deep for JSON stays text, the call still parses
    check("glm45_moe", glm45("lookup", [("x", deep)]), "", [("lookup", {"x": deep})])
    # a schema-typed object too deep falls back to the text too
    check("minimax_m2", minimax(("search", [("query", "q"), ("filters", deep)])), "",
          [("search", {"query": "q", "filters": deep})])


FORCED = [
    ("glm45_moe", W, "<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>"),
    ("glm45_moe", None, "get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris</arg_value>\n</tool_call>"),
    ("glm47_moe", W, "<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>"),
    ("glm47_moe", None, "get_weather<arg_key>city</arg_key><arg_value>Paris</arg_value></tool_call>"),
    ("step3", W, '<steptml:parameter name="city">Paris</steptml:parameter></steptml:invoke>' + S3[3] + S3[1]),
    ("step3", None, '<steptml:invoke name="get_weather"><steptml:parameter name="city">Paris</steptml:parameter>'
                    "</steptml:invoke>" + S3[3] + S3[1]),
    ("kimik2", W, '{"city": "Paris"}' + K2[3] + K2[1]),
    ("kimik2", None, 'functions.get_weather:0' + K2[4] + '{"city": "Paris"}' + K2[3] + K2[1]),
    ("minimax_m2", W, '<parameter name="city">Paris</parameter>\n</invoke>\n</minimax:tool_call>'),
    ("minimax_m2", None, '<invoke name="get_weather">\n<parameter name="city">Paris</parameter>\n</invoke>\n'
                         "</minimax:tool_call>"),
]


@pytest.mark.parametrize("family,function,continuation", FORCED)
def test_forced_prefix_round_trip(family, function, continuation):
    prefix = get_tool_parser(family).forced_prefix(function)
    assert prefix
    check(family, continuation, "", [(W, {"city": "Paris"})], prefix=prefix)


# What each family's chat template writes when it renders a call (abridged from the models' templates).
GLM45 = ("{%- for tc in m.tool_calls %}{{ '\\n<tool_call>' + tc.name }}\n{% for k, v in _args.items() %}\n"
         "<arg_key>{{ k }}</arg_key>\n<arg_value>{{ v | tojson(ensure_ascii=False) if v is not string else v }}"
         "</arg_value>\n{% endfor %}\n</tool_call>{% endfor %}")
GLM47 = ("{%- for tc in m.tool_calls %}{{- '<tool_call>' + tc.name -}}{% for k, v in _args.items() %}"
         "<arg_key>{{ k }}</arg_key><arg_value>{{ v | tojson(ensure_ascii=False) if v is not string else v }}"
         "</arg_value>{% endfor %}</tool_call>{% endfor %}")
STEP3 = ("{{- '<｜tool_calls_begin｜>' -}}{%- for tc in message.tool_calls -%}{{- '<｜tool_call_begin｜>function"
         "<｜tool_sep｜><steptml:invoke name=\"' + tc.function.name + '\">' -}}{%- endfor -%}")
KIMI = ("{%- if message['tool_calls'] -%}<|tool_calls_section_begin|>{%- for tool_call in message['tool_calls'] -%}"
        "<|tool_call_begin|>{{ tool_call['id'] }}<|tool_call_argument_begin|>{{ tool_call['function']['arguments'] }}"
        "<|tool_call_end|>{%- endfor -%}<|tool_calls_section_end|>{%- endif -%}")
MINIMAX = ("{%- for tool_call in message.tool_calls -%}{{- '<minimax:tool_call>\\n' }}{{- '<invoke name=\"' "
           "+ tool_call.name + '\">' }}{% for k, v in args.items() %}<parameter name=\"{{ k }}\">{{ v }}</parameter>"
           "{% endfor %}</invoke>\\n</minimax:tool_call>{%- endfor -%}")


def test_choose_tool_parser():
    assert choose_tool_parser("Glm4MoeForCausalLM", GLM45) == "glm45_moe"  # not qwen
    assert choose_tool_parser("Glm4MoeForCausalLM", GLM47) == "glm47_moe"
    assert choose_tool_parser("Step3VLForConditionalGeneration", STEP3) == "step3"
    assert choose_tool_parser("DeepseekV3ForCausalLM", KIMI) == "kimik2"
    assert choose_tool_parser("MiniMaxM2ForCausalLM", MINIMAX) == "minimax_m2"
    assert choose_tool_parser("Qwen3ForCausalLM", "{{ '<tool_call>\\n' }}{{ tool_call | tojson }}") == "qwen"
