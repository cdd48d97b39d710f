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
  from 171 to 114 MB at the same perplexity, see QUALITY.md) and keeps an untied model's embedding fp16;
* per-layer overrides, matched with ``fnmatch`` against the canonical projection name
  (``model.layers.3.mlp.down_proj``, ``lm_head``): ``keep_fp16`` patterns stay dense fp16,
  ``bits_overrides`` [(pattern, bits)] pick the width (first match wins);
* everything else (norms, biases of dense layers) is stored dense: norms in fp32, the
  embedding and fp16-kept projections in fp16.

Memory: the checkpoint is read one tensor at a time (loaders are lazy) and each quantized
tensor is reduced to its packed codes at once, so the quantization pass holds one layer's
weights plus the output. Calibration from a text file runs the source one block at a time
(``calibrate.collect_input_stats_layerwise``: one block's weights plus the calibration hidden
states); the no-dataset default samples text from the model, which needs the whole model once
(use ``--calib FILE`` for sources that do not fit); ``calib="none"`` skips calibration (unweighted).
"""
from __future__ import annotations

import fnmatch
import hashlib
import sys
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import torch

from ..errors import ConfigError
from ..formats.checkpoint import Checkpoint
from .kmeans import kmeans_rows, weighted_error
from .pack import SUPPORTED_BITS, pack_codes
from .record import QuantRecord

__all__ = ["Recipe", "QuantizedModel", "quantize_checkpoint", "calibration_stats", "quantize_to_cbk",
           "parse_bits_overrides"]

PROJ_SUFFIXES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")


@dataclass
class Recipe:
    bits: int = 4
    head_bits: int | None = 8  # None: keep the LM head fp16
    embed_bits: int | None | str = "auto"  # None: fp16; "auto": tied -> share the head's table, else fp16
    weighted: bool = True  # E[x^2]-weighted k-means (False: plain k-means, no calibration)
    calib: str | None = None  # text file; None: sampled from the model itself; "none": no calibration
    calib_seqs: int = 32
    calib_len: int = 512  # file windows; sampled sequences use calib_sample_len
    calib_sample_len: int = 256
    seed: int = 0
    iters: int = 60
    starts: tuple[str, ...] = ("cuberoot", "grid")
    keep_fp16: list[str] = field(default_factory=list)
    bits_overrides: list[tuple[str, int]] = field(default_factory=list)

    def validate(self) -> "Recipe":
        for what, b in [("--bits", self.bits), ("--head-bits", self.head_bits), ("--embed-bits", self.embed_bits)]:
            if b is not None and b != "auto" and b not in SUPPORTED_BITS:
                raise ConfigError(f"{what} must be one of {SUPPORTED_BITS}, got {b}")
        for pat, b in self.bits_overrides:
            if b not in SUPPORTED_BITS:
                raise ConfigError(f"bits override {pat}={b}: bits must be one of {SUPPORTED_BITS}")
        if self.iters < 0:
            raise ConfigError(f"--iters must be >= 0, got {self.iters}")
        return self

    def bits_for(self, name: str) -> int | None:
        """Bits for a projection (canonical name without .weight); None = keep fp16."""
        if any(fnmatch.fnmatchcase(name, p) for p in self.keep_fp16):
            return None
        for pat, b in self.bits_overrides:
            if fnmatch.fnmatchcase(name, pat):
                return b
        return self.head_bits if name == "lm_head" else self.bits

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["starts"] = list(self.starts)
        d["bits_overrides"] = [list(x) for x in self.bits_overrides]
        d["method"] = ("per-row scalar codebook, " + ("E[x^2]-weighted" if self.weighted else "unweighted")
                       + " k-means, best of starts " + "/".join(self.starts) + f", up to {self.iters} Lloyd iterations")
        return d


def parse_bits_overrides(items: list[str]) -> list[tuple[str, int]]:
    """['model.layers.0.*=8', '*down_proj=8'] -> [(pattern, bits)]."""
    out = []
    for it in items:
        pat, sep, b = it.rpartition("=")
        if not sep or not pat:
            raise ConfigError(f"--layer-bits expects PATTERN=BITS, got {it!r}")
        try:
            out.append((pat, int(b)))
        except ValueError:
            raise ConfigError(f"--layer-bits {it!r}: bits must be an integer") from None
    return out


@dataclass
class QuantizedModel:
    config: Any  # ModelConfig of the output (tie flag may differ from the source)
    dense: dict[str, torch.Tensor]
    quantized: dict[str, QuantRecord]
    report: list[dict[str, Any]]  # per quantized tensor: name, bits, shape, rel errors, seconds
    seconds: float = 0.0

    def bits_per_weight(self, which: str = "projections") -> float:
        """Stored bits per weight: 'projections' (layers' q..down, quantized or kept dense),
        'all' (every tensor incl. head/embedding/norms/biases)."""
        nbits = nweights = 0
        for name, r in self.quantized.items():
            if which == "projections" and not name.startswith("model.layers."):
                continue
            nbits += sum(t.numel() * t.element_size() * 8 for t in r.tensors.values())
            nweights += r.shape[0] * r.shape[1]
        for name, t in self.dense.items():  # projections kept dense (fp16) count too
            if which == "projections" and name.startswith("model.layers.") and name.endswith("_proj.weight"):
                nbits += t.numel() * t.element_size() * 8
                nweights += t.numel()
        if which == "all":
            for name, t in self.dense.items():
                nbits += t.numel() * t.element_size() * 8
                nweights += t.numel()
            for r in self.quantized.values():
                if r.bias is not None:
                    nbits += r.bias.numel() * r.bias.element_size() * 8
        return nbits / max(1, nweights)


def _source_sha256(path: str) -> str | None:
    p = Path(path)
    if not p.is_file():
        return None
    h = hashlib.sha256()
    with open(p, "rb") as f:
        while block := f.read(1 << 24):
            h.update(block)
    return h.hexdigest()


def calibration_stats(ckpt: Checkpoint, recipe: Recipe, device: str = "cpu", decoder=None,
                      progress: bool = True, log: Callable[[str], None] | None = None) -> dict[str, torch.Tensor] | None:
    """E[x^2] per input channel of every projection, per the recipe's calibration source."""
    from . import calibrate

    if not recipe.weighted or recipe.calib == "none":
        return None
    from ..models.decoder import Decoder

    log = log or (lambda s: None)
    t0 = time.perf_counter()
    if recipe.calib:
        toks = calibrate.file_calibration_tokens(ckpt.tokenizer, recipe.calib, recipe.calib_seqs, recipe.calib_len)
        what = f"{toks.shape[0]} windows x {toks.shape[1]} tokens of {recipe.calib}"
        if decoder is None:  # bounded memory: one block of the source at a time
            stats = calibrate.collect_input_stats_layerwise(ckpt, toks, device=device, progress=progress)
            log(f"calibration: {what}, layer by layer, {time.perf_counter() - t0:.1f} s")
            return stats
        dec = decoder
    else:
        dec = decoder if decoder is not None else Decoder.from_checkpoint(ckpt, dtype=torch.float32, device=device).eval()
        bos = ckpt.tokenizer.bos_id if ckpt.tokenizer is not None else None
        toks = calibrate.sampled_calibration_tokens(dec, bos, recipe.calib_seqs, recipe.calib_sample_len,
                                                    seed=recipe.seed, progress=progress)
        what = f"{toks.shape[0]} sequences x {toks.shape[1]} tokens sampled from the model (seed {recipe.seed})"
    stats = calibrate.collect_input_stats(dec, toks, progress=progress)
    log(f"calibration: {what}, {time.perf_counter() - t0:.1f} s")
    if decoder is None:
        del dec
    return stats


def _quantize_matrix(W: torch.Tensor, bits: int, imp: torch.Tensor | None, recipe: Recipe, device: str,
                     bias: torch.Tensor | None) -> tuple[QuantRecord, dict[str, float]]:
    res = kmeans_rows(W, 1 << bits, imp, iters=recipe.iters, starts=recipe.starts, device=device)
    rec = QuantRecord("codebook", (W.shape[0], W.shape[1]), {"bits": bits},
                      {"codes": pack_codes(res.codes, bits), "codebook": res.codebook},
                      None if bias is None else bias.detach().to(torch.float16).cpu())
    Wq = torch.gather(res.codebook.float(), 1, res.codes.long())
    err = {"rel_err": weighted_error(W, Wq), "rel_err_weighted": weighted_error(W, Wq, imp) if imp is not None else float("nan")}
    return rec, err


def quantize_checkpoint(ckpt: Checkpoint, recipe: Recipe, *, device: str = "cpu",
                        stats: dict[str, torch.Tensor] | None = None, progress: bool = True,
                        log: Callable[[str], None] | None = None) -> QuantizedModel:
    """Quantize every projection of ``ckpt`` per ``recipe`` (calibration stats computed if needed)."""
    from tqdm import tqdm

    recipe.validate()
    log = log or (lambda s: print(s, file=sys.stderr))
    t_start = time.perf_counter()
    if stats is None and recipe.weighted and recipe.calib != "none":
        stats = calibration_stats(ckpt, recipe, device=device, progress=progress, log=log)
    cfg = replace(ckpt.config)
    T = ckpt.tensors
    dense: dict[str, torch.Tensor] = {}
    quantized: dict[str, QuantRecord] = {}
    report: list[dict[str, Any]] = []

    def imp_for(name: str) -> torch.Tensor | None:
        if not recipe.weighted or stats is None:
            return None
        return stats.get(name)

    def do(name: str, W: torch.Tensor, bits: int | None, bias: torch.Tensor | None, imp=None, store_as=None):
        key = (store_as or name) + ".weight"
        if bits is None:
            dense[key] = W.detach().to(torch.float16).cpu()
            if bias is not None:
                dense[(store_as or name) + ".bias"] = bias.detach().to(torch.float16).cpu()
            return None
        t0 = time.perf_counter()
        rec, err = _quantize_matrix(W.float(), bits, imp, recipe, device, bias)
        quantized[key] = rec
        row = {"name": store_as or name, "bits": bits, "shape": list(W.shape), **err,
               "seconds": time.perf_counter() - t0}
        report.append(row)
        return row

    def dense_of(x):  # a .cbk source holds QuantRecords: requantize from their dequantized weights
        if isinstance(x, QuantRecord):
            from .linear import build_linear
            return build_linear(x).dequantize(torch.float32)
        return x

    layers = range(cfg.num_layers)
    bar = tqdm(layers, desc="quantize", unit="layer", disable=not progress, dynamic_ncols=True)
    for i in bar:
        rows = []
        for suf in PROJ_SUFFIXES:
            name = f"model.layers.{i}.{suf}"
            rec = T[name + ".weight"]
            W = dense_of(rec)
            b = T[name + ".bias"] if (name + ".bias") in T else getattr(rec, "bias", None)
            r = do(name, W, recipe.bits_for(name), b, imp_for(name))
            if r is not None:
                rows.append(r)
            del W
        for key in T:
            if key.startswith(f"model.layers.{i}.") and not any(key.startswith(f"model.layers.{i}.{s}.") for s in PROJ_SUFFIXES):
                dense[key] = T[key].detach().float().cpu()  # norms
        if rows:
            msg = "  ".join(f"{r['name'].rsplit('.', 1)[-1]}:{r['rel_err']:.4f}" for r in rows)
            bar.set_postfix_str(f"max rel err {max(r['rel_err'] for r in rows):.4f}")
            (tqdm.write if progress else log)(f"layer {i:3d}  rel. weight error  {msg}")
    dense["model.norm.weight"] = T["model.norm.weight"].detach().float().cpu()

    # Embedding and LM head.
    E = dense_of(T["model.embed_tokens.weight"])
    head_bits = recipe.bits_for("lm_head")
    embed_bits = recipe.embed_bits
    if embed_bits == "auto":
        embed_bits = head_bits if cfg.tie_word_embeddings else None
    head_imp = imp_for("lm_head")
    if cfg.tie_word_embeddings:
        if head_bits is not None and embed_bits == head_bits:  # one quantized table for both
            r = do("model.embed_tokens", E, embed_bits, None, head_imp)
            log(f"embed_tokens+lm_head (tied) {embed_bits}-bit  rel. weight error {r['rel_err']:.4f}")
        else:
            do("model.embed_tokens", E, embed_bits, None, None)
            if head_bits is not None:
                r = do("lm_head", E, head_bits, None, head_imp)
                cfg = replace(cfg, tie_word_embeddings=False)
                log(f"lm_head (untied from the embedding) {head_bits}-bit  rel. weight error {r['rel_err']:.4f}")
    else:
        do("model.embed_tokens", E, embed_bits, None, None)
        H = dense_of(T["lm_head.weight"])
        r = do("lm_head", H, head_bits, None, head_imp)
        if r is not None:
            log(f"lm_head {head_bits}-bit  rel. weight error {r['rel_err']:.4f}")
    seconds = time.perf_counter() - t_start
    return QuantizedModel(cfg, dense, quantized, report, seconds)


def quantize_to_cbk(src: str | None, out: str | Path, recipe: Recipe, *, device: str = "cpu",
                    progress: bool = True, log: Callable[[str], None] | None = None) -> tuple[Path, QuantizedModel]:
    """Load ``src`` (HF dir, .gguf, .cbk source; None = default model), quantize, write ``out`` atomically."""
    from ..api import load_checkpoint
    from ..formats.cbk import write_cbk

    log = log or (lambda s: print(s, file=sys.stderr))
    ckpt = load_checkpoint(src)
    qm = quantize_checkpoint(ckpt, recipe, device=device, progress=progress, log=log)
    prov = {"source": Path(ckpt.source).name, "source_format": ckpt.source_format,
            "source_sha256": _source_sha256(ckpt.source), "quantize_seconds": round(qm.seconds, 2)}
    rd = recipe.to_dict()
    rd["bits_per_weight"] = {"projections": round(qm.bits_per_weight("projections"), 4),
                             "all": round(qm.bits_per_weight("all"), 4)}
    rd["layer_errors"] = {r["name"]: round(r["rel_err"], 6) for r in qm.report}
    path = write_cbk(out, config=qm.config, dense=qm.dense, quantized=qm.quantized, tokenizer=ckpt.tokenizer,
                     recipe=rd, provenance=prov, generation=getattr(ckpt, "generation", None) or None)
    return Path(path), qm
