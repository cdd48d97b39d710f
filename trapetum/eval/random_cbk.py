"""A ``.cbk`` file of random weights at a real model shape with a real tokenizer (serving benchmarks on a GPU
machine that has no model files: ``trapetum serve F.cbk`` then runs as on a quantized model of that shape).

    python -m trapetum.eval.random_cbk --shape llama2-7b --format cb4 --tokenizer SRC --out F.cbk [--device cuda]
    python -m trapetum.eval.random_cbk --tokenizer SRC --export-tokenizer DIR   # SRC's tokenizer as HF files

SRC: a ``tokenizer.json`` (with ``tokenizer_config.json`` / ``generation_config.json`` beside it when present:
bos / eos tokens, chat template), a directory holding them, a ``.gguf`` or a ``.cbk`` (its tokenizer is taken).
The weights are eval/random_model.py's ``random_checkpoint`` (each tensor generated on ``--device``, seeded by
its name), with the model's vocab_size set to the tokenizer's size; the file says so: provenance
``source_format`` "random", ``random_weights`` true, ``tokenizer_source``; recipe ``random_weights`` true.
Written with formats/cbk_write.py's ``CbkWriter`` (atomic, streamed): every tensor is generated twice, once
for its declaration (dtype, shape) and once for its bytes, and only one tensor is in host memory at a time.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ..errors import TrapetumError
from ..tokenizer import Tokenizer
from .random_model import FORMATS, SHAPES, random_checkpoint


def read_tokenizer_source(src: str | Path) -> Tokenizer:
    """The tokenizer of ``src`` (see the module docstring); a one-line TrapetumError when it has none."""
    p = Path(src)
    if not p.exists():
        raise TrapetumError(f"--tokenizer {p}: no such file or directory")
    if p.is_dir() or p.suffix == ".json":
        from ..formats.hf import read_json, read_tokenizer
        d = p if p.is_dir() else p.parent
        if p.is_file() and p.name != "tokenizer.json":
            raise TrapetumError(f"--tokenizer {p}: a tokenizer file must be named tokenizer.json")
        gp = d / "generation_config.json"
        tk = read_tokenizer(d, read_json(gp) if gp.exists() else {})
    else:
        from ..formats.detect import load_checkpoint
        tk = load_checkpoint(p).tokenizer
    if tk is None:
        raise TrapetumError(f"--tokenizer {p}: holds no tokenizer")
    return tk


def export_tokenizer(tk: Tokenizer, out: str | Path) -> Path:
    """Write ``tk`` as Hugging Face files into the directory ``out``: tokenizer.json, tokenizer_config.json (bos,
    first eos, pad / unk, chat template), generation_config.json (every eos id); ``read_tokenizer_source`` reads
    them back to the same tokenizer."""
    d = Path(out)
    d.mkdir(parents=True, exist_ok=True)
    (d / "tokenizer.json").write_text(tk.tk.to_str())
    cfg = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": tk.bos_token,
           "eos_token": tk.eos_tokens[0] if tk.eos_tokens else None, **tk.extra_special}
    if tk.chat_template:
        cfg["chat_template"] = tk.chat_template
    (d / "tokenizer_config.json").write_text(json.dumps(cfg, indent=1))
    (d / "generation_config.json").write_text(json.dumps({"eos_token_id": list(tk.eos_ids)}))
    return d


def write_random_cbk(out: str | Path, tokenizer: Tokenizer, *, shape: str = "llama2-7b", fmt: str = "cb4",
                     device="cpu", layers: int | None = None, overrides: dict | None = None,
                     tokenizer_source: str = "", log=None) -> Path:
    """Write the random-weight model (``shape``, ``fmt`` as in random_model.py; ``overrides``: ModelConfig
    fields, e.g. a tiny test shape) with ``tokenizer`` to ``out``; returns the path."""
    import torch

    from ..formats.cbk_spec import QuantSpec, TensorSpec
    from ..formats.cbk_write import CbkWriter, check_output_path
    from ..schemes.record import QuantRecord
    if shape not in SHAPES:
        raise TrapetumError(f"--shape: one of {', '.join(SHAPES)}, got {shape!r}")
    if fmt not in FORMATS:
        raise TrapetumError(f"--format: one of {', '.join(FORMATS)}, got {fmt!r}")
    try:
        ck = random_checkpoint(shape, fmt, device, layers=layers,
                               overrides={"vocab_size": tokenizer.vocab_size, **(overrides or {})})
    except TypeError as e:  # an unknown ModelConfig field
        raise TrapetumError(f"--set: {e}") from None
    names = list(ck.tensors.keys())
    check_output_path(out, flag="--out")
    note = (f"random weights (trapetum.eval.random_model.random_checkpoint {shape} {fmt}, seeded by tensor name); "
            f"vocab_size set to the tokenizer's {tokenizer.vocab_size}")
    prov = {"source": note, "source_format": "random", "random_weights": True, "tokenizer_source": tokenizer_source}
    recipe = {"random_weights": True, "shape": shape, "format": fmt}
    specs = {}
    for n in names:  # pass 1: the declarations (each tensor generated on the device and dropped)
        x = ck.tensors[n]
        specs[n] = QuantSpec.of(x) if isinstance(x, QuantRecord) else TensorSpec.of(x)
        del x
    with CbkWriter(out, config=ck.config, tokenizer=tokenizer, recipe=recipe, provenance=prov) as w:
        for n, sp in specs.items():
            (w.declare_quantized if isinstance(sp, QuantSpec) else w.declare_dense)(n, sp)
        for i, n in enumerate(names):  # pass 2: the bytes, one tensor at a time
            x = ck.tensors[n]
            (w.put_quantized if isinstance(x, QuantRecord) else w.put_dense)(n, x)
            del x
            if log and (i + 1) % 32 == 0:
                log(f"  {i + 1}/{len(names)} tensors")
    path = w.path  # leaving the block committed the file (an exception aborts it: no file)
    if device != "cpu" and torch.cuda.is_available():
        torch.cuda.empty_cache()
    return Path(path)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m trapetum.eval.random_cbk", description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", default="llama2-7b", help=f"one of {', '.join(SHAPES)} (default llama2-7b)")
    p.add_argument("--format", default="cb4", help=f"one of {', '.join(FORMATS)} (default cb4)")
    p.add_argument("--tokenizer", required=True, metavar="SRC", help="tokenizer.json, a directory, .gguf or .cbk")
    p.add_argument("--out", default=None, metavar="F.cbk")
    p.add_argument("--export-tokenizer", default=None, metavar="DIR", help="write SRC's tokenizer as HF files")
    p.add_argument("--device", default=None, help="where the weights are generated (default cuda when present)")
    p.add_argument("--layers", type=int, default=None, help="fewer layers than the shape has")
    p.add_argument("--set", action="append", default=[], metavar="FIELD=N",
                   help="a ModelConfig field of the shape replaced (repeatable), e.g. hidden_size=64 for a tiny test")
    a = p.parse_args(argv)
    try:
        overrides = {}
        for item in a.set:
            k, eq, v = item.partition("=")
            try:
                overrides[k] = int(v) if eq else None
            except ValueError:
                overrides[k] = None
            if overrides[k] is None or k == "vocab_size":
                raise TrapetumError(f"--set {item}: expected FIELD=INTEGER (vocab_size comes from the tokenizer)")
        tk = read_tokenizer_source(a.tokenizer)
        if a.export_tokenizer:
            d = export_tokenizer(tk, a.export_tokenizer)
            size = sum(f.stat().st_size for f in d.iterdir())
            print(f"wrote {d} ({size:,} bytes; vocab {tk.vocab_size}, eos {tk.eos_tokens})")
        if a.out:
            import torch
            dev = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
            if a.layers is not None and a.layers < 1:
                raise TrapetumError(f"--layers: at least 1, got {a.layers}")
            t0 = time.perf_counter()
            path = write_random_cbk(a.out, tk, shape=a.shape, fmt=a.format, device=dev, layers=a.layers,
                                    overrides=overrides, tokenizer_source=Path(a.tokenizer).name,
                                    log=lambda s: print(s, file=sys.stderr, flush=True))
            print(f"wrote {path}: {path.stat().st_size / 1e9:.2f} GB in {time.perf_counter() - t0:.1f} s "
                  f"({a.shape} {a.format}, vocab {tk.vocab_size}, random weights, generated on {dev})")
        elif not a.export_tokenizer:
            raise TrapetumError("give --out F.cbk (or --export-tokenizer DIR)")
    except TrapetumError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
