// y = x @ w.T (+ bias) in bfloat16 on AMX tiles, for the tens of rows of a decode step.
//
// At a few dozen rows a linear is still bound by reading its weight once from memory, but it
// is too many rows for vector dot products (small_linear.cpp: each weight vector serves at
// most four rows) and too few for oneDNN's AMX path, which leaves half the bandwidth unused
// there. Here the weight is repacked once (amx_pack) into the tiles AMX multiplies: for each
// 32 outputs, all of K as a run of 1 KiB tiles, so a task streams one contiguous range with
// software prefetch ahead. A task keeps 32 outputs' sums in four 16 x 16 float32 tiles and, per
// 32 values of K, loads two weight tiles and one or two tiles of x (16 rows each) and runs
// up to four tile multiplies (TDPBF16PS). More than 32 rows are done 32 at a time while the
// task's weight tiles are still in cache. Each output is its float32 sum plus the bias,
// rounded once to bfloat16 (round to nearest even), as oneDNN's is.
//
// Built only where the compiler targets AMX-BF16 (-march=native on a CPU that has it); Linux
// must also grant the process the tile state (arch_prctl), which kvmesh::amx_available()
// asks for once. Elsewhere the ops are not registered with an implementation and
// amx_available() is false.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <c10/util/Optional.h>
#include <torch/library.h>

#include <cstdint>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__AVX512BF16__)
#define KVMESH_AMX_LINEAR 1
#include <immintrin.h>
#include <sys/syscall.h>

#include "cpu_math.h"
#include <unistd.h>
#endif

namespace {

constexpr int64_t kTileK = 32;    // bfloat16 values of K in a tile's row
constexpr int64_t kTileN = 16;    // outputs in a weight tile
constexpr int64_t kGroupN = 32;   // outputs a task computes at once: two weight tiles
constexpr int64_t kTileRows = 16; // rows of x in a tile
constexpr int64_t kTileBytes = 1024;

#if defined(KVMESH_AMX_LINEAR)
constexpr int64_t kAheadBytes = 8192;  // how far ahead the weight stream is prefetched

struct alignas(64) TileConfig {  // the LDTILECFG layout, palette 1
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

bool request_tile_state() {
  constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
  return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
}

bool tiles_granted() {
  static const bool granted = request_tile_state();
  return granted;
}

// Tiles: 0, 1 the sums of x rows 0-15 for the group's outputs 0-15 and 16-31; 2, 3 those of
// rows 16-31; 4, 5 the two tiles of x; 6, 7 the two weight tiles. ``two``: 32 rows, else 16
// or fewer (as configured).
inline void group_sums(const char* w, int64_t k_tiles, const char* x, int64_t x_row_bytes, bool two, float* sums) {
  _tile_zero(0);
  _tile_zero(1);
  if (two) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t kt = 0; kt < k_tiles; ++kt) {
    const char* b = w + kt * 2 * kTileBytes;
    for (int64_t line = 0; line < 2 * kTileBytes; line += 64) _mm_prefetch(b + kAheadBytes + line, _MM_HINT_T0);
    _tile_loadd(6, b, 64);
    _tile_loadd(7, b + kTileBytes, 64);
    const char* a = x + kt * kTileK * 2;
    _tile_loadd(4, a, x_row_bytes);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (two) {
      _tile_loadd(5, a + kTileRows * x_row_bytes, x_row_bytes);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  constexpr int64_t row_bytes = kGroupN * 4;
  _tile_stored(0, sums, row_bytes);
  _tile_stored(1, sums + kTileN, row_bytes);
  if (two) {
    _tile_stored(2, sums + kTileRows * kGroupN, row_bytes);
    _tile_stored(3, sums + kTileRows * kGroupN + kTileN, row_bytes);
  }
}

// sums (rows, 32) plus the bias, rounded, into y's rows at outputs [n0, n0 + width).
inline void write_rows(const float* sums, int64_t rows, const uint16_t* bias, uint16_t* y, int64_t y_row, int64_t n0,
                       int64_t width) {
  for (int64_t h = 0; h < width; h += kTileN) {
    const int64_t count = width - h < kTileN ? width - h : kTileN;
    const __mmask16 mask = static_cast<__mmask16>((1u << count) - 1);
    const __m512 b = bias != nullptr ? kvmesh::cpu::bf16x16_to_float(_mm256_maskz_loadu_epi16(mask, bias + n0 + h)) : _mm512_setzero_ps();
    for (int64_t m = 0; m < rows; ++m) {
      const __m512 v = _mm512_add_ps(_mm512_load_ps(sums + m * kGroupN + h), b);
      _mm256_mask_storeu_epi16(y + m * y_row + n0 + h, mask, reinterpret_cast<__m256i>(_mm512_cvtneps_pbh(v)));
    }
  }
}
#endif

int64_t round_up(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

// w (N, K) -> its tiles: N and K padded with zeros to multiples of 32, then for each 32
// outputs, for each 32 of K, two 1 KiB tiles (outputs 0-15, 16-31), each 16 rows of K pairs
// by 16 outputs by the pair (the VNNI layout TDPBF16PS reads). Shape (N padded, K padded).
at::Tensor amx_pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kBFloat16 && w.device().is_cpu(), "amx_pack: w (N, K) bfloat16 on the CPU");
  const int64_t N = w.size(0), K = w.size(1), Np = round_up(N, kGroupN), Kp = round_up(K, kTileK);
  at::Tensor padded = w;
  if (Np != N || Kp != K) {
    padded = at::zeros({Np, Kp}, w.options());
    padded.narrow(0, 0, N).narrow(1, 0, K).copy_(w);
  }
  // (group, half, output, k tile, k pair, pair) -> (group, k tile, half, k pair, output, pair)
  return padded.reshape({Np / kGroupN, 2, kTileN, Kp / kTileK, kTileK / 2, 2})
      .permute({0, 3, 1, 4, 2, 5})
      .contiguous()
      .view({Np, Kp});
}

at::Tensor amx_linear(const at::Tensor& x_in, const at::Tensor& tiles, int64_t N, const c10::optional<at::Tensor>& bias) {
#if defined(KVMESH_AMX_LINEAR)
  TORCH_CHECK(tiles_granted(), "amx_linear: Linux did not grant this process the AMX tile state");
  TORCH_CHECK(x_in.dim() == 2 && x_in.scalar_type() == at::kBFloat16 && x_in.device().is_cpu(), "amx_linear: x (M, K) bfloat16 on the CPU");
  TORCH_CHECK(tiles.dim() == 2 && tiles.scalar_type() == at::kBFloat16 && tiles.is_contiguous(), "amx_linear: tiles from amx_pack");
  const int64_t Np = tiles.size(0), Kp = tiles.size(1), M = x_in.size(0), K = x_in.size(1);
  TORCH_CHECK(Np % kGroupN == 0 && Kp % kTileK == 0 && N <= Np && N > Np - kGroupN && K <= Kp && K > Kp - kTileK,
              "amx_linear: tiles (", Np, ", ", Kp, ") are not of a (", N, ", ", K, ") weight");
  at::Tensor b;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N, "amx_linear: bias (N)");
    b = bias->to(at::kBFloat16).contiguous();
  }
  auto y = at::empty({M, N}, x_in.options());
  if (M == 0) return y;
  // x as whole tiles: K padded with zeros, and more than 16 rows padded to a multiple of 16
  // (the padding rows' sums are not written); otherwise read where it lies.
  const int64_t Mp = M > kTileRows ? round_up(M, kTileRows) : M;
  at::Tensor x = x_in;
  if (Kp != K || Mp != M || x.stride(1) != 1) {
    x = at::zeros({Mp, Kp}, x_in.options());
    x.narrow(0, 0, M).narrow(1, 0, K).copy_(x_in);
  }
  const int64_t x_row_bytes = x.stride(0) * 2, k_tiles = Kp / kTileK, groups = Np / kGroupN;
  const auto* xp = static_cast<const char*>(x.const_data_ptr());
  const auto* wp = static_cast<const char*>(tiles.const_data_ptr());
  const auto* bp = b.defined() ? static_cast<const uint16_t*>(b.const_data_ptr()) : nullptr;
  auto* yp = static_cast<uint16_t*>(y.data_ptr());
  TileConfig config;
  const auto first_rows = static_cast<uint8_t>(Mp < kTileRows ? Mp : kTileRows);
  for (int t : {0, 1, 4}) config.rows[t] = first_rows;
  for (int t : {2, 3, 5, 6, 7}) config.rows[t] = kTileRows;
  for (int t = 0; t < 8; ++t) config.colsb[t] = 64;
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    _tile_loadconfig(&config);  // per thread: the tile configuration is thread state
    alignas(64) float sums[2 * kTileRows * kGroupN];
    for (int64_t g = begin; g < end; ++g) {
      const char* w = wp + g * kGroupN * Kp * 2;
      const int64_t n0 = g * kGroupN, width = N - n0 < kGroupN ? N - n0 : kGroupN;
      for (int64_t m0 = 0; m0 < M; m0 += 2 * kTileRows) {
        const bool two = Mp - m0 > kTileRows;
        group_sums(w, k_tiles, xp + m0 * x_row_bytes, x_row_bytes, two, sums);
        const int64_t rows = M - m0 < 2 * kTileRows ? M - m0 : 2 * kTileRows;
        write_rows(sums, rows, bp, yp + m0 * N, N, n0, width);
      }
    }
    _tile_release();
  });
  return y;
#else
  TORCH_CHECK(false, "amx_linear: not built for this CPU (no AMX-BF16)");
#endif
}

bool amx_available() {
#if defined(KVMESH_AMX_LINEAR)
  return tiles_granted();
#else
  return false;
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvmesh, m) {
  m.def("amx_pack(Tensor w) -> Tensor");
  m.def("amx_linear(Tensor x, Tensor tiles, int n, Tensor? bias) -> Tensor");
  m.def("amx_available() -> bool", &amx_available);
}

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) {
  m.impl("amx_pack", &amx_pack);
  m.impl("amx_linear", &amx_linear);
}
