// Causal attention of one sequence's prefill chunk in bfloat16, for CPUs with AVX512-BF16
// (used where they have no AMX: there PyTorch's flash attention runs bfloat16 no faster than
// float32, while the linears run 2.4x faster; docs/benchmarks.md, "Issue 12 on an AMD EPYC
// Zen 4 without AMX"), and in float32 for CPUs with AVX-512 (attend_f32, after the bfloat16
// kernel: the same tasks and softmax, plain float32 FMAs; docs/benchmarks.md, "A float32
// prefill attention kernel").
//
// q (L, heads, dim), k and v (S, kv_heads, dim), S >= L: the chunk's queries are the last L of
// the S positions (S - L tokens of earlier context, e.g. a cached prefix, then the chunk
// itself), and query row r attends to keys 0 .. S - L + r. Rows strided, the last dim
// contiguous. K is
// packed once a call into pairs of dims for 16 keys at a time and V into pairs of keys for
// every dim, so that q.k and p.v are both vdpbf16ps (bf16 products exact in float32, summed in
// float32): 16 scores from 32 instructions for a 64-dim head, no horizontal sums, and the query
// heads sharing a KV head share each load. Softmax in float32 over a row's scores (two passes:
// one row's scores are at most L floats); the weights are rounded to bfloat16 for p.v (as a
// bfloat16 flash attention rounds them), the output once. prefill_attention_lse also gives each
// row's log-sum-exp, and attends every row to every key where asked (a shared prefix's part of
// a grouped prefill, merged with the chunk's own part by the two log-sum-exps).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <torch/library.h>

#include <immintrin.h>

#include "cpu_math.h"

#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <limits>
#include <string>
#include <tuple>
#include <vector>

namespace {

#if defined(__AVX512F__) && defined(__AVX512BF16__)
#define KVMESH_PREFILL_ATTENTION 1

constexpr int64_t kKeys = 16;  // keys a score vector holds

// causal: row r attends to keys 0 .. S - L + r; otherwise to all S (the queries after the keys,
// as a shared prefix's are). lse, where given, (L, heads) float32: each row's log-sum-exp of
// its scaled scores, to merge with attention over other keys.
template <int64_t D, int64_t G>
void attend_bf16(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale_, bool causal, at::Tensor& out,
                 float* lse) {
  static_assert(D % 32 == 0, "D: a multiple of 32");
  constexpr int64_t kPairs = D / 2, kVecs = D / 16;
  const int64_t len = q.size(0), keys_len = k.size(0), offset = keys_len - len, heads = q.size(1), kv_heads = k.size(1);
  const int64_t key_blocks = (keys_len + kKeys - 1) / kKeys, key_pairs = key_blocks * kKeys / 2;
  const float scale = static_cast<float>(scale_);
  const auto* qp = static_cast<const uint16_t*>(q.const_data_ptr());
  const auto* kp = static_cast<const uint16_t*>(k.const_data_ptr());
  const auto* vp = static_cast<const uint16_t*>(v.const_data_ptr());
  auto* op = static_cast<uint16_t*>(out.data_ptr());
  const int64_t qs = q.stride(0), qh = q.stride(1), ks = k.stride(0), kh = k.stride(1), vs = v.stride(0), vh = v.stride(1);

  // K: [kv head][key block][pair of dims][16 keys][2]; V: [kv head][pair of keys][dim][2]; the
  // keys past the last padded with zeros (their scores are never read, their weights are 0).
  std::vector<uint16_t> kpack(kv_heads * key_blocks * kPairs * kKeys * 2), vpack(kv_heads * key_pairs * D * 2);
  at::parallel_for(0, kv_heads * key_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t h = t / key_blocks, block = t % key_blocks;
      uint16_t* kd = kpack.data() + t * kPairs * kKeys * 2;
      for (int64_t j = 0; j < kKeys; ++j) {
        const int64_t key = block * kKeys + j;
        const uint16_t* row = key < keys_len ? kp + key * ks + h * kh : nullptr;
        for (int64_t p = 0; p < kPairs; ++p) {
          kd[(p * kKeys + j) * 2] = row != nullptr ? row[2 * p] : 0;
          kd[(p * kKeys + j) * 2 + 1] = row != nullptr ? row[2 * p + 1] : 0;
        }
      }
      for (int64_t i = block * kKeys / 2; i < (block + 1) * kKeys / 2; ++i) {
        uint16_t* vd = vpack.data() + (h * key_pairs + i) * D * 2;
        const uint16_t* first = 2 * i < keys_len ? vp + 2 * i * vs + h * vh : nullptr;
        const uint16_t* second = 2 * i + 1 < keys_len ? vp + (2 * i + 1) * vs + h * vh : nullptr;
        for (int64_t d = 0; d < D; ++d) {
          vd[2 * d] = first != nullptr ? first[d] : 0;
          vd[2 * d + 1] = second != nullptr ? second[d] : 0;
        }
      }
    }
  });

  // Tasks: (row r and row len-1-r, KV head): causal, a pair's keys are 2 * offset + len + 1
  // whichever pair, so each thread's share of the triangle is even under OpenMP's static split.
  const int64_t halves = (len + 1) / 2;
  at::parallel_for(0, halves * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(G * key_blocks * kKeys);
    std::vector<uint16_t> weights(G * key_blocks * kKeys);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t h = t % kv_heads, half = t / kv_heads;
      const int64_t rows[2] = {half, len - 1 - half};
      for (int64_t n = 0; n < (rows[1] == rows[0] ? 1 : 2); ++n) {  // an odd length's middle row once
        const int64_t r = rows[n];
        const int64_t context = causal ? offset + r + 1 : keys_len, blocks = (context + kKeys - 1) / kKeys, padded = blocks * kKeys;
        int32_t qpairs[G][kPairs];
        for (int64_t g = 0; g < G; ++g) std::memcpy(qpairs[g], qp + r * qs + (h * G + g) * qh, D * sizeof(uint16_t));
        const uint16_t* kbase = kpack.data() + h * key_blocks * kPairs * kKeys * 2;
        for (int64_t block = 0; block < blocks; ++block) {
          __m512 acc[G];
          for (int64_t g = 0; g < G; ++g) acc[g] = _mm512_setzero_ps();
          const uint16_t* kb = kbase + block * kPairs * kKeys * 2;
          for (int64_t p = 0; p < kPairs; ++p) {
            const __m512i keys = _mm512_loadu_si512(kb + p * kKeys * 2);
            for (int64_t g = 0; g < G; ++g)
              acc[g] = _mm512_dpbf16_ps(acc[g], (__m512bh)_mm512_set1_epi32(qpairs[g][p]), (__m512bh)keys);
          }
          const __m512 s = _mm512_set1_ps(scale);
          for (int64_t g = 0; g < G; ++g) _mm512_storeu_ps(scores.data() + g * padded + block * kKeys, _mm512_mul_ps(acc[g], s));
        }
        float inv[G];
        for (int64_t g = 0; g < G; ++g) {
          float* row = scores.data() + g * padded;
          float peak = -std::numeric_limits<float>::infinity();
          for (int64_t i = 0; i < context; ++i) peak = row[i] > peak ? row[i] : peak;
          const float total = kvmesh::cpu::exp_shifted(row, context, peak);
          inv[g] = 1.f / total;
          if (lse != nullptr) lse[r * heads + h * G + g] = peak + std::log(total);
          for (int64_t i = context; i < padded; ++i) row[i] = 0.f;  // the keys after r weigh nothing
          uint16_t* w = weights.data() + g * padded;
          for (int64_t i = 0; i < padded; i += kKeys) {
            const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_loadu_ps(row + i));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(w + i), (__m256i)rounded);
          }
        }
        __m512 acc[G][kVecs];
        for (int64_t g = 0; g < G; ++g)
          for (int64_t c = 0; c < kVecs; ++c) acc[g][c] = _mm512_setzero_ps();
        const uint16_t* vbase = vpack.data() + h * key_pairs * D * 2;
        for (int64_t i = 0; i < (context + 1) / 2; ++i) {
          __m512i vals[kVecs];
          for (int64_t c = 0; c < kVecs; ++c) vals[c] = _mm512_loadu_si512(vbase + (i * D + c * 16) * 2);
          for (int64_t g = 0; g < G; ++g) {
            int32_t pair;
            std::memcpy(&pair, weights.data() + g * padded + 2 * i, sizeof(pair));
            const __m512bh w = (__m512bh)_mm512_set1_epi32(pair);
            for (int64_t c = 0; c < kVecs; ++c) acc[g][c] = _mm512_dpbf16_ps(acc[g][c], w, (__m512bh)vals[c]);
          }
        }
        for (int64_t g = 0; g < G; ++g) {
          uint16_t* dst = op + (r * heads + h * G + g) * D;
          const __m512 norm = _mm512_set1_ps(inv[g]);
          for (int64_t c = 0; c < kVecs; ++c) {
            const __m256bh rounded = _mm512_cvtneps_pbh(_mm512_mul_ps(acc[g][c], norm));
            _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + c * 16), (__m256i)rounded);
          }
        }
      }
    }
  });
}

#define KVMESH_GROUP_CASES(D)                                                       \
  switch (q.size(1) / k.size(1)) {                                                  \
    case 1: attend_bf16<D, 1>(q, k, v, scale, causal, out, lse); return true;       \
    case 2: attend_bf16<D, 2>(q, k, v, scale, causal, out, lse); return true;       \
    case 3: attend_bf16<D, 3>(q, k, v, scale, causal, out, lse); return true;       \
    case 4: attend_bf16<D, 4>(q, k, v, scale, causal, out, lse); return true;       \
    case 5: attend_bf16<D, 5>(q, k, v, scale, causal, out, lse); return true;       \
    case 6: attend_bf16<D, 6>(q, k, v, scale, causal, out, lse); return true;       \
    case 7: attend_bf16<D, 7>(q, k, v, scale, causal, out, lse); return true;       \
    case 8: attend_bf16<D, 8>(q, k, v, scale, causal, out, lse); return true;       \
    default: break;                                                                 \
  }
#endif

#if defined(__AVX512F__)
#define KVMESH_PREFILL_ATTENTION_F32 1

constexpr int64_t kKeysF32 = 16;  // keys a score vector holds

// q.k of M query vectors (a tile's rows times the query heads of one KV head) with NB blocks of
// 16 keys (K packed [dim][16 keys] a block): M * NB chains of FMAs, each K load shared by the M
// vectors, each query element broadcast once for the NB blocks; the scores scaled into
// scores[m * stride + b * 16 ..].
template <int64_t D, int64_t M, int64_t NB>
inline void score_blocks_f32(const float* const* qrows, const float* kb, float scale, float* scores, int64_t stride) {
  __m512 acc[M][NB];
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < NB; ++b) acc[m][b] = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; ++d) {
    __m512 keys[NB];
    for (int64_t b = 0; b < NB; ++b) keys[b] = _mm512_loadu_ps(kb + (b * D + d) * kKeysF32);
    for (int64_t m = 0; m < M; ++m) {
      const __m512 qd = _mm512_set1_ps(qrows[m][d]);
      for (int64_t b = 0; b < NB; ++b) acc[m][b] = _mm512_fmadd_ps(qd, keys[b], acc[m][b]);
    }
  }
  const __m512 s = _mm512_set1_ps(scale);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t b = 0; b < NB; ++b) _mm512_storeu_ps(scores + m * stride + b * kKeysF32, _mm512_mul_ps(acc[m][b], s));
}

// p.v of M weight rows with CV vectors of 16 dims of V (rows read in place), for keys 0 .. n of
// a chunk: M * CV accumulators in registers, each V load shared by the M rows, then added to
// sums[m] (the chunks before, times alpha[m]: their softmax's shift moved). A sum a chunk, so
// no chain of FMAs runs over thousands of keys (measured: 1.4x flash attention's mean error).
template <int64_t M, int64_t CV>
inline void weigh_values_f32(const float* weights, int64_t stride, const float* values, int64_t value_stride, int64_t n,
                             const float* alpha, float* sums, int64_t sums_stride) {
  __m512 acc[M][CV];
  for (int64_t m = 0; m < M; ++m)
    for (int64_t c = 0; c < CV; ++c) acc[m][c] = _mm512_setzero_ps();
  for (int64_t i = 0; i < n; ++i) {
    __m512 vals[CV];
    for (int64_t c = 0; c < CV; ++c) vals[c] = _mm512_loadu_ps(values + i * value_stride + c * 16);
    for (int64_t m = 0; m < M; ++m) {
      const __m512 w = _mm512_set1_ps(weights[m * stride + i]);
      for (int64_t c = 0; c < CV; ++c) acc[m][c] = _mm512_fmadd_ps(w, vals[c], acc[m][c]);
    }
  }
  for (int64_t m = 0; m < M; ++m) {
    const __m512 a = _mm512_set1_ps(alpha[m]);
    for (int64_t c = 0; c < CV; ++c) {
      float* sum = sums + m * sums_stride + c * 16;
      _mm512_storeu_ps(sum, _mm512_fmadd_ps(_mm512_loadu_ps(sum), a, acc[m][c]));
    }
  }
}

// As attend_bf16 in float32, a tile of R consecutive rows at a time (so each K and V load serves
// R * G query vectors, as a matrix product's register tile does) and the keys in chunks of
// kChunk with an online softmax (as flash attention: a tile's scores stay in L1, its outputs
// are rescaled when a chunk raises a row's peak): K packed once a call into [dim][16 keys]
// blocks (q.k is one FMA a dim for 16 keys, no horizontal sums), V read in place (p.v one FMA a
// key for 16 dims), the softmax's weights kept in float32; a row's keys after its own position
// weigh 0.
template <int64_t D, int64_t G>
void attend_f32(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale_, bool causal, at::Tensor& out,
                float* lse) {
  static_assert(D % 32 == 0, "D: a multiple of 32");
  constexpr int64_t kVecs = D / 16, kChunk = 256;
  constexpr int64_t R = G >= 6 ? 1 : G >= 3 ? 12 / G : G == 2 ? 6 : 8;  // rows a tile: about 12 query vectors
  constexpr int64_t M = R * G, NB = M <= 12 ? 2 : 1;
  constexpr int64_t CV = 24 / M >= 4 ? 4 : 24 / M >= 2 ? 2 : 1;  // V vectors a p.v pass (kVecs is a multiple)
  const int64_t len = q.size(0), keys_len = k.size(0), offset = keys_len - len, heads = q.size(1), kv_heads = k.size(1);
  const int64_t key_blocks = (keys_len + kKeysF32 - 1) / kKeysF32;
  const float scale = static_cast<float>(scale_);
  const float* qp = q.const_data_ptr<float>();
  const float* kp = k.const_data_ptr<float>();
  const float* vp = v.const_data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t qs = q.stride(0), qh = q.stride(1), ks = k.stride(0), kh = k.stride(1), vs = v.stride(0), vh = v.stride(1);

  // K: [kv head][key block][dim][16 keys], the keys past the last zeros (their scores are never read).
  std::vector<float> kpack(kv_heads * key_blocks * D * kKeysF32);
  at::parallel_for(0, kv_heads * key_blocks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const int64_t h = t / key_blocks, block = t % key_blocks;
      float* kd = kpack.data() + t * D * kKeysF32;
      for (int64_t j = 0; j < kKeysF32; ++j) {
        const int64_t key = block * kKeysF32 + j;
        const float* row = key < keys_len ? kp + key * ks + h * kh : nullptr;
        for (int64_t d = 0; d < D; ++d) kd[d * kKeysF32 + j] = row != nullptr ? row[d] : 0.f;
      }
    }
  });

  // Tasks: (tile i and tile tiles-1-i, KV head), an even share of the causal triangle each, as
  // attend_bf16's mirror rows.
  const int64_t tiles = (len + R - 1) / R, halves = (tiles + 1) / 2;
  at::parallel_for(0, halves * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores(M * kChunk), sums(M * D);
    for (int64_t t = begin; t < end; ++t) {
      const int64_t h = t % kv_heads, half = t / kv_heads;
      const int64_t pair[2] = {half, tiles - 1 - half};
      for (int64_t n = 0; n < (pair[1] == pair[0] ? 1 : 2); ++n) {  // an odd count's middle tile once
        const int64_t first = pair[n] * R;
        const float* qrows[M];
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
        const float* kbase = kpack.data() + h * key_blocks * D * kKeysF32;
        for (int64_t start = 0; start < widest; start += kChunk) {
          const int64_t stop = std::min(widest, start + kChunk), blocks = (stop - start + kKeysF32 - 1) / kKeysF32;
          const float* kchunk = kbase + start / kKeysF32 * D * kKeysF32;
          int64_t block = 0;
          for (; block + NB <= blocks; block += NB)
            score_blocks_f32<D, M, NB>(qrows, kchunk + block * D * kKeysF32, scale, scores.data() + block * kKeysF32, kChunk);
          for (; block < blocks; ++block)
            score_blocks_f32<D, M, 1>(qrows, kchunk + block * D * kKeysF32, scale, scores.data() + block * kKeysF32, kChunk);
          for (int64_t m = 0; m < M; ++m) {
            float* row = scores.data() + m * kChunk;
            const int64_t seen = std::max<int64_t>(0, std::min(context[m], stop) - start);  // keys of this chunk it attends to
            float high = peak[m];
            for (int64_t i = 0; i < seen; ++i) high = row[i] > high ? row[i] : high;
            alpha[m] = high == peak[m] ? 1.f : std::exp(peak[m] - high);  // the first chunk: exp(-inf) = 0
            total[m] = total[m] * alpha[m] + (seen > 0 ? kvmesh::cpu::exp_shifted(row, seen, high) : 0.f);
            peak[m] = high;
            for (int64_t i = seen; i < stop - start; ++i) row[i] = 0.f;  // the keys after its row weigh nothing
          }
          for (int64_t c = 0; c < kVecs; c += CV)
            weigh_values_f32<M, CV>(scores.data(), kChunk, vp + start * vs + h * vh + c * 16, vs, stop - start, alpha,
                                    sums.data() + c * 16, D);
        }
        for (int64_t m = 0; m < M; ++m) {
          const int64_t r = first + m / G, g = m % G;
          if (r >= len) continue;  // a row past the chunk's end
          const __m512 norm = _mm512_set1_ps(1.f / total[m]);
          float* dst = op + (r * heads + h * G + g) * D;
          for (int64_t c = 0; c < kVecs; ++c) _mm512_storeu_ps(dst + c * 16, _mm512_mul_ps(_mm512_loadu_ps(sums.data() + m * D + c * 16), norm));
          if (lse != nullptr) lse[r * heads + h * G + g] = peak[m] + std::log(total[m]);
        }
      }
    }
  });
}

#define KVMESH_GROUP_CASES_F32(D)                                                   \
  switch (q.size(1) / k.size(1)) {                                                  \
    case 1: attend_f32<D, 1>(q, k, v, scale, causal, out, lse); return true;        \
    case 2: attend_f32<D, 2>(q, k, v, scale, causal, out, lse); return true;        \
    case 3: attend_f32<D, 3>(q, k, v, scale, causal, out, lse); return true;        \
    case 4: attend_f32<D, 4>(q, k, v, scale, causal, out, lse); return true;        \
    case 5: attend_f32<D, 5>(q, k, v, scale, causal, out, lse); return true;        \
    case 6: attend_f32<D, 6>(q, k, v, scale, causal, out, lse); return true;        \
    case 7: attend_f32<D, 7>(q, k, v, scale, causal, out, lse); return true;        \
    case 8: attend_f32<D, 8>(q, k, v, scale, causal, out, lse); return true;        \
    default: break;                                                                 \
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

// Into out (and lse, where not null); false: no kernel for this head dim or group in this build.
bool attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale, bool causal, at::Tensor& out,
            float* lse) {
#ifdef KVMESH_PREFILL_ATTENTION
  if (q.scalar_type() == at::kBFloat16 && q.size(2) == 64) KVMESH_GROUP_CASES(64)
  if (q.scalar_type() == at::kBFloat16 && q.size(2) == 128) KVMESH_GROUP_CASES(128)
#endif
#ifdef KVMESH_PREFILL_ATTENTION_F32
  if (q.scalar_type() == at::kFloat && q.size(2) == 64) KVMESH_GROUP_CASES_F32(64)
  if (q.scalar_type() == at::kFloat && q.size(2) == 128) KVMESH_GROUP_CASES_F32(128)
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
