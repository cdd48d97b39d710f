// The argument checks of the split sparse GEMV launcher (sparse_mma.cu; included after
// <torch/extension.h>): codebook cb fp16 [N, 16] over B blocks of kRows rows, dense uint8 [M], y fp16 [M, N]
// (epi 0) or [M, f] (epi 1, 2), the residual, S K ranges of at most max_ks inputs, the fp32 partials and the int32
// counters. Returns N.
#pragma once

namespace trapetum_sparse_split {

inline int check_args(const torch::Tensor& cb, const torch::Tensor& res, const torch::Tensor& dense,
                      const torch::Tensor& y, const torch::Tensor& part, const torch::Tensor& cnt, int M, int K, int B,
                      int kRows, int max_ks, int64_t epi, int64_t has_res, int64_t f, int S) {
  TORCH_CHECK(cb.is_cuda() && cb.is_contiguous() && cb.scalar_type() == at::kHalf && cb.dim() == 2 && cb.size(1) == 16, "codebook");
  const int N = cb.size(0);
  TORCH_CHECK(N >= 1 && B == (N + kRows - 1) / kRows, "codebook rows vs code blocks");
  TORCH_CHECK(M >= 1 && M <= 16 && K >= 1, "shape");
  TORCH_CHECK(dense.is_cuda() && dense.numel() == M && dense.scalar_type() == at::kByte, "dense");
  TORCH_CHECK(y.is_cuda() && y.is_contiguous() && y.scalar_type() == at::kHalf, "y");
  TORCH_CHECK(res.is_cuda() && res.is_contiguous() && res.scalar_type() == at::kHalf, "residual");
  TORCH_CHECK(epi >= 0 && epi <= 2, "epi");
  TORCH_CHECK(epi == 0 ? y.numel() == (int64_t)M * N : (N % 16 == 0 && f > 0 && 2 * f <= N && y.numel() == (int64_t)M * f),
              "y shape");
  TORCH_CHECK(!has_res || (epi == 0 && res.numel() == (int64_t)M * N), "residual shape");
  TORCH_CHECK(S >= 1 && (K + S - 1) / S <= max_ks, "splits");
  TORCH_CHECK(S == 1 || (part.is_cuda() && part.is_contiguous() && part.scalar_type() == at::kFloat &&
                         part.numel() >= (int64_t)S * M * B * kRows), "partials");
  TORCH_CHECK(cnt.is_cuda() && cnt.scalar_type() == at::kInt && cnt.numel() >= (int64_t)M * B, "counters");
  return N;
}

}  // namespace trapetum_sparse_split
