"""``trapetum rotate SRC -o OUT [--seed S] [--rotation orthogonal|hadamard] [--dtype f16|f32]``: a fair source.

Folds the norms and rotates the model (``quant/rotate.py``): the same function with weights that carry no source
quantization grid, written as a GGUF file (OUT ends in ``.gguf``; needs a GGUF source, whose metadata and
vocabulary are copied) or as a Hugging Face safetensors directory (anything else).
"""
from __future__ import annotations

import argparse
import json


def register(sub) -> None:
    p = sub.add_parser("rotate", help="fold norms and rotate a model (same logits, no source grid): a fair "
                                      "source for quantizer comparisons",
                       description="Fold every RMSNorm weight into the projections that read it and rotate the "
                                   "residual stream (QuaRot-style; Gemma's sandwich norms allow only a signed "
                                   "permutation, and there every norm stays, permuted, unfolded), the value heads "
                                   "and the MLP units, with seeded random maps. "
                                   "The result computes the same logits within rounding; written as an fp16 "
                                   "GGUF (OUT.gguf, from a GGUF source) or an HF safetensors directory.")
    p.add_argument("src", help="HF directory or .gguf (dense families: llama, mistral, qwen2, gemma2, gemma3)")
    p.add_argument("-o", "--output", required=True, metavar="OUT", help="OUT.gguf, or a directory for HF output")
    p.add_argument("--seed", type=int, default=0, help="seed of the random maps (default 0)")
    p.add_argument("--rotation", default="orthogonal", choices=["orthogonal", "hadamard"],
                   help="orthogonal (Haar-random, default) or randomized Hadamard (dimensions a power of 2)")
    p.add_argument("--no-heads", action="store_true", help="leave the value heads unrotated")
    p.add_argument("--no-mlp-perm", action="store_true", help="leave the MLP's intermediate units in place")
    p.add_argument("--dtype", default="f16", choices=["f16", "f32"], help="stored dtype of matrices (default f16)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import os
    import time

    from ..errors import TrapetumError
    from ..formats.dense_export import write_dense_gguf, write_dense_hf
    from ..formats.detect import load_checkpoint
    from ..quant.rotate import RotateSpec, rotate_checkpoint

    if not os.path.exists(args.src):
        raise TrapetumError(f"{args.src}: file not found")
    t0 = time.perf_counter()
    ckpt = load_checkpoint(args.src)
    if ckpt.source_format not in ("hf", "gguf"):
        raise TrapetumError(f"{args.src}: rotate reads a dense source (HF directory or GGUF), not a "
                            f"{ckpt.source_format} file")
    spec = RotateSpec(seed=args.seed, rotation=args.rotation, heads=not args.no_heads,
                      mlp_perm=not args.no_mlp_perm).validate()
    rot = rotate_checkpoint(ckpt, spec)
    if str(args.output).endswith(".gguf"):
        if ckpt.source_format != "gguf":
            raise TrapetumError(f"-o {args.output}: GGUF output needs a GGUF source (its metadata and vocabulary "
                                "are copied); write an HF directory instead")
        out = write_dense_gguf(rot, args.src, args.output, args.dtype,
                               extra_meta={"trapetum.rotation": json.dumps(rot.meta["rotation"])})
        size = out.stat().st_size
    else:
        out = write_dense_hf(rot, args.output, args.dtype)
        size = sum(f.stat().st_size for f in out.iterdir())
    r = rot.meta["rotation"]
    print(f"wrote {out}  {size / 1e6:.1f} MB  ({args.dtype}; residual: {r['residual']}, seed {args.seed}, "
          f"{args.rotation}{', heads' if spec.heads else ''}{', MLP permuted' if spec.mlp_perm else ''}; "
          f"head {'tied' if rot.config.tie_word_embeddings else 'untied'})  {time.perf_counter() - t0:.1f} s")
    return 0
