"""Tool-call parsers: one class per output family, all incremental.

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

import ast
import hashlib
import json
import logging
import os
import re
import secrets

import msgspec

from xinfer.parsers.reasoning import partial_tail
from xinfer.parsers.schema import check_arguments

log = logging.getLogger("xinfer.parsers")


class ToolCallDelta(msgspec.Struct, array_like=True):
    index: int  # the call's index within this choice (0, 1, ...)
    id: str | None  # set in the first delta of a call only
    name: str | None  # set in the first delta of a call only
    arguments: str  # a fragment of the arguments JSON string


_WS = " \t\r\n"
_CALL_KEYS = {"name", "arguments", "parameters", "type", "id"}


def _strict() -> bool:
    return os.environ.get("XINFER_STRICT_TOOL_CALL", "").strip().lower() not in ("", "0", "false", "no")


def _calls_from(value):
    """A call object or a list of them -> the calls; None when any item is not a call."""
    items = value if isinstance(value, list) else [value]
    calls = [_call_from(x) for x in items]
    return calls if items and None not in calls else None


def _call_from(obj) -> tuple[str, dict] | None:
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
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            return None
    return (obj["name"], args) if isinstance(args, dict) else None


def _load_args(text: str) -> dict | None:
    text = text.strip()
    if text.startswith("```"):  # DeepSeek wraps arguments in a ```json fence
        text = text[3:]
        text = text[text.find("\n") + 1:] if "\n" in text else ""
        if text.rstrip().endswith("```"):
            text = text.rstrip()[:-3]
    if not text.strip():
        return {}
    try:
        args = json.loads(text)
    except ValueError:
        return None
    return args if isinstance(args, dict) else None


_PAIRS = {"[": "]", "{": "}", "(": ")"}


class _Balance:
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


class ToolParser:
    """One request choice's output, fed as it streams: `feed(text)` and at the end `finish()`
    each return (content delta, [ToolCallDelta]). A call comes out as one delta (id, name and
    its whole arguments JSON) once it is complete; text that is not a well-formed call comes out
    as content, verbatim. `prefix` is text already placed in the prompt by `forced_prefix`: it
    is parsed as the output's start but never returned as content."""
    name = "base"
    starts: tuple[str, ...] = ()  # markers that open a call section anywhere
    leading = ""  # characters that open a section at a gap (the output's start, after a call)
    gap = _WS  # held at a gap; goes with the call that follows it

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
        self._early: list[ToolCallDelta] = []
        if prefix:
            _, self._early = self.feed(prefix)

    # ---- public ----

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        self._buf += text
        return self._run(final=False)

    def finish(self) -> tuple[str, list[ToolCallDelta]]:
        return self._run(final=True)

    @classmethod
    def forced_prefix(cls, function_name: str | None) -> str | None:
        return None

    # ---- the state machine ----

    def _take(self, n: int) -> str:
        text, start = self._buf[:n], self._pos
        self._buf, self._pos = self._buf[n:], self._pos + n
        if start < self._hidden:
            text = text[self._hidden - start:]
        return text

    def _run(self, final: bool) -> tuple[str, list[ToolCallDelta]]:
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

    def _section(self, buf: str, off: int, final: bool) -> tuple[int, list | None] | None:
        """The call section starting at buf[off]: None while incomplete (never when final),
        else (chars of buf it takes, [(name, args), ...] or None when it does not parse)."""
        raise NotImplementedError

    def _accept(self, parsed: list[tuple[str, dict]]) -> list[ToolCallDelta]:
        out = []
        strict = _strict()
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
            out.append(ToolCallDelta(index, self._make_id(index), name, json.dumps(args, ensure_ascii=False)))
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
            self._sec = _Balance(i, quotes)
        end = self._sec.scan(buf)
        if end < 0:
            return (len(buf), _BAD) if final else None
        try:
            return end, json.loads(buf[i:end])
        except ValueError:
            return end, _BAD


def _skip_ws(buf: str, i: int) -> int:
    while i < len(buf) and buf[i] in _WS:
        i += 1
    return i


class PassthroughToolParser(ToolParser):
    name = "passthrough"

    def _run(self, final):
        calls, self._early = self._early, []
        return self._take(len(self._buf)), calls


class JsonToolParser(ToolParser):
    """The whole reply is a call object {"name", "arguments"|"parameters"} or a list of them."""
    name = "json"
    leading = "{["

    def _section(self, buf, off, final):
        done = self._json_at(buf, off, final)
        if done is None:
            return None
        end, value = done
        return end, _calls_from(value)

    args_key = "arguments"  # what a forced call names its arguments

    @classmethod
    def forced_prefix(cls, function_name):
        if function_name is None:
            return '{"name": '
        return '{"name": ' + json.dumps(function_name, ensure_ascii=False) + f', "{cls.args_key}": '


class LlamaToolParser(JsonToolParser):
    """Llama 3.1/3.2 JSON tool calling: [<|python_tag|>]{"name": ..., "parameters": {...}},
    several separated by ";"."""
    name = "llama"
    TAG = "<|python_tag|>"
    starts = (TAG,)
    leading = "{"
    gap = _WS + ";"

    def _section(self, buf, off, final):
        i = off
        if buf.startswith(self.TAG, off):
            i = _skip_ws(buf, off + len(self.TAG))
            if i == len(buf):
                return (len(buf), None) if final else None
            if buf[i] != "{":  # python code for a built-in tool, not JSON: content
                return off + len(self.TAG), None
        done = self._json_at(buf, i, final)
        if done is None:
            return None
        end, value = done
        call = _call_from(value)
        return end, ([call] if call else None)

    args_key = "parameters"


class QwenToolParser(ToolParser):
    """Hermes style (Qwen2.5, Qwen3): <tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>."""
    name = "qwen"
    START, END = "<tool_call>", "</tool_call>"
    starts = (START,)

    def _section(self, buf, off, final):
        done = self._until(buf, off + len(self.START), self.END, final)
        if done is None:
            return None
        n, body = done
        return n, (None if body is None else self._parse(body))

    def _parse(self, body: str):
        calls, i, dec = [], _skip_ws(body, 0), json.JSONDecoder()
        while i < len(body):  # usually one object; tolerate several in one block
            try:
                value, i = dec.raw_decode(body, i)
            except ValueError:
                return None
            call = _call_from(value)
            if call is None:
                return None
            calls.append(call)
            i = _skip_ws(body, i)
        return calls or None

    @classmethod
    def forced_prefix(cls, function_name):
        if function_name is None:
            return "<tool_call>\n"
        return '<tool_call>\n{"name": ' + json.dumps(function_name, ensure_ascii=False) + ', "arguments": '


_FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)(?:</function>|\Z)", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)(?:</parameter>|(?=<parameter=)|\Z)", re.DOTALL)


def _convert(value: str, schema) -> object:
    """A Qwen3-Coder parameter value (always text) as the type the tool schema asks for."""
    t = schema.get("type") if isinstance(schema, dict) else None
    types = t if isinstance(t, list) else [t] if t else []
    if not types or "string" in types:
        return value
    text = value.strip()
    for t in types:
        try:
            if t == "integer":
                return int(text)
            if t == "number":
                v = json.loads(text)
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    return v
            elif t == "boolean" and text.lower() in ("true", "false"):
                return text.lower() == "true"
            elif t == "null" and text.lower() in ("null", "none"):
                return None
            elif t in ("object", "array"):
                try:
                    v = json.loads(text)
                except ValueError:
                    v = ast.literal_eval(text)  # models sometimes write Python literals here
                if isinstance(v, dict if t == "object" else list):
                    return v
        except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
            pass
    return value


class QwenCoderToolParser(QwenToolParser):
    """Qwen3-Coder: <tool_call>\\n<function=NAME>\\n<parameter=P>\\nVALUE\\n</parameter>\\n
    </function>\\n</tool_call>; values are text, typed by the tool's schema."""
    name = "qwen_coder"

    def _parse(self, body: str):
        if "<function=" not in body:  # the model fell back to Hermes JSON
            return super()._parse(body)
        calls, leftover = [], body
        for m in _FUNCTION.finditer(body):
            leftover = leftover.replace(m.group(0), "", 1)
            name = m.group(1).strip()
            props = (self.schemas.get(name) or {}).get("properties") or {}
            args = {}
            for p in _PARAMETER.finditer(m.group(2)):
                key, value = p.group(1).strip(), p.group(2)
                # the template writes "<parameter=P>\nVALUE\n</parameter>": those two newlines go
                value = value.removeprefix("\n")
                value = value.removesuffix("\n")
                args[key] = _convert(value, props.get(key))
            calls.append((name, args))
        if not calls or leftover.strip():
            return None
        return calls

    @classmethod
    def forced_prefix(cls, function_name):
        if function_name is None:
            return "<tool_call>\n"
        return f"<tool_call>\n<function={function_name}>\n"


class MistralToolParser(ToolParser):
    """[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...] (v3 tokenizers) and
    [TOOL_CALLS]name[ARGS]{...} (v11+, repeated per call; [CALL_ID]id may sit before [ARGS])."""
    name = "mistral"
    MARK = "[TOOL_CALLS]"
    starts = (MARK,)
    _NAME_END = re.compile(r"\s")
    _NAME_MAX = 256

    def _section(self, buf, off, final):
        i = _skip_ws(buf, off + len(self.MARK))
        if i == len(buf):
            return (len(buf), None) if final else None
        if buf[i] in "[{":
            done = self._json_at(buf, i, final)
            if done is None:
                return None
            end, value = done
            return end, _calls_from(value)
        # a name (and call id) is short and holds no whitespace: anything else is prose
        limit = i + self._NAME_MAX
        j = buf.find("[ARGS]", i, limit + len("[ARGS]"))
        bad = self._NAME_END.search(buf, i, j if j >= 0 else min(len(buf), limit))
        if bad:
            return bad.start(), None
        if j < 0:
            if len(buf) >= limit + len("[ARGS]"):
                return limit, None
            return (len(buf), None) if final else None
        name = buf[i:j].split("[CALL_ID]")[0]
        k = _skip_ws(buf, j + len("[ARGS]"))
        if k == len(buf):
            return (len(buf), None) if final else None
        if buf[k] != "{" or not name:
            return k, None
        done = self._json_at(buf, k, final)
        if done is None:
            return None
        end, value = done
        return end, ([(name, value)] if isinstance(value, dict) else None)

    def _make_id(self, index):
        # Mistral templates reject ids that are not exactly 9 alphanumeric characters
        digest = int.from_bytes(hashlib.sha256(f"{self.id_prefix}-{index}".encode()).digest()[:8], "big")
        alphabet = "0123456789abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
        chars = []
        for _ in range(9):
            digest, r = divmod(digest, 62)
            chars.append(alphabet[r])
        return "".join(chars)

    @classmethod
    def forced_prefix(cls, function_name):
        if function_name is None:
            return cls.MARK
        # the JSON-list form: both tokenizer generations parse it
        return cls.MARK + '[{"name": ' + json.dumps(function_name, ensure_ascii=False) + ', "arguments": '


class PythonicToolParser(ToolParser):
    """Llama 3.2 / Llama 4 pythonic: [get_weather(city="SF", days=3), other()], literals only."""
    name = "pythonic"
    leading = "["

    def _section(self, buf, off, final):
        if self._sec is None:
            self._sec = _Balance(off, quotes="\"'")
        end = self._sec.scan(buf)
        if end < 0:
            return (len(buf), None) if final else None
        return end, self._parse(buf[off:end])

    @staticmethod
    def _parse(text: str):
        try:
            tree = ast.parse(text.strip(), mode="eval").body
        except (SyntaxError, ValueError, MemoryError, RecursionError):
            return None
        if not isinstance(tree, ast.List) or not tree.elts:
            return None
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or node.args:
                return None
            name = _dotted(node.func)
            if name is None or any(kw.arg is None for kw in node.keywords):
                return None
            try:
                args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}
                json.dumps(args)  # literals that JSON cannot hold (sets, bytes, complex) fail here
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                return None
            calls.append((name, args))
        return calls

    @classmethod
    def forced_prefix(cls, function_name):
        if function_name is None:
            return "["
        if not all(part.isidentifier() for part in function_name.split(".")):
            return None
        return f"[{function_name}("


def _dotted(node) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        head = _dotted(node.value)
        return None if head is None else f"{head}.{node.attr}"
    return None


class DeepSeekToolParser(ToolParser):
    """DeepSeek-V3: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json {...} ```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>; V3.1 drops the type and fence:
    <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>."""
    name = "deepseek"
    CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
    starts = (CALLS_BEGIN,)

    def _section(self, buf, off, final):
        done = self._until(buf, off + len(self.CALLS_BEGIN), self.CALLS_END, final)
        if done is None:
            return None
        n, body = done
        if body is None:
            # ended without the closing marker: fine if every call in it closed
            body = buf[off + len(self.CALLS_BEGIN):]
            if not body.rstrip().endswith(self.CALL_END):
                return n, None
        return n, self._parse(body)

    def _parse(self, body: str):
        calls, rest = [], body.strip()
        while rest:
            if not rest.startswith(self.CALL_BEGIN):
                return None
            e = rest.find(self.CALL_END)
            if e < 0:
                return None
            head, sep, tail = rest[len(self.CALL_BEGIN):e].partition(self.SEP)
            if not sep:
                return None
            if head.strip() == "function" and "\n" in tail.strip():  # V3: type, then name line
                name, _, tail = tail.strip().partition("\n")
            else:
                name = head
            name, args = name.strip(), _load_args(tail)
            if not name or args is None:
                return None
            calls.append((name, args))
            rest = rest[e + len(self.CALL_END):].strip()
        return calls or None

    @classmethod
    def forced_prefix(cls, function_name):
        if function_name is None:
            return cls.CALLS_BEGIN + cls.CALL_BEGIN
        return cls.CALLS_BEGIN + cls.CALL_BEGIN + function_name + cls.SEP


TOOL_PARSERS: dict[str, type[ToolParser]] = {
    cls.name: cls for cls in (
        JsonToolParser, QwenToolParser, QwenCoderToolParser, LlamaToolParser, MistralToolParser,
        PythonicToolParser, DeepSeekToolParser, PassthroughToolParser)
}


def get_tool_parser(name: str) -> type[ToolParser]:
    try:
        return TOOL_PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool parser {name!r}; valid: {', '.join(sorted(TOOL_PARSERS))}") from None


# What a chat template writes when it renders a call, most specific first.
_TEMPLATE_MARKERS = [
    ("tool▁calls▁begin", "deepseek"),
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
