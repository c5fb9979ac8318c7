"""OpenAI response shapes: choices, stream chunks and logprobs built from the engine's
TextDeltas (already trimmed of resends by the EngineClient)."""
from __future__ import annotations

from xinfer.ipc.step import unpack_ids


class TokenStrings:
    """Token id -> its text, for logprobs (cached: the same ids come back all the time)."""

    def __init__(self, tok):
        self.tok = tok
        self.cache: dict[int, str] = {}

    def __call__(self, tid: int) -> str:
        s = self.cache.get(tid)
        if s is None:
            if len(self.cache) > 200_000:
                self.cache.clear()
            s = self.cache[tid] = (self.tok.decode([tid], skip_special_tokens=False) if self.tok is not None
                                   else f"token_id:{tid}")
        return s


def chat_logprobs(strs: TokenStrings, ids: list[int], entries: list) -> list[dict]:
    def one(tid, lp):
        t = strs(tid)
        return {"token": t, "logprob": lp, "bytes": list(t.encode())}

    return [{**one(tid, lp), "top_logprobs": [one(a, alp) for a, alp in alts]}
            for tid, (lp, alts) in zip(ids, entries)]


def completion_logprobs(strs: TokenStrings, ids: list[int], entries: list, text_offset: int) -> dict:
    """The legacy completions format; an entry of None (the first prompt token) has no logprob."""
    out = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for tid, e in zip(ids, entries):
        t = strs(tid)
        out["tokens"].append(t)
        out["text_offset"].append(text_offset)
        text_offset += len(t)
        out["token_logprobs"].append(None if e is None else e[0])
        out["top_logprobs"].append(None if e is None else {strs(a): alp for a, alp in e[1]})
    return out


def prompt_logprobs(strs: TokenStrings, ids: list[int], entries: list) -> list[dict | None]:
    """vLLM's prompt_logprobs: per prompt token None (the first has no context), else {token id:
    {logprob, rank, decoded_token}} of the token itself and of the top alternatives, ranked 1..N
    (the token among them keeps that rank, as in vLLM)."""
    def one(tid, lp, rank):
        return {"logprob": lp, "rank": rank, "decoded_token": strs(tid)}

    out = []
    for tid, e in zip(ids, entries):
        if e is None:
            out.append(None)
            continue
        lp, alts, rank = e
        out.append({str(tid): one(tid, lp, rank), **{str(a): one(a, alp, r) for r, (a, alp) in enumerate(alts, 1)}})
    return out


def merge_completion_logprobs(a: dict | None, b: dict) -> dict:
    if a is None:
        return b
    return {k: a[k] + b[k] for k in a}


class ChoiceState:
    """What one choice has produced so far (non-streaming responses and usage)."""

    def __init__(self):
        self.content: list[str] = []
        self.reasoning: list[str] = []
        self.calls: dict[int, dict] = {}
        self.logprob_ids: list[int] = []
        self.logprobs: list = []
        self.prompt_logprobs = None
        self.finish_reason: str | None = None
        self.tokens = 0
        self.cached = 0
        self.stop_str: str | None = None

    def add(self, o) -> None:
        self.content.append(o.text)
        self.reasoning.append(o.reasoning)
        for c in o.tool_calls:
            call = self.calls.setdefault(c.index, {"id": c.id, "type": "function",
                                                    "function": {"name": c.name, "arguments": ""}})
            call["function"]["arguments"] += c.arguments
        if o.logprobs:
            self.logprob_ids += unpack_ids(o.logprob_token_ids)
            self.logprobs += o.logprobs
        if o.prompt_logprobs is not None:
            self.prompt_logprobs = o.prompt_logprobs
        self.tokens = o.total_tokens
        if o.finish_reason:
            self.finish_reason = finish_reason(o.finish_reason, bool(self.calls))
            self.cached = o.num_cached_tokens
            self.stop_str = o.stop_str

    def tool_calls(self) -> list[dict]:
        return [self.calls[i] for i in sorted(self.calls)]


def finish_reason(reason: str, has_calls: bool) -> str:
    if reason in ("stop", "abort"):
        return "tool_calls" if has_calls else "stop"
    return reason


def chat_delta(o, first_call_seen: set) -> dict:
    """The `delta` of a chat stream chunk for one TextDelta."""
    delta = {}
    if o.reasoning:
        delta["reasoning_content"] = delta["reasoning"] = o.reasoning  # the older name and vLLM's newer one
    if o.text:
        delta["content"] = o.text
    if o.tool_calls:
        calls = []
        for c in o.tool_calls:
            d = {"index": c.index, "function": {"arguments": c.arguments}}
            if c.index not in first_call_seen:
                first_call_seen.add(c.index)
                d = {"index": c.index, "id": c.id, "type": "function",
                     "function": {"name": c.name, "arguments": c.arguments}}
            calls.append(d)
        delta["tool_calls"] = calls
    return delta
