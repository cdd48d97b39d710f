"""EngineOps: the GPU engine's executor of the model's blocks (models/blocks), one object per forward mode.

DECODE / VERIFY (M = 1..16 rows of one sequence at positions pos .. pos + M - 1; graph-captured):
    residual stream fp16 [M, D]; projections' batch-invariant GEMVs (``Projection.gemv``), the residual add
    fused into the o / down GEMV (``Options.fuse``); RMSNorm, RoPE + KV append + split-KV attention
    (``kernels.attention.attention_rows``: row r reduced exactly as a decode step at length pos + r + 1) and the
    gate/up activation as kernels. Every op works row by row, so row r of a VERIFY pass is bitwise the decode step
    at pos + r: the contract speculative decoding and the exact prefill rest on. Where the blocks name the one
    projection that reads an op's result (``feeds=``) and it takes its rows in fragment order (VERIFY, M >= 3: the
    mma GEMV, kernels/codebook_layout.py), RMSNorm, the attention merge and the gate/up epilogue write that order
    and hand over ``Fragments`` (``KernelOptions.frag_producers``): the same values, one copy launch fewer.
PREFILL (a prompt at positions start .. start + T - 1; not captured): residual stream fp32 [T, D] (as the CPU
    reference: fp16 rounding of two adds per layer drifts), projections dequantized and multiplied on tensor cores
    (``Projection.matmul``), attention by SDPA over the cache (fp32 scores where a softcap applies).
Activations are allocated per call: inside a captured graph they come from the graph's private pool (stable
addresses across replays); the logits go to the engine's static buffer.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from ..kernels import expert_gemv, moe_route
from ..kernels.attention import attention_rows
from ..kernels.codebook_layout import FRAG_ROWS
from ..kernels.fused import rmsnorm, rope_kv_append
from ..models.batch import ForwardBatch, Mode
from ..models.blocks.attention import row_heads
from ..models.blocks.moe import select_experts
from ..models.sparsity import DENSE_POSITIONS
from . import engine_latent
from .engine_experts import prefill_experts


class SparseRows:
    """A DECODE / VERIFY site input whose threshold select is deferred to the projection that reads it
    (EngineOps.sparsify): x fp16 [M, F], t the layer's threshold, dense bool [M, 1] (rows kept whole)."""
    __slots__ = ("x", "t", "dense")

    def __init__(self, x, t: float, dense):
        self.x, self.t, self.dense = x, t, dense

    def select(self):
        """The thresholded input itself: where(|x| > t | dense, x, 0) (t compared in x's dtype)."""
        keep = (self.x.abs() > self.t) | self.dense
        return torch.where(keep, self.x, torch.zeros((), dtype=self.x.dtype, device=self.x.device))


class EngineOps:
    def __init__(self, eng, mode: Mode):
        self.eng, self.cfg, self.mode = eng, eng.cfg, mode
        self.kopts = eng.options.kernels
        self.rows = mode is not Mode.PREFILL
        self._dense_rows = None  # [N, 1] bool: the rows sparsify leaves dense (one pass's rows, made on first use)

    def _frag_bits(self, feeds, m: int) -> int | None:
        """The fragment order the projection ``feeds`` reads m rows in, when this pass writes it (module docstring)."""
        if feeds is None or not self.rows or m < FRAG_ROWS or not self.kopts.frag_producers:
            return None
        return feeds.reads_fragments(m)

    # -- norms, adds, heads --------------------------------------------------------------------
    def norm(self, x, w, eps=None, feeds=None):
        return rmsnorm(x.contiguous(), w, self.cfg.rms_norm_eps if eps is None else eps, offset=self.cfg.norm_offset,
                       frag_bits=self._frag_bits(feeds, x.shape[0]) if x.dim() == 2 else None, kopts=self.kopts)

    def split(self, x, sizes):
        return [t.contiguous() for t in torch.split(x, list(sizes), dim=-1)]

    def add(self, x, y):
        return x + y

    def sparsify(self, x, t, batch: ForwardBatch):
        """x [N, F] * (|x| > t) (t compared in x's dtype), rows at positions < DENSE_POSITIONS unchanged
        (models/sparsity.py). PREFILL: the select (an elementwise torch op, row by row the same bits). DECODE /
        VERIFY: ``SparseRows``, the select deferred to the projection that reads it: a codebook projection with
        input-major codes (``enable_sparse``) and at most ``KernelOptions.sparse_rows`` rows fuses it into its
        sparse GEMV (the codes of zero inputs not read); any other materializes it (``SparseRows.select``)."""
        if self._dense_rows is None:
            pos = torch.arange(x.shape[0], device=x.device, dtype=torch.int32) + batch.start
            self._dense_rows = (pos < DENSE_POSITIONS).view(-1, 1)
        if self.rows:
            return SparseRows(x, float(t), self._dense_rows)
        return SparseRows(x, float(t), self._dense_rows).select()

    def _sparse(self, w, x) -> bool:
        """Whether ``w`` takes the SparseRows ``x`` through its sparse GEMV (else the caller selects, dense path)."""
        return getattr(w, "sparse_ready", False) and x.x.shape[0] <= self.kopts.sparse_rows

    def heads(self, qkv):
        return row_heads(self.cfg, qkv)

    # -- projections -------------------------------------------------------------------------
    def project(self, w, x, residual=None):
        if isinstance(x, SparseRows):
            if not self._sparse(w, x):
                x = x.select()
            else:
                out = torch.empty(x.x.shape[0], w.out_features, dtype=torch.float16, device=x.x.device)
                fuse = residual is not None and self.eng.options.fuse
                w.sparse_gemv(x.x, x.t, x.dense, out, residual=residual if fuse else None)
                return out if residual is None or fuse else residual + out
        if not self.rows:
            y = w.matmul(x)
            return y if residual is None else residual + y
        out = torch.empty(x.shape[0], w.out_features, dtype=torch.float16, device=x.device)
        if residual is not None and self.eng.options.fuse:
            return w.gemv(x, out, residual=residual)
        w.gemv(x, out)
        return out if residual is None else residual + out

    def gate_up(self, w, x, feeds=None):
        if isinstance(x, SparseRows):
            if not self._sparse(w, x):
                x = x.select()
            else:
                out = torch.empty(x.x.shape[0], w.f, dtype=torch.float16, device=x.x.device)
                return w.sparse_gemv(x.x, x.t, x.dense, out)
        if not self.rows:
            return w.matmul(x)
        b = self._frag_bits(feeds, x.shape[0]) if w.writes_fragments else None
        if b is not None:
            return w.gemv(x, None, out_frag_bits=b)
        return w.gemv(x, torch.empty(x.shape[0], w.f, dtype=torch.float16, device=x.device))

    # -- embedding and logits ----------------------------------------------------------------
    def embed(self, table, batch: ForwardBatch):
        eng = self.eng
        if self.rows:
            if eng.host_embed:  # the table in host RAM: the rows were uploaded before this pass (engine._upload_rows)
                x = eng.embed_rows[:batch.tokens.shape[0]].clone()
            else:
                x = torch.index_select(table, 0, batch.tokens)  # [M, D] fp16
            return x.mul_(eng.embed_scale) if eng.embed_scale is not None else x
        if eng.host_embed:
            x = table[batch.tokens.cpu()].to(eng.device).float()
        else:
            x = table[batch.tokens].float()  # [T, D]
        return x * eng.embed_scale if eng.embed_scale is not None else x

    def logits(self, head, h):
        cap = self.cfg.final_softcap
        if not self.rows:
            logits = head.matmul(h.contiguous()).float()
            return torch.tanh(logits / cap) * cap if cap is not None else logits
        m = h.shape[0]
        out = self.eng.logits_rows[:m]
        out.copy_(head.gemv(h, torch.empty(m, head.out_features, dtype=torch.float16, device=h.device)))
        if cap is not None:
            out.div_(cap).tanh_().mul_(cap)
        return out

    # -- attention ---------------------------------------------------------------------------
    def attend(self, q, k, v, batch: ForwardBatch, p, feeds=None):
        eng, cfg = self.eng, self.cfg
        kc, vc = eng.kv.k[p.layer], eng.kv.v[p.layer]
        window = cfg.sliding_window if p.sliding else None
        if self.rows:
            cos, sin = eng.rope_local if p.sliding else eng.rope
            out = torch.empty(q.shape[0], cfg.num_heads, eng.head_dim, dtype=torch.float16, device=q.device)
            fused = eng.options.attention == "fused"
            res = attention_rows(q, k, v, kc, vc, batch.start, cos, sin, scale=cfg.scale, window=window,
                                 softcap=cfg.attn_softcap, out=out, workspace=eng.attn_ws, config=eng.attn_config,
                                 fused=fused, frag_bits=self._frag_bits(feeds, q.shape[0]) if fused else None,
                                 kopts=self.kopts)
            return res if res is not out else out.view(q.shape[0], -1)
        start = int(batch.start)
        cos, sin = eng.pass_rope(p.sliding, start, q.shape[0])
        return self._prefill_attention(q, k, v, kc, vc, start, cos, sin, window)

    def _prefill_attention(self, q, k, v, kc, vc, start, cos, sin, window):
        cfg = self.cfg
        T, Hq, hd = q.shape
        Hkv = k.shape[1]
        q = q.contiguous()
        rope_kv_append(q, k, v, kc, vc, start, cos, sin, kopts=self.kopts)
        S = start + T
        kk, vv = kc[:, :S].unsqueeze(0), vc[:, :S].unsqueeze(0)  # [1, Hkv, S, hd]
        rep = Hq // Hkv
        if rep > 1:
            kk, vv = kk.repeat_interleave(rep, 1), vv.repeat_interleave(rep, 1)
        qq = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, T, hd]
        qi = torch.arange(start, S, device=q.device)[:, None]
        kj = torch.arange(S, device=q.device)[None, :]
        mask = kj <= qi
        if window is not None:
            mask = mask & (qi - kj < window)
        if cfg.attn_softcap is None:
            if window is None and start == 0:
                a = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=cfg.scale)
            else:
                a = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=cfg.scale)
        else:
            s = (qq.float() @ kk.float().transpose(-1, -2)) * cfg.scale
            s = torch.tanh(s / cfg.attn_softcap) * cfg.attn_softcap
            a = (s.masked_fill(~mask, float("-inf")).softmax(-1) @ vv.float()).to(torch.float16)
        return a[0].transpose(0, 1).reshape(T, Hq * hd)

    # -- mixture of experts (models/blocks/moe.py) -----------------------------------------------
    # The router is a batch-invariant fp16 GEMV; the scores and top-k run on the device (rows without group limits:
    # kernels/moe_route.py, one launch; else select_experts' sort / gather / scatter): no host sync, capturable. DECODE / VERIFY rows of a layer with stacked experts (runtime/engine_experts.py) run
    # only the chosen experts: kernels/expert_gemv.py, two launches with the ids read on the device, each row its
    # own programs (its bits alone). PREFILL runs each expert over the tokens that chose it
    # (engine_experts.prefill_experts). Otherwise (unstacked schemes, no Triton) every expert runs over every row
    # (batch-invariant GEMVs) and row r adds expert e's output times its weight (0 for the experts it did not
    # choose), in ascending e, in fp32: E / k times the chosen experts' work. Routed experts in host RAM
    # (runtime/host_experts.py): the rows, weights and ids go to the host, the chosen experts run there.
    def route(self, router, h):
        logits = self.project(router.proj, h)  # [M, E] fp16
        cfg = self.cfg
        if self.rows and moe_route.applies(cfg) and moe_route.available(h.device):  # one launch, no groups
            return moe_route.route(logits, cfg.num_experts_per_tok, cfg.router_scoring, cfg.norm_topk_prob,
                                   cfg.routed_scaling_factor, router.bias)
        return select_experts(logits.float(), cfg, router.bias)

    def experts(self, experts, h, weights, idx):
        if getattr(experts, "on_host", False):  # routed experts in host RAM (runtime/host_experts.py)
            return experts.run(h.contiguous(), weights, idx, self.eng.host_staging)
        stack = getattr(experts, "stack", None)
        if self.rows and stack is not None and expert_gemv.available(h.device):
            return stack.run(h.contiguous(), weights, idx, gather=self.kopts.triton_gather, kopts=self.kopts)
        if not self.rows:  # each expert over the tokens that chose it (engine_experts.py)
            return prefill_experts(self, experts, h, weights, idx)
        out = torch.zeros(h.shape[0], self.cfg.hidden_size, dtype=torch.float32, device=h.device)
        for e, ex in enumerate(experts):
            c = torch.where(idx == e, weights, torch.zeros_like(weights)).sum(-1, keepdim=True)  # one match: exact
            y = self.project(ex.down, self.gate_up(ex.gate_up, h))
            out += c * y.float()
        return out.to(h.dtype)

    def sigmoid_gate(self, w, h, y):
        # float64 sigmoid: a CPU elementwise kernel's vector body and scalar tail differ in float32 (moe.py)
        g = torch.sigmoid(self.project(w, h).double()).to(torch.float32)
        return (g * y.float()).to(y.dtype)

    # -- latent attention (models/blocks/mla.py) ---------------------------------------------------
    # The new rows' keys and values are expanded through kv_b once and cached per head ([H, T_max, P] with
    # P = max(head_dim, v_head_dim), zero-padded), the rotary part first: q_h = [RoPE(q_rot_h), q_nope_h, 0],
    # k_h = [RoPE(k_rot), k_nope_h, 0] (de-interleaved, so the kernels' rotate-half RoPE of the first qk_rope
    # features is DeepSeek's interleaved rotation), v_h = [v_h, 0]; then the engine's ordinary attention (its
    # contracts hold as they are). Options.mla "latent": the absorbed form over the compressed latent cache
    # (kv_lora_rank + qk_rope per position), runtime/engine_latent.py.
    def latent_attend(self, q, c, k_rot, batch: ForwardBatch, p):
        if self.eng.latent:  # Options.mla "latent": the absorbed form over the latent cache
            return engine_latent.attend(self, q, c, k_rot, batch, p)
        cfg = self.cfg
        n, H = q.shape[0], cfg.num_heads
        nope, rope, vd, P = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim, self.eng.head_dim
        perm = self.eng.rope_perm  # on the device already: nothing crosses from the host inside a graph
        q = q.view(n, H, cfg.head_dim)
        kv = self.project(p.kv_b, c).view(n, H, nope + vd)
        kr = k_rot.view(n, 1, rope)
        if perm is not None:
            kr = kr[..., perm]
        # as few launches as the layout allows (a decode step runs this per layer): q in one gather
        # (eng.mla_q_index), k in one concatenation, zeros only for padding that exists (P > its width)
        qq = q.index_select(-1, self.eng.mla_q_index)
        parts = [kr.expand(n, H, rope), kv[..., :nope]]
        if P > rope + nope:
            pad = torch.zeros(n, H, P - rope - nope, dtype=q.dtype, device=q.device)
            qq, parts = torch.cat([qq, pad], -1), parts + [pad]
        kk = torch.cat(parts, -1)
        if vd == P:
            vv = kv[..., nope:].contiguous()
        else:
            vv = torch.zeros(n, H, P, dtype=q.dtype, device=q.device)
            vv[..., :vd] = kv[..., nope:]
        a = self.attend(qq, kk, vv, batch, p)  # [n, H * P]
        return a.view(n, H, P)[..., :vd].reshape(n, H * vd).contiguous()
