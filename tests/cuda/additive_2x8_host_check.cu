// Host check of the 2x8 AQLM kernels (trapetum/kernels/cuda/additive_gemv.cu), no GPU needed.
//
// 1. Lane maps, for every lane: each table-build store and each lookup step hits 32 distinct banks, the
//    ring reads are conflict-free (LDS.128 per quarter-warp; the canonical layout's LDS.64 per
//    half-warp), packed_pos is a permutation that gives every lane the bytes the lookups assume, and the
//    PRMT of each step (emulated from its PTX definition) makes the address of the byte step_byte names.
// 2. The kernels themselves (aqlm_2x8_kernel for both layouts, aqlm_2x8_reduce_kernel), compiled for the
//    CPU (TRAPETUM_AQLM_EMU) and run with every thread a coroutine: shuffles, redux, mma.sync (emulated
//    from the PTX fragment layouts) and __syncthreads are resolved when all participants have arrived
//    (a lane missing is an error); cp.async lands as late as allowed: at issue its destination is filled
//    with garbage, the data is written when a cp.async.wait_group retires its group (so a slot read
//    before its wait, or refilled before it was read, gives wrong sums); shared memory starts as garbage;
//    global reads are bounds-checked against the exact buffers (no slack); guard words around the partial
//    sums and outputs. Checked: every valid partial written, y against float64, the packed and canonical
//    layouts bitwise equal, bitwise equal for other grids.
// Usage: check [--quick (fewer cases) | --packed-pos (prints packed_pos for the Python packer's test)].
// Built and run by tests/test_additive_kernels.py (nvcc -x c++ -I trapetum/kernels/cuda: host code only);
// TRAPETUM_AQLM_CU names the kernel source (the mutation test compiles this check against altered copies,
// which must fail).
#define TRAPETUM_AQLM_EMU 1
#include <ucontext.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <random>
#include <set>
#include <vector>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <vector_types.h>

static int fails = 0;
#define CHECK(c, ...)                                             \
  do {                                                            \
    if (!(c)) {                                                   \
      if (fails++ < 20) {                                         \
        printf("FAIL %s:%d ", __FILE__, __LINE__);                \
        printf(__VA_ARGS__);                                      \
        printf("\n");                                             \
      }                                                           \
    }                                                             \
  } while (0)

// ----------------------------------------------------------------------------- the emulator
namespace emu {
constexpr int kMaxThreads = 256;
constexpr uint32_t kSmemBase = 0x400;        // shared addresses start here (like a reserved area)
constexpr size_t kSmemSize = 112 * 1024;     // >= kSmemBytes (checked below)
enum Op { kRun, kShfl, kRedux, kMma, kSync };
struct Copy {
  uint32_t dst;
  const uint8_t* src;
};
struct Thread {
  ucontext_t ctx;
  std::vector<char> stack;
  uint3 idx;
  Op op = kRun;
  bool done = false;
  float f = 0, fres = 0;
  unsigned u = 0, ures = 0;
  int arg = 0;
  uint32_t a0 = 0, a1 = 0, b0 = 0;
  float c[4] = {0, 0, 0, 0};
  std::vector<Copy> open;
  std::deque<std::vector<Copy>> groups;
};
static Thread threads[kMaxThreads];
static int nthreads = 0, cur = 0;
static ucontext_t sched;
static uint3 block_idx, grid_dim;
alignas(16) static uint8_t smem[kSmemSize];
static std::mt19937 garbage_rng(12345);
static std::function<void()> body;
struct Range {
  const void* p;
  size_t n;
};
static std::vector<Range> readable;  // global buffers the kernels may read

static bool check_read(const void* p, size_t n, const char* what) {
  const uint8_t* b = static_cast<const uint8_t*>(p);
  for (const Range& r : readable) {
    const uint8_t* rb = static_cast<const uint8_t*>(r.p);
    if (b >= rb && b + n <= rb + r.n) return true;
  }
  CHECK(false, "%s: global read of %zu bytes outside every buffer (thread %d block %u)", what, n, cur, block_idx.x);
  return false;
}
static uint8_t* smem_at(uint32_t addr, uint32_t n, uint32_t align) {
  CHECK(addr % align == 0 && addr >= kSmemBase && addr - kSmemBase + n <= kSmemSize, "shared address %#x (%u bytes)",
        addr, n);
  if (addr < kSmemBase || addr - kSmemBase + n > kSmemSize) return smem;  // keep going after the failure
  return smem + (addr - kSmemBase);
}
static void garbage(uint8_t* p, size_t n) {
  for (size_t i = 0; i < n; ++i) p[i] = garbage_rng() & 0xff;
}
// Block the current thread on a collective; returns once the scheduler resolved it.
static void wait_on(Op op) {
  threads[cur].op = op;
  swapcontext(&threads[cur].ctx, &sched);
}
static void entry() {
  body();
  Thread& t = threads[cur];
  CHECK(t.open.empty() && t.groups.empty(), "thread %d ended with cp.async copies not waited for", cur);
  t.done = true;
}
// mma.sync.m16n8k8.row.col f32.f16.f16.f32 for one warp (PTX fragment layouts): A 16x8 (lane (g, t): a0 =
// row g, cols 2t, 2t+1; a1 = row g + 8), B 8x8 (b0 = rows 2t, 2t+1 of col g), C/D (c0, c1 = row g, cols 2t,
// 2t+1; c2, c3 = row g + 8). Products of fp16 values are exact in fp32; sums in float64, rounded once.
static void resolve_mma(int w) {
  float A[16][8], B[8][8];
  for (int l = 0; l < 32; ++l) {
    const Thread& t = threads[32 * w + l];
    const int g = l >> 2, tt = l & 3;
    __half h[6];
    memcpy(&h[0], &t.a0, 4);
    memcpy(&h[2], &t.a1, 4);
    memcpy(&h[4], &t.b0, 4);
    A[g][2 * tt] = __half2float(h[0]), A[g][2 * tt + 1] = __half2float(h[1]);
    A[g + 8][2 * tt] = __half2float(h[2]), A[g + 8][2 * tt + 1] = __half2float(h[3]);
    B[2 * tt][g] = __half2float(h[4]), B[2 * tt + 1][g] = __half2float(h[5]);
  }
  for (int l = 0; l < 32; ++l) {
    Thread& t = threads[32 * w + l];
    const int g = l >> 2, tt = l & 3;
    for (int i = 0; i < 4; ++i) {
      const int row = g + 8 * (i >> 1), col = 2 * tt + (i & 1);
      double s = t.c[i];
      for (int k = 0; k < 8; ++k) s += (double)A[row][k] * B[k][col];
      t.c[i] = (float)s;
    }
  }
}
// Run body() for every thread of one block (threads = block size) until all have returned.
static void run_block(int nthr, uint3 bidx, uint3 gdim, std::function<void()> fn) {
  nthreads = nthr, block_idx = bidx, grid_dim = gdim, body = std::move(fn);
  garbage(smem, kSmemSize);  // shared memory is not initialised
  for (int i = 0; i < nthr; ++i) {
    Thread& t = threads[i];
    t.stack.resize(256 * 1024);
    t.idx = make_uint3(i, 0, 0);
    t.op = kRun;
    t.done = false;
    t.open.clear();
    t.groups.clear();
    getcontext(&t.ctx);
    t.ctx.uc_stack.ss_sp = t.stack.data();
    t.ctx.uc_stack.ss_size = t.stack.size();
    t.ctx.uc_link = &sched;
    makecontext(&t.ctx, entry, 0);
  }
  for (;;) {
    for (int i = 0; i < nthr; ++i)
      if (!threads[i].done && threads[i].op == kRun) {
        cur = i;
        swapcontext(&sched, &threads[i].ctx);
      }
    bool all_done = true, progress = false;
    for (int i = 0; i < nthr; ++i) all_done &= threads[i].done;
    if (all_done) return;
    for (int w = 0; w < nthr / 32; ++w) {  // warp collectives: all 32 lanes at the same one
      Thread* lanes = &threads[32 * w];
      const Op op = lanes[0].op;
      if (op != kShfl && op != kRedux && op != kMma) continue;
      bool same = true;
      for (int l = 0; l < 32; ++l) same &= !lanes[l].done && lanes[l].op == op && lanes[l].arg == lanes[0].arg;
      if (!same) {  // every thread is blocked or done here: a lane missing is a divergence
        CHECK(false, "block %u warp %d: lanes at different collectives, or some exited", bidx.x, w);
        return;
      }
      if (op == kShfl)
        for (int l = 0; l < 32; ++l) lanes[l].fres = lanes[l ^ lanes[l].arg].f;
      if (op == kRedux) {
        unsigned m = 0;
        for (int l = 0; l < 32; ++l) m = std::max(m, lanes[l].u);
        for (int l = 0; l < 32; ++l) lanes[l].ures = m;
      }
      if (op == kMma) resolve_mma(w);
      for (int l = 0; l < 32; ++l) lanes[l].op = kRun;
      progress = true;
    }
    bool all_sync = true;
    for (int i = 0; i < nthr; ++i) all_sync &= !threads[i].done && threads[i].op == kSync;
    if (all_sync) {
      for (int i = 0; i < nthr; ++i) threads[i].op = kRun;
      progress = true;
    }
    if (!progress) {
      CHECK(false, "block %u: deadlock (a barrier or collective some threads never reach)", bidx.x);
      return;
    }
  }
}
static void land(const std::vector<Copy>& g) {
  for (const Copy& c : g) memcpy(smem_at(c.dst, 16, 16), c.src, 16);
}
}  // namespace emu

// CUDA names the kernel source uses, for the CPU
template <class T>
T __ldg(const T* p) {
  emu::check_read(p, sizeof(T), "__ldg");
  return *p;
}
template <class T>
T __ldca(const T* p) {
  emu::check_read(p, sizeof(T), "__ldca");
  return *p;
}
template <class T>
T __ldcg(const T* p) {
  emu::check_read(p, sizeof(T), "__ldcg");
  return *p;
}
#include "pdl.cuh"  // (-I trapetum/kernels/cuda) here: after __ldca, before the names below are redefined
#undef __global__
#define __global__
#undef __launch_bounds__
#define __launch_bounds__(...)
#undef __shared__
#define __shared__ static
#define threadIdx (emu::threads[emu::cur].idx)
#define blockIdx (emu::block_idx)
#define gridDim (emu::grid_dim)
#define trapetum_aqlm_smem (reinterpret_cast<uint32_t*>(emu::smem))
inline size_t __cvta_generic_to_shared(const void* p) {
  return emu::kSmemBase + (static_cast<const uint8_t*>(p) - emu::smem);
}
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline float __fmul_rn(float a, float b) { return a * b; }  // host float arithmetic rounds to nearest (no FMA)
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __shfl_xor_sync(unsigned mask, float v, int m) {
  CHECK(mask == 0xffffffffu, "shuffle mask");
  emu::threads[emu::cur].f = v;
  emu::threads[emu::cur].arg = m;
  emu::wait_on(emu::kShfl);
  return emu::threads[emu::cur].fres;
}
inline unsigned __reduce_max_sync(unsigned mask, unsigned v) {
  CHECK(mask == 0xffffffffu, "redux mask");
  emu::threads[emu::cur].u = v;
  emu::threads[emu::cur].arg = -1;
  emu::wait_on(emu::kRedux);
  return emu::threads[emu::cur].ures;
}
inline void __syncthreads() { emu::wait_on(emu::kSync); }

namespace trapetum_aqlm {  // the device helpers of the .cu, for the CPU
inline uint64_t evict_first_policy() { return 0; }
inline void cp_async16(uint32_t dst, const void* src, uint64_t) {
  emu::garbage(emu::smem_at(dst, 16, 16), 16);  // in flight: the slot holds nothing usable until the wait
  if (emu::check_read(src, 16, "cp.async"))
    emu::threads[emu::cur].open.push_back({dst, static_cast<const uint8_t*>(src)});
}
inline void cp_async16_if(uint32_t dst, const void* src, bool ok, uint64_t pol) {
  if (ok) cp_async16(dst, src, pol);
}
inline void cp_async_commit() {
  emu::Thread& t = emu::threads[emu::cur];
  t.groups.push_back(t.open);
  t.open.clear();
}
template <int N>
inline void cp_async_wait() {
  emu::Thread& t = emu::threads[emu::cur];
  while ((int)t.groups.size() > N) {
    emu::land(t.groups.front());
    t.groups.pop_front();
  }
}
inline uint4 lds128(uint32_t a) {
  uint4 v;
  memcpy(&v, emu::smem_at(a, 16, 16), 16);
  return v;
}
inline uint2 lds64(uint32_t a) {
  uint2 v;
  memcpy(&v, emu::smem_at(a, 8, 8), 8);
  return v;
}
inline float lds_f32(uint32_t a) {
  float v;
  memcpy(&v, emu::smem_at(a, 4, 4), 4);
  return v;
}
inline void sts_f32(uint32_t a, float v) { memcpy(emu::smem_at(a, 4, 4), &v, 4); }
// prmt.b32 d, a, b, c (default mode): result byte n = byte c[4n+2:4n] of {b, a}, sign-replicated if c[4n+3].
inline uint32_t prmt(uint32_t a, uint32_t b, uint32_t c) {
  uint8_t bytes[8];
  for (int i = 0; i < 4; ++i) bytes[i] = (a >> (8 * i)) & 0xff, bytes[4 + i] = (b >> (8 * i)) & 0xff;
  uint32_t d = 0;
  for (int n = 0; n < 4; ++n) {
    const int sel = (c >> (4 * n)) & 0xf;
    uint8_t v = bytes[sel & 7];
    if (sel & 8) v = (v & 0x80) ? 0xff : 0;
    d |= uint32_t(v) << (8 * n);
  }
  return d;
}
inline void mma16808(float* c, uint32_t a0, uint32_t a1, uint32_t b0) {
  emu::Thread& t = emu::threads[emu::cur];
  t.a0 = a0, t.a1 = a1, t.b0 = b0, t.arg = -2;
  memcpy(t.c, c, sizeof(t.c));
  emu::wait_on(emu::kMma);
  memcpy(c, t.c, sizeof(t.c));
}
}  // namespace trapetum_aqlm

#ifndef TRAPETUM_AQLM_CU
#define TRAPETUM_AQLM_CU "../../trapetum/kernels/cuda/additive_gemv.cu"
#endif
#include TRAPETUM_AQLM_CU

using namespace trapetum_aqlm;
static_assert(kSmemBytes <= (int)emu::kSmemSize, "emulated shared memory too small");

// ----------------------------------------------------------------------------- 1. lane maps
static void check_lane_maps() {
  // table build: every store of every mma tile hits 32 banks, every table word is written once
  std::vector<int> written(kTabBytes / 4, 0);
  for (int q = 0; q < kTiles; ++q)
    for (int mt = 0; mt < 2; ++mt)
      for (int e = 0; e < 2; ++e)
        for (int second = 0; second < 2; ++second) {
          std::set<int> banks;
          for (int lane = 0; lane < 32; ++lane) {
            const int w = build_word(q, mt, lane, e, second);
            CHECK(w >= 0 && w < kTabBytes / 4, "build word %d", w);
            if (w < 0 || w >= kTabBytes / 4) continue;
            written[w]++;
            banks.insert(w % 32);
          }
          CHECK(banks.size() == 32, "build store conflict q%d mt%d e%d s%d: %zu banks", q, mt, e, second, banks.size());
        }
  for (int w = 0; w < kTabBytes / 4; ++w) CHECK(written[w] == 1, "table word %d written %d times", w, written[w]);
  // table columns: one per (group, codebook)
  std::set<int> cols;
  for (int gl = 0; gl < kSlice; ++gl)
    for (int m = 0; m < 2; ++m) cols.insert(tab_col_of(gl, m));
  CHECK(cols.size() == kCols && *cols.begin() == 0 && *cols.rbegin() == kCols - 1, "table columns");
  // packed_pos: a permutation of the unit's 1 KB; lane (r, j) copies, into slot e, chunk j of row
  // 8 (e ^ (j & 1)) + r with its halves swapped for half_swap(r), i.e. its word k is chunk word k ^ 2 hs
  std::vector<int> seen(kUnitBytes, 0);
  for (int rr = 0; rr < kUnitRows; ++rr)
    for (int b = 0; b < kSliceBytes; ++b) {
      const int pos = packed_pos(rr, b);
      CHECK(pos >= 0 && pos < kUnitBytes, "packed_pos %d", pos);
      if (pos < 0 || pos >= kUnitBytes) continue;
      seen[pos]++;
      const int e = pos / 512, lane = (pos % 512) / 16, x = pos % 16, r = lane >> 2, j = lane & 3;
      CHECK(rr == 8 * (e ^ (j & 1)) + r && b / 16 == j && x == ((b % 16) ^ (8 * half_swap(r))),
            "packed_pos(%d, %d) = %d: not lane %d's byte", rr, b, pos, lane);
    }
  for (int i = 0; i < kUnitBytes; ++i) CHECK(seen[i] == 1, "packed byte %d held %d times", i, seen[i]);
  // ring reads: LDS.128 (quarter-warps: 8 lanes x 16 B at 16 lane) and the canonical LDS.64 pairs
  // (half-warps: 16 lanes x 8 B at 16 lane + ring_half(lane, h)) are single wavefronts
  for (int qw = 0; qw < 4; ++qw) {
    std::set<int> b16;
    for (int lane = 8 * qw; lane < 8 * qw + 8; ++lane) b16.insert((16 * lane / 16) % 8);
    CHECK(b16.size() == 8, "LDS.128 ring read conflict");
  }
  for (int h = 0; h < 2; ++h)
    for (int hw = 0; hw < 2; ++hw) {
      std::set<int> b8;
      for (int lane = 16 * hw; lane < 16 * hw + 16; ++lane) {
        const int a = 16 * lane + ring_half(lane, h);
        CHECK(a % 8 == 0, "LDS.64 alignment");
        b8.insert((a / 8) % 16);
      }
      CHECK(b8.size() == 16, "LDS.64 ring read conflict: half %d half-warp %d, %zu bank pairs", h, hw, b8.size());
    }
  // lookups: the words a lane holds (both layouts), the PRMT address, 32 banks per step, 16 bytes per lane
  std::mt19937 rng(7);
  for (int trial = 0; trial < 64; ++trial) {
    uint8_t chunk[32][16];
    for (auto& c : chunk)
      for (auto& v : c) v = rng() & 0xff;
    std::vector<std::set<int>> banks(16);
    for (int lane = 0; lane < 32; ++lane) {
      const int r = lane >> 2, j = lane & 3;
      uint8_t packed[16], canon[16];
      for (int x = 0; x < 16; ++x) packed[x] = chunk[lane][x ^ (8 * half_swap(r))];  // what packed_pos stores
      memcpy(canon, chunk[lane], 16);
      uint32_t wp[4], wc[4];
      memcpy(wp, packed, 16);
      memcpy(&wc[0], canon + ring_half(lane, 0), 8);
      memcpy(&wc[2], canon + ring_half(lane, 1), 8);
      CHECK(!memcmp(wp, wc, 16), "lane %d: the layouts give different words", lane);
      std::set<int> ps;
      for (int s = 0; s < 16; ++s) {
        const uint32_t sw = step_word(lane, s);
        const uint32_t addr = prmt(wp[s >> 2], sw, sw);
        const int p = step_byte(r, s);
        ps.insert(p);
        CHECK(addr == ((uint32_t)chunk[lane][p] << 8) + 4u * tab_col(j, p), "lane %d step %d: address %#x", lane, s,
              addr);
        banks[s].insert((addr / 4) % 32);
      }
      CHECK(ps.size() == 16, "lane %d looks up %zu distinct bytes", lane, ps.size());
    }
    for (int s = 0; s < 16; ++s) CHECK(banks[s].size() == 32, "lookup step %d: %zu banks", s, banks[s].size());
  }
}

// ----------------------------------------------------------------------------- 2. the kernels on the CPU
struct Problem {
  std::vector<int> Ns;
  int G, R = 1;                                // R activation rows
  std::vector<float> x;                        // fp16 values [R][8 G]
  std::vector<std::vector<uint16_t>> cbh;      // per part fp16 [2, 256, 8]
  std::vector<std::vector<uint8_t>> canon;     // per part [N][G][2]
  std::vector<uint16_t> scales, bias, res;     // all rows; res [R][all rows]
  bool has_bias, has_res;
  int rows() const {
    int n = 0;
    for (int N : Ns) n += N;
    return n;
  }
};

static uint16_t h16(float v) {
  const __half h = __float2half(v);
  uint16_t u;
  memcpy(&u, &h, 2);
  return u;
}
static float f16(uint16_t u) {
  __half h;
  memcpy(&h, &u, 2);
  return __half2float(h);
}

static Problem make_problem(std::vector<int> Ns, int G, unsigned seed, int R = 1) {
  std::mt19937 rng(seed);
  std::normal_distribution<float> nd(0.f, 1.f);
  Problem pr;
  pr.Ns = Ns, pr.G = G, pr.R = R;
  pr.x.resize((size_t)R * 8 * G);
  for (auto& v : pr.x) v = f16(h16(nd(rng)));
  for (int N : Ns) {
    std::vector<uint16_t> cb(2 * 256 * 8);
    for (auto& v : cb) v = h16(nd(rng));
    pr.cbh.push_back(cb);
    std::vector<uint8_t> c((size_t)N * G * 2);
    for (auto& v : c) v = rng() & 0xff;
    pr.canon.push_back(c);
  }
  pr.has_bias = rng() & 1, pr.has_res = rng() & 1;
  if (Ns.size() == 2 && Ns[0] == Ns[1]) pr.has_res = 0;  // a gate/up pair: launch() also runs the act reductions
  for (int i = 0; i < pr.rows(); ++i) {
    pr.scales.push_back(h16(0.01f + 0.05f * std::abs(nd(rng))));
    pr.bias.push_back(h16(nd(rng)));
  }
  for (int i = 0; i < R * pr.rows(); ++i) pr.res.push_back(h16(nd(rng)));
  return pr;
}

// Activation row t of pr alone (R = 1): what a one-row launch gets.
static Problem row_of(const Problem& pr, int t) {
  Problem one = pr;
  const int n = pr.rows();
  one.R = 1;
  one.x.assign(pr.x.begin() + (size_t)t * 8 * pr.G, pr.x.begin() + (size_t)(t + 1) * 8 * pr.G);
  one.res.assign(pr.res.begin() + (size_t)t * n, pr.res.begin() + (size_t)(t + 1) * n);
  return one;
}

// The codes of part q as the launcher gets them: canonical bytes, or pack_2x8's "slices" layout.
static std::vector<uint8_t> code_buffer(const Problem& pr, int q, bool packed, long long* meta) {
  const int N = pr.Ns[q], G = pr.G, nslices = (G + kSlice - 1) / kSlice, groups = (N + kUnitRows - 1) / kUnitRows;
  meta[0] = N, meta[1] = 0, meta[4] = packed;
  if (!packed) {
    meta[2] = 2LL * G, meta[3] = kSliceBytes;
    return pr.canon[q];
  }
  meta[2] = kSliceBytes, meta[3] = (long long)kUnitBytes * groups;
  std::vector<uint8_t> buf((size_t)nslices * groups * kUnitBytes, 0);
  for (int sl = 0; sl < nslices; ++sl)
    for (int row = 0; row < N; ++row)
      for (int b = 0; b < kSliceBytes && sl * kSliceBytes + b < 2 * G; ++b)
        buf[((size_t)sl * groups + row / kUnitRows) * kUnitBytes + packed_pos(row % kUnitRows, b)] =
            pr.canon[q][(size_t)row * 2 * G + sl * kSliceBytes + b];
  return buf;
}

struct Result {
  std::vector<uint16_t> y;     // [R][all rows]
  std::vector<uint16_t> act[2];  // gate/up pairs: [R][N] of act = 1, 2
  std::vector<float> partial;  // valid entries only, [R][part][slice][row]
};

// One launch (the main kernel on `grid` code ranges x R activation rows, then the reduction), as the torch
// launcher sets it up.
static Result launch(const Problem& pr, bool packed, int grid) {
  const int P = (int)pr.Ns.size(), G = pr.G, nslices = (G + kSlice - 1) / kSlice, R = pr.R;
  std::vector<long long> meta(kMetaCols * P);
  std::vector<std::vector<uint8_t>> bufs;
  for (int q = 0; q < P; ++q) bufs.push_back(code_buffer(pr, q, packed, &meta[kMetaCols * q]));
  std::vector<const uint8_t*> cptr;
  for (auto& b : bufs) cptr.push_back(b.data());
  std::vector<uint16_t> cb;
  for (auto& c : pr.cbh) cb.insert(cb.end(), c.begin(), c.end());
  Params2x8 p;
  const PartTotals tot = fill_parts(p.part, P, meta.data(), cptr.data(), cb.data(), nslices);
  constexpr int kGuard = 64;
  const float sentinel = -1234.5f;
  std::vector<float> partial(R * tot.floats + 2 * kGuard, sentinel);
  std::vector<uint16_t> y(R * tot.rows + 2 * kGuard, 0xBEEF);
  std::vector<uint16_t> xh;
  for (float v : pr.x) xh.push_back(h16(v));
  emu::readable.clear();
  for (auto& b : bufs) emu::readable.push_back({b.data(), b.size()});
  emu::readable.push_back({xh.data(), xh.size() * 2});
  emu::readable.push_back({cb.data(), cb.size() * 2});
  emu::readable.push_back({pr.scales.data(), pr.scales.size() * 2});
  emu::readable.push_back({pr.bias.data(), pr.bias.size() * 2});
  emu::readable.push_back({pr.res.data(), pr.res.size() * 2});
  emu::readable.push_back({partial.data() + kGuard, R * tot.floats * sizeof(float)});  // the reduction reads these
  p.x = reinterpret_cast<const half*>(xh.data());
  p.scales = reinterpret_cast<const half*>(pr.scales.data());
  p.bias = reinterpret_cast<const half*>(pr.bias.data());
  p.res = reinterpret_cast<const half*>(pr.res.data());
  p.y = reinterpret_cast<half*>(y.data() + kGuard);
  p.partial = partial.data() + kGuard;
  p.nparts = P, p.G = G, p.nslices = nslices, p.has_bias = pr.has_bias, p.has_res = pr.has_res;
  p.units = tot.units;
  p.rows = R, p.floats = tot.floats, p.y_stride = tot.rows, p.res_stride = tot.rows;
  const int blocks = (int)std::min<long long>(grid, p.units) * R;
  for (int b = 0; b < blocks; ++b)
    emu::run_block(kThreads, make_uint3(b, 0, 0), make_uint3(blocks, 1, 1),
                   [&] { packed ? aqlm_2x8_kernel<true>(p) : aqlm_2x8_kernel<false>(p); });
  Result res;
  for (int t = 0; t < R; ++t)
    for (int q = 0; q < P; ++q)
      for (int sl = 0; sl < nslices; ++sl)
        for (int row = 0; row < pr.Ns[q]; ++row) {
          const Part2x8& Pq = p.part[q];
          const float v = p.partial[t * tot.floats + Pq.partial0 + (size_t)sl * kUnitRows * Pq.groups + row];
          CHECK(v != sentinel && !std::isnan(v), "partial row %d part %d slice %d row %d not written", t, q, sl, row);
          res.partial.push_back(v);
        }
  const auto reduce = [&](int nrows) {
    const int rblocks = (nrows + kReduceRows - 1) / kReduceRows;
    for (int t = 0; t < R; ++t)
      for (int b = 0; b < rblocks; ++b)
        emu::run_block(kThreads, make_uint3(b, t, 0), make_uint3(rblocks, R, 1), [&] { aqlm_2x8_reduce_kernel(p); });
  };
  reduce((int)tot.rows);
  for (int i = 0; i < kGuard; ++i) {
    CHECK(partial[i] == sentinel && partial[kGuard + R * tot.floats + i] == sentinel, "partial guard overwritten");
    CHECK(y[i] == 0xBEEF && y[kGuard + R * tot.rows + i] == 0xBEEF, "y guard overwritten");
  }
  res.y.assign(y.begin() + kGuard, y.begin() + kGuard + R * tot.rows);
  // a gate/up pair: the reduction with act = 1, 2 writes act(gate) * up of the fp16 rows just checked
  if (P == 2 && pr.Ns[0] == pr.Ns[1] && !pr.has_res) {
    const int n = pr.Ns[0];
    for (int act = 1; act <= 2; ++act) {
      std::vector<uint16_t> y2(R * n + 2 * kGuard, 0xBEEF);
      p.y = reinterpret_cast<half*>(y2.data() + kGuard);
      p.act = act, p.y_stride = n;
      reduce(n);
      for (int i = 0; i < kGuard; ++i)
        CHECK(y2[i] == 0xBEEF && y2[kGuard + R * n + i] == 0xBEEF, "act %d: y guard", act);
      for (int t = 0; t < R; ++t)
        for (int f = 0; f < n; ++f) {
          const float want = trapetum_act::apply(act, f16(res.y[t * tot.rows + f])) * f16(res.y[t * tot.rows + n + f]);
          CHECK(y2[kGuard + t * n + f] == h16(want), "act %d row %d, %d: not act(gate) * up of the fp16 rows", act, t,
                f);
        }
      res.act[act - 1].assign(y2.begin() + kGuard, y2.begin() + kGuard + R * n);
    }
    p.act = 0, p.y_stride = tot.rows;
  }
  // the reduction's order, on the host: quarter q adds slices q, q + 4, ..; then (s0 + s1) + (s2 + s3)
  for (int t = 0; t < R; ++t)
    for (long long grow = 0; grow < tot.rows; ++grow) {
      const Part2x8 Pr = part_of_row(p.part, P, grow);
      const int row = int(grow - Pr.row0);
      float qs[4];
      for (int q4 = 0; q4 < 4; ++q4) {
        float acc = 0.f;
        for (int sl = q4; sl < nslices; sl += 4)
          acc += p.partial[t * tot.floats + Pr.partial0 + (size_t)sl * kUnitRows * Pr.groups + row];
        qs[q4] = acc;
      }
      float v = ((qs[0] + qs[1]) + (qs[2] + qs[3])) * f16(pr.scales[grow]);
      if (pr.has_bias) v += f16(pr.bias[grow]);
      if (pr.has_res) v += f16(pr.res[t * tot.rows + grow]);
      CHECK(h16(v) == res.y[t * tot.rows + grow], "row %d, %lld: y is not the fixed-order sum of its partials", t,
            grow);
    }
  return res;
}

// Every partial sum against float64 (error <= 1e-5 of the sum of its terms' magnitudes: a single wrong
// lookup is ~1e-2 of it), y against float64 (fp16 output: 2e-3 relative over the vector), every row.
static void check_against_reference(const Problem& pr, const Result& got, const char* what) {
  const int G = pr.G, nslices = (G + kSlice - 1) / kSlice, n = pr.rows();
  size_t k = 0;
  double num = 0, den = 0, worst = 0;
  for (int t = 0; t < pr.R; ++t) {
    const float* x = pr.x.data() + (size_t)t * 8 * G;
    size_t row0 = 0;
    for (size_t q = 0; q < pr.Ns.size(); ++q) {
      const int N = pr.Ns[q];
      std::vector<double> acc(N, 0.0);
      for (int sl = 0; sl < nslices; ++sl)
        for (int row = 0; row < N; ++row) {
          double ref = 0, mag = 1e-30;
          for (int g = sl * kSlice; g < std::min(G, (sl + 1) * kSlice); ++g)
            for (int m = 0; m < 2; ++m) {
              const uint8_t c = pr.canon[q][((size_t)row * G + g) * 2 + m];
              double tv = 0;
              for (int d = 0; d < 8; ++d) tv += (double)f16(pr.cbh[q][(m * 256 + c) * 8 + d]) * x[8 * g + d];
              ref += tv, mag += std::abs(tv);
            }
          const double e = std::abs(got.partial[k] - ref) / mag;
          CHECK(e < 1e-5, "%s: x row %d part %zu slice %d row %d: partial %.8g, float64 %.8g", what, t, q, sl, row,
                got.partial[k], ref);
          worst = std::max(worst, e);
          ++k;
          acc[row] += ref;
        }
      for (int row = 0; row < N; ++row) {
        double ref = acc[row] * f16(pr.scales[row0 + row]);
        if (pr.has_bias) ref += f16(pr.bias[row0 + row]);
        if (pr.has_res) ref += f16(pr.res[(size_t)t * n + row0 + row]);
        const double v = f16(got.y[(size_t)t * n + row0 + row]);
        num += (v - ref) * (v - ref), den += ref * ref;
      }
      row0 += N;
    }
  }
  const double rel = std::sqrt(num / den);
  CHECK(rel < 2e-3, "%s: y rel err %.2e", what, rel);
  printf("  %s: partials err <= %.1e of their magnitude, y rel %.1e\n", what, worst, rel);
}

static void run_case(std::vector<int> Ns, int G, int grid, unsigned seed) {
  const Problem pr = make_problem(Ns, G, seed);
  printf("parts=%zu N0=%d G=%d grid=%d\n", Ns.size(), Ns[0], G, grid);
  const Result a = launch(pr, true, grid);
  check_against_reference(pr, a, "packed");
  const Result b = launch(pr, false, grid);
  check_against_reference(pr, b, "canonical");
  CHECK(a.partial == b.partial && a.y == b.y, "packed and canonical layouts differ bitwise");
  const Result c = launch(pr, true, grid / 3 + 1);
  CHECK(a.partial == c.partial && a.y == c.y, "packed layout: grid %d and %d differ bitwise", grid, grid / 3 + 1);
}

// Batch invariance: each activation row of an R-row launch (other rows random) has exactly the bits of the
// one-row launch of that row, outputs and gate/up activations included.
static void run_rows_case(std::vector<int> Ns, int G, int grid, int R, bool packed, unsigned seed) {
  const Problem pr = make_problem(Ns, G, seed, R);
  printf("rows=%d parts=%zu N0=%d G=%d grid=%d %s\n", R, Ns.size(), Ns[0], G, grid, packed ? "packed" : "canonical");
  const Result all = launch(pr, packed, grid);
  check_against_reference(pr, all, "all rows");
  const int n = pr.rows();
  for (int t = 0; t < R; ++t) {
    const Result one = launch(row_of(pr, t), packed, grid);
    CHECK(std::equal(one.y.begin(), one.y.end(), all.y.begin() + (size_t)t * n), "row %d of %d: y differs bitwise", t,
          R);
    const size_t np = one.partial.size();
    CHECK(std::equal(one.partial.begin(), one.partial.end(), all.partial.begin() + t * np),
          "row %d of %d: partials differ bitwise", t, R);
    for (int a = 0; a < 2; ++a)
      CHECK(std::equal(one.act[a].begin(), one.act[a].end(), all.act[a].begin() + t * one.act[a].size()),
            "row %d of %d: act %d differs bitwise", t, R, a + 1);
  }
}

int main(int argc, char** argv) {
  if (argc > 1 && !strcmp(argv[1], "--packed-pos")) {  // for the Python packer's test
    for (int rr = 0; rr < kUnitRows; ++rr)
      for (int b = 0; b < kSliceBytes; ++b) printf("%d\n", packed_pos(rr, b));
    return 0;
  }
  setvbuf(stdout, nullptr, _IONBF, 0);  // FAIL lines survive a crash (a mutant may corrupt the heap)
  const bool quick = argc > 1 && !strcmp(argv[1], "--quick");  // the mutation test: fewer cases
  check_lane_maps();
  // {N, G, blocks}: partial last slices and units (N % 16), a single unit, more blocks than units, segments
  // long enough for the steady loop (>= (kRing + kSteady) kWarps units per slice and block), one block
  const int cases[][3] = {{2000, 32, 1}, {13, 40, 3},   {1030, 184, 4}, {8, 8, 1},     {64, 64, 5},  {100, 96, 264},
                          {257, 136, 7}, {53, 32, 1000}, {1, 8, 1},     {1500, 64, 2}, {9, 24, 2},   {4096, 40, 3}};
  unsigned seed = 1;
  for (int i = 0; i < (quick ? 3 : 12); ++i) run_case({cases[i][0]}, cases[i][1], cases[i][2], seed++);
  // several parts in one launch (q/k/v, gate/up): unequal rows, segments crossing part boundaries
  const std::vector<std::vector<int>> multi = {{13, 5, 29}, {64, 16, 16}, {100, 100}, {1, 2, 3, 4}, {1257, 9, 700},
                                                {17, 17}};
  const int grids[] = {7, 1, 264, 3, 2, 5};
  for (size_t i = 0; i < (quick ? 1 : multi.size()); ++i) run_case(multi[i], 40 + 64 * (int)i, grids[i], seed++);
  // several activation rows: every row the one-row launch's bits (q/k/v- and gate/up-like parts, both layouts)
  run_rows_case({100, 37, 37}, 104, 5, 3, true, seed++);
  run_rows_case({48, 48}, 64, 3, 5, false, seed++);
  if (!quick) {
    run_rows_case({300}, 72, 2, 2, false, seed++);
    run_rows_case({33, 33}, 40, 7, 16, true, seed++);
    run_rows_case({9, 1, 20}, 8, 1000, 4, true, seed++);
  }
  printf(fails ? "FAILED (%d)\n" : "all ok\n", fails);
  return fails != 0;
}
