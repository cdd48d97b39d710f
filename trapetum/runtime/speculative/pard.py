"""PARD, target-independent mode (arXiv 2504.18583; the PARD-2 drafters of arXiv 2605.08632 run the same way
without target features): a drafter trained to predict K tokens at once proposes them in ONE forward over the new
real tokens plus K - 1 mask tokens.

Per round, with the last token at position p and the drafter's cache valid below ``valid`` (= the previous round's
p + 1: its mask rows are never valid): rows = the real tokens at valid .. p, then K - 1 copies of the mask token at
p + 1 .. p + K - 1, in one multi-row pass (more than 16 rows: the real tokens first, in passes of 16, then the
last K rows in one). Row p's argmax is draft 1 and mask row p + i's is draft i + 1 (sampling: drawn from those
rows' distributions, given to the loop as q). The mask rows' cache entries are overwritten by the next round's real
tokens, so nothing is copied or rolled back.

Pipelined (``propose_at``, pipeline.py): the previous round's emitted tokens are known only on the device, n + 1
of the L = k_prev + 1 rows of ``new``; the pass runs a fixed L + K - 1 rows at base = the previous round's p + 1
(host-known): ``new`` with every row past n replaced by the mask token, then K - 1 masks, so rows n .. n + K - 1
are the last real token and K - 1 masks after it whatever n is; the drafts are gathered from those rows on the
device. The extra mask rows past n + K - 1 write cache rows that the next round's pass (from the new p + 1)
rewrites before reading. The rows are the synchronous pass's rows 0 .. n + K - 1, bitwise.

The mask token id: PARD checkpoints name it ``pard_token`` in config.json (``mask_token_id`` resolves it).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from ...errors import ConfigError
from ..sampling import GenerationSettings
from .draft_model import pending_tokens
from ...models.batch import MAX_VERIFY_ROWS
from .drafter import Draft, DeviceContext, DraftContext, Drafter, draft_sampler, sample_rows
from .rows import Rows


def mask_token_id(ckpt, explicit: int | None = None) -> int:
    """The PARD mask token of a drafter checkpoint: ``explicit`` when given, else ``pard_token`` from the
    checkpoint's metadata (a .cbk written with it) or from config.json beside a Hugging Face directory."""
    if explicit is not None:
        tok = explicit
    else:
        tok = (ckpt.meta or {}).get("pard_token")
        src = Path(str(ckpt.source))
        cfg = src / "config.json" if src.is_dir() else None
        if tok is None and cfg is not None and cfg.is_file():
            try:
                tok = json.loads(cfg.read_text()).get("pard_token")
            except (OSError, ValueError) as e:
                raise ConfigError(f"{cfg}: cannot read pard_token ({e})") from None
        if tok is None:
            raise ConfigError(f"{ckpt.source}: no PARD mask token (config.json has no 'pard_token'); "
                              "give it explicitly (draft_mask_token=ID)")
    if isinstance(tok, bool) or not isinstance(tok, int) or not 0 <= tok < ckpt.config.vocab_size:
        raise ConfigError(f"{ckpt.source}: PARD mask token must be a token id below the drafter's vocabulary of "
                          f"{ckpt.config.vocab_size}, got {tok!r}")
    return tok


class PardDrafter(Drafter):
    name = "pard"

    def __init__(self, rows: Rows, mask_token: int):
        if not 0 <= mask_token < rows.vocab_size:
            raise ValueError(f"mask_token {mask_token} outside the drafter's vocabulary of {rows.vocab_size}")
        self.rows = rows
        self.mask_token = mask_token
        self.masks = torch.full((16,), mask_token, dtype=torch.long, device=rows.device)
        self.ar = torch.arange(16, device=rows.device)

    @property
    def host_free(self) -> bool:
        return self.rows.device_positions

    def begin(self, prompt: list[int], s: GenerationSettings, max_len: int, target_vocab: int, device) -> None:
        super().begin(prompt, s, max_len, target_vocab, device)
        self.cap = min(max_len, self.rows.max_len)
        self.off = len(prompt) >= self.cap
        self.sampler = draft_sampler(s, target_vocab, self.rows.device)
        self.valid = len(prompt)
        if not self.off:
            self.rows.prefill(prompt, self.cap)

    def propose(self, ctx: DraftContext, k: int) -> Draft | None:
        if self.off:
            return None
        p = ctx.pos
        k = min(k, self.cap - p, len(self.masks))  # mask rows reach p + k - 1
        if k <= 0:
            return None
        pend = pending_tokens(ctx, self.valid).to(self.rows.device)
        toks = torch.cat([pend, self.masks[:k - 1]]) if k > 1 else pend
        logits, greedy = self.rows.rows(toks, self.valid)
        self.valid = p + 1
        if self.sampler is None:
            return Draft(greedy[-k:].clamp(max=self.target_vocab - 1))
        t, q = sample_rows(self.sampler, logits[-k:], self.target_vocab)
        return Draft(t, q)

    def propose_at(self, ctx: DeviceContext, k: int) -> Draft | None:
        if self.off:
            return None
        if ctx.hi >= self.cap:  # the real rows would pass the drafter's cache: no drafts from here on
            self.off = True
            return None
        mk = max(0, min(k, self.cap - ctx.hi, MAX_VERIFY_ROWS))  # mask rows reach hi + mk - 1
        L = ctx.new.shape[0]
        n = ctx.n.to(self.rows.device)
        real = torch.where(self.ar[:L] <= n, ctx.new.to(self.rows.device), self.masks[:L])
        toks = torch.cat([real, self.masks[:mk - 1]]) if mk > 1 else real
        logits, greedy = self.rows.rows_all(toks, ctx.base, logits=self.sampler is not None)
        if mk == 0:  # the catch-up alone (the cache stays valid below the next round's base)
            return None
        idx = n + self.ar[:mk]
        if self.sampler is None:
            return Draft(greedy.index_select(0, idx).clamp(max=self.target_vocab - 1))
        t, q = sample_rows(self.sampler, logits.index_select(0, idx), self.target_vocab)
        return Draft(t, q)
