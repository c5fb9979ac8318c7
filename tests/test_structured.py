"""Structured outputs (issue 15): the constraint kinds and their 400s, the bitmask against
xgrammar's own, the offline Engine, forced tool calls held to their schemas for every family
with a grammar, and the server through the real openai SDK (parse with pydantic, json_schema
whole and streamed, regex, choice, grammar, n > 1, completions), outputs checked with jsonschema."""
import json
import re
from types import SimpleNamespace

import jsonschema
import pytest
import torch

from tests.conftest import CHAT_KEY
from xinfer.errors import InvalidRequestError
from xinfer.structured import StructuredOutput as SO, check

PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20},
                                            "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string", "maxLength": 30}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 30}}, "required": ["zone"]}}}


# ---- the specs ----

@pytest.mark.parametrize("so", [SO.json(PERSON), SO.json(), SO.regex(r"\d{3}-\d{4}"), SO.choice(["a", "b c"]),
                                SO.json({"type": "object", "properties": {"not": {"type": "string"}}}),
                                SO.grammar('root ::= "x" [0-9]+'), SO("json", "true"),
                                SO.structural_tag({"type": "structural_tag", "format": {"type": "const_string",
                                                                                      "value": "hi"}})])
def test_good_specs_parse(so):
    check(so)


@pytest.mark.parametrize("so, words", [
    (SO("json", '{"type": "foo"}'), "invalid JSON schema: Unsupported type"),
    (SO("json", "{not json"), "invalid JSON schema"),
    (SO("json", "[1, 2]"), "a JSON schema is an object"),
    (SO("json", '{"type": "string", "pattern": "(("}'), "invalid JSON schema"),
    (SO("json", '{"type": "object", "minProperties": 1000000}'), "minProperties"),
    (SO("json", '{"type": "integer", "multipleOf": 3}'), "the keyword 'multipleOf' is not supported"),
    (SO("json", '{"type": "object", "properties": {"a": {"if": {"type": "string"}}}}'), "'if' is not supported"),
    (SO("json", '{"anyOf": [{"not": {"type": "string"}}]}'), "'not' is not supported"),
    (SO.regex("(a"), "invalid regex: Regex parsing error"),
    (SO.grammar('root ::= "a'), "invalid grammar: EBNF lexer error"),
    (SO.grammar("nothing ::= \"a\""), "invalid grammar"),
    (SO("choice", "[]"), "non-empty list of strings"),
    (SO("choice", "[1]"), "non-empty list of strings"),
    (SO("structural_tag", '{"type": "structural_tag", "format": {"type": "nope"}}'), "invalid structural tag"),
    (SO("xml", "x"), "unknown structured output kind"),
])
def test_bad_specs_name_the_problem(so, words):
    with pytest.raises(InvalidRequestError) as e:
        check(so)
    assert words in str(e.value)
    assert "/project/" not in str(e.value) and ".cc:" not in str(e.value)  # no C++ source positions


def test_bitmask_unpacking_matches_xgrammar():
    import xgrammar as xgr

    from ops.sampling import allowed_by_bitmask
    V = 1000
    g = torch.Generator().manual_seed(0)
    words = torch.randint(-2**31, 2**31 - 1, (3, (V + 31) // 32), dtype=torch.int32, generator=g)
    logits = torch.randn(3, V, generator=g)
    ours = logits.masked_fill(~allowed_by_bitmask(words, V), float("-inf"))
    theirs = logits.clone()
    xgr.apply_token_bitmask_inplace(theirs, words.clone())
    assert torch.equal(ours, theirs)


# ---- the offline Engine ----

@pytest.fixture(scope="module")
def engine(smollm_path):
    from xinfer import Engine, EngineConfig
    e = Engine(EngineConfig(model=smollm_path, kv_cache_gb=0.25))
    yield e
    e.close()


def chat(engine, text):
    return engine.tokenizer.encode_chat([{"role": "user", "content": text}])


def test_engine_outputs_follow_each_kind(engine):
    from xinfer import SamplingParams
    cases = [(SO.json(PERSON), lambda t: jsonschema.validate(json.loads(t), PERSON)),
             (SO.regex(r"\d{3}-\d{4}"), lambda t: re.fullmatch(r"\d{3}-\d{4}", t) or pytest.fail(t)),
             (SO.choice(["red", "green", "blue"]), lambda t: t in ("red", "green", "blue") or pytest.fail(t)),
             (SO.grammar('root ::= "A" [0-9] [0-9] "B"'), lambda t: re.fullmatch(r"A\d\dB", t) or pytest.fail(t))]
    prompts = [chat(engine, "Describe a person.")] * len(cases)
    params = [SamplingParams(max_tokens=60, temperature=0.0, structured=so) for so, _ in cases]
    outs = engine.generate(prompts, params)
    for (so, ok), out in zip(cases, outs):
        assert out.finish_reason == "stop", (so, out.text)  # the grammar's end ends the generation
        ok(out.text)


def test_engine_sampled_n_and_unconstrained_neighbours(engine):
    """Sampled choices (n = 3) each follow the schema; an unconstrained request in the same batch
    gets the same tokens as it does alone (requests without a constraint pay nothing)."""
    from xinfer import SamplingParams
    free = SamplingParams(max_tokens=20, temperature=0.0)
    alone = engine.generate([chat(engine, "Say hi.")], free)[0].token_ids
    outs = engine.generate([chat(engine, "A person, please."), chat(engine, "Say hi.")],
                           [SamplingParams(max_tokens=60, temperature=1.0, seed=3, n=3, structured=SO.json(PERSON)),
                            free])
    for out in outs[:3]:
        jsonschema.validate(json.loads(out.text), PERSON)
    assert outs[3].token_ids == alone


def test_engine_bad_spec_is_refused_and_the_next_runs(engine):
    from xinfer import SamplingParams
    with pytest.raises(InvalidRequestError):
        engine.generate([chat(engine, "x")], SamplingParams(structured=SO.regex("(")))
    assert engine.generate([chat(engine, "x")], SamplingParams(max_tokens=3, structured=SO.choice(["ok"])))[0].text == "ok"


def test_compile_failure_in_the_core_ends_the_request_with_the_reason(engine):
    """A grammar that passes the API's parse but fails the core's compile (a bug, or the timeout)
    ends its request with finish_reason "error" and the reason; the engine goes on."""
    from xinfer import SamplingParams
    real = engine.core.grammars.submit

    def failing(so):
        from concurrent.futures import Future
        f = Future()
        f.set_exception(RuntimeError("boom"))
        return f
    engine.core.grammars.submit = failing
    try:
        out = engine.generate([chat(engine, "x")], SamplingParams(max_tokens=5, structured=SO.json()))[0]
    finally:
        engine.core.grammars.submit = real
    assert out.finish_reason == "error" and "boom" in out.error
    assert engine.generate([chat(engine, "x")], SamplingParams(max_tokens=3, structured=SO.choice(["ok"])))[0].text == "ok"


# ---- tool grammars, per family ----

FAMILIES = ["json", "qwen", "llama", "mistral", "deepseek", "kimik2", "qwen_coder", "glm45_moe", "glm47_moe",
            "minimax_m2"]


def _matcher(tag):
    import xgrammar as xgr
    from transformers import AutoTokenizer  # noqa: F401  (xgrammar needs a tokenizer: a byte-level one)
    compiler = xgr.GrammarCompiler(_tokenizer_info())
    return xgr.GrammarMatcher(compiler.compile_structural_tag(json.dumps(tag)), terminate_without_stop_token=True)


_INFO = []


def _tokenizer_info():
    if not _INFO:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        from xinfer.loader import load_model_info
        tok = load_model_info(None).tokenizer
        _INFO.append(xgr.TokenizerInfo.from_huggingface(PreTrainedTokenizerFast(tokenizer_object=tok.tok),
                                                        stop_token_ids=tok.eos_token_ids))
    return _INFO[0]


def _render(cls, calls):
    """The text of `calls` [(name, args)] as the family's grammar writes them (JSON arguments
    compact as json.dumps makes them; XML styles as xgrammar's docs show them)."""
    def args(a):
        if cls.ARGS_STYLE == "json":
            return json.dumps(a)
        if cls.ARGS_STYLE == "qwen_xml":
            return "".join(f"<parameter={k}>{v}</parameter>" for k, v in a.items())
        if cls.ARGS_STYLE == "glm_xml":
            return "".join(f"<arg_key>{k}</arg_key><arg_value>{v}</arg_value>" for k, v in a.items())
        return "".join(f'<parameter name="{k}">{v}</parameter>' for k, v in a.items())
    open_, sep, close = cls.SECTION
    body = sep.join(cls.call_tag(n)[0] + args(a) + cls.call_tag(n)[1] for n, a in calls)
    return open_ + body + close


@pytest.mark.parametrize("family", FAMILIES)
def test_forced_call_grammar_accepts_the_family_format_and_the_parser_reads_it(family):
    from xinfer.parsers import get_tool_parser
    from xinfer.parsers.grammar import HeldCalls, tool_tag
    cls = get_tool_parser(family)
    tools = [WEATHER, TIME]
    one = [("get_weather", {"city": "Paris", "unit": "c"})]
    two = one + [("get_time", {"zone": "CET"})]
    for choice, parallel, calls in [("get_weather", True, one), ("required", True, two), ("required", False, one)]:
        tag = tool_tag(cls, tools, choice, parallel)
        text = _render(cls, calls)
        m = _matcher(tag)
        assert m.accept_string(text), (family, choice, text)
        assert m.is_terminated() or m.accept_string(""), text
        parser = cls(tools, "call_test_id")
        content, got = parser.feed(text)
        c2, more = parser.finish()
        got = got + more
        assert [(c.name, json.loads(c.arguments)) for c in got] == calls, (family, content + c2)
        if cls.ARGS_STYLE == "json":  # held: streamed piece by piece, same calls
            held = HeldCalls(cls(tools, "call_test_id"), [n for n, _ in [("get_weather", 0), ("get_time", 0)]])
            pieces = [held.feed(ch) for ch in text] + [held.finish()]
            assert "".join(p[0] for p in pieces) == ""
            names, argtext = {}, {}
            for _, chunks in pieces:
                for c in chunks:
                    if c.name:
                        names[c.index] = c.name
                    argtext[c.index] = argtext.get(c.index, "") + c.arguments
            assert [(names[i], json.loads(argtext[i])) for i in sorted(names)] == calls
    # arguments off the schema are not in the grammar
    bad = _render(cls, [("get_weather", {"city": "Paris", "unit": "kelvin"})])
    assert not _matcher(tool_tag(cls, tools, "get_weather")).accept_string(bad)


def test_families_without_a_grammar_keep_the_forced_prefix():
    from xinfer.parsers import get_tool_parser
    from xinfer.parsers.grammar import tool_tag
    for family in ("pythonic", "step3", "passthrough"):
        assert tool_tag(get_tool_parser(family), [WEATHER], "required") is None


# ---- the server ----

@pytest.fixture(scope="module")
def srv(chat_server):
    from openai import OpenAI
    return SimpleNamespace(base=chat_server, client=OpenAI(base_url=chat_server + "/v1", api_key=CHAT_KEY,
                                                           max_retries=0))


ASK = [{"role": "user", "content": "Invent a person."}]


def test_openai_parse_with_pydantic(srv):
    from pydantic import BaseModel, Field

    class Person(BaseModel):
        name: str = Field(max_length=20)
        age: int = Field(ge=0, le=120)
    r = srv.client.beta.chat.completions.parse(model="any", messages=ASK, response_format=Person, temperature=0)
    assert isinstance(r.choices[0].message.parsed, Person) and r.choices[0].finish_reason == "stop"


def test_json_schema_whole_streamed_and_n(srv):
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    r = srv.client.chat.completions.create(model="m", messages=ASK, response_format=rf, temperature=0.9, n=2, seed=1)
    for ch in r.choices:
        jsonschema.validate(json.loads(ch.message.content), PERSON)
    parts = [c.choices[0].delta.content or "" for c in srv.client.chat.completions.create(
        model="m", messages=ASK, response_format=rf, temperature=0, stream=True) if c.choices]
    assert len([p for p in parts if p]) > 3  # it streams, token by token
    jsonschema.validate(json.loads("".join(parts)), PERSON)
    r = srv.client.chat.completions.create(model="m", messages=ASK, response_format={"type": "json_object"},
                                           max_tokens=200, temperature=0)
    assert r.choices[0].message.content.lstrip().startswith("{")


@pytest.mark.parametrize("extra, check_text", [
    ({"structured_outputs": {"regex": r"[A-Z][a-z]{2,8}"}}, lambda t: re.fullmatch(r"[A-Z][a-z]{2,8}", t)),
    ({"guided_regex": r"\d{3}"}, lambda t: re.fullmatch(r"\d{3}", t)),
    ({"structured_outputs": {"choice": ["yes", "no"]}}, lambda t: t in ("yes", "no")),
    ({"guided_choice": ["left", "right"]}, lambda t: t in ("left", "right")),
    ({"structured_outputs": {"grammar": 'root ::= "id-" [0-9] [0-9]'}}, lambda t: re.fullmatch(r"id-\d\d", t)),
    ({"grammar": 'root ::= ("a" | "b")+ "."'}, lambda t: re.fullmatch(r"[ab]+\.", t)),  # llama-server's field
    ({"json_schema": PERSON}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
    ({"guided_json": PERSON}, lambda t: jsonschema.validate(json.loads(t), PERSON) is None),
])
def test_every_spelling_on_chat(srv, extra, check_text):
    r = srv.client.chat.completions.create(model="m", messages=ASK, max_tokens=100, temperature=0, extra_body=extra)
    text = r.choices[0].message.content
    assert check_text(text), text
    assert r.choices[0].finish_reason == "stop"


def test_completions_take_them_too(srv):
    r = srv.client.completions.create(model="m", prompt="The answer is", max_tokens=20, temperature=0,
                                      extra_body={"structured_outputs": {"choice": ["42", "unknown"]}})
    assert r.choices[0].text in ("42", "unknown")


@pytest.mark.parametrize("extra, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "foo"}}}},
     "Unsupported type"),
    ({"response_format": {"type": "json_schema"}}, "needs 'json_schema'"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"guided_regex": "(a"}, "invalid regex"),
    ({"structured_outputs": {"grammar": 'root ::= "a'}}, "invalid grammar"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "ask for one structured output"),
    ({"structured_outputs": {"structural_tag": '{"type": "structural_tag", "format": {"type": "x"}}'}},
     "invalid structural tag"),
])
def test_bad_specs_are_400s_and_the_next_request_is_fine(srv, extra, words):
    import openai
    with pytest.raises(openai.BadRequestError) as e:
        srv.client.chat.completions.create(model="m", messages=ASK, max_tokens=5, extra_body=extra)
    assert words in str(e.value)
    ok = srv.client.chat.completions.create(model="m", messages=ASK, max_tokens=3, extra_body={"guided_choice": ["ok"]})
    assert ok.choices[0].message.content == "ok"


def test_forced_tool_calls_are_valid_against_their_schemas_and_stream(srv):
    msgs = [{"role": "user", "content": "What's the weather in Paris and the time in Tokyo?"}]
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = srv.client.chat.completions.create(model="m", messages=msgs, tools=[WEATHER, TIME], tool_choice=named,
                                           temperature=0)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and r.choices[0].finish_reason == "tool_calls"
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])
    for parallel in (True, False):
        r = srv.client.chat.completions.create(model="m", messages=msgs, tools=[WEATHER, TIME], tool_choice="required",
                                               temperature=0.8, seed=5, parallel_tool_calls=parallel)
        calls = r.choices[0].message.tool_calls
        assert calls and (parallel or len(calls) == 1)
        schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
        for c in calls:
            jsonschema.validate(json.loads(c.function.arguments), schemas[c.function.name])
    chunks = [c.choices[0].delta.tool_calls[0] for c in srv.client.chat.completions.create(
        model="m", messages=msgs, tools=[WEATHER], tool_choice=named, temperature=0, stream=True)
        if c.choices and c.choices[0].delta.tool_calls]
    assert len(chunks) > 3 and chunks[0].function.name == "get_weather" and chunks[0].id
    assert all(c.function.name is None for c in chunks[1:])  # the arguments stream after the name
    args = json.loads("".join(c.function.arguments or "" for c in chunks))
    jsonschema.validate(args, WEATHER["function"]["parameters"])
