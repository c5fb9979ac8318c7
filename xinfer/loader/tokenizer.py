"""The tokenizer and chat template, from a Hugging Face folder or a GGUF file."""
from __future__ import annotations

import functools
import json
import sys
import time
from datetime import datetime
from pathlib import Path

from xinfer.errors import InvalidRequestError, ModelLoadError


# The template variables apply_chat_template sets itself, and the names of its own parameters.
TEMPLATE_OWN_NAMES = frozenset({"self", "messages", "tools", "add_generation_prompt", "bos_token", "eos_token",
                                "chat_template"})
# A request's own template is client code: it renders in the same sandbox, under a deadline and a cap
# on what it writes (and on the strings and numbers its operators make).
REQUEST_TEMPLATE_SECONDS = 1.0
REQUEST_TEMPLATE_MAX_TEXT = 16 << 20  # characters
_MAX_BITS = 1 << 16  # an int from `*` or `**` past this is no prompt text, and can take minutes to make


class Tokenizer:
    def __init__(self, tok, chat_template: str | None, bos_token_id: int | None, eos_token_ids: list[int],
                 add_bos: bool = False):
        self.tok = tok  # a tokenizers.Tokenizer
        self.chat_template = chat_template
        self.bos_token_id = bos_token_id
        self.eos_token_ids = eos_token_ids
        self.add_bos = add_bos  # prepend BOS ourselves when the tokenizer's post-processor doesn't
        self.vocab_size = tok.get_vocab_size(with_added_tokens=True)
        self._template = None

    def to_spec(self) -> tuple:
        """What a process needs to rebuild this tokenizer without reading the model (for decoding:
        no chat template); Tokenizer.from_spec undoes it in ~50 ms."""
        return self.tok.to_str(), self.bos_token_id, list(self.eos_token_ids), self.add_bos

    @classmethod
    def from_spec(cls, spec: tuple) -> "Tokenizer":
        from tokenizers import Tokenizer as HFTokenizer
        text, bos, eos, add_bos = spec
        return cls(HFTokenizer.from_str(text), None, bos, eos, add_bos)

    @property
    def bos_token(self) -> str:
        return self.tok.id_to_token(self.bos_token_id) if self.bos_token_id is not None else ""

    @property
    def eos_token(self) -> str:
        return self.tok.id_to_token(self.eos_token_ids[0]) if self.eos_token_ids else ""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        # encode_batch_fast releases the GIL while it works (encode does not) and skips the offsets we
        # never read: a 5 MB prompt tokenized in a thread no longer stalls the API's event loop.
        ids = self.tok.encode_batch_fast([text], add_special_tokens=add_special_tokens)[0].ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None and ids[:1] != [self.bos_token_id]:
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return self.tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: list | None = None, chat_template: str | None = None, **kwargs) -> str:
        """`chat_template`: a request's own, in place of the model's; `kwargs` are more template
        variables; they never replace TEMPLATE_OWN_NAMES."""
        if chat_template is None and not self.chat_template:
            raise InvalidRequestError("this model has no chat template; use a completion prompt instead")
        # One context dict, not keywords: a variable named like render's own parameters ("self") is fine.
        context = {**kwargs, "messages": messages, "tools": tools, "add_generation_prompt": add_generation_prompt,
                   "bos_token": self.bos_token, "eos_token": self.eos_token}
        if self._template is None and chat_template is None:
            self._template = _compile(self.chat_template)
        template = self._template if chat_template is None else _request_template(chat_template)
        try:
            return template.render(context) if chat_template is None else _render_bounded(template, context)
        except (Exception, _Overtime) as e:  # a template raises for messages it does not accept
            raise InvalidRequestError(f"chat template failed: {e}") from None

    def encode_chat(self, messages, add_generation_prompt=True, tools=None, **kwargs) -> list[int]:
        # The template writes any BOS itself; don't let the tokenizer add a second one.
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, tools, **kwargs),
                           add_special_tokens=False)


def _compile(source: str, guarded: bool = False):
    return _environment(guarded).from_string(source)


@functools.lru_cache(maxsize=32)  # clients resend the same template with every request
def _request_template(source: str):
    from jinja2 import TemplateSyntaxError
    try:
        return _compile(source, guarded=True)
    except TemplateSyntaxError as e:
        raise InvalidRequestError(f"the request's chat_template does not compile: {e.message} (line {e.lineno})") \
            from None
    except RecursionError:
        raise InvalidRequestError("the request's chat_template is nested too deeply") from None


class _Overtime(BaseException):
    """Past a request template's deadline: a BaseException, so no `except Exception` on the way
    (jinja's, a filter's) swallows it."""


def _render_bounded(template, context: dict) -> str:
    """Render a request's template with a line hook on this thread that raises past the deadline
    (a compiled template is Python: each loop turn is a line event), up to REQUEST_TEMPLATE_MAX_TEXT."""
    end = time.monotonic() + REQUEST_TEMPLATE_SECONDS

    def hook(frame, event, arg):
        if time.monotonic() > end:
            raise _Overtime(f"the request's chat_template ran past {REQUEST_TEMPLATE_SECONDS:g} s")
        return hook

    parts, size = [], 0
    old = sys.gettrace()
    sys.settrace(hook)
    try:
        for part in template.generate(context):
            size += len(part)
            if size > REQUEST_TEMPLATE_MAX_TEXT:
                raise ValueError(f"the request's chat_template wrote more than {REQUEST_TEMPLATE_MAX_TEXT} characters")
            parts.append(part)
    finally:
        sys.settrace(old)
    return "".join(parts)


def _too_big(op: str, a, b) -> bool:
    """Would `a op b` make a huge string, list or int? That is one C call, which no deadline stops."""
    seq = (str, list, tuple)
    if op == "+":
        return isinstance(a, seq) and isinstance(b, seq) and len(a) + len(b) > REQUEST_TEMPLATE_MAX_TEXT
    if op == "**":
        return isinstance(a, int) and isinstance(b, int) and abs(a) > 1 and b * abs(a).bit_length() > _MAX_BITS
    if isinstance(a, int) and isinstance(b, seq):
        a, b = b, a
    if isinstance(a, seq) and isinstance(b, int):
        return len(a) * b > REQUEST_TEMPLATE_MAX_TEXT
    return isinstance(a, int) and isinstance(b, int) and a.bit_length() + b.bit_length() > _MAX_BITS


@functools.cache
def _environment(guarded: bool):
    """The sandbox chat templates render in; `guarded` (a request's own template): its `*`, `**`,
    `+` and `~` are sized before they run (the model's may join a prompt of any size)."""
    from jinja2.compiler import CodeGenerator
    from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

    class Joins(CodeGenerator):
        def visit_Concat(self, node, frame):  # `a ~ b`: through Guarded.joined, not jinja's str_join
            self.write("environment.joined((")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

    class Guarded(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "+"})  # also keeps jinja from folding them at compile time
        code_generator_class = Joins

        def call_binop(self, context, operator, left, right):
            if _too_big(operator, left, right):
                raise SecurityError(f"the chat template's {operator!r} would make too large a value")
            return super().call_binop(context, operator, left, right)

        def joined(self, parts):
            parts = [str(p) for p in parts]
            if sum(map(len, parts)) > REQUEST_TEMPLATE_MAX_TEXT:
                raise SecurityError("the chat template's '~' would make too large a string")
            return "".join(parts)

    def raise_exception(msg):
        raise ValueError(msg)

    kind = Guarded if guarded else ImmutableSandboxedEnvironment
    env = kind(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda v, indent=None, ensure_ascii=False, **_: json.dumps(
        v, indent=indent, ensure_ascii=ensure_ascii)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def load_hf_tokenizer(folder: str, eos_from_generation: list[int]) -> Tokenizer:
    from tokenizers import Tokenizer as HFTok

    f = Path(folder)
    if not (f / "tokenizer.json").is_file():
        raise ModelLoadError(f"{folder} has no tokenizer.json")
    try:
        tok = HFTok.from_file(str(f / "tokenizer.json"))
    except Exception as e:
        raise ModelLoadError(f"cannot read {f / 'tokenizer.json'}: {e}") from None
    cfg = json.loads((f / "tokenizer_config.json").read_text()) if (f / "tokenizer_config.json").is_file() else {}
    template = cfg.get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        template = next((t["template"] for t in template if t.get("name") == "default"), template[0]["template"])
    if (f / "chat_template.jinja").is_file():
        template = (f / "chat_template.jinja").read_text()

    def tid(key):
        v = cfg.get(key)
        if isinstance(v, dict):
            v = v.get("content")
        return tok.token_to_id(v) if v else None

    eos = list(eos_from_generation) or ([tid("eos_token")] if tid("eos_token") is not None else [])
    return Tokenizer(tok, template, tid("bos_token"), eos, add_bos=False)
