"""`xinfer chat`: a chat in the terminal, with the engine in this process or with a running
`xinfer serve` (--url, over its OpenAI-compatible streaming API, stdlib only)."""
from __future__ import annotations

import importlib
import itertools
import json
import signal
import sys
import urllib.error
import urllib.request

from xinfer import envs
from xinfer.errors import XinferError
from xinfer.parsers.reasoning import REASONING_PARSERS, ReasoningParser, reasoning_markers, starts_in_reasoning

DIM, RESET = "\x1b[2m", "\x1b[0m"
HELP = """\
/reset         clear the conversation (the system prompt stays)
/system TEXT   set the system prompt (none without TEXT) and clear the conversation
/help          this list
/exit          quit (or Ctrl-D); Ctrl-C stops a reply"""


class LocalChat:
    """The engine in this process: one request per turn, stepped here."""

    def __init__(self, args):
        from xinfer import Engine

        self.engine = Engine(args.engine_config)
        self.tok = self.engine.tokenizer
        if self.tok is None or not self.tok.chat_template:
            raise ValueError("this model has no chat template (give one with --chat-template)")
        self.markers = reasoning_markers(self.tok.chat_template, args.reasoning_parser)
        self.args = args
        self.name = self.engine.info.name
        self._ids = itertools.count()

    def stream(self, messages):
        """Yields (reasoning, content) pieces. Ctrl-C only sets a flag, checked between steps: a step
        cut in the middle would leave the engine core half-updated."""
        from xinfer import SamplingParams

        text = self.tok.apply_chat_template(messages)
        ids = self.tok.encode(text, add_special_tokens=False)
        room = self.engine.max_model_len - len(ids)
        params = SamplingParams(max_tokens=max(1, min(self.args.max_tokens, room)),
                                temperature=self.args.temperature)
        parser = None
        if self.markers:
            parser = ReasoningParser(*self.markers, in_reasoning=starts_in_reasoning(text, self.markers))
        rid = f"chat-{next(self._ids)}"
        stop = []
        old = signal.signal(signal.SIGINT, lambda *_: stop.append(True))
        try:
            self.engine.add_request(ids, params, rid)  # a conversation over the context raises here
            done = False
            while not done:
                if stop:
                    self.engine.abort_request(rid)
                    raise KeyboardInterrupt
                for d in self.engine.step():
                    if d.request_id != rid:
                        continue
                    if d.finish_reason == "error":
                        raise XinferError(d.error or "the request failed")
                    yield parser.feed(d.text) if parser else ("", d.text)
                    done = d.finish_reason is not None
            if parser:
                yield parser.finish()
        finally:
            signal.signal(signal.SIGINT, old)

    def close(self):
        self.engine.close()


class RemoteChat:
    """A running `xinfer serve`: /v1/chat/completions with stream=true, read as SSE lines. Ctrl-C
    raises in the read; leaving the `with` closes the connection, which aborts the request there."""

    def __init__(self, args):
        self.url = args.url.rstrip("/")
        self.args = args
        key = args.api_key or envs.api_key()
        self.headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        models = self._request("/v1/models")  # fails fast on a wrong URL or key
        with models as r:
            data = json.load(r).get("data") or [{}]
        self.name = data[0].get("id", "default")

    def _request(self, path, body=None):
        req = urllib.request.Request(self.url + path, None if body is None else json.dumps(body).encode(),
                                     self.headers)
        try:
            return urllib.request.urlopen(req, timeout=300)
        except urllib.error.HTTPError as e:
            try:
                msg = json.loads(e.read())["error"]["message"]
            except (ValueError, KeyError, TypeError):
                msg = e.reason
            raise XinferError(f"{self.url}{path}: {e.code} {msg}") from None
        except urllib.error.URLError as e:
            raise XinferError(f"{self.url}{path}: {e.reason}") from None

    def stream(self, messages):
        body = {"model": self.name, "messages": messages, "stream": True,
                "temperature": self.args.temperature, "max_tokens": self.args.max_tokens}
        with self._request("/v1/chat/completions", body) as r:
            for line in r:
                if not line.startswith(b"data:"):
                    continue  # blank separators and ": keep-alive" comments
                data = line[5:].strip()
                if data == b"[DONE]":
                    return
                event = json.loads(data)
                if "error" in event:
                    raise XinferError(event["error"].get("message", "the request failed"))
                for choice in event.get("choices") or []:
                    d = choice.get("delta") or {}
                    yield d.get("reasoning_content") or d.get("reasoning") or "", d.get("content") or ""

    def close(self):
        pass


def show(pieces, out, tty: bool) -> str:
    """Write a reply as it streams, the reasoning dimmed on a terminal; returns the content, which
    is what the history keeps."""
    dim, content, last = False, [], "\n"
    try:
        for reasoning, text in pieces:
            if reasoning:
                if tty and not dim:
                    out.write(DIM)
                    dim = True
                out.write(reasoning)
                last = reasoning
            if text:
                if dim:
                    out.write(RESET)
                    dim = False
                if content == [] and not last.endswith("\n"):
                    out.write("\n")  # the answer starts on its own line after the reasoning
                out.write(text)
                content.append(text)
                last = text
            out.flush()
    finally:
        if dim:
            out.write(RESET)
        out.flush()
    return "".join(content)


def chat_loop(backend, system: str | None, out=sys.stdout) -> int:
    tty = out.isatty()
    history: list[dict] = []

    def reset():
        history[:] = [{"role": "system", "content": system}] if system else []

    reset()
    out.write(f"xinfer chat with {backend.name}; /help for commands, Ctrl-D to quit\n")
    while True:
        try:
            line = input("> ")
        except EOFError:
            out.write("\n")
            return 0
        except KeyboardInterrupt:
            out.write("\n")  # a fresh prompt; only Ctrl-D quits
            continue
        line = line.strip()
        if not line:
            continue
        if line.startswith("/"):
            cmd, _, rest = line.partition(" ")
            if cmd in ("/exit", "/quit"):
                return 0
            if cmd == "/reset":
                reset()
                out.write("(conversation cleared)\n")
            elif cmd == "/system":
                system = rest.strip() or None
                reset()
                out.write("(system prompt set, conversation cleared)\n" if system else
                          "(system prompt removed, conversation cleared)\n")
            elif cmd == "/help":
                out.write(HELP + "\n")
            else:
                out.write(f"unknown command {cmd}; /help lists them\n")
            continue
        history.append({"role": "user", "content": line})
        try:
            reply = show(backend.stream(history), out, tty)
            history.append({"role": "assistant", "content": reply})
            out.write("\n")
        except KeyboardInterrupt:
            history.pop()  # an interrupted turn is dropped: ask again, or something else
            out.write("\n[interrupted]\n")
        except (XinferError, OSError) as e:  # OSError: the server went away mid-reply
            history.pop()
            out.write(f"\nerror: {e} (/reset starts over)\n")
        out.flush()


def cmd_chat(args) -> int:
    backend = RemoteChat(args) if args.url else LocalChat(args)
    try:
        try:
            importlib.import_module("readline")  # line editing and history for input()
        except ImportError:
            pass
        return chat_loop(backend, args.system)
    finally:
        backend.close()


def add_chat_args(c) -> None:
    """The chat's own flags (xinfer/cli.py adds the engine's; args.engine_config is made from them)."""
    c.add_argument("--url", default=None, help="talk to a running `xinfer serve` at this address "
                   "(http://host:port) instead of loading the model here; the engine flags are then unused")
    c.add_argument("--api-key", default=None, help="with --url: the server's --api-key (or XINFER_API_KEY)")
    c.add_argument("--system", default=None, help="system prompt")
    c.add_argument("--temperature", type=float, default=0.7)
    c.add_argument("--max-tokens", type=int, default=512, help="longest reply, in tokens")
    c.add_argument("--reasoning-parser", default=None,
                   help=f"reasoning markers by name ({', '.join(REASONING_PARSERS)}); default: from the chat "
                        "template")
