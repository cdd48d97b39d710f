"""The batch scheduler's forwards on the GPU engine (runtime/engine.py) over a paged fp16 KV cache: the same
interface as runtime/paged_ops.CpuBatchRunner (``kv``, ``prefill``, ``decode``, ``replay``).

    prefill(table, tokens, start)   one prompt chunk of one sequence: its positions 0 .. start - 1 copied from its
        blocks into the engine's contiguous cache, the engine's PREFILL forward over the chunk (tensor cores; a
        first chunk through ``GpuEngine.prefill``, padded and graph-captured on CUDA), the new rows copied back
        into the blocks; logits fp32 [V] of the chunk's last row. A function of the sequence's own chunk and
        prefix alone.
    decode(tables, tokens, positions)   one DECODE forward over S rows, each its own sequence (or, replay, several
        rows of one sequence at consecutive positions: all rows' K/V are written before any row attends, and a
        row sees only positions below its length): PagedEngineOps.

PagedEngineOps (EngineOps, DECODE rows): projections through the schemes' batch-invariant GEMVs in calls of at
most ``rows_per_call`` rows (16; the tiled codebook projections: all rows in one launch over groups of 16; row r
of an M-row GEMV is bitwise the M = 1 result: the verify contract of issue 15);
RMSNorm, the gate/up activation and the residual adds row by row as in the decode step; RoPE of each row at its
own position (the engine's tables, rotate-half, in fp32, rounded to fp16) and its K/V written into its sequence's
blocks; attention by kernels/paged_attention.py (each row over its own blocks, bitwise independent of the batch).
So a sequence's logits are the same whatever the other rows are (tests/test_paged_engine.py; the bitwise
assertion runs on the GPU, the CPU's torch fallbacks of the GEMVs being ordinary matmuls).

CUDA graphs (``Options.graph`` on CUDA): one per batch-size bucket (BUCKETS: the smallest that holds the rows),
captured on first use over static inputs (tokens, positions, block tables); rows past the real ones are padding
rows (position 0 of a spare block outside the allocator), which change no real row (rows are independent). A
step's inputs are written on the host into the bucket's page-locked buffers (numpy, no torch op per row) and
uploaded in two asynchronous copies: no host sync in ``decode`` (the scheduler's one read of the tokens is the
step's only one).

Scope: dense attention + MLP models without activation sparsity; latent attention and mixture-of-experts layers
are refused (UnsupportedError).
"""
from __future__ import annotations

import torch

from ..errors import UnsupportedError
from ..kernels.paged_attention import paged_attention
from ..models.batch import MAX_VERIFY_ROWS, ForwardBatch, Mode
from ..models.blocks import decoder_forward
from ..models.sparsity import DENSE_POSITIONS
from .engine_ops import EngineOps
from .paged_kv import PagedKV


BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def _groups(n: int, step: int = MAX_VERIFY_ROWS):
    return [(i, min(i + step, n)) for i in range(0, n, step)]


class PagedEngineOps(EngineOps):
    def __init__(self, eng, kv: PagedKV, tables: torch.Tensor, positions: torch.Tensor):
        super().__init__(eng, Mode.DECODE)
        self.kv, self.tables, self.positions = kv, tables, positions  # int32 [S, W], int64 [S]
        self.lens = (positions + 1).to(torch.int32)
        bs = kv.block_size
        self.blk = tables.gather(1, (positions // bs).view(-1, 1)).view(-1).long()
        self.off = positions % bs

    def _frag_bits(self, feeds, m):
        return None  # rows reach the GEMVs in groups of at most 16 (row-major slices), never in fragment order

    def project(self, w, x, residual=None):
        out = torch.empty(x.shape[0], w.out_features, dtype=torch.float16, device=x.device)
        for a, b in _groups(x.shape[0], w.rows_per_call):
            o = torch.empty(b - a, w.out_features, dtype=torch.float16, device=x.device)
            if residual is not None and self.eng.options.fuse:
                o = w.gemv(x[a:b].contiguous(), o, residual=residual[a:b].contiguous())
            else:
                o = w.gemv(x[a:b].contiguous(), o)
                if residual is not None:
                    o = residual[a:b] + o
            out[a:b] = o
        return out

    def gate_up(self, w, x, feeds=None):
        out = torch.empty(x.shape[0], w.f, dtype=torch.float16, device=x.device)
        for a, b in _groups(x.shape[0], w.rows_per_call):
            out[a:b] = w.gemv(x[a:b].contiguous(), torch.empty(b - a, w.f, dtype=torch.float16, device=x.device))
        return out

    def sparsify(self, x, t, batch):
        keep = (x.abs() > t) | (self.positions < DENSE_POSITIONS).view(-1, 1)
        return torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device))

    def logits(self, head, h):
        out = self.project(head, h).float()
        cap = self.cfg.final_softcap
        return torch.tanh(out / cap) * cap if cap is not None else out

    def _rope(self, x, sliding: bool):
        """x [S, H, hd] rotated (rotate-half over the first 2 * HALF features) at each row's position -> fp16."""
        cos, sin = self.eng.rope_local if sliding else self.eng.rope  # fp32 [T_max, HALF]
        c, s = cos[self.positions][:, None, :], sin[self.positions][:, None, :]
        half = c.shape[-1]
        xf = x.float()
        x1, x2 = xf[..., :half], xf[..., half:2 * half]
        out = xf.clone()
        out[..., :half] = x1 * c + (-x2) * s
        out[..., half:2 * half] = x2 * c + x1 * s
        return out.to(torch.float16)

    def attend(self, q, k, v, batch: ForwardBatch, p, feeds=None):
        cfg = self.cfg
        q, k = self._rope(q, p.sliding), self._rope(k, p.sliding)
        kb, vb = self.kv.k[p.layer], self.kv.v[p.layer]  # [NB, Hkv, BS, hd]
        kb[self.blk, :, self.off] = k
        vb[self.blk, :, self.off] = v.to(torch.float16)
        out = paged_attention(q.contiguous(), kb, vb, self.tables, self.lens, scale=cfg.scale,
                              window=cfg.sliding_window if p.sliding else None, softcap=cfg.attn_softcap)
        return out

    def latent_attend(self, q, c, k_rot, batch, p):  # GpuBatchRunner refuses MLA models
        raise NotImplementedError("batched serving of latent attention on the engine")


class GpuBatchRunner:
    """The scheduler's forwards (module docstring) over a GpuEngine."""

    def __init__(self, eng, num_blocks: int, block_size: int = 16):
        cfg = eng.cfg
        if cfg.mla or cfg.moe:
            raise UnsupportedError("batched decoding on the GPU engine runs attention + MLP models only so far")
        if eng.sparsity is not None:
            raise UnsupportedError("batched decoding on the GPU engine does not run activation sparsity yet")
        if eng.options.prefill == "exact":
            raise UnsupportedError("batched decoding on the GPU engine: the exact prefill is not supported")
        if eng.placement.offloads:
            raise UnsupportedError("batched decoding on the GPU engine: tensors in host RAM (--gpu-mem) are not "
                                   "supported yet")
        self.eng, self.cfg = eng, cfg
        self.kv = PagedKV(cfg, num_blocks, block_size, torch.float16, eng.device, spare_blocks=1)
        self.pad_block = num_blocks  # the spare block: padding rows write and read there
        self.width = (eng.max_len + block_size - 1) // block_size  # block-table width (the engine's context)
        self.graphs: dict[int, tuple] = {}  # bucket -> (graph, tokens and positions, tables, logits)
        self._host: dict[int, tuple] = {}   # bucket -> its host input buffers (``_stage``)
        self._staged = None                 # a CUDA event after the last upload from them
        self._pool = None

    def _table(self, table: torch.Tensor) -> torch.Tensor:
        t = torch.zeros(self.width, dtype=torch.int32)
        t[:table.numel()] = table.to(torch.int32)
        return t

    @torch.inference_mode()
    def prefill(self, table: torch.Tensor, tokens: list[int], start: int) -> torch.Tensor:
        eng, n = self.eng, len(tokens)
        table = table.to(eng.device)
        for layer in range(self.cfg.num_layers):
            if start:
                k, v = self.kv.gather(layer, table, start)
                eng.kv.k[layer, :, :start] = k
                eng.kv.v[layer, :, :start] = v
        ids = torch.tensor(tokens, dtype=torch.long, device=eng.device)
        if start == 0 and eng.options.prefill == "default":  # a first chunk: the engine's own prompt pass, padded
            logits = eng.prefill(ids)[None]                    # and graph-captured on CUDA (runtime/engine.py)
        else:
            logits = self._chunk(ids, start)
        for layer in range(self.cfg.num_layers):
            self.kv.write(layer, table, start, eng.kv.k[layer, :, start:start + n], eng.kv.v[layer, :, start:start + n])
        return logits[-1].float()

    def _chunk(self, ids: torch.Tensor, start: int) -> torch.Tensor:
        """The PREFILL forward of a chunk at start .. start + n - 1 over the engine's cache: logits [1, V]."""
        eng = self.eng
        batch = ForwardBatch.prefill(ids, start, "last")
        if eng.options.prefill == "precise":
            from .precise import PreciseOps, no_tf32
            with no_tf32():
                logits = decoder_forward(batch, PreciseOps(eng), eng.model)
        else:
            logits = decoder_forward(batch, EngineOps(eng, Mode.PREFILL), eng.model)
        return logits

    @torch.inference_mode()
    def decode(self, tables: list[torch.Tensor], tokens: list[int], positions: list[int]) -> torch.Tensor:
        eng = self.eng
        S = len(tokens)
        graph = eng.use_graph and S <= BUCKETS[-1]
        B = next(b for b in BUCKETS if b >= S) if graph else S
        ip, tab = self._stage(B, tables, tokens, positions, reuse=graph)
        if not graph:
            ip, tab = ip.to(eng.device), tab.to(eng.device)
            return self._forward(ip[0], ip[1], tab)
        entry = self.graphs.get(B)
        if entry is None:
            entry = self.graphs[B] = self._capture(B, ip, tab)
        g, ip_b, tab_b, logits = entry
        ip_b.copy_(ip, non_blocking=True)
        tab_b.copy_(tab, non_blocking=True)
        self._staged.record()  # the host buffers are rewritten only after these copies ran (``_stage``)
        g.replay()
        return logits[:S].clone()

    def _stage(self, B: int, tables, tokens, positions, reuse: bool):
        """The inputs of B rows on the host: int64 [2, B] (tokens; positions) and int32 [B, W] (block tables; 0
        past a table's end), rows past the S real ones padding rows (token 0 at position 0 of the spare block).
        ``reuse``: the bucket's page-locked buffers (uploaded with no host sync; first waiting until the previous
        upload from them ran), else fresh ones."""
        if reuse:
            if B not in self._host:
                pin = torch.device(self.eng.device).type == "cuda"
                self._host[B] = (torch.empty(2, B, dtype=torch.long, pin_memory=pin),
                                 torch.empty(B, self.width, dtype=torch.int32, pin_memory=pin))
                if pin and self._staged is None:
                    self._staged = torch.cuda.Event()
            if self._staged is not None:
                self._staged.synchronize()
            ip, tab = self._host[B]
        else:
            ip, tab = torch.empty(2, B, dtype=torch.long), torch.empty(B, self.width, dtype=torch.int32)
        S = len(tokens)
        a, t = ip.numpy(), tab.numpy()
        a[0, :S], a[1, :S], a[:, S:] = tokens, positions, 0
        t[:S], t[S:] = 0, self.pad_block
        for i, blocks in enumerate(tables):
            t[i, :blocks.numel()] = blocks.cpu().numpy()
        return ip, tab

    def _forward(self, ids, pos, tab):
        eng, S = self.eng, ids.numel()
        batch = ForwardBatch(Mode.DECODE, ids, 0, S, seq_slots=torch.arange(S, dtype=torch.int32, device=eng.device),
                             seq_lens=(pos + 1).to(torch.int32), positions=pos)
        return decoder_forward(batch, PagedEngineOps(eng, self.kv, tab, pos), eng.model)

    def _capture(self, B: int, ip, tab):
        """Bucket B's graph over static inputs ip_b int64 [2, B] (tokens; positions), tab_b int32 [B, W], filled
        from the host rows ``ip``, ``tab`` first (the warm-up forwards write the real rows' K/V: the same bits)."""
        dev = self.eng.device
        ip_b = ip.to(dev)
        tab_b = tab.to(dev)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):  # compile the kernels, settle allocations
                self._forward(ip_b[0], ip_b[1], tab_b)
        torch.cuda.current_stream().wait_stream(s)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self._pool):
            logits = self._forward(ip_b[0], ip_b[1], tab_b)
        return g, ip_b, tab_b, logits

    def replay(self, table: torch.Tensor, tokens: list[int], start: int) -> None:
        n = len(tokens)
        self.decode([table] * n, list(tokens), list(range(start, start + n)))
