"""Whole-model quantization: checkpoint -> dense + quantized tensors -> ``.cbk``.

The recipe (``Recipe``) for each projection weight ``P.weight`` of the checkpoint:

* every q/k/v/o and gate/up/down projection: a ``bits``-bit per-row scalar codebook
  (K = 2**bits centroids per output row) found by weighted k-means (``kmeans.kmeans_rows``),
  each element weighted by E[x_j^2] of its input channel from calibration (``calibrate.py``);
  ``weighted=False`` gives plain (unweighted) k-means;
* ``lm_head``: ``head_bits`` (default 8, K = 256) weighted by E[x^2] of the final-norm output, or
  kept in fp16 with ``head_bits=None``. A model with tied embeddings keeps its fp16 embedding
  and stores the quantized head as its own ``lm_head.weight`` (the output config is untied),
  unless ``embed_bits`` equals ``head_bits``: then one quantized table serves both (config stays tied);
* ``embed_bits``: the embedding as a per-row codebook too, or None for fp16. The default "auto"
  gives a tied model one shared ``head_bits`` table (config stays tied: on SmolLM2 it cut the file
  from 171 to 114 MB at the same perplexity, see QUALITY.md); an untied model's embedding becomes an 8-bit
  codebook when its source stores it at 8 bits or fewer (a quantized GGUF tensor: Qwen2.5's Q5_0 table would
  triple in fp16), and stays fp16 from an fp16 / bf16 / fp32 source (``source_bits.auto_embed_bits``);
* per-layer overrides, matched with ``fnmatch`` against the canonical projection name
  (``model.layers.3.mlp.down_proj``, ``lm_head``): ``keep_fp16`` patterns stay dense fp16,
  ``bits_overrides`` [(pattern, bits)] pick the width (first match wins);
* everything else (norms, biases of dense layers) is stored dense: norms in fp32, the
  embedding and fp16-kept projections in fp16.

Memory: the checkpoint is read one tensor at a time (loaders are lazy) and each quantized
tensor is reduced to its packed codes at once. ``plan_quantization`` lists every output tensor
(name, dtype, shape, scheme) from the config and the recipe before anything is quantized;
``quantize_to_cbk`` declares that plan to a streaming ``CbkWriter`` and writes each tensor as soon
as it is produced, so it holds about one tensor of the source plus its k-means work, never the
output (a 70B model needs no more RAM than a 7B one). ``quantize_checkpoint`` runs the same
generator (``iter_quantized``) but keeps the output in memory, for callers that want it. Calibration
from a text file runs the source one block at a time (``calibrate.collect_input_stats_layerwise``: one
block's weights plus the calibration hidden states); the no-dataset default samples text from the model
with the whole fp32 model when it fits the memory budget (``mem_budget_gb``, else half of the free
memory), else block by block with the same tokens (``calibrate.sampling_decoder``: bounded memory but
slow; ``--calib FILE`` is faster) and then collects layer by layer; ``calib="none"`` skips calibration
(unweighted).
"""
from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator, Mapping

import torch

from ..errors import ConfigError
from ..formats.cbk import CbkFile, CbkWriter, sha256_file
from ..formats.cbk_write import check_output_path
from ..formats.cbk_spec import DTYPE_SIZES, QuantSpec, TensorSpec
from ..formats.detect import load_checkpoint
from ..models.checkpoint import Checkpoint, LazyTensors
from ..models.schema import expected_shapes, layer_projections
from ..models.config import ModelConfig
from .codebook_fit import fit_rows, project_centroids, stored_specs
from .recipe import Recipe, bits_choices, parse_bits_overrides  # noqa: F401  (re-exported: the recipe's home was here)
from .source_bits import already_quantized, auto_embed_bits, larger_than_source, source_bytes
from ..kernels.pack import pack_codes, packed_width
from ..schemes import registry
from ..schemes.record import QuantRecord

__all__ = ["Recipe", "QuantizedModel", "QuantPlan", "plan_quantization", "iter_quantized", "quantize_checkpoint",
           "calibration_stats", "quantize_to_cbk", "parse_bits_overrides", "quantize_matrix", "codebook_spec",
           "recipe_summary", "recipe_and_provenance", "source_provenance", "source_sha256"]

PROJ_SUFFIXES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@dataclass
class QuantizedModel:
    config: Any  # ModelConfig of the output (tie flag may differ from the source)
    dense: dict[str, torch.Tensor]
    quantized: dict[str, QuantRecord]
    report: list[dict[str, Any]]  # per quantized tensor: name, bits, shape, rel errors, seconds
    seconds: float = 0.0
    plan: "QuantPlan | None" = None  # the output's specs, when known (the streaming path)

    def bits_per_weight(self, which: str = "projections") -> float:
        """Stored bits per weight: 'projections' (layers' q..down, quantized or kept dense),
        'all' (every tensor incl. head/embedding/norms/biases)."""
        if self.plan is not None:
            return self.plan.bits_per_weight(which)
        return _bits_per_weight({n: TensorSpec.of(t) for n, t in self.dense.items()},
                                {n: QuantSpec.of(r) for n, r in self.quantized.items()}, which)


def _bits_per_weight(dense: Mapping[str, TensorSpec], quantized: Mapping[str, QuantSpec], which: str) -> float:
    nbits = nweights = 0
    for name, q in quantized.items():
        if which == "projections" and not name.startswith("model.layers."):
            continue
        nbits += sum(t.nbytes * 8 for t in q.tensors.values())
        nweights += q.shape[0] * q.shape[1]
    for name, t in dense.items():  # projections kept dense (fp16) count too
        if which == "projections" and name.startswith("model.layers.") and name.endswith("_proj.weight"):
            nbits += t.nbytes * 8
            nweights += math.prod(t.shape)
    if which == "all":
        for name, t in dense.items():
            nbits += t.nbytes * 8
            nweights += math.prod(t.shape)
        for q in quantized.values():
            if q.bias is not None:
                nbits += q.bias.nbytes * 8
    return nbits / max(1, nweights)


def source_sha256(path: str) -> str | None:
    """Provenance of a source: hex sha256 of the file (.gguf, .cbk), None for a directory (HF, AQLM)."""
    return sha256_file(path) if Path(path).is_file() else None


def source_provenance(ckpt: Checkpoint) -> dict[str, Any]:
    """The provenance every driver records: source name, source format, source sha256 (``source_sha256``)."""
    return {"source": Path(ckpt.source).name, "source_format": ckpt.source_format,
            "source_sha256": source_sha256(ckpt.source)}


def recipe_summary(recipe: dict[str, Any], qm: "QuantizedModel") -> dict[str, Any]:
    """``recipe`` (a recipe's ``to_dict()``) with what the run measured: bits per weight ("projections",
    "all", 4 decimals) and each quantized layer's relative weight error (6 decimals)."""
    return {**recipe, "bits_per_weight": {"projections": round(qm.bits_per_weight("projections"), 4),
                                          "all": round(qm.bits_per_weight("all"), 4)},
            "layer_errors": {r["name"]: round(r["rel_err"], 6) for r in qm.report}}


def calibration_stats(ckpt: Checkpoint, recipe: Recipe, device: str = "cpu", decoder=None,
                      progress: bool = True, log: Callable[[str], None] | None = None,
                      mem_budget_gb: float | None = None) -> dict[str, torch.Tensor] | None:
    """E[x^2] per input channel of every projection, per the recipe's calibration source.

    Without ``decoder`` the source is never built whole unless it fits: file calibration runs one
    block at a time; sampled calibration builds the fp32 model only when its size fits the memory
    budget (``mem_budget_gb`` GB of 10^9 bytes, else half of the free memory; the CLI passes
    ``settings.Options.calib_mem_gb``), and otherwise samples the same tokens block by block and collects
    the statistics layer by layer."""
    from . import calibrate

    if not recipe.weighted or recipe.calib == "none":
        return None
    log = log or (lambda s: None)
    t0 = time.perf_counter()
    dec, bounded = decoder, decoder is None
    if recipe.calib:
        toks = calibrate.file_calibration_tokens(ckpt.tokenizer, recipe.calib, recipe.calib_seqs, recipe.calib_len)
        what = f"{toks.shape[0]} windows x {toks.shape[1]} tokens of {recipe.calib}"
    else:
        if decoder is None:
            dec, bounded = calibrate.sampling_decoder(ckpt, device, mem_budget_gb, log)
        bos = ckpt.tokenizer.bos_id if ckpt.tokenizer is not None else None
        toks = calibrate.sampled_calibration_tokens(dec, bos, recipe.calib_seqs, recipe.calib_sample_len,
                                                    seed=recipe.seed, progress=progress)
        what = f"{toks.shape[0]} sequences x {toks.shape[1]} tokens sampled from the model (seed {recipe.seed})"
    if bounded or recipe.gptq:  # one block of the source at a time (GPTQ's Hessians: always so)
        dec, bounded = None, True
        stats = calibrate.collect_input_stats_layerwise(ckpt, toks, device=device, progress=progress,
                                                        hessians=recipe.gptq)
    else:
        stats = calibrate.collect_input_stats(dec, toks, progress=progress)
    note = calibrate.expert_fallback(stats, ckpt.config)
    if note:
        log(note)
    log(f"calibration: {what}, {'layer by layer' if bounded else 'whole model'}, {time.perf_counter() - t0:.1f} s")
    return stats


_POST_CHUNK = 1 << 21  # elements per step of packing and error measurement (~70 MB of float64 work)


def quantize_matrix(W: torch.Tensor, bits: int, imp: torch.Tensor | None, recipe: Recipe, device: str,
                     bias: torch.Tensor | None, storage: str = "f16",
                     hess: torch.Tensor | None = None) -> tuple[QuantRecord, dict[str, float]]:
    """k-means (``codebook_fit.fit_rows``: the codebook in ``storage``, shared tables of
    ``recipe.head_group_rows`` rows), with ``hess`` (E[x x^T] of the input) and ``recipe.gptq`` refined by
    ``gptq.gptq_refine`` (error-compensated codes, Hessian-weighted codebooks), then packing and the relative errors ||(W - Wq) sqrt(w)|| / ||W sqrt(w)||
    row chunk by row chunk (kmeans_rows bounds its own work the same way): a 70B projection (8192 x 28672) needs
    its codes plus ~70 MB here, not the ~6 GB that whole-matrix float64 temporaries would take. Both run on W's
    device: the uint8 codes cross to it chunk by chunk and are widened and packed there (integer work: the same
    bytes on any device; on the host it was CPU time of the order of a GPU layer's k-means)."""
    book, codes, stored, params = fit_rows(W, bits, imp, storage=storage, group_rows=recipe.head_group_rows,
                                           iters=recipe.iters, starts=recipe.starts, device=device)
    R, C = W.shape  # codes uint8 [R, C], book: the decoded fp16 [R, K] (CPU)
    err_h = {}
    if hess is not None and recipe.gptq and storage != "shared":
        from .gptq import gptq_refine
        book, codes, stored, info = gptq_refine(
            W.to(device), hess.to(device), book, codes, lambda c: project_centroids(c, storage), stored,
            rounds=recipe.gptq_rounds, block=recipe.gptq_block, damp=recipe.gptq_damp)
        err_h = {"hessian_gain": info["objective"] / max(info["objective_start"], 1e-300)}
    packed = torch.empty(R, packed_width(C, bits), dtype=torch.uint8)
    w = None if imp is None else imp.to(W.device, torch.float64)
    num = den = num_w = den_w = 0.0
    step = max(1, _POST_CHUNK // max(1, C))
    for r0 in range(0, R, step):
        r1 = min(R, r0 + step)
        cc = codes[r0:r1].to(W.device)  # uint8 to W's device, widened and packed there (integers: the same bytes)
        packed[r0:r1] = pack_codes(cc, bits)
        Wc = W[r0:r1].to(torch.float64)
        Wq = torch.gather(book[r0:r1].to(W.device, torch.float64), 1, cc.long())
        d2 = Wq.sub_(Wc).square_()  # [r, C]
        w2 = Wc.square_()
        num += float(d2.sum())
        den += float(w2.sum())
        if w is not None:
            wc = w if w.dim() == 1 else w[r0:r1]
            num_w += float((d2 * wc).sum())
            den_w += float((w2 * wc).sum())
        del Wc, Wq, d2, w2
    rec = QuantRecord("codebook", (R, C), params, {"codes": packed, **stored},
                      None if bias is None else bias.detach().to(torch.float16).cpu())
    err = {"rel_err": math.sqrt(num / max(den, 1e-300)),
           "rel_err_weighted": math.sqrt(num_w / max(den_w, 1e-300)) if w is not None else float("nan"), **err_h}
    return rec, err


def codebook_spec(shape: tuple[int, int], bits: int, bias: bool, storage: str = "f16",
                  group_rows: int | None = None) -> QuantSpec:
    """The spec ``quantize_matrix`` produces for a [out, in] weight (kept in step with it; the
    writer refuses a record that differs from its declaration)."""
    out, inp = shape
    params, books = stored_specs(out, bits, storage, group_rows)
    return QuantSpec("codebook", (out, inp), params,
                     {"codes": TensorSpec("U8", (out, packed_width(inp, bits))),
                      **{role: TensorSpec(dt, sh) for role, (dt, sh) in books.items()}},
                     TensorSpec("F16", (out,)) if bias else None)


@dataclass
class _Job:
    """One step of the plan. kind "proj": the weight ``src`` (and bias ``bias_src``, or the bias
    carried by a QuantRecord source when ``record_bias``) becomes ``out``.weight quantized to
    ``bits`` (None: dense fp16), k-means weighted by stats[``imp``]; kind "norm": ``src`` is copied
    dense fp32 to ``out``."""
    kind: str
    src: str
    out: str
    shape: tuple[int, ...]
    bits: int | None = None
    bias_src: str | None = None
    record_bias: bool = False
    imp: str | None = None
    layer: int | None = None  # model layer (progress and the per-layer log line)
    label: str | None = None  # log line for the embedding / head
    storage: str = "f16"  # codebook storage (schemes/codebook_store.py)


@dataclass
class QuantPlan:
    """Every output tensor, known before anything is quantized: output config, dense specs and
    quantized specs in the order ``iter_quantized`` yields them (also the order of declaration,
    hence of the file's layout)."""
    config: ModelConfig
    dense: dict[str, TensorSpec]
    quantized: dict[str, QuantSpec]
    jobs: list[_Job]

    def bits_per_weight(self, which: str = "projections") -> float:
        return _bits_per_weight(self.dense, self.quantized, which)


def plan_quantization(ckpt: Checkpoint, recipe: Recipe, *, layers: bool = True) -> QuantPlan:
    """The output of ``quantize_checkpoint(ckpt, recipe)`` without computing it: names, dtypes,
    shapes and schemes, from the config, the recipe and the source's tensor names (shapes come
    from the config; small tensors of unknown shape, e.g. norms, are read once).

    ``layers=False`` plans only the final norm, the embedding and the LM head (with the output
    config's tie flag): drivers that quantize the layers their own way (``additive_driver``) share
    this code for the head, so a tied model gets the same one-table layout from every scheme."""
    recipe.validate()
    cfg = replace(ckpt.config)
    T = ckpt.tensors
    keys = list(T)  # iteration only: ``in T`` on a lazy mapping would load the tensor
    keyset = set(keys)
    exp = expected_shapes(cfg)
    known = dict(getattr(T, "shapes", {}) or {})
    formats = dict(getattr(T, "formats", {}) or {})

    def may_be_record(key: str) -> bool:
        """A QuantRecord source (.cbk, AQLM) carries a projection's bias inside the record: such a
        weight is peeked at (cheap: its tensors are memory-mapped) to learn whether it has one."""
        if ckpt.source_format in ("cbk", "aqlm"):
            return True
        fmt = formats.get(key)
        return ckpt.source_format not in ("hf", "gguf") and fmt is not None and fmt not in DTYPE_SIZES
    jobs: list[_Job] = []

    def shape_of(key: str) -> tuple[int, ...]:
        if key in exp:
            return tuple(exp[key])
        if key in known:
            return tuple(known[key])
        return tuple(T[key].shape)  # a small tensor the config does not describe

    def proj(name: str, src: str, bits: int | None, imp: str | None, *, out: str | None = None,
             bias: bool = True, **kw) -> None:
        out = out or name
        bias_src = name + ".bias" if bias and (name + ".bias") in keyset else None
        record_bias = False
        if bias and bias_src is None and may_be_record(src):
            rec = T[src]
            record_bias = isinstance(rec, QuantRecord) and rec.bias is not None
        storage = recipe.storage_for(bits) if kw.get("layer") is not None else recipe.head_codebook
        jobs.append(_Job("proj", src, out, shape_of(out + ".weight"), bits, bias_src, record_bias, imp, **kw,
                         storage=storage))

    by_layer: dict[int, list[str]] = {}
    for key in keys:
        if key.startswith("model.layers."):
            idx = key.split(".", 3)[2]
            if idx.isdigit():
                by_layer.setdefault(int(idx), []).append(key)
    for i in range(cfg.num_layers if layers else 0):
        names = layer_projections(cfg, i)  # attention or MLA, then dense MLP or every expert (shared ones too)
        for name in names:
            proj(name, name + ".weight", recipe.bits_for(name), name, layer=i)
        owned = {n + suffix for n in names for suffix in (".weight", ".bias")}
        for key in by_layer.get(i, []):  # norms, routers, their correction bias, the shared-expert gate: exact
            if key not in owned:
                jobs.append(_Job("norm", key, key, shape_of(key), layer=i))
    jobs.append(_Job("norm", "model.norm.weight", "model.norm.weight", shape_of("model.norm.weight")))

    # Embedding and LM head.
    E = "model.embed_tokens.weight"
    head_bits = recipe.bits_for("lm_head")
    embed_bits = recipe.embed_bits
    if embed_bits == "auto":
        embed_bits = auto_embed_bits(cfg.tie_word_embeddings, head_bits, formats.get(E))
    if cfg.tie_word_embeddings:
        if head_bits is not None and embed_bits == head_bits:  # one quantized table for both
            proj("model.embed_tokens", E, embed_bits, "lm_head", bias=False,
                 label=f"embed_tokens+lm_head (tied) {embed_bits}-bit")
        else:
            proj("model.embed_tokens", E, embed_bits, None, bias=False)
            if head_bits is not None:
                cfg = replace(cfg, tie_word_embeddings=False)
                exp = expected_shapes(cfg)
                proj("lm_head", E, head_bits, "lm_head", bias=False,
                     label=f"lm_head (untied from the embedding) {head_bits}-bit")
    else:
        proj("model.embed_tokens", E, embed_bits, None, bias=False)
        proj("lm_head", "lm_head.weight", head_bits, "lm_head", bias=False, label=f"lm_head {head_bits}-bit")

    dense: dict[str, TensorSpec] = {}
    quantized: dict[str, QuantSpec] = {}
    for j in jobs:
        has_bias = j.bias_src is not None or j.record_bias
        if j.kind == "norm":
            dense[j.out] = TensorSpec("F32", j.shape)
        elif j.bits is None:
            dense[j.out + ".weight"] = TensorSpec("F16", j.shape)
            if has_bias:
                dense[j.out + ".bias"] = TensorSpec("F16", (j.shape[0],))
        else:
            quantized[j.out + ".weight"] = codebook_spec(j.shape, j.bits, has_bias, j.storage, recipe.head_group_rows)
    return QuantPlan(cfg, dense, quantized, jobs)


def iter_quantized(ckpt: Checkpoint, recipe: Recipe, plan: QuantPlan, *, device: str = "cpu",
                   stats: dict[str, torch.Tensor] | None = None, progress: bool = True,
                   log: Callable[[str], None] | None = None
                   ) -> Iterator[tuple[str, torch.Tensor | QuantRecord, dict[str, Any] | None]]:
    """Carry out ``plan``: yields (output name, dense tensor or QuantRecord, report row or None) in
    the plan's order, one at a time (the caller decides whether to keep or write each)."""
    from tqdm import tqdm

    log = log or (lambda s: print(s, file=sys.stderr))
    T = ckpt.tensors

    def imp_for(name: str | None) -> torch.Tensor | None:
        if name is None or not recipe.weighted or stats is None:
            return None
        return stats.get(name)

    def dense_of(x):  # a .cbk source holds QuantRecords: requantize from their dequantized weights
        if isinstance(x, QuantRecord):
            return registry.dequantize(x, torch.float32)
        return x

    # one step per layer, and one per quantized embedding / head (minutes of k-means on a large vocabulary)
    extra = [j for j in plan.jobs if j.kind == "proj" and j.layer is None and j.bits is not None]
    bar = tqdm(total=plan.config.num_layers + len(extra), desc="quantize", unit="step", disable=not progress,
               dynamic_ncols=True)
    rows: list[dict[str, Any]] = []
    cached: tuple[str, torch.Tensor] | None = None  # the embedding, read once for a tied head
    try:
        for k, j in enumerate(plan.jobs):
            nxt = plan.jobs[k + 1] if k + 1 < len(plan.jobs) else None
            if j.kind == "norm":
                yield j.out, T[j.src].detach().float().cpu(), None
            else:
                if cached is not None and cached[0] == j.src:
                    W = cached[1]
                else:
                    src = T[j.src]
                    W = dense_of(src)
                    cached = (j.src, W) if nxt is not None and nxt.src == j.src else None
                b = T[j.bias_src] if j.bias_src is not None else (src.bias if j.record_bias else None)
                if b is None and isinstance(src, QuantRecord) and src.bias is not None:  # never drop it silently
                    raise ConfigError(f"{j.src} carries a bias the plan did not expect (source format "
                                      f"{ckpt.source_format!r} does not list it as a quantized record)")
                if j.bits is None:
                    yield j.out + ".weight", W.detach().to(torch.float16).cpu(), None
                    if b is not None:
                        yield j.out + ".bias", b.detach().to(torch.float16).cpu(), None
                else:
                    t0 = time.perf_counter()
                    if j.layer is None:  # the embedding / head: its own step of the bar, named
                        bar.set_description(f"quantize {(j.label or j.out).split(' (')[0]} ({j.shape[0]} rows)")
                    shape, Wf = list(W.shape), W.float()
                    if cached is None:  # drop the source's own copy (fp16/bf16) while k-means runs
                        W = src = None
                    hess = (stats.hessians or {}).get(j.imp) if recipe.gptq and getattr(stats, "hessians", None) \
                        and j.layer is not None else None
                    rec, err = quantize_matrix(Wf, j.bits, imp_for(j.imp), recipe, device, b, j.storage, hess)
                    del Wf
                    row = {"name": j.out, "bits": j.bits, "shape": shape, **err,
                           "seconds": time.perf_counter() - t0}
                    if j.layer is not None:
                        rows.append(row)
                    elif j.label:
                        (tqdm.write if progress else log)(f"{j.label}  rel. weight error {row['rel_err']:.4f}")
                    if j.layer is None:
                        bar.update(1)
                    yield j.out + ".weight", rec, row
                    del rec
                del W, b
                if cached is None:
                    src = None
            if j.layer is not None and (nxt is None or nxt.layer != j.layer):  # end of a layer
                if rows:
                    msg = "  ".join(f"{r['name'].rsplit('.', 1)[-1]}:{r['rel_err']:.4f}"  # GPTQ: output error ratio
                                    + (f"(H x{r['hessian_gain']:.2f})" if "hessian_gain" in r else "") for r in rows)
                    bar.set_postfix_str(f"max rel err {max(r['rel_err'] for r in rows):.4f}")
                    (tqdm.write if progress else log)(f"layer {j.layer:3d}  rel. weight error  {msg}")
                rows = []
                bar.update(1)
    finally:
        bar.close()


def quantize_checkpoint(ckpt: Checkpoint, recipe: Recipe, *, device: str = "cpu",
                        stats: dict[str, torch.Tensor] | None = None, progress: bool = True,
                        log: Callable[[str], None] | None = None, layers: bool = True,
                        mem_budget_gb: float | None = None) -> QuantizedModel:
    """Quantize every projection of ``ckpt`` per ``recipe`` (calibration stats computed if needed, with
    ``mem_budget_gb`` as in ``calibration_stats``), keeping the whole output in memory (``quantize_to_cbk``
    streams it to a file instead). ``layers=False``: only the final norm, the embedding and the LM head
    (see ``plan_quantization``)."""
    recipe.validate()
    log = log or (lambda s: print(s, file=sys.stderr))
    t_start = time.perf_counter()
    plan = plan_quantization(ckpt, recipe, layers=layers)
    if stats is None and recipe.weighted and recipe.calib != "none":
        stats = calibration_stats(ckpt, recipe, device=device, progress=progress, log=log,
                                  mem_budget_gb=mem_budget_gb)
    dense: dict[str, torch.Tensor] = {}
    quantized: dict[str, QuantRecord] = {}
    report: list[dict[str, Any]] = []
    for name, x, row in iter_quantized(ckpt, recipe, plan, device=device, stats=stats, progress=progress, log=log):
        if isinstance(x, QuantRecord):
            quantized[name] = x
        else:
            dense[name] = x
        if row is not None:
            report.append(row)
    return QuantizedModel(plan.config, dense, quantized, report, time.perf_counter() - t_start)


def recipe_and_provenance(ckpt: Checkpoint, recipe: Recipe, qm: QuantizedModel) -> tuple[dict, dict]:
    """The file's recipe (``recipe_summary``) and provenance (``source_provenance`` and the duration) as
    ``quantize_to_cbk`` writes them, for a run that kept its output in memory."""
    return recipe_summary(recipe.to_dict(), qm), {**source_provenance(ckpt), "quantize_seconds": round(qm.seconds, 2)}


def planned_bytes(plan: QuantPlan) -> int:
    """The size of the file ``plan`` makes, near enough for a disk-space check: every tensor's bytes plus the
    header's reserve and about 256 bytes of table per stored tensor."""
    specs = list(plan.dense.values())
    for q in plan.quantized.values():
        specs += list(q.tensors.values()) + ([q.bias] if q.bias is not None else [])
    return sum(t.nbytes for t in specs) + _header_reserve(plan) + 256 * len(specs)


def check_inputs(recipe: Recipe) -> None:
    """``--calib FILE`` must be readable now, not after loading and planning the model."""
    c = recipe.calib
    if c and c != "none" and not (Path(c).is_file() and os.access(c, os.R_OK)):
        raise ConfigError(f"--calib {c}: " + ("not a readable file" if Path(c).exists() else "file not found"))


def _header_reserve(plan: QuantPlan) -> int:
    """Header room for what ``quantize_to_cbk`` learns at the end: a layer_errors entry per quantized
    layer ("model.layers.12.self_attn.q_proj":0.012345, at most len(name) + 18 bytes once the quotes
    are escaped inside the header's JSON string; doubled here), bits per weight, the source hash and
    the duration (well under the 8 KiB slack). Outgrowing it is safe but moves the whole data once;
    a tight figure keeps tiny files tiny (a flat 64 KiB would be a sixth of a 400 KiB test model)."""
    return 8192 + sum(2 * (len(name) + 24) for name in plan.quantized)


def quantize_to_cbk(src: str | Checkpoint | None, out: str | Path, recipe: Recipe, *, device: str = "cpu",
                    progress: bool = True, log: Callable[[str], None] | None = None,
                    stats: dict[str, torch.Tensor] | None = None,
                    mem_budget_gb: float | None = None) -> tuple[Path, QuantizedModel]:
    """Load ``src`` (HF dir, .gguf, .cbk source, a loaded Checkpoint; None = default model),
    quantize, and stream every tensor into ``out`` as it is produced (written atomically).
    ``mem_budget_gb``: the calibration's memory budget (``calibration_stats``).

    Memory stays about one tensor of work however large the model. The returned QuantizedModel's
    ``dense`` and ``quantized`` are read back lazily from the written file (memory-mapped)."""
    recipe.validate()
    log = log or (lambda s: print(s, file=sys.stderr))
    ckpt = src if isinstance(src, Checkpoint) else load_checkpoint(src)
    t_start = time.perf_counter()
    plan = plan_quantization(ckpt, recipe)
    check_inputs(recipe)  # before the work: every check that can fail (issue 22)
    check_output_path(out, planned_bytes(plan))
    warning = already_quantized(ckpt.tensor_formats(), recipe.bits)
    if warning:
        log(warning)
    bigger = larger_than_source(planned_bytes(plan), source_bytes(ckpt.source),
                                embed_dense="model.embed_tokens.weight" not in plan.quantized)
    if bigger:
        log(bigger)
    if stats is None and recipe.weighted and recipe.calib != "none":
        stats = calibration_stats(ckpt, recipe, device=device, progress=progress, log=log,
                                  mem_budget_gb=mem_budget_gb)
    if recipe.target_bpw is not None or recipe.target_mb is not None:  # mixed precision: bits per projection
        from .allocate import plan_bits
        recipe = plan_bits(ckpt, recipe, plan, stats, device, log).validate()
        plan = plan_quantization(ckpt, recipe)
    report: list[dict[str, Any]] = []
    prov0 = {"source": Path(ckpt.source).name, "source_format": ckpt.source_format}
    writer = CbkWriter(out, config=plan.config, tokenizer=ckpt.tokenizer, recipe=recipe.to_dict(), provenance=prov0,
                       generation=getattr(ckpt, "generation", None) or None, reserve_bytes=_header_reserve(plan))
    with writer:  # an exception (or Ctrl-C) aborts: no file, the target untouched
        for name, spec in plan.dense.items():
            writer.declare_dense(name, spec)
        for name, qspec in plan.quantized.items():
            writer.declare_quantized(name, qspec)
        for name, x, row in iter_quantized(ckpt, recipe, plan, device=device, stats=stats, progress=progress,
                                           log=log):
            if isinstance(x, QuantRecord):
                writer.put_quantized(name, x)
            else:
                writer.put_dense(name, x)
            if row is not None:
                report.append(row)
            del x
        summary = QuantizedModel(plan.config, {}, {}, report, time.perf_counter() - t_start, plan)
        if progress and Path(ckpt.source).is_file():
            log(f"hashing the source for the provenance ({Path(ckpt.source).stat().st_size / 1e6:,.0f} MB) ...")
        rd, prov = recipe_and_provenance(ckpt, recipe, summary)
        writer.update(recipe=rd, provenance=prov)
        if progress:
            log(f"writing {out} (header, fsync, rename) ...")
    path = writer.path
    if writer.header_moved_bytes:
        log(f"note: the header outgrew its reserved room; {writer.header_moved_bytes / 1e6:.1f} MB of data were moved")
    f = CbkFile(path)
    dense = LazyTensors({n: (lambda n=n: f.tensor(n)) for n in plan.dense})
    quantized = LazyTensors({n: (lambda n=n: f.record(n)) for n in plan.quantized})
    return Path(path), QuantizedModel(plan.config, dense, quantized, report, summary.seconds, plan)
