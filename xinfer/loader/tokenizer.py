"""The tokenizer and chat template, from a Hugging Face folder or a GGUF file."""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from xinfer.errors import InvalidRequestError, ModelLoadError


# The template variables apply_chat_template sets itself, and the names of its own parameters.
TEMPLATE_OWN_NAMES = frozenset({"self", "messages", "tools", "add_generation_prompt", "bos_token", "eos_token"})


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
                            tools: list | None = None, **kwargs) -> str:
        """`kwargs` are more template variables; they never replace TEMPLATE_OWN_NAMES."""
        if not self.chat_template:
            raise InvalidRequestError("this model has no chat template; use a completion prompt instead")
        if self._template is None:
            self._template = _compile(self.chat_template)
        # One context dict, not keywords: a variable named like render's own parameters ("self") is fine.
        context = {**kwargs, "messages": messages, "tools": tools, "add_generation_prompt": add_generation_prompt,
                   "bos_token": self.bos_token, "eos_token": self.eos_token}
        try:
            return self._template.render(context)
        except Exception as e:  # a template raises for messages it does not accept
            raise InvalidRequestError(f"chat template failed: {e}") from None

    def encode_chat(self, messages, add_generation_prompt=True, tools=None, **kwargs) -> list[int]:
        # The template writes any BOS itself; don't let the tokenizer add a second one.
        return self.encode(self.apply_chat_template(messages, add_generation_prompt, tools, **kwargs),
                           add_special_tokens=False)


def _compile(source: str):
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(msg):
        raise ValueError(msg)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda v, indent=None, ensure_ascii=False, **_: json.dumps(
        v, indent=indent, ensure_ascii=ensure_ascii)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


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
