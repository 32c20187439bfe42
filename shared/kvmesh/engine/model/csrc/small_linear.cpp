// y = x @ w.T (+ bias) for the few rows of a decode step: bfloat16 with AVX512-BF16, float32
// with AVX-512 or AVX2 + FMA.
//
// x (M, K), w (N, K) row-major as loaded, bias (N) or none; y (M, N). A decode step's
// linears read every weight once for a handful of rows: the time is the weight's trip from
// memory. oneDNN's kernels leave a third of the bandwidth unused there; this one streams the
// weight rows with software prefetch into L2 32 KiB ahead, takes four weight rows at a time and
// uses each loaded weight vector for up to four x rows (bfloat16: vdpbf16ps, 32 products an
// instruction; float32: fused multiply-adds), accumulated in float32, and loops over the
// rest of x's rows while the four weight rows are still in L1, so a weight is read from
// memory once whatever M is. Each output is its float32 sum (plus the bias) rounded once to
// the dtype, as oneDNN's is; the sums' order differs, so an output may be one unit in the
// last place apart.
//
// Each dtype is built only where the compiler targets its instructions (-march=native);
// kvmesh::small_linear_available(dtype) says whether it was.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include <immintrin.h>

#include "cpu_math.h"

#include <cstdint>
#include <string>

namespace {

constexpr int kRows = 4;  // weight rows a task takes at a time
constexpr int kXRows = 4;  // x rows each loaded weight vector serves
// How far ahead the weight is prefetched, into L2 (prefetcht1): at least this, in whole groups
// of kRows rows, so that each row's lines are fetched from the same row of a later group (a
// distance in bytes alone would land inside the group being read once a row passes 8 KiB).
// On an AMD EPYC Zen 4, the weight rows 8 rows ahead into L1 (prefetcht0) streamed 8-16 GB/s a
// core from memory where a plain read streams 26; into L2 at 16-96 KiB ahead, 14-20 (the same
// distance into L1: no better than before). docs/benchmarks.md, "The small-batch linear
// kernel's prefetch".
constexpr int64_t kAheadBytes = 32 * 1024;

// kAheadBytes or more, in elements, in whole groups of kRows rows of K elements.
inline int64_t ahead_elements(int64_t K, int64_t elem_bytes) {
  const int64_t group = kRows * K;
  const int64_t groups = (kAheadBytes + group * elem_bytes - 1) / (group * elem_bytes);
  return group * (groups > 1 ? groups : 1);
}

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define KVMESH_SMALL_LINEAR_BF16 1
struct Bf16Dot {  // 32 bfloat16 products into 16 float32 sums a step
  using Elem = uint16_t;
  using Out = c10::BFloat16;
  using Vec = __m512bh;
  static constexpr int64_t kStep = 32;
  static __m512 zero() { return _mm512_setzero_ps(); }
  static Vec load(const Elem* p) { return (Vec)_mm512_loadu_si512(p); }
  static Vec load_tail(const Elem* p, int64_t n) { return (Vec)_mm512_maskz_loadu_epi16((__mmask32)((1ull << n) - 1), p); }
  static __m512 madd(__m512 acc, Vec w, Vec x) { return _mm512_dpbf16_ps(acc, w, x); }
  static float sum(__m512 acc) { return _mm512_reduce_add_ps(acc); }
};
#endif

#if defined(__AVX512F__)
#define KVMESH_SMALL_LINEAR_F32 1
struct F32Fma {  // 16 float32 products a step
  using Elem = float;
  using Out = float;
  using Vec = __m512;
  static constexpr int64_t kStep = 16;
  static __m512 zero() { return _mm512_setzero_ps(); }
  static Vec load(const Elem* p) { return _mm512_loadu_ps(p); }
  static Vec load_tail(const Elem* p, int64_t n) { return _mm512_maskz_loadu_ps((__mmask16)((1u << n) - 1), p); }
  static __m512 madd(__m512 acc, Vec w, Vec x) { return _mm512_fmadd_ps(w, x, acc); }
  static float sum(__m512 acc) { return _mm512_reduce_add_ps(acc); }
};
#elif defined(__AVX2__) && defined(__FMA__)
#define KVMESH_SMALL_LINEAR_F32 1
struct F32Fma {  // 8 float32 products a step
  using Elem = float;
  using Out = float;
  using Vec = __m256;
  static constexpr int64_t kStep = 8;
  static __m256 zero() { return _mm256_setzero_ps(); }
  static Vec load(const Elem* p) { return _mm256_loadu_ps(p); }
  static Vec load_tail(const Elem* p, int64_t n) {
    const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    return _mm256_maskload_ps(p, _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), lanes));
  }
  static __m256 madd(__m256 acc, Vec w, Vec x) { return _mm256_fmadd_ps(w, x, acc); }
  static float sum(__m256 acc) {
    const __m128 pair = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
    const __m128 two = _mm_add_ps(pair, _mm_movehl_ps(pair, pair));
    return _mm_cvtss_f32(_mm_add_ss(two, _mm_shuffle_ps(two, two, 1)));
  }
};
#endif

// R weight rows against x rows [0, MB) (x already offset): their float32 sums.
template <typename Ops, int R, int MB>
inline void dot_rows(const typename Ops::Elem* w, int64_t K, const typename Ops::Elem* x, int64_t xs, bool prefetch,
                     int64_t ahead, float (*sums)[kRows]) {
  decltype(Ops::zero()) acc[MB][R];
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) acc[m][r] = Ops::zero();
  int64_t k = 0;
  for (; k + Ops::kStep <= K; k += Ops::kStep) {
    typename Ops::Vec wv[R];
    for (int r = 0; r < R; ++r) {
      // one prefetch per cache line of each row, ``ahead`` elements on (an address, not a
      // pointer: past the end of the weight it is harmless, a prefetch cannot fault)
      if (prefetch && (k * sizeof(typename Ops::Elem)) % 64 == 0)
        _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(w + r * K + k) +
                                                   ahead * sizeof(typename Ops::Elem)),
                     _MM_HINT_T1);
      wv[r] = Ops::load(w + r * K + k);
    }
    for (int m = 0; m < MB; ++m) {
      const typename Ops::Vec xv = Ops::load(x + m * xs + k);
      for (int r = 0; r < R; ++r) acc[m][r] = Ops::madd(acc[m][r], wv[r], xv);
    }
  }
  if (k < K) {  // the last K % kStep elements, masked (zeros contribute nothing)
    typename Ops::Vec wv[R];
    for (int r = 0; r < R; ++r) wv[r] = Ops::load_tail(w + r * K + k, K - k);
    for (int m = 0; m < MB; ++m) {
      const typename Ops::Vec xv = Ops::load_tail(x + m * xs + k, K - k);
      for (int r = 0; r < R; ++r) acc[m][r] = Ops::madd(acc[m][r], wv[r], xv);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int r = 0; r < R; ++r) sums[m][r] = Ops::sum(acc[m][r]);
}

// R weight rows (outputs n0..n0+R) against every row of x.
template <typename Ops, int R>
inline void rows_against_x(const typename Ops::Elem* w, int64_t K, const typename Ops::Elem* x, int64_t xs, int64_t M,
                           int64_t n0, int64_t N, const typename Ops::Out* bias, typename Ops::Out* y, int64_t ahead) {
  float sums[kXRows][kRows];
  for (int64_t m0 = 0; m0 < M; m0 += kXRows) {
    const typename Ops::Elem* xm = x + m0 * xs;
    const bool prefetch = m0 == 0;
    const int64_t mb = M - m0 < kXRows ? M - m0 : kXRows;
    switch (mb) {
      case 1: dot_rows<Ops, R, 1>(w, K, xm, xs, prefetch, ahead, sums); break;
      case 2: dot_rows<Ops, R, 2>(w, K, xm, xs, prefetch, ahead, sums); break;
      case 3: dot_rows<Ops, R, 3>(w, K, xm, xs, prefetch, ahead, sums); break;
      default: dot_rows<Ops, R, 4>(w, K, xm, xs, prefetch, ahead, sums); break;
    }
    for (int64_t m = 0; m < mb; ++m)
      for (int r = 0; r < R; ++r) {
        const float b = bias != nullptr ? kvmesh::cpu::to_float(bias[n0 + r]) : 0.f;
        y[(m0 + m) * N + n0 + r] = kvmesh::cpu::from_float<typename Ops::Out>(sums[m][r] + b);
      }
  }
}

template <typename Ops>
void linear_rows(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias, at::Tensor& y) {
  using Elem = typename Ops::Elem;
  const int64_t M = x.size(0), N = w.size(0), K = w.size(1), xs = x.stride(0);
  const auto* wp = static_cast<const Elem*>(w.const_data_ptr());
  const auto* xp = static_cast<const Elem*>(x.const_data_ptr());
  auto* yp = static_cast<typename Ops::Out*>(y.data_ptr());
  // the bias in the output's dtype, read where it lies (converted only if it came in another)
  const at::Tensor b = bias.has_value() && bias->defined() ? bias->to(y.scalar_type()).contiguous() : at::Tensor();
  const auto* bias_p = b.defined() ? static_cast<const typename Ops::Out*>(b.const_data_ptr()) : nullptr;
  const int64_t groups = N / kRows;
  const int64_t ahead = ahead_elements(K, sizeof(Elem));
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g)
      rows_against_x<Ops, kRows>(wp + g * kRows * K, K, xp, xs, M, g * kRows, N, bias_p, yp, ahead);
  });
  for (int64_t n = groups * kRows; n < N; ++n) rows_against_x<Ops, 1>(wp + n * K, K, xp, xs, M, n, N, bias_p, yp, ahead);
}

at::Tensor small_linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK(x.device().is_cpu() && w.scalar_type() == dtype, "small_linear: CPU tensors of one dtype");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && w.dim() == 2 && w.is_contiguous() && x.size(1) == w.size(1),
              "small_linear: x (M, K) rows contiguous, w (N, K) contiguous");
  if (bias.has_value() && bias->defined())
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == w.size(0), "small_linear: bias (N)");
  auto y = at::empty({x.size(0), w.size(0)}, x.options());
#if defined(KVMESH_SMALL_LINEAR_BF16)
  if (dtype == at::kBFloat16) {
    linear_rows<Bf16Dot>(x, w, bias, y);
    return y;
  }
#endif
#if defined(KVMESH_SMALL_LINEAR_F32)
  if (dtype == at::kFloat) {
    linear_rows<F32Fma>(x, w, bias, y);
    return y;
  }
#endif
  TORCH_CHECK(false, "small_linear: not built for ", dtype, " on this CPU");
}

bool small_linear_available(const std::string& dtype) {
#if defined(KVMESH_SMALL_LINEAR_BF16)
  if (dtype == "bfloat16") return true;
#endif
#if defined(KVMESH_SMALL_LINEAR_F32)
  if (dtype == "float32") return true;
#endif
  return false;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvmesh, m) {
  m.def("small_linear(Tensor x, Tensor w, Tensor? bias) -> Tensor");
  m.def("small_linear_available(str dtype) -> bool", &small_linear_available);
}

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) { m.impl("small_linear", &small_linear); }
