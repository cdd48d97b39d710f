"""``trapetum sparsify``: activation-sparsity thresholds (TEAL, arXiv 2408.14690) from calibration text.

Method: the calibration windows (``file_calibration_tokens``: ``n_seqs`` windows of ``seq_len`` tokens spread over
a text file, no special tokens; never the evaluation text) run through the *dense* reference decoder (fp32) layer
by layer, all windows at once; forward pre-hooks on q_proj (the qkv site), o_proj, gate_proj (gate_up) and
down_proj collect |x| of every row but those at positions < DENSE_POSITIONS (always dense at run time), and each
layer's threshold of a site is the S-quantile of those values: the k-th smallest |x| with k = floor(S * n) (0 for
S = 0), so ``x * (|x| > t)`` zeroes k of the n calibration values (more where values tie at t). Memory: the fp32
decoder plus one layer's site inputs over every calibration row ((3 D + F) x rows x 4 bytes; SmolLM2-135M at
16 x 512 rows: 107 MB).

Output (``sparsify``): a ``.cbk`` model gets the table as its ``sparsity`` metadata section (the file rewritten
atomically, in place or to ``out``); a GGUF / HF model a side file, JSON ``{"format": "trapetum-sparsity", ...}``
(models/sparsity.py), written atomically (default ``<model>.sparsity.json`` beside it).
"""
from __future__ import annotations

import json
import os
import time
from pathlib import Path

import torch

from ..errors import TrapetumError
from ..formats.cbk_write import rewrite_with_sparsity
from ..formats.detect import load_checkpoint
from ..models.batch import ForwardBatch
from ..models.decoder import Decoder
from ..models.sparsity import DENSE_POSITIONS, SITES, SiteThresholds, SparsityTable, check_sparse_kinds
from ..models.torch_ops import TorchOps
from .calibrate import file_calibration_tokens

__all__ = ["parse_targets", "calibrate_thresholds", "sparsify", "write_side_file", "threshold_of"]

SITE_NAMES = {"q": "qkv", "k": "qkv", "v": "qkv", "qkv": "qkv", "o": "o", "gate": "gate_up", "up": "gate_up",
              "gate_up": "gate_up", "down": "down"}


def parse_targets(sparsity: float, sites: str | dict | None = None) -> dict[str, float]:
    """Target sparsity per site: ``sparsity`` everywhere, then ``sites`` ("q=0.3,o=0.5,gate=...,down=..." or a
    dict; q/k/v/qkv name the shared qkv input, gate/up/gate_up the MLP's) overriding it. TrapetumError naming the
    option when a name or value is wrong."""
    def value(v, what: str) -> float:
        try:
            s = float(v)
        except (TypeError, ValueError):
            raise TrapetumError(f"{what} must be a number in [0, 1), got {v!r}") from None
        if not 0 <= s < 1:
            raise TrapetumError(f"{what} must be in [0, 1), got {v!r}")
        return s

    out = {s: value(sparsity, "--sparsity") for s in SITES}
    if isinstance(sites, str):
        items = []
        for part in filter(None, (p.strip() for p in sites.split(","))):
            if "=" not in part:
                raise TrapetumError(f"--site: expected NAME=SPARSITY items separated by commas, got {part!r}")
            items.append(tuple(x.strip() for x in part.split("=", 1)))
    else:
        items = list((sites or {}).items())
    for name, v in items:
        site = SITE_NAMES.get(str(name).lower())
        if site is None:
            raise TrapetumError(f"--site: unknown site {name!r} (q, o, gate, down; or qkv, gate_up)")
        out[site] = value(v, f"--site {name}")
    return out


def threshold_of(values: torch.Tensor, s: float) -> float:
    """The S-quantile threshold of |x| values (module docstring): the k-th smallest, k = floor(S * n)."""
    n = values.numel()
    k = int(s * n)
    if k == 0 or n == 0:
        return 0.0
    return float(values.kthvalue(k).values)


@torch.inference_mode()
def calibrate_thresholds(decoder: Decoder, tokens: torch.Tensor, targets: dict[str, float], batch: int = 4,
                         progress: bool = True) -> SparsityTable:
    """Thresholds of every layer and site from ``tokens`` [N, L] (each window at positions 0 .. L - 1) through the
    dense ``decoder`` (module docstring)."""
    cfg = decoder.config
    check_sparse_kinds(cfg)
    if tokens.shape[1] <= DENSE_POSITIONS:
        raise TrapetumError(f"calibration windows of {tokens.shape[1]} tokens leave no row to calibrate on")
    p = next(decoder.parameters())
    rot = (decoder.rope_global, decoder.rope_local)
    xs = []
    for i in range(0, tokens.shape[0], batch):
        tk = tokens[i:i + batch].to(p.device)
        b = ForwardBatch.prefill(tk)
        xs.append(TorchOps(cfg, rot, torch.arange(tk.shape[1], device=p.device), None).embed(decoder.embed, b))
    layers = []
    achieved = {s: 0.0 for s in SITES}
    it = list(enumerate(decoder.model.layers))
    if progress:
        from tqdm import tqdm
        it = tqdm(it, desc="sparsify: calibration", unit="layer", leave=False, dynamic_ncols=True)
    for _, block in it:
        got: dict[str, list[torch.Tensor]] = {s: [] for s in SITES}

        def hook(site, got=got):
            def f(mod, args):
                got[site].append(args[0][:, DENSE_POSITIONS:].detach().abs().float().reshape(-1).cpu())
            return f
        mods = {"qkv": block.self_attn.q_proj, "o": block.self_attn.o_proj, "gate_up": block.mlp.gate_proj,
                "down": block.mlp.down_proj}
        hooks = [m.register_forward_pre_hook(hook(s)) for s, m in mods.items()]
        try:
            xs = [decoder.run_layer(block, x) for x in xs]
        finally:
            for h in hooks:
                h.remove()
        row = {}
        for s in SITES:
            v = torch.cat(got[s])
            row[s] = threshold_of(v, targets[s])
            achieved[s] += float((v <= row[s]).double().mean())  # the calibration rows that become zero
        layers.append(SiteThresholds(**row))
    n = len(layers)
    cal = {"rows": int(tokens.shape[0] * (tokens.shape[1] - DENSE_POSITIONS)), "windows": int(tokens.shape[0]),
           "window_tokens": int(tokens.shape[1]), "dense_positions": DENSE_POSITIONS,
           "achieved": {s: round(achieved[s] / n, 6) for s in SITES}}
    return SparsityTable(tuple(layers), dict(targets), cal)


def default_out(model: str | os.PathLike) -> Path:
    return Path(str(Path(model)).rstrip("/") + ".sparsity.json")


def write_side_file(table: SparsityTable, path: str | os.PathLike) -> Path:
    """The side file, atomically (temporary file in the target's directory, fsync, rename)."""
    path = Path(path)
    tmp = path.parent / f".{path.name[:200]}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
    text = json.dumps(table.to_side(), indent=1, allow_nan=False) + "\n"
    try:
        with open(tmp, "x", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise TrapetumError(f"cannot write {path}: {e.strerror or e}") from None
    return path


def sparsify(model: str | os.PathLike, calib: str | os.PathLike, sparsity: float, sites: str | dict | None = None,
             out: str | os.PathLike | None = None, *, n_seqs: int = 16, seq_len: int = 512, device: str = "cpu",
             threads: int | None = None, progress: bool = True) -> tuple[SparsityTable, Path]:
    """Calibrate thresholds for ``model`` on the text file ``calib`` and write them (module docstring); returns
    (table, the path written)."""
    targets = parse_targets(sparsity, sites)
    if n_seqs < 1 or seq_len < 2:
        raise TrapetumError(f"calibration needs at least one window of 2 tokens, got {n_seqs} x {seq_len}")
    ckpt = load_checkpoint(model)
    is_cbk = ckpt.source_format == "cbk"
    if out is not None and str(out).endswith(".cbk") and not is_cbk:
        raise TrapetumError(f"-o {out}: only a .cbk model can carry its thresholds inside; for a "
                            f"{ckpt.source_format} model write a side file (.json)")
    check_sparse_kinds(ckpt.config)
    if ckpt.tokenizer is None:
        raise TrapetumError(f"{model}: the model has no tokenizer, so it cannot read calibration text")
    t0 = time.perf_counter()
    tokens = file_calibration_tokens(ckpt.tokenizer, calib, n_seqs, seq_len)
    dec = Decoder.from_checkpoint(ckpt, dtype=torch.float32, device=device).eval()
    if device == "cpu":
        dec.use_host_kernels(threads)
    table = calibrate_thresholds(dec, tokens, targets, progress=progress)
    del dec
    table = SparsityTable(table.layers, table.targets,
                          {**table.calibration, "file": Path(calib).name, "seconds": round(time.perf_counter() - t0, 1)})
    if is_cbk and (out is None or not str(out).endswith(".json")):
        try:
            return table, rewrite_with_sparsity(model, out or model, table.to_dict())
        except (ValueError, OSError) as e:
            raise TrapetumError(f"cannot write {out or model}: {e}") from None
    return table, write_side_file(table, out or default_out(model))
