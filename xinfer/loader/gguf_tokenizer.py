"""A GGUF file's tokenizer rebuilt as a `tokenizers` Tokenizer: byte-level BPE with llama.cpp's
pre-tokenizer regexes, or SentencePiece-style BPE with byte fallback."""
from __future__ import annotations

import logging

from gguf import TokenType
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

log = logging.getLogger("xinfer.loader.gguf")

_GPT2_SPLIT = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                 r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                 r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                 r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O_SPLIT = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
                r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
                r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_CJK = r"[一-龥ࠀ-一가-퟿]+"

# tokenizer.ggml.pre -> regexes applied in turn (each splits the pieces of the previous one, keeping
# matches and gaps), as in llama.cpp's llama-vocab.cpp; written in the tokenizer.json dialect.
_PRE_SPLITS = {
    **dict.fromkeys(["gpt2", "mpt", "olmo", "jais", "trillion", "granite-docling"], [_GPT2_SPLIT]),
    **dict.fromkeys(["smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva"],
                    [r"\p{N}", _GPT2_SPLIT]),
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "dbrx", "smaug-bpe", "chatglm-bpe", "glm4"], [_LLAMA3_SPLIT]),
    **dict.fromkeys(["qwen2", "stablelm2", "hunyuan", "deepseek-r1-qwen", "megrez", "kormo"], [_QWEN2_SPLIT]),
    **dict.fromkeys(["gpt-4o", "llama4", "minimax-m2", "kanana2"], [_GPT4O_SPLIT]),
    "tekken": [_TEKKEN_SPLIT],
    "falcon": [r"[\p{P}\$\+<=>\^~\|`]+", _GPT2_SPLIT, r"[0-9][0-9][0-9]"],
    # llama.cpp spells the letter class out range by range; it is Unicode's cased letters.
    "deepseek-llm": [r"[\r\n]", r"\s?[\p{Lu}\p{Ll}\p{Lt}]+", r"\s?[!-/:-~！-／：-～‘-‟　-。]+", r"\s+$", _CJK,
                     r"\p{N}+"],
    "deepseek-coder": [r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _CJK, r"\p{N}"],
    "deepseek-v3": [r"\p{N}{1,3}", r"[一-龥぀-ゟ゠-ヿ]+",
                    r"[!\"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+"
                    r"| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"],
    **dict.fromkeys(["bloom", "poro-chat", "gpt3-finnish"], [r" ?[^(\s|.,!?…。，、।۔،)]+"]),
}
# llama.cpp looks a whole pre-token up in the vocabulary before merging for these.
_IGNORE_MERGES = {"llama3", "llama-v3", "llama-bpe", "falcon3", "pixtral", "gpt-4o", "llama4", "tekken"}


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used to spell byte-level BPE tokens."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def byte_level_tokenizer(tokens: list[str], merges: list[str], pre: str) -> Tokenizer:
    spelling = bytes_to_unicode()
    alphabet = set(spelling.values())
    # Tokens are stored byte-level spelled, except some added ones stored as plain text.
    vocab = {(t if set(t) <= alphabet else "".join(spelling[b] for b in t.encode())): i
             for i, t in enumerate(tokens)}
    splits = _PRE_SPLITS.get(pre)
    if splits is None:
        log.warning("unknown GGUF pre-tokenizer %r; splitting text like GPT-2", pre)
        splits = [_GPT2_SPLIT]
    tok = Tokenizer(models.BPE(vocab, [tuple(m.split(" ", 1)) for m in merges], fuse_unk=False,
                               ignore_merges=pre in _IGNORE_MERGES))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in splits]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    return tok


def sentencepiece_tokenizer(tokens: list[str], scores: list[float] | None, unk: str, gemma: bool,
                            add_space_prefix: bool) -> Tokenizer:
    """SentencePiece BPE with byte fallback, as a tokenizers BPE whose merges come from the scores."""
    if gemma:
        # Gemma files store whitespace-run tokens with real spaces, and their scores do not follow the
        # merge order; the order of the tokens in the file does.
        tokens = ["▁" * len(t) if " " in t and not t.strip() else t for t in tokens]
        scores = None
    if scores is None:
        scores = [-float(i) for i in range(len(tokens))]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab, merges_from_scores(vocab, dict(zip(tokens, scores))),
                               unk_token=unk if unk in vocab else None, fuse_unk=True, byte_fallback=True))
    steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if gemma:
        tok.normalizer = normalizers.Replace(" ", "▁")
        tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(
            replacement="▁", prepend_scheme="first" if add_space_prefix else "never", split=False)
        if add_space_prefix:
            steps.append(decoders.Strip(" ", 1, 0))
    tok.decoder = decoders.Sequence(steps)
    return tok


def merges_from_scores(vocab: dict[str, int], scores: dict[str, float]) -> list[tuple[str, str]]:
    """Every split of a token into two vocabulary pieces, best-scoring token first."""
    merges = []
    for token, score in scores.items():
        local = [(token[:i], token[i:], score) for i in range(1, len(token))
                 if token[:i] in vocab and token[i:] in vocab]
        local.sort(key=lambda m: (vocab[m[0]], vocab[m[1]]))
        merges += local
    merges.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in merges]


def add_special_tokens(tok: Tokenizer, tokens: list[str], types: list[int], byte_level: bool) -> None:
    """Control tokens become special tokens and user-defined ones added tokens, so each is matched
    whole in the text (e.g. "<|im_start|>" is one id)."""
    alphabet = set(bytes_to_unicode().values()) if byte_level else None
    control = [AddedToken(t, special=True, normalized=False) for t, ty in zip(tokens, types)
               if ty == TokenType.CONTROL and (alphabet is None or set(t) <= alphabet)]
    tok.add_special_tokens(control)
    vocab = tok.get_vocab()
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t, ty in zip(tokens, types)
                    if ty == TokenType.USER_DEFINED and t in vocab])
