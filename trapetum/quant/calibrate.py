"""Calibration: E[x^2] of every input channel of every projection, from calibration tokens.

Two sources of calibration tokens:

* a text file (``--calib FILE``): tokenized once without special tokens and cut into
  ``n_seqs`` windows of ``seq_len`` tokens spread evenly over the file (for example
  WikiText-2 ``valid.txt`` or Tiny Shakespeare; never the evaluation text);
* the default, **no dataset**: text sampled from the model itself. ``n_seqs`` sequences start
  from BOS (or, when the model has none, from one token drawn uniformly from the first 1,000
  ids), and ``seq_len - 1`` tokens are drawn at temperature 1.0 with top-p 0.95 through the
  KV cache, all sequences in one batch, with a fixed seed (so the recipe is reproducible).
  Sampling from the model covers the inputs the model actually produces, needs no data file,
  and works for any model; ``QUALITY.md`` compares it with file calibration.

``collect_input_stats_layerwise`` gives the same statistics from a checkpoint with bounded
memory (one block of the source at a time); ``quantize.py`` uses it for file calibration.

Memory of the sampled default (``sampling_decoder``): the fp32 size of the source is estimated from
its config's shapes (nothing is read). When it fits the memory budget, the whole fp32 model is built
and samples (fast). Otherwise ``streamed_decoder`` samples: a ``Decoder`` whose embedding, blocks and
LM head are each built from the (lazy) checkpoint for their part of every token step, run, and
dropped, so it holds one block (or the embedding, or the head) plus the KV caches of all blocks
([n_seqs, kv heads, seq_len, head_dim] each); the statistics then come from
``collect_input_stats_layerwise``. Both decoders do the same float32 operations and go through the
same sampling code, so the tokens (and the recipe's result) do not depend on the path; the streamed
one re-reads every block at every token step and is slow for large models (the page cache helps
when RAM allows; ``--calib FILE`` is much faster). The budget is the caller's ``budget_gb`` (in GB of
10^9 bytes; the CLI passes ``settings.Options.calib_mem_gb``, i.e. ``TRAPETUM_CALIB_MEM_GB``) when given,
else half of the free memory: ``MemAvailable`` of ``/proc/meminfo`` on the CPU, ``torch.cuda.mem_get_info``
on CUDA. Nothing here reads the environment.

Statistics are collected with forward pre-hooks on every projection (q/k/v/o, gate/up/down and
lm_head): for each projection the mean over all calibration tokens of x_j^2, float64 sums,
returned as float32 [in_features]. Projections that share an input (q/k/v, gate/up) get equal
statistics.
"""
from __future__ import annotations

import math
import os
from dataclasses import replace
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from ..errors import TrapetumError
from ..models.checkpoint import Checkpoint, LazyTensors
from ..models.decoder import Router
from ..models.schema import expected_shapes

__all__ = ["file_calibration_tokens", "sampled_calibration_tokens", "collect_input_stats",
           "collect_input_stats_layerwise", "streamed_decoder", "sampling_decoder", "model_fp32_bytes",
           "memory_budget", "MEM_ENV"]

MEM_ENV = "TRAPETUM_CALIB_MEM_GB"  # named in the log line: the CLI reads it into budget_gb (settings.py)


def file_calibration_tokens(tokenizer, path: str | Path, n_seqs: int = 32, seq_len: int = 512) -> torch.Tensor:
    """[n, seq_len] token windows spread evenly over a text file (no special tokens)."""
    try:
        text = Path(path).read_text(encoding="utf-8", errors="replace")
    except OSError as e:
        raise TrapetumError(f"cannot read calibration file {path}: {e.strerror or e}") from None
    ids = torch.tensor(tokenizer.encode(text, add_special_tokens=False), dtype=torch.long)
    if ids.numel() < seq_len:
        raise TrapetumError(f"calibration file {path} has {ids.numel()} tokens, fewer than one window of {seq_len}")
    n_avail = ids.numel() // seq_len
    n = min(n_seqs, n_avail)
    starts = torch.linspace(0, n_avail - 1, n).round().long() * seq_len
    return torch.stack([ids[s:s + seq_len] for s in starts.tolist()])


@torch.inference_mode()
def sampled_calibration_tokens(decoder, bos_id: int | None, n_seqs: int = 32, seq_len: int = 256,
                               seed: int = 0, temperature: float = 1.0, top_p: float = 0.95,
                               progress: bool = True) -> torch.Tensor:
    """[n_seqs, seq_len] tokens sampled from the model itself (the no-dataset default)."""
    p = next(decoder.parameters())
    g = torch.Generator(device="cpu").manual_seed(seed)
    if bos_id is not None:
        first = torch.full((n_seqs, 1), int(bos_id), dtype=torch.long)
    else:
        first = torch.randint(0, min(1000, decoder.config.vocab_size), (n_seqs, 1), generator=g)
    out = [first]
    cache = decoder.new_cache(batch=n_seqs, max_len=seq_len)
    cur = first.to(p.device)
    it = range(seq_len - 1)
    if progress:
        from tqdm import tqdm
        it = tqdm(it, desc="calibration: sampling", unit="tok", leave=False, dynamic_ncols=True)
    for t in it:
        logits = decoder(cur, cache=cache, start_pos=t)[:, -1].float().cpu()  # [B, V]
        probs = torch.softmax(logits / temperature, -1)
        sp, si = probs.sort(-1, descending=True)
        keep = sp.cumsum(-1) - sp < top_p  # smallest prefix whose mass reaches top_p
        sp = sp * keep
        nxt = si.gather(-1, torch.multinomial(sp / sp.sum(-1, keepdim=True), 1, generator=g))
        out.append(nxt)
        cur = nxt.to(p.device)
    return torch.cat(out, 1)


@torch.inference_mode()
def collect_input_stats(decoder, tokens: torch.Tensor, batch: int = 4, names: list[str] | None = None,
                        progress: bool = True) -> dict[str, torch.Tensor]:
    """E[x^2] per input channel of each projection over every token of ``tokens`` [N, L].

    Returns canonical projection name (``model.layers.0.self_attn.q_proj``, ``lm_head``) ->
    float32 [in_features] on the CPU."""
    projs = dict(decoder.projections())
    projs.update(decoder.routers() if hasattr(decoder, "routers") else {})  # every row of an MoE layer
    if names is not None:
        projs = {n: m for n, m in projs.items() if n in names}
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    hooks = []

    square_sums = _SquareSums()

    def make_hook(name):
        def hook(mod, args):
            s, n = square_sums(args[0])
            if name in sums:
                sums[name] += s
            else:
                sums[name] = s
            counts[name] = counts.get(name, 0) + n
        return hook

    for n, m in projs.items():
        hooks.append(m.register_forward_pre_hook(make_hook(n)))
    p = next(decoder.parameters())
    try:
        it = range(0, tokens.shape[0], batch)
        if progress:
            from tqdm import tqdm
            it = tqdm(it, desc="calibration: statistics", unit="batch", leave=False, dynamic_ncols=True)
        for i in it:
            decoder(tokens[i:i + batch].to(p.device))
    finally:
        for h in hooks:
            h.remove()
    if not sums:
        raise TrapetumError("calibration saw no projection inputs")
    return Stats({n: (sums[n] / counts[n]).float().cpu() for n in sums}, counts)


@torch.inference_mode()
def collect_input_stats_layerwise(ckpt, tokens: torch.Tensor, device: str | torch.device = "cpu", batch: int = 4,
                                  progress: bool = True, hessians: bool = False) -> dict[str, torch.Tensor]:
    """Same statistics as ``collect_input_stats`` with bounded memory: one block at a time.

    The calibration hidden states ([N, L, hidden], fp32) are pushed through the source model one
    block at a time; each block is built alone from the (lazy) checkpoint, run, and dropped, so
    peak memory is one block's weights plus the hidden states, never the whole model. The LM
    head's input statistics are those of the final norm's output (the head is never built).

    ``hessians``: the result's ``.hessians`` also maps every dense-layer projection (not the experts, not the
    head) to its input's second moment E[x x^T], float32 [in, in] on the CPU (float64 sums; projections fed one
    tensor, q/k/v and gate/up, share one matrix object). Its diagonal is the E[x^2] above. Memory: one
    [in, in] matrix per distinct input, kept for every layer (SmolLM2-135M: 0.4 GB; a 7B model: 22 GB)."""
    import torch.nn.functional as F

    from ..models.layers import RMSNorm
    from ..schemes.registry import reference_embedding
    from ..schemes.record import QuantRecord

    cfg = ckpt.config
    T = ckpt.tensors
    E = T["model.embed_tokens.weight"]
    if isinstance(E, QuantRecord):
        E = reference_embedding(E).dequantize()
    E = E.float()
    xs = []
    for i in range(0, tokens.shape[0], batch):
        x = F.embedding(tokens[i:i + batch], E).to(device)  # [b, L, hidden]
        if cfg.embed_scale is not None:
            x = x * torch.tensor(cfg.embed_scale, dtype=x.dtype)
        xs.append(x)
    del E
    D = cfg.hidden_size
    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    count = tokens.numel()

    square_sums = _SquareSums()
    grams = _Grams()
    gram_sums: dict[str, torch.Tensor] = {}  # the first projection fed an input -> sum of x x^T
    alias: dict[str, str] = {}  # projection -> the projection whose sum holds its input's
    hess: dict[str, torch.Tensor] = {}

    def make_hook(name):
        want_gram = hessians and ".experts." not in name and name.endswith("_proj")

        def hook(mod, args):
            s, n = square_sums(args[0])
            sums[name] = sums[name] + s if name in sums else s
            counts[name] = counts.get(name, 0) + n  # an expert sees only the rows routed to it
            if want_gram:
                g, owner = grams(args[0], name)
                alias[name] = owner
                if owner == name:
                    gram_sums[name] = gram_sums[name] + g if name in gram_sums else g
        return hook

    layers = range(cfg.num_layers)
    if progress:
        from tqdm import tqdm
        layers = tqdm(layers, desc="calibration: statistics", unit="layer", leave=False, dynamic_ncols=True)
    for i in layers:
        prefix = f"model.layers.{i}."
        dec = _block_decoder(ckpt, i, device)
        block = dec.model.layers[0]
        hooks = [m.register_forward_pre_hook(make_hook(prefix + n)) for n, m in block.named_modules()
                 if n.endswith("_proj") or isinstance(m, Router)]
        try:
            xs = [dec.run_layer(block, x) for x in xs]
        finally:
            for h in hooks:
                h.remove()
        del dec, block
        shared: dict[str, torch.Tensor] = {}
        for name, owner in alias.items():  # this layer's: mean, float32, one object per input
            if owner not in shared:
                shared[owner] = (gram_sums.pop(owner) / counts[owner]).float().cpu()
            hess[name] = shared[owner]
        alias.clear()
    norm = RMSNorm(T["model.norm.weight"].float().to(device), cfg.rms_norm_eps, cfg.norm_offset)
    for x in xs:
        h = norm(x).double().pow(2).reshape(-1, D).sum(0)
        sums["lm_head"] = sums["lm_head"] + h if "lm_head" in sums else h
    counts["lm_head"] = count
    return Stats({n: (s / counts[n]).float().cpu() for n, s in sums.items()}, counts, hess if hessians else None)


class _SquareSums:
    """(sum over rows of x^2 in float64 [in_features], rows) of a projection's input x [..., in_features].

    Projections fed the same tensor (q/k/v, gate/up: the reference forward passes one tensor object to each
    and changes no projection input in place) get the sums computed once: the last input is remembered by
    identity (and by its version counter outside inference mode, where tensors have one) and its result handed
    out again. They are the same float64 operations, so the statistics are bit for bit those of summing at
    every hook."""

    def __init__(self):
        self._x = self._version = self._out = None

    @staticmethod
    def _version_of(x: torch.Tensor):
        return None if x.is_inference() else x._version

    def __call__(self, x: torch.Tensor) -> tuple[torch.Tensor, int]:
        if self._x is not x or self._version != self._version_of(x):
            x2 = x.detach().double().pow(2).reshape(-1, x.shape[-1])
            self._x, self._version, self._out = x, self._version_of(x), (x2.sum(0), x2.shape[0])
        return self._out[0].clone(), self._out[1]


# Calibration of the experts of a mixture-of-experts layer: expert e's E[x^2] is over the rows routed to it, and a
# rarely chosen expert sees few (or none). An expert with n < EXPERT_MIN_ROWS rows is given EXPERT_MIN_ROWS rows'
# worth of statistics: its own n rows plus EXPERT_MIN_ROWS - n rows of a fallback, the statistics of its layer:
# gate / up (input h, the MLP's normed input) from the router's input (every row of the layer); down (input
# act(gate h) * up h, the expert's own intermediate features) from the row-weighted mean over the layer's experts'
# down inputs (uniform weights when no expert of the layer saw a row). n = 0 is the fallback alone.
EXPERT_MIN_ROWS = 64


class Stats(dict):
    """Projection name -> E[x^2] fp32 [in_features]; ``counts``: how many rows each saw; ``hessians``: None, or
    projection name -> E[x x^T] fp32 [in, in] (``collect_input_stats_layerwise(hessians=True)``)."""

    def __init__(self, stats: dict, counts: dict[str, int], hessians: dict[str, torch.Tensor] | None = None):
        super().__init__(stats)
        self.counts = dict(counts)
        self.hessians = hessians


class _Grams:
    """(sum over rows of x x^T in float64 [in, in], owner) of a projection's input x [..., in]: computed once per
    input tensor (identity and version, as ``_SquareSums``); ``owner`` is the first projection that was fed it,
    the others get the same sums and need not keep their own."""

    def __init__(self):
        self._x = self._version = self._out = None

    def __call__(self, x: torch.Tensor, name: str) -> tuple[torch.Tensor, str]:
        version = _SquareSums._version_of(x)
        if self._x is not x or self._version != version:
            x2 = x.detach().double().reshape(-1, x.shape[-1])
            self._x, self._version, self._out = x, version, (x2.T @ x2, name)
        return self._out


def expert_fallback(stats: dict, cfg) -> str | None:
    """Apply the fallback above in place to ``stats`` (a ``Stats``) for every expert of every MoE layer of ``cfg``;
    return a one-line note of how many experts needed it (None when none did)."""
    from ..models.schema import moe_names
    counts = getattr(stats, "counts", {})
    short = total = 0
    for i in range(cfg.num_layers):
        if cfg.block_kinds(i)[1] != "moe":
            continue
        m = moe_names(cfg, i)
        router = stats.get(m["router"])
        downs = [(ex["down"], counts.get(ex["down"], 0)) for ex in m["experts"]]
        seen = sum(c for _, c in downs)
        if seen:
            down_mean = sum(stats[n].double() * c for n, c in downs if c) / seen
        else:
            down_mean = torch.ones(cfg.moe_intermediate_size, dtype=torch.float64)
        for ex in m["experts"]:
            total += 1
            n = min(counts.get(ex["gate"], 0), EXPERT_MIN_ROWS)
            if n >= EXPERT_MIN_ROWS:
                continue
            short += 1
            for role, fb in (("gate", router), ("up", router), ("down", down_mean)):
                name = ex[role]
                if fb is None:  # no router statistics (a collector without them): leave the expert unweighted
                    stats.pop(name, None)
                    continue
                own = stats[name].double() * n if n else 0.0
                stats[name] = ((own + fb.double() * (EXPERT_MIN_ROWS - n)) / EXPERT_MIN_ROWS).float()
    if not short:
        return None
    return (f"calibration: {short} of {total} experts saw fewer than {EXPERT_MIN_ROWS} rows: their statistics are "
            f"completed with their layer's (router input for gate/up, the experts' mean for down)")


# ---------------------------------------------------------------------------------------------
# Bounded memory: views of one part of a checkpoint, and a decoder that streams its blocks
# ---------------------------------------------------------------------------------------------
class _ViewTensors(LazyTensors):
    """LazyTensors whose ``in`` looks at the names only (Mapping's default would load the tensor)."""

    def __contains__(self, name: object) -> bool:
        return name in self._getters


def _view_decoder(ckpt: Checkpoint, cfg, getters: dict[str, Callable[[], object]], device):
    """``Decoder.from_checkpoint`` (fp32) of a view of ``ckpt``: config ``cfg``, tensors ``getters``."""
    from ..models.decoder import Decoder

    view = Checkpoint(cfg, _ViewTensors(getters), None, ckpt.source, ckpt.source_format)
    return Decoder.from_checkpoint(view, dtype=torch.float32, device=device)


def _block_decoder(ckpt: Checkpoint, i: int, device: str | torch.device = "cpu", names: list[str] | None = None):
    """A one-block fp32 Decoder holding block ``i`` of ``ckpt`` alone (as its layer 0), built the way
    ``Decoder.from_checkpoint`` builds the whole model; its embedding is a 1-row stand-in, tied head."""
    cfg, T = ckpt.config, ckpt.tensors
    prefix = f"model.layers.{i}."
    names = [n for n in T if n.startswith(prefix)] if names is None else names
    getters = {"model.layers.0." + n[len(prefix):]: (lambda n=n: T[n]) for n in names}
    getters.update({"model.embed_tokens.weight": lambda: torch.zeros(1, cfg.hidden_size),
                    "model.norm.weight": lambda: torch.ones(cfg.hidden_size)})
    cfg1 = replace(cfg, num_layers=1, vocab_size=1, tie_word_embeddings=True, layer_types=[cfg.layer_types[i]],
                   mlp_types=[cfg.mlp_types[i]])
    return _view_decoder(ckpt, cfg1, getters, device)


def _ends_decoder(ckpt: Checkpoint, part: str, device: str | torch.device = "cpu"):
    """A Decoder without blocks holding one end of ``ckpt`` in fp32, built as ``Decoder.from_checkpoint``
    builds it: ``part="embed"``: the embedding (its tied head shares the table); ``"head"``: the final
    norm and LM head (an untied model's embedding is a zero stand-in that takes no memory)."""
    cfg, T = ckpt.config, ckpt.tensors
    names = set(T)  # iteration only: ``in T`` would load the tensor
    E = "model.embed_tokens.weight"
    getters = {"model.norm.weight": lambda: T["model.norm.weight"]}
    if part == "head" and "lm_head.weight" in names:
        getters.update({n: (lambda n=n: T[n]) for n in ("lm_head.weight", "lm_head.bias") if n in names})
        getters[E] = lambda: torch.zeros(1, cfg.hidden_size, device=device).expand(cfg.vocab_size, -1)
    else:
        getters[E] = lambda: T[E]
    cfg0 = replace(cfg, num_layers=0, layer_types=[], mlp_types=[], tie_word_embeddings=cfg.tie_word_embeddings or part == "embed")
    return _view_decoder(ckpt, cfg0, getters, device)


class _Streamed(nn.Module):
    """One part of a streamed Decoder: ``build()`` makes it from the checkpoint at every call; it runs
    and is dropped when the call returns (nothing of it stays in memory)."""

    def __init__(self, build: Callable[[], nn.Module], layer: int | None = None):
        super().__init__()
        self.build, self.layer = build, layer


class _StreamedEmbedding(_Streamed):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.build().model.embed_tokens(ids)


class _StreamedBlock(_Streamed):
    @property
    def blocks(self) -> list:
        """The layer's blocks (models/blocks), built now and dropped after the forward; its KV-cache layer is the
        streamed model's ``layer`` (the one-block decoder holds it as its layer 0)."""
        block = self.build().model.layers[0]
        block.layer_index = self.layer
        return block.blocks


class _StreamedHead(_Streamed):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.build().lm_head(x)


def streamed_decoder(ckpt: Checkpoint, device: str | torch.device = "cpu"):
    """A Decoder computing what ``Decoder.from_checkpoint(ckpt, torch.float32, device)`` computes, float32
    operation for float32 operation, with one part of the model in memory at a time: the embedding,
    each block and the LM head are built from the lazy checkpoint when the forward reaches them and
    dropped after. Only the final norm's weight is kept; ``new_cache`` gives the KV caches of all
    blocks. Every forward re-reads the whole checkpoint: meant for ``sampled_calibration_tokens``."""
    from ..models.decoder import Decoder
    from ..models.layers import RMSNorm

    cfg, T = ckpt.config, ckpt.tensors
    names = list(T)
    blocks = []
    for i in range(cfg.num_layers):
        mine = [n for n in names if n.startswith(f"model.layers.{i}.")]
        blocks.append(_StreamedBlock(lambda i=i, mine=mine: _block_decoder(ckpt, i, device, mine), i))
    norm = RMSNorm(T["model.norm.weight"].to(device=device, dtype=torch.float32), cfg.rms_norm_eps, cfg.norm_offset)
    dec = Decoder(cfg, _StreamedEmbedding(lambda: _ends_decoder(ckpt, "embed", device)), blocks, norm,
                  _StreamedHead(lambda: _ends_decoder(ckpt, "head", device)))
    return dec.to(device).eval()


# ---------------------------------------------------------------------------------------------
# Which sampler: the whole fp32 model when it fits the memory budget, else the streamed one
# ---------------------------------------------------------------------------------------------
def model_fp32_bytes(ckpt: Checkpoint) -> int:
    """Bytes of the whole model in fp32, from the config's shapes (nothing is read; a tied head is
    counted once, as ``Decoder.from_checkpoint`` shares it)."""
    return 4 * sum(math.prod(s) for s in expected_shapes(ckpt.config).values())


def _free_bytes(device: str | torch.device) -> float:
    """Free memory on ``device``: torch.cuda.mem_get_info on CUDA, MemAvailable on the CPU (inf if unknown)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return float(torch.cuda.mem_get_info(dev)[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return math.inf


def memory_budget(device: str | torch.device = "cpu", budget_gb: float | None = None) -> float:
    """Bytes the whole fp32 model may take to sample calibration text: ``budget_gb`` (GB of 10^9 bytes),
    else half of the free memory of ``device``."""
    if budget_gb is not None:
        return float(budget_gb) * 1e9
    return _free_bytes(device) / 2


def sampling_decoder(ckpt: Checkpoint, device: str | torch.device = "cpu", budget_gb: float | None = None,
                     log: Callable[[str], None] | None = None):
    """(decoder, streamed): the whole fp32 model when its size fits ``memory_budget``, else
    ``streamed_decoder`` (same tokens, bounded memory, slow); the choice is logged."""
    from ..models.decoder import Decoder

    log = log or (lambda s: None)
    need, budget = model_fp32_bytes(ckpt), memory_budget(device, budget_gb)
    if need <= budget:
        return Decoder.from_checkpoint(ckpt, dtype=torch.float32, device=device).eval(), False
    log(f"calibration: the source needs {need / 1e9:.1f} GB in fp32, over the memory budget of {budget / 1e9:.1f} GB "
        f"({MEM_ENV} sets it): sampling block by block, one block in memory at a time. Every token step "
        f"re-reads all {ckpt.config.num_layers} blocks from the checkpoint, so this is SLOW for a large model "
        "(the page cache helps when RAM allows; --calib FILE is much faster)")
    return streamed_decoder(ckpt, device), True
