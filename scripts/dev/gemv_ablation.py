"""What the grouped multi-row 4-bit codebook GEMV waits on (session 15): the production kernel, an experimental
copy with one stage left out at a time, occupancy and prefetch variants, timed in one run.

    python3 scripts/dev/gemv_ablation.py --out DIR      (H200: builds ~10-20 s, times ~30 s)

Builds trapetum/kernels/experimental/codebook_gemv_ablation.py's libraries (nvcc, parts in parallel), prints each
variant's registers / spill bytes / resident blocks an SM, then for each shape (in x out) and row count: random
tiled codes, codebooks and x on the GPU (x handed to the kernels in the group-wise fragment order, so only the
GEMV is timed), a float64 check of the production kernel, the bitwise check of every exact variant against it
(and of prod16 / prod8 / prod1 against prod at the rows the production dispatch gives them: 9..16 / 3..8 / 1..2;
prod1 takes x row-major), and the time of every variant (trapetum.eval.bench_kernels' graph_time_calls: one CUDA graph over rotating buffer sets past the L2, PDL off, median of replays); "prod" is
timed first and again last ("prod_again") to show drift. Prints one table last (us, ratio to prod) and writes
DIR/gemv_ablation.json and .md. Exit status 1 if any check failed or any variant failed to run (after the table).
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from trapetum.kernels.experimental import codebook_gemv_ablation as abl  # noqa: E402

SHAPES = "4096x11008,11008x4096,4096x4096"
ROWS = "16,32,64"
L2_BYTES = 60 * 2**20
SASS_OPS = ("HMMA", "LDS", "LDG", "STS", "CCTL", "BAR", "STG", "STL", "LDL")


def parse_shapes(s: str) -> list[tuple[int, int]]:
    """'4096x11008,...' -> [(in, out), ...]; in % 128 == 0 (4-bit, 64 code bytes a chunk), out >= 1."""
    out = []
    for part in s.split(","):
        m = re.fullmatch(r"\s*(\d+)x(\d+)\s*", part)
        if not m:
            raise argparse.ArgumentTypeError(f"shape {part!r}: expected INxOUT")
        k, n = int(m.group(1)), int(m.group(2))
        if k % 128 or n < 1:
            raise argparse.ArgumentTypeError(f"shape {part!r}: in must be a multiple of 128, out >= 1")
        out.append((k, n))
    return out


def parse_rows(s: str) -> list[int]:
    rows = [int(r) for r in s.split(",") if r.strip()]
    if not rows or any(not 1 <= r <= 256 for r in rows):
        raise argparse.ArgumentTypeError(f"rows {s!r}: 1..256 each")
    return rows


def parse_variants(s: str) -> list[str]:
    names = list(abl.VARIANTS) if s == "all" else [v.strip() for v in s.split(",") if v.strip()]
    bad = [v for v in names if v not in abl.VARIANTS]
    if bad:
        raise argparse.ArgumentTypeError(f"variants {bad}: not in {list(abl.VARIANTS)}")
    if "prod" not in names:
        names.insert(0, "prod")
    return names


def args_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, help="directory for gemv_ablation.json / .md")
    p.add_argument("--shapes", type=parse_shapes, default=parse_shapes(SHAPES))
    p.add_argument("--rows", type=parse_rows, default=parse_rows(ROWS))
    p.add_argument("--variants", type=parse_variants, default=parse_variants("all"))
    p.add_argument("--replays", type=int, default=30)
    p.add_argument("--build-dir", default="/tmp/trapetum-abl-build")
    p.add_argument("--nparts", type=int, default=abl.NPARTS)
    p.add_argument("--sass", action="store_true", help="also count SASS ops per kernel (cuobjdump; build only: "
                   "no GPU needed with --arch)")
    p.add_argument("--arch", default=None, help="sm_XX (default: the GPU's)")
    p.add_argument("--main-ext", action="store_true", help="also time the production call (trapetum's codebook_gemv: "
                   "its x copy launch + the GEMV; builds the main extension, a minute or more) and check its bits")
    return p


def sass_counts(text: str) -> dict[str, dict[str, int]]:
    """cuobjdump -sass text -> {function: {op: count}} for SASS_OPS (op = the mnemonic before its first dot)."""
    out: dict[str, dict[str, int]] = {}
    cur = None
    for line in text.splitlines():
        m = re.search(r"Function : (\S+)", line)
        if m:
            cur = out.setdefault(m.group(1), dict.fromkeys(SASS_OPS, 0))
            continue
        m = re.search(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9]*)", line)
        if cur is not None and m and m.group(1) in cur:
            cur[m.group(1)] += 1
    return out


def ptxas_report(text: str) -> dict[str, dict[str, int]]:
    """ptxas -v output -> {variant: {regs, spill_stores, spill_loads}} (kernel_label names)."""
    out = {}
    pat = (r"Compiling entry function '(\S+)'[^\n]*\n(?:[^\n]*Function properties[^\n]*\n)?\s*(\d+) bytes stack frame, "
           r"(\d+) bytes spill stores, (\d+) bytes spill loads\n[^\n]*Used (\d+) registers")
    for f, _, st, ld, regs in re.findall(pat, text):
        out[kernel_label(f)] = {"regs": int(regs), "spill_stores": int(st), "spill_loads": int(ld)}
    return out


def kernel_label(mangled: str) -> str:
    """A mangled kernel name -> variant name (or the mangled name)."""
    m = re.search(r"cb_abl_kernelILi(\d+)ELi(\d+)E", mangled)
    if m:
        minb, flags = int(m.group(1)), int(m.group(2))
        from_flags = {0: "copy", 1: "no_lut", 2: "no_x", 4: "no_mma", 8: "no_red", 16: "no_table", 5: "loads_only",
                      3: "mma_codes", 32: "codes2", 64: "pfx2", 128: "pfx4", 7: "skeleton"}
        name = from_flags.get(flags, f"flags{flags}")
        return {("copy", 3): "occ3", ("pfx2", 3): "occ3_pfx2"}.get((name, minb), name)
    m = re.search(r"cb_xr2(p?)_kernelILi(\d+)ELi(\d+)E", mangled)
    if m:
        base = {("2", "2"): "xr2", ("1", "2"): "xr2_g1", ("1", "1"): "xr2_n1"}.get(m.groups()[1:])
        if base is None:
            return mangled
        return base.replace("xr2", "xr2p") if m.group(1) else base
    if "cb_gemv_mma_groups_kernel" in mangled:
        return "prod"
    if "cb_gemv_mma_kernelILi4ELi2E" in mangled:
        return "prod16"
    if "cb_gemv_mma_kernelILi4ELi1ELi0ELb1ELb1E" in mangled:
        return "prod8"
    if "cb_gemv_mma_kernelILi4ELi1ELi0ELb1ELb0E" in mangled:
        return "prod1"
    return mangled


def table(results: list[dict], variants: list[str]) -> str:
    """Markdown: a row per (shape, rows), a column per variant: 'us (ratio to prod)'; '!' marks a failed exactness
    check, 'err' a variant that did not run."""
    cols = [v for v in variants if any(v in r["us"] or v in r["errors"] for r in results)]
    cols += [v for v in ("prod_call", "prod_again") if any(v in r["us"] or v in r["errors"] for r in results)]
    head = "| shape | M | " + " | ".join(cols) + " |"
    lines = [head, "|" + "---|" * (len(cols) + 2)]
    for r in results:
        base = r["us"].get("prod")
        cells = []
        for v in cols:
            if v in r["errors"]:
                cells.append("err")
            elif v not in r["us"]:
                cells.append("")
            else:
                us = r["us"][v]
                ratio = f" ({us / base:.2f})" if base and v != "prod" else ""
                cells.append(f"{us:.1f}{ratio}" + ("!" if r["exact"].get(v) is False else ""))
        lines.append(f"| {r['shape']} | {r['rows']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def find_cuobjdump() -> str | None:
    import shutil
    p = shutil.which("cuobjdump")
    if p:
        return p
    try:
        import triton
        q = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
        return str(q) if q.exists() else None
    except Exception:
        return None


def sass_report(paths) -> dict[str, dict[str, int]]:
    import subprocess
    tool = find_cuobjdump()
    if tool is None:
        raise RuntimeError("--sass: no cuobjdump (PATH or triton's)")
    counts: dict[str, dict[str, int]] = {}
    for p in paths:
        r = subprocess.run([tool, "-sass", str(p)], capture_output=True, text=True, check=True)
        for fn, c in sass_counts(r.stdout).items():
            counts[kernel_label(fn)] = c
    return counts


def run_case(lib, k: int, n: int, m: int, variants: list[str], replays: int, gen, main_ext: bool = False) -> dict:
    import torch
    from trapetum.eval.bench_kernels import graph_time_calls
    from trapetum.kernels.codebook_gemv import codebook_gemv_reference
    from trapetum.kernels.codebook_layout import tile_codes
    kb, npad = k // 2, -(-n // 16) * 16
    per_set = npad * kb + n * 32 + m * k * 2 + m * n * 2
    n_sets = max(2, min(64, math.ceil(4 * L2_BYTES / per_set)))
    sets = []
    for i in range(n_sets):
        codes = torch.randint(0, 256, (n, kb), dtype=torch.uint8, device="cuda", generator=gen)
        cb = torch.randn(n, 16, device="cuda", generator=gen).half()
        x = torch.randn(m, k, device="cuda", dtype=torch.float16, generator=gen)
        y = torch.empty(m, n, device="cuda", dtype=torch.float16)
        sets.append((lib.frag(x), tile_codes(codes), cb, y, x, codes))
    r = {"shape": f"{k}x{n}", "rows": m, "sets": n_sets, "us": {}, "exact": {}, "errors": {}}
    xf, tiled, cb, y, x, codes = sets[0]
    lib.launch("prod", xf, tiled, cb, y)
    torch.cuda.synchronize()
    ref = codebook_gemv_reference(x.double(), codes, cb.double(), 4).double()
    err = (y.double() - ref).abs().max().item()
    tol = 2e-3 * ref.abs().max().item() + 1e-2
    r["prod_max_abs_err"], r["prod_tol"] = err, tol
    if not err <= tol:
        r["errors"]["prod"] = f"float64 check failed: max abs err {err:.4g} > {tol:.4g}"
    want = y.clone()
    for v in variants:
        if not abl.takes_rows(v, m):
            continue
        xin = 4 if v in abl.ROW_MAJOR_X else 0  # index of the x this variant takes in a set
        if abl.VARIANTS[v][1] and v != "prod":
            try:
                y.fill_(0)
                lib.launch(v, sets[0][xin], tiled, cb, y)
                torch.cuda.synchronize()
                r["exact"][v] = bool(torch.equal(y.view(torch.int16), want.view(torch.int16)))
            except Exception as e:
                r["errors"][v] = f"{type(e).__name__}: {e}"[:300]
                continue
        try:
            calls = [lambda s=s, v=v, xin=xin: lib.launch(v, s[xin], s[1], s[2], s[3]) for s in sets]
            for c in calls:
                c()
            torch.cuda.synchronize()
            r["us"][v] = graph_time_calls(calls, replays=replays)
        except Exception as e:
            r["errors"][v] = f"{type(e).__name__}: {e}"[:300]
    if main_ext:  # the production entry point as the engine calls it (x row-major: its copy launch included)
        import dataclasses
        from trapetum.kernels import codebook_gemv as cg
        from trapetum.settings import DEFAULT_KERNELS
        ko = dataclasses.replace(DEFAULT_KERNELS, pdl="off", grouped_gemv_groups=2)
        try:
            y.fill_(0)
            cg.codebook_gemv(x, tiled, cb, 4, out=y, tiled=True, kopts=ko)
            torch.cuda.synchronize()
            r["exact"]["prod_call"] = bool(torch.equal(y.view(torch.int16), want.view(torch.int16)))
            calls = [lambda s=s: cg.codebook_gemv(s[4], s[1], s[2], 4, out=s[3], tiled=True, kopts=ko) for s in sets]
            r["us"]["prod_call"] = graph_time_calls(calls, replays=replays)
        except Exception as e:
            r["errors"]["prod_call"] = f"{type(e).__name__}: {e}"[:300]
    calls = [lambda s=s: lib.launch("prod", s[0], s[1], s[2], s[3]) for s in sets]
    r["us"]["prod_again"] = graph_time_calls(calls, replays=replays)
    del sets
    torch.cuda.empty_cache()
    return r


def main(argv=None) -> int:
    a = args_parser().parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    import torch
    cuda = torch.cuda.is_available()
    arch = a.arch or (f"sm_{''.join(map(str, torch.cuda.get_device_capability()))}" if cuda else None)
    if arch is None:
        print("gemv_ablation: no GPU and no --arch", file=sys.stderr)
        return 2
    paths, ptxas = abl.build(a.build_dir, arch, a.nparts)
    res: dict = {"arch": arch, "build_s": round(time.time() - t0, 1), "variants": {}, "cases": []}
    res["ptxas"] = ptxas_report(ptxas)
    print(f"built {len(paths)} parts for {arch} in {res['build_s']} s", flush=True)
    if a.sass:
        try:
            res["sass"] = sass_report(paths)
        except Exception as e:  # counts are a side dish: report, keep timing
            print(f"WARNING: --sass: {type(e).__name__}: {e}", flush=True)
            res["sass"] = {"error": str(e)[:300]}
        for name, c in sorted(res["sass"].items()):
            if isinstance(c, dict) and not name.startswith("_Z"):
                print(f"sass {name:12s} " + " ".join(f"{op}={n}" for op, n in c.items()), flush=True)
    if not cuda:
        (out / "gemv_ablation.json").write_text(json.dumps(res, indent=1))
        return 0
    lib = abl.Lib(paths)
    print(f"{'variant':12s} regs local blocks/SM spill_st/ld  what", flush=True)
    for v in a.variants:
        info = lib.info(v)
        res["variants"][v] = {**info, "exact": abl.VARIANTS[v][1], "what": abl.VARIANTS[v][2]}
        print(f"{v:12s} {info['regs']:4d} {info['local_bytes']:5d} {info['blocks_per_sm']:9d} "
              f"{res['ptxas'].get(v, {}).get('spill_stores', -1):5d}/{res['ptxas'].get(v, {}).get('spill_loads', -1):<5d} "
              f"{abl.VARIANTS[v][2]}", flush=True)
    failed = []
    gen = torch.Generator(device="cuda").manual_seed(15)
    for k, n in a.shapes:
        for m in a.rows:
            r = run_case(lib, k, n, m, a.variants, a.replays, gen, a.main_ext)
            res["cases"].append(r)
            print(json.dumps(r), flush=True)
            failed += [f"{r['shape']} M={m} {v}: not bitwise equal to prod" for v, ok in r["exact"].items() if not ok]
            failed += [f"{r['shape']} M={m} {v}: {e}" for v, e in r["errors"].items()]
    res["total_s"] = round(time.time() - t0, 1)
    res["failed"] = failed
    md = table(res["cases"], a.variants)
    (out / "gemv_ablation.json").write_text(json.dumps(res, indent=1))
    (out / "gemv_ablation.md").write_text(md + "\n")
    for f in failed:
        print(f"FAILED: {f}", flush=True)
    print(f"total {res['total_s']} s; {'ALL CHECKS PASSED' if not failed else f'{len(failed)} FAILURES'}")
    print(md)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
