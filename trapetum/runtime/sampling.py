"""Token choice from logits: repetition penalty, temperature, top-k, top-p, min-p (HF order)."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import TrapetumError


@dataclass
class GenerationSettings:
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False

    def validate(self) -> "GenerationSettings":
        def bad(name: str, msg: str) -> None:
            raise TrapetumError(f"{name}: {msg}, got {getattr(self, name)!r}")

        def num(name: str) -> float:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v:
                bad(name, "must be a number")
            return v

        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0:
            bad("max_new_tokens", "must be a non-negative integer")
        if num("temperature") < 0 or self.temperature > 100:
            bad("temperature", "must be in [0, 100]")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            bad("top_k", "must be a non-negative integer")
        if not 0 < num("top_p") <= 1:
            bad("top_p", "must be in (0, 1]")
        if not 0 <= num("min_p") <= 1:
            bad("min_p", "must be in [0, 1]")
        if not 0 < num("repetition_penalty") <= 100:
            bad("repetition_penalty", "must be in (0, 100]")
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, int)):
            bad("seed", "must be an integer")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "must be a list of non-empty strings")
        return self


class Sampler:
    """Chooses tokens from logits on the logits' device, without reading anything back to the host.

    The repetition penalty uses a device mask of the tokens seen so far (prompt + generated),
    updated from the chosen token tensor, so a GPU engine can sample with no host sync.
    """

    def __init__(self, s: GenerationSettings, vocab_size: int, device: str | torch.device = "cpu",
                 prompt: list[int] | None = None):
        self.s = s
        self.gen = torch.Generator(device=device)
        if s.seed is not None:
            self.gen.manual_seed(s.seed)
        else:
            self.gen.seed()
        self.seen = None
        if s.repetition_penalty != 1.0:
            self.seen = torch.zeros(vocab_size, dtype=torch.bool, device=device)
            if prompt:
                self.seen[torch.tensor(prompt, device=device)] = True

    def __call__(self, logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """logits [V] -> token id tensor [1] (written into ``out`` when given)."""
        s = self.s
        logits = logits.float()
        if self.seen is not None:
            pen = torch.where(logits > 0, logits / s.repetition_penalty, logits * s.repetition_penalty)
            logits = torch.where(self.seen, pen, logits)
        if s.temperature == 0:
            tok = torch.argmax(logits).view(1)
        else:
            logits = logits / s.temperature
            if s.top_k and s.top_k < logits.numel():
                kth = torch.topk(logits, s.top_k).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            if s.top_p < 1.0:
                sorted_logits, order = torch.sort(logits, descending=False)
                cum = torch.softmax(sorted_logits, -1).cumsum(-1)
                remove = cum <= (1 - s.top_p)
                remove[-1] = False
                logits = logits.masked_fill(remove.scatter(0, order, remove), float("-inf"))
            probs = torch.softmax(logits, -1)
            if s.min_p > 0:
                probs = probs.masked_fill(probs < s.min_p * probs.max(), 0.0)
            tok = torch.multinomial(probs, 1, generator=self.gen)
        if self.seen is not None:
            self.seen.index_fill_(0, tok, True)
        if out is not None:
            out.copy_(tok)
            return out
        return tok
