"""``trapetum quantize SRC -o OUT.cbk [--bits 4] [--head-bits 8] [--calib FILE]``."""
from __future__ import annotations

import argparse

from ..errors import TrapetumError
from ._common import bits_or_none

BITS_HELP = "1, 2, 3, 4 or 8"  # quant.quantize.bits_choices() (tests/test_cli_first_hour.py checks that they agree)
DEVICE_HELP = ("cpu or cuda (default: cuda when a GPU is present, else cpu. Unlike generate, chat and serve, "
               "which default to the CPU, quantizing is a batch job whose k-means runs many times faster on a GPU)")


def register(sub) -> None:
    p = sub.add_parser("quantize", help="compress a checkpoint into a .cbk file (per-row codebooks)",
                       description="Quantize every projection to a per-row scalar codebook (E[x^2]-weighted "
                                   "k-means), the LM head to 8 bits, and write a .cbk file atomically.")
    p.add_argument("src", help="HF directory, .gguf or .cbk")
    p.add_argument("-o", "--output", required=True, metavar="OUT.cbk")
    p.add_argument("--bits", type=int, default=4, help=f"index bits of the projections ({BITS_HELP}; default 4)")
    p.add_argument("--head-bits", default="8", metavar="BITS|fp16",
                   help="LM head: codebook bits, or fp16 to keep it dense (default 8)")
    p.add_argument("--embed-bits", default="auto", metavar="BITS|fp16|auto",
                   help="embedding table: codebook bits, or fp16; auto (default): a tied model shares the "
                        "head's quantized table; an untied one gets an 8-bit codebook when its source stores "
                        "the embedding at 8 bits or fewer (a quantized GGUF), else keeps it fp16")
    p.add_argument("--calib", default=None, metavar="FILE|none",
                   help="calibration text for E[x^2] (e.g. wikitext-2 valid.txt); default: text sampled "
                        "from the model itself; 'none': unweighted k-means")
    p.add_argument("--calib-seqs", type=int, default=32, metavar="N", help="calibration sequences (default 32)")
    p.add_argument("--keep-fp16", action="append", default=[], metavar="PATTERN",
                   help="keep matching projections dense, e.g. lm_head or 'model.layers.0.*' (repeatable)")
    p.add_argument("--layer-bits", action="append", default=[], metavar="PATTERN=BITS",
                   help="bits for matching projections, e.g. '*.mlp.down_proj=8' (repeatable, first match wins)")
    p.add_argument("--iters", type=int, default=60, help="Lloyd iterations per start (default 60)")
    p.add_argument("--codebook", default="u8", choices=["f16", "u8", "shared"],
                   help="how the layers' per-row codebooks are stored: u8 (default: 8-bit centroids on a per-row "
                        "range, .cbk version 2), f16 (as version 1 wrote them) or shared (tables shared by groups "
                        "of rows, scaled per row)")
    p.add_argument("--head-codebook", default="shared", choices=["f16", "u8", "shared"],
                   help="the same for the embedding and LM head (default shared: one table per "
                        "--head-group-rows rows, scaled per row; f16: 256 fp16 centroids per row at 8 bits)")
    p.add_argument("--head-group-rows", type=int, default=512, metavar="N",
                   help="rows per shared table (default 512)")
    p.add_argument("--gptq", action=argparse.BooleanOptionalAction, default=None,
                   help="error-compensated codes (GPTQ with the per-row codebooks: input Hessians from calibration, "
                        "each column's error fed to the next) and Hessian-weighted codebook refits; needs calibration. "
                        "Default: on when quantizing on CUDA with calibration (seconds more there, 3-10%% lower "
                        "perplexity at the same size: QUALITY.md, Session 14), off on the CPU (minutes more there). "
                        "With --scheme aqlm-2x8/aqlm-1x16: the additive codes and codebooks refined under the full "
                        "Hessian (trapetum/quant/additive_gptq.py); default off there")
    p.add_argument("--gptq-rounds", type=int, default=2, metavar="N",
                   help="rounds of GPTQ assignments and codebook refits (default 2)")
    p.add_argument("--target-bpw", type=float, default=None, metavar="B",
                   help="mixed precision: choose 2, 3, 4 or 8 bits per layer projection from its measured "
                        "sensitivity so that the layer projections average B bits per weight, codebooks included "
                        "(--layer-bits / --keep-fp16 matches stay as given)")
    p.add_argument("--target-size", type=float, default=None, metavar="MB",
                   help="mixed precision as --target-bpw, with the whole file's size (MB, 10^6 bytes) as the budget")
    p.add_argument("--device", default=None, help=DEVICE_HELP)
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    p.add_argument("--scheme", default="scalar", choices=["scalar", "aqlm-2x8", "aqlm-1x16"],
                   help="per-row scalar codebooks (default) or 2-bit additive codebooks in the AQLM layout")
    p.set_defaults(func=run)


def preflight(args: argparse.Namespace) -> None:
    """Before anything is loaded: the source exists, the output can be created (its directory exists and takes
    a new file), the calibration file is readable. quantize_to_cbk then checks the disk space for its plan
    (and warns about an already quantized source) before calibrating."""
    import os

    from ..formats.cbk_write import check_output_path
    if not os.path.exists(args.src):
        raise TrapetumError(f"{args.src}: file not found")
    check_output_path(args.output, flag="-o")
    c = args.calib
    if c is not None and c != "none" and not (os.path.isfile(c) and os.access(c, os.R_OK)):
        raise TrapetumError(f"--calib {c}: " + ("not a readable file" if os.path.exists(c) else "file not found"))


def run(args: argparse.Namespace) -> int:
    preflight(args)
    import torch

    from ..quant.quantize import Recipe, parse_bits_overrides, quantize_to_cbk
    from ..settings import Options

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    budget = Options.from_env().calib_mem_gb  # TRAPETUM_CALIB_MEM_GB: the sampled calibration's memory budget
    if args.scheme != "scalar":
        return _run_additive(args, device, budget)
    calib = args.calib
    recipe = Recipe(bits=args.bits, head_bits=bits_or_none(args.head_bits, "--head-bits"),
                    embed_bits=_embed_bits(args), weighted=calib != "none", calib=calib, calib_seqs=args.calib_seqs,
                    iters=args.iters, keep_fp16=list(args.keep_fp16), codebook=args.codebook,
                    head_codebook=args.head_codebook, head_group_rows=args.head_group_rows,
                    gptq=default_gptq(device, calib, args.codebook) if args.gptq is None else args.gptq,
                    gptq_rounds=args.gptq_rounds, target_bpw=args.target_bpw, target_mb=args.target_size,
                    bits_overrides=parse_bits_overrides(args.layer_bits)).validate()
    path, qm = quantize_to_cbk(args.src, args.output, recipe, device=device, progress=not args.quiet,
                               mem_budget_gb=budget)
    _report(path, qm, "codebooks included")
    return 0


def _run_additive(args: argparse.Namespace, device: str, budget: float | None) -> int:
    """``--scheme aqlm-2x8|aqlm-1x16`` (trapetum/quant/additive_driver.py): uses --head-bits, --embed-bits,
    --head-codebook, --head-group-rows, --calib, --calib-seqs, --gptq, --gptq-rounds, --device, --quiet; the
    scalar-only options do not apply. ``--gptq`` is off unless given (the full-Hessian refinement)."""
    from ..quant.additive_driver import AdditiveRecipe, quantize_additive_to_cbk

    recipe = AdditiveRecipe(scheme=args.scheme, head_bits=bits_or_none(args.head_bits, "--head-bits"),
                            embed_bits=_embed_bits(args), weighted=args.calib != "none", calib=args.calib,
                            calib_seqs=args.calib_seqs, head_codebook=args.head_codebook,
                            head_group_rows=args.head_group_rows, gptq=bool(args.gptq),
                            gptq_rounds=args.gptq_rounds).validate()
    path, qm = quantize_additive_to_cbk(args.src, args.output, recipe, device=device, progress=not args.quiet,
                                        mem_budget_gb=budget)
    _report(path, qm, "codebooks and scales included")
    return 0


def default_gptq(device: str, calib: str | None, codebook: str) -> bool:
    """``--gptq``'s default: on where it costs seconds (a CUDA device) and can run (calibration, per-row
    codebooks); off on the CPU, where its blockwise calibration and column sweeps take minutes on a small model."""
    return str(device).startswith("cuda") and calib != "none" and codebook != "shared"


def _embed_bits(args: argparse.Namespace) -> int | None | str:
    eb = getattr(args, "embed_bits", "auto")
    return "auto" if eb == "auto" else bits_or_none(eb, "--embed-bits")


def _report(path, qm, included: str) -> None:
    print(f"wrote {path}  {path.stat().st_size / 1e6:.1f} MB  {qm.bits_per_weight('projections'):.3f} bits/weight "
          f"(projections, {included})  {qm.bits_per_weight('all'):.3f} bits/weight (all tensors)  {qm.seconds:.1f} s")
