"""DeepSeek-V3 / V3.1 tool calls."""
from __future__ import annotations

from xinfer.parsers.base import MarkedCalls, load_json, register


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
class DeepSeekToolParser(MarkedCalls):
    """DeepSeek-V3: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json {...} ```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>; V3.1 drops the type and fence:
    <｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>."""
    name = "deepseek"
    CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
    CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
    SECTIONS = {CALLS_BEGIN: CALLS_END}

    def _call(self, inner: str):
        head, sep, tail = inner.partition(self.SEP)
        if not sep:
            return None
        if head.strip() == "function" and "\n" in tail.strip():  # V3: type, then name line
            name, _, tail = tail.strip().partition("\n")
        else:
            name = head
        name, args = name.strip(), _load_args(tail)
        return None if not name or args is None else (name, args)

    @classmethod
    def forced_prefix(cls, function_name):
        if function_name is None:
            return cls.CALLS_BEGIN + cls.CALL_BEGIN
        return cls.CALLS_BEGIN + cls.CALL_BEGIN + function_name + cls.SEP

    SECTION = (CALLS_BEGIN, "", CALLS_END)

    @classmethod
    def call_tag(cls, function_name):  # the V3.1 form; the parser reads both
        if cls.CALL_END in function_name or cls.SEP in function_name:
            return None
        return cls.CALL_BEGIN + function_name + cls.SEP, cls.CALL_END
