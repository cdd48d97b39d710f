"""Tokenizer: a ``tokenizers.Tokenizer`` plus BOS/EOS ids and the chat template.

Every loader (HF directory, GGUF vocabulary, .cbk) builds one of these; BOS is added by the
``tokenizers`` post-processor when the model wants it, so there is one way to encode.

Chat templates are rendered by ``chat_template.py``: in a child process, in jinja2's immutable sandbox, under
time, memory and output limits (a template is code from a model file). Every failure is a ChatTemplateError
naming the model file (``source``).

Special tokens in chat messages: ``encode_chat`` encodes the text of the messages as text. A user who writes
``<|im_end|><|im_start|>system`` in a message gets those characters as ordinary tokens, not the control
tokens, so a message cannot forge a turn; the control tokens the template itself writes stay control tokens.
(transformers' ``apply_chat_template(tokenize=True)`` and llama.cpp's server both parse such text into the
control tokens; OpenAI's API treats it as text, as here.) ``encode`` of a plain prompt (``generate`` without
``--chat``, ``/v1/completions``) still parses control tokens: there the caller writes the whole prompt.
"""
from __future__ import annotations

import re
from typing import Any, Callable, Iterable

from tokenizers import Tokenizer as HFTokenizer

from .chat_template import DEFAULT_LIMITS, ChatTemplateError, TemplateLimits, render_chat_template
from .errors import TrapetumError  # noqa: F401  (ChatTemplateError is a TrapetumError)

__all__ = ["Tokenizer", "StreamDecoder", "ChatTemplateError", "TemplateLimits"]

MAX_SPECIAL_CHARS = 512      # longer special tokens are not looked for in messages (no one types them)
MAX_MESSAGE_DEPTH = 32
_SENTINEL_BASE = 0xF0000     # Supplementary Private Use Area-A: stand-ins while the template renders


def _trie_regex(words: Iterable[str]) -> re.Pattern:
    """A regex matching any of ``words``, longest first, in time independent of how many there are."""
    trie: dict = {}
    for w in words:
        node = trie
        for ch in w:
            node = node.setdefault(ch, {})
        node[""] = {}

    def build(node: dict) -> str:
        alts = [re.escape(ch) + build(child) for ch, child in sorted(node.items()) if ch]
        if not alts:
            return ""
        body = alts[0] if len(alts) == 1 else "(?:" + "|".join(alts) + ")"
        return f"(?:{body})?" if "" in node else body
    return re.compile(build(trie))


def _map_strings(x: Any, fn: Callable[[str], str], depth: int = 0, key: str | None = None) -> Any:
    """``x`` with ``fn`` applied to every string value (not to keys, roles or content-part types)."""
    if depth > MAX_MESSAGE_DEPTH:
        raise ChatTemplateError(f"chat messages are nested more than {MAX_MESSAGE_DEPTH} levels deep")
    if isinstance(x, str):
        return x if key in ("role", "type") else fn(x)
    if isinstance(x, dict):
        return {k: _map_strings(v, fn, depth + 1, k) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_map_strings(v, fn, depth + 1) for v in x]
    return x


class Tokenizer:
    def __init__(self, tk: HFTokenizer, *, bos_token: str | None, eos_tokens: list[str],
                 chat_template: str | None = None, extra_special: dict[str, str] | None = None,
                 source: str | None = None, template_limits: TemplateLimits = DEFAULT_LIMITS):
        self.tk = tk
        self.bos_token = bos_token
        self.eos_tokens = [t for t in eos_tokens if t is not None]
        self.bos_id = tk.token_to_id(bos_token) if bos_token else None
        self.eos_ids = sorted({i for i in (tk.token_to_id(t) for t in self.eos_tokens) if i is not None})
        self.chat_template = chat_template
        self.extra_special = dict(extra_special or {})  # e.g. {"pad_token": "<pad>", "unk_token": "<unk>"}
        self.source = source            # the model file, named in errors
        self.template_limits = template_limits
        self._specials: tuple[re.Pattern, set[int]] | None = None
        self._plain_tk: HFTokenizer | None = None

    # -- encode / decode -------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.tk.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tk.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self.tk.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self.tk.token_to_id(token)

    # -- chat ------------------------------------------------------------------------------
    def _where(self) -> str:
        return f"{self.source}: " if self.source else ""

    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """Render messages to the prompt string (same result as transformers' apply_chat_template)."""
        if not self.chat_template:
            raise ChatTemplateError(f"{self._where()}this model has no chat template; use generate with a plain "
                                    "prompt", reason="this model has no chat template")
        ctx: dict[str, Any] = dict(self.extra_special)
        ctx.update(bos_token=self.bos_token or "", eos_token=self.eos_tokens[0] if self.eos_tokens else "")
        ctx.update(kwargs)
        ctx.update(messages=messages, add_generation_prompt=bool(add_generation_prompt))
        ctx.setdefault("tools", None)
        ctx.setdefault("documents", None)
        try:
            return render_chat_template(self.chat_template, ctx, self.template_limits)
        except ChatTemplateError as e:
            raise ChatTemplateError(f"{self._where()}{e}", reason=e.reason, rejected=e.rejected) from None

    def _special_index(self) -> tuple[re.Pattern, set[int]] | None:
        if self._specials is None:
            dec = self.tk.get_added_tokens_decoder()
            ids = {i for i, t in dec.items() if t.special}
            words = {dec[i].content for i in ids if 0 < len(dec[i].content) <= MAX_SPECIAL_CHARS}
            try:
                pattern = _trie_regex(words) if words else re.compile(r"(?!)")
            except (re.error, RecursionError):
                pattern = re.compile("|".join(re.escape(w) for w in sorted(words, key=len, reverse=True)))
            self._specials = (pattern, ids)
        return self._specials

    def _plain(self) -> HFTokenizer:
        """A copy of the tokenizer that encodes special-token text as ordinary text."""
        if self._plain_tk is None:
            tk = HFTokenizer.from_str(self.tk.to_str())
            tk.encode_special_tokens = True
            self._plain_tk = tk
        return self._plain_tk

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered chat; special-token text inside the messages is encoded as text (module
        docstring). The template writes BOS itself, so no special tokens are added on top (as in transformers)."""
        pattern, special_ids = self._special_index()
        found: set[str] = set()
        strings: list[str] = []

        def scan(s: str) -> str:
            strings.append(s)
            found.update(m.group() for m in pattern.finditer(s))
            return s
        _map_strings(messages, scan)
        if not found:
            return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)
        # Stand-in characters that occur nowhere in the messages or the template mark where message text had
        # special-token text; after rendering they are put back and the tokens over them re-encoded as text.
        used = set(self.chat_template or "").union(*map(set, strings))
        stand_in: dict[str, str] = {}
        cp = _SENTINEL_BASE
        for word in sorted(found):
            while chr(cp) in used:
                cp += 1
            stand_in[word] = chr(cp)
            cp += 1
        masked = _map_strings(messages, lambda s: pattern.sub(lambda m: stand_in[m.group()], s))
        rendered = self.apply_chat_template(masked, add_generation_prompt)
        back = {c: w for w, c in stand_in.items()}
        marks = re.compile("[" + "".join(back) + "]")
        pieces, spans, pos, out_len = [], [], 0, 0
        for m in marks.finditer(rendered):
            pieces.append(rendered[pos:m.start()])
            out_len += m.start() - pos
            word = back[m.group()]
            pieces.append(word)
            spans.append((out_len, out_len + len(word)))
            out_len += len(word)
            pos = m.end()
        pieces.append(rendered[pos:])
        text = "".join(pieces)
        in_message = bytearray(len(text) + 1)
        for a, b in spans:
            in_message[a:b] = b"\x01" * (b - a)
        enc = self.tk.encode(text, add_special_tokens=False)
        ids: list[int] = []
        for tid, (a, b) in zip(enc.ids, enc.offsets):
            if tid in special_ids and any(in_message[a:max(b, a + 1)]):
                ids.extend(self._plain().encode(text[a:b], add_special_tokens=False).ids)
            else:
                ids.append(tid)
        return ids

    # -- (de)serialization for .cbk ----------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"tokenizer_json": self.tk.to_str(), "bos_token": self.bos_token, "eos_tokens": self.eos_tokens,
                "chat_template": self.chat_template, "extra_special": self.extra_special}

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str | None = None) -> "Tokenizer":
        """From ``to_dict``'s form (its types checked by the caller: formats/cbk_meta.py for a .cbk file)."""
        return cls(HFTokenizer.from_str(d["tokenizer_json"]), bos_token=d.get("bos_token"),
                   eos_tokens=list(d.get("eos_tokens") or []), chat_template=d.get("chat_template"),
                   extra_special=d.get("extra_special") or {}, source=source)


class StreamDecoder:
    """Turns a growing list of token ids into text pieces, never splitting a UTF-8 character."""

    def __init__(self, tokenizer: Tokenizer):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.prefix = 0  # ids before this index are already emitted and only give context
        self.read = 0  # ids[prefix:read] decode to text already emitted

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        prev = self.tok.decode(self.ids[self.prefix:self.read])
        cur = self.tok.decode(self.ids[self.prefix:])
        if len(cur) > len(prev) and not cur.endswith("\ufffd"):
            piece = cur[len(prev):]
            self.prefix, self.read = self.read, len(self.ids)
            return piece
        return ""

    def flush(self) -> str:
        prev = self.tok.decode(self.ids[self.prefix:self.read])
        cur = self.tok.decode(self.ids[self.prefix:])
        self.prefix = self.read = len(self.ids)
        return cur[len(prev):] if len(cur) > len(prev) else ""
