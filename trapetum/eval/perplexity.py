"""Perplexity harness: mean NLL over every predicted token of non-overlapping windows.

Protocol (printed with every result):
* the text file is read whole (UTF-8) and tokenized once, as one stream, *without* special
  tokens (no BOS/EOS are inserted by the tokenizer);
* the stream is cut into consecutive, non-overlapping windows of ``ctx`` tokens; the tail that
  does not fill a window is dropped; ``windows`` takes the first N of them (or all);
* BOS handling, default ``bos=False``: each window is fed as is and its first token is context
  only, so a window scores ``ctx - 1`` tokens (16 windows x 2048 -> 32,752 tokens).
  With ``bos=True`` the model's BOS id is put in front of ``ctx - 1`` text tokens and all of them
  are scored (windows then hold ``ctx - 1`` text tokens each, ``ctx`` positions with BOS);
* NLL is the mean over all scored tokens of all windows, in nats, accumulated in float64;
  PPL = exp(NLL).

``decode=True`` scores the same windows token by token through the decoder's KV cache (one
position per forward); in fp32 it must equal the prefill NLL within 1e-4 nats.

Greedy agreement, the harness's second figure: ``greedy_tokens`` continues a prompt greedily on the reference
decoder; ``agreement`` counts, per prompt, the leading tokens two continuations share.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from ..errors import TrapetumError

__all__ = ["PPLResult", "tokenize_file", "make_windows", "window_nll", "perplexity"]


@dataclass
class PPLResult:
    nll: float  # mean NLL per scored token, nats
    tokens: int  # scored tokens
    windows: int
    ctx: int
    bos: bool
    mode: str  # "prefill" | "decode"
    nll_per_window: list[float]

    @property
    def ppl(self) -> float:
        return math.exp(self.nll)

    def line(self) -> str:
        return f"PPL {self.ppl:.2f}  NLL {self.nll:.4f}  {self.tokens} tokens  {self.windows} windows x {self.ctx}"

    def protocol(self) -> str:
        bos = ("BOS + ctx-1 text tokens per window, all text tokens scored" if self.bos
               else "no BOS, first token of each window is context only")
        return (f"{self.mode}; non-overlapping windows of {self.ctx}; text tokenized as one stream without "
                f"special tokens; {bos}; mean NLL over every scored token")


def tokenize_file(tokenizer, path: str | Path) -> torch.Tensor:
    """Token ids of a whole text file (no special tokens), int64 [N]."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as e:
        raise TrapetumError(f"cannot read text file {path}: {e.strerror or e}") from None
    if tokenizer is None:
        raise TrapetumError("this model has no tokenizer, so it cannot score a text file")
    return torch.tensor(tokenizer.encode(text, add_special_tokens=False), dtype=torch.long)


def make_windows(ids: torch.Tensor, ctx: int, windows: int | None = None, bos_id: int | None = None) -> torch.Tensor:
    """[W, ctx] windows of the stream (first ``windows`` or all full ones); with ``bos_id`` each
    window is BOS followed by ctx-1 text tokens."""
    if ctx < 2:
        raise TrapetumError(f"--ctx must be at least 2, got {ctx}")
    step = ctx - 1 if bos_id is not None else ctx
    n_full = ids.numel() // step
    if n_full == 0:
        raise TrapetumError(f"the text has {ids.numel()} tokens, fewer than one window of {ctx}")
    n = n_full if windows is None else min(int(windows), n_full)
    if n <= 0:
        raise TrapetumError(f"--windows must be positive, got {windows}")
    w = ids[: n * step].view(n, step)
    if bos_id is not None:
        w = torch.cat([torch.full((n, 1), bos_id, dtype=w.dtype), w], 1)
    return w


@torch.inference_mode()
def window_nll(model, window: torch.Tensor, decode: bool = False) -> tuple[float, int]:
    """Sum of NLL (float64) and count of predicted tokens for one window [T] (all but the first).

    ``model`` is a Decoder (torch reference path) or the GPU engine (anything with ``logits_for``)."""
    if hasattr(model, "logits_for"):
        tok = window.to(model.device)
        logits = model.logits_for(tok, decode=decode)  # [T, V] float32
        nll = F.cross_entropy(logits[:-1].float(), tok[1:], reduction="sum")
        return float(nll.double()), tok.numel() - 1
    decoder = model
    dev = next(iter(decoder.buffers()), None)
    p = next(iter(decoder.parameters()), None)
    device = (p if p is not None else dev).device
    tok = window.to(device).view(1, -1)
    T = tok.shape[1]
    if not decode:
        logits = decoder(tok)  # [1, T, V] float32
        nll = F.cross_entropy(logits[0, :-1].float(), tok[0, 1:], reduction="sum", )
        return float(nll.double()), T - 1
    cache = decoder.new_cache(batch=1, max_len=T)
    total = torch.zeros((), dtype=torch.float64, device=device)
    for t in range(T - 1):
        logits = decoder(tok[:, t:t + 1], cache=cache, start_pos=t)  # [1, 1, V]
        total += F.cross_entropy(logits[0, -1:].float(), tok[0, t + 1:t + 2], reduction="sum").double()
    return float(total), T - 1


def perplexity(decoder, ids: torch.Tensor, ctx: int = 2048, windows: int | None = None, *, decode: bool = False,
               bos_id: int | None = None, progress: bool = True, desc: str = "ppl") -> PPLResult:
    """Score the first ``windows`` (None = all) non-overlapping windows of ``ids``; see module doc."""
    W = make_windows(ids, ctx, windows, bos_id)
    total, count, per = 0.0, 0, []
    it = range(W.shape[0])
    if progress:
        from tqdm import tqdm
        it = tqdm(it, desc=desc, unit="win", leave=False, dynamic_ncols=True)
    for i in it:
        s, n = window_nll(decoder, W[i], decode=decode)
        total += s
        count += n
        per.append(s / n)
        if progress:
            it.set_postfix(ppl=f"{math.exp(total / count):.3f}")
    return PPLResult(total / count, count, W.shape[0], ctx, bos_id is not None,
                     "decode" if decode else "prefill", per)


@torch.inference_mode()
def greedy_tokens(decoder, ids: list[int], n: int) -> list[int]:
    """``n`` greedy tokens after ``ids`` on a reference decoder (prefill, then one token per forward)."""
    dev = next(decoder.parameters()).device
    cache = decoder.new_cache(batch=1, max_len=len(ids) + n)
    logits = decoder(torch.tensor([ids], device=dev), cache=cache, start_pos=0)[:, -1]
    out = []
    for i in range(n):
        t = int(logits.argmax(-1))
        out.append(t)
        logits = decoder(torch.tensor([[t]], device=dev), cache=cache, start_pos=len(ids) + i)[:, -1]
    return out


def agreement(a: list[list[int]], b: list[list[int]]) -> tuple[int, int]:
    """(tokens of ``a``'s continuations that agree with ``b``'s up to their first difference, tokens of ``a``)."""
    same = 0
    for x, y in zip(a, b):
        for u, v in zip(x, y):
            if u != v:
                break
            same += 1
    return same, sum(len(x) for x in a)
