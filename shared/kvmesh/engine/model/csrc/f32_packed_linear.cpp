// y = x @ w.T (+ bias) in float32 with fused multiply-adds on a packed copy of the weight, for
// the few to a few dozen rows of a decode step: AVX-512, or AVX2 with FMA.
//
// The design of vnni_linear.cpp in float32. f32_pack lays the weight out as, for each group of
// two vectors of outputs (32 with AVX-512, 16 with AVX2), all of K in order, each k one run of
// the group's weights; so one vector load is one k for a vector of outputs, which a fused
// multiply-add takes against one x row's value broadcast to every lane. The sums of a vector of
// outputs sit in one register (no horizontal sums at the end, which small_linear.cpp's layout
// needs for every output) and each weight vector loaded serves every row of a pass (12 with
// AVX-512's 32 registers, 6 with AVX2's 16; small_linear.cpp's: four). The group's weight is one
// contiguous range, prefetched 32 KiB ahead into L2; more rows go in even passes while it is
// still in cache, and a few rows split their sums into chains so the multiply-adds overlap.
// Each output is its float32 sum plus the bias; the sums' order differs from oneDNN's, so an
// output may differ from it by rounding.
//
// Built where the compiler targets AVX-512 or AVX2 with FMA (-march=native);
// kvmesh::f32_packed_linear_available() says whether it was, kvmesh::f32_packed_linear_lanes() for
// which vectors.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include <array>
#include <cstdint>
#include <utility>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#define KVMESH_F32_PACKED 1
#include <immintrin.h>
#endif

namespace {

#if defined(KVMESH_F32_PACKED)
#if defined(__AVX512F__)
struct Vec {  // 16 float32 lanes
  using V = __m512;
  static constexpr int64_t kLanes = 16;
  static constexpr int kMaxRows = 12;  // 2 x 12 sums of 32 registers
  static V zero() { return _mm512_setzero_ps(); }
  static V load(const float* p) { return _mm512_loadu_ps(p); }
  static V broadcast(const float* p) { return _mm512_set1_ps(*p); }
  static V fma(V w, V x, V acc) { return _mm512_fmadd_ps(w, x, acc); }
  static V add(V a, V b) { return _mm512_add_ps(a, b); }
  static V load_first(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(static_cast<__mmask16>((1u << n) - 1), p); }
  static void store_first(float* p, V v, int64_t n) { _mm512_mask_storeu_ps(p, static_cast<__mmask16>((1u << n) - 1), v); }
};
#else
struct Vec {  // 8 float32 lanes
  using V = __m256;
  static constexpr int64_t kLanes = 8;
  static constexpr int kMaxRows = 6;  // 2 x 6 sums, two weight vectors and x of 16 registers
  static V zero() { return _mm256_setzero_ps(); }
  static V load(const float* p) { return _mm256_loadu_ps(p); }
  static V broadcast(const float* p) { return _mm256_broadcast_ss(p); }
  static V fma(V w, V x, V acc) { return _mm256_fmadd_ps(w, x, acc); }
  static V add(V a, V b) { return _mm256_add_ps(a, b); }
  static __m256i first(int64_t n) {
    return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(n)), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
  }
  static V load_first(const float* p, int64_t n) { return _mm256_maskload_ps(p, first(n)); }
  static void store_first(float* p, V v, int64_t n) { _mm256_maskstore_ps(p, first(n), v); }
};
#endif

constexpr int64_t kLanes = Vec::kLanes;
constexpr int64_t kGroupN = 2 * kLanes;  // outputs in a group: two vectors
constexpr int kMaxRows = Vec::kMaxRows;
constexpr int64_t kAheadBytes = 32 * 1024;  // how far ahead the weight stream is prefetched, into L2

// MB rows of x (from ``x``, ``xs`` apart) against the kGroupN outputs of one packed group ``w``
// (K runs of kGroupN); their sums plus the bias into y's rows (``ys`` apart), ``width`` outputs.
template <int MB>
void group_rows(const float* w, int64_t K, const float* x, int64_t xs, bool prefetch, const Vec::V* bias, float* y,
                int64_t ys, int64_t width) {
  constexpr int kChains = kMaxRows >= 12 ? (MB <= 2 ? 4 : MB <= 4 ? 2 : 1) : (MB <= 3 ? 2 : 1);
  // The sums in flat arrays indexed by constants once the loops are unrolled, so the compiler
  // keeps them in registers (an array of arrays passed to a lambda was kept on the stack too:
  // a store per multiply-add, which halved the rate with AVX2's 256-bit stores).
  Vec::V sum0[kChains * MB], sum1[kChains * MB];
#pragma GCC unroll 48
  for (int i = 0; i < kChains * MB; ++i) sum0[i] = sum1[i] = Vec::zero();
  int64_t k = 0;
  for (; k + kChains <= K; k += kChains) {
#pragma GCC unroll 4
    for (int c = 0; c < kChains; ++c) {
      const float* run = w + (k + c) * kGroupN;
      if (prefetch)
        for (int64_t line = 0; line < kGroupN * 4; line += 64)
          _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(run) + kAheadBytes + line), _MM_HINT_T1);
      const Vec::V w0 = Vec::load(run), w1 = Vec::load(run + kLanes);
#pragma GCC unroll 12
      for (int m = 0; m < MB; ++m) {
        const Vec::V xv = Vec::broadcast(x + m * xs + k + c);
        sum0[c * MB + m] = Vec::fma(w0, xv, sum0[c * MB + m]);
        sum1[c * MB + m] = Vec::fma(w1, xv, sum1[c * MB + m]);
      }
    }
  }
  for (; k < K; ++k) {
    const float* run = w + k * kGroupN;
    const Vec::V w0 = Vec::load(run), w1 = Vec::load(run + kLanes);
#pragma GCC unroll 12
    for (int m = 0; m < MB; ++m) {
      const Vec::V xv = Vec::broadcast(x + m * xs + k);
      sum0[m] = Vec::fma(w0, xv, sum0[m]);
      sum1[m] = Vec::fma(w1, xv, sum1[m]);
    }
  }
#pragma GCC unroll 4
  for (int c = 1; c < kChains; ++c)
#pragma GCC unroll 12
    for (int m = 0; m < MB; ++m) {
      sum0[m] = Vec::add(sum0[m], sum0[c * MB + m]);
      sum1[m] = Vec::add(sum1[m], sum1[c * MB + m]);
    }
  for (int h = 0; h < 2; ++h) {
    const int64_t count = width - h * kLanes < kLanes ? width - h * kLanes : kLanes;
    if (count <= 0) break;
#pragma GCC unroll 12
    for (int m = 0; m < MB; ++m) {
      const Vec::V s = h == 0 ? sum0[m] : sum1[m];
      const Vec::V v = bias != nullptr ? Vec::add(s, bias[h]) : s;
      Vec::store_first(y + m * ys + h * kLanes, v, count);
    }
  }
}

using GroupRows = void (*)(const float*, int64_t, const float*, int64_t, bool, const Vec::V*, float*, int64_t, int64_t);

template <int... MB>
constexpr auto group_rows_table(std::integer_sequence<int, MB...>) {
  return std::array<GroupRows, sizeof...(MB)>{&group_rows<MB + 1>...};
}
#endif

// w (N, K) float32 -> N padded with zeros to whole groups, then for each group all of K, each
// k the group's outputs in order. Shape (N padded, K).
at::Tensor f32_pack(const at::Tensor& w) {
#if defined(KVMESH_F32_PACKED)
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.device().is_cpu(), "f32_pack: w (N, K) float32 on the CPU");
  const int64_t N = w.size(0), K = w.size(1), Np = (N + kGroupN - 1) / kGroupN * kGroupN;
  at::Tensor padded = w;
  if (Np != N) {
    padded = at::zeros({Np, K}, w.options());
    padded.narrow(0, 0, N).copy_(w);
  }
  return padded.reshape({Np / kGroupN, kGroupN, K}).permute({0, 2, 1}).contiguous().view({Np, K});
#else
  TORCH_CHECK(false, "f32_pack: not built for this CPU (no AVX-512, no AVX2 with FMA)");
#endif
}

at::Tensor f32_packed_linear(const at::Tensor& x, const at::Tensor& packed, int64_t N, const c10::optional<at::Tensor>& bias) {
#if defined(KVMESH_F32_PACKED)
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.device().is_cpu() && x.stride(1) == 1,
              "f32_packed_linear: x (M, K) float32 on the CPU, rows contiguous");
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == at::kFloat && packed.is_contiguous(), "f32_packed_linear: a weight from f32_pack");
  const int64_t Np = packed.size(0), K = packed.size(1), M = x.size(0);
  TORCH_CHECK(Np % kGroupN == 0 && N <= Np && N > Np - kGroupN && x.size(1) == K,
              "f32_packed_linear: the packed weight (", Np, ", ", K, ") is not of a (", N, ", ", x.size(1), ") weight");
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "f32_packed_linear: bias (N)");
    b = bias->to(at::kFloat).contiguous();
  }
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  static constexpr auto kernels = group_rows_table(std::make_integer_sequence<int, kMaxRows>{});
  const auto* xp = x.const_data_ptr<float>();
  const auto* wp = packed.const_data_ptr<float>();
  const float* bp = b.defined() ? b.const_data_ptr<float>() : nullptr;
  auto* yp = y.data_ptr<float>();
  const int64_t xs = x.stride(0), groups = Np / kGroupN;
  // the rows split evenly into passes of at most kMaxRows
  const int64_t passes = (M + kMaxRows - 1) / kMaxRows, pass_rows = (M + passes - 1) / passes;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t n0 = g * kGroupN, width = N - n0 < kGroupN ? N - n0 : kGroupN;
      Vec::V bias_v[2];
      for (int h = 0; h < 2 && bp != nullptr; ++h) {
        const int64_t count = width - h * kLanes < kLanes ? (width - h * kLanes > 0 ? width - h * kLanes : 0) : kLanes;
        bias_v[h] = count > 0 ? Vec::load_first(bp + n0 + h * kLanes, count) : Vec::zero();
      }
      const float* w = wp + g * kGroupN * K;
      for (int64_t m0 = 0; m0 < M; m0 += pass_rows) {
        const int64_t mb = M - m0 < pass_rows ? M - m0 : pass_rows;
        kernels[mb - 1](w, K, xp + m0 * xs, xs, m0 == 0, bp != nullptr ? bias_v : nullptr, yp + m0 * N + n0, N, width);
      }
    }
  });
  return y;
#else
  TORCH_CHECK(false, "f32_packed_linear: not built for this CPU (no AVX-512, no AVX2 with FMA)");
#endif
}

bool f32_packed_linear_available() {
#if defined(KVMESH_F32_PACKED)
  return true;
#else
  return false;
#endif
}

// The float32 lanes of the vectors it was built for: 16 (AVX-512), 8 (AVX2), 0 (not built).
int64_t f32_packed_linear_lanes() {
#if defined(KVMESH_F32_PACKED)
  return kLanes;
#else
  return 0;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvmesh, m) {
  m.def("f32_pack(Tensor w) -> Tensor");
  m.def("f32_packed_linear(Tensor x, Tensor packed, int n, Tensor? bias) -> Tensor");
  m.def("f32_packed_linear_available() -> bool", &f32_packed_linear_available);
  m.def("f32_packed_linear_lanes() -> int", &f32_packed_linear_lanes);
}

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) {
  m.impl("f32_pack", &f32_pack);
  m.impl("f32_packed_linear", &f32_packed_linear);
}
