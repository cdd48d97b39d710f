"""Whole-model additive quantization (``trapetum quantize SRC -o OUT.cbk --scheme aqlm-2x8|aqlm-1x16``).

Per projection (q/k/v/o, gate/up/down) of every layer: ``additive.quantize_additive`` weighted by
E[x^2] of the projection's input channel, from the scalar quantizer's calibration
(``quantize.calibration_stats``: a text file, or text sampled from the model itself). The final
norm, the embedding and the LM head are the scalar quantizer's own (``quantize.quantize_checkpoint``
with ``layers=False``, same ``head_bits`` / ``embed_bits``): the head an 8-bit per-row scalar codebook
weighted by the final-norm statistics; a tied model (``embed_bits="auto"``) stores ONE such table,
``model.embed_tokens.weight``, for embedding and head (the config stays tied); an untied model keeps
its embedding dense fp16. Layer norms stay dense fp32.

Layer by layer with bounded memory: one layer's weights are read at a time; its records are written
at once to ``<OUT>.parts/layer_NNNN.safetensors`` (temporary file + ``os.replace``, so a kill leaves
either the whole layer or nothing) with a fingerprint of the model (sha256 of every source tensor),
the calibration settings and the quantizer settings. A rerun with the same model, data and settings
reuses every finished layer whose fingerprint matches (the calibration statistics are cached the same
way) and computes the rest; the quantizer is seeded per layer, so a resumed run writes the same file
as an uninterrupted one. The parts hold the layers' projections only: the embedding and head are
computed at every run from the source and the (cached) statistics, so ``head_bits`` / ``embed_bits``
(the head layout) are left out of the layer fingerprint and cannot mix with an old part. The parts
directory is removed after the ``.cbk`` is written.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..errors import ConfigError
from ..formats.cbk import write_cbk
from ..formats.detect import load_checkpoint
from ..kernels import beam_search as beam_step
from ..models.schema import layer_projections
from ..schemes import registry
from ..schemes.record import QuantRecord
from .additive import SCHEMES, AdditiveLinear, dequantize_aqlm, quantize_additive
from .quantize import (QuantizedModel, Recipe, calibration_stats, quantize_checkpoint, recipe_summary,
                       source_provenance)

__all__ = ["AdditiveRecipe", "quantize_additive_checkpoint", "quantize_additive_to_cbk", "model_fingerprint",
           "save_calibration"]

CALIBRATION_CACHE = "calibration.safetensors"  # in the work directory (``<OUT>.parts``)


@dataclass
class AdditiveRecipe:
    scheme: str = "aqlm-2x8"  # "aqlm-2x8" | "aqlm-1x16"
    head_bits: int | None = 8
    embed_bits: int | None | str = "auto"  # as quantize.Recipe: "auto" gives a tied model one shared table
    weighted: bool = True
    calib: str | None = None  # text file; None: sampled from the model; "none": unweighted
    calib_seqs: int = 32
    calib_len: int = 512
    calib_sample_len: int = 256
    seed: int = 0
    beam: int = 4
    iters: int = 6  # beam-search / least-squares rounds
    beam_steps: int = 2
    kmeans_iters: int = 10
    head_codebook: str = "shared"  # the scalar head's codebook storage, as quantize.Recipe.head_codebook
    head_group_rows: int = 512
    gptq: bool = False  # the full-Hessian refinement (additive_gptq.py): needs calibration with Hessians
    gptq_rounds: int = 2
    gptq_block: int = 128
    gptq_damp: float = 0.01
    gptq_cg_iters: int = 25

    GPTQ_FIELDS = ("gptq", "gptq_rounds", "gptq_block", "gptq_damp", "gptq_cg_iters")

    def validate(self) -> "AdditiveRecipe":
        if self.scheme not in SCHEMES:
            raise ConfigError(f"--scheme must be one of {', '.join(SCHEMES)}, got {self.scheme!r}")
        for k in ("beam", "beam_steps", "calib_seqs"):
            if getattr(self, k) < 1:
                raise ConfigError(f"{k} must be >= 1")
        if self.iters < 0:
            raise ConfigError("iters must be >= 0")
        if self.gptq and (not self.weighted or self.calib == "none"):
            raise ConfigError("--gptq needs calibration (its Hessians): not --calib none")
        if self.gptq_rounds < 1 or self.gptq_block < 8 or not self.gptq_damp > 0 or self.gptq_cg_iters < 0:
            raise ConfigError("--gptq-rounds must be >= 1, the block >= 8, the damping > 0, the CG iterations >= 0")
        self.scalar_recipe().validate()  # head_bits / embed_bits
        return self

    def scalar_recipe(self, hessians: bool = False) -> Recipe:
        """The scalar recipe whose calibration (and LM head / embedding) this run shares; ``hessians``: its
        calibration also collects the input Hessians (the scalar recipe's ``gptq``; only the calibration reads it
        here: the head and embedding are quantized with ``hessians=False``)."""
        return Recipe(bits=4, head_bits=self.head_bits, embed_bits=self.embed_bits, weighted=self.weighted,
                      calib=self.calib, calib_seqs=self.calib_seqs, calib_len=self.calib_len,
                      calib_sample_len=self.calib_sample_len, seed=self.seed, head_codebook=self.head_codebook,
                      head_group_rows=self.head_group_rows, gptq=hessians)

    def fingerprint_settings(self) -> dict[str, Any]:
        """The settings a layer part depends on: ``to_dict`` without the head layout (computed at every run);
        without the GPTQ fields when it is off, so parts written before the option existed still resume."""
        head_layout = ("head_bits", "embed_bits", "head_codebook", "head_group_rows")
        skip = head_layout + (() if self.gptq else self.GPTQ_FIELDS)
        return {k: v for k, v in self.to_dict().items() if k not in skip}

    def to_dict(self) -> dict[str, Any]:
        M, nb = SCHEMES[self.scheme]
        d = asdict(self)
        d["method"] = (f"additive codebooks {M}x{nb} (AQLM layout, in_group 8, per-row scales): residual k-means "
                       f"start, beam search (beam {self.beam}) and least-squares codebooks, "
                       + ("E[x^2]-weighted" if self.weighted and self.calib != "none" else "unweighted")
                       + f", {self.iters} rounds"
                       + (f"; then {self.gptq_rounds} rounds under the full input Hessian (calibration): "
                          f"error-compensated codes (GPTQ sweep over groups of 8, damping {self.gptq_damp}, "
                          "then exact per-group coordinate descent) and Hessian least-squares codebooks and scales, "
                          "never worse than the start" if self.gptq else "")
                       + "; lm_head " + (f"{self.head_bits}-bit scalar codebook" if self.head_bits else "fp16"))
        return d


def _sha_tensor(h: "hashlib._Hash", name: str, t: Any) -> None:
    if isinstance(t, QuantRecord):
        h.update(json.dumps([name, t.scheme, list(t.shape), t.params], sort_keys=True).encode())
        for k in sorted(t.tensors):
            _sha_tensor(h, f"{name}/{k}", t.tensors[k])
        if t.bias is not None:
            _sha_tensor(h, f"{name}/bias", t.bias)
        return
    t = t.detach().cpu().contiguous()
    h.update(json.dumps([name, str(t.dtype), list(t.shape)]).encode())
    if t.numel():
        h.update(t.view(torch.uint8).numpy().tobytes() if t.dim() else t.reshape(1).view(torch.uint8).numpy().tobytes())


def model_fingerprint(ckpt) -> str:
    """sha256 over the config and every tensor of the checkpoint (read one tensor at a time)."""
    h = hashlib.sha256(json.dumps(ckpt.config.to_dict(), sort_keys=True).encode())
    for name in sorted(ckpt.tensors):
        _sha_tensor(h, name, ckpt.tensors[name])
    return h.hexdigest()


def _calib_fingerprint(ckpt_fp: str, recipe: AdditiveRecipe) -> str:
    calib_file = None
    if recipe.calib and recipe.calib != "none":
        calib_file = hashlib.sha256(Path(recipe.calib).read_bytes()).hexdigest()
    keys = {k: getattr(recipe, k) for k in ("weighted", "calib_seqs", "calib_len", "calib_sample_len", "seed")}
    if recipe.gptq:  # the cache then holds the Hessians too (and comes from the layer-by-layer collection)
        keys["hessians"] = True
    return hashlib.sha256(json.dumps([ckpt_fp, calib_file, recipe.calib == "none", keys], sort_keys=True)
                          .encode()).hexdigest()


def _atomic_save(tensors: dict[str, torch.Tensor], path: Path, meta: dict[str, str]) -> None:
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp), metadata=meta)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _load_if(path: Path, fingerprint: str) -> tuple[dict[str, torch.Tensor], dict[str, str]] | None:
    if not path.exists():
        return None
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            if meta.get("fingerprint") != fingerprint:
                return None
            return {k: f.get_tensor(k) for k in f.keys()}, meta
    except Exception:  # a damaged part is recomputed
        return None


HESSIAN_PREFIX = "hessian:"  # cache keys of the Hessians (one tensor per distinct input; the aliases in metadata)


def _stats(ckpt, recipe: AdditiveRecipe, work: Path, fp: str, device: str, progress: bool,
           log, mem_budget_gb: float | None) -> tuple[dict[str, torch.Tensor] | None, dict[str, torch.Tensor]]:
    """(E[x^2] per projection or None, the Hessians per projection: empty unless ``recipe.gptq``)."""
    if not recipe.weighted or recipe.calib == "none":
        return None, {}
    got = _load_if(work / CALIBRATION_CACHE, _calib_fingerprint(fp, recipe))
    if got is not None:
        log("calibration: reusing cached statistics")
        tensors, meta = got
        stats = {k: v for k, v in tensors.items() if not k.startswith(HESSIAN_PREFIX)}
        alias = json.loads(meta.get("hessians", "{}"))
        return stats, {name: tensors[HESSIAN_PREFIX + owner] for name, owner in alias.items()}
    stats = calibration_stats(ckpt, recipe.scalar_recipe(hessians=recipe.gptq), device=device, progress=progress,
                              log=log, mem_budget_gb=mem_budget_gb)
    hessians = dict(getattr(stats, "hessians", None) or {}) if recipe.gptq else {}
    save_calibration(work, fp, recipe, stats, hessians)
    return stats, hessians


def save_calibration(work_dir: str | Path, fingerprint: str, recipe: AdditiveRecipe,
                     stats: dict[str, torch.Tensor], hessians: dict[str, torch.Tensor] | None = None) -> None:
    """Store ``stats`` (float32, on the CPU) as the calibration cache of ``work_dir`` for the model of
    ``fingerprint`` (``model_fingerprint``) and ``recipe``'s calibration settings: a run with the same model,
    data and settings reuses them instead of calibrating (the quantizer benchmark seeds its random
    statistics this way). ``hessians`` (``recipe.gptq``): projection -> E[x x^T], stored once per distinct
    tensor (q/k/v and gate/up share one)."""
    tensors = {k: v.float().cpu() for k, v in stats.items()}
    owner_of: dict[int, str] = {}
    alias: dict[str, str] = {}
    for name in sorted(hessians or {}):
        H = hessians[name]
        owner = owner_of.setdefault(id(H), name)
        alias[name] = owner
        if owner == name:
            tensors[HESSIAN_PREFIX + name] = H.float().cpu()
    meta = {"fingerprint": _calib_fingerprint(fingerprint, recipe)}
    if alias:
        meta["hessians"] = json.dumps(alias, sort_keys=True)
    _atomic_save(tensors, Path(work_dir) / CALIBRATION_CACHE, meta)


def _layer_seed(seed: int, name: str) -> int:
    return (seed * 1000003 + int(hashlib.sha256(name.encode()).hexdigest()[:8], 16)) % (2**31)


def quantize_additive_checkpoint(ckpt, recipe: AdditiveRecipe, work_dir: str | Path, *, device: str = "cpu",
                                 progress: bool = True, log: Callable[[str], None] | None = None,
                                 stop_after: int | None = None, mem_budget_gb: float | None = None) -> QuantizedModel:
    """Quantize every projection of ``ckpt`` to additive codebooks (see the module docstring).

    ``stop_after``: raise KeyboardInterrupt after that many layers were computed (tests of resuming).
    ``mem_budget_gb``: the calibration's memory budget (``quantize.calibration_stats``)."""
    from tqdm import tqdm

    recipe.validate()
    log = log or (lambda s: print(s, file=sys.stderr))
    M, nbits = SCHEMES[recipe.scheme]
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    fp = model_fingerprint(ckpt)
    stats, hessians = _stats(ckpt, recipe, work, fp, device, progress, log, mem_budget_gb)
    # what a layer part depends on: not the head layout (head_bits, embed_bits, its storage), computed at every run
    settings = json.dumps(recipe.fingerprint_settings(), sort_keys=True)
    cfg = ckpt.config
    T = ckpt.tensors
    dense: dict[str, torch.Tensor] = {}
    quantized: dict[str, QuantRecord] = {}
    report: list[dict[str, Any]] = []
    computed = 0
    bar = tqdm(range(cfg.num_layers), desc=f"quantize {recipe.scheme}", unit="layer", disable=not progress,
               dynamic_ncols=True)
    # the beam step's implementation (torch on the CPU, the Triton kernel on CUDA) rounds scores differently,
    # so a part is reused only by a run with the same one: a resumed run gives the uninterrupted run's file
    step = beam_step.resolve("auto", torch.device(device), 1 << nbits)
    for i in bar:
        # "errors v2": parts record the plain and the weighted error (older parts, weighted only, are redone)
        lfp = hashlib.sha256(f"{fp}|{_calib_fingerprint(fp, recipe)}|{settings}|layer {i}|errors v2|step {step}"
                             .encode()).hexdigest()
        part = work / f"layer_{i:04d}.safetensors"
        got = _load_if(part, lfp)
        # the layer's projections (attention or MLA; the dense MLP or every expert): name suffixes
        sufs = [n[len(f"model.layers.{i}."):] for n in layer_projections(cfg, i)]
        if got is None:
            tensors: dict[str, torch.Tensor] = {}
            errs: dict[str, float] = {}
            errs_w: dict[str, float] = {}
            gains: dict[str, float] = {}  # --gptq: Hessian objective against the diagonal start's
            for suf in sufs:
                name = f"model.layers.{i}.{suf}"
                W = T[name + ".weight"]
                if isinstance(W, QuantRecord):
                    W = registry.dequantize(W, torch.float32, name)
                imp = None if stats is None else stats.get(name)
                hess = hessians.get(name) if recipe.gptq else None  # experts have none: the diagonal objective
                r = quantize_additive(W.float(), imp, num_codebooks=M, nbits=nbits, beam=recipe.beam,
                                      iters=recipe.iters, beam_steps=recipe.beam_steps,
                                      kmeans_iters=recipe.kmeans_iters, seed=_layer_seed(recipe.seed, name),
                                      device=device, hessian=hess, gptq_rounds=recipe.gptq_rounds,
                                      gptq_block=recipe.gptq_block, gptq_damp=recipe.gptq_damp,
                                      gptq_cg_iters=recipe.gptq_cg_iters)
                if r.gptq is not None:
                    gains[suf] = r.gptq["objective"] / max(r.gptq["objective_start"], 1e-300)
                tensors[f"{suf}.codes"], tensors[f"{suf}.codebooks"], tensors[f"{suf}.scales"] = \
                    r.codes, r.codebooks, r.scales
                # the two measures of the scalar report: plain and E[x^2]-weighted relative norm error
                Wf = W.to(device=device, dtype=torch.float32)  # on the quantizer's device (GPU: fast, transient)
                Wq = dequantize_aqlm(r.codes.to(Wf.device), r.codebooks.to(Wf.device), r.scales.to(Wf.device))
                errs[suf] = float((Wf - Wq).norm() / Wf.norm().clamp_min(1e-30))
                errs_w[suf] = r.history[-1] ** 0.5 if imp is not None else float("nan")
                del W, Wf, Wq
            meta = {"errors": json.dumps(errs), "errors_weighted": json.dumps(errs_w), "hessian_gain": json.dumps(gains)}
            _atomic_save(tensors, part, {"fingerprint": lfp, **meta})
            computed += 1
        else:
            tensors, meta = got
        errs, errs_w = json.loads(meta["errors"]), json.loads(meta["errors_weighted"])
        gains = json.loads(meta.get("hessian_gain", "{}"))
        for suf in sufs:
            name = f"model.layers.{i}.{suf}"
            bias = T[name + ".bias"] if (name + ".bias") in T else None
            mod = AdditiveLinear(tensors[f"{suf}.codes"], tensors[f"{suf}.codebooks"], tensors[f"{suf}.scales"],
                                 None if bias is None else bias.detach().to(torch.float16).cpu())
            quantized[name + ".weight"] = mod.to_record()
            report.append({"name": name, "scheme": recipe.scheme, "shape": [mod.out_features, mod.in_features],
                           "rel_err": errs[suf], "rel_err_weighted": errs_w[suf],
                           **({"hessian_gain": gains[suf]} if suf in gains else {})})
        owned = {f"model.layers.{i}.{s}.{x}" for s in sufs for x in ("weight", "bias")}
        for key in T:
            if key.startswith(f"model.layers.{i}.") and key not in owned:
                dense[key] = T[key].detach().float().cpu()  # norms, routers, the correction bias, shared gate
        msg = "  ".join(f"{s.rsplit('.', 1)[-1]}:{errs[s]:.4f}" + (f"(H x{gains[s]:.2f})" if s in gains else "")
                        for s in sufs)
        (tqdm.write if progress else log)(f"layer {i:3d}  rel. weight error  {msg}"
                                          + ("" if got is None else "  (resumed)"))
        if stop_after is not None and computed >= stop_after and i + 1 < cfg.num_layers:
            raise KeyboardInterrupt(f"stopped after {computed} computed layers")
    # final norm, embedding and LM head: the scalar quantizer's code (one shared table when tied)
    tables = quantize_checkpoint(ckpt, recipe.scalar_recipe(), device=device, stats=stats, progress=False,
                                 log=log, layers=False)
    dense.update(tables.dense)
    quantized.update(tables.quantized)
    report += tables.report
    return QuantizedModel(tables.config, dense, quantized, report, time.perf_counter() - t0)


def quantize_additive_to_cbk(src: str | None, out: str | Path, recipe: AdditiveRecipe, *, device: str = "cpu",
                             progress: bool = True, log: Callable[[str], None] | None = None,
                             stop_after: int | None = None, keep_parts: bool = False,
                             provenance: dict | None = None,
                             mem_budget_gb: float | None = None) -> tuple[Path, QuantizedModel]:
    """Load ``src``, quantize (resuming from ``<out>.parts``), write ``out`` atomically. ``mem_budget_gb``:
    the calibration's memory budget (``quantize.calibration_stats``)."""
    log = log or (lambda s: print(s, file=sys.stderr))
    ckpt = load_checkpoint(src)
    out = Path(out)
    work = out.with_name(out.name + ".parts")
    qm = quantize_additive_checkpoint(ckpt, recipe, work, device=device, progress=progress, log=log,
                                      stop_after=stop_after, mem_budget_gb=mem_budget_gb)
    prov = {**source_provenance(ckpt), **(provenance or {})}
    path = write_cbk(out, config=qm.config, dense=qm.dense, quantized=qm.quantized, tokenizer=ckpt.tokenizer,
                     recipe=recipe_summary(recipe.to_dict(), qm), provenance=prov,
                     generation=getattr(ckpt, "generation", None) or None)
    if not keep_parts:
        shutil.rmtree(work, ignore_errors=True)
    log(f"quantized in {qm.seconds:.1f} s")
    return Path(path), qm

