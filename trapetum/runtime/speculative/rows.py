"""Position-addressed row forwards of one sequence: the one interface the speculative loop and the model drafters
use, over the GPU engine or the CPU reference decoder.

    prefill(prompt, max_len) -> logits fp32 [V]     a fresh sequence: the prompt at 0 .. T-1 into the KV cache
                                                    (the same prefill the model's plain Runner runs)
    rows(tokens [M], base)   -> (logits [m, V], greedy [m])
                                 M rows at base .. base + M - 1 (any M: passes of at most 16 rows); the logits and
                                 argmax of the LAST m = min(M, 16) rows; every row bitwise the decode step at its
                                 position (VERIFY mode), so a row's result does not depend on how rows are grouped
    greedy_steps(first [1], pos, n, out [n])       n decode steps from ``first`` at ``pos``, each feeding its argmax
                                                    to the next; the n argmaxes go into ``out`` (on the device)
    step(token [1], pos) -> logits [V]              one decode step
    rows_all(tokens [M], base) -> (logits [M, V] | None, greedy [M])
                                 ``rows`` with every row's output (passes past the first 16 rows copied out)
The pipelined loop (pipeline.py) uses the same forwards with the position in a device tensor ``at`` (one int
element; nothing read back): ``rows_at(tokens [m <= 16], at)``, ``step_at(token, at)``,
``greedy_steps_at(first, at, n, out)``. ``device_positions``: the rows read ``at`` on the device (the GPU engine's
graphs); the reference reads it with int() (free on the CPU, so tests can run the pipelined loop there).

Both caches are addressed by position: a row written at p stays until another forward writes p, and a forward
reads only positions up to its own, so discarding rows (a rejected draft) needs no copy. Tensors returned are views
valid until the next forward of the same object. Nothing here reads a value back to the host.
"""
from __future__ import annotations

import torch

from ...models.batch import MAX_VERIFY_ROWS, Mode


class Rows:
    """Shared chunking; subclasses give ``_pass(tokens [m <= 16], base) -> (logits [m, V], greedy [m])``."""

    vocab_size: int
    device: torch.device
    max_len: int  # positions the KV cache holds
    device_positions = False

    def prefill(self, prompt: list[int], max_len: int) -> torch.Tensor:
        raise NotImplementedError

    def _pass(self, tokens: torch.Tensor, base: int) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def rows(self, tokens: torch.Tensor, base: int) -> tuple[torch.Tensor, torch.Tensor]:
        m = int(tokens.shape[0])
        if m < 1:
            raise ValueError("rows: at least one token")
        if base < 0 or base + m > self.max_len:
            raise ValueError(f"rows {base}..{base + m - 1} outside the KV cache of {self.max_len}")
        last = min(m, MAX_VERIFY_ROWS)
        head = m - last
        for i in range(0, head, MAX_VERIFY_ROWS):
            j = min(i + MAX_VERIFY_ROWS, head)
            self._pass(tokens[i:j], base + i)
        return self._pass(tokens[head:], base + head)

    def step(self, token: torch.Tensor, pos: int) -> torch.Tensor:
        return self._pass(token.view(1), pos)[0][0]

    def greedy_steps(self, first: torch.Tensor, pos: int, n: int, out: torch.Tensor) -> None:
        tok = first.view(1)
        for i in range(n):
            _, g = self._pass(tok, pos + i)
            out[i:i + 1].copy_(g[:1])
            tok = out[i:i + 1]

    def rows_all(self, tokens: torch.Tensor, base: int, logits: bool = False):
        """(logits [M, V] fp32 or None, greedy [M]) of rows ``tokens`` [M] at base .. base + M - 1 (any M);
        M <= 16: views of the one pass; more: the earlier passes' outputs copied out as they come."""
        m = int(tokens.shape[0])
        if m <= MAX_VERIFY_ROWS:
            lg, g = self.rows(tokens, base)
            return (lg if logits else None), g
        lgs, gs = [], []
        for i in range(0, m, MAX_VERIFY_ROWS):
            lg, g = self.rows(tokens[i:i + MAX_VERIFY_ROWS], base + i)
            gs.append(g.clone())
            if logits:
                lgs.append(lg.clone())
        return (torch.cat(lgs) if logits else None), torch.cat(gs)

    # -- device positions (the pipelined loop) ----------------------------------------------------
    def rows_at(self, tokens: torch.Tensor, at: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self._pass(tokens, int(at))

    def step_at(self, token: torch.Tensor, at: torch.Tensor) -> torch.Tensor:
        return self.step(token, int(at))

    def greedy_steps_at(self, first: torch.Tensor, at: torch.Tensor, n: int, out: torch.Tensor) -> None:
        self.greedy_steps(first, int(at), n, out)


class EngineRows(Rows):
    """Over a GpuEngine: verify passes (CUDA graphs per row count) and greedy decode steps whose argmax stays in the
    engine's ``token`` buffer between steps."""

    device_positions = True

    def __init__(self, engine):
        self.engine = engine
        self.vocab_size = engine.cfg.vocab_size
        self.device = engine.device
        self.max_len = engine.max_len

    def prefill(self, prompt: list[int], max_len: int) -> torch.Tensor:
        if max_len > self.engine.max_len:
            raise ValueError(f"{max_len} positions exceed the engine's KV cache of {self.engine.max_len}")
        return self.engine.prefill(prompt)

    def _pass(self, tokens, base):
        logits = self.engine.verify(tokens, base)
        return logits, self.engine.argmax_rows[:logits.shape[0]]

    def step(self, token, pos):
        self.engine.set_position(token, pos)
        self.engine.step(greedy=False)
        return self.engine.logits

    def greedy_steps(self, first, pos, n, out):
        if n <= 0:
            return
        eng = self.engine
        eng.set_position(first, pos)
        for i in range(n):
            eng.step(greedy=True)  # reads token at pos, writes its argmax into token, pos += 1
            out[i:i + 1].copy_(eng.token)

    def rows_at(self, tokens, at):
        logits = self.engine.verify_at(tokens, at)
        return logits, self.engine.argmax_rows[:logits.shape[0]]

    def step_at(self, token, at):
        eng = self.engine
        eng.token.copy_(token.view(1))
        eng.pos.copy_(at.view(1))
        eng.step(greedy=False)
        return eng.logits

    def greedy_steps_at(self, first, at, n, out):
        if n <= 0:
            return
        eng = self.engine
        eng.token.copy_(first.view(1))
        eng.pos.copy_(at.view(1))
        for i in range(n):
            eng.step(greedy=True)
            out[i:i + 1].copy_(eng.token)


class ReferenceRows(Rows):
    """Over the torch reference Decoder and a KVCache of its own (VERIFY mode: rows one by one, each bitwise the
    one-token forward the plain ReferenceRunner runs)."""

    def __init__(self, decoder, max_len: int | None = None):
        self.decoder = decoder
        self.vocab_size = decoder.config.vocab_size
        self.device = next(decoder.parameters()).device
        self.max_len = max_len or decoder.config.context_length
        self.cache = None

    def prefill(self, prompt: list[int], max_len: int) -> torch.Tensor:
        if max_len > self.max_len:
            raise ValueError(f"{max_len} positions exceed the context of {self.max_len}")
        self.cache = self.decoder.new_cache(1, max_len)
        self.cache_len = max_len
        ids = torch.tensor([prompt], dtype=torch.long, device=self.device)
        return self.decoder(ids, self.cache, 0, last_only=True)[0, -1]

    def rows(self, tokens, base):
        if self.cache is None:
            raise ValueError("rows before prefill")
        if base + int(tokens.shape[0]) > self.cache_len:
            raise ValueError(f"rows {base}..{base + int(tokens.shape[0]) - 1} outside the KV cache of {self.cache_len}")
        return super().rows(tokens, base)

    def _pass(self, tokens, base):
        t = tokens.to(device=self.device, dtype=torch.long).view(1, -1)
        logits = self.decoder(t, self.cache, base, mode=Mode.VERIFY)[0]
        return logits, torch.argmax(logits, -1)


def model_rows(engine=None, decoder=None, max_len: int | None = None) -> Rows:
    """EngineRows over ``engine`` when given, else ReferenceRows over ``decoder``."""
    if engine is not None:
        return EngineRows(engine)
    return ReferenceRows(decoder, max_len)
