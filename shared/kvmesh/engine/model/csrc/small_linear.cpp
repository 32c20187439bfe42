// y = x @ w.T (+ bias) in bfloat16 for the few rows of a decode step, with AVX512-BF16.
//
// x (M, K), w (N, K) row-major as loaded, bias (N) or none; y (M, N). A decode step's
// linears read every weight once for a handful of rows: the time is the weight's trip from
// memory. oneDNN's kernels leave a third of the bandwidth unused there; this one streams the
// weight rows with software prefetch a few rows ahead, takes four weight rows at a time and
// uses each loaded weight vector for up to four x rows (vdpbf16ps: 32 products a
// instruction, accumulated in float32), and loops over the rest of x's rows while the four
// weight rows are still in L1, so a weight is read from memory once whatever M is. Each
// output is its float32 sum (plus the bias) rounded once to bfloat16, as oneDNN's is; the
// sums' order differs, so an output may be one unit in the last place apart.
//
// Built only where the compiler targets AVX512-BF16 (-march=native on such a CPU);
// kvmesh::small_linear_available() says whether it was.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include <immintrin.h>

#include "cpu_math.h"

#include <cstdint>

namespace {

#if defined(__AVX512BF16__) && defined(__AVX512F__)

constexpr int kRows = 4;  // weight rows a task takes at a time
constexpr int kXRows = 4;  // x rows each loaded weight vector serves
constexpr int64_t kAheadRows = 8;  // how far ahead the weight rows are prefetched

// Up to kRows weight rows (``rows`` of them) against x rows [m0, m0 + mb): sums into out.
template <int R, int MB>
inline void dot_rows(const uint16_t* w, int64_t K, const uint16_t* x, int64_t xs, bool prefetch, float (*sums)[kRows]) {
  __m512 acc[MB][R];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    __m512bh wv[R];
    for (int r = 0; r < R; ++r) {
      if (prefetch) _mm_prefetch(reinterpret_cast<const char*>(w + (r + kAheadRows) * K + k), _MM_HINT_T0);
      wv[r] = (__m512bh)_mm512_loadu_si512(w + r * K + k);
    }
    for (int m = 0; m < MB; ++m) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + m * xs + k);
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], wv[r], xv);
    }
  }
  if (k < K) {  // the last K % 32 elements, masked (zeros contribute nothing)
    const __mmask32 mask = (__mmask32)((1ull << (K - k)) - 1);
    __m512bh wv[R];
    for (int r = 0; r < R; ++r) wv[r] = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + r * K + k);
    for (int m = 0; m < MB; ++m) {
      const __m512bh xv = (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * xs + k);
      for (int r = 0; r < R; ++r) acc[m][r] = _mm512_dpbf16_ps(acc[m][r], wv[r], xv);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) sums[m][r] = _mm512_reduce_add_ps(acc[m][r]);
}

template <int R>
inline void rows_against_x(const uint16_t* w, int64_t K, const uint16_t* x, int64_t xs, int64_t M, int64_t n0, int64_t N,
                           const float* bias, c10::BFloat16* y) {
  float sums[kXRows][kRows];
  for (int64_t m0 = 0; m0 < M; m0 += kXRows) {
    const uint16_t* xm = x + m0 * xs;
    const bool prefetch = m0 == 0;
    switch (M - m0 < kXRows ? M - m0 : kXRows) {
      case 1: dot_rows<R, 1>(w, K, xm, xs, prefetch, sums); break;
      case 2: dot_rows<R, 2>(w, K, xm, xs, prefetch, sums); break;
      case 3: dot_rows<R, 3>(w, K, xm, xs, prefetch, sums); break;
      default: dot_rows<R, 4>(w, K, xm, xs, prefetch, sums); break;
    }
    const int64_t mb = M - m0 < kXRows ? M - m0 : kXRows;
    for (int64_t m = 0; m < mb; ++m)
      for (int r = 0; r < R; ++r) {
        const float b = bias != nullptr ? bias[n0 + r] : 0.f;
        y[(m0 + m) * N + n0 + r] = kvmesh::cpu::from_float<c10::BFloat16>(sums[m][r] + b);
      }
  }
}

at::Tensor small_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.device().is_cpu() && x.scalar_type() == at::kBFloat16 && w.scalar_type() == at::kBFloat16,
              "small_linear: bfloat16 CPU tensors");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && w.dim() == 2 && w.is_contiguous() && x.size(1) == w.size(1),
              "small_linear: x (M, K) rows contiguous, w (N, K) contiguous");
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1);
  at::Tensor bias_float;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "small_linear: bias (N)");
    bias_float = bias->to(at::kFloat).contiguous();
  }
  auto y = at::empty({M, N}, x.options());
  const auto* wp = static_cast<const uint16_t*>(w.const_data_ptr());
  const auto* xp = static_cast<const uint16_t*>(x.const_data_ptr());
  const float* bp = bias_float.defined() ? bias_float.const_data_ptr<float>() : nullptr;
  auto* yp = y.data_ptr<c10::BFloat16>();
  const int64_t xs = x.stride(0);
  const int64_t groups = N / kRows;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) rows_against_x<kRows>(wp + g * kRows * K, K, xp, xs, M, g * kRows, N, bp, yp);
  });
  for (int64_t n = groups * kRows; n < N; ++n) rows_against_x<1>(wp + n * K, K, xp, xs, M, n, N, bp, yp);
  return y;
}

bool small_linear_available() { return true; }

#else

at::Tensor small_linear(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&) {
  TORCH_CHECK(false, "small_linear: built without AVX512-BF16");
}

bool small_linear_available() { return false; }

#endif

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvmesh, m) {
  m.def("small_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("small_linear_available() -> bool", &small_linear_available);
}

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) { m.impl("small_linear", &small_linear); }
