"""Tool-call parsers: the shared state machine, the helpers the families build on, and the
registry. Each family lives in its own module and registers itself by name.

Every parser is the same small state machine over the output text:

- content: text streams out as soon as it is certain; only a tail that could still grow into
  a start marker is held back.
- gap: at the start of the output and right after a call, whitespace (and the family's
  separators) is held; if a call follows it belongs to that call, otherwise it is content.
  So a reply that is only calls has no whitespace content.
- call section: from a start marker (or a leading "{" / "[" for the bare-JSON families) the
  text is buffered until the family's `_section` says the call is complete; then it is parsed
  into (name, arguments) pairs, or, when that fails, given back as content verbatim.

Feeding the text whole or in any chunks gives the same result, because each decision depends
only on text already seen, never on where a chunk ended.

Call ids: `id_prefix + "-" + index`. The caller passes a prefix unique to the request and
choice (e.g. "call_" + 24 hex chars); a prefix under 8 characters gets a random 24-hex suffix
so ids are always at least 9 characters and unique. Mistral templates demand 9 alphanumeric
characters, so that family derives such ids from the same prefix and index.
"""
from __future__ import annotations

import abc
import json
import logging
import re
import secrets

from xinfer import envs
from xinfer.ipc.text import ToolCallChunk
from xinfer.parsers.reasoning import partial_tail
from xinfer.parsers.schema import check_arguments

log = logging.getLogger("xinfer.parsers")

WS = " \t\r\n"
_CALL_KEYS = {"name", "arguments", "parameters", "type", "id"}
MAX_DEPTH = 64  # model JSON nested deeper is no call: json.loads/dumps would exhaust Python's stack

_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_TO_BRACKETS = bytes.maketrans(b"{}", b"[]")
_NOT_BRACKETS = bytes(sorted(set(range(256)) - set(b"[]{}")))


def too_deep(text: str | bytes, limit: int = MAX_DEPTH) -> bool:
    """Whether JSON text nests arrays and objects deeper than `limit` (text that is not JSON
    may count as deep). A few passes in C, none per character in Python."""
    raw = text.encode("utf-8", "surrogatepass") if isinstance(text, str) else text
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    brackets = _JSON_STRING.sub(b"", raw).translate(_TO_BRACKETS, _NOT_BRACKETS)
    for _ in range(limit):  # each pass drops the innermost level
        if not brackets:
            return False
        brackets = brackets.replace(b"[]", b"")
    return bool(brackets)


def load_json(text: str):
    """json.loads for model output: ValueError also when it is nested too deep."""
    if too_deep(text):
        raise ValueError(f"JSON nested deeper than {MAX_DEPTH} levels")
    return json.loads(text)


def calls_from(value):
    """A call object or a list of them -> the calls; None when any item is not a call."""
    items = value if isinstance(value, list) else [value]
    calls = [call_from(x) for x in items]
    return calls if items and None not in calls else None


def call_from(obj) -> tuple[str, dict] | None:
    """A {"name": ..., "arguments"|"parameters": {...}} object as (name, args), else None.
    Extra keys mean it is some other JSON, not a call."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    if not set(obj) <= _CALL_KEYS:
        return None
    args = obj.get("arguments", obj.get("parameters"))
    if args is None:
        args = {}
    if isinstance(args, str):  # some models send the arguments already encoded
        try:
            args = load_json(args) if args.strip() else {}
        except ValueError:
            return None
    return (obj["name"], args) if isinstance(args, dict) else None


def skip_ws(buf: str, i: int) -> int:
    while i < len(buf) and buf[i] in WS:
        i += 1
    return i


_PAIRS = {"[": "]", "{": "}", "(": ")"}


class Balance:
    """Finds where a bracketed value that starts at `start` ends, resumably (each feed scans
    only the new text). Mismatched brackets end it early, so broken text fails fast."""
    def __init__(self, start: int, quotes: str = '"'):
        self.i, self.quotes = start, quotes
        self.stack: list[str] = []
        self.quote: str | None = None
        self.escape = False

    def scan(self, s: str) -> int:
        """Index just past the value, or -1 while it is still open."""
        while self.i < len(s):
            c = s[self.i]
            self.i += 1
            if self.quote:
                if self.escape:
                    self.escape = False
                elif c == "\\":
                    self.escape = True
                elif c == self.quote:
                    self.quote = None
            elif c in self.quotes:
                self.quote = c
            elif c in _PAIRS:
                self.stack.append(_PAIRS[c])
            elif c in ")]}":
                expected = self.stack.pop() if self.stack else None
                if c != expected or not self.stack:  # a mismatch ends it too, to fail parsing
                    return self.i
        return -1


_BAD = object()  # a complete value that is not what we wanted


class ToolParser(abc.ABC):
    """One request choice's output, fed as it streams: `feed(text)` and at the end `finish()`
    each return (content delta, [ToolCallChunk]). A call comes out as one chunk (id, name and
    its whole arguments JSON, so offset 0) once it is complete; text that is not a well-formed
    call comes out as content, verbatim. `prefix` is text already placed in the prompt by
    `forced_prefix`: it is parsed as the output's start but never returned as content."""
    name = "base"
    starts: tuple[str, ...] = ()  # markers that open a call section anywhere
    leading = ""  # characters that open a section at a gap (the output's start, after a call)
    gap = WS  # held at a gap; goes with the call that follows it

    def __init__(self, tools: list[dict] | None = None, id_prefix: str = "call", prefix: str = ""):
        if len(id_prefix) < 8:
            id_prefix = f"{id_prefix}_{secrets.token_hex(12)}"
        self.id_prefix = id_prefix
        self.schemas: dict[str, dict | None] = {}
        for tool in tools or []:
            fn = tool.get("function", tool) if isinstance(tool, dict) else None
            if isinstance(fn, dict) and isinstance(fn.get("name"), str):
                self.schemas[fn["name"]] = fn.get("parameters")
        self._buf = ""
        self._pos = 0  # where _buf starts in the whole output
        self._hidden = len(prefix)  # the forced prefix: parsed, never output as content
        self._in_call = False
        self._off = 0  # where the call's marker starts in _buf (after gap whitespace)
        self._sec = None  # the open section's scan state
        self._at_gap = True
        self._had_call = False
        self._count = 0
        self._early: list[ToolCallChunk] = []
        if prefix:
            _, self._early = self.feed(prefix)

    # ---- public ----

    def feed(self, text: str) -> tuple[str, list[ToolCallChunk]]:
        self._buf += text
        return self._run(final=False)

    def finish(self) -> tuple[str, list[ToolCallChunk]]:
        return self._run(final=True)

    @classmethod
    def forced_prefix(cls, function_name: str | None) -> str | None:
        return None

    # The tool grammar (xinfer/parsers/grammar.py): a call of NAME is call_tag(NAME)[0], then its
    # arguments in ARGS_STYLE (xgrammar's "json" or one of its XML styles), then call_tag(NAME)[1];
    # several calls sit between SECTION[0] and SECTION[2], SECTION[1] apart.
    ARGS_STYLE = "json"
    SECTION = ("", "\n", "")

    @classmethod
    def call_tag(cls, function_name: str) -> tuple[str, str] | None:
        """(text before the arguments, text after them) of a call; None: no grammar for it."""
        return None

    # ---- the state machine ----

    def _take(self, n: int) -> str:
        text, start = self._buf[:n], self._pos
        self._buf, self._pos = self._buf[n:], self._pos + n
        if start < self._hidden:
            text = text[self._hidden - start:]
        return text

    def _run(self, final: bool) -> tuple[str, list[ToolCallChunk]]:
        content: list[str] = []
        calls, self._early = self._early, []
        while True:
            if self._in_call:
                done = self._section(self._buf, self._off, final)
                if done is None:
                    break
                n, parsed = done
                text = self._take(n)
                if parsed is None:
                    content.append(text)
                    self._at_gap = False
                else:
                    calls += self._accept(parsed)
                    self._had_call = self._at_gap = True
                self._in_call, self._sec = False, None
                continue
            buf = self._buf
            if self._at_gap:
                rest = buf.lstrip(self.gap)
                if not rest:
                    if final:
                        text = self._take(len(buf))
                        if not self._had_call:  # trailing whitespace after calls is dropped
                            content.append(text)
                    break
                if rest[0] in self.leading or rest.startswith(self.starts):
                    self._in_call, self._off, self._at_gap = True, len(buf) - len(rest), False
                    continue
                if not final and any(m.startswith(rest) for m in self.starts):
                    break
                self._at_gap = False
            hits = [(i, m) for m in self.starts if (i := buf.find(m)) >= 0]
            if hits:
                i = min(hits)[0]
                content.append(self._take(i))
                self._in_call, self._off = True, 0
                continue
            keep = 0 if final else partial_tail(buf, self.starts)
            content.append(self._take(len(buf) - keep))
            break
        return "".join(content), calls

    @abc.abstractmethod
    def _section(self, buf: str, off: int, final: bool) -> tuple[int, list | None] | None:
        """The call section starting at buf[off]: None while incomplete (never when final),
        else (chars of buf it takes, [(name, args), ...] or None when it does not parse)."""

    def _accept(self, parsed: list[tuple[str, dict]]) -> list[ToolCallChunk]:
        out = []
        strict = envs.strict_tool_call()
        for name, args in parsed:
            if strict:
                if name not in self.schemas:
                    reason = "no such tool"
                else:
                    reason = check_arguments(args, self.schemas[name])
                if reason:
                    log.warning("dropped tool call %r: %s", name, reason)
                    continue
            index = self._count
            self._count += 1
            arguments = json.dumps(args, ensure_ascii=False)
            out.append(ToolCallChunk(index, 0, self._make_id(index), name, arguments))
        return out

    def _make_id(self, index: int) -> str:
        return f"{self.id_prefix}-{index}"

    # ---- helpers for sections ----

    def _until(self, buf: str, body_start: int, end: str, final: bool):
        """(chars taken, body) once `end` is seen; (len(buf), None) if it never came."""
        j = buf.find(end, self._sec if self._sec is not None else body_start)
        if j < 0:
            if final:
                return len(buf), None
            self._sec = max(body_start, len(buf) - len(end) + 1)  # rescan only what may hold it
            return None
        return j + len(end), buf[body_start:j]

    def _json_at(self, buf: str, i: int, final: bool, quotes: str = '"'):
        """(end, value) for the bracketed value at buf[i]; value is _BAD if it does not load."""
        if self._sec is None:
            self._sec = Balance(i, quotes)
        end = self._sec.scan(buf)
        if end < 0:
            return (len(buf), _BAD) if final else None
        try:
            return end, load_json(buf[i:end])
        except ValueError:
            return end, _BAD


class TaggedCalls(ToolParser):
    """Families whose calls sit between a START and an END tag; `_parse` reads what is between."""
    START = END = ""

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        cls.starts = (cls.START,)

    def _section(self, buf, off, final):
        done = self._until(buf, off + len(self.START), self.END, final)
        if done is None:
            return None
        n, body = done
        return n, (None if body is None else self._parse(body))


class MarkedCalls(ToolParser):
    """Families whose calls sit in a section of special-token markers: SECTIONS maps each opening
    marker to its closing one; inside, each call is CALL_BEGIN ... CALL_END, read by `_call`."""
    SECTIONS: dict[str, str] = {}
    CALL_BEGIN = CALL_END = ""

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        cls.starts = tuple(cls.SECTIONS)

    @abc.abstractmethod
    def _call(self, inner: str) -> tuple[str, dict] | None:
        """(name, arguments) from what is between CALL_BEGIN and CALL_END, or None: not a call."""

    def _section(self, buf, off, final):
        begin = next(b for b in self.SECTIONS if buf.startswith(b, off))
        done = self._until(buf, off + len(begin), self.SECTIONS[begin], final)
        if done is None:
            return None
        n, body = done
        if body is None:
            # ended without the closing marker: fine if every call in it closed
            body = buf[off + len(begin):]
            if not body.rstrip().endswith(self.CALL_END):
                return n, None
        return n, self._parse(body)

    def _parse(self, body: str):
        calls, rest = [], body.strip()
        while rest:
            e = rest.find(self.CALL_END)
            call = self._call(rest[len(self.CALL_BEGIN):e]) if rest.startswith(self.CALL_BEGIN) and e >= 0 else None
            if call is None:
                return None
            calls.append(call)
            rest = rest[e + len(self.CALL_END):].strip()
        return calls or None


# Filled by `register` as the family modules are imported (xinfer/parsers/__init__.py imports
# them all, in the order this dict lists them).
TOOL_PARSERS: dict[str, type[ToolParser]] = {}


def register(cls: type[ToolParser]) -> type[ToolParser]:
    """Class decorator: makes a family available under its `name`."""
    if cls.name in TOOL_PARSERS:
        raise ValueError(f"tool parser {cls.name!r} registered twice")
    TOOL_PARSERS[cls.name] = cls
    return cls


# vLLM's --tool-call-parser names for the same formats (its mistral, pythonic, step3 and minimax_m2
# are spelled alike).
VLLM_PARSER_NAMES = {"hermes": "qwen", "llama3_json": "llama", "deepseek_v3": "deepseek", "qwen3_coder": "qwen_coder",
                     "glm45": "glm45_moe", "glm47": "glm47_moe", "kimi_k2": "kimik2"}


def get_tool_parser(name: str) -> type[ToolParser]:
    try:
        return TOOL_PARSERS[VLLM_PARSER_NAMES.get(name, name)]
    except KeyError:
        raise ValueError(f"unknown tool parser {name!r}; valid: {', '.join(sorted(TOOL_PARSERS))} "
                         f"(or vLLM's {', '.join(sorted(VLLM_PARSER_NAMES))})") from None


# What a chat template writes when it renders a call, most specific first.
_TEMPLATE_MARKERS = [
    ("tool▁calls▁begin", "deepseek"),
    ("steptml:invoke", "step3"),
    ("<|tool_calls_section_begin|>", "kimik2"),
    ("<minimax:tool_call>", "minimax_m2"),
    ("</arg_key><arg_value>", "glm47_moe"),  # GLM templates also have <tool_call>; 4.7 drops the newlines
    ("<arg_key>", "glm45_moe"),
    ("<function=", "qwen_coder"),  # Qwen3-Coder's template also has <tool_call>
    ("<tool_call>", "qwen"),
    ("[TOOL_CALLS]", "mistral"),
    ("func_name1(", "pythonic"),
    ("<|python_tag|>", "llama"),
    ('"parameters": dictionary of argument name', "llama"),
]

# Used only without a chat template: Llama and Qwen-Coder share their architecture with
# models that have no (or another) tool format, so the template decides when there is one.
_ARCHITECTURES = {
    "Qwen2ForCausalLM": "qwen", "Qwen3ForCausalLM": "qwen", "Qwen3MoeForCausalLM": "qwen",
    "Qwen2MoeForCausalLM": "qwen", "MistralForCausalLM": "mistral", "MixtralForCausalLM": "mistral",
    "DeepseekV3ForCausalLM": "deepseek", "Llama4ForConditionalGeneration": "pythonic",
    "Llama4ForCausalLM": "pythonic",
}


def choose_tool_parser(architecture: str | None, chat_template: str | None, enforce: str | None = None) -> str:
    """The parser for a model: `enforce` (validated), else the chat template's call markers,
    else (no template) the architecture, else "passthrough"; a template that handles tools with
    no known marker gets "json"."""
    if enforce:
        return get_tool_parser(enforce).name
    if chat_template:
        for marker, name in _TEMPLATE_MARKERS:
            if marker in chat_template:
                return name
        return "json" if re.search(r"\btools\b", chat_template) else "passthrough"
    return _ARCHITECTURES.get(architecture or "", "passthrough")
