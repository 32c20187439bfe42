// Attention of one sequence's prefill chunk, causal (to its earlier context and to itself) or
// to every key (a shared prefix's part of a grouped prefill), in bfloat16 for CPUs with
// AVX512-BF16 and in float32 for CPUs with AVX-512. Used where they have no AMX (bfloat16: there
// PyTorch's flash attention runs bfloat16 no faster than float32, while the linears run 2.4x
// faster; docs/benchmarks.md, "Issue 12 on an AMD EPYC Zen 4 without AMX"; both: "A float32
// prefill attention kernel, and both dtypes' kernel in tiles of rows").
//
// q (L, heads, dim), k and v (S, kv_heads, dim), S >= L when causal: the chunk's queries are the
// last L of the S positions (S - L tokens of earlier context, e.g. a cached prefix, then the
// chunk itself), and query row r attends to keys 0 .. S - L + r. Rows strided, the last dim
// contiguous.
//
// A task is a tile of R consecutive rows times the G query heads of one KV head (M = R * G query
// vectors, about 12: each K and V load serves all of them, as a matrix product's register tile
// does) with its mirror tile (tiles i and tiles-1-i: an even share of the causal triangle each).
// K is packed once a call so that q.k is one FMA (float32: a dim for 16 keys) or one vdpbf16ps
// (bfloat16: a pair of dims for 16 keys, products exact in float32, summed in float32) at a time,
// no horizontal sums; bfloat16's V is packed into pairs of keys for every dim (p.v one vdpbf16ps
// for two keys and 16 dims), float32's read in place. The keys go by in chunks of 256 with an
// online softmax in float32 (as flash attention: a tile's scores stay in L1, its sums are
// rescaled when a chunk raises a row's peak, and summed a chunk at a time); bfloat16's weights
// are rounded to bfloat16 for p.v (as a bfloat16 flash attention rounds them), the output once.
// prefill_attention_lse also gives each row's log-sum-exp.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <immintrin.h>

#include "cpu_math.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <tuple>
#include <type_traits>
#include <vector>

namespace {

#if defined(__AVX512F__)
#define KVMESH_PREFILL_ATTENTION_F32 1
#if defined(__AVX512BF16__)
#define KVMESH_PREFILL_ATTENTION 1
#endif

constexpr int64_t kKeys = 16;    // keys a score vector holds
constexpr int64_t kChunk = 256;  // keys a pass of the online softmax

// The largest of start and row[0 .. n) (a NaN score is passed over, as `x > high` does), 16 at a
// time: the scalar loop GCC leaves it as (no fast-math) was a tenth of a small chunk's time.
inline float row_peak(const float* row, int64_t n, float start) {
  __m512 high = _mm512_set1_ps(start);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) high = _mm512_max_ps(_mm512_loadu_ps(row + i), high);  // the second operand if either is NaN
  if (i < n) high = _mm512_mask_max_ps(high, (__mmask16)((1u << (n - i)) - 1), _mm512_maskz_loadu_ps((__mmask16)((1u << (n - i)) - 1), row + i), high);
  return _mm512_reduce_max_ps(high);
}

// q.k of M query vectors with NB blocks of 16 keys, scaled into scores[m * stride + b * 16 ..]:
// M * NB chains, each K load shared by the M vectors. float32: K blocks [dim][16 keys].
template <int64_t D, int64_t M, int64_t NB>
inline void score_blocks(const float* const* qrows, const float* kb, float scale, float* scores, int64_t stride) {
  __m512 acc[M][NB];
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < NB; ++b) acc[m][b] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    __m512 keys[NB];
    for (int64_t b = 0; b < NB; ++b) keys[b] = _mm512_loadu_ps(kb + (b * D + d) * kKeys);
    for (int64_t m = 0; m < M; ++m) {
      const __m512 qd = _mm512_set1_ps(qrows[m][d]);
      for (int64_t b = 0; b < NB; ++b) acc[m][b] = _mm512_fmadd_ps(qd, keys[b], acc[m][b]);
    }
  }
  const __m512 s = _mm512_set1_ps(scale);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < NB; ++b) _mm512_storeu_ps(scores + m * stride + b * kKeys, _mm512_mul_ps(acc[m][b], s));
}

// sums[m] = sums[m] * alpha[m] + acc[m]: a chunk's p.v into the rows' sums, the chunks before
// rescaled (their softmax's shift moved).
template <int64_t M, int64_t CV>
inline void add_chunk(const __m512 (&acc)[M][CV], const float* alpha, float* sums, int64_t sums_stride) {
  for (int64_t m = 0; m < M; ++m) {
    const __m512 a = _mm512_set1_ps(alpha[m]);
    for (int64_t c = 0; c < CV; ++c) {
      float* sum = sums + m * sums_stride + c * 16;
      _mm512_storeu_ps(sum, _mm512_fmadd_ps(_mm512_loadu_ps(sum), a, acc[m][c]));
    }
  }
}

// p.v of M weight rows with CV vectors of 16 dims, for the n keys of a chunk (float32: V rows
// read in place), then added to sums[m] (the chunks before, times alpha[m]: their softmax's
// shift moved). A sum a chunk: no chain of FMAs runs over thousands of keys (one did: 1.4x flash
// attention's mean error).
template <int64_t M, int64_t CV>
inline void weigh_values(const float* weights, const float* values, int64_t value_stride, int64_t n, const float* alpha,
                         float* sums, int64_t sums_stride) {
  __m512 acc[M][CV];
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = 0; c < CV; ++c) acc[m][c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    __m512 vals[CV];
    for (int64_t c = 0; c < CV; ++c) vals[c] = _mm512_loadu_ps(values + i * value_stride + c * 16);
    for (int64_t m = 0; m < M; ++m) {
      const __m512 w = _mm512_set1_ps(weights[m * kChunk + i]);
      for (int64_t c = 0; c < CV; ++c) acc[m][c] = _mm512_fmadd_ps(w, vals[c], acc[m][c]);
    }
  }
  add_chunk(acc, alpha, sums, sums_stride);
}

#ifdef KVMESH_PREFILL_ATTENTION
inline int32_t pair_at(const uint16_t* x) {  // two bfloat16s as one 32-bit lane
  int32_t pair;
  std::memcpy(&pair, x, sizeof(pair));
  return pair;
}

// bfloat16: K blocks [pair of dims][16 keys][2].
template <int64_t D, int64_t M, int64_t NB>
inline void score_blocks(const uint16_t* const* qrows, const uint16_t* kb, float scale, float* scores, int64_t stride) {
  __m512 acc[M][NB];
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < NB; ++b) acc[m][b] = _mm512_setzero_ps();
  for (int64_t p = 0; p < D / 2; ++p) {
    __m512i keys[NB];
    for (int64_t b = 0; b < NB; ++b) keys[b] = _mm512_loadu_si512(kb + (b * D / 2 + p) * kKeys * 2);
    for (int64_t m = 0; m < M; ++m) {
      const __m512bh qp = (__m512bh)_mm512_set1_epi32(pair_at(qrows[m] + 2 * p));
      for (int64_t b = 0; b < NB; ++b) acc[m][b] = _mm512_dpbf16_ps(acc[m][b], qp, (__m512bh)keys[b]);
    }
  }
  const __m512 s = _mm512_set1_ps(scale);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < NB; ++b) _mm512_storeu_ps(scores + m * stride + b * kKeys, _mm512_mul_ps(acc[m][b], s));
}

// bfloat16: V packed [pair of keys][dim][2] from the chunk's first key (n rounded up to a pair:
// the weight of a key past the chunk's last is 0), the weights rounded to bfloat16.
template <int64_t M, int64_t CV>
inline void weigh_values(const uint16_t* weights, const uint16_t* values, int64_t value_stride, int64_t n, const float* alpha,
                         float* sums, int64_t sums_stride) {
  __m512 acc[M][CV];
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = 0; c < CV; ++c) acc[m][c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < (n + 1) / 2; ++i) {
    __m512i vals[CV];
    for (int64_t c = 0; c < CV; ++c) vals[c] = _mm512_loadu_si512(values + i * value_stride + c * 32);
    for (int64_t m = 0; m < M; ++m) {
      const __m512bh w = (__m512bh)_mm512_set1_epi32(pair_at(weights + m * kChunk + 2 * i));
      for (int64_t c = 0; c < CV; ++c) acc[m][c] = _mm512_dpbf16_ps(acc[m][c], w, (__m512bh)vals[c]);
    }
  }
  add_chunk(acc, alpha, sums, sums_stride);
}
#endif

// T: float (float32) or uint16_t (bfloat16's bits). causal: row r attends to keys 0 .. S - L + r;
// otherwise to all S. lse, where given, (L, heads) float32: each row's log-sum-exp of its scaled
// scores, to merge with attention over other keys.
template <typename T, int64_t D, int64_t G>
void attend_tiles(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale_, bool causal, at::Tensor& out,
                  float* lse) {
  static_assert(D % 32 == 0, "D: a multiple of 32");
  constexpr bool kBf16 = std::is_same_v<T, uint16_t>;
  constexpr int64_t kVecs = D / 16;
  constexpr int64_t R = G >= 6 ? 1 : G >= 3 ? 12 / G : G == 2 ? 6 : 8;  // rows a tile: about 12 query vectors
  constexpr int64_t M = R * G, NB = M <= 12 ? 2 : 1;
  constexpr int64_t CV = 24 / M >= 4 ? 4 : 24 / M >= 2 ? 2 : 1;  // V vectors a p.v pass (kVecs is a multiple)
  const int64_t len = q.size(0), keys_len = k.size(0), offset = keys_len - len, heads = q.size(1), kv_heads = k.size(1);
  const int64_t key_blocks = (keys_len + kKeys - 1) / kKeys, block_size = D * kKeys;  // a K block's elements
  const float scale = static_cast<float>(scale_);
  const auto* qp = static_cast<const T*>(q.const_data_ptr());
  const auto* kp = static_cast<const T*>(k.const_data_ptr());
  const auto* vp = static_cast<const T*>(v.const_data_ptr());
  auto* op = static_cast<T*>(out.data_ptr());
  const int64_t qs = q.stride(0), qh = q.stride(1), ks = k.stride(0), kh = k.stride(1), vs = v.stride(0), vh = v.stride(1);

  // K: [kv head][key block][dim][16 keys] (bfloat16: [pair of dims][16 keys][2]); bfloat16's V:
  // [kv head][pair of keys][dim][2]. The keys past the last are zeros (never weighed).
  std::vector<T> kpack(kv_heads * key_blocks * block_size), vpack(kBf16 ? kv_heads * key_blocks * block_size : 0);
  at::parallel_for(0, kv_heads * key_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t h = t / key_blocks, block = t % key_blocks;
      T* kd = kpack.data() + t * block_size;  // (the vectors start zeroed: a missing key is left so)
      for (int64_t j = 0; j < kKeys && block * kKeys + j < keys_len; ++j) {
        const T* row = kp + (block * kKeys + j) * ks + h * kh;
        if constexpr (kBf16) {  // a pair of dims at a time: one 32-bit copy, not two 16-bit ones
          for (int64_t p = 0; p < D / 2; ++p) std::memcpy(kd + (p * kKeys + j) * 2, row + 2 * p, 2 * sizeof(T));
        } else {
          for (int64_t d = 0; d < D; ++d) kd[d * kKeys + j] = row[d];
        }
      }
      if constexpr (kBf16) {  // two keys' rows interleaved 16 dims at a time (a scalar loop was most of a small chunk's time)
        for (int64_t key = block * kKeys; key < std::min(keys_len, (block + 1) * kKeys); key += 2) {
          const T* first = vp + key * vs + h * vh;
          const T* second = key + 1 < keys_len ? first + vs : nullptr;
          T* vd = vpack.data() + (h * key_blocks * kKeys + key) * D;
          for (int64_t c = 0; c < D / 16; ++c) {
            const __m512i low = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(first + c * 16)));
            const __m512i high = second != nullptr
                                     ? _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(second + c * 16)))
                                     : _mm512_setzero_si512();
            _mm512_storeu_si512(vd + c * 32, _mm512_or_si512(low, _mm512_slli_epi32(high, 16)));
          }
        }
      }
    }
  });

  const int64_t tiles = (len + R - 1) / R, halves = (tiles + 1) / 2;
  at::parallel_for(0, halves * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(M * kChunk), sums(M * D);
    std::vector<T> weights(kBf16 ? M * kChunk : 0);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t h = t % kv_heads, half = t / kv_heads;
      const int64_t pair[2] = {half, tiles - 1 - half};
      for (int64_t n = 0; n < (pair[1] == pair[0] ? 1 : 2); ++n) {  // an odd count's middle tile once
        const int64_t first = pair[n] * R;
        const T* qrows[M];
        int64_t context[M];
        int64_t widest = 0;
        for (int64_t j = 0; j < R; ++j) {
          const int64_t r = std::min(first + j, len - 1);  // past the end: the last row again, not written
          for (int64_t g = 0; g < G; ++g) {
            qrows[j * G + g] = qp + r * qs + (h * G + g) * qh;
            context[j * G + g] = causal ? offset + r + 1 : keys_len;
          }
          widest = std::max(widest, causal ? offset + r + 1 : keys_len);
        }
        float peak[M], total[M], alpha[M];
        for (int64_t m = 0; m < M; ++m) peak[m] = -std::numeric_limits<float>::infinity(), total[m] = 0.f;
        std::fill(sums.begin(), sums.end(), 0.f);
        const T* kbase = kpack.data() + h * key_blocks * block_size;
        for (int64_t start = 0; start < widest; start += kChunk) {
          const int64_t stop = std::min(widest, start + kChunk), blocks = (stop - start + kKeys - 1) / kKeys;
          const T* kchunk = kbase + start / kKeys * block_size;
          int64_t block = 0;
          for (; block + NB <= blocks; block += NB)
            score_blocks<D, M, NB>(qrows, kchunk + block * block_size, scale, scores.data() + block * kKeys, kChunk);
          for (; block < blocks; ++block)
            score_blocks<D, M, 1>(qrows, kchunk + block * block_size, scale, scores.data() + block * kKeys, kChunk);
          for (int64_t m = 0; m < M; ++m) {
            float* row = scores.data() + m * kChunk;
            const int64_t seen = std::max<int64_t>(0, std::min(context[m], stop) - start);  // keys of this chunk it attends to
            const float high = row_peak(row, seen, peak[m]);
            alpha[m] = high == peak[m] ? 1.f : std::exp(peak[m] - high);  // the first chunk: exp(-inf) = 0
            total[m] = total[m] * alpha[m] + (seen > 0 ? kvmesh::cpu::exp_shifted(row, seen, high) : 0.f);
            peak[m] = high;
            for (int64_t i = seen; i < blocks * kKeys; ++i) row[i] = 0.f;  // the keys after its row weigh nothing
            if constexpr (kBf16) {
              for (int64_t i = 0; i < blocks * kKeys; i += kKeys) {
                const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_loadu_ps(row + i));
                _mm256_storeu_si256(reinterpret_cast<__m256i*>(weights.data() + m * kChunk + i), (__m256i)rounded);
              }
            }
          }
          for (int64_t c = 0; c < kVecs; c += CV) {
            if constexpr (kBf16)
              weigh_values<M, CV>(weights.data(), vpack.data() + (h * key_blocks * kKeys + start) * D + c * 32, 2 * D,
                                  stop - start, alpha, sums.data() + c * 16, D);
            else
              weigh_values<M, CV>(scores.data(), vp + start * vs + h * vh + c * 16, vs, stop - start, alpha,
                                  sums.data() + c * 16, D);
          }
        }
        for (int64_t m = 0; m < M; ++m) {
          const int64_t r = first + m / G, g = m % G;
          if (r >= len) continue;  // a row past the chunk's end
          const __m512 norm = _mm512_set1_ps(1.f / total[m]);
          T* dst = op + (r * heads + h * G + g) * D;
          for (int64_t c = 0; c < kVecs; ++c) {
            const __m512 x = _mm512_mul_ps(_mm512_loadu_ps(sums.data() + m * D + c * 16), norm);
            if constexpr (kBf16)
              _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c * 16), (__m256i)_mm512_cvtneps_pbh(x));
            else
              _mm512_storeu_ps(dst + c * 16, x);
          }
          if (lse != nullptr) lse[r * heads + h * G + g] = peak[m] + std::log(total[m]);
        }
      }
    }
  });
}

template <typename T, int64_t D>
bool attend_groups(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale, bool causal, at::Tensor& out,
                   float* lse) {
  switch (q.size(1) / k.size(1)) {
    case 1: attend_tiles<T, D, 1>(q, k, v, scale, causal, out, lse); return true;
    case 2: attend_tiles<T, D, 2>(q, k, v, scale, causal, out, lse); return true;
    case 3: attend_tiles<T, D, 3>(q, k, v, scale, causal, out, lse); return true;
    case 4: attend_tiles<T, D, 4>(q, k, v, scale, causal, out, lse); return true;
    case 5: attend_tiles<T, D, 5>(q, k, v, scale, causal, out, lse); return true;
    case 6: attend_tiles<T, D, 6>(q, k, v, scale, causal, out, lse); return true;
    case 7: attend_tiles<T, D, 7>(q, k, v, scale, causal, out, lse); return true;
    case 8: attend_tiles<T, D, 8>(q, k, v, scale, causal, out, lse); return true;
    default: return false;
  }
}
#endif

// Whether this build has the kernel for "bfloat16" (AVX512-BF16) or "float32" (AVX-512), for
// the model to choose it.
bool prefill_attention_built(const std::string& dtype) {
#ifdef KVMESH_PREFILL_ATTENTION
  if (dtype == "bfloat16") return true;
#endif
#ifdef KVMESH_PREFILL_ATTENTION_F32
  if (dtype == "float32") return true;
#endif
  return false;
}

void check_inputs(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, bool causal) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3, "prefill_attention: bad ranks");
  TORCH_CHECK((q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat) && k.scalar_type() == q.scalar_type() &&
                  v.scalar_type() == q.scalar_type(),
              "prefill_attention: bfloat16 or float32 only, the same for q, k and v");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1 && v.stride(2) == 1, "prefill_attention: dim not contiguous");
  TORCH_CHECK(k.sizes() == v.sizes() && (q.size(0) <= k.size(0) || !causal) && q.size(2) == k.size(2) && k.size(1) > 0 &&
                  q.size(1) % k.size(1) == 0,
              "prefill_attention: shapes");
}

// Into out (and lse, where not null); false: no kernel for this dtype, head dim or group in this build.
bool attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale, bool causal, at::Tensor& out,
            float* lse) {
#ifdef KVMESH_PREFILL_ATTENTION
  if (q.scalar_type() == at::kBFloat16 && q.size(2) == 64) return attend_groups<uint16_t, 64>(q, k, v, scale, causal, out, lse);
  if (q.scalar_type() == at::kBFloat16 && q.size(2) == 128) return attend_groups<uint16_t, 128>(q, k, v, scale, causal, out, lse);
#endif
#ifdef KVMESH_PREFILL_ATTENTION_F32
  if (q.scalar_type() == at::kFloat && q.size(2) == 64) return attend_groups<float, 64>(q, k, v, scale, causal, out, lse);
  if (q.scalar_type() == at::kFloat && q.size(2) == 128) return attend_groups<float, 128>(q, k, v, scale, causal, out, lse);
#endif
  return false;
}

// out (L, heads, dim) in q's dtype, contiguous: each query row attends to the keys up to its own
// position (row r is at position S - L + r).
at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale) {
  check_inputs(q, k, v, true);
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  if (q.size(0) == 0) return out;
  TORCH_CHECK(attend(q, k, v, scale, true, out, nullptr), "prefill_attention: no kernel for this head dim or group in this build");
  return out;
}

// (out, lse (L, heads) float32): causal as prefill_attention, or every row to every key.
std::tuple<at::Tensor, at::Tensor> prefill_attention_lse(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                                         double scale, bool causal) {
  check_inputs(q, k, v, causal);
  TORCH_CHECK(k.size(0) > 0, "prefill_attention: no keys");
  at::Tensor out = at::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  at::Tensor lse = at::empty({q.size(0), q.size(1)}, q.options().dtype(at::kFloat));
  if (q.size(0) == 0) return {out, lse};
  TORCH_CHECK(attend(q, k, v, scale, causal, out, lse.data_ptr<float>()),
              "prefill_attention: no kernel for this head dim or group in this build");
  return {out, lse};
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvmesh, m) {
  m.def("prefill_attention(Tensor q, Tensor k, Tensor v, float scale) -> Tensor");
  m.def("prefill_attention_lse(Tensor q, Tensor k, Tensor v, float scale, bool causal) -> (Tensor, Tensor)");
  m.def("prefill_attention_built(str dtype) -> bool", &prefill_attention_built);
}

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) {
  m.impl("prefill_attention", &prefill_attention);
  m.impl("prefill_attention_lse", &prefill_attention_lse);
}
