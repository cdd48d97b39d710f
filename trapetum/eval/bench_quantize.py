"""Quantizer speed on a random-weight model at a real shape (issue 3 item 4, issue 6 item 5).

    python -m trapetum.eval.bench_quantize --shape llama2-7b [--scheme cb4|aqlm-2x8|aqlm-1x16]
                                           [--device cuda] [--out DIR] [--layers N]
    trapetum bench quantize --shape llama2-7b [--scheme aqlm-2x8]

Builds a lazy checkpoint whose tensors are generated on demand (seeded per tensor, fp16, on the
device), E[x^2] statistics drawn at random per input channel (the weighted k-means path, without
running calibration text through a random model), and times ``quantize_to_cbk`` end to end: every
projection 4-bit, the LM head 8-bit, the file streamed to DIR. ``--layers`` quantizes the first N
blocks only (a smoke run); the figure to report is a full run.

``--scheme aqlm-2x8`` / ``aqlm-1x16`` times the additive driver instead (``quant/additive_driver.py``,
the code behind ``trapetum quantize --scheme aqlm-2x8``) with its default ``AdditiveRecipe``, on the same
random checkpoint and the same random E[x^2] statistics: they are handed to the driver through its own
calibration cache (``<OUT>.parts/calibration.safetensors``), so no text is run through a random model.
The timed region is the driver (fingerprint, every layer, head/embedding) plus ``write_cbk``. Each
layer's time goes to stderr as it finishes, so a partial (``--layers N``) or killed run still gives the
per-layer cost; the JSON line's ``extrapolation`` (only when ``--layers`` is below the shape's depth) is
an estimate from those per-layer times, labelled as such, never a measurement. ``--work DIR`` (additive
schemes) keeps the file and the driver's per-layer parts in DIR: a run killed part-way (a time limit)
leaves its finished layers there, and the same command resumes from them; the resumed run's JSON line
counts its own layers only (``layers_resumed`` says how many it took over), so a whole-model time split
over two runs is the sum of the killed run's per-layer lines and the resumed run's ``seconds``.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
import zlib
from pathlib import Path

import torch

from ..models.checkpoint import Checkpoint, LazyTensors
from ..models.schema import expected_shapes
from ..kernels import beam_search as beam_step
from ..models.config import ModelConfig
from ..quant.quantize import PROJ_SUFFIXES, Recipe, quantize_to_cbk
from .random_model import SHAPES


def random_checkpoint(cfg: ModelConfig, device: str) -> Checkpoint:
    """Lazy checkpoint of random fp16 weights (norms ones), one tensor materialized per access."""
    shapes = expected_shapes(cfg)

    def getter(name: str, shape: tuple[int, ...]):
        def get() -> torch.Tensor:
            if len(shape) == 1:
                return torch.ones(shape, device=device)
            g = torch.Generator(device=device).manual_seed(zlib.crc32(name.encode()))
            return (torch.randn(shape, device=device, generator=g) * 0.02).to(torch.float16)
        return get

    tensors = LazyTensors({n: getter(n, s) for n, s in shapes.items()}, {n: "F16" for n in shapes}, shapes)
    return Checkpoint(cfg, tensors, None, f"random:{cfg.family}", "random")


def random_stats(cfg: ModelConfig, device: str) -> dict[str, torch.Tensor]:
    g = torch.Generator(device=device).manual_seed(1)
    ins = {"self_attn.q_proj": cfg.hidden_size, "self_attn.k_proj": cfg.hidden_size,
           "self_attn.v_proj": cfg.hidden_size, "self_attn.o_proj": cfg.num_heads * cfg.head_dim,
           "mlp.gate_proj": cfg.hidden_size, "mlp.up_proj": cfg.hidden_size, "mlp.down_proj": cfg.intermediate_size}
    stats = {}
    for i in range(cfg.num_layers):
        for suf in PROJ_SUFFIXES:
            stats[f"model.layers.{i}.{suf}"] = torch.rand(ins[suf], device=device, generator=g) + 0.01
    stats["lm_head"] = torch.rand(cfg.hidden_size, device=device, generator=g) + 0.01
    return stats


class RandomHessians:
    """``Stats.hessians`` for ``--gptq``: E[x x^T] of each projection's input, made on access (seeded by the
    input's name, on the device): diag(E[x^2]) plus a rank-C/8 positive part, the shape of a real layer's
    second moment. q/k/v and gate/up share an input (its name), as calibration gives them one matrix; each access
    computes it again (a [C, C/8] x [C/8, C] product: milliseconds on a GPU, inside the timed region)."""

    def __init__(self, stats: dict[str, torch.Tensor], device: str):
        self.stats, self.device = stats, device

    def get(self, name: str, default=None):
        d = self.stats.get(name)
        if d is None or name == "lm_head":
            return default
        shared = name.replace("k_proj", "q_proj").replace("v_proj", "q_proj").replace("up_proj", "gate_proj")
        g = torch.Generator(device=self.device).manual_seed(zlib.crc32(shared.encode()))
        C = d.shape[0]
        A = torch.randn(C, max(1, C // 8), device=self.device, generator=g) / C ** 0.5
        return torch.diag(d) + A @ A.T


SCHEMES = ("cb4", "aqlm-2x8", "aqlm-1x16")


def work_cbk(work: str | None, scheme: str) -> Path | None:
    """The kept .cbk of ``--work DIR`` (DIR/model.cbk, DIR made), or None without it."""
    if not work:
        return None
    if scheme == "cb4":
        from ..errors import TrapetumError
        raise TrapetumError("--work: only the additive schemes (aqlm-2x8, aqlm-1x16) resume a killed run")
    Path(work).mkdir(parents=True, exist_ok=True)
    return Path(work) / "model.cbk"


def run(shape: str, device: str, out_dir: Path | None, layers: int | None = None, scheme: str = "cb4",
        keep: Path | None = None, additive_settings: dict | None = None, stop_after: int | None = None,
        gptq: bool = False) -> dict:
    """Time one quantizer run and print one JSON line. ``keep``: write the .cbk there (kept) instead of
    a temporary directory (additive schemes), its ``.parts`` work folder next to it: a run killed before
    the end leaves its finished layers there and the next run with the same ``keep`` resumes from them
    (``--work``). ``additive_settings``: AdditiveRecipe field overrides (tests; the benchmark uses the
    defaults). ``stop_after``: the driver stops after that many computed layers (tests of resuming). ``gptq``:
    the scalar recipe with ``--gptq`` (``RandomHessians`` in place of calibration's)."""
    spec = dict(SHAPES[shape])
    full_layers = spec["num_layers"]
    if layers:
        spec["num_layers"] = layers
    cfg = ModelConfig(**spec).validate(shape)
    ckpt = random_checkpoint(cfg, device)
    stats = random_stats(cfg, device)
    if scheme != "cb4":
        return _run_additive(shape, scheme, cfg, full_layers, ckpt, stats, device, out_dir, keep,
                             additive_settings or {}, stop_after)
    recipe = Recipe(bits=4, head_bits=8, embed_bits=None, gptq=gptq).validate()
    if gptq:
        from ..quant.calibrate import Stats
        stats = Stats(stats, {}, RandomHessians(stats, device))
    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        path, qm = quantize_to_cbk(ckpt, Path(tmp) / "model.cbk", recipe, device=device, progress=True,
                                   stats=stats)
        seconds = time.perf_counter() - t0
        size = path.stat().st_size
    res = {"shape": shape, "scheme": "cb4", "layers": cfg.num_layers, "device": device,
           "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else None,
           "seconds": round(seconds, 2), "file_bytes": size, "date": time.strftime("%Y-%m-%d"),
           "recipe": "4-bit projections (E[x^2]-weighted k-means, random statistics" + (
               ", then GPTQ with random Hessians" if gptq else "") + "), 8-bit head, fp16 embedding"}
    print(json.dumps(res))
    return res


def _run_additive(shape: str, scheme: str, cfg: ModelConfig, full_layers: int, ckpt: Checkpoint,
                  stats: dict[str, torch.Tensor], device: str, out_dir: Path | None, keep: Path | None,
                  settings: dict, stop_after: int | None = None) -> dict:
    from ..formats.cbk import verify_cbk, write_cbk
    from ..quant import additive_driver as drv

    recipe = drv.AdditiveRecipe(scheme=scheme, **settings).validate()
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    marks: dict[str, float] = {}
    per_layer: list[float] = []  # layers computed by this run
    resumed: list[int] = []  # layers an earlier, killed run left in the work folder

    def log(msg: str) -> None:
        now = time.perf_counter()
        if msg.startswith("calibration: reusing"):  # fingerprint done, the layers start
            marks["layers0"] = marks["last"] = now
        elif msg.startswith("layer "):
            sync()
            now = time.perf_counter()
            i = len(per_layer) + len(resumed)
            if msg.endswith("(resumed)"):
                resumed.append(i)
            else:
                per_layer.append(now - marks["last"])
            print(f"[bench] layer {i}/{cfg.num_layers}: {now - marks['last']:.2f} s "
                  f"(elapsed {now - marks['t0']:.1f} s)  {msg}", file=sys.stderr, flush=True)
            marks["last"] = now
            return
        print(msg, file=sys.stderr, flush=True)

    with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
        out = Path(keep) if keep else Path(tmp) / "model.cbk"
        work = out.with_name(out.name + ".parts")
        work.mkdir(parents=True, exist_ok=True)
        # the random statistics, as the driver's calibration cache (untimed: the scalar path gets them
        # as an argument); the driver recomputes the model fingerprint inside the timed region
        drv.save_calibration(work, drv.model_fingerprint(ckpt), recipe, stats)
        sync()
        marks["t0"] = t0 = time.perf_counter()
        qm = drv.quantize_additive_checkpoint(ckpt, recipe, work, device=device, progress=False, log=log,
                                              stop_after=stop_after)
        if "layers0" not in marks:
            raise RuntimeError("the additive driver did not reuse the seeded calibration statistics")
        t_head0 = marks["last"]
        rd = recipe.to_dict()
        rd["bits_per_weight"] = {"projections": round(qm.bits_per_weight("projections"), 4),
                                 "all": round(qm.bits_per_weight("all"), 4)}
        path = Path(write_cbk(out, config=qm.config, dense=qm.dense, quantized=qm.quantized, tokenizer=None,
                              recipe=rd, provenance={"source": ckpt.source, "source_format": "random"}))
        sync()
        seconds = time.perf_counter() - t0
        size = path.stat().st_size
        f, problems = verify_cbk(path)  # untimed
        if f is not None:
            f.close()
        shutil.rmtree(work, ignore_errors=True)
    setup = marks["layers0"] - t0  # model fingerprint (+ reading the cached statistics)
    tail = seconds - (t_head0 - t0)  # final norm, embedding, LM head, write_cbk
    res = {"shape": shape, "scheme": scheme, "layers": cfg.num_layers, "device": device,
           "gpu": torch.cuda.get_device_name() if device.startswith("cuda") else None,
           "seconds": round(seconds, 2), "file_bytes": size, "date": time.strftime("%Y-%m-%d"),
           "verified": not problems,
           "breakdown_seconds": {"fingerprint": round(setup, 2), "layers": round(sum(per_layer), 2),
                                 "head_embed_write": round(tail, 2)},
           "per_layer_seconds": [round(x, 2) for x in per_layer],
           "layers_resumed": len(resumed),
           "beam_step": beam_step.resolve("auto", torch.device(device), 1 << drv.SCHEMES[scheme][1]),
           "settings": {k: v for k, v in rd.items() if k != "bits_per_weight"},
           "bits_per_weight": rd["bits_per_weight"],
           "recipe": f"{scheme} additive projections (driver "
                     f"{'defaults' if not settings else 'defaults except ' + json.dumps(settings, sort_keys=True)}"
                     f", random E[x^2] statistics), "
                     f"{recipe.head_bits}-bit head, embedding {recipe.embed_bits}"}
    if resumed:  # a resumed run: its time covers the layers it computed, not the whole model
        res["resumed_note"] = (f"{len(resumed)} layers were computed by an earlier, killed run (its stderr has their "
                               "times); seconds and per_layer_seconds cover this run only")
    if cfg.num_layers < full_layers and per_layer and not resumed:
        mean = sum(per_layer) / len(per_layer)
        est = setup * full_layers / cfg.num_layers + mean * full_layers + tail
        res["extrapolation"] = {
            "ESTIMATE_NOT_MEASURED": True, "full_layers": full_layers,
            "estimated_seconds": round(est, 1), "estimated_minutes": round(est / 60, 1),
            "formula": f"fingerprint x {full_layers}/{cfg.num_layers} + mean measured layer time "
                       f"({mean:.2f} s) x {full_layers} + measured head/embedding/write time"}
    print(json.dumps(res))
    return res


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="llama2-7b", choices=sorted(SHAPES))
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--out", default=None, help="directory for the temporary .cbk (default: system temp)")
    p.add_argument("--layers", type=int, default=None, help="only the first N blocks (smoke run)")
    p.add_argument("--scheme", default="cb4", choices=SCHEMES,
                   help="cb4: 4-bit scalar codebooks (default); aqlm-2x8 / aqlm-1x16: the additive driver")
    p.add_argument("--work", default=None,
                   help="additive schemes: keep DIR/model.cbk and its .parts folder; a killed run resumes from there")
    p.add_argument("--gptq", action="store_true", help="cb4 with quantize --gptq (random Hessians)")
    a = p.parse_args(argv)
    run(a.shape, a.device, Path(a.out) if a.out else None, a.layers, scheme=a.scheme, keep=work_cbk(a.work, a.scheme),
        gptq=a.gptq)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
