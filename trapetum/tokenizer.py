"""Tokenizer: a ``tokenizers.Tokenizer`` plus BOS/EOS ids and the chat template.

Every loader (HF directory, GGUF vocabulary, .cbk) builds one of these; BOS is added by the
``tokenizers`` post-processor when the model wants it, so there is one way to encode.
"""
from __future__ import annotations

import json
from datetime import datetime
from typing import Any, Iterable

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from .errors import TrapetumError


class ChatTemplateError(TrapetumError):
    pass


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators=None,
            sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise(message: str) -> None:
    raise ChatTemplateError(f"chat template: {message}")


def compile_chat_template(source: str) -> jinja2.Template:
    """Compile a chat template the way Hugging Face transformers does (same env flags and helpers)."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except jinja2.TemplateError as e:
        raise ChatTemplateError(f"chat template does not compile: {e}") from None


class Tokenizer:
    def __init__(self, tk: HFTokenizer, *, bos_token: str | None, eos_tokens: list[str],
                 chat_template: str | None = None, extra_special: dict[str, str] | None = None):
        self.tk = tk
        self.bos_token = bos_token
        self.eos_tokens = [t for t in eos_tokens if t is not None]
        self.bos_id = tk.token_to_id(bos_token) if bos_token else None
        self.eos_ids = sorted({i for i in (tk.token_to_id(t) for t in self.eos_tokens) if i is not None})
        self.chat_template = chat_template
        self.extra_special = dict(extra_special or {})  # e.g. {"pad_token": "<pad>", "unk_token": "<unk>"}
        self._template: jinja2.Template | None = None

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
    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """Render messages to the prompt string (same result as transformers' apply_chat_template)."""
        if not self.chat_template:
            raise ChatTemplateError("this model has no chat template; use generate with a plain prompt")
        if self._template is None:
            self._template = compile_chat_template(self.chat_template)
        ctx = dict(self.extra_special)
        ctx.update(bos_token=self.bos_token or "", eos_token=self.eos_tokens[0] if self.eos_tokens else "")
        ctx.update(kwargs)
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         tools=None, documents=None, **ctx)
        except jinja2.TemplateError as e:
            raise ChatTemplateError(f"chat template failed to render: {e}") from None

    def encode_chat(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[int]:
        # The template writes BOS itself, so no special tokens are added on top (as in transformers).
        return self.encode(self.apply_chat_template(messages, add_generation_prompt), add_special_tokens=False)

    # -- (de)serialization for .cbk ----------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {"tokenizer_json": self.tk.to_str(), "bos_token": self.bos_token, "eos_tokens": self.eos_tokens,
                "chat_template": self.chat_template, "extra_special": self.extra_special}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Tokenizer":
        return cls(HFTokenizer.from_str(d["tokenizer_json"]), bos_token=d.get("bos_token"),
                   eos_tokens=list(d.get("eos_tokens") or []), chat_template=d.get("chat_template"),
                   extra_special=d.get("extra_special") or {})


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
