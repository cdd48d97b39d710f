"""ForwardBatch: what one forward pass processes, the one interface between the model and its executors.

    mode        PREFILL  a prompt pass (any number of rows, matrix-matrix kernels, no graph)
                DECODE   one new row per sequence (the decode step; graph-captured per row bucket)
                VERIFY   M = 1..16 new rows of one sequence at consecutive positions, every row bitwise what that
                         many DECODE steps give (speculative verify, exact prefill; graph-captured per M)
    tokens      int64 [N] (engine) or [B, T] (reference: B sequences of T rows at the same positions)
    start       position of row 0 (an int, or a one-element int32 device tensor that a captured graph reads)
    n           rows N (T for the reference)
    logits      "all" rows need logits, or only the "last" row of each sequence
    seq_slots   int32 [N] the KV-cache slot of each row's sequence (one sequence: None = slot 0)
    seq_lens    int32 [S] each sequence's length after this pass (None: start + n for the one sequence)
    positions   int64 [N] each row's position (many sequences; None: start .. start + n - 1)
    last_row    int64 [1] device index of the row whose logits "last" means (None: row n - 1; a prompt padded
                to a graph's length bucket names its real last row)

Many sequences (the batch scheduler, runtime/scheduler.py): ``seq_slots`` gives each row's sequence (an index
into ``seq_lens``), ``positions`` each row's position; a DECODE batch then has one row per sequence, a PREFILL
batch any rows (prompt chunks and decode rows side by side).

Rows of one sequence are at consecutive positions start .. start + n - 1 and attend causally to everything
before them. The batch object is model vocabulary (the blocks read it), so it lives below the blocks; the
executors (models/torch_ops.py for the reference, runtime/ for the engine) give it meaning.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

MAX_VERIFY_ROWS = 16


class Mode(enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    VERIFY = "verify"


@dataclass
class ForwardBatch:
    mode: Mode
    tokens: torch.Tensor
    start: int | torch.Tensor
    n: int
    logits: str = "all"
    seq_slots: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    last_row: torch.Tensor | None = None

    def __post_init__(self):
        if self.logits not in ("all", "last"):
            raise ValueError(f"logits: 'all' or 'last', got {self.logits!r}")
        if self.n < 1:
            raise ValueError(f"n: a batch has at least one row, got {self.n}")
        if self.mode is Mode.DECODE and self.seq_slots is None and self.n != 1:
            raise ValueError(f"n: a DECODE batch of one sequence has one row, got {self.n}")
        if self.mode is Mode.VERIFY and self.n > MAX_VERIFY_ROWS:
            raise ValueError(f"n: a VERIFY batch has at most {MAX_VERIFY_ROWS} rows, got {self.n}")

    @classmethod
    def prefill(cls, tokens: torch.Tensor, start: int = 0, logits: str = "all") -> "ForwardBatch":
        return cls(Mode.PREFILL, tokens, start, int(tokens.shape[-1]), logits)

    @classmethod
    def rows(cls, mode: Mode, tokens: torch.Tensor, start: int | torch.Tensor) -> "ForwardBatch":
        """DECODE (one row) or VERIFY (tokens [M]) rows of one sequence at start .. start + M - 1."""
        return cls(mode, tokens, start, int(tokens.shape[-1]), "all")
