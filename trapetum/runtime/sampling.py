"""Token choice from logits: repetition penalty, temperature, top-k, top-p, min-p (HF order)."""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..errors import TrapetumError


# Sampling parameters are checked against what the float32 sampler can represent: logits / temperature and
# logits / repetition_penalty overflow to inf (and softmax to NaN) for tiny divisors (1e-45 is 0 in float32).
# A temperature below GREEDY_BELOW runs as greedy (temperature -> 0 is argmax: at 1e-5 a token 1e-4 below the
# best already has weight e^-10, and vLLM draws the same line); a repetition penalty must be at least
# MIN_REPETITION_PENALTY (0.01 multiplies repeated tokens' logits by 100, far past any use).
GREEDY_BELOW = 1e-5
MIN_REPETITION_PENALTY = 0.01
MAX_TEMPERATURE = 100.0
SEED_RANGE = (-(2 ** 63), 2 ** 64 - 1)   # what torch.Generator.manual_seed accepts


@dataclass
class GenerationSettings:
    max_new_tokens: int = 256
    temperature: float = 0.0  # 0 = greedy (and every temperature below GREEDY_BELOW)
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    ignore_eos: bool = False

    def validate(self) -> "GenerationSettings":
        """Check every field (TrapetumError naming it); a positive temperature below GREEDY_BELOW becomes 0."""
        def bad(name: str, msg: str) -> None:
            raise TrapetumError(f"{name}: {msg}, got {' '.join(repr(getattr(self, name)).split())[:60]}")

        def num(name: str) -> float:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                bad(name, "must be a finite number")
            return v

        def integer(name: str) -> int:
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int):
                bad(name, "must be an integer")
            return v

        if integer("max_new_tokens") < 0:
            bad("max_new_tokens", "must be a non-negative integer")
        if not 0 <= num("temperature") <= MAX_TEMPERATURE:
            bad("temperature", f"must be in [0, {MAX_TEMPERATURE:g}]")
        if self.temperature < GREEDY_BELOW:
            self.temperature = 0.0
        if integer("top_k") < 0:
            bad("top_k", "must be a non-negative integer")
        if not 0 < num("top_p") <= 1:
            bad("top_p", "must be in (0, 1]")
        if not 0 <= num("min_p") <= 1:
            bad("min_p", "must be in [0, 1]")
        if not MIN_REPETITION_PENALTY <= num("repetition_penalty") <= 100:
            bad("repetition_penalty", f"must be in [{MIN_REPETITION_PENALTY:g}, 100]")
        if self.seed is not None and not SEED_RANGE[0] <= integer("seed") <= SEED_RANGE[1]:
            bad("seed", "must be an integer in [-2**63, 2**64 - 1]")
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not isinstance(self.stop, list) or not all(isinstance(s, str) and s for s in self.stop):
            bad("stop", "must be a list of non-empty strings")
        if not isinstance(self.ignore_eos, bool):
            bad("ignore_eos", "must be true or false")
        return self


class Sampler:
    """Chooses tokens from logits on the logits' device, without reading anything back to the host.

    ``probs(logits [M, V], drafts)`` is the distribution each row samples from, after the repetition penalty,
    temperature, top-k, top-p and min-p (HF order), normalized; with temperature 0 the one-hot of the (penalized)
    argmax. The repetition penalty's state is a device mask of the tokens seen so far (prompt + accepted tokens);
    row r of a multi-row call also sees ``drafts[:r]`` (a verify pass: row r scores the token after draft r-1),
    without changing the state. ``sample(probs)`` draws one token per row from the sampler's generator;
    ``accept(tokens)`` adds tokens to the state. ``sampler(logits [V])`` is the one-step form: probs, sample,
    accept, so a GPU engine can sample with no host sync.
    """

    def __init__(self, s: GenerationSettings, vocab_size: int, device: str | torch.device = "cpu",
                 prompt: list[int] | None = None):
        self.s = s
        self.vocab_size = vocab_size
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

    @property
    def greedy(self) -> bool:
        return self.s.temperature == 0

    def _seen_rows(self, m: int, drafts: torch.Tensor | None) -> torch.Tensor | None:
        """[M, V] penalty masks: the state, plus drafts[:r] for row r."""
        if self.seen is None:
            return None
        rows = self.seen.expand(m, -1).clone()
        if drafts is not None and m > 1:
            d = drafts.reshape(-1)[: m - 1].to(device=rows.device, dtype=torch.long)
            hit = torch.zeros(m, self.vocab_size, dtype=torch.bool, device=rows.device)
            hit[1:].scatter_(1, d.view(-1, 1), True)  # row r gets drafts[r - 1]; no host value crosses (no sync)
            rows |= hit.cumsum(0).bool()
        return rows

    def processed(self, logits: torch.Tensor, drafts: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [M, V] fp32 after the repetition penalty and (unless greedy) temperature, top-k and top-p
        (masked entries -inf)."""
        s = self.s
        logits = logits.float().reshape(-1, logits.shape[-1])
        seen = self._seen_rows(logits.shape[0], drafts)
        if seen is not None:
            pen = torch.where(logits > 0, logits / s.repetition_penalty, logits * s.repetition_penalty)
            logits = torch.where(seen, pen, logits)
        if self.greedy:
            return logits
        logits = logits / s.temperature
        if s.top_k and s.top_k < logits.shape[-1]:
            kth = torch.topk(logits, s.top_k, dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if s.top_p < 1.0:
            sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
            cum = torch.softmax(sorted_logits, -1).cumsum(-1)
            remove = cum <= (1 - s.top_p)
            remove[:, -1] = False
            logits = logits.masked_fill(remove.scatter(1, order, remove), float("-inf"))
        return logits

    def probs(self, logits: torch.Tensor, drafts: torch.Tensor | None = None) -> torch.Tensor:
        """The distributions [M, V] fp32 the rows sample from (class docstring)."""
        logits = self.processed(logits, drafts)
        if self.greedy:
            return torch.nn.functional.one_hot(torch.argmax(logits, -1), logits.shape[-1]).float()
        probs = torch.softmax(logits, -1)
        if self.s.min_p > 0:
            probs = probs.masked_fill(probs < self.s.min_p * probs.amax(-1, keepdim=True), 0.0)
            probs = probs / probs.sum(-1, keepdim=True)
        return probs

    def sample(self, probs: torch.Tensor) -> torch.Tensor:
        """One token per row [M] (int64) from ``probs`` [M, V]."""
        if self.greedy:
            return torch.argmax(probs, -1)
        return torch.multinomial(probs, 1, generator=self.gen).view(-1)

    def accept(self, tokens: torch.Tensor) -> None:
        """Tokens now part of the sequence (the repetition penalty's state)."""
        if self.seen is not None:
            self.seen.index_fill_(0, tokens.reshape(-1).to(torch.long), True)

    def __call__(self, logits: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """logits [V] -> token id tensor [1] (written into ``out`` when given)."""
        if self.greedy:
            tok = torch.argmax(self.processed(logits), -1).view(1)
        else:
            tok = self.sample(self.probs(logits)).view(1)
        self.accept(tok)
        if out is not None:
            out.copy_(tok)
            return out
        return tok
