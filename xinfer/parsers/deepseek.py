"""DeepSeek-V3 / V3.1 tool calls."""
from __future__ import annotations


from xinfer.parsers.base import ToolParser, load_json, register


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
        args = load_json(text)
    except ValueError:
        return None
    return args if isinstance(args, dict) else None


@register
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
