"""GPU engine: the model's blocks over EngineOps, static state, forwards captured as CUDA graphs per (mode, rows).

State (static, allocated once): the KV cache ``kv`` [L, Hkv, T_max, hd] x 2, the input rows ``row_tokens`` [16]
(``token`` = its first row, the decode step's input and greedy output), the position ``pos`` [1] of row 0,
the logits ``logits_rows`` fp32 [16, V] (``logits`` = row 0), the greedy choices ``argmax_rows`` [16], the
attention and 2-bit GEMV workspaces. A forward reads ``row_tokens[:M]`` and ``pos`` and writes the cache rows
pos .. pos + M - 1 and ``logits_rows[:M]``:

    step(greedy)          DECODE, one row: the decode step; greedy puts argmax(logits) into ``token``; pos += 1
    verify(tokens, base)  VERIFY, M = 1..16 rows at base .. base + M - 1 (pos unchanged): row r's logits and cache
                          row are bitwise what r + 1 decode steps from base give (the kernels are batch-invariant
                          and attention reduces each row as decode does at its length); argmax_rows[:M] greedy
    prefill(ids)          PREFILL: the prompt at 0 .. T-1 (tensor cores, fp32 residual; ``Options.prefill`` =
                          "precise": fp32-reference accuracy, runtime/precise.py; "exact": through the verify graphs
                          in chunks of 16, 8, 4, 2, 1 rows, so the prompt continues bit for bit like a decoded one;
                          the default takes "exact" for short prompts of codebook models: ``short_exact``)
Graphs: one per (mode, rows, greedy), captured on first use and replayed at any position (positions live in
``pos``); ``Options.graph`` off runs the same code eagerly. The default prefill of a prompt (last-row logits;
``Options.prefill_graph``, CUDA) runs padded to ``prefill_bucket(T)`` rows (rows past T are zero tokens whose cache
rows decode overwrites before any read: attention is causal): eagerly at a bucket's first use (and always with
graphs off), then as a graph captured at its second use, the same kernels on the same shapes, so the same bits.
Placement (runtime/placement.py; ``placement=``, else planned from ``Options.gpu_mem_gb``; default everything on
the device, the engine unchanged bit for bit): with the embedding table in host RAM, a forward of rows first reads
``row_tokens[:M]`` back (one sync), gathers their table rows on the host into a pinned buffer and copies them into
the static ``embed_rows`` before the graph replay (or the eager pass), so the step stays one captured graph; a
prompt runs padded as on the device (the same shapes, so the same bits and the same greedy tokens as the
all-on-device engine) but always eagerly: its rows are gathered on the host in the pass (EngineOps.embed). With routed experts in host RAM (runtime/host_experts.py)
every MoE layer's experts run on the CPU between the layer's GPU work, which a graph cannot hold: such an engine
runs its steps eagerly (graphs off). Graph segments between host layers would save the launches, not the host
work: nearly every layer of the models that need this is an MoE layer (DeepSeek-V2-Lite: 26 of 27), so a segment
is one layer's attention and router, and the per-layer sync stays; left for when eager launches are measured to
matter against the host GEMVs.
Implements the Runner protocol (``tokens``).
"""
from __future__ import annotations

from typing import Iterator

import torch

from ..errors import UnsupportedError
from ..kernels.attention import attention_workspace, fixed_chunk_config, named_config
from ..models.batch import MAX_VERIFY_ROWS, ForwardBatch, Mode
from ..models.blocks import decoder_forward
from ..models.checkpoint import Checkpoint
from ..models.layers import rotaries
from ..models.rope import deinterleave_index
from ..models.sparsity import check_sparse_kinds
from ..settings import Options
from . import engine_latent
from .engine_model import build_model, enable_sparse
from .engine_ops import EngineOps
from .host_experts import HostStaging
from .kv import ContiguousKV
from .placement import Placement, plan_for
from .sampling import GenerationSettings, Sampler

EXACT_CHUNKS = (16, 8, 4, 2, 1)  # the exact prefill's chunks where a padded 16-row pass would pass the cache's end


def prefill_bucket(t: int) -> int:
    """Rows a padded prefill of t tokens runs: t rounded up to a multiple of max(16, 2**(bit_length(t) - 4)),
    at most 1/8 more rows than t (16 rows at the least)."""
    if t < 1:
        raise ValueError(f"t: a prompt has at least one token, got {t}")
    g = max(16, 1 << max(t.bit_length() - 4, 0))
    return -(-t // g) * g


def _sdpa_backends():
    """The prefill's attention kernels when it is padded and captured: flash / memory-efficient / math (cuDNN's
    SDPA is left out of graphs; the eager first pass uses the same set, so both give the same bits)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def _codebook_kind(p) -> bool:
    """A projection (or fused gate/up) whose decode / verify GEMV is the 4-/8-bit codebook kernel, in all parts."""
    if p.kind == "codebook":
        return True
    parts = getattr(p, "parts", None) if p.kind == "concat" else (
        [w for w in (p.gate, p.up) if w is not None] if p.kind == "separate" else None)
    return bool(parts) and all(_codebook_kind(w) for w in parts)


class GpuEngine:
    """Batch-1 decoding (and verify / prefill) of a checkpoint on one device (CUDA; on the CPU the kernels'
    torch fallbacks run, for tests)."""

    def __init__(self, ckpt: Checkpoint, max_len: int, *, device: str | torch.device = "cuda",
                 options: Options | None = None, sparsity=None, placement: Placement | None = None):
        """``sparsity``: a SparsityTable (models/sparsity.py) of the model's layers, or None (dense). ``placement``:
        where the tensors live (None: planned from ``options.gpu_mem_gb``; no budget: all on the device)."""
        self.options = options = options or Options()
        cfg = self.cfg = ckpt.config
        dev = self.device = torch.device(device)
        self.max_len = max_len
        if placement is None:
            placement = plan_for(ckpt, max_len, options.gpu_mem_gb, latent=bool(cfg.mla) and options.mla == "latent")
        self.placement = placement
        if placement.offloads and options.prefill == "precise":
            raise UnsupportedError(f"{ckpt.source}: the precise prefill does not run with tensors in host RAM "
                                   "(--gpu-mem) yet")
        # host experts run between a layer's GPU work: no graphs (module docstring)
        self.use_graph = options.graph and dev.type == "cuda" and not placement.experts_host
        if (cfg.moe or cfg.mla) and options.prefill == "precise":
            raise UnsupportedError(f"{ckpt.source}: the precise prefill does not run mixture-of-experts or "
                                   "latent-attention layers yet (TRAPETUM_PREFILL=default or exact)")
        # per-head cache and attention size: latent attention's keys and values padded to one (engine_ops.py)
        self.head_dim = max(cfg.head_dim, cfg.v_head_dim) if cfg.mla else cfg.head_dim
        self.rope_perm = deinterleave_index(cfg.qk_rope_head_dim).to(dev) if cfg.mla and cfg.rope_interleave else None
        if cfg.mla:  # q [nope, rope] -> [rope (de-interleaved), nope] in one gather (engine_ops.latent_attend)
            rope = torch.arange(cfg.qk_rope_head_dim) if self.rope_perm is None else self.rope_perm.cpu()
            self.mla_q_index = torch.cat([rope + cfg.qk_nope_head_dim, torch.arange(cfg.qk_nope_head_dim)]).to(dev)
        if options.prefill == "precise":
            from .precise import PreciseOps  # noqa: F401  (checks the model before building it)
        self.model = build_model(ckpt, dev, options, precise=options.prefill == "precise", placement=placement)
        D = cfg.hidden_size
        self.host_embed = placement.embed_host
        if self.host_embed:  # the rows of a forward, gathered on the host, uploaded before it (module docstring)
            self.embed_pinned = torch.empty(MAX_VERIFY_ROWS, D, dtype=torch.float16, pin_memory=dev.type == "cuda")
            self.embed_rows = torch.empty(MAX_VERIFY_ROWS, D, dtype=torch.float16, device=dev)
        self.host_staging = HostStaging(D, cfg.num_experts_per_tok, dev) if placement.experts_host else None
        self.source = ckpt.source
        self.sparsity = None
        self.embed_scale = torch.tensor(cfg.embed_scale, dtype=torch.float16) if cfg.embed_scale is not None else None
        self.rotaries = g, loc = rotaries(cfg)
        # row p of each table rotates as a decode step at p (models/rope.py: YaRN's attention factor folded in;
        # longrope / dynamic with the frequencies of length p + 1); a prompt pass may need its own (pass_rope)
        self.rope = g.spec.table(max_len, device=dev)
        self.rope_local = loc.spec.table(max_len, device=dev) if loc is not None else self.rope
        # attention config: a named one (Options.attn_config), else fixed 64-position chunks when the o projections
        # are dense fp16 (NOTES-engine.md: the adaptive splits slowed the fp16 7B), else the kernel's choice
        hd, G = self.head_dim, cfg.num_heads // cfg.num_kv_heads
        if options.attn_config:
            self.attn_config = named_config(options.attn_config)
        elif all(L.attention.o.kind == "fp16" for L in self.model.layers):
            self.attn_config = fixed_chunk_config(hd, G)
        else:
            self.attn_config = None
        self.latent = bool(cfg.mla) and options.mla == "latent"
        if self.latent:  # the latent [c, RoPE(k_rot)] per position, one "head", nothing in v (engine_latent.py)
            self.kv = ContiguousKV(cfg, max_len, dev, head_dim=cfg.kv_lora_rank + cfg.qk_rope_head_dim, heads=1,
                                   v_dim=0)
            engine_latent.setup(self)
        else:
            self.kv = ContiguousKV(cfg, max_len, dev, head_dim=hd)
        self.attn_ws = attention_workspace(cfg.num_heads, hd, max_len, dev, hkv=cfg.num_kv_heads,
                                           config=self.attn_config, rows=MAX_VERIFY_ROWS)
        self.row_tokens = torch.zeros(MAX_VERIFY_ROWS, dtype=torch.long, device=dev)
        self.token = self.row_tokens[:1]
        self.pos = torch.zeros(1, dtype=torch.int32, device=dev)
        self.logits_rows = torch.zeros(MAX_VERIFY_ROWS, cfg.vocab_size, dtype=torch.float32, device=dev)
        self.logits = self.logits_rows[0]
        self.argmax_rows = torch.zeros(MAX_VERIFY_ROWS, dtype=torch.long, device=dev)
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self._pool = None
        self.layer_hook = None  # profiling: decoder_forward's on_layer for the row forwards (they then run eagerly)
        # padded prefill (prefill_bucket): the prompt rows, the real last row, graphs with their logits per bucket
        self.prefill_tokens: torch.Tensor | None = None
        self.prefill_last = torch.zeros(1, dtype=torch.long, device=dev)
        self.prefill_graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._prefill_seen: set[int] = set()
        self._codebook_layers: bool | None = None  # short_exact: every layer projection a codebook GEMV
        if sparsity is not None:  # before any graph is captured: the thresholds are constants of the graphs
            self.set_sparsity(sparsity)

    # -- accounting ----------------------------------------------------------------------------
    @property
    def k_cache(self) -> torch.Tensor:
        return self.kv.k

    @property
    def v_cache(self) -> torch.Tensor:
        return self.kv.v

    def pass_rope(self, sliding: bool, start: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) tables of a PREFILL pass over positions start .. start + T - 1: the decode-step tables, except
        for a length-dependent RoPE (longrope, dynamic NTK) whose pass crosses its threshold, which rotates every
        position of the pass with the frequencies of length start + T (as the reference and transformers)."""
        g, loc = self.rotaries
        rope = loc if sliding and loc is not None else g
        n = start + T
        if rope.spec.length_dependent and n > rope.spec.threshold:
            return rope.spec.table(n, seq_len=n, device=self.device)
        return self.rope_local if sliding else self.rope

    def set_sparsity(self, table) -> None:
        """Thresholds of every layer (a SparsityTable), or None (dense: the blocks' dense path, bitwise). The
        sparse projections' input-major codes are made on first use and kept; captured graphs are dropped (the
        thresholds are constants of a graph)."""
        if table is not None:
            check_sparse_kinds(self.cfg)
            table.check_model(self.cfg.num_layers, self.source)
        for i, L in enumerate(self.model.layers):
            for _, w in L.blocks:
                w.sparsity = None if table is None else table.layers[i]
                if table is not None:
                    enable_sparse(w)
        self.sparsity = table
        self.graphs.clear()
        self.prefill_graphs.clear()
        self._prefill_seen.clear()

    def weight_bytes(self) -> int:
        """Bytes of the weights on the engine's device (those in host RAM: ``host_weight_bytes``)."""
        return self.model.weight_bytes()

    def host_weight_bytes(self) -> int:
        return self.model.host_weight_bytes()

    # -- the row forwards (DECODE, VERIFY) -----------------------------------------------------
    def _rows(self, mode: Mode, m: int, greedy: bool) -> None:
        batch = ForwardBatch.rows(mode, self.row_tokens[:m], self.pos)
        logits = decoder_forward(batch, EngineOps(self, mode), self.model, on_layer=self.layer_hook)  # logits_rows[:m]
        if mode is Mode.DECODE:
            if greedy:
                torch.argmax(logits, dim=-1, out=self.token)
            self.pos.add_(1)
        else:
            torch.argmax(logits, dim=-1, out=self.argmax_rows[:m])

    def _upload_rows(self, m: int) -> None:
        """The table rows of ``row_tokens[:m]`` from the host table into ``embed_rows[:m]`` (host embedding)."""
        ids = self.row_tokens[:m].cpu()  # the sync: the tokens may come from the previous step's argmax
        self._gather_rows(ids)

    def _gather_rows(self, ids: torch.Tensor) -> None:
        """The host side of ``_upload_rows``: table rows ``ids`` (int64 [m] on the CPU) gathered into the pinned
        buffer, queued for upload into ``embed_rows[:m]``."""
        m = ids.numel()
        torch.index_select(self.model.embed, 0, ids, out=self.embed_pinned[:m])
        self.embed_rows[:m].copy_(self.embed_pinned[:m], non_blocking=self.device.type == "cuda")

    def _run(self, mode: Mode, m: int, greedy: bool) -> None:
        if not self.use_graph or self.layer_hook is not None:  # a profiling hook runs eagerly (decoder_forward)
            if self.host_embed:
                self._upload_rows(m)
            self._rows(mode, m, greedy)
            return
        key = (mode, m, greedy)
        g = self.graphs.get(key)
        if g is None:
            g = self.graphs[key] = self._capture(mode, m, greedy)
        if self.host_embed:
            self._upload_rows(m)
        g.replay()

    def _capture(self, mode: Mode, m: int, greedy: bool) -> torch.cuda.CUDAGraph:
        saved = (self.row_tokens.clone(), self.pos.clone())
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):  # compile Triton kernels, load the extensions, settle allocations
                self._restore(saved)
                self._rows(mode, m, greedy)
        torch.cuda.current_stream().wait_stream(s)
        self._restore(saved)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self._pool):
            self._rows(mode, m, greedy)
        self._restore(saved)
        return g

    def _restore(self, saved) -> None:
        self.row_tokens.copy_(saved[0])
        self.pos.copy_(saved[1])

    def step(self, greedy: bool = True) -> None:
        """One decode step (graph replay when enabled): reads ``token`` at ``pos``; logits in ``logits``."""
        self._run(Mode.DECODE, 1, greedy)

    def set_position(self, token: int | torch.Tensor, pos: int) -> None:
        if isinstance(token, torch.Tensor):
            self.token.copy_(token.view(1))
        else:
            self.token.fill_(int(token))
        self.pos.fill_(pos)

    @torch.inference_mode()
    def verify(self, tokens, base: int) -> torch.Tensor:
        """Rows ``tokens`` [M] (M <= 16) at positions base .. base + M - 1 in one pass: their K/V go into the cache,
        their logits fp32 [M, V] (a view of ``logits_rows``, valid until the next forward) and greedy choices
        (``argmax_rows[:M]``) come back; ``pos`` is left at ``base``."""
        t = torch.as_tensor(tokens, dtype=torch.long, device=self.device).view(-1)
        m = t.numel()
        if not 1 <= m <= MAX_VERIFY_ROWS:
            raise ValueError(f"tokens: 1 to {MAX_VERIFY_ROWS} rows per verify pass, got {m}")
        if base < 0 or base + m > self.max_len:
            raise ValueError(f"base: rows {base}..{base + m - 1} outside the KV cache of {self.max_len}")
        self.row_tokens[:m].copy_(t)
        self.pos.fill_(base)
        self._run(Mode.VERIFY, m, True)
        return self.logits_rows[:m]

    @torch.inference_mode()
    def verify_at(self, tokens: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """``verify`` with the base position in a device tensor ``pos`` (one integer element, copied into ``pos``
        on the device: nothing is read back, so a caller can queue passes whose positions the device computes).
        ``tokens`` [M] on the device; the caller guarantees pos + M <= max_len (not checkable without a sync)."""
        m = tokens.numel()
        if not 1 <= m <= MAX_VERIFY_ROWS:
            raise ValueError(f"tokens: 1 to {MAX_VERIFY_ROWS} rows per verify pass, got {m}")
        self.row_tokens[:m].copy_(tokens.view(-1))
        self.pos.copy_(pos.view(1))
        self._run(Mode.VERIFY, m, True)
        return self.logits_rows[:m]

    # -- prefill ---------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, ids, all_logits: bool = False) -> torch.Tensor:
        """Process the prompt (positions 0..T-1) into the KV cache; return the last position's logits fp32 [V]
        (or every position's, [T, V], with all_logits)."""
        tokens = torch.as_tensor(ids, dtype=torch.long, device=self.device).view(-1)
        T = tokens.numel()
        if T > self.max_len:
            raise ValueError(f"prompt of {T} tokens exceeds the engine's KV cache of {self.max_len}")
        if T == 0:
            raise ValueError("prompt is empty")
        if self.options.prefill == "exact" or (not all_logits and self.short_exact(T)):
            return self.prefill_exact(tokens, all_logits)
        return self.prefill_pass(tokens, all_logits)

    @torch.inference_mode()
    def prefill_pass(self, tokens: torch.Tensor, all_logits: bool = False) -> torch.Tensor:
        """``prefill``'s one prompt pass (the default dequantizing pass, padded and captured where it can be, or the
        precise one), whatever the prompt's length: ``tokens`` [T] on the device, 1 <= T <= max_len."""
        T = tokens.numel()
        if not all_logits and self._pads_prefill(T):
            return self._prefill_padded(tokens)
        batch = ForwardBatch.prefill(tokens, 0, "all" if all_logits else "last")
        if self.options.prefill == "precise":
            from .precise import PreciseOps, no_tf32
            with no_tf32():
                logits = decoder_forward(batch, PreciseOps(self), self.model)
        else:
            logits = decoder_forward(batch, EngineOps(self, Mode.PREFILL), self.model)
        return logits if all_logits else logits[0]

    def short_exact(self, t: int) -> bool:
        """Whether the default prefill runs a prompt of t tokens as the exact prefill (16-row verify passes): on CUDA,
        t <= ``Options.exact_prefill_max``, every layer projection a 4-/8-bit codebook one (its 16-row GEMV costs
        about 1.3 decode steps where the dequantizing pass costs a dozen or more: BENCHMARKS.md, "Short prompts"),
        no mixture-of-experts or latent-attention layer. The choice depends on t and the model only (the same
        prompt always takes the same path, so the same bits)."""
        o = self.options
        if self.device.type != "cuda" or o.prefill != "default" or not 1 <= t <= o.exact_prefill_max:
            return False
        if self._codebook_layers is None:
            self._codebook_layers = not (self.cfg.moe or self.cfg.mla) and all(
                _codebook_kind(p) for p in self.model.projections()[1:])
        return self._codebook_layers

    def _pads_prefill(self, t: int) -> bool:
        """Whether the prompt runs padded (class docstring; captured when graphs are on): on CUDA, the default
        prefill, no layer whose prompt pass is data-dependent on the host (mixture of experts: per-expert token
        counts; latent attention), no RoPE whose tables depend on the pass length, the bucket inside the cache."""
        o, cfg = self.options, self.cfg
        return (self.device.type == "cuda" and o.prefill_graph and o.prefill == "default"
                and not cfg.moe and not cfg.mla and not any(r is not None and r.spec.length_dependent for r in self.rotaries)
                and prefill_bucket(t) <= self.max_len)

    def _prefill_pass(self, tp: int) -> torch.Tensor:
        """The padded prompt pass over ``prefill_tokens[:tp]``: logits fp32 [1, V] of row ``prefill_last``."""
        batch = ForwardBatch(Mode.PREFILL, self.prefill_tokens[:tp], 0, tp, "last", last_row=self.prefill_last)
        with _sdpa_backends():
            return decoder_forward(batch, EngineOps(self, Mode.PREFILL), self.model)

    def _prefill_padded(self, tokens: torch.Tensor) -> torch.Tensor:
        T = tokens.numel()
        tp = prefill_bucket(T)
        if self.prefill_tokens is None:
            self.prefill_tokens = torch.zeros(self.max_len, dtype=torch.long, device=self.device)
        self.prefill_tokens[:T].copy_(tokens)
        self.prefill_tokens[T:tp].zero_()
        self.prefill_last.fill_(T - 1)
        entry = self.prefill_graphs.get(tp)
        if entry is None and (not self.use_graph or self.host_embed or tp not in self._prefill_seen):
            # graphs off, the table in host RAM (a host gather in the pass), or a bucket's first use: eager (a
            # one-off prompt pays no capture)
            self._prefill_seen.add(tp)
            return self._prefill_pass(tp)[0]
        if entry is None:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):  # settle allocations and lazy handles off the capture
                self._prefill_pass(tp)
            torch.cuda.current_stream().wait_stream(s)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=self._pool):
                out = self._prefill_pass(tp)
            entry = self.prefill_graphs[tp] = (g, out)
        entry[0].replay()
        return entry[1][0].clone()

    @torch.inference_mode()
    def prefill_exact(self, tokens, all_logits: bool = False) -> torch.Tensor:
        """The prompt through the 16-row verify graph: cache rows and logits are bitwise those of decoding the prompt
        token by token. The last chunk is padded with token 0 to 16 rows (one graph for every prompt; the padding
        rows' cache entries lie past the prompt, where decoding writes before it reads: attention is causal), or,
        where 16 rows would pass the cache's end, split into chunks of 8, 4, 2, 1."""
        tokens = torch.as_tensor(tokens, dtype=torch.long, device=self.device).view(-1)
        T = tokens.numel()
        out = torch.empty(T if all_logits else 1, self.cfg.vocab_size, dtype=torch.float32, device=self.device)
        padded = torch.zeros(-(-T // MAX_VERIFY_ROWS) * MAX_VERIFY_ROWS, dtype=torch.long, device=self.device)
        padded[:T].copy_(tokens)
        p = 0
        while p < T:
            fits = p + MAX_VERIFY_ROWS <= self.max_len
            m = min(MAX_VERIFY_ROWS, T - p) if fits else next(c for c in EXACT_CHUNKS if c <= T - p)
            rows = self.verify(padded[p:p + (MAX_VERIFY_ROWS if fits else m)], p)
            if all_logits:
                out[p:p + m].copy_(rows[:m])
            elif p + m == T:
                out[0].copy_(rows[m - 1])
            p += m
        return out if all_logits else out[0]

    @torch.inference_mode()
    def logits_for(self, ids: torch.Tensor, decode: bool = False) -> torch.Tensor:
        """Logits fp32 [T, V] of every position of ``ids`` [T]: one prefill, or (decode=True) one
        prefill of the first token then a decode step per position (the self-check of the step)."""
        ids = torch.as_tensor(ids, dtype=torch.long, device=self.device).view(-1)
        if not decode:
            return self.prefill(ids, all_logits=True)
        out = torch.empty(ids.numel(), self.cfg.vocab_size, dtype=torch.float32, device=self.device)
        out[0] = self.prefill(ids[:1])
        for t in range(1, ids.numel()):
            self.set_position(ids[t], t)
            self.step(greedy=False)
            out[t] = self.logits
        return out

    # -- Runner protocol -------------------------------------------------------------------
    @torch.inference_mode()
    def tokens(self, prompt: list[int], s: GenerationSettings, max_len: int) -> Iterator[int]:
        """Sampled tokens, chosen on the GPU; the host reads each token while the next step runs."""
        if max_len > self.max_len:
            raise ValueError(f"{max_len} positions exceed the engine's KV cache of {self.max_len}")
        greedy = s.temperature == 0 and s.repetition_penalty == 1.0
        sampler = Sampler(s, self.cfg.vocab_size, self.device, prompt)
        logits = self.prefill(prompt)
        self.set_position(sampler(logits), len(prompt))
        on_gpu = self.device.type == "cuda"
        host = torch.zeros(1, dtype=torch.long, pin_memory=on_gpu)
        done = torch.cuda.Event() if on_gpu else None
        pos = len(prompt)  # position of the token in self.token
        while True:
            host.copy_(self.token, non_blocking=on_gpu)
            if done is not None:
                done.record()
            more = pos + 1 < max_len
            if more:  # queue the next step before reading this token back
                self.step(greedy)
                if not greedy:
                    sampler(self.logits, out=self.token)
            if done is not None:
                done.synchronize()
            yield int(host[0])
            if not more:
                return
            pos += 1
