// Host emulation of the 2x8 AQLM kernel (trapetum/kernels/cuda/additive_gemv.cu): runs the kernel's
// own lane-map functions (table columns, build stores, PRMT lookup words, segments) for every lane
// of every warp on the CPU, with mma.sync and PRMT emulated from their PTX definitions, and checks:
// every table word written once with x_g . C_m[k]; each build store and each lookup step hits 32
// distinct banks; every (part, slice, octet) unit done once, both code layouts read the
// same bytes; every partial written before the reduction; y = float64 reference.
// Built and run by tests/test_additive_kernels.py::test_2x8_lane_maps_host (needs nvcc, no GPU).
#include "../../trapetum/kernels/cuda/additive_gemv.cu"
#include <cstdio>
#include <cstdlib>
#include <cmath>
#include <vector>
#include <random>
#include <set>
#include <cstring>
#include <cuda_fp16.h>

using namespace trapetum_aqlm;

static uint32_t prmt_emu(uint32_t a, uint32_t b, uint32_t c) {
  uint8_t bytes[8];
  for (int i = 0; i < 4; ++i) { bytes[i] = (a >> (8 * i)) & 0xff; bytes[4 + i] = (b >> (8 * i)) & 0xff; }
  uint32_t d = 0;
  for (int n = 0; n < 4; ++n) {
    int sel = (c >> (4 * n)) & 0xf;
    uint8_t v = bytes[sel & 7];
    if (sel & 8) v = (v & 0x80) ? 0xff : 0;
    d |= uint32_t(v) << (8 * n);
  }
  return d;
}

static int fails = 0;
#define CHECK(c, ...) do { if (!(c)) { if (fails++ < 20) { printf("FAIL %s:%d ", __FILE__, __LINE__); printf(__VA_ARGS__); printf("\n"); } } } while (0)

// One launch over parts of Ns[q] rows (shared x of G groups), codes in the canonical layout
// (slices = false) or in the kernel's packed "slices" layout, laid out by the same offsets and strides
// that trapetum/kernels/additive_gemv.py passes to the launcher.
int run(std::vector<int> Ns, int G, int grid, bool slices, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  const int P = (int)Ns.size();
  const int nslices = (G + kSlice - 1) / kSlice;
  std::vector<float> x(G * 8);
  for (auto& v : x) v = __half2float(__float2half(nd(rng)));
  std::vector<std::vector<float>> cbs(P, std::vector<float>(2 * 256 * 8)), scs(P);
  std::vector<std::vector<uint8_t>> canon(P);
  std::vector<uint16_t> cbh(P * 2 * 256 * 8);
  std::vector<long long> meta(4 * P);
  size_t total = 0;
  for (int q = 0; q < P; ++q) {
    for (size_t i = 0; i < cbs[q].size(); ++i) {
      const __half h = __float2half(nd(rng));
      cbs[q][i] = __half2float(h);
      memcpy(&cbh[q * 2 * 256 * 8 + i], &h, 2);
    }
    scs[q].resize(Ns[q]);
    for (auto& v : scs[q]) v = __half2float(__float2half(0.01f + 0.05f * std::abs(nd(rng))));
    canon[q].resize((size_t)Ns[q] * G * 2);
    for (auto& v : canon[q]) v = rng() & 0xff;
    const long long npad = 8LL * ((Ns[q] + 7) / 8);
    meta[4 * q] = Ns[q];
    meta[4 * q + 1] = (long long)total;
    meta[4 * q + 2] = slices ? 64 : 2LL * G;
    meta[4 * q + 3] = slices ? 64 * npad : 64;
    total += slices ? (size_t)nslices * npad * 64 : canon[q].size();
  }
  std::vector<uint8_t> buf(total + 64, 0xAB);  // canonical: no padding; packed: pad bytes are 0
  for (int q = 0; q < P; ++q)
    for (int row = 0; row < Ns[q]; ++row)
      for (int sl = 0; sl < nslices; ++sl)
        for (int bb = 0; bb < 64; ++bb) {
          const int g = sl * kSlice + bb / 2;
          const size_t dst = meta[4 * q + 1] + sl * meta[4 * q + 3] + row * meta[4 * q + 2] + bb;
          if (g < G) buf[dst] = canon[q][((size_t)row * G + g) * 2 + (bb & 1)];
          else if (slices) buf[dst] = 0;
        }
  if (slices)  // padded rows of the packed layout are zero
    for (int q = 0; q < P; ++q)
      for (int row = Ns[q]; row < 8 * ((Ns[q] + 7) / 8); ++row)
        for (int sl = 0; sl < nslices; ++sl)
          memset(&buf[meta[4 * q + 1] + sl * meta[4 * q + 3] + row * 64], 0, 64);
  Part2x8 parts[kMaxParts];
  std::vector<const uint8_t*> bases(P, buf.data());  // one buffer here; offsets in meta
  const PartTotals tot = fill_parts(parts, P, meta.data(), bases.data(), cbh.data(), nslices);
  std::vector<float> partial(tot.floats, NAN);
  std::vector<int> done_unit(tot.units, 0);
  std::vector<double> y(tot.rows, NAN);
  std::vector<float> tab(kTabBytes / 4);
  const long long units = tot.units;
  for (int b = 0; b < grid; ++b) {
    const long long u1 = (long long)(b + 1) * units / grid;
    for (long long u = (long long)b * units / grid; u < u1;) {
      const Part2x8 Pt = part_of(parts, P, u);
      int q = 0;
      while (q + 1 < P && parts[q + 1].units0 <= u) ++q;
      CHECK(Pt.units0 == parts[q].units0 && Pt.N == Ns[q], "part_of u=%lld", u);
      const std::vector<float>& cb = cbs[q];
      const int N = Pt.N;
      int slice, oa, ob;
      next_segment(Pt, u, u1, &slice, &oa, &ob);
      CHECK(ob > oa && oa >= 0 && ob <= Pt.octets, "segment %d %d", oa, ob);
      for (int o = oa; o < ob; ++o) done_unit[Pt.units0 + (long long)slice * Pt.octets + o]++;
      u += ob - oa;
      // ---- build
      std::fill(tab.begin(), tab.end(), NAN);
      std::vector<int> written(kTabBytes / 4, 0);
      for (int warp = 0; warp < kWarps; ++warp)
        for (int q = warp; q < kTiles; q += kWarps)
          for (int mt = 0; mt < 2; ++mt) {
            float A[16][8], B[8][8];
            for (int lane = 0; lane < 32; ++lane) {
              const int gid = lane >> 2, t = lane & 3;
              for (int hh = 0; hh < 2; ++hh) {
                const int g = slice * kSlice + 16 * mt + 8 * hh + gid;
                for (int i = 0; i < 2; ++i) A[gid + 8 * hh][2 * t + i] = g < G ? x[(size_t)g * 8 + 2 * t + i] : 0.f;
              }
              for (int i = 0; i < 2; ++i) B[2 * t + i][gid] = cb[(bcol_m(gid) * 256 + bcol_k(q, gid)) * 8 + 2 * t + i];
            }
            float C[16][8];
            for (int rr = 0; rr < 16; ++rr)
              for (int cc = 0; cc < 8; ++cc) {
                double s = 0;
                for (int k = 0; k < 8; ++k) s += (double)A[rr][k] * B[k][cc];
                C[rr][cc] = (float)s;
              }
            for (int e = 0; e < 2; ++e)
              for (int second = 0; second < 2; ++second) {
                std::set<int> banks;
                for (int lane = 0; lane < 32; ++lane) {
                  const int gid = lane >> 2, t = lane & 3;
                  const float c[4] = {C[gid][2 * t], C[gid][2 * t + 1], C[gid + 8][2 * t], C[gid + 8][2 * t + 1]};
                  const bool hi_first = t >= 2;
                  const float v = second == 0 ? (hi_first ? c[2 + e] : c[e]) : (hi_first ? c[e] : c[2 + e]);
                  const int w = build_word(q, mt, lane, e, second);
                  CHECK(w >= 0 && w < kTabBytes / 4, "word %d", w);
                  tab[w] = v;
                  written[w]++;
                  banks.insert(w % 32);
                }
                CHECK(banks.size() == 32, "build store conflict: %zu banks", banks.size());
              }
          }
      for (int w = 0; w < kTabBytes / 4; ++w) CHECK(written[w] == 1, "word %d written %d times", w, written[w]);
      for (int gl = 0; gl < kSlice; ++gl)
        for (int m = 0; m < 2; ++m)
          for (int k = 0; k < 256; ++k) {
            const int g = slice * kSlice + gl;
            double ref = 0;
            if (g < G) for (int d = 0; d < 8; ++d) ref += (double)x[(size_t)g * 8 + d] * cb[(m * 256 + k) * 8 + d];
            const float got = tab[k * kCols + tab_col_of(gl, m)];
            CHECK(std::abs(got - ref) <= 1e-5 * (1 + std::abs(ref)), "tab g%d m%d k%d %f %f", g, m, k, got, ref);
          }
      // ---- lookups
      for (int o = oa; o < ob; ++o) {
        float lanev[32];
        std::vector<std::set<int>> banks(16), addrs(16);
        for (int lane = 0; lane < 32; ++lane) {
          const int r = lane >> 2, j = lane & 3, row = 8 * o + r;
          uint8_t chunk[16] = {0};
          if (row < N && slice * kSlice + 8 * j < G)
            memcpy(chunk, Pt.codes + slice * Pt.slice_stride + row * Pt.row_stride + 16 * j, 16);
          CHECK(!(row < N && slice * kSlice + 8 * j < G) ||
                    !memcmp(chunk, &canon[q][(size_t)row * 2 * G + slice * kSliceBytes + 16 * j],
                            std::min(16, 2 * G - slice * kSliceBytes - 16 * j)),
                "layout lane %d", lane);
          uint32_t c4[4];
          memcpy(c4, chunk, 16);
          const bool swap = r >= 4;
          const uint32_t w[4] = {swap ? c4[1] : c4[0], swap ? c4[0] : c4[1], swap ? c4[3] : c4[2], swap ? c4[2] : c4[3]};
          float acc[4];
          for (int s = 0; s < 16; ++s) {
            const uint32_t sw = step_word(lane, s);
            const uint32_t addr = prmt_emu(w[s >> 2], sw, sw);
            CHECK(addr % 4 == 0 && addr < (uint32_t)kTabBytes, "addr %u", addr);
            // the byte looked up is chunk byte step_byte(r, s), column tab_col(j, that byte)
            const int p = step_byte(r, s);
            CHECK(addr == ((uint32_t)chunk[p] << 8) + 4u * tab_col(j, p), "addr map lane %d s %d", lane, s);
            banks[s].insert((addr / 4) % 32);
            const float v = tab[addr / 4];
            if (s < 4) acc[s] = v; else acc[s & 3] += v;
          }
          lanev[lane] = (acc[0] + acc[1]) + (acc[2] + acc[3]);
        }
        for (int s = 0; s < 16; ++s) CHECK(banks[s].size() == 32, "lookup conflict s=%d: %zu banks", s, banks[s].size());
        // each lane covers every byte of its chunk once
        for (int lane = 0; lane < 32; ++lane) {
          std::set<int> ps;
          for (int s = 0; s < 16; ++s) ps.insert(step_byte(lane >> 2, s));
          CHECK(ps.size() == 16, "lane %d bytes", lane);
        }
        float v1[32], v2[32];
        for (int l = 0; l < 32; ++l) v1[l] = lanev[l] + lanev[l ^ 1];
        for (int l = 0; l < 32; ++l) v2[l] = v1[l] + v1[l ^ 2];
        for (int r = 0; r < 8; ++r) {
          const int row = 8 * o + r;
          if (row < N) partial[Pt.partial0 + (size_t)slice * N + row] = v2[4 * r];
        }
      }
    }
  }
  for (long long u = 0; u < units; ++u) CHECK(done_unit[u] == 1, "unit %lld done %d", u, done_unit[u]);
  // ---- the reduce kernel: thread (row, q) adds slices q, q + 4, ..; then (s0 + s1) + (s2 + s3)
  for (long long grow = 0; grow < tot.rows; ++grow) {
    const Part2x8 Pr = part_of_row(parts, P, grow);
    const int row = int(grow - Pr.row0);
    CHECK(row >= 0 && row < Pr.N, "part_of_row %lld", grow);
    float qs[4];
    for (int q4 = 0; q4 < 4; ++q4) {
      float acc = 0.f;
      for (int sl = q4; sl < nslices; sl += 4) {
        const float v = partial[Pr.partial0 + (size_t)sl * Pr.N + row];
        CHECK(!std::isnan(v), "partial slice %d row %lld unset", sl, grow);
        acc += v;
      }
      qs[q4] = acc;
    }
    int q = 0;
    while (q + 1 < P && parts[q + 1].row0 <= grow) ++q;
    y[grow] = ((qs[0] + qs[1]) + (qs[2] + qs[3])) * scs[q][row];
  }
  double num = 0, den = 0;
  for (int q = 0; q < P; ++q)
    for (int row = 0; row < Ns[q]; ++row) {
      double ref = 0;
      for (int g = 0; g < G; ++g)
        for (int d = 0; d < 8; ++d) {
          const double wgt = (double)cbs[q][(0 * 256 + canon[q][((size_t)row * G + g) * 2 + 0]) * 8 + d] +
                             (double)cbs[q][(1 * 256 + canon[q][((size_t)row * G + g) * 2 + 1]) * 8 + d];
          ref += wgt * x[(size_t)g * 8 + d];
        }
      ref *= scs[q][row];
      const double got = y[parts[q].row0 + row];
      CHECK(!std::isnan(got), "part %d row %d not written", q, row);
      num += (got - ref) * (got - ref);
      den += ref * ref;
    }
  const double rel = std::sqrt(num / den);
  printf("parts=%d N0=%d G=%d grid=%d slices=%d layout=%s rel=%.2e\n", P, Ns[0], G, grid, nslices,
         slices ? "slices" : "rows", rel);
  CHECK(rel < 1e-6, "rel err %e", rel);
  return 0;
}

int main() {
  // {N, G, blocks}: partial last slices and octets, more blocks than units, one block; both layouts
  const int cases[][3] = {{8, 8, 1}, {13, 40, 3}, {64, 64, 5}, {100, 96, 264}, {257, 136, 7}, {1030, 184, 50},
                          {53, 32, 1000}, {300, 512, 264}, {1, 8, 1}, {9, 24, 2}};
  unsigned seed = 1;
  for (int slices = 0; slices < 2; ++slices)
    for (auto& c : cases) run({c[0]}, c[1], c[2], slices != 0, seed++);
  // several parts in one launch (q/k/v, gate/up): unequal rows, segments crossing part boundaries
  const std::vector<std::vector<int>> multi = {{64, 16, 16}, {13, 5, 29}, {100, 100}, {1, 2, 3, 4}, {257, 9}};
  const int grids[] = {1, 7, 264, 3, 50};
  for (int slices = 0; slices < 2; ++slices)
    for (size_t i = 0; i < multi.size(); ++i) run(multi[i], 40 + 64 * (int)i, grids[i], slices != 0, seed++);
  printf(fails ? "FAILED (%d)\n" : "all ok\n", fails);
  return fails != 0;
}
