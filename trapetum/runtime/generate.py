"""The generation loop: prefill, then decode token by token, streaming text pieces.

It drives any *runner* with ``tokens(prompt_ids, settings, max_len) -> Iterator[int]`` (the Runner protocol): the
CPU reference runner below, or the GPU engine (runtime/engine.py). Stop strings never leak into the output.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Iterator, Protocol

import torch

from ..errors import TrapetumError
from ..models.decoder import Decoder
from ..tokenizer import StreamDecoder, Tokenizer
from .sampling import GenerationSettings, Sampler


class ContextOverflow(TrapetumError):
    def __init__(self, prompt_tokens: int, max_new_tokens: int, context: int):
        self.prompt_tokens, self.max_new_tokens, self.context = prompt_tokens, max_new_tokens, context
        super().__init__(f"prompt of {prompt_tokens} tokens plus max_new_tokens {max_new_tokens} exceeds the "
                         f"context size of {context} tokens")


class Runner(Protocol):
    def tokens(self, prompt: list[int], s: GenerationSettings, max_len: int) -> Iterator[int]:
        """Yield sampled token ids after ``prompt``; the caller closes the iterator to stop."""
        ...


class ReferenceRunner:
    """Torch reference path: the Decoder with a static KV cache, sampling on the host."""

    def __init__(self, decoder: Decoder):
        self.decoder = decoder

    @torch.inference_mode()
    def tokens(self, prompt: list[int], s: GenerationSettings, max_len: int) -> Iterator[int]:
        dev = next(self.decoder.parameters()).device
        cache = self.decoder.new_cache(1, max_len)
        sampler = Sampler(s, self.decoder.config.vocab_size, dev, prompt)
        logits = self.decoder(torch.tensor([prompt], dtype=torch.long, device=dev), cache, 0, last_only=True)
        pos = len(prompt)
        while True:
            tok = int(sampler(logits[0, -1]))
            yield tok
            if pos >= max_len:
                return
            logits = self.decoder(torch.tensor([[tok]], dtype=torch.long, device=dev), cache, pos)
            pos += 1


@dataclass
class Completion:
    text: str
    token_ids: list[int]
    finish_reason: str  # "stop" | "length" | "cancelled"
    prompt_tokens: int
    completion_tokens: int
    ttft_s: float = 0.0
    tokens_per_s: float = 0.0


@dataclass
class StreamEvent:
    text: str
    token_id: int | None = None
    done: bool = False
    completion: Completion | None = None


@dataclass
class _StopScan:
    stops: list[str]
    text: str = ""
    emitted: int = 0
    hit: bool = False

    def feed(self, piece: str) -> str:
        """Add text; return what can safely be emitted (never part of a stop string)."""
        self.text += piece
        if not self.stops:
            out, self.emitted = self.text[self.emitted:], len(self.text)
            return out
        longest = max(len(s) for s in self.stops)
        lo = max(0, self.emitted - longest)
        cut = min((i for i in (self.text.find(s, lo) for s in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            self.hit = True
            self.text = self.text[:cut]
            out = self.text[self.emitted:] if cut > self.emitted else ""
            self.emitted = len(self.text)
            return out
        hold = 0  # longest tail that could still grow into a stop string
        for s in self.stops:
            for k in range(min(len(s) - 1, len(self.text)), 0, -1):
                if self.text.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        end = max(self.emitted, len(self.text) - hold)
        out, self.emitted = self.text[self.emitted:end], end
        return out

    def flush(self) -> str:
        out, self.emitted = self.text[self.emitted:], len(self.text)
        return out


class TokenStream:
    """One request's output as tokens arrive: EOS, stop strings (never leaked), max_new_tokens, the streamed text
    pieces and the final Completion. ``push(tok)`` returns the StreamEvents that token releases and sets
    ``finish`` ("stop" | "length") when the request is done; ``close(finish)`` returns the tail and the done
    event. Both the one-request loop (``stream_tokens``) and the batch scheduler (runtime/scheduler.py) use it."""

    def __init__(self, tokenizer: Tokenizer | None, prompt: list[int], s: GenerationSettings,
                 t0: float | None = None):
        self.s, self.prompt_tokens = s, len(prompt)
        self.eos = set() if (s.ignore_eos or tokenizer is None) else set(tokenizer.eos_ids)
        self.dec = StreamDecoder(tokenizer) if tokenizer is not None else None
        self.scan = _StopScan(list(s.stop))
        self.out: list[int] = []
        self.t0 = time.perf_counter() if t0 is None else t0
        self.t_first: float | None = None
        self.finish: str | None = None

    def push(self, tok: int) -> list[StreamEvent]:
        if self.t_first is None:
            self.t_first = time.perf_counter()
        if tok in self.eos:
            self.finish = "stop"
            return []
        self.out.append(tok)
        piece = self.scan.feed(self.dec.push(tok)) if self.dec is not None else ""
        if self.scan.hit:
            self.finish = "stop"
            return [StreamEvent(piece, tok)] if piece else []
        if len(self.out) >= self.s.max_new_tokens:
            self.finish = "length"
        return [StreamEvent(piece, tok)]

    def close(self, finish: str | None = None) -> list[StreamEvent]:
        """The tail text (if any) and the done event; ``finish`` overrides (e.g. "cancelled"); default "length"."""
        events = []
        dec, scan = self.dec, self.scan
        if dec is not None and not scan.hit:
            tail = scan.feed(dec.flush())
            tail += "" if scan.hit else scan.flush()
            if tail:
                events.append(StreamEvent(tail, None))
        finish = finish or self.finish or "length"
        t_end = time.perf_counter()
        t_first, out = self.t_first, self.out
        ttft = (t_first or t_end) - self.t0
        rate = (len(out) - 1) / (t_end - t_first) if t_first and len(out) > 1 and t_end > t_first else 0.0
        text = scan.text if dec is not None else ""
        comp = Completion(text, list(out), finish, self.prompt_tokens, len(out), ttft, rate)
        events.append(StreamEvent("", None, done=True, completion=comp))
        return events


def check_request(prompt: list[int], s: GenerationSettings, context_size: int) -> None:
    """Settings valid, prompt non-empty, prompt + max_new_tokens within the context (TrapetumError otherwise)."""
    s.validate()
    if not prompt:
        raise TrapetumError("prompt is empty (no tokens)")
    if len(prompt) + s.max_new_tokens > context_size:
        raise ContextOverflow(len(prompt), s.max_new_tokens, context_size)


def stream_tokens(runner: Runner, tokenizer: Tokenizer | None, prompt: list[int], s: GenerationSettings,
                  context_size: int, cancel: threading.Event | None = None) -> Iterator[StreamEvent]:
    """Yield text pieces as they are produced; the last event has done=True and the Completion."""
    check_request(prompt, s, context_size)
    ts = TokenStream(tokenizer, prompt, s)
    finish = None
    if cancel is not None and cancel.is_set():
        finish = "cancelled"
    elif s.max_new_tokens > 0:
        source = runner.tokens(prompt, s, len(prompt) + s.max_new_tokens)
        try:
            for tok in source:
                yield from ts.push(tok)
                if ts.finish is not None:
                    break
                if cancel is not None and cancel.is_set():
                    finish = "cancelled"
                    break
        finally:
            source.close()
    yield from ts.close(finish)
