"""The parser process's per-choice state and the API's trimming: a restarted detokenizer/parser pair
re-parses every live choice from its first character, and the client still gets each piece once."""
from xinfer.api.engine_client import _Seen
from xinfer.ipc.text import ParseInit, ParseSpec, TextBatch, TextDelta
from xinfer.parsers.choice import parse_batch

OUTPUT = ("<think>The user wants weather.</think>\n\nLet me check."
          '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n</tool_call>')
SPEC = ParseSpec(tool_parser="qwen", reasoning=("<think>", "</think>"), id_prefix="call_0123456789abcdef")


def _deltas(text, cuts, start=0, final=True):
    """TextDeltas of `text` cut at `cuts` (as the detokenizer sends them: raw offsets)."""
    out, prev = [], start
    for i, c in enumerate(list(cuts) + [len(text)]):
        reason = "stop" if final and c == len(text) else None
        out.append(TextDelta("r1", 0, prev, text[prev:c], c, reason, 0))
        prev = c
    return out


def _collect(items, seen, acc):
    for o in items:
        seen.trim(o)
        acc["content"] += o.text
        acc["reasoning"] += o.reasoning
        for c in o.tool_calls:
            call = acc["calls"].setdefault(c.index, {"id": c.id, "name": c.name, "arguments": ""})
            call["arguments"] += c.arguments


def test_resync_after_a_restart_gives_each_piece_once():
    whole = {"content": "", "reasoning": "", "calls": {}}
    states = {}
    out = parse_batch(TextBatch(_deltas(OUTPUT, [5, 20, 45, 70, 90]), [ParseInit("r1", 0, SPEC)]), states)
    _collect(out.items, _Seen(), whole)
    assert whole["reasoning"] == "The user wants weather." and whole["content"] == "Let me check."
    assert whole["calls"][0]["name"] == "get_weather" and "Zürich" in whole["calls"][0]["arguments"]
    assert not states  # finished choices are forgotten

    for cut in (10, 40, 60, 100):  # the pair dies after `cut` characters were parsed and sent
        seen, acc, states = _Seen(), {"content": "", "reasoning": "", "calls": {}}, {}
        first = parse_batch(TextBatch(_deltas(OUTPUT[:cut], [3, 7], final=False), [ParseInit("r1", 0, SPEC)]),
                            states)
        _collect(first.items, seen, acc)
        fresh = {}  # the new parser process: a resync batch resends everything from the start
        again = parse_batch(TextBatch([TextDelta("r1", 0, 0, OUTPUT[:cut], cut, None, 0)],
                                      [ParseInit("r1", 0, SPEC)], resync=True), fresh)
        rest = parse_batch(TextBatch(_deltas(OUTPUT, [cut + 5], start=cut)), fresh)
        _collect(again.items + rest.items, seen, acc)
        assert acc["content"] == whole["content"] and acc["reasoning"] == whole["reasoning"]
        assert [(c["name"], c["arguments"]) for c in acc["calls"].values()] == \
            [(c["name"], c["arguments"]) for c in whole["calls"].values()]


def test_single_call_drops_what_follows_the_call():
    spec = ParseSpec(tool_parser="qwen", single_call=True, id_prefix="call_0123456789abcdef")
    text = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>and then some junk'
    out = parse_batch(TextBatch(_deltas(text, [20, 50]), [ParseInit("r1", 0, spec)]), {})
    assert "".join(o.text for o in out.items) == ""
    assert [c.name for o in out.items for c in o.tool_calls] == ["f"]
