"""Tokenizer from a GGUF file's vocabulary metadata, as a ``tokenizers.Tokenizer``.

A GGUF carries no ``tokenizer.json``; llama.cpp stores the pieces, their types, scores, merges and
the special ids under ``tokenizer.ggml.*``. Two vocabulary kinds are rebuilt here:

- ``gpt2``: byte-level BPE with the file's merges; the pre-tokenizer split regex follows
  ``tokenizer.ggml.pre`` (the family whose merges were learned on that split).
- ``llama``: SentencePiece-style BPE with byte fallback; the file has no merges, so they are
  derived from the vocabulary (every split of a piece into two pieces, best first by score; Gemma's
  scores do not follow its merge order, its file order does).

The construction matches what Hugging Face transformers builds from the same file (its GGUF
tokenizer converter), which the tests check id for id. No transformers at run time.
"""
from __future__ import annotations

from functools import lru_cache
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer as HFTokenizer, decoders, normalizers, pre_tokenizers, processors
from tokenizers.models import BPE

from ..errors import FormatError, UnsupportedError
from ..tokenizer import Tokenizer

# Bounds on the vocabulary, checked before the merges are derived (deriving costs the sum of the squared piece
# lengths): real vocabularies have ~260k pieces at most, of a few dozen characters.
MAX_TOKENS = 1 << 22
MAX_PIECE_CHARS = 1024
MAX_VOCAB_CHARS = 64 << 20

# llama.cpp token types
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
           r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
          r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_TEKKEN = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
           r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
           r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_GPT4O = (r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
          r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# tokenizer.ggml.pre -> split regex applied before byte-level mapping. Names not listed ("gpt2",
# "smollm", "default", ...) use GPT-2's own regex (ByteLevel with use_regex=True). SmolLM's digit
# split is already implied by its merges (there are no merges joining digits).
PRE_TOKENIZER_SPLITS: dict[str, str] = {
    **dict.fromkeys(["llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2",
                     "dbrx", "smaug-bpe"], _LLAMA3),
    **dict.fromkeys(["qwen2", "deepseek-r1-qwen", "kormo", "megrez"], _QWEN2),
    "tekken": _TEKKEN,
    **dict.fromkeys(["gpt-4o", "llama4", "minimax-m2"], _GPT4O),
}

# Pieces that end a turn in the chat templates of the families we load (llama.cpp's EOG list).
END_OF_TURN = ("<|eot_id|>", "<|im_end|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "<|eom_id|>",
               "<EOT>", "<|end_of_text|>")


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character table used to spell byte-level BPE pieces."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def derive_merges(vocab: dict[str, int], scores: dict[str, float] | None) -> list[tuple[str, str]]:
    """Merges implied by a vocabulary: each piece split into two pieces that are both in it.

    Ordered best first: by the piece's score (descending) when scores are given, else by id
    (ascending); ties by longer left, then longer right piece (the order transformers uses).
    """
    rank = scores if scores is not None else vocab
    found: list[tuple[str, str, float]] = []
    for piece, score in rank.items():
        local = []
        for i in range(1, len(piece)):
            left, right = piece[:i], piece[i:]
            if left in vocab and right in vocab:
                local.append((left, right, score))
        if len(local) > 1:
            local.sort(key=lambda x: (vocab[x[0]], vocab[x[1]]))
        found.extend(local)
    found.sort(key=lambda x: (x[2], len(x[0]), len(x[1])), reverse=scores is not None)
    return [(a, b) for a, b, _ in found]


# -- the two vocabulary kinds -----------------------------------------------------------------
def _byte_level(tokens: list[str], merges: list[str], pre: str | None) -> HFTokenizer:
    alphabet = set(bytes_to_unicode().values())
    spell = bytes_to_unicode()
    vocab = {t if set(t) <= alphabet else "".join(spell[b] for b in t.encode("utf-8")): i
             for i, t in enumerate(tokens)}
    pairs = [tuple(m.split(" ")) for m in merges]
    tk = HFTokenizer(BPE(vocab=vocab, merges=pairs, dropout=None, continuing_subword_prefix="",
                         end_of_word_suffix="", fuse_unk=False, byte_fallback=False))
    split = PRE_TOKENIZER_SPLITS.get(pre or "")
    if split is None:
        tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tk.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(split), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tk.decoder = decoders.ByteLevel()
    return tk


def _sentencepiece(tokens: list[str], scores: list[float] | None, gemma: bool, add_prefix_space: bool,
                   unk: str | None, phi3: bool = False) -> HFTokenizer:
    if gemma:
        # Gemma stores runs of spaces as real spaces; its pieces spell them with U+2581.
        tokens = ["\u2581" * len(t) if " " in t and not t.strip() else t for t in tokens]
        rank: dict[str, float] | None = {t: -i for i, t in enumerate(tokens)}  # file order = merge order
    else:
        rank = dict(zip(tokens, scores)) if scores is not None else None
    vocab = {t: i for i, t in enumerate(tokens)}
    merges = derive_merges(vocab, rank)
    if gemma:
        tk = HFTokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=True, unk_token=unk or "<unk>",
                             dropout=None, byte_fallback=True))
        tk.normalizer = normalizers.Replace(" ", "\u2581")
        tk.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous", invert=False)
        tk.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
        return tk
    tk = HFTokenizer(BPE(vocab=vocab, merges=merges, fuse_unk=True, byte_fallback=True, dropout=None))
    if phi3:
        # Phi-3's own tokenizer.json prefixes and respells spaces in a normalizer, not with Metaspace:
        # it differs only on text starting with a space ("  hi" -> three U+2581, Metaspace gives two).
        tk.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
        add_prefix_space = True
    else:
        tk.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581",
                                                    prepend_scheme="first" if add_prefix_space else "never",
                                                    split=False)
    steps = [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()]
    if add_prefix_space:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tk.decoder = decoders.Sequence(steps)
    return tk


# -- assembly ----------------------------------------------------------------------------------
def tokenizer_from_gguf(meta: dict[str, Any], where: str) -> Tokenizer:
    """Build the Tokenizer a GGUF file describes (``meta``: its metadata as Python values)."""
    arch = meta.get("general.architecture")
    model = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens or not all(isinstance(t, str) for t in tokens):
        raise FormatError(f"{where}: tokenizer.ggml.tokens is missing or not a list of strings")
    if len(tokens) > MAX_TOKENS:
        raise FormatError(f"{where}: tokenizer.ggml.tokens has {len(tokens)} tokens, past the limit of {MAX_TOKENS}")
    longest = max(map(len, tokens))
    if longest > MAX_PIECE_CHARS or sum(map(len, tokens)) > MAX_VOCAB_CHARS:
        raise FormatError(f"{where}: tokenizer.ggml.tokens holds a piece of {longest} characters or more than "
                          f"{MAX_VOCAB_CHARS} characters in all (limits {MAX_PIECE_CHARS} and {MAX_VOCAB_CHARS})")
    types = meta.get("tokenizer.ggml.token_type") or []
    if not isinstance(types, list) or (types and len(types) != len(tokens)):
        raise FormatError(f"{where}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in types):
        raise FormatError(f"{where}: tokenizer.ggml.token_type must be a list of integers")

    def special(key: str) -> str | None:
        i = meta.get(f"tokenizer.ggml.{key}_token_id")
        if i is None:
            return None
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(tokens):
            raise FormatError(f"{where}: tokenizer.ggml.{key}_token_id = {i!r} is outside the vocabulary")
        return tokens[i]

    bos, eos, unk, pad = special("bos"), special("eos"), special("unknown"), special("padding")
    add_bos = meta.get("tokenizer.ggml.add_bos_token")
    add_eos = bool(meta.get("tokenizer.ggml.add_eos_token", False))

    if model == "gpt2":
        merges = meta.get("tokenizer.ggml.merges")
        if not isinstance(merges, list) or not all(isinstance(m, str) and m.count(" ") == 1 for m in merges):
            raise FormatError(f"{where}: byte-level (gpt2) vocabulary without tokenizer.ggml.merges (a list of "
                              "'left right' strings)")
        tk = _byte_level(tokens, merges, meta.get("tokenizer.ggml.pre"))
        add_bos = bool(add_bos)
    elif model == "llama":
        scores = meta.get("tokenizer.ggml.scores")
        gemma = str(arch).startswith("gemma")
        if not gemma and (not isinstance(scores, list) or len(scores) != len(tokens)
                          or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in scores)):
            raise FormatError(f"{where}: SentencePiece (llama) vocabulary without one score per token")
        prefix = bool(meta.get("tokenizer.ggml.add_space_prefix", True)) and not gemma
        tk = _sentencepiece(tokens, scores, gemma, prefix, unk, phi3=arch == "phi3")
        add_bos = True if add_bos is None else bool(add_bos)  # llama.cpp's default for SentencePiece
    else:
        raise UnsupportedError(f"{where}: tokenizer model {model!r} is not supported (gpt2, llama)")

    # Control pieces become special tokens (kept whole, skipped by decode(skip_special_tokens));
    # user-defined pieces are matched whole but are not special.
    vocab = tk.get_vocab()
    alphabet = set(bytes_to_unicode().values()) if model == "gpt2" else None
    control = [AddedToken(t, normalized=False, special=True) for t, ty in zip(tokens, types)
               if ty == CONTROL and (alphabet is None or set(t) <= alphabet)]
    named = [t for t in (bos, eos, unk, pad) if t is not None and t in vocab]
    control += [AddedToken(t, normalized=False, special=True) for t in named]
    tk.add_special_tokens(control)
    user = [AddedToken(t, normalized=False, special=False) for t, ty in zip(tokens, types)
            if ty == USER_DEFINED and t in vocab]
    if user:
        tk.add_tokens(user)

    single, pair, specials = "$A:0", "$A:0 $B:1", []
    if add_bos and bos is not None:
        single, pair = f"{bos}:0 {single}", f"{bos}:0 $A:0 {bos}:1 $B:1"
        specials.append((bos, tk.token_to_id(bos)))
    if add_eos and eos is not None:
        single += f" {eos}:0"
        pair = pair.replace("$A:0", f"$A:0 {eos}:0").replace("$B:1", f"$B:1 {eos}:1")
        specials.append((eos, tk.token_to_id(eos)))
    tk.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)

    eos_tokens = [eos] if eos else []
    for key in ("eot", "eom"):
        t = special(key)
        if t and t not in eos_tokens:
            eos_tokens.append(t)
    control_set = {t for t, ty in zip(tokens, types) if ty == CONTROL} if types else set()
    for t in END_OF_TURN:
        if t in control_set and t not in eos_tokens:
            eos_tokens.append(t)
    extra = {k: v for k, v in (("unk_token", unk), ("pad_token", pad)) if v is not None}
    template = meta.get("tokenizer.chat_template")
    if template is not None and not isinstance(template, str):
        raise FormatError(f"{where}: tokenizer.chat_template must be a string")
    return Tokenizer(tk, bos_token=bos, eos_tokens=eos_tokens, chat_template=template or None,
                     extra_special=extra, source=where)
