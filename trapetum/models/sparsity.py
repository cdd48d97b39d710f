"""Activation sparsity (TEAL, arXiv 2408.14690): per-layer, per-site magnitude thresholds of the projections' inputs.

A *site* is the input of one group of projections that share it:

    qkv       the attention block's normed input h (q, k and v; MLA's q / kv_a)   [D]
    o         the attention output a, the input of o_proj                        [Hq * hd]
    gate_up   the MLP block's normed input h (gate and up)                        [D]
    down      the gated product act(gate h) * up h, the input of down_proj        [F]

With thresholds t (one float per layer and site), a site's input becomes ``x * (|x| > t)`` (an exact select: kept
entries keep their bits), except on the rows at positions < ``DENSE_POSITIONS`` (position 0, the attention sink,
stays dense: sparsifying it costs far more quality than any other position, TEAL section 4 and the seed's figures).
The mask is elementwise and the threshold a per-layer constant, so each row is thresholded on its own: a VERIFY
row is bitwise the decode step at its position, with or without sparsity. A threshold of 0 keeps every nonzero.

The table's JSON form (the ``.cbk`` metadata section ``sparsity``, docs/CBK.md, or a side file
``{"format": "trapetum-sparsity", ...}`` beside a GGUF / HF model):

    {"version": 1, "method": "teal-magnitude",
     "targets": {"qkv": 0.25, "o": 0.5, "gate_up": 0.25, "down": 0.5},     // the calibration's target sparsity
     "layers": [{"qkv": t, "o": t, "gate_up": t, "down": t}, ...],         // one object per decoder layer
     "calibration": {...}}                                                 // free-form: where the thresholds came from

``check`` validates a table from a file as hostile (types, finite non-negative thresholds, targets in [0, 1), the
layer count of the model); the executors apply it with their ``sparsify`` op (models/blocks).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..errors import FormatError, UnsupportedError

SITES = ("qkv", "o", "gate_up", "down")
VERSION = 1
METHOD = "teal-magnitude"
SIDE_FORMAT = "trapetum-sparsity"
DENSE_POSITIONS = 1  # positions 0 .. DENSE_POSITIONS - 1 are never sparsified (the attention sink)
MAX_LAYERS = 4096
MAX_SIDE_BYTES = 16 << 20  # a side file holds 4 floats per layer: anything near this is not one

Fail = Callable[[str], Any]


@dataclass(frozen=True)
class SiteThresholds:
    """One layer's thresholds, by site (module docstring)."""
    qkv: float
    o: float
    gate_up: float
    down: float


@dataclass(frozen=True)
class SparsityTable:
    layers: tuple[SiteThresholds, ...]
    targets: dict = field(default_factory=dict)  # site -> target sparsity of the calibration
    calibration: dict = field(default_factory=dict)  # free-form provenance

    def to_dict(self) -> dict:
        return {"version": VERSION, "method": METHOD, "targets": dict(self.targets),
                "layers": [{s: float(getattr(t, s)) for s in SITES} for t in self.layers],
                "calibration": dict(self.calibration)}

    def to_side(self) -> dict:
        """The side file's JSON object."""
        return {"format": SIDE_FORMAT, **self.to_dict()}

    @classmethod
    def from_dict(cls, d: Any, fail: Fail, num_layers: int | None = None, what: str = "sparsity") -> "SparsityTable":
        check(d, fail, num_layers, what)
        return cls(tuple(SiteThresholds(**{s: float(row[s]) for s in SITES}) for row in d["layers"]),
                   dict(d.get("targets") or {}), dict(d.get("calibration") or {}))

    def check_model(self, num_layers: int, source: str) -> None:
        if len(self.layers) != num_layers:
            raise FormatError(f"{source}: the sparsity table has {len(self.layers)} layers, the model {num_layers}")


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _show(v: Any) -> str:
    return " ".join(repr(v).split())[:60]


def check(d: Any, fail: Fail, num_layers: int | None = None, what: str = "sparsity") -> None:
    """The table's schema (module docstring); ``fail(message)`` raises, the message names the field."""
    if not isinstance(d, dict):
        fail(f"{what} must be an object, got {_show(d)}")
    v = d.get("version")
    if not isinstance(v, int) or isinstance(v, bool):
        fail(f"{what}.version must be an integer, got {_show(v)}")
    if v != VERSION:
        fail(f"{what}.version is {v}; this build reads version {VERSION}")
    if d.get("method", METHOD) != METHOD:
        fail(f"{what}.method must be {METHOD!r}, got {_show(d.get('method'))}")
    targets = d.get("targets")
    if targets is not None:
        if not isinstance(targets, dict):
            fail(f"{what}.targets must be an object, got {_show(targets)}")
        for k, s in targets.items():
            if k not in SITES or not _number(s) or not 0 <= s < 1:
                fail(f"{what}.targets.{str(k)[:40]} must be a site ({', '.join(SITES)}) with a sparsity in [0, 1), "
                     f"got {_show(s)}")
    cal = d.get("calibration")
    if cal is not None and not isinstance(cal, dict):
        fail(f"{what}.calibration must be an object, got {_show(cal)}")
    layers = d.get("layers")
    if not isinstance(layers, list) or not 1 <= len(layers) <= MAX_LAYERS:
        fail(f"{what}.layers must be a list of 1..{MAX_LAYERS} objects, got {_show(layers)}")
    if num_layers is not None and len(layers) != num_layers:
        fail(f"{what}.layers has {len(layers)} entries, the model has {num_layers} layers")
    for i, row in enumerate(layers):
        if not isinstance(row, dict):
            fail(f"{what}.layers[{i}] must be an object, got {_show(row)}")
        for s in SITES:
            t = row.get(s)
            if not _number(t) or t < 0 or t > 1e30:
                fail(f"{what}.layers[{i}].{s} must be a finite non-negative number, got {_show(t)}")


def read_side_file(path: str | Path, num_layers: int | None = None) -> SparsityTable:
    """A side file's table; FormatError naming the file and the field otherwise."""
    p = Path(path)

    def fail(msg: str):
        raise FormatError(f"{p}: {msg}")
    try:
        if p.stat().st_size > MAX_SIDE_BYTES:
            fail(f"larger than {MAX_SIDE_BYTES} bytes: not a sparsity file")
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise FormatError(f"cannot read sparsity file {p}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        fail("not UTF-8 text: not a sparsity file")
    try:
        d = json.loads(text, parse_constant=lambda c: fail(f"{c} is not a JSON number"))
    except (json.JSONDecodeError, RecursionError) as e:
        fail(f"not a JSON sparsity file ({' '.join(str(e).split())[:80]})")
    if not isinstance(d, dict) or d.get("format") != SIDE_FORMAT:
        fail(f"not a sparsity file (format must be {SIDE_FORMAT!r})")
    return SparsityTable.from_dict(d, fail, num_layers)


def check_sparse_kinds(cfg) -> None:
    """UnsupportedError unless every layer is an attention block and a dense MLP (the kinds that take thresholds
    today: latent attention and mixtures of experts have no sparsity sites yet)."""
    for i in range(cfg.num_layers):
        kinds = cfg.block_kinds(i)
        if kinds != ("attention", "mlp"):
            raise UnsupportedError(f"activation sparsity: layer {i} is {' + '.join(kinds)}; only attention + mlp "
                                   "layers take thresholds")


def uniform(num_layers: int, threshold: float) -> SparsityTable:
    """Every site of every layer at one threshold (tests and benchmarks)."""
    t = SiteThresholds(threshold, threshold, threshold, threshold)
    return SparsityTable(tuple(t for _ in range(num_layers)))
