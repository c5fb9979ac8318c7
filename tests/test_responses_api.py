"""OpenAI's Responses API (issue 21) through the real openai SDK: whole, streamed (typed events),
a function call round trip, previous_response_id with the in-memory store, text.format."""
import json

import jsonschema
import openai
import pytest

from tests.conftest import CHAT_KEY

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}},
                          "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def client(chat_server):
    return openai.OpenAI(base_url=chat_server + "/v1", api_key=CHAT_KEY, max_retries=0)


def test_whole_and_streamed(client):
    kw = dict(model="m", input="Say hello in five words.", instructions="Be terse.", max_output_tokens=20,
              temperature=0)
    r = client.responses.create(**kw)
    assert r.object == "response" and r.id.startswith("resp_") and r.status in ("completed", "incomplete")
    assert r.output_text and r.output[0].type == "message" and r.output[0].content[0].type == "output_text"
    assert r.usage.input_tokens > 5 and r.usage.output_tokens > 0
    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == r.output_text == events[-1].response.output_text
    for k in ("response.output_item.added", "response.content_part.added", "response.output_text.done",
              "response.content_part.done", "response.output_item.done"):
        assert kinds.count(k) == 1, k


def test_function_call_round_trip_and_streamed_arguments(client):
    ask = "What's the weather in Paris?"
    r = client.responses.create(model="m", input=ask, tools=[WEATHER],
                                tool_choice={"type": "function", "name": "get_weather"})
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather" and call.call_id
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    follow = [{"role": "user", "content": ask}, call.model_dump(exclude_none=True),
              {"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C"}]
    r2 = client.responses.create(model="m", input=follow, tools=[WEATHER], max_output_tokens=16)
    assert r2.output
    events = list(client.responses.create(model="m", input=ask, tools=[WEATHER], tool_choice="required",
                                          parallel_tool_calls=False, stream=True))
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(deltas) > 1 and len(done) == 1 and "".join(deltas) == done[0].arguments
    jsonschema.validate(json.loads(done[0].arguments), WEATHER["parameters"])


def test_previous_response_id_and_the_store(client):
    r = client.responses.create(model="m", input="My name is Ada. Say OK.", max_output_tokens=8, temperature=0)
    r2 = client.responses.create(model="m", input="What is my name?", previous_response_id=r.id,
                                 max_output_tokens=8, temperature=0)
    alone = client.responses.create(model="m", input="What is my name?", max_output_tokens=8, temperature=0)
    assert r2.usage.input_tokens > alone.usage.input_tokens  # the earlier turn is in the prompt
    assert client.responses.retrieve(r.id).id == r.id
    client.responses.delete(r.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="m", input="x", previous_response_id=r.id)
    unstored = client.responses.create(model="m", input="x", max_output_tokens=2, store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(unstored.id)


def test_text_format_json_schema(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"],
              "additionalProperties": False}
    r = client.responses.create(model="m", input="Name a city.", max_output_tokens=40,
                                text={"format": {"type": "json_schema", "name": "city", "schema": schema,
                                                 "strict": True}})
    jsonschema.validate(json.loads(r.output_text), schema)


def test_bad_requests_are_400s(client):
    for kw in [dict(input=[{"type": "computer_call"}]), dict(input="x", tools=[{"type": "web_search"}]),
               dict(input=[{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}])]:
        with pytest.raises(openai.BadRequestError):
            client.responses.create(model="m", **kw)
    assert client.responses.create(model="m", input="Hi", max_output_tokens=2).output
