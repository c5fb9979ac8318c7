"""Structured outputs: a request's constraint (JSON schema, regex, choice, EBNF grammar or an
xgrammar structural tag) compiled by xgrammar into a token matcher, whose bitmask of allowed
next tokens the sampler applies.

Where each part runs: `check` (the API process and the offline Engine, on every constrained
request) parses the spec without a tokenizer, so a bad one is a 400 before anything starts.
`Grammars` (the engine core) compiles it against the tokenizer off the step loop, keeps one
matcher per sequence, advances it with every sampled token and packs the next step's bitmasks
into the StepPlan; the worker only applies them (ops/sampling.py). xgrammar (and with it torch)
is imported on the first constrained request, never by a server that gets none.
"""
from __future__ import annotations

import json
import logging
import re
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import msgspec

from xinfer.errors import InvalidRequestError

log = logging.getLogger("xinfer.structured")

KINDS = ("json", "json_object", "regex", "choice", "grammar", "structural_tag")
MAX_SPEC = 1 << 20  # characters of one spec (the body limit bounds it too)
MAX_CHOICES = 4096


class StructuredOutput(msgspec.Struct, array_like=True, frozen=True):
    """kind: one of KINDS; spec: the JSON schema / structural tag as JSON text, the regex, the
    EBNF (GBNF) grammar, or the choices as a JSON list of strings ("" for json_object)."""
    kind: str
    spec: str = ""

    @classmethod
    def json(cls, schema: dict | str | None = None) -> "StructuredOutput":
        """Output valid against `schema` (a dict or its JSON text); None: any JSON object."""
        if schema is None:
            return cls("json_object")
        return cls("json", schema if isinstance(schema, str) else json.dumps(schema))

    @classmethod
    def regex(cls, pattern: str) -> "StructuredOutput":
        return cls("regex", pattern)

    @classmethod
    def choice(cls, choices: list[str]) -> "StructuredOutput":
        return cls("choice", json.dumps(list(choices)))

    @classmethod
    def grammar(cls, ebnf: str) -> "StructuredOutput":
        return cls("grammar", ebnf)

    @classmethod
    def structural_tag(cls, tag: dict | str) -> "StructuredOutput":
        return cls("structural_tag", tag if isinstance(tag, str) else json.dumps(tag))


def _xgr():
    import xgrammar  # torch and transformers come with it: only when a request needs it
    return xgrammar


_CPP_PREFIX = re.compile(r"^\[[^\]]*\] [^ ]+:\d+: ")  # xgrammar's "[time] file.cc:line: " head


def _message(e: Exception) -> str:
    msg = _CPP_PREFIX.sub("", str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__)
    return msg[:500]


def _choices_ebnf(spec: str) -> str:
    try:
        choices = json.loads(spec)
    except ValueError:
        choices = None
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) for c in choices):
        raise InvalidRequestError("choice must be a non-empty list of strings", param="structured_outputs")
    if len(choices) > MAX_CHOICES:
        raise InvalidRequestError(f"choice has over {MAX_CHOICES} entries", param="structured_outputs")
    # EBNF string literals take JSON's escapes
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


# JSON-schema keywords xgrammar would ignore without a word (checked on xgrammar 0.2.9): a schema
# using one is refused, not silently loosened.
UNSUPPORTED = frozenset({"multipleOf", "if", "then", "else", "not", "dependentRequired", "dependentSchemas",
                         "dependencies", "unevaluatedProperties", "unevaluatedItems", "contentEncoding",
                         "contentMediaType", "contentSchema", "$dynamicRef", "$dynamicAnchor", "minContains",
                         "maxContains"})
_MAPS = ("properties", "patternProperties", "$defs", "definitions")  # name -> schema
_ONE = ("items", "additionalProperties", "additionalItems", "contains", "propertyNames")
_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")


def unsupported_keyword(schema, depth: int = 0) -> str | None:
    """The first keyword of UNSUPPORTED used as a schema keyword anywhere in `schema` (a property
    named "not" is fine)."""
    if not isinstance(schema, dict) or depth > 64:
        return None
    bad = next((k for k in schema if k in UNSUPPORTED), None)
    if bad is not None:
        return bad
    subs = [v for k in _MAPS if isinstance(schema.get(k), dict) for v in schema[k].values()]
    subs += [schema[k] for k in _ONE if k in schema]
    subs += [v for k in _LISTS if isinstance(schema.get(k), list) for v in schema[k]]
    if isinstance(schema.get("items"), list):
        subs += schema["items"]
    return next((b for v in subs if (b := unsupported_keyword(v, depth + 1)) is not None), None)


def grammar_of(so: StructuredOutput):
    """The tokenizer-independent xgrammar Grammar of `so`; InvalidRequestError naming what is wrong."""
    if so.kind not in KINDS:
        raise InvalidRequestError(f"unknown structured output kind {so.kind!r}; one of {', '.join(KINDS)}",
                                  param="structured_outputs")
    if len(so.spec) > MAX_SPEC:
        raise InvalidRequestError(f"the {so.kind} spec is over {MAX_SPEC} characters", param="structured_outputs")
    xgr = _xgr()
    try:
        if so.kind == "json_object":
            return xgr.Grammar.builtin_json_grammar()
        if so.kind == "json":
            schema = json.loads(so.spec)
            if not isinstance(schema, (dict, bool)):
                raise ValueError("a JSON schema is an object")
            bad = unsupported_keyword(schema)
            if bad is not None:
                raise ValueError(f"the keyword {bad!r} is not supported")
            return xgr.Grammar.from_json_schema(so.spec, any_whitespace=False, strict_mode=True)
        if so.kind == "regex":
            return xgr.Grammar.from_regex(so.spec)
        if so.kind == "choice":
            return xgr.Grammar.from_ebnf(_choices_ebnf(so.spec))
        if so.kind == "grammar":
            return xgr.Grammar.from_ebnf(so.spec)
        return xgr.Grammar.from_structural_tag(so.spec)
    except InvalidRequestError:
        raise
    except (ValueError, RuntimeError, TypeError, RecursionError) as e:  # xgrammar's errors are RuntimeErrors
        what = {"json": "JSON schema", "json_object": "JSON", "grammar": "grammar", "structural_tag":
                "structural tag"}.get(so.kind, so.kind)
        raise InvalidRequestError(f"invalid {what}: {_message(e)}", param="structured_outputs",
                                  code="invalid_structured_output") from None


def check(so: StructuredOutput) -> None:
    grammar_of(so)


class Grammars:
    """The engine core's side: compiled grammars (cached by spec), one matcher per sequence."""

    def __init__(self, tokenizer, vocab_size: int, eos_ids: list[int], timeout: float = 30.0):
        self._tokenizer, self.vocab_size, self.eos_ids, self.timeout = tokenizer, vocab_size, eos_ids, timeout
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="xinfer-grammar")
        self._compiler = None
        self._lock = threading.Lock()

    def _get_compiler(self):
        with self._lock:
            if self._compiler is None:
                if self._tokenizer is None:
                    raise InvalidRequestError("structured outputs need a tokenizer; this model has none")
                xgr = _xgr()
                from transformers import PreTrainedTokenizerFast
                hf = PreTrainedTokenizerFast(tokenizer_object=self._tokenizer.tok)
                info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab_size,
                                                          stop_token_ids=list(self.eos_ids))
                self._compiler = xgr.GrammarCompiler(info, max_threads=1, cache_limit_bytes=256 << 20)
                log.info("structured outputs: xgrammar %s ready", getattr(xgr, "__version__", "?"))
            return self._compiler

    def submit(self, so: StructuredOutput) -> Future:
        """Compile off the caller's thread; the future's result is the CompiledGrammar."""
        return self._pool.submit(lambda: self._get_compiler().compile_grammar(grammar_of(so)))

    @staticmethod
    def matcher(compiled):
        return _xgr().GrammarMatcher(compiled)

    def bitmask(self, matchers: list) -> bytes:
        """The allowed next tokens of each matcher, as int32 rows of ceil(vocab/32) words (bit set:
        allowed), raw bytes for the StepPlan."""
        xgr = _xgr()
        mask = xgr.allocate_token_bitmask(len(matchers), self.vocab_size)
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(mask, i)
        return mask.numpy().tobytes()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
