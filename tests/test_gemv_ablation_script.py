"""CPU checks of scripts/dev/gemv_ablation.py (argument parsing, parsers of ptxas / cuobjdump output, the table)
and of the variant list against the CUDA source's; the kernels themselves are GPU-only (timed, not tested: the
script asserts the exact variants' bits on the GPU)."""
from __future__ import annotations

import argparse
import importlib.util
import re
from pathlib import Path

import pytest

from trapetum.kernels.experimental import codebook_gemv_ablation as abl

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("gemv_ablation", ROOT / "scripts" / "dev" / "gemv_ablation.py")
ga = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ga)


def test_parse_shapes_rows_variants():
    assert ga.parse_shapes("4096x11008, 11008x4096") == [(4096, 11008), (11008, 4096)]
    for bad in ("4096", "4000x4096", "4096x0", "axb"):
        with pytest.raises(argparse.ArgumentTypeError):
            ga.parse_shapes(bad)
    assert ga.parse_rows("16,32,64") == [16, 32, 64]
    for bad in ("", "0", "257", "16,300"):
        with pytest.raises(argparse.ArgumentTypeError):
            ga.parse_rows(bad)
    assert ga.parse_variants("all") == list(abl.VARIANTS)
    assert ga.parse_variants("occ3,no_x") == ["prod", "occ3", "no_x"]  # prod always, first
    with pytest.raises(argparse.ArgumentTypeError):
        ga.parse_variants("occ4")
    a = ga.args_parser().parse_args(["--out", "d"])
    assert a.shapes == [(4096, 11008), (11008, 4096), (4096, 4096)] and a.rows == [16, 32, 64]
    assert a.variants[0] == "prod" and a.replays == 30


def _source_variants() -> dict[int, tuple[int, int]]:
    src = abl.SOURCE.read_text()
    flags = {k: int(v) for k, v in re.findall(r"\b(k[A-Z]\w+) = (\d+)", src.split("constexpr int kGB")[0])}
    body = src.split("#define TRAPETUM_ABL_VARIANTS(X)")[1].split("\n\n")[0]
    out = {}
    for i, b, f in re.findall(r"X\((\d+), (\d+), ([^)]+)\)", body):
        out[int(i)] = (int(b), sum(flags[t.strip()] for t in f.split("|")) if f.strip() != "0" else 0)
    return out


def _source_xr2(p: str = "") -> dict[int, tuple[int, int]]:
    body = abl.SOURCE.read_text().split(f"#define TRAPETUM_XR2{p}_VARIANTS(X)")[1].split("\n")[0]
    return {int(i): (int(gb), int(nt)) for i, gb, nt in re.findall(r"X\((\d+), (\d+), (\d+)\)", body)}


def test_variant_table_matches_source():
    src, xr2, xr2p = _source_variants(), _source_xr2(), _source_xr2("P")
    py = {v: name for name, (v, _, _) in abl.VARIANTS.items() if v >= 0}
    assert sorted(src) + sorted(xr2) + sorted(xr2p) == sorted(py) == list(range(len(src) + len(xr2) + len(xr2p)))
    for i, (minb, fl) in src.items():  # the script's SASS labels name the same variant as the index
        assert ga.kernel_label(f"_ZN12trapetum_abl13cb_abl_kernelILi{minb}ELi{fl}EEEvPK6__half") == py[i]
    for i, (gb, nt) in xr2.items():
        assert ga.kernel_label(f"_ZN12trapetum_abl13cb_xr2_kernelILi{gb}ELi{nt}EEEvPK6__half") == py[i]
    for i, (gb, nt) in xr2p.items():
        assert ga.kernel_label(f"_ZN12trapetum_abl14cb_xr2p_kernelILi{gb}ELi{nt}EEEvPK6__half") == py[i]
    exact = {name for name, (_, ex, _) in abl.VARIANTS.items() if ex}
    assert exact == {"prod", "prod16", "prod8", "prod1", "copy", "occ3", "codes2", "pfx2", "pfx4", "occ3_pfx2",
                     "xr2", "xr2_g1", "xr2_n1", "xr2p", "xr2p_g1"}
    assert ga.kernel_label("_ZN12trapetum_mma25cb_gemv_mma_groups_kernelILi4ELi0ELi2EEEv") == "prod"
    assert ga.kernel_label("_ZN12trapetum_mma18cb_gemv_mma_kernelILi4ELi2ELi0ELb1ELb1ELb0EEEv") == "prod16"
    assert ga.kernel_label("_ZN12trapetum_mma18cb_gemv_mma_kernelILi4ELi1ELi0ELb1ELb1ELb0EEEv") == "prod8"
    assert ga.kernel_label("_ZN12trapetum_mma18cb_gemv_mma_kernelILi4ELi1ELi0ELb1ELb0ELb0EEEv") == "prod1"
    assert abl.takes_rows("prod8", 8) and not abl.takes_rows("prod8", 9) and not abl.takes_rows("xr2_n1", 16)
    assert abl.takes_rows("xr2", 64) and abl.takes_rows("prod1", 1) and not abl.takes_rows("prod1", 3)


def test_nvcc_command_and_hash():
    cmd = abl.nvcc_command("nvcc", "sm_90", 3, 8, "/tmp/p.so")
    assert "-arch=sm_90" in cmd and "-DABL_PART=3" in cmd and "-DABL_NPARTS=8" in cmd and cmd[-1] == "/tmp/p.so"
    assert abl.source_hash("a") != abl.source_hash("b") and len(abl.source_hash()) == 16


def test_ptxas_and_sass_parsers():
    log = ("ptxas info    : Compiling entry function '_ZN12trapetum_abl13cb_abl_kernelILi3ELi0EEEvPK6__half' for "
           "'sm_90'\nptxas info    : Function properties for _ZN12trapetum_abl13cb_abl_kernelILi3ELi0EEEvPK6__half\n"
           "    96 bytes stack frame, 100 bytes spill stores, 108 bytes spill loads\n"
           "ptxas info    : Used 80 registers, used 1 barriers, 96 bytes cumulative stack size\n")
    assert ga.ptxas_report(log) == {"occ3": {"regs": 80, "spill_stores": 100, "spill_loads": 108}}
    sass = ("\t\tFunction : _ZN12trapetum_abl13cb_abl_kernelILi2ELi0EEE\n"
            "        /*0480*/                   HMMA.16816.F32 R8, R24, R20, R8 ;\n"
            "        /*0490*/              @P3 HMMA.16816.F32 R8, R24, R20, R8 ;\n"
            "        /*04a0*/              @!PT LDS R0, [R2+UR4] ;\n"
            "        /*04b0*/                   LDG.E.128.CONSTANT R4, desc[UR6][R2.64] ;\n"
            "        /*04c0*/                   CCTL.E.PF1 [R2] ;\n"
            "\t\tFunction : other\n        /*0000*/                   LDSM.16.M88 R0, [R1] ;\n")
    c = ga.sass_counts(sass)
    k = "_ZN12trapetum_abl13cb_abl_kernelILi2ELi0EEE"
    assert (c[k]["HMMA"], c[k]["LDS"], c[k]["LDG"], c[k]["CCTL"], c[k]["STS"]) == (2, 1, 1, 1, 0)
    assert sum(c["other"].values()) == 0  # LDSM is not LDS


def test_table():
    cases = [{"shape": "4096x11008", "rows": 64, "us": {"prod": 50.0, "occ3": 40.0, "no_x": 25.0, "prod_again": 50.5},
              "exact": {"occ3": False}, "errors": {"pfx2": "boom"}},
             {"shape": "4096x11008", "rows": 16, "us": {"prod": 20.0, "prod16": 19.0}, "exact": {"prod16": True},
              "errors": {}}]
    md = ga.table(cases, ["prod", "prod16", "occ3", "no_x", "pfx2", "codes2"])
    lines = md.splitlines()
    assert lines[0] == "| shape | M | prod | prod16 | occ3 | no_x | pfx2 | prod_again |"
    assert lines[2] == "| 4096x11008 | 64 | 50.0 |  | 40.0 (0.80)! | 25.0 (0.50) | err | 50.5 (1.01) |"
    assert lines[3] == "| 4096x11008 | 16 | 20.0 | 19.0 (0.95) |  |  |  |  |"
