"""Splitting a model's output into reasoning (between think markers) and content, incrementally."""
from __future__ import annotations

# (start, end) pairs, most specific first: a template may quote several.
_MARKERS = [("◁think▷", "◁/think▷"), ("[THINK]", "[/THINK]"), ("<think>", "</think>")]


def partial_tail(text: str, markers) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of some marker: the part
    that must be held back while streaming because the next chunk may complete a marker."""
    longest = max((len(m) for m in markers), default=0)
    for k in range(min(len(text), longest - 1), 0, -1):
        tail = text[-k:]
        if any(m.startswith(tail) for m in markers):
            return k
    return 0


# --reasoning-parser: vLLM's names for the marker pairs ("none": no reasoning split)
_THINK = ("<think>", "</think>")
REASONING_PARSERS = {"none": None, "deepseek_r1": _THINK, "deepseek_v3": _THINK, "qwen3": _THINK, "glm45": _THINK,
                     "minimax_m2": _THINK, "step3": _THINK, "mistral": ("[THINK]", "[/THINK]"),
                     "kimi_k2": ("◁think▷", "◁/think▷")}


def reasoning_markers(chat_template: str | None, parser: str | None = None) -> tuple[str, str] | None:
    """The reasoning markers: those of `parser` (--reasoning-parser) if given, else the first pair the
    chat template mentions."""
    if parser is not None:
        if parser not in REASONING_PARSERS:
            raise ValueError(f"--reasoning-parser {parser!r} is not one of {', '.join(REASONING_PARSERS)}")
        return REASONING_PARSERS[parser]
    if not chat_template:
        return None
    for start, end in _MARKERS:
        if start in chat_template or end in chat_template:
            return start, end
    return None


def starts_in_reasoning(rendered_prompt: str, markers) -> bool:
    """True when the prompt opens a reasoning block the model is to continue (DeepSeek-R1,
    Qwen3-thinking templates end the generation prompt with "<think>\\n")."""
    if not markers:
        return False
    return rendered_prompt.rstrip().endswith(markers[0])


class ReasoningParser:
    def __init__(self, start: str = "<think>", end: str = "</think>", in_reasoning: bool = False):
        self.start, self.end = start, end
        self.in_reasoning = in_reasoning
        self._buf = ""
        # Qwen3 writes "</think>\n\n" before the answer: newlines right after an end marker go.
        self._strip_newlines = False

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        return self._run(final=False)

    def finish(self) -> tuple[str, str]:
        return self._run(final=True)

    def _run(self, final: bool) -> tuple[str, str]:
        reasoning, content = [], []
        while self._buf:
            if self.in_reasoning:
                i = self._buf.find(self.end)
                if i >= 0:
                    reasoning.append(self._buf[:i])
                    self._buf = self._buf[i + len(self.end):]
                    self.in_reasoning = False
                    self._strip_newlines = True
                    continue
                keep = 0 if final else partial_tail(self._buf, [self.end])
                reasoning.append(self._buf[:len(self._buf) - keep])
                self._buf = self._buf[len(self._buf) - keep:]
                break
            if self._strip_newlines:
                self._buf = self._buf.lstrip("\r\n")
                if not self._buf:
                    break  # more newlines may follow: stay in stripping mode
                self._strip_newlines = False
            i = self._buf.find(self.start)
            if i >= 0:
                content.append(self._buf[:i])
                self._buf = self._buf[i + len(self.start):]
                self.in_reasoning = True
                continue
            keep = 0 if final else partial_tail(self._buf, [self.start])
            content.append(self._buf[:len(self._buf) - keep])
            self._buf = self._buf[len(self._buf) - keep:]
            break
        return "".join(reasoning), "".join(content)
