// Tensor-core expert GEMVs (4-/8-bit per-row codebooks) for mixture-of-experts DECODE / VERIFY rows: only the
// experts each row chose, the expert ids read on the device (no host sync: capturable in a CUDA graph).
//
//   gate/up  h[m, j, o] = act(G_e x[m]) * (U_e x[m]) (o < f),  e = idx[m, j]            (EPI 1 SiLU, 2 GELU-tanh)
//   down     part[m, j, d] = (D_e h[m, j])[d] in fp32;  then y[m, d] = round(sum_j w[m, j] * part[m, j, d]
//            (+ residual[m, d])), slots j = 0, 1, ..., k - 1 in order (expert_combine_kernel)
// Stacks (kernels/expert_gemv.py's docstring): codes uint8 [E, R, KB], expert e at e * R * KB; codebook fp16
// [E, N, 2**bits]. gate/up rows interleaved 8 gate / 8 up (R = N = 2 Fp); down R = N = D (canonical) or
// R = ceil(D / 16) * 16 (tiled: codebook_layout.tile_codes of each expert).
//
// Design: the block body of cb_gemv_mma_kernel (codebook_gemv_mma.cu, its file comment) at M = 1, unchanged:
// one block = 16 weight rows of one expert x the whole input, for one (row m, slot j) pair r = blockIdx.y =
// m * k + j. The block waits for the previous kernel (PDL: the routing kernel writes idx), reads e = idx[r], and
// offsets the code and codebook pointers by e; then the prologue (first code loads, table build), the chunk loop,
// the fixed-order warp reduction and the epilogue of the dense M = 1 call on expert e's matrix and x row m (gate/up)
// or h row r (down). So each (m, j) has exactly the bits of that one-row dense call (gate/up: the fp16 h; down: the
// fp32 dot before rounding), whatever the other rows hold or chose: row m of an M-row call is bitwise its one-row
// call (the VERIFY contract), and replays are bitwise (no atomics). The price of reading e first: the weight-only
// prologue can no longer overlap the previous kernel (the dense GEMVs hide it behind PDL).
// The table build (64 KB per 16-row block) is paid per (m, j) pair: a DeepSeek-V2-Lite down block has only
// KB = 704 code bytes per row (11 chunks: 1-2 per warp), so its build is comparable to its lookups there.
// Rows that chose the same expert read its weights separately (from L2 after the first).
// Requirements (checked by kernels/expert_gemv_mma.py): bits 4 / 8, KB % 64 == 0 (4-bit: in % 128 == 0,
// 8-bit: in % 64 == 0), gate/up R % 16 == 0, sm_80+.
#ifndef TRAPETUM_CBGEMV_MMA_CU
#include "codebook_gemv_mma.cu"  // standalone compile (scripts/cuda_check.sh); the extension concatenates both files
#endif

namespace trapetum_mma {


// EPI 1 / 2: gate/up (y = h, fp16, f outputs per pair); EPI 0: down (part, fp32, N outputs per pair).
// x rows: gate/up x[m] = x + (r / ks) * K; down h[m, j] = x + r * K.
template <int BITS, int EPI, bool TILED>
__global__ void __launch_bounds__(kThreads, 3)
cb_expert_mma_kernel(const half* __restrict__ x, const void* __restrict__ idx, int idx64,
                     const uint8_t* __restrict__ codes_all, const half* __restrict__ cb_all, long long codes_stride,
                     long long cb_stride, half* __restrict__ y, float* __restrict__ part, int N, int K, int KB,
                     int F, int ks) {
  trapetum_pdl::allow_dependents();
  trapetum_pdl::wait_inputs();  // idx (and x) come from the previous kernels
  uint32_t* smem = trapetum_cbgemv_smem;
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int g = lane >> 2, t = lane & 3;
  const int row0 = blockIdx.x * 16;
  const int r = blockIdx.y;
  const long long e = idx64 ? (long long)__ldca(reinterpret_cast<const long long*>(idx) + r)
                            : (long long)__ldca(reinterpret_cast<const int*>(idx) + r);
  const uint8_t* codes = codes_all + e * codes_stride;
  const half* cb = cb_all + e * cb_stride;
  const half* xr = x + (size_t)(EPI == 0 ? r : r / ks) * K;
  const CodeStream<TILED> cs(codes, N, KB, row0, g, t);
  const int nchunks = cs.nchunks;

  uint4 qa0, qb0, qa1, qb1;
  cs.load(warp, qa0, qb0);
  cs.load(warp + kWarps, qa1, qb1);
  build_table<BITS>(smem, cb, N, row0, tid);
  __syncthreads();

  uint32_t sb;
  asm("mov.u32 %0, trapetum_cbgemv_smem;" : "=r"(sb));
  const uint32_t lane4 = (uint32_t)lane * 4u;
  float acc[1][4] = {{0.0f, 0.0f, 0.0f, 0.0f}};
  constexpr int XW = XWords<BITS>::value;
  uint32_t xw0[1][XW] = {}, xw1[1][XW] = {};
  load_x<BITS, 1, false>(xw0, xr, 1, K, g, t, min(warp, nchunks - 1));
  for (int c = warp; c < nchunks; c += kWarps) {
    uint4 qa2, qb2;
    cs.load(c + 2 * kWarps, qa2, qb2);
    load_x<BITS, 1, false>(xw1, xr, 1, K, g, t, min(c + kWarps, nchunks - 1));
    compute_chunk<BITS, 1>(acc, qa0, qb0, sb, lane4, xw0);
    qa0 = qa1; qb0 = qb1; qa1 = qa2; qb1 = qb2;
#pragma unroll
    for (int i = 0; i < XW; ++i) xw0[0][i] = xw1[0][i];
  }
  __syncthreads();  // every warp is done with the table: reuse it for the reduction
  float* red = reinterpret_cast<float*>(smem);
  if (EPI != 0) {
    reduce_store<1, EPI>(red, acc, tid, lane, warp, row0, 1, N, F, 0, 0, nullptr, y + (size_t)r * F);
  } else {  // reduce_store's EPI 0 branch at M = 1, stored in fp32
    __syncthreads();
#pragma unroll
    for (int q = 0; q < 4; ++q) red[(warp * 4 + q) * 32 + lane] = acc[0][q];
    __syncthreads();
    if (tid < 16) {
      const int rr = tid, ln = (rr & 7) * 4, reg = (rr >> 3) << 1;
      float s = 0.0f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) s += red[(w * 4 + reg) * 32 + ln];
      if (row0 + rr < N) part[(size_t)r * N + row0 + rr] = s;
    }
  }
}

// y[m, d] = round(sum_j w[m, j] * part[m, j, d] (+ res[m, d])), j in order from 0.0f (one thread per (m, d)).
__global__ void __launch_bounds__(256)
expert_combine_kernel(const float* __restrict__ part, const float* __restrict__ w, const half* __restrict__ res,
                      half* __restrict__ y, int M, int N, int ks, int has_res) {
  trapetum_pdl::allow_dependents();
  trapetum_pdl::wait_inputs();
  const long long q = (long long)blockIdx.x * 256 + threadIdx.x;
  if (q >= (long long)M * N) return;
  const int m = (int)(q / N), d = (int)(q - (long long)m * N);
  float s = 0.0f;
  for (int j = 0; j < ks; ++j)
    s = __fmaf_rn(__ldca(w + (size_t)m * ks + j), __ldca(part + ((size_t)m * ks + j) * N + d), s);
  if (has_res) s += trapetum_pdl::ld_input_half(res + q);
  y[q] = __float2half(s);
}

}  // namespace trapetum_mma

#ifdef TRAPETUM_TORCH_LAUNCHER
namespace trapetum_mma {
struct ExpertArgs {
  const half* x; const void* idx; int idx64; const uint8_t* codes; const half* cb; long long cs, cbs;
  half* y; float* part; int N, K, KB, F, ks, pairs;
};

template <int BITS, int EPI, bool TILED>
static void launch_expert(const ExpertArgs& a, cudaStream_t stream, bool pdl) {
  auto kern = cb_expert_mma_kernel<BITS, EPI, TILED>;
  const int smem_bytes = kTabWords * 4;
  static bool attr_set[kAttrDevices] = {};
  set_smem_once(kern, attr_set, smem_bytes, 100);  // codebook_gemv_mma.cu's launcher helper
  const dim3 grid((a.N + 15) / 16, a.pairs);
  C10_CUDA_CHECK(trapetum_pdl::launch(kern, grid, kThreads, smem_bytes, stream, pdl, a.x, a.idx, a.idx64, a.codes,
                                      a.cb, a.cs, a.cbs, a.y, a.part, a.N, a.K, a.KB, a.F, a.ks));
}

template <int EPI, bool TILED>
static void expert_by_bits(const ExpertArgs& a, int bits, cudaStream_t s, bool pdl) {
  if (bits == 4) launch_expert<4, EPI, TILED>(a, s, pdl);
  else launch_expert<8, EPI, TILED>(a, s, pdl);
}

template <int EPI>
static void expert_dispatch(const ExpertArgs& a, int bits, bool tiled, cudaStream_t s, bool pdl) {
  if (tiled) expert_by_bits<EPI, true>(a, bits, s, pdl);
  else expert_by_bits<EPI, false>(a, bits, s, pdl);
}

static void expert_common(const torch::Tensor& x, const torch::Tensor& idx, const torch::Tensor& codes,
                          const torch::Tensor& cb, int64_t bits) {
  TORCH_CHECK(x.is_cuda() && x.is_contiguous() && x.scalar_type() == at::kHalf, "x");
  TORCH_CHECK(idx.is_cuda() && idx.dim() == 2 && idx.is_contiguous() &&
              (idx.scalar_type() == at::kInt || idx.scalar_type() == at::kLong), "idx");
  TORCH_CHECK(codes.is_cuda() && codes.dim() == 3 && codes.is_contiguous() && codes.scalar_type() == at::kByte, "codes");
  TORCH_CHECK(bits == 4 || bits == 8, "bits");
  TORCH_CHECK(cb.is_cuda() && cb.dim() == 3 && cb.is_contiguous() && cb.scalar_type() == at::kHalf &&
              cb.size(0) == codes.size(0) && cb.size(2) == (1 << bits) && cb.size(1) <= codes.size(1), "codebook");
  TORCH_CHECK(codes.size(2) % 64 == 0, "codes: 64 code bytes per row | KB");
  TORCH_CHECK(idx.numel() >= 1 && idx.numel() <= 65535, "idx: 1 to 65535 (row, slot) pairs");
}
}  // namespace trapetum_mma

// x [M, K] fp16; idx int32/int64 [M, k]; codes uint8 [E, 2Fp, KB] (canonical or tiled); cb fp16 [E, 2Fp, 2**bits];
// h fp16 [M, k, f] out; epi 1 (SiLU) / 2 (GELU-tanh).
void cb_expert_gate_up(torch::Tensor x, torch::Tensor idx, torch::Tensor codes, torch::Tensor cb, torch::Tensor h,
                       int64_t bits, int64_t epi, int64_t f, int64_t tiled, int64_t pdl) {
  using namespace trapetum_mma;
  expert_common(x, idx, codes, cb, bits);
  const int M = x.size(0), K = x.size(1), ks = idx.size(1), N = codes.size(1), KB = codes.size(2);
  TORCH_CHECK(x.dim() == 2 && idx.size(0) == M && KB * 8 == K * bits, "x / codes width");
  TORCH_CHECK(cb.size(1) == N && N % 16 == 0 && f > N / 2 - 8 && f <= N / 2, "f vs interleaved rows");
  TORCH_CHECK(epi == 1 || epi == 2, "epi");
  TORCH_CHECK(h.is_cuda() && h.is_contiguous() && h.scalar_type() == at::kHalf && h.numel() == (int64_t)M * ks * f, "h");
  const c10::cuda::CUDAGuard guard(x.device());
  ExpertArgs a{reinterpret_cast<const half*>(x.data_ptr<at::Half>()), idx.data_ptr(), idx.scalar_type() == at::kLong,
               codes.data_ptr<uint8_t>(), reinterpret_cast<const half*>(cb.data_ptr<at::Half>()),
               (long long)codes.stride(0), (long long)cb.stride(0), reinterpret_cast<half*>(h.data_ptr<at::Half>()),
               nullptr, N, K, KB, (int)f, ks, M * ks};
  cudaStream_t s = c10::cuda::getCurrentCUDAStream().stream();
  if (epi == 1) expert_dispatch<1>(a, (int)bits, tiled != 0, s, pdl != 0);
  else expert_dispatch<2>(a, (int)bits, tiled != 0, s, pdl != 0);
}

// h fp16 [M, k, F]; idx [M, k]; weights fp32 [M, k]; codes uint8 [E, R, KB] (R = D, or ceil(D/16)*16 tiled);
// cb fp16 [E, D, 2**bits]; res fp16 [M, D] (read when has_res); part fp32 [M, k, D] scratch; y fp16 [M, D] out.
void cb_expert_down(torch::Tensor h, torch::Tensor idx, torch::Tensor weights, torch::Tensor codes, torch::Tensor cb,
                    torch::Tensor res, torch::Tensor part, torch::Tensor y, int64_t bits, int64_t has_res,
                    int64_t tiled, int64_t pdl) {
  using namespace trapetum_mma;
  expert_common(h, idx, codes, cb, bits);
  TORCH_CHECK(h.dim() == 3, "h");
  const int M = h.size(0), ks = h.size(1), K = h.size(2), N = cb.size(1), KB = codes.size(2);
  TORCH_CHECK(idx.size(0) == M && idx.size(1) == ks && KB * 8 == K * bits, "h / codes width");
  TORCH_CHECK(tiled ? codes.size(1) == (N + 15) / 16 * 16 : codes.size(1) == N, "codes rows");
  TORCH_CHECK(weights.is_cuda() && weights.is_contiguous() && weights.scalar_type() == at::kFloat &&
              weights.numel() == (int64_t)M * ks, "weights");
  TORCH_CHECK(part.is_cuda() && part.is_contiguous() && part.scalar_type() == at::kFloat &&
              part.numel() == (int64_t)M * ks * N, "part");
  TORCH_CHECK(y.is_cuda() && y.is_contiguous() && y.scalar_type() == at::kHalf && y.numel() == (int64_t)M * N, "y");
  TORCH_CHECK(res.is_cuda() && res.is_contiguous() && res.scalar_type() == at::kHalf &&
              (!has_res || res.numel() == (int64_t)M * N), "residual");
  const c10::cuda::CUDAGuard guard(h.device());
  ExpertArgs a{reinterpret_cast<const half*>(h.data_ptr<at::Half>()), idx.data_ptr(), idx.scalar_type() == at::kLong,
               codes.data_ptr<uint8_t>(), reinterpret_cast<const half*>(cb.data_ptr<at::Half>()),
               (long long)codes.stride(0), (long long)cb.stride(0), nullptr, part.data_ptr<float>(), N, K, KB, 0, ks,
               M * ks};
  cudaStream_t s = c10::cuda::getCurrentCUDAStream().stream();
  expert_dispatch<0>(a, (int)bits, tiled != 0, s, pdl != 0);
  const long long n = (long long)M * N;
  C10_CUDA_CHECK(trapetum_pdl::launch(expert_combine_kernel, (unsigned)((n + 255) / 256), 256, 0, s, pdl != 0,
                                      (const float*)part.data_ptr<float>(), (const float*)weights.data_ptr<float>(),
                                      reinterpret_cast<const half*>(res.data_ptr<at::Half>()),
                                      reinterpret_cast<half*>(y.data_ptr<at::Half>()), M, N, ks, (int)has_res));
}
#endif
