"""GPU decode engine: static buffers, fused kernels, the decode step replayed as one CUDA graph.

Data path of one decode step (all buffers static, positions in device tensors):
    x = embed[token] (* scale)
    per layer: h = rmsnorm(x); qkv = Wqkv h (+b); [q/k norm];
               a = RoPE + KV append + split-KV attention (one kernel), merge; x = Wo a + x; h = rmsnorm(x);
               g = act(Wg h) * (Wu h); x = Wd g + x
    logits = Whead rmsnorm(x) (softcap); greedy: token = argmax(logits); pos += 1
Prefill dequantizes each projection and multiplies on tensor cores (cuBLAS), attention by SDPA.

Kill switches (read when the engine is built): TRAPETUM_GRAPH=0 (eager steps), TRAPETUM_FUSE=0
(separate q/k/v and gate/up GEMVs, separate residual adds), TRAPETUM_TC=0 (no tensor-core GEMV,
inside the kernels). TRAPETUM_ATTN is read at each step's launches instead, i.e. when a graph is captured
(clear engine.graphs after changing it). By default RoPE + KV append run inside the split-KV attention
kernel, then the merge kernel (two launches per layer). TRAPETUM_ATTN=unfused: RoPE + KV append, split-KV attention and its merge as
three launches (the path before decode_attention_fused); =seq: the same with the sequential attention
kernel; =inline-merge: one launch, the merge done by the last program of each kv head. The inline merge
runs G * D / BLOCK_DM dependent steps in one program: on the H200 it lost to the merge kernel everywhere
but MHA at short context (NOTES-engine.md, session 5), so it is opt-in.
Layers with q/k norm (Gemma-3) keep their two per-head RMSNorm launches before the fused kernel: folding
them in would change how the norm's sum of squares is reduced, so the cache would no longer hold the bits
the unfused path writes.
Opt-in: TRAPETUM_PREFILL=precise (or precise_prefill=True): the prompt pass at fp32-reference accuracy
for evaluation (fp32 activations, hi/lo-split fp16 GEMMs with fp32 outputs, fp32 attention; ~2-3x the
GEMM work; runtime/precise.py). TRAPETUM_PREFILL=default (or unset) is the fast path; other values
are an error.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Iterator

import torch
import torch.nn.functional as F

from ..kernels.attention import attention_workspace, decode_attention, decode_attention_fused, fixed_chunk_config
from ..kernels.fused import rmsnorm, rope_kv_append, rope_tables
from ..models.decoder import Decoder
from .precise import PrecisePrefill, precise_enabled
from .projections import GateUp, make_proj, release_codes
from .sampling import GenerationSettings, Sampler


def env_on(name: str, default: str = "1") -> bool:
    return os.environ.get(name, default) not in ("0", "false", "off", "")


@dataclass
class LayerW:
    in_norm: torch.Tensor
    ffn_norm: torch.Tensor
    post_attn: torch.Tensor | None
    post_ffn: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    qkv: list  # one fused projection, or [q, k, v] unfused
    o: object
    gate_up: GateUp
    down: object
    sliding: bool


class GpuEngine:
    """Batch-1 decoding of a Decoder on one GPU. Implements the Runner protocol (``tokens``)."""

    def __init__(self, decoder: Decoder, max_len: int, *, fuse: bool | None = None, graph: bool | None = None,
                 precise_prefill: bool | None = None, own_weights: bool = False):
        cfg = self.cfg = decoder.config
        dev = self.device = next(decoder.parameters()).device
        self.fuse = env_on("TRAPETUM_FUSE") if fuse is None else fuse
        self.use_graph = (env_on("TRAPETUM_GRAPH") if graph is None else graph) and dev.type == "cuda"
        self.max_len = max_len
        half = torch.float16
        m = decoder.model
        self.embed = m.embed_tokens.dequantize().to(device=dev, dtype=half)
        self.embed_scale = torch.tensor(cfg.embed_scale, dtype=half) if cfg.embed_scale is not None else None
        w = lambda n: n.weight.data.to(device=dev, dtype=torch.float32)  # noqa: E731
        self.layers: list[LayerW] = []
        for i, blk in enumerate(m.layers):
            a, mlp = blk.self_attn, blk.mlp
            qkv = ([make_proj([a.q_proj, a.k_proj, a.v_proj], dev)] if self.fuse else
                   [make_proj([p], dev) for p in (a.q_proj, a.k_proj, a.v_proj)])
            sw = cfg.sandwich_norms
            self.layers.append(LayerW(
                in_norm=w(blk.input_layernorm),
                ffn_norm=w(blk.pre_feedforward_layernorm if sw else blk.post_attention_layernorm),
                post_attn=w(blk.post_attention_layernorm) if sw else None,
                post_ffn=w(blk.post_feedforward_layernorm) if sw else None,
                q_norm=w(a.q_norm) if cfg.qk_norm else None, k_norm=w(a.k_norm) if cfg.qk_norm else None,
                qkv=qkv, o=make_proj([a.o_proj], dev),
                gate_up=GateUp(mlp.gate_proj, mlp.up_proj, cfg.hidden_act, dev, fuse=self.fuse),
                down=make_proj([mlp.down_proj], dev), sliding=cfg.layer_types[i] == "sliding"))
        self.final_norm = w(m.norm)
        self.head = make_proj([decoder.lm_head], dev)
        rot = cfg.rotary_dim
        self.rope = rope_tables(max_len, rot, inv_freq=decoder.rope_global.inv_freq, device=dev)
        self.rope_local = (rope_tables(max_len, rot, inv_freq=decoder.rope_local.inv_freq, device=dev)
                           if decoder.rope_local is not None else self.rope)
        self._alloc()
        # The attention config: None lets choose_config pick at capture (8 length-adaptive splits per kv head with
        # >= 32 kv heads). An engine whose o projections are dense fp16 GEMVs keeps fixed 64-position chunks: with the
        # splits the fp16 Llama-2-7B decoded ~10% slower at both 128 and 4k positions (H200, session 6: 238 vs 266
        # and 210 vs 231 tok/s, both orders in one process) while the 4-bit one gained 3%; the attention kernel
        # alone was not slower (NOTES-engine.md). TRAPETUM_ATTN_CONFIG still overrides both.
        dense = all(L.o.kind == "fp16" for L in self.layers)
        self.attn_config = fixed_chunk_config(cfg.head_dim, cfg.num_heads // cfg.num_kv_heads) if dense else None
        self.graphs: dict[bool, torch.cuda.CUDAGraph] = {}
        # fp32-accurate prefill (None: the default); exact weights where the decoder holds non-fp16 ones
        self.precise = PrecisePrefill(self, decoder) if precise_enabled(precise_prefill) else None
        # own_weights: free the decoder's codes that only the engine's own layouts (tiled, interleaved,
        # packed) serve now, so a model's codes are not held twice; the decoder then refuses forward()
        self.released_bytes = self._release(decoder) if own_weights else 0
        # the release step was the only use of the projections' references to the decoder's modules: drop
        # them, or an engine would keep a decoder it was built from (and its canonical codes) alive
        for p in self._projections():
            if isinstance(p, GateUp):
                p.forget_sources()
            else:
                p.sources = []

    def _projections(self) -> list:
        return [self.head] + [p for lw in self.layers for p in (*lw.qkv, lw.o, lw.gate_up, lw.down)]

    def _release(self, decoder: Decoder) -> int:
        mods = {id(m): m for p in self._projections() for m in p.sources}
        freed = sum(release_codes(m) for m in mods.values())
        if mods:
            decoder.released = f"{len(mods)} projections' codes, {freed / 1e6:.1f} MB"
        return freed

    # -- buffers ---------------------------------------------------------------------------
    def _alloc(self) -> None:
        cfg, dev, half = self.cfg, self.device, torch.float16
        Hq, Hkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        shape = (cfg.num_layers, Hkv, self.max_len, hd)
        self.k_cache = torch.zeros(shape, dtype=half, device=dev)
        self.v_cache = torch.zeros(shape, dtype=half, device=dev)
        self.token = torch.zeros(1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(1, dtype=torch.int32, device=dev)  # position of `token`
        self.length = torch.ones(1, dtype=torch.int32, device=dev)  # pos + 1 (attention span)
        D, I = cfg.hidden_size, cfg.intermediate_size
        self.x = [torch.zeros(D, dtype=half, device=dev) for _ in range(2)]
        self.h = torch.zeros(D, dtype=half, device=dev)
        self.t = torch.zeros(D, dtype=half, device=dev)
        self.qkv = torch.zeros((Hq + 2 * Hkv) * hd, dtype=half, device=dev)
        self.attn = torch.zeros(Hq, hd, dtype=half, device=dev)
        self.g = torch.zeros(I, dtype=half, device=dev)
        self.gu = torch.zeros(2 * I, dtype=half, device=dev)
        self.logits16 = torch.zeros(cfg.vocab_size, dtype=half, device=dev)
        self.logits = torch.zeros(cfg.vocab_size, dtype=torch.float32, device=dev)
        self.ws = attention_workspace(Hq, hd, self.max_len, dev)

    def weight_bytes(self) -> int:
        n = self.embed.numel() * 2 + self.head.nbytes()
        for L in self.layers:
            n += sum(p.nbytes() for p in L.qkv) + L.o.nbytes() + L.gate_up.nbytes() + L.down.nbytes()
        return n

    # -- one decode step over static buffers ---------------------------------------------------
    def _step(self, greedy: bool) -> None:
        cfg = self.cfg
        Hq, Hkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        eps, off = cfg.rms_norm_eps, cfg.norm_offset
        x, x2 = self.x
        torch.index_select(self.embed, 0, self.token, out=x.view(1, -1))
        if self.embed_scale is not None:
            x.mul_(self.embed_scale)
        qd, kd = Hq * hd, Hkv * hd
        for li, L in enumerate(self.layers):
            rmsnorm(x, L.in_norm, eps, offset=off, out=self.h)
            if len(L.qkv) == 1:
                L.qkv[0].gemv(self.h, self.qkv)
            else:
                for p, sl in zip(L.qkv, (slice(0, qd), slice(qd, qd + kd), slice(qd + kd, qd + 2 * kd))):
                    p.gemv(self.h, self.qkv[sl])
            q = self.qkv[:qd].view(Hq, hd)
            k = self.qkv[qd:qd + kd].view(Hkv, hd)
            v = self.qkv[qd + kd:].view(Hkv, hd)
            if L.q_norm is not None:
                rmsnorm(q, L.q_norm, eps, offset=off, out=q)
                rmsnorm(k, L.k_norm, eps, offset=off, out=k)
            self._attention(li, L, q, k, v)
            a = self.attn.view(-1)
            if L.post_attn is not None:
                L.o.gemv(a, self.t)
                rmsnorm(self.t, L.post_attn, eps, offset=off, out=self.t)
                x.add_(self.t)
            elif self.fuse:
                L.o.gemv(a, x2, residual=x)
                x, x2 = x2, x
            else:
                L.o.gemv(a, self.t)
                x.add_(self.t)
            rmsnorm(x, L.ffn_norm, eps, offset=off, out=self.h)
            L.gate_up.gemv(self.h, self.g, self.gu)
            if L.post_ffn is not None:
                L.down.gemv(self.g, self.t)
                rmsnorm(self.t, L.post_ffn, eps, offset=off, out=self.t)
                x.add_(self.t)
            elif self.fuse:
                L.down.gemv(self.g, x2, residual=x)
                x, x2 = x2, x
            else:
                L.down.gemv(self.g, self.t)
                x.add_(self.t)
        rmsnorm(x, self.final_norm, eps, offset=off, out=self.h)
        self.head.gemv(self.h, self.logits16)
        self.logits.copy_(self.logits16)
        if cfg.final_softcap is not None:
            self.logits.div_(cfg.final_softcap).tanh_().mul_(cfg.final_softcap)
        if greedy:
            torch.argmax(self.logits, dim=0, keepdim=True, out=self.token)
        self.pos.add_(1)
        self.length.add_(1)

    def _attention(self, li: int, L: LayerW, q, k, v) -> None:
        """self.attn = attention of the new token (un-roped q, k, v) at self.pos, its k and v appended to layer
        li's cache: the fused split kernel and the merge kernel (one launch with TRAPETUM_ATTN=inline-merge), or
        rope_kv_append + decode_attention (TRAPETUM_ATTN=unfused / seq)."""
        cfg = self.cfg
        cos, sin = self.rope_local if L.sliding else self.rope
        kc, vc = self.k_cache[li], self.v_cache[li]
        kw = dict(scale=cfg.scale, window=cfg.sliding_window if L.sliding else None, softcap=cfg.attn_softcap,
                  out=self.attn, workspace=self.ws,
                  config=None if os.environ.get("TRAPETUM_ATTN_CONFIG") else self.attn_config)
        mode = os.environ.get("TRAPETUM_ATTN", "split")
        if mode in ("unfused", "seq"):  # decode_attention reads "seq" itself
            rope_kv_append(q, k, v, kc, vc, self.pos, cos, sin)
            decode_attention(q, kc, vc, self.length, **kw)
        else:
            decode_attention_fused(q, k, v, kc, vc, self.pos, cos, sin, inline_merge=mode == "inline-merge", **kw)

    def step(self, greedy: bool = True) -> None:
        """Run one decode step (graph replay when enabled). Reads self.token/self.pos."""
        if not self.use_graph:
            self._step(greedy)
            return
        g = self.graphs.get(greedy)
        if g is None:
            g = self._capture(greedy)
        g.replay()

    def _capture(self, greedy: bool) -> torch.cuda.CUDAGraph:
        saved = (self.token.clone(), self.pos.clone(), self.length.clone())
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):  # compile Triton kernels, load the extension, settle allocations
                self._restore(saved)
                self._step(greedy)
        torch.cuda.current_stream().wait_stream(s)
        self._restore(saved)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            self._step(greedy)
        self._restore(saved)
        self.graphs[greedy] = g
        return g

    def _restore(self, saved) -> None:
        self.token.copy_(saved[0])
        self.pos.copy_(saved[1])
        self.length.copy_(saved[2])

    def set_position(self, token: int | torch.Tensor, pos: int) -> None:
        if isinstance(token, torch.Tensor):
            self.token.copy_(token.view(1))
        else:
            self.token.fill_(int(token))
        self.pos.fill_(pos)
        self.length.fill_(pos + 1)

    # -- prefill ---------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, ids: list[int] | torch.Tensor, all_logits: bool = False) -> torch.Tensor:
        """Process the prompt (positions 0..T-1) into the KV cache; return the last position's logits
        fp32 [V] (or every position's, [T, V], with all_logits)."""
        cfg = self.cfg
        tokens = torch.as_tensor(ids, dtype=torch.long, device=self.device).view(-1)
        T = tokens.numel()
        if T > self.max_len:
            raise ValueError(f"prompt of {T} tokens exceeds the engine's KV cache of {self.max_len}")
        if self.precise is not None:
            return self.precise.prefill(self, tokens, all_logits)
        Hq, Hkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        eps, off = cfg.rms_norm_eps, cfg.norm_offset
        # The residual stream stays in fp32 (as in the CPU reference; fp16 rounding of 2 adds per
        # layer drifts: ~5e-3 relative logit error on SmolLM2-135M, an fp16 torch run's own level).
        x = self.embed[tokens].float()  # [T, D]
        if self.embed_scale is not None:
            x = x * self.embed_scale
        qd, kd = Hq * hd, Hkv * hd
        pos_i = torch.arange(T, device=self.device)
        causal = pos_i[None, :] <= pos_i[:, None]
        for li, L in enumerate(self.layers):
            h = rmsnorm(x, L.in_norm, eps, offset=off)
            qkv = torch.cat([p.matmul(h) for p in L.qkv], dim=1) if len(L.qkv) > 1 else L.qkv[0].matmul(h)
            q = qkv[:, :qd].reshape(T, Hq, hd)
            k = qkv[:, qd:qd + kd].reshape(T, Hkv, hd)
            v = qkv[:, qd + kd:].reshape(T, Hkv, hd)
            if L.q_norm is not None:
                q = rmsnorm(q, L.q_norm, eps, offset=off)
                k = rmsnorm(k, L.k_norm, eps, offset=off)
            cos, sin = self.rope_local if L.sliding else self.rope
            kc, vc = self.k_cache[li], self.v_cache[li]
            q = q.contiguous()
            rope_kv_append(q, k, v, kc, vc, 0, cos, sin)
            kk, vv = kc[:, :T].unsqueeze(0), vc[:, :T].unsqueeze(0)  # [1, Hkv, T, hd]
            rep = Hq // Hkv
            if rep > 1:
                kk, vv = kk.repeat_interleave(rep, 1), vv.repeat_interleave(rep, 1)
            qq = q.transpose(0, 1).unsqueeze(0)  # [1, Hq, T, hd]
            mask = causal
            if L.sliding:
                mask = mask & (pos_i[:, None] - pos_i[None, :] < cfg.sliding_window)
            if cfg.attn_softcap is None:
                if L.sliding:
                    a = F.scaled_dot_product_attention(qq, kk, vv, attn_mask=mask, scale=cfg.scale)
                else:
                    a = F.scaled_dot_product_attention(qq, kk, vv, is_causal=True, scale=cfg.scale)
            else:
                s = (qq.float() @ kk.float().transpose(-1, -2)) * cfg.scale
                s = torch.tanh(s / cfg.attn_softcap) * cfg.attn_softcap
                a = (s.masked_fill(~mask, float("-inf")).softmax(-1) @ vv.float()).to(torch.float16)
            a = a[0].transpose(0, 1).reshape(T, qd)
            o = L.o.matmul(a)
            if L.post_attn is not None:
                o = rmsnorm(o.contiguous(), L.post_attn, eps, offset=off)
            x = x + o
            h = rmsnorm(x, L.ffn_norm, eps, offset=off)
            d = L.down.matmul(L.gate_up.matmul(h))
            if L.post_ffn is not None:
                d = rmsnorm(d.contiguous(), L.post_ffn, eps, offset=off)
            x = x + d
        h = rmsnorm((x if all_logits else x[-1:]).contiguous(), self.final_norm, eps, offset=off)
        logits = self.head.matmul(h).float()
        logits = logits if all_logits else logits[0]
        if cfg.final_softcap is not None:
            logits = torch.tanh(logits / cfg.final_softcap) * cfg.final_softcap
        return logits

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
