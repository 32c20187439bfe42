// y = x @ w.T (+ bias) in bfloat16 with AVX512-BF16 vector dot products, for the two to a few
// dozen rows of a decode step, on a CPU without AMX.
//
// It reads the weight in the layout amx_pack (amx_linear.cpp) makes for the AMX tiles: for each
// 32 outputs, all of K in runs of two 1 KiB tiles, each 16 pairs of K by 16 outputs by the
// pair. One 64-byte vector of that is one pair of K for 16 outputs, which is what VDPBF16PS
// multiplies against a pair of one x row's values broadcast to every lane: 16 outputs' sums
// in one register, no horizontal sums at the end (small_linear.cpp's layout needs one per
// output, a third of its instructions at K = 576), and each weight vector loaded once serves
// up to twelve x rows (small_linear.cpp's: four). A task keeps 32 outputs by up to twelve
// rows in 24 registers, streams its outputs' weight as one contiguous range with software
// prefetch into L2 ahead, and does more rows in passes of at most twelve while that weight is
// still in cache; with four rows or fewer it splits the sums into two or four chains so that
// the multiplies do not wait on each other. Each output is its float32 sum plus the bias,
// rounded once to bfloat16 (round to nearest even), as oneDNN's is; the sums' order differs,
// so an output may be one unit in the last place apart.
//
// Built only where the compiler targets AVX512-BF16 (-march=native);
// kvmesh::vnni_linear_available() says whether it was.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <utility>

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define KVMESH_VNNI_LINEAR 1
#include <immintrin.h>

#include "cpu_math.h"
#endif

namespace {

#if defined(KVMESH_VNNI_LINEAR)
constexpr int64_t kTileK = 32;        // K values in a k tile of the packed weight (amx_pack)
constexpr int64_t kTileElems = 512;   // bfloat16 values in one 1 KiB tile: 16 pairs x 16 outputs x 2
constexpr int64_t kGroupN = 32;       // outputs in a group: two tiles side by side
constexpr int kMaxRows = 12;          // x rows a pass keeps sums for: 2 x 12 of 32 vector registers
constexpr int64_t kAheadBytes = 32 * 1024;  // how far ahead the weight stream is prefetched, into L2

// The pair of x values (k, k + 1) of one row, in every 32-bit lane; ``last``: k + 1 is past K (zero).
inline __m512bh x_pair(const uint16_t* row, int64_t k, bool last = false) {
  uint32_t pair = row[k];
  if (!last) std::memcpy(&pair, row + k, sizeof(pair));
  return (__m512bh)_mm512_set1_epi32(static_cast<int>(pair));
}

// One pair of K (vectors w0, w1 of the group's two tiles) into the MB rows' sums.
template <int MB>
inline void add_pair(__m512 (*acc)[2], __m512bh w0, __m512bh w1, const uint16_t* x, int64_t xs, int64_t k, bool last) {
  for (int m = 0; m < MB; ++m) {
    const __m512bh xv = x_pair(x + m * xs, k, last);
    acc[m][0] = _mm512_dpbf16_ps(acc[m][0], w0, xv);
    acc[m][1] = _mm512_dpbf16_ps(acc[m][1], w1, xv);
  }
}

// MB rows of x (from ``x``, ``xs`` elements apart) against the 32 outputs of one packed group
// ``w``; their sums plus the bias, rounded, into y's rows (``ys`` apart) at outputs [n0, n0 + width).
template <int MB>
void group_rows(const uint16_t* w, int64_t K, const uint16_t* x, int64_t xs, bool prefetch, const __m512* bias,
                uint16_t* y, int64_t ys, int64_t n0, int64_t width) {
  // Few rows make few sums, each waiting on its last VDPBF16PS: alternate pairs of K go to
  // separate chains of sums (added up at the end) so that the multiplies overlap.
  constexpr int kChains = MB <= 2 ? 4 : MB <= 4 ? 2 : 1;
  __m512 chains[kChains][MB][2];
  for (int c = 0; c < kChains; ++c)
    for (int m = 0; m < MB; ++m) chains[c][m][0] = chains[c][m][1] = _mm512_setzero_ps();
  auto& acc = chains[0];
  const int64_t pairs = K / 2;  // whole pairs; an odd K's last value is a pair with a zero
  for (int64_t p0 = 0; p0 < pairs; p0 += kTileK / 2) {
    const uint16_t* tile = w + (p0 / (kTileK / 2)) * 2 * kTileElems;
    if (prefetch)
      for (int64_t line = 0; line < 2 * kTileElems * 2; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(reinterpret_cast<uintptr_t>(tile) + kAheadBytes + line), _MM_HINT_T1);
    const int64_t end = pairs - p0 < kTileK / 2 ? pairs - p0 : kTileK / 2;
    int64_t q = 0;
    for (; q + kChains <= end; q += kChains)
      for (int c = 0; c < kChains; ++c)
        add_pair<MB>(chains[c], (__m512bh)_mm512_loadu_si512(tile + (q + c) * kGroupN),
                     (__m512bh)_mm512_loadu_si512(tile + kTileElems + (q + c) * kGroupN), x, xs, 2 * (p0 + q + c), false);
    for (; q < end; ++q)
      add_pair<MB>(acc, (__m512bh)_mm512_loadu_si512(tile + q * kGroupN),
                   (__m512bh)_mm512_loadu_si512(tile + kTileElems + q * kGroupN), x, xs, 2 * (p0 + q), false);
  }
  for (int c = 1; c < kChains; ++c)
    for (int m = 0; m < MB; ++m)
      for (int h = 0; h < 2; ++h) acc[m][h] = _mm512_add_ps(acc[m][h], chains[c][m][h]);
  if (K % 2 != 0) {
    const int64_t p = pairs, q = p % (kTileK / 2);
    const uint16_t* tile = w + (p / (kTileK / 2)) * 2 * kTileElems;
    add_pair<MB>(acc, (__m512bh)_mm512_loadu_si512(tile + q * kGroupN), (__m512bh)_mm512_loadu_si512(tile + kTileElems + q * kGroupN),
                 x, xs, 2 * p, true);
  }
  for (int h = 0; h < 2; ++h) {
    const int64_t count = width - h * 16 < 16 ? width - h * 16 : 16;
    if (count <= 0) break;
    const __mmask16 mask = static_cast<__mmask16>((1u << count) - 1);
    for (int m = 0; m < MB; ++m) {
      const __m512 v = bias != nullptr ? _mm512_add_ps(acc[m][h], bias[h]) : acc[m][h];
      _mm256_mask_storeu_epi16(y + m * ys + n0 + h * 16, mask, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
    }
  }
}

using GroupRows = void (*)(const uint16_t*, int64_t, const uint16_t*, int64_t, bool, const __m512*, uint16_t*, int64_t,
                           int64_t, int64_t);

template <int... MB>
constexpr auto group_rows_table(std::integer_sequence<int, MB...>) {
  return std::array<GroupRows, sizeof...(MB)>{&group_rows<MB + 1>...};
}
#endif

at::Tensor vnni_linear(const at::Tensor& x, const at::Tensor& tiles, int64_t N, const c10::optional<at::Tensor>& bias) {
#if defined(KVMESH_VNNI_LINEAR)
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.device().is_cpu() && x.stride(1) == 1,
              "vnni_linear: x (M, K) bfloat16 on the CPU, rows contiguous");
  TORCH_CHECK(tiles.dim() == 2 && tiles.scalar_type() == at::kBFloat16 && tiles.is_contiguous(), "vnni_linear: tiles from amx_pack");
  const int64_t Np = tiles.size(0), Kp = tiles.size(1), M = x.size(0), K = x.size(1);
  TORCH_CHECK(Np % kGroupN == 0 && Kp % kTileK == 0 && N <= Np && N > Np - kGroupN && K <= Kp && K > Kp - kTileK,
              "vnni_linear: tiles (", Np, ", ", Kp, ") are not of a (", N, ", ", K, ") weight");
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "vnni_linear: bias (N)");
    b = bias->to(at::kBFloat16).contiguous();
  }
  auto y = at::empty({M, N}, x.options());
  if (M == 0) return y;
  static constexpr auto kernels = group_rows_table(std::make_integer_sequence<int, kMaxRows>{});
  const auto* xp = static_cast<const uint16_t*>(x.const_data_ptr());
  const auto* wp = static_cast<const uint16_t*>(tiles.const_data_ptr());
  const auto* bp = b.defined() ? static_cast<const uint16_t*>(b.const_data_ptr()) : nullptr;
  auto* yp = static_cast<uint16_t*>(y.data_ptr());
  const int64_t xs = x.stride(0), groups = Np / kGroupN;
  // the rows split evenly into passes of at most kMaxRows (16: 8 + 8, not 12 + 4)
  const int64_t passes = (M + kMaxRows - 1) / kMaxRows, pass_rows = (M + passes - 1) / passes;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t g = begin; g < end; ++g) {
      const int64_t n0 = g * kGroupN, width = N - n0 < kGroupN ? N - n0 : kGroupN;
      __m512 bias_v[2];
      for (int h = 0; h < 2 && bp != nullptr; ++h) {
        const int64_t count = width - h * 16 < 16 ? (width - h * 16 > 0 ? width - h * 16 : 0) : 16;
        const __mmask16 mask = static_cast<__mmask16>((1u << count) - 1);
        bias_v[h] = kvmesh::cpu::bf16x16_to_float(_mm256_maskz_loadu_epi16(mask, bp + n0 + h * 16));
      }
      const uint16_t* w = wp + g * kGroupN * Kp;
      for (int64_t m0 = 0; m0 < M; m0 += pass_rows) {
        const int64_t mb = M - m0 < pass_rows ? M - m0 : pass_rows;
        kernels[mb - 1](w, K, xp + m0 * xs, xs, m0 == 0, bp != nullptr ? bias_v : nullptr, yp + m0 * N, N, n0, width);
      }
    }
  });
  return y;
#else
  TORCH_CHECK(false, "vnni_linear: not built for this CPU (no AVX512-BF16)");
#endif
}

bool vnni_linear_available() {
#if defined(KVMESH_VNNI_LINEAR)
  return true;
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvmesh, m) {
  m.def("vnni_linear(Tensor x, Tensor tiles, int n, Tensor? bias) -> Tensor");
  m.def("vnni_linear_available() -> bool", &vnni_linear_available);
}

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) { m.impl("vnni_linear", &vnni_linear); }
