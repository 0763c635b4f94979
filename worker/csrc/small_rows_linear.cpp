// fp32 x @ W^T (+ b) for a few rows (decode batches), read from the plain
// row-major weight: packed_linear's kernel up to kMaxSmallRows rows (see
// paged_attention_cpu.cpp). MKL's GEMM time grows with each row of a small
// batch and oneDNN's wants its own reordered copy of the weight; this kernel
// streams each weight row once for all the batch's rows, so a decode step
// reads one copy of the weights whatever its batch size.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <optional>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace tokenbudget_cpu {

#if defined(__AVX512F__)
namespace {

// Outputs n0 .. n0+R-1 of M rows: R weight rows in flight, each loaded once
// per 16 columns and multiplied into all M rows.
template <int M, int R>
inline void block(const float* x, int64_t K, const float* w, const float* bias, float* y,
                  int64_t N, int64_t n0) {
  __m512 acc[M][R];
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    __m512 xv[M];
    for (int m = 0; m < M; ++m) xv[m] = _mm512_loadu_ps(x + m * K + k);
    for (int r = 0; r < R; ++r) {
      const __m512 wv = _mm512_loadu_ps(w + (n0 + r) * K + k);
      for (int m = 0; m < M; ++m) acc[m][r] = _mm512_fmadd_ps(wv, xv[m], acc[m][r]);
    }
  }
  if (k < K) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (K - k)) - 1);
    __m512 xv[M];
    for (int m = 0; m < M; ++m) xv[m] = _mm512_maskz_loadu_ps(tail, x + m * K + k);
    for (int r = 0; r < R; ++r) {
      const __m512 wv = _mm512_maskz_loadu_ps(tail, w + (n0 + r) * K + k);
      for (int m = 0; m < M; ++m) acc[m][r] = _mm512_fmadd_ps(wv, xv[m], acc[m][r]);
    }
  }
  for (int m = 0; m < M; ++m)
    for (int r = 0; r < R; ++r)
      y[m * N + n0 + r] = _mm512_reduce_add_ps(acc[m][r]) + (bias ? bias[n0 + r] : 0.f);
}

template <int M>
void rows(const float* x, int64_t K, const float* w, const float* bias, float* y, int64_t N) {
  // 8 weight rows in flight for one batch row, fewer as rows add accumulators.
  constexpr int R = M == 1 ? 8 : (M == 2 ? 6 : 4);
  const int64_t blocks = (N + R - 1) / R;
  // A thread takes at least ~64 KiB of weights: below that a fork costs more.
  const int64_t grain = std::max<int64_t>(1, (64 << 10) / (R * K * 4));
  at::parallel_for(0, blocks, grain, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * R;
      if (n0 + R <= N) {
        block<M, R>(x, K, w, bias, y, N, n0);
      } else {
        for (int64_t n = n0; n < N; ++n) block<M, 1>(x, K, w, bias, y, N, n);
      }
    }
  });
}

}  // namespace
#endif

// x [rows, K] @ weight [N, K]^T (+ bias [N]) -> [rows, N], or an undefined
// tensor where this kernel does not apply (not fp32, more than kMaxSmallRows
// rows, a strided weight, or no AVX-512 in this build).
at::Tensor small_rows_linear(const at::Tensor& x, const at::Tensor& weight,
                             const std::optional<at::Tensor>& bias, int64_t max_rows) {
#if defined(__AVX512F__)
  const int64_t M = x.size(0), K = x.size(1), N = weight.size(0);
  const bool fits = M >= 1 && M <= max_rows && M <= 4 && K > 0 &&
                    x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat &&
                    weight.layout() == at::kStrided && weight.is_contiguous() &&
                    weight.size(1) == K &&
                    (!bias || (bias->scalar_type() == at::kFloat && bias->is_contiguous()));
  if (!fits) return at::Tensor();
  const at::Tensor xc = x.contiguous();
  at::Tensor y = at::empty({M, N}, x.options());
  const float* b = bias ? bias->data_ptr<float>() : nullptr;
  const float* xp = xc.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* yp = y.data_ptr<float>();
  switch (M) {
    case 1: rows<1>(xp, K, wp, b, yp, N); break;
    case 2: rows<2>(xp, K, wp, b, yp, N); break;
    case 3: rows<3>(xp, K, wp, b, yp, N); break;
    default: rows<4>(xp, K, wp, b, yp, N); break;
  }
  return y;
#else
  (void)x, (void)weight, (void)bias, (void)max_rows;
  return at::Tensor();
#endif
}

}  // namespace tokenbudget_cpu

namespace {
bool small_rows_linear_built() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}
}  // namespace

TORCH_LIBRARY_FRAGMENT(tokenbudget_cpu, m) {
  m.def("small_rows_linear_built() -> bool", &small_rows_linear_built);
}
