"""Anthropic's Messages API (issue 21) through the real anthropic SDK: whole and streamed (the
event sequence read raw too), a tool round trip, count_tokens, stop_sequences, x-api-key, and
Anthropic-shaped errors."""
import json
import urllib.request

import jsonschema
import pytest

from tests.conftest import CHAT_KEY as KEY

anthropic = pytest.importorskip("anthropic")

WEATHER = {"name": "get_weather", "description": "The weather in a city",
           "input_schema": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                                             "unit": {"enum": ["c", "f"]}},
                            "required": ["city", "unit"], "additionalProperties": False}}
HI = [{"role": "user", "content": "Say hello in five words."}]


@pytest.fixture(scope="module")
def srv(chat_server):
    return chat_server, anthropic.Anthropic(base_url=chat_server, api_key=KEY, max_retries=0)


def test_messages_whole(srv):
    _, client = srv
    r = client.messages.create(model="claude-sonnet-4-5", max_tokens=24, messages=HI,
                               system="You are terse.", extra_body={"temperature": 0})
    assert r.type == "message" and r.role == "assistant" and r.model == "claude-sonnet-4-5"
    assert r.id.startswith("msg_") and r.content[0].type == "text" and r.content[0].text
    assert r.stop_reason in ("end_turn", "max_tokens") and r.stop_sequence is None
    assert r.usage.output_tokens > 0 and r.usage.input_tokens + r.usage.cache_read_input_tokens > 10


def test_messages_streamed_matches_whole_and_the_event_order(srv):
    base, client = srv
    kw = dict(model="m", max_tokens=24, messages=HI, extra_body={"temperature": 0})
    whole = client.messages.create(**kw).content[0].text
    with client.messages.stream(**kw) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole == final.content[0].text
    raw = {"model": "m", "max_tokens": 24, "messages": HI, "temperature": 0, "stream": True}
    req = urllib.request.Request(base + "/v1/messages", json.dumps(raw).encode(),
                                 {"Content-Type": "application/json", "x-api-key": KEY})
    with urllib.request.urlopen(req, timeout=60) as resp:
        lines = resp.read().decode().splitlines()
    events = [ln[len("event: "):] for ln in lines if ln.startswith("event: ")]
    datas = [json.loads(ln[len("data: "):]) for ln in lines if ln.startswith("data: ")]
    assert [d["type"] for d in datas] == events
    assert events[0] == "message_start" and events[-2:] == ["message_delta", "message_stop"]
    body = [e for e in events if e != "ping"][1:-2]
    assert body[0] == "content_block_start" and body[-1] == "content_block_stop"
    assert set(body[1:-1]) == {"content_block_delta"}
    assert datas[-2]["delta"]["stop_reason"] in ("end_turn", "max_tokens") and datas[-2]["usage"]["output_tokens"] > 0


def test_tool_round_trip(srv):
    _, client = srv
    ask = [{"role": "user", "content": "What's the weather in Paris?"}]
    r = client.messages.create(model="m", max_tokens=64, messages=ask, tools=[WEATHER],
                               tool_choice={"type": "tool", "name": "get_weather"})
    (use,) = [b for b in r.content if b.type == "tool_use"]
    assert r.stop_reason == "tool_use" and use.name == "get_weather" and use.id
    jsonschema.validate(use.input, WEATHER["input_schema"])
    follow = ask + [{"role": "assistant", "content": r.content},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,
                                                  "content": "Sunny, 21 degrees."}]}]
    r2 = client.messages.create(model="m", max_tokens=24, messages=follow, tools=[WEATHER])
    assert r2.content and r2.stop_reason in ("end_turn", "max_tokens", "tool_use")
    # streamed: the call's input arrives as input_json_delta pieces
    with client.messages.stream(model="m", max_tokens=64, messages=ask, tools=[WEATHER],
                                tool_choice={"type": "any", "disable_parallel_tool_use": True}) as stream:
        kinds = [e.type for e in stream]
        final = stream.get_final_message()
    assert "input_json" in kinds or kinds.count("content_block_delta") > 1
    (use,) = [b for b in final.content if b.type == "tool_use"]
    jsonschema.validate(use.input, WEATHER["input_schema"])
    assert final.stop_reason == "tool_use"


def test_count_tokens_matches_the_prompt(srv):
    _, client = srv
    msgs = [{"role": "user", "content": "Count me, please: one two three."}]
    n = client.messages.count_tokens(model="m", messages=msgs, system="Be brief.").input_tokens
    r = client.messages.create(model="m", max_tokens=2, messages=msgs, system="Be brief.")
    assert n == r.usage.input_tokens + r.usage.cache_read_input_tokens and n > 10
    more = client.messages.count_tokens(model="m", messages=msgs, system="Be brief.", tools=[WEATHER]).input_tokens
    assert more > n  # the tools are described in the prompt


def test_stop_sequences_report_which(srv):
    _, client = srv
    r = client.messages.create(model="m", max_tokens=40, messages=HI, stop_sequences=[" "],
                               extra_body={"temperature": 0})
    assert r.stop_reason == "stop_sequence" and r.stop_sequence == " "


def test_output_config_format_is_a_structured_output(srv):
    _, client = srv
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
              "additionalProperties": False}
    r = client.messages.create(model="m", max_tokens=40, messages=[{"role": "user", "content": "Name a city."}],
                               output_config={"format": {"type": "json_schema", "schema": schema}},
                               thinking={"type": "adaptive"})
    jsonschema.validate(json.loads(r.content[0].text), schema)


def test_errors_are_anthropic_shaped(srv):
    base, client = srv
    with pytest.raises(anthropic.AuthenticationError) as e:
        anthropic.Anthropic(base_url=base, api_key="wrong", max_retries=0).messages.create(
            model="m", max_tokens=5, messages=HI)
    assert e.value.body["type"] == "error" and e.value.body["error"]["type"] == "authentication_error"
    for bad in [{"messages": HI}, {"max_tokens": 5, "messages": []},
                {"max_tokens": 5, "messages": [{"role": "user", "content": [{"type": "document"}]}]},
                {"max_tokens": 5, "messages": HI, "tools": [{"name": "web", "type": "web_search_20250305"}]}]:
        req = urllib.request.Request(base + "/v1/messages", json.dumps({"model": "m", **bad}).encode(),
                                     {"Content-Type": "application/json", "x-api-key": KEY})
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=30)
        body = json.loads(err.value.read())
        assert err.value.code == 400 and body["type"] == "error", body
        assert body["error"]["type"] == "invalid_request_error" and body["error"]["message"]
    assert client.messages.create(model="m", max_tokens=3, messages=HI).content  # the next one is fine
