"""The batch scheduler's forwards on the GPU engine (runtime/engine.py) over a paged fp16 KV cache: the same
interface as runtime/paged_ops.CpuBatchRunner (``kv``, ``prefill``, ``decode``, ``replay``).

    prefill(table, tokens, start)   one prompt chunk of one sequence: its positions 0 .. start - 1 copied from its
        blocks into the engine's contiguous cache, the engine's PREFILL forward over the chunk (tensor cores; a
        first chunk through ``GpuEngine.prefill``, padded and graph-captured on CUDA), the new rows copied back
        into the blocks (every layer in one launch for K and one for V: PagedKV.write_all / gather_all; the table
        and tokens uploaded without a host sync); logits fp32 [V] of the chunk's last row. A function of the
        sequence's own chunk and prefix alone.
    decode(tables, tokens, positions, prev=None, src=None)   one DECODE forward over S rows, each its own sequence (or, replay and the
        scheduler's folded prompts, several rows of one sequence at consecutive positions: all rows' K/V are
        written before any row attends, and a row sees only positions below its length): PagedEngineOps.
        ``prev`` (int64 [R] on the device: the previous step's sampled tokens, maybe still being computed) and
        ``src`` (per row an index into it, -1: the row's token from ``tokens``): the scheduler's overlapped steps
        (runtime/scheduler.py); the indices travel with the host inputs and one gather on the device writes the
        rows' tokens into the forward's token input before it runs (stream order, no host sync).
    overlap   the scheduler's default ``overlap`` (True: the host's work on a step's tokens runs while the device
        computes the next step).
    fold_prompt   the scheduler's default ``fold`` (FOLD_PROMPT): a short prompt as decode rows costs its row
        groups of the batched GEMVs, where ``prefill`` dequantizes every weight of the model (NOTES-serving.md,
        session 12).
    row_group   the scheduler's ``row_group``: 64 where the wgmma GEMV runs (its cost steps by 64-row groups, each
        dequantizing every weight: a step of 65 rows costs what 128 do), else 0 (no limit).

PagedEngineOps (EngineOps, DECODE rows): projections through the schemes' batch-invariant GEMVs, written straight
into their outputs (the residual add fused into o / down with ``Options.fuse``), all rows in one call where they
fit ``rows_per_call`` (the tiled codebook projections: up to 256, groups of 16 in one launch; else calls of at most
16 into row slices of the output; row r of an M-row GEMV is bitwise the M = 1 result: the verify contract of issue
15); at 3..16 rows the RMSNorm, the attention merge and the gate/up epilogue hand the next GEMV its rows in
fragment order, as the engine's VERIFY pass does (the same values); RMSNorm and the gate/up activation as the decode step's kernels, row
by row; per layer one launch for RoPE of q (in place) and k at each row's own position (the engine's tables,
rotate-half, fp32 rounded to fp16 as fused.rope_kv_append) with the K/V written into each row's block slot, then
the paged split-KV and merge launches (kernels/paged_attention.py: each row over its own blocks, bitwise independent
of the batch): 9 launches a layer for a Llama-type layer (2 norms, 4 GEMVs, 3 attention), none of them per row.
So a sequence's logits are the same whatever the other rows are (tests/test_paged_engine.py; the bitwise
assertion runs on the GPU, the CPU's torch fallbacks of the GEMVs being ordinary matmuls).

CUDA graphs (``Options.graph`` on CUDA): one per batch-size bucket (BUCKETS: the smallest that holds the rows; past 16
whole groups of 16, the grouped GEMV's unit, so a folded prompt pads at most 15 rows) and
chunk bound (``chunk_bound``: the paged split's grid over a power of two of 64-position chunks that holds the
step's longest row, so that a wide table launches no mass of programs that only exit), captured on first use over static inputs (tokens, positions, block tables); rows past the real ones are padding
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
from ..kernels import codebook_gemm_wgmma
from ..kernels.paged_attention import CHUNK_BLOCKS, paged_attention, paged_rope_append
from ..models.batch import MAX_VERIFY_ROWS, ForwardBatch, Mode
from ..models.blocks import decoder_forward
from ..models.sparsity import DENSE_POSITIONS
from .engine_ops import EngineOps
from .paged_kv import PagedKV


BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 112, 128, 192, 256)  # above 16: whole groups of 16 GEMV rows
FOLD_PROMPT = 128  # the scheduler's default ``fold``: prompts up to this long run as decode rows


def _gather(ip: torch.Tensor, prev: torch.Tensor | None) -> None:
    """Rows of ``ip`` (int64 [3, B] on the device: tokens; positions; sources) whose source is an index into
    ``prev`` take their token from there (tiny device ops, no host sync); nothing without ``prev``."""
    if prev is not None:
        src = ip[2]
        ip[0].copy_(torch.where(src >= 0, prev.index_select(0, src.clamp(min=0)), ip[0]))


def _groups(n: int, step: int = MAX_VERIFY_ROWS):
    return [(i, min(i + step, n)) for i in range(0, n, step)]


class PagedEngineOps(EngineOps):
    def __init__(self, eng, kv: PagedKV, tables: torch.Tensor, positions: torch.Tensor, lens: torch.Tensor,
                 chunks: int | None = None):
        super().__init__(eng, Mode.DECODE)
        self.kv, self.tables, self.positions = kv, tables, positions  # int32 [S, W], int64 [S]
        self.lens = lens  # int32 [S]: positions + 1
        self.chunks = chunks  # the split grid's chunk bound (paged_attention's max_chunks), None: the table's

    def _frag_bits(self, feeds, m):
        # the engine's fragment-order hand-over (3 <= m <= 16 rows, one GEMV call): the same values
        if feeds is None or m > feeds.rows_per_call:
            return None
        return super()._frag_bits(feeds, m)

    def project(self, w, x, residual=None):
        m = x.shape[0]
        out = torch.empty(m, w.out_features, dtype=torch.float16, device=x.device)
        fuse = residual is not None and self.eng.options.fuse
        if m <= w.rows_per_call:  # one call, straight into out
            if fuse:
                return w.gemv(x, out, residual=residual)
            w.gemv(x, out)
            return out if residual is None else residual + out
        x = x.contiguous()
        for a, b in _groups(m, w.rows_per_call):  # row slices of contiguous tensors: contiguous
            if fuse:
                w.gemv(x[a:b], out[a:b], residual=residual[a:b].contiguous())
            else:
                w.gemv(x[a:b], out[a:b])
        return out if residual is None or fuse else residual + out

    def gate_up(self, w, x, feeds=None):
        m = x.shape[0]
        if m <= w.rows_per_call:
            return super().gate_up(w, x, feeds)
        out = torch.empty(m, w.f, dtype=torch.float16, device=x.device)
        x = x.contiguous()
        for a, b in _groups(m, w.rows_per_call):
            w.gemv(x[a:b], out[a:b])
        return out

    def sparsify(self, x, t, batch):
        keep = (x.abs() > t) | (self.positions < DENSE_POSITIONS).view(-1, 1)
        return torch.where(keep, x, torch.zeros((), dtype=x.dtype, device=x.device))

    def logits(self, head, h):
        out = self.project(head, h).float()
        cap = self.cfg.final_softcap
        return torch.tanh(out / cap) * cap if cap is not None else out

    def attend(self, q, k, v, batch: ForwardBatch, p, feeds=None):
        cfg = self.cfg
        cos, sin = self.eng.rope_local if p.sliding else self.eng.rope  # fp32 [T_max, HALF]
        kb, vb = self.kv.k[p.layer], self.kv.v[p.layer]  # [NB, Hkv, BS, hd]
        q = paged_rope_append(q, k, v.to(torch.float16), kb, vb, self.tables, self.positions, cos, sin)
        return paged_attention(q, kb, vb, self.tables, self.lens, scale=cfg.scale,
                               window=cfg.sliding_window if p.sliding else None, softcap=cfg.attn_softcap,
                               max_chunks=self.chunks, frag_bits=self._frag_bits(feeds, q.shape[0]))

    def latent_attend(self, q, c, k_rot, batch, p):  # GpuBatchRunner refuses MLA models
        raise NotImplementedError("batched serving of latent attention on the engine")


class GpuBatchRunner:
    """The scheduler's forwards (module docstring) over a GpuEngine."""

    fold_prompt = FOLD_PROMPT
    overlap = True  # measured on the H200 (BENCHMARKS.md, session 15): 1.10x / 1.25x / 1.33x at 1 / 16 / 64 clients

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
        # the many-row GEMV's extension (Hopper), built now rather than inside the first step's graph capture
        wgmma = codebook_gemm_wgmma.ready(eng.device, eng.options.kernels)
        self.row_group = codebook_gemm_wgmma.ROW_GROUP if wgmma else 0
        self.kv = PagedKV(cfg, num_blocks, block_size, torch.float16, eng.device, spare_blocks=1)
        self.pad_block = num_blocks  # the spare block: padding rows write and read there
        self.width = (eng.max_len + block_size - 1) // block_size  # block-table width (the engine's context)
        self.graphs: dict[tuple, tuple] = {}  # (bucket, chunks) -> (graph, tokens and positions, tables, logits)
        self._host: dict[int, tuple] = {}   # bucket -> its host input buffers (``_stage``)
        self._staged = None                 # a CUDA event after the last upload from them
        self._prompt_host = self._prompt_dev = self._prompt_done = None  # ``_stage_prompt``'s buffers
        self._pool = None

    def _table(self, table: torch.Tensor) -> torch.Tensor:
        t = torch.zeros(self.width, dtype=torch.int32)
        t[:table.numel()] = table.to(torch.int32)
        return t

    @torch.inference_mode()
    def prefill(self, table: torch.Tensor, tokens: list[int], start: int) -> torch.Tensor:
        eng, n = self.eng, len(tokens)
        tab, ids = self._stage_prompt(table, tokens)
        if start:  # the prefix of every layer into the engine's cache: one gather and one copy for K and for V
            self.kv.gather_all(tab, start, eng.kv.k, eng.kv.v)
        if start == 0 and eng.options.prefill == "default":  # a first chunk: the engine's own prompt pass, padded
            logits = eng.prefill(ids)[None]                    # and graph-captured on CUDA (runtime/engine.py)
        else:
            logits = self._chunk(ids, start)
        self.kv.write_all(tab, start, eng.kv.k[:, :, start:start + n], eng.kv.v[:, :, start:start + n])
        return logits[-1].float()

    def _stage_prompt(self, table: torch.Tensor, tokens: list[int]):
        """A prompt chunk's block table and tokens on the device (int64 [blocks], [n]): on CUDA through page-locked
        buffers and asynchronous copies (no host sync; the buffers are rewritten only after the last copies from
        them ran), else plain tensors."""
        dev = torch.device(self.eng.device)
        if dev.type != "cuda":
            return table.to(dev), torch.tensor(tokens, dtype=torch.long, device=dev)
        nb, n = table.numel(), len(tokens)
        if self._prompt_host is None:
            self._prompt_host = torch.empty(self.width + self.eng.max_len, dtype=torch.long, pin_memory=True)
            self._prompt_dev = torch.empty(self.width + self.eng.max_len, dtype=torch.long, device=dev)
            self._prompt_done = torch.cuda.Event()
        else:
            self._prompt_done.synchronize()
        h = self._prompt_host.numpy()
        h[:nb], h[nb:nb + n] = table.numpy(), tokens
        d = self._prompt_dev[:nb + n]
        d.copy_(self._prompt_host[:nb + n], non_blocking=True)
        self._prompt_done.record()
        return d[:nb], d[nb:]

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
    def decode(self, tables: list[torch.Tensor], tokens: list[int], positions: list[int],
               prev: torch.Tensor | None = None, src: list[int] | None = None) -> torch.Tensor:
        eng = self.eng
        S = len(tokens)
        graph = eng.use_graph and S <= BUCKETS[-1]
        B = next(b for b in BUCKETS if b >= S) if graph else S
        C = self.chunk_bound(max(positions) + 1)
        ip, tab = self._stage(B, tables, tokens, positions, reuse=graph, src=src)
        if not graph:
            ip, tab = ip.to(eng.device), tab.to(eng.device)
            _gather(ip, prev)
            return self._forward(ip[0], ip[1], tab, C)
        entry = self.graphs.get((B, C))
        if entry is None:
            entry = self.graphs[B, C] = self._capture(B, C, ip, tab, prev)
        g, ip_b, tab_b, logits = entry
        ip_b.copy_(ip, non_blocking=True)
        tab_b.copy_(tab, non_blocking=True)
        self._staged.record()  # the host buffers are rewritten only after these copies ran (``_stage``)
        _gather(ip_b, prev)
        g.replay()
        return logits[:S].clone()

    def _stage(self, B: int, tables, tokens, positions, reuse: bool, src=None):
        """The inputs of B rows on the host: int64 [3, B] (tokens; positions; ``src``, -1 for none) and int32
        [B, W] (block tables; 0 past a table's end), rows past the S real ones padding rows (token 0 at position
        0 of the spare block). ``reuse``: the bucket's page-locked buffers (uploaded with no host sync; first
        waiting until the previous upload from them ran), else fresh ones."""
        if reuse:
            if B not in self._host:
                pin = torch.device(self.eng.device).type == "cuda"
                self._host[B] = (torch.empty(3, B, dtype=torch.long, pin_memory=pin),
                                 torch.empty(B, self.width, dtype=torch.int32, pin_memory=pin))
                if pin and self._staged is None:
                    self._staged = torch.cuda.Event()
            if self._staged is not None:
                self._staged.synchronize()
            ip, tab = self._host[B]
        else:
            ip, tab = torch.empty(3, B, dtype=torch.long), torch.empty(B, self.width, dtype=torch.int32)
        S = len(tokens)
        a, t = ip.numpy(), tab.numpy()
        a[0, :S], a[1, :S], a[:2, S:] = tokens, positions, 0
        a[2] = -1
        if src is not None:
            a[2, :S] = src
        t[:S], t[S:] = 0, self.pad_block
        for i, blocks in enumerate(tables):
            t[i, :blocks.numel()] = blocks.cpu().numpy()
        return ip, tab

    def chunk_bound(self, length: int) -> int:
        """The split grid's chunks for rows of at most ``length`` positions: a power of two >= ceil(length / CH),
        at most the table's (a graph per bucket and bound; the bound changes no bit: kernels/paged_attention.py)."""
        ch = CHUNK_BLOCKS * self.kv.block_size
        need = -(-int(length) // ch)
        return min(1 << max(0, need - 1).bit_length(), -(-self.width * self.kv.block_size // ch))

    def _forward(self, ids, pos, tab, chunks=None):
        eng, S = self.eng, ids.numel()
        lens = (pos + 1).to(torch.int32)
        batch = ForwardBatch(Mode.DECODE, ids, 0, S, seq_slots=torch.arange(S, dtype=torch.int32, device=eng.device),
                             seq_lens=lens, positions=pos)
        return decoder_forward(batch, PagedEngineOps(eng, self.kv, tab, pos, lens, chunks), eng.model)

    def _capture(self, B: int, C: int, ip, tab, prev=None):
        """Bucket B's graph (split grid of C chunks) over static inputs ip_b int64 [3, B] (tokens; positions;
        sources of ``_gather``, not read by the graph), tab_b int32 [B, W], filled from the host rows ``ip``,
        ``tab`` and ``prev`` first (the warm-up forwards write the real rows' K/V: the same bits)."""
        dev = self.eng.device
        ip_b = ip.to(dev)
        tab_b = tab.to(dev)
        _gather(ip_b, prev)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):  # compile the kernels, settle allocations
                self._forward(ip_b[0], ip_b[1], tab_b, C)
        torch.cuda.current_stream().wait_stream(s)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self._pool):
            logits = self._forward(ip_b[0], ip_b[1], tab_b, C)
        return g, ip_b, tab_b, logits

    def replay(self, table: torch.Tensor, tokens: list[int], start: int) -> None:
        n = len(tokens)
        self.decode([table] * n, list(tokens), list(range(start, start + n)))
