"""A request's structured output: OpenAI's response_format, vLLM's structured_outputs and
guided_* fields, llama-server's json_schema and grammar, and forced tool calls, as one
StructuredOutput on its SamplingParams (xinfer/structured.py compiles and applies it)."""
from __future__ import annotations

import json

from xinfer.api.protocol import ApiError
from xinfer.parsers.grammar import tool_tag
from xinfer.structured import StructuredOutput, check

_SPELLINGS = (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
              ("guided_grammar", "grammar"), ("json_schema", "json"), ("grammar", "grammar"))


def _make(kind: str, value) -> StructuredOutput:
    if kind == "json":
        if isinstance(value, str):
            return StructuredOutput("json", value)
        return StructuredOutput.json(None if value is True else value)
    if kind == "choice":
        return StructuredOutput.choice(value)
    if kind == "structural_tag":
        tag = json.loads(value) if isinstance(value, str) and value.lstrip().startswith("{") else value
        if isinstance(tag, dict) and "structures" in tag:  # vLLM's first form: begin/schema/end + triggers
            tag = {"type": "structural_tag", "format": {
                "type": "triggered_tags", "triggers": tag.get("triggers") or [],
                "tags": [{"type": "tag", "begin": s.get("begin", ""), "end": s.get("end", ""),
                          "content": {"type": "json_schema", "json_schema": s.get("schema") or {}}}
                         for s in tag["structures"] if isinstance(s, dict)]}}
        return StructuredOutput.structural_tag(tag)
    return StructuredOutput(kind, value)


def requested(body) -> StructuredOutput | None:
    """The one structured output a chat or completions body asks for (a 400 if it asks for two)."""
    given: list[tuple[str, StructuredOutput]] = []
    rf = body.response_format
    if rf is not None and rf.type != "text":
        if rf.type == "json_schema" and rf.json_schema is None:
            raise ApiError("response_format of type json_schema needs 'json_schema'", param="response_format")
        schema = rf.json_schema.schema if rf.type == "json_schema" else None
        given.append(("response_format", StructuredOutput.json({"type": "object"} if schema is None else schema)
                      if rf.type == "json_schema" else StructuredOutput("json", '{"type": "object"}')))
    so = body.structured_outputs
    if so is not None:
        for kind in ("json", "regex", "choice", "grammar", "structural_tag"):
            value = getattr(so, kind)
            if value is not None:
                given.append((f"structured_outputs.{kind}", _make(kind, value)))
        if so.json_object:
            given.append(("structured_outputs.json_object", StructuredOutput("json", '{"type": "object"}')))
    for field, kind in _SPELLINGS:
        value = getattr(body, field)
        if value is not None:
            given.append((field, _make(kind, value)))
    if len(given) > 1:
        raise ApiError(f"ask for one structured output, not {len(given)} ({', '.join(n for n, _ in given)})",
                       param=given[1][0])
    return given[0][1] if given else None


def after_reasoning(so: StructuredOutput, end_marker: str) -> StructuredOutput:
    """`so` held only after the reasoning closes: the prompt leaves the model thinking, and the
    thinking itself is free text."""
    element = {"json": lambda: {"type": "json_schema", "json_schema": json.loads(so.spec)},
               "regex": lambda: {"type": "regex", "pattern": so.spec},
               "grammar": lambda: {"type": "grammar", "grammar": so.spec},
               "choice": lambda: {"type": "or", "elements": [{"type": "const_string", "value": c}
                                                             for c in json.loads(so.spec)]},
               "structural_tag": lambda: json.loads(so.spec)["format"],
               "json_object": lambda: {"type": "json_schema", "json_schema": {"type": "object"}}}[so.kind]()
    think = {"type": "tag", "begin": "", "content": {"type": "any_text"}, "end": end_marker}
    return StructuredOutput.structural_tag({"type": "structural_tag", "format": {
        "type": "sequence", "elements": [think, element]}})


def for_tools(parser, tools, choice: str, parallel: bool) -> StructuredOutput | None:
    tag = tool_tag(parser, tools, choice, parallel)
    return None if tag is None else StructuredOutput.structural_tag(tag)


def checked(so: StructuredOutput | None) -> StructuredOutput | None:
    """Parse it now (in the API's thread pool): a bad spec is a 400 before the response starts."""
    if so is not None:
        check(so)
    return so
