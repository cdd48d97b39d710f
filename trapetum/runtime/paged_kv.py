"""Paged KV cache for batched serving: fixed-size blocks, per-sequence block tables, a block allocator.

Layout: per layer, ``k[l]`` and ``v[l]`` [num_blocks, Hkv, block_size, hd] (the model's dtype, on its device),
views of one tensor each, ``K`` and ``V`` [layers, num_blocks, Hkv, block_size, hd], so that a prompt chunk's rows
of every layer go in or out in one launch (``write_all``, ``gather_all``).
A sequence owns a block table (a list of block ids, in position order): position p lives in block
``table[p // block_size]`` at offset ``p % block_size``. Blocks are handed out by ``BlockAllocator`` (lowest free
ids first, so a run is reproducible) and come back when the sequence finishes or is cancelled.

Contract: a sequence reads only positions it wrote (attention over [0, length)), so a block's stale contents from
an earlier owner are never read; ``poison_freed`` fills new and returned blocks with NaN so that a test sees any stale
read as NaN logits. ``gather`` copies a sequence's positions into a fresh contiguous tensor whose size depends on
that sequence alone (never on the other sequences or on where its blocks lie).
"""
from __future__ import annotations

import math

import torch

from ..errors import TrapetumError, UnsupportedError
from ..models.config import ModelConfig


GATHER_BYTES = 1 << 28  # the largest temporary of one ``gather_all`` slice


class KVExhausted(TrapetumError):
    """Not enough free KV blocks for a request now (the server answers 429)."""

    def __init__(self, needed: int, free: int, total: int):
        self.needed, self.free, self.total = needed, free, total
        super().__init__(f"KV cache full: the request needs {needed} blocks, {free} of {total} are free")


class BlockAllocator:
    """Free-list of ``num_blocks`` block ids with accounting (``used``, ``peak``, ``num_free``)."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise TrapetumError(f"kv blocks: at least 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: pop() gives the lowest id
        self._owned = [False] * num_blocks
        self.peak = 0

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def used(self) -> int:
        return self.num_blocks - len(self._free)

    def allocate(self, n: int) -> list[int]:
        if n > len(self._free):
            raise KVExhausted(n, len(self._free), self.num_blocks)
        out = [self._free.pop() for _ in range(n)]
        for b in out:
            self._owned[b] = True
        self.peak = max(self.peak, self.used)
        return out

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if not self._owned[b]:
                raise RuntimeError(f"block {b} freed twice")
            self._owned[b] = False
        self._free.extend(sorted(blocks, reverse=True))
        self._free.sort(reverse=True)


class PagedKV:
    """The blocks of every layer plus their allocator (module docstring for the layout)."""

    def __init__(self, cfg: ModelConfig, num_blocks: int, block_size: int = 16, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu", poison_freed: bool = False, spare_blocks: int = 0):
        """``spare_blocks``: blocks num_blocks .. num_blocks + spare_blocks - 1 outside the allocator (the GPU
        runner's padding rows write there)."""
        if cfg.mla:
            raise UnsupportedError("batched serving: latent-attention (MLA) models are not supported yet")
        if block_size < 1:
            raise TrapetumError(f"kv block size: at least 1, got {block_size}")
        self.cfg, self.block_size, self.poison_freed = cfg, block_size, poison_freed
        shape = (num_blocks + spare_blocks, cfg.num_kv_heads, block_size, cfg.head_dim)
        self.alloc = BlockAllocator(num_blocks)
        # uninitialized: a position is written before it is read, and a large cache then takes no memory pages
        # until requests use them
        self.K = torch.empty((cfg.num_layers,) + shape, dtype=dtype, device=device)
        self.V = torch.empty((cfg.num_layers,) + shape, dtype=dtype, device=device)
        self.k, self.v = list(self.K.unbind(0)), list(self.V.unbind(0))
        if poison_freed:  # (tests) never-written positions are NaN too
            for t in self.k + self.v:
                t.fill_(float("nan"))

    @staticmethod
    def bytes_per_block(cfg: ModelConfig, block_size: int, dtype: torch.dtype = torch.float32) -> int:
        return 2 * cfg.num_layers * cfg.num_kv_heads * block_size * cfg.head_dim * torch.empty(0, dtype=dtype).element_size()

    @classmethod
    def blocks_for_bytes(cls, cfg: ModelConfig, nbytes: float, block_size: int,
                         dtype: torch.dtype = torch.float32) -> int:
        return int(nbytes // cls.bytes_per_block(cfg, block_size, dtype))

    @property
    def num_blocks(self) -> int:
        return self.alloc.num_blocks

    def blocks_needed(self, positions: int) -> int:
        return max(1, math.ceil(positions / self.block_size))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def free(self, blocks: list[int]) -> None:
        self.alloc.free(blocks)
        if self.poison_freed and blocks:
            idx = torch.tensor(blocks, dtype=torch.long, device=self.k[0].device)
            for t in self.k + self.v:
                t.index_fill_(0, idx, float("nan"))

    # -- rows of one sequence ------------------------------------------------------------------
    def _where(self, table: torch.Tensor, start: int, n: int):
        pos = torch.arange(start, start + n, device=table.device)
        return table[pos // self.block_size], pos % self.block_size

    def write(self, layer: int, table: torch.Tensor, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k / v [Hkv, n, hd] into positions start .. start + n - 1 of the sequence with block table ``table``
        (int64 [blocks])."""
        n = k.shape[1]
        if start + n > table.numel() * self.block_size:
            raise RuntimeError(f"positions up to {start + n} past the sequence's {table.numel()} blocks")
        b, o = self._where(table, start, n)
        self.k[layer][b, :, o] = k.transpose(0, 1).to(self.k[layer].dtype)
        self.v[layer][b, :, o] = v.transpose(0, 1).to(self.v[layer].dtype)

    def write_all(self, table: torch.Tensor, start: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """k / v [layers, Hkv, n, hd] into positions start .. start + n - 1 of every layer: ``write`` of each layer
        (the same values), one index_put for K and one for V."""
        n = k.shape[2]
        if start + n > table.numel() * self.block_size:
            raise RuntimeError(f"positions up to {start + n} past the sequence's {table.numel()} blocks")
        b, o = self._where(table, start, n)
        self.K[:, b, :, o] = k.permute(2, 0, 1, 3).to(self.K.dtype)  # indexed dims first: [n, layers, Hkv, hd]
        self.V[:, b, :, o] = v.permute(2, 0, 1, 3).to(self.V.dtype)

    def gather_all(self, table: torch.Tensor, length: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Positions 0 .. length - 1 of every layer into k / v [layers, Hkv, >= length, hd] (``gather`` of each
        layer, the same values), one gather and one copy each for K and V per slice of layers whose gathered
        temporary stays within GATHER_BYTES (all layers at once for a prefix of up to ~1,000 positions of a
        7B-shaped cache)."""
        b, o = self._where(table, 0, length)
        per = max(1, length * self.K[0, 0].numel() // self.block_size * self.K.element_size())
        step = max(1, GATHER_BYTES // per)
        for a in range(0, self.cfg.num_layers, step):
            z = min(a + step, self.cfg.num_layers)
            k[a:z, :, :length] = self.K[a:z, b, :, o].permute(1, 2, 0, 3)
            v[a:z, :, :length] = self.V[a:z, b, :, o].permute(1, 2, 0, 3)

    def gather(self, layer: int, table: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Fresh contiguous k, v [Hkv, length, hd] of positions 0 .. length - 1."""
        nb = self.blocks_needed(length)
        Hkv, hd = self.cfg.num_kv_heads, self.cfg.head_dim
        ids = table[:nb]
        k = self.k[layer][ids].transpose(0, 1).reshape(Hkv, nb * self.block_size, hd)[:, :length].contiguous()
        v = self.v[layer][ids].transpose(0, 1).reshape(Hkv, nb * self.block_size, hd)[:, :length].contiguous()
        return k, v

    def gather_blocks(self, layer: int, table: torch.Tensor, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Fresh contiguous k, v [Hkv, capacity, hd] of the blocks that hold positions 0 .. length - 1 (capacity: a
        whole number of blocks; positions past length - 1 are whatever the blocks hold)."""
        nb = self.blocks_needed(length)
        Hkv, hd = self.cfg.num_kv_heads, self.cfg.head_dim
        ids = table[:nb]
        k = self.k[layer][ids].transpose(0, 1).reshape(Hkv, nb * self.block_size, hd)
        v = self.v[layer][ids].transpose(0, 1).reshape(Hkv, nb * self.block_size, hd)
        return k, v
