"""Session 14, second part: where the 8-bit shared-table head's time goes on the avx512vbmi path (Zen 4).

Builds patched copies of kernels/host/codebook_host.c (in a temporary directory, never the package's) and runs
scripts/dev/s14_lib_mb.c on each, alternated, one thread:
  base     the tree's kernel
  group    the table formed once per group of G rows instead of per row (the cost of idea 1, y_r = s_r * sum x T_g[c]:
           WRONG results, timing only; the real idea 1 also changes the .cbk semantics, see NOTES-engine.md)
  memcvt   the word vectors stored and widened from memory (no vextracti64x4; same results)
  form     the per-row table's fp16 halves stored and reloaded (no vinserti64x4; same results)
  unpack   the lo / hi planes interleaved by vpunpck{l,h}bw (avx512fp16's order, row8_spr) instead of vpermt2b
           (timing only here: x is not prepared in that order)
  noext / noint / nocvt   probes that drop the extracts / the lo-hi interleave / the fp16 widenings (WRONG results)

    python scripts/dev/s14_head8_probe.py [ROUNDS] [N] [K] [G] [TREE]  (defaults 3, 151936, 896, 512: Qwen's head;
                                                                        TREE: this checkout)
The patches match codebook_host.c as of 37c7cb5 (before row8_bytes), so TREE must be such a tree, e.g.
`git archive 37c7cb5 | tar -x -C /tmp/base` and TREE=/tmp/base; "unpack" there is what row8_bytes became.
Prints GB/s (codes + tables, best of 3 calls; per variant the best and the median over rounds: under other load
the best is the figure to compare) cold (the N x K matrix once, > L3) and warm (1024 rows, 200 times).
"""
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

ROW = """    const __m512 f0 = _mm512_cvtph_ps(_mm512_castsi512_si256(w0)), f1 = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(w0, 1));
    const __m512 f2 = _mm512_cvtph_ps(_mm512_castsi512_si256(w1)), f3 = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(w1, 1));
    for (int r = 0; r < R; r++) {
      const float *x = j->xp + (m0 + r) * j->Kp + b * 64;"""
CVT = {
    "memcvt": """    _mm512_store_si512((void *)wb, w0); _mm512_store_si512((void *)(wb + 32), w1);
    const __m512 f0 = _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)wb));
    const __m512 f1 = _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)(wb + 16)));
    const __m512 f2 = _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)(wb + 32)));
    const __m512 f3 = _mm512_cvtph_ps(_mm256_load_si256((const __m256i *)(wb + 48)));""",
    "noext": """    const __m512 f0 = _mm512_cvtph_ps(_mm512_castsi512_si256(w0)), f1 = _mm512_cvtph_ps(_mm512_castsi512_si256(hi));
    const __m512 f2 = _mm512_cvtph_ps(_mm512_castsi512_si256(w1)), f3 = _mm512_cvtph_ps(_mm512_castsi512_si256(lo));""",
    "noint": """    const __m512 f0 = _mm512_cvtph_ps(_mm512_castsi512_si256(lo)), f1 = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(lo, 1));
    const __m512 f2 = _mm512_cvtph_ps(_mm512_castsi512_si256(hi)), f3 = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(hi, 1));""",
    "unpack": """    const __m512i u0 = _mm512_unpacklo_epi8(lo, hi), u1 = _mm512_unpackhi_epi8(lo, hi);
    const __m512 f0 = _mm512_cvtph_ps(_mm512_castsi512_si256(u0)), f1 = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(u0, 1));
    const __m512 f2 = _mm512_cvtph_ps(_mm512_castsi512_si256(u1)), f3 = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(u1, 1));""",
    "nocvt": """    const __m512 f0 = _mm512_castsi512_ps(w0), f1 = _mm512_castsi512_ps(w1);
    const __m512 f2 = _mm512_castsi512_ps(lo), f3 = _mm512_castsi512_ps(hi);""",
}
ROW_TAIL = """
    for (int r = 0; r < R; r++) {
      const float *x = j->xp + (m0 + r) * j->Kp + b * 64;"""
ACC = """  for (int r = 0; r < R; r++) a0[r] = a1[r] = _mm512_setzero_ps();
  for (long b = 0; b < nb64; b++) {"""
FORM_OLD = """    for (int e = 0; e < 8; e++)
      t[e] = _mm512_inserti64x4(
          _mm512_castsi256_si512(_mm512_cvtps_ph(_mm512_mul_ps(s, _mm512_load_ps(gt + 32 * e)), RNE)),
          _mm512_cvtps_ph(_mm512_mul_ps(s, _mm512_load_ps(gt + 32 * e + 16)), RNE), 1);"""
FORM_NEW = """    uint16_t tb[256] __attribute__((aligned(64)));
    for (int e = 0; e < 16; e++)
      _mm256_store_si256((__m256i *)(tb + 16 * e), _mm512_cvtps_ph(_mm512_mul_ps(s, _mm512_load_ps(gt + 16 * e)), RNE));
    for (int e = 0; e < 8; e++) t[e] = _mm512_load_si512((const void *)(tb + 32 * e));"""
GROUP_OLD = """    __m512i t[8], lb[4], hb[4];
    table8_512(j, n, gt, &g, t);
    for (int i = 0; i < 4; i++) {
      lb[i] = _mm512_permutex2var_epi8(t[2 * i], evv, t[2 * i + 1]);
      hb[i] = _mm512_permutex2var_epi8(t[2 * i], odv, t[2 * i + 1]);
    }"""
GROUP_NEW = """    __m512i t[8], lb[4], hb[4];
    static __thread __m512i T[8], LB[4], HB[4];
    static __thread long gg = -2;
    if (n0 == n || n / j->G != gg) {
      gg = n / j->G;
      table8_512(j, n, gt, &g, T);
      for (int i = 0; i < 4; i++) {
        LB[i] = _mm512_permutex2var_epi8(T[2 * i], evv, T[2 * i + 1]);
        HB[i] = _mm512_permutex2var_epi8(T[2 * i], odv, T[2 * i + 1]);
      }
    }
    for (int i = 0; i < 8; i++) t[i] = T[i];
    for (int i = 0; i < 4; i++) { lb[i] = LB[i]; hb[i] = HB[i]; }"""


def variant(src: str, name: str) -> str:
    def sub(s, old, new):
        assert old in s, (name, old[:60])
        return s.replace(old, new, 1)  # the first: row8_vbmi (row8_spr, after it, has the same lines)
    if name in CVT:
        src = sub(src, ROW, CVT[name] + ROW_TAIL)
        if name == "memcvt":
            src = sub(src, ACC, ACC.replace("\n  for (long b", "\n  uint16_t wb[64] __attribute__((aligned(64)));\n  for (long b"))
    elif name == "form":
        src = sub(src, FORM_OLD, FORM_NEW)
    elif name == "group":
        src = sub(src, GROUP_OLD, GROUP_NEW)
    return src


def main() -> None:
    args = sys.argv[1:] + ["3", "151936", "896", "512", str(ROOT)][len(sys.argv) - 1:]
    rounds, N, K, G = (int(a) for a in args[:4])
    HOST = Path(args[4]) / "trapetum" / "kernels" / "host"
    names = ("base", "group", "memcvt", "form", "unpack", "noext", "noint", "nocvt")
    d = Path(tempfile.mkdtemp(prefix="s14_head8_"))
    src = (HOST / "codebook_host.c").read_text()
    for nm in names:
        (d / f"{nm}.c").write_text(variant(src, nm))
        lib = d / f"lib_{nm}.so"
        subprocess.run(["gcc", "-O3", "-shared", "-fPIC", "-pthread", "-ffp-contract=off", str(d / f"{nm}.c"),
                        str(HOST / "host_pool.c"), str(HOST / "cpu_step.c"), "-o", str(lib), "-lm"], check=True)
        subprocess.run(["gcc", "-O2", str(ROOT / "scripts" / "dev" / "s14_lib_mb.c"), str(lib), "-o",
                        str(d / f"mb_{nm}"), f"-Wl,-rpath,{d}"], check=True)
    res = {(nm, w): [] for nm in names for w in ("cold", "warm")}
    for r in range(rounds):
        for nm in (names if r % 2 == 0 else names[::-1]):
            for w, args in (("cold", [N, 1, 3, 0]), ("warm", [1024, 200, 10, 1])):
                out = subprocess.run(["nice", "-n", "10", str(d / f"mb_{nm}"), "8", str(K), str(args[0]), str(args[1]),
                                      str(args[2]), str(args[3]), "3", "1", str(G)], capture_output=True, text=True).stdout
                res[nm, w].append(float(out.split(": ")[1].split()[0]))
        print(f"round {r + 1} done, load {os.getloadavg()[0]:.2f}", flush=True)
    print("| variant | cold GB/s: best, median (range) | warm GB/s: best, median (range) |\n|---|---|---|")
    for nm in names:
        cells = []
        for w in ("cold", "warm"):
            v = sorted(res[nm, w])
            cells.append(f"{v[-1]:.1f}, {v[len(v) // 2]:.1f} ({v[0]:.1f}-{v[-1]:.1f})")
        print(f"| {nm} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
