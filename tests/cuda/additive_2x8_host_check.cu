// Host emulation of the 2x8 AQLM kernel (trapetum/kernels/cuda/additive_gemv.cu): runs the kernel's
// own lane-map functions (table columns, build stores, PRMT lookup words, segments) for every lane
// of every warp on the CPU, with mma.sync and PRMT emulated from their PTX definitions, and checks:
// every table word written once with x_g . C_m[k]; each build store and each lookup step hits 32
// distinct banks; every (slice, octet) unit done once; counters back at zero; y = float64 reference.
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

int run(int N, int G, int grid, unsigned seed) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  std::vector<float> x(G * 8), cb(2 * 256 * 8), sc(N);
  for (auto& v : x) v = __half2float(__float2half(nd(rng)));
  for (auto& v : cb) v = __half2float(__float2half(nd(rng)));
  for (auto& v : sc) v = __half2float(__float2half(0.01f + 0.05f * std::abs(nd(rng))));
  std::vector<uint8_t> codes((size_t)N * G * 2);
  for (auto& v : codes) v = rng() & 0xff;
  const int nslices = (G + kSlice - 1) / kSlice, octets = (N + 7) / 8;
  const long long units = (long long)nslices * octets;
  std::vector<float> partial((size_t)nslices * N, NAN);
  std::vector<int> counters(octets, 0), done_unit(units, 0);
  std::vector<double> y(N, NAN);
  std::vector<float> tab(kTabBytes / 4);
  for (int b = 0; b < grid; ++b) {
    const long long u1 = (long long)(b + 1) * units / grid;
    for (long long u = (long long)b * units / grid; u < u1;) {
      int slice, oa, ob;
      next_segment(u, u1, octets, &slice, &oa, &ob);
      CHECK(ob > oa && oa >= 0 && ob <= octets, "segment %d %d", oa, ob);
      u += ob - oa;
      for (int o = oa; o < ob; ++o) done_unit[(long long)slice * octets + o]++;
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
          if (row < N && slice * kSlice + 8 * j < G) memcpy(chunk, &codes[(size_t)row * 2 * G + slice * kSliceBytes + 16 * j], 16);
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
          if (row < N) partial[(size_t)slice * N + row] = v2[4 * r];
        }
      }
      // ---- completion
      for (int o = oa; o < ob; ++o) {
        if (counters[o]++ == nslices - 1) {
          counters[o] = 0;
          for (int rr = 0; rr < 8; ++rr) {
            const int row = 8 * o + rr;
            if (row >= N) continue;
            float acc = 0.f;
            for (int sl = 0; sl < nslices; ++sl) acc += partial[(size_t)sl * N + row];
            y[row] = acc * sc[row];
          }
        }
      }
    }
  }
  for (long long u = 0; u < units; ++u) CHECK(done_unit[u] == 1, "unit %lld done %d", u, done_unit[u]);
  for (int o = 0; o < octets; ++o) CHECK(counters[o] == 0, "counter %d = %d", o, counters[o]);
  double num = 0, den = 0;
  for (int row = 0; row < N; ++row) {
    double ref = 0;
    for (int g = 0; g < G; ++g)
      for (int d = 0; d < 8; ++d) {
        const double wgt = (double)cb[(0 * 256 + codes[((size_t)row * G + g) * 2 + 0]) * 8 + d] +
                           (double)cb[(1 * 256 + codes[((size_t)row * G + g) * 2 + 1]) * 8 + d];
        ref += wgt * x[(size_t)g * 8 + d];
      }
    ref *= sc[row];
    CHECK(!std::isnan(y[row]), "row %d not written", row);
    num += (y[row] - ref) * (y[row] - ref);
    den += ref * ref;
  }
  const double rel = std::sqrt(num / den);
  printf("N=%d G=%d grid=%d slices=%d octets=%d rel=%.2e\n", N, G, grid, nslices, octets, rel);
  CHECK(rel < 1e-6, "rel err %e", rel);
  return 0;
}

int main() {
  // {N, G, blocks}: partial last slices and octets, more blocks than units, one block
  const int cases[][3] = {{8, 8, 1}, {13, 40, 3}, {64, 64, 5}, {100, 96, 264}, {257, 136, 7}, {1030, 184, 50},
                          {53, 32, 1000}, {300, 512, 264}, {1, 8, 1}, {9, 24, 2}};
  unsigned seed = 1;
  for (auto& c : cases) run(c[0], c[1], c[2], seed++);
  printf(fails ? "FAILED (%d)\n" : "all ok\n", fails);
  return fails != 0;
}
