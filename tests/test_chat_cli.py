"""`xinfer chat`: driven in a pseudo-terminal on the bundled model, and over --url against a server."""
import io
import os
import pty
import re
import select
import signal
import subprocess
import sys
import time

import pytest

from tests.conftest import start_server, stop_server
from xinfer.chat_cli import LocalChat, show
from xinfer.engine_core import Delta

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
PROMPT = r"\n> $"  # the prompt, waiting for a line


class Terminal:
    """`xinfer chat ...` with a pty as its controlling terminal: Ctrl-C typed there is a SIGINT."""

    def __init__(self, *args):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:
            os.chdir(ROOT)
            os.execvpe(sys.executable, [sys.executable, "-m", "xinfer.cli", "chat", *args],
                       {**os.environ, "TERM": "dumb"})
        self.raw, self.pos = b"", 0

    @property
    def text(self) -> str:
        return ANSI.sub("", self.raw.decode(errors="replace").replace("\r", ""))

    def expect(self, pattern: str, timeout: float = 120) -> str:
        """Read until `pattern` matches past the last match; returns the text up to its end."""
        deadline = time.time() + timeout
        while True:
            m = re.compile(pattern).search(self.text, self.pos)
            if m:
                seen, self.pos = self.text[self.pos:m.end()], m.end()
                return seen
            left = deadline - time.time()
            assert left > 0, f"no {pattern!r} in {self.text[self.pos:]!r} (all: {self.text[-400:]!r})"
            if select.select([self.fd], [], [], min(left, 1))[0]:
                try:
                    chunk = os.read(self.fd, 4096)
                except OSError:  # EIO: the child is gone
                    chunk = b""
                assert chunk, f"chat exited waiting for {pattern!r}: {self.text!r}"
                self.raw += chunk

    def send(self, data: bytes) -> None:
        os.write(self.fd, data)

    def alive(self) -> bool:
        return os.waitpid(self.pid, os.WNOHANG) == (0, 0)

    def exit_code(self, timeout: float = 60) -> int:
        deadline = time.time() + timeout
        while time.time() < deadline:
            if select.select([self.fd], [], [], 0.2)[0]:
                try:
                    self.raw += os.read(self.fd, 4096)
                except OSError:
                    pass
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                os.close(self.fd)
                return os.waitstatus_to_exitcode(status)
        self.kill()
        raise AssertionError(f"chat did not exit: {self.text!r}")

    def kill(self) -> None:
        try:
            os.kill(self.pid, signal.SIGKILL)
            os.waitpid(self.pid, 0)
        except OSError:
            pass


def reply_of(seen: str, line: str) -> str:
    """The reply between the echoed user line and the next prompt."""
    return seen.split(line, 1)[1].rsplit("\n> ", 1)[0].strip()


def test_chat_in_terminal():
    t = Terminal("--max-tokens", "16", "--temperature", "0")
    try:
        t.expect("/help for commands")
        t.expect(PROMPT)
        t.send(b"Hi!\r")
        assert re.search(r"\w", reply_of(t.expect(PROMPT), "Hi!"))
        t.send(b"/reset\r")
        t.expect(r"\(conversation cleared\)\n> $")
        t.send(b"/help\r")
        t.expect(r"/system TEXT[^>]*Ctrl-C stops a reply\n> $")
        t.send(b"What is 2+2?\r")
        assert re.search(r"\w", reply_of(t.expect(PROMPT), "What is 2+2?"))
        # Ctrl-C at the prompt: a fresh prompt, no exit. A SIGINT that lands after the prompt is
        # printed but before readline waits for a key is only seen at the next key (CPython's
        # readline loop): give it a moment to be waiting.
        time.sleep(0.5)
        t.send(b"\x03")
        t.expect(PROMPT, timeout=30)
        assert t.alive()
        t.send(b"\x04")  # Ctrl-D quits
        assert t.exit_code() == 0
    finally:
        t.kill()


def test_ctrl_c_stops_a_reply():
    t = Terminal("--max-tokens", "400", "--temperature", "0")
    try:
        t.expect(PROMPT)
        for ask in ("Write a long story about a dragon.", "Now write a long poem about the sea."):
            t.send(ask.encode() + b"\r")
            t.expect(re.escape(ask) + r"\n")
            t.expect(r"\w")  # the reply has started
            t.send(b"\x03")
            t.expect(r"\[interrupted\]\n> $")
            assert t.alive()
        t.send(b"/exit\r")
        assert t.exit_code() == 0
    finally:
        t.kill()


def test_chat_over_url_through_a_pipe():
    proc, base, _ = start_server()
    try:
        r = subprocess.run([sys.executable, "-m", "xinfer.cli", "chat", "--url", base, "--max-tokens", "16",
                            "--temperature", "0"], input="Hi!\n", capture_output=True, text=True, timeout=120,
                           cwd=ROOT)
    finally:
        stop_server(proc)
    assert r.returncode == 0, r.stderr
    assert "\x1b[" not in r.stdout
    reply = r.stdout.split("\n", 1)[1].split("> ")[1]  # after the banner and the first prompt
    assert re.search(r"\w", reply), r.stdout


class Tty(io.StringIO):
    def isatty(self):
        return True


def test_reasoning_dimmed_only_on_a_terminal():
    pieces = [("Let me ", ""), ("think.", ""), ("", "Four"), ("", ".")]
    out = Tty()
    assert show(iter(pieces), out, out.isatty()) == "Four."
    assert out.getvalue() == "\x1b[2mLet me think.\x1b[0m\nFour."
    out = io.StringIO()
    assert show(iter(pieces), out, out.isatty()) == "Four."
    assert out.getvalue() == "Let me think.\nFour."


class FakeEngine:
    """Steps out `texts` one delta each; a None sends this process a SIGINT in that step instead."""
    max_model_len = 100

    def __init__(self, texts):
        self.texts, self.aborted = list(texts), []

    def add_request(self, ids, params, rid):
        self.rid = rid

    def step(self):
        text = self.texts.pop(0)
        if text is None:
            os.kill(os.getpid(), signal.SIGINT)
            return []
        return [Delta(0, self.rid, 0, [1], text, None if self.texts else "stop")]

    def abort_request(self, rid):
        self.aborted.append(rid)


def local_chat(texts, markers=("<think>", "</think>")):
    from types import SimpleNamespace
    chat = object.__new__(LocalChat)
    chat.engine, chat.markers, chat._ids = FakeEngine(texts), markers, iter(range(9))
    chat.tok = SimpleNamespace(apply_chat_template=lambda m: "prompt", encode=lambda t, add_special_tokens: [1, 2])
    chat.args = SimpleNamespace(max_tokens=16, temperature=0.0)
    return chat


def test_in_process_reasoning_split_and_ctrl_c_abort():
    chat = local_chat(["<thi", "nk>hm</think>", "\n\nFour", "."])
    pieces = list(chat.stream([{"role": "user", "content": "2+2?"}]))
    assert "".join(r for r, _ in pieces) == "hm" and "".join(c for _, c in pieces) == "Four."
    chat = local_chat(["Once", None, "never"])
    with pytest.raises(KeyboardInterrupt):
        list(chat.stream([{"role": "user", "content": "a story"}]))
    assert chat.engine.aborted == ["chat-0"] and chat.engine.texts == ["never"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # put back
