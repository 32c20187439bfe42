// Decode attention that reads K/V where they lie in the paged pool (no gather).
//
// q (B, heads, dim); k_cache, v_cache: one layer's strided views (num_blocks, block_size,
// kv_heads, dim), the last dimension contiguous; block_tables (B, n) int64; context_lens
// (B,) int64. One task per (sequence, kv head): the query heads sharing that KV head are
// scored together, so each K/V row is read once. Scores, softmax and the weighted sum of V
// are accumulated in float32; the output is rounded to q's dtype once. paged_decode_lse also
// returns each query head's log-sum-exp of its scaled scores (B, heads) float32, so a caller
// can merge this attention with one over other keys (a shared prefix read once: cascade).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <immintrin.h>

#include "cpu_math.h"

#include <cmath>
#include <type_traits>
#include <cstdint>
#include <cstring>
#include <limits>
#include <tuple>
#include <vector>

namespace {

using kvmesh::cpu::exp_shifted;
using kvmesh::cpu::to_float;

constexpr int64_t kMaxDim = 256;
constexpr int64_t kBlocksAhead = 2;  // how many K/V blocks ahead of the one read are fetched

// Tasks per thread: enough work (~200k multiply-adds) that waking the pool pays off, so a
// short batch-1 step runs on the calling thread.
inline int64_t grain(int64_t tokens, int64_t group, int64_t dim) {
  const int64_t per_task = tokens * group * dim * 2;
  return per_task >= 200000 ? 1 : 200000 / (per_task > 0 ? per_task : 1);
}

// One call's sizes and where its rows lie: q (B, heads, dim), the layer's strided K/V views,
// the block tables and context lengths. P is the element type the kernel loads (uint16_t for
// bfloat16 bits), O the output's.
template <typename P, typename O>
struct Paged {
  int64_t num_seqs, heads, kv_heads, group, block_size, width;
  float scale;
  const P *qp, *kp, *vp;
  const int64_t *tp, *lp;
  O* op;
  float* lsep;  // nullptr: no log-sum-exp wanted
  int64_t qs, qh, kb, kt, kh, vb, vt, vh;
  int64_t row_bytes;  // one K (V) row of one head

  Paged(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& tables, const at::Tensor& lens,
        double scale_, at::Tensor& out, float* lse)
      : num_seqs(q.size(0)), heads(q.size(1)), kv_heads(k.size(2)), group(q.size(1) / k.size(2)), block_size(k.size(1)),
        width(tables.size(1)), scale(static_cast<float>(scale_)), qp(static_cast<const P*>(q.const_data_ptr())),
        kp(static_cast<const P*>(k.const_data_ptr())), vp(static_cast<const P*>(v.const_data_ptr())),
        tp(tables.const_data_ptr<int64_t>()), lp(lens.const_data_ptr<int64_t>()), op(static_cast<O*>(out.data_ptr())),
        lsep(lse), qs(q.stride(0)), qh(q.stride(1)), kb(k.stride(0)), kt(k.stride(1)), kh(k.stride(2)), vb(v.stride(0)),
        vt(v.stride(1)), vh(v.stride(2)), row_bytes(q.size(2) * static_cast<int64_t>(sizeof(P))) {}

  const int64_t* table(int64_t s) const { return tp + s * width; }
  const P* query(int64_t s, int64_t head) const { return qp + s * qs + head * qh; }
  const P* key(const int64_t* table, int64_t pos, int64_t h) const {
    return kp + table[pos / block_size] * kb + (pos % block_size) * kt + h * kh;
  }
  const P* value(const int64_t* table, int64_t pos, int64_t h) const {
    return vp + table[pos / block_size] * vb + (pos % block_size) * vt + h * vh;
  }
  // f(pos, row) for the first len key (value) rows of KV head h, block by block: a pointer
  // step per row, not a division by the block size. The blocks lie anywhere in the pool, so
  // each row's load waits on memory unless fetched ahead (prefetching one cache line of each
  // row of the next block only, bfloat16 attention read K/V at 8-9 GB/s): every cache line of
  // the rows kBlocksAhead blocks on is prefetched as a block begins, to L2 (the first blocks',
  // at the start, to L1), and in the keys' pass this block's value rows too, to L2 (they are
  // read after the softmax; a task's few tens of KB stay there). The blocks ahead went to L1
  // before: to L2 the attention ran 1.2-1.7x faster on an AMD EPYC Zen 4 (kernel_ab_bench.py;
  // docs/benchmarks.md, "The decode attention's blocks ahead into L2 too").
  template <typename F>
  void each_key(const int64_t* table, int64_t len, int64_t h, F&& f) const {
    rows(kp, kb, kt, kh, table, len, h, f, vp, vb, vt, vh);
  }
  template <typename F>
  void each_value(const int64_t* table, int64_t len, int64_t h, F&& f) const {
    rows(vp, vb, vt, vh, table, len, h, f, nullptr, 0, 0, 0);
  }
  // Every cache line of ``count`` rows from ``first`` (rows ``tstride`` elements apart).
  template <int Hint>
  void prefetch_rows(const P* first, int64_t tstride, int64_t count) const {
    for (int64_t r = 0; r < count; ++r) {
      const char* row = reinterpret_cast<const char*>(first + r * tstride);
      for (int64_t line = 0; line < row_bytes; line += 64) _mm_prefetch(row + line, static_cast<_mm_hint>(Hint));
    }
  }
  template <typename F>
  void rows(const P* base, int64_t bstride, int64_t tstride, int64_t hstride, const int64_t* table, int64_t len,
            int64_t h, F& f, const P* also, int64_t also_bstride, int64_t also_tstride, int64_t also_hstride) const {
    const int64_t blocks = (len + block_size - 1) / block_size;
    auto count = [&](int64_t b) { return len - b * block_size < block_size ? len - b * block_size : block_size; };
    auto first = [&](const P* pool, int64_t bs, int64_t hs, int64_t b) { return pool + table[b] * bs + h * hs; };
    for (int64_t b = 0; b < blocks && b < kBlocksAhead; ++b) prefetch_rows<_MM_HINT_T0>(first(base, bstride, hstride, b), tstride, count(b));
    for (int64_t b = 0; b < blocks; ++b) {
      if (b + kBlocksAhead < blocks)
        prefetch_rows<_MM_HINT_T1>(first(base, bstride, hstride, b + kBlocksAhead), tstride, count(b + kBlocksAhead));
      if (also != nullptr) prefetch_rows<_MM_HINT_T1>(first(also, also_bstride, also_hstride, b), also_tstride, count(b));
      const P* row = first(base, bstride, hstride, b);
      for (int64_t pos = b * block_size, end = pos + count(b); pos < end; ++pos, row += tstride) f(pos, row);
    }
  }
  O* output(int64_t s, int64_t head, int64_t dim) const { return op + (s * heads + head) * dim; }
  // The log-sum-exp of a row of scaled scores, from its peak and its sum of exp(score - peak).
  void store_lse(int64_t s, int64_t head, float peak, float total) const {
    if (lsep != nullptr) lsep[s * heads + head] = peak + std::log(total);
  }
  // Tasks (sequence, KV head) per thread for a context of the tables' full width.
  int64_t grain_for(int64_t dim) const { return grain(width * block_size, group, dim); }
};

// Softmax in place over each of ``group`` rows of ``len`` scores; inv[g]: 1 / row g's sum,
// peak[g]: its largest score.
inline void softmax_rows(float* scores, int64_t group, int64_t len, float* inv, float* peaks) {
  for (int64_t g = 0; g < group; ++g) {
    float* row = scores + g * len;
    float peak = -std::numeric_limits<float>::infinity();
    for (int64_t i = 0; i < len; ++i) peak = row[i] > peak ? row[i] : peak;
    const float total = exp_shifted(row, len, peak);
    inv[g] = 1.f / total;
    peaks[g] = peak;
  }
}

// D > 0: the head dim known at compile time (loops unrolled, accumulators in registers).
template <typename T, int64_t D>
void run(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& tables,
         const at::Tensor& lens, double scale, at::Tensor& out, float* lse) {
  const Paged<T, T> a(q, k_cache, v_cache, tables, lens, scale, out, lse);
  const int64_t dim = D > 0 ? D : q.size(2);

  at::parallel_for(0, a.num_seqs * a.kv_heads, a.grain_for(dim), [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<const T*> krows, vrows;
    alignas(64) float qf[kMaxDim];
    alignas(64) float acc[kMaxDim];
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / a.kv_heads, h = task % a.kv_heads;
      const int64_t len = a.lp[s];
      const int64_t* table = a.table(s);
      scores.resize(len);
      krows.resize(len);
      vrows.resize(len);
      for (int64_t pos = 0; pos < len; ++pos) {
        krows[pos] = a.key(table, pos, h);
        vrows[pos] = a.value(table, pos, h);
      }
      for (int64_t g = 0; g < a.group; ++g) {
        const int64_t head = h * a.group + g;
        const T* src = a.query(s, head);
        for (int64_t d = 0; d < dim; ++d) qf[d] = to_float(src[d]) * a.scale;
        float peak = -std::numeric_limits<float>::infinity();
        for (int64_t pos = 0; pos < len; ++pos) {
          const T* krow = krows[pos];
          float dotp = 0.f;
#pragma omp simd reduction(+ : dotp)
          for (int64_t d = 0; d < dim; ++d) dotp += qf[d] * to_float(krow[d]);
          scores[pos] = dotp;
          peak = dotp > peak ? dotp : peak;
        }
        const float total = exp_shifted(scores.data(), len, peak);
        for (int64_t d = 0; d < dim; ++d) acc[d] = 0.f;
        for (int64_t pos = 0; pos < len; ++pos) {
          const T* vrow = vrows[pos];
          const float w = scores[pos];
#pragma omp simd
          for (int64_t d = 0; d < dim; ++d) acc[d] += w * to_float(vrow[d]);
        }
        const float inv = 1.f / total;
        a.store_lse(s, head, peak, total);
        T* dst = a.output(s, head, dim);
        for (int64_t d = 0; d < dim; ++d) dst[d] = static_cast<T>(acc[d] * inv);
      }
    }
  });
}

// float32 in the CPU's widest vectors (GCC vector extensions: 16 floats, a zmm, on AVX-512; 8,
// a ymm, elsewhere). As run_bf16: the group's query heads share each K/V row load and their
// accumulators stay in registers, where the generic loop above reads a K/V row once per query
// head and keeps one scalar reduction per dot product.
#if defined(__AVX512F__)
constexpr int64_t kLanes = 16;
#else
constexpr int64_t kLanes = 8;
#endif
typedef float fvec __attribute__((vector_size(kLanes * sizeof(float))));

inline fvec loadv(const float* p) {
  fvec v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}

inline float hsum(fvec v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(reinterpret_cast<__m512>(v));
#elif defined(__AVX__)
  const __m256 wide = reinterpret_cast<__m256>(v);
  __m128 x = _mm_add_ps(_mm256_castps256_ps128(wide), _mm256_extractf128_ps(wide, 1));
  x = _mm_add_ps(x, _mm_movehl_ps(x, x));
  x = _mm_add_ss(x, _mm_movehdup_ps(x));
  return _mm_cvtss_f32(x);
#else
  float s = 0.f;
  for (int64_t i = 0; i < kLanes; ++i) s += v[i];
  return s;
#endif
}

// G: the query heads per KV head, known at compile time so that the group's accumulators
// stay in registers.
template <int64_t D, int64_t G>
void run_f32(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& tables,
             const at::Tensor& lens, double scale, at::Tensor& out, float* lse) {
  static_assert(D % kLanes == 0, "D: a multiple of the vector width");
  constexpr int64_t kMaxGroup = G, kVecs = D / kLanes, group = G;
  const Paged<float, float> a(q, k_cache, v_cache, tables, lens, scale, out, lse);

  at::parallel_for(0, a.num_seqs * a.kv_heads, a.grain_for(D), [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / a.kv_heads, h = task % a.kv_heads;
      const int64_t len = a.lp[s];
      const int64_t* table = a.table(s);
      scores.resize(group * len);
      fvec qv[kMaxGroup][kVecs];
      for (int64_t g = 0; g < group; ++g)
        for (int64_t c = 0; c < kVecs; ++c) qv[g][c] = loadv(a.query(s, h * group + g) + c * kLanes) * a.scale;
      a.each_key(table, len, h, [&](int64_t pos, const float* krow) {
        fvec kv[kVecs];
        for (int64_t c = 0; c < kVecs; ++c) kv[c] = loadv(krow + c * kLanes);
        for (int64_t g = 0; g < group; ++g) {
          fvec acc = qv[g][0] * kv[0];
          for (int64_t c = 1; c < kVecs; ++c) acc += qv[g][c] * kv[c];
          scores[g * len + pos] = hsum(acc);
        }
      });
      float inv[kMaxGroup], peaks[kMaxGroup];
      softmax_rows(scores.data(), group, len, inv, peaks);
      for (int64_t g = 0; g < group; ++g) a.store_lse(s, h * group + g, peaks[g], 1.f / inv[g]);
      fvec acc[kMaxGroup][kVecs] = {};
      a.each_value(table, len, h, [&](int64_t pos, const float* vrow) {
        fvec vv[kVecs];
        for (int64_t c = 0; c < kVecs; ++c) vv[c] = loadv(vrow + c * kLanes);
        for (int64_t g = 0; g < group; ++g) {
          const float w = scores[g * len + pos];
          for (int64_t c = 0; c < kVecs; ++c) acc[g][c] += w * vv[c];
        }
      });
      for (int64_t g = 0; g < group; ++g) {
        float* dst = a.output(s, h * group + g, D);
        for (int64_t c = 0; c < kVecs; ++c) {
          const fvec res = acc[g][c] * inv[g];
          std::memcpy(dst + c * kLanes, &res, sizeof(res));
        }
      }
    }
  });
}

#if defined(__AVX512F__) && defined(__AVX512BF16__)
// bfloat16 with AVX512-BF16: q.k by vdpbf16ps (bf16 products are exact in float32, summed in
// float32), V widened to float32 in registers; the group's query heads share each K/V load.
template <int64_t D, int64_t G>
void run_bf16(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& tables,
              const at::Tensor& lens, double scale, at::Tensor& out, float* lse) {
  static_assert(D % 32 == 0, "D: a multiple of 32");
  constexpr int64_t kMaxGroup = G, kVecs = D / 16, group = G;
  const Paged<uint16_t, c10::BFloat16> a(q, k_cache, v_cache, tables, lens, scale, out, lse);  // bf16 as its bits

  at::parallel_for(0, a.num_seqs * a.kv_heads, a.grain_for(D), [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t task = begin; task < end; ++task) {
      const int64_t s = task / a.kv_heads, h = task % a.kv_heads;
      const int64_t len = a.lp[s];
      const int64_t* table = a.table(s);
      scores.resize(group * len);
      __m512i qv[kMaxGroup][D / 32];
      for (int64_t g = 0; g < group; ++g)
        for (int64_t c = 0; c < D / 32; ++c) qv[g][c] = _mm512_loadu_si512(a.query(s, h * group + g) + c * 32);
      a.each_key(table, len, h, [&](int64_t pos, const uint16_t* krow) {
        __m512i kv[D / 32];
        for (int64_t c = 0; c < D / 32; ++c) kv[c] = _mm512_loadu_si512(krow + c * 32);
        for (int64_t g = 0; g < group; ++g) {
          __m512 acc = _mm512_setzero_ps();
          for (int64_t c = 0; c < D / 32; ++c) acc = _mm512_dpbf16_ps(acc, (__m512bh)qv[g][c], (__m512bh)kv[c]);
          scores[g * len + pos] = _mm512_reduce_add_ps(acc) * a.scale;
        }
      });
      float inv[kMaxGroup], peaks[kMaxGroup];
      softmax_rows(scores.data(), group, len, inv, peaks);
      for (int64_t g = 0; g < group; ++g) a.store_lse(s, h * group + g, peaks[g], 1.f / inv[g]);
      __m512 acc[kMaxGroup][kVecs];
      for (int64_t g = 0; g < group; ++g)
        for (int64_t c = 0; c < kVecs; ++c) acc[g][c] = _mm512_setzero_ps();
      a.each_value(table, len, h, [&](int64_t pos, const uint16_t* vrow) {
        __m512 vv[kVecs];
        for (int64_t c = 0; c < kVecs; ++c)
          vv[c] = kvmesh::cpu::bf16x16_to_float(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(vrow + c * 16)));
        for (int64_t g = 0; g < group; ++g) {
          const __m512 w = _mm512_set1_ps(scores[g * len + pos]);
          for (int64_t c = 0; c < kVecs; ++c) acc[g][c] = _mm512_fmadd_ps(w, vv[c], acc[g][c]);
        }
      });
      for (int64_t g = 0; g < group; ++g) {
        alignas(64) float tmp[D];
        const __m512 scale_out = _mm512_set1_ps(inv[g]);
        for (int64_t c = 0; c < kVecs; ++c) _mm512_store_ps(tmp + c * 16, _mm512_mul_ps(acc[g][c], scale_out));
        c10::BFloat16* dst = a.output(s, h * group + g, D);
        for (int64_t d = 0; d < D; ++d) dst[d] = static_cast<c10::BFloat16>(tmp[d]);
      }
    }
  });
}
#define KVMESH_BF16_KERNEL 1
#endif

// The vectorized kernels for group sizes 1-8 (template K<D, G>), or false: the generic one.
#define KVMESH_GROUP_CASES(K, D)                                                       \
  switch (q.size(1) / k_cache.size(2)) {                                               \
    case 1: K<D, 1>(q, k_cache, v_cache, tables, lens, scale, out, lse); return true;  \
    case 2: K<D, 2>(q, k_cache, v_cache, tables, lens, scale, out, lse); return true;  \
    case 3: K<D, 3>(q, k_cache, v_cache, tables, lens, scale, out, lse); return true;  \
    case 4: K<D, 4>(q, k_cache, v_cache, tables, lens, scale, out, lse); return true;  \
    case 5: K<D, 5>(q, k_cache, v_cache, tables, lens, scale, out, lse); return true;  \
    case 6: K<D, 6>(q, k_cache, v_cache, tables, lens, scale, out, lse); return true;  \
    case 7: K<D, 7>(q, k_cache, v_cache, tables, lens, scale, out, lse); return true;  \
    case 8: K<D, 8>(q, k_cache, v_cache, tables, lens, scale, out, lse); return true;  \
    default: return false;                                                             \
  }

template <typename T>
bool dispatch_vectorized(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                         const at::Tensor& tables, const at::Tensor& lens, double scale, at::Tensor& out, float* lse) {
#ifdef KVMESH_BF16_KERNEL
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (q.size(2) == 64) KVMESH_GROUP_CASES(run_bf16, 64)
    if (q.size(2) == 128) KVMESH_GROUP_CASES(run_bf16, 128)
  }
#endif
  if constexpr (std::is_same_v<T, float>) {
    if (q.size(2) == 64) KVMESH_GROUP_CASES(run_f32, 64)
    if (q.size(2) == 128) KVMESH_GROUP_CASES(run_f32, 128)
  }
  return false;
}
#undef KVMESH_GROUP_CASES

template <typename T>
void dispatch_dim(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& tables,
                  const at::Tensor& lens, double scale, at::Tensor& out, float* lse) {
  if (dispatch_vectorized<T>(q, k_cache, v_cache, tables, lens, scale, out, lse)) return;
  switch (q.size(2)) {
    case 64: run<T, 64>(q, k_cache, v_cache, tables, lens, scale, out, lse); break;
    case 128: run<T, 128>(q, k_cache, v_cache, tables, lens, scale, out, lse); break;
    default: run<T, 0>(q, k_cache, v_cache, tables, lens, scale, out, lse);
  }
}

// out: (B, heads, dim) in q's dtype; lse: nullptr, or (B, heads) float32 to fill.
void decode_into(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& tables,
                 const at::Tensor& lens, double scale, at::Tensor& out, float* lse) {
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "paged_decode: bad ranks");
  TORCH_CHECK(q.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "paged_decode: dim not contiguous");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() && q.scalar_type() == v_cache.scalar_type(), "paged_decode: dtypes");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0 && q.size(2) == k_cache.size(3) && q.size(2) <= kMaxDim,
              "paged_decode: shapes");
  TORCH_CHECK(tables.scalar_type() == at::kLong && lens.scalar_type() == at::kLong, "paged_decode: int64 tables");
  TORCH_CHECK(tables.is_contiguous() && lens.is_contiguous() && tables.size(0) == q.size(0), "paged_decode: tables");
  switch (q.scalar_type()) {
    case at::kFloat: dispatch_dim<float>(q, k_cache, v_cache, tables, lens, scale, out, lse); break;
    case at::kBFloat16: dispatch_dim<c10::BFloat16>(q, k_cache, v_cache, tables, lens, scale, out, lse); break;
    case at::kHalf: dispatch_dim<c10::Half>(q, k_cache, v_cache, tables, lens, scale, out, lse); break;
    default: TORCH_CHECK(false, "paged_decode: unsupported dtype");
  }
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& tables, const at::Tensor& lens, double scale) {
  at::Tensor out = at::empty_like(q, at::MemoryFormat::Contiguous);
  decode_into(q, k_cache, v_cache, tables, lens, scale, out, nullptr);
  return out;
}

std::tuple<at::Tensor, at::Tensor> paged_decode_lse(const at::Tensor& q, const at::Tensor& k_cache,
                                                    const at::Tensor& v_cache, const at::Tensor& tables,
                                                    const at::Tensor& lens, double scale) {
  at::Tensor out = at::empty_like(q, at::MemoryFormat::Contiguous);
  at::Tensor lse = at::empty({q.size(0), q.size(1)}, q.options().dtype(at::kFloat));
  decode_into(q, k_cache, v_cache, tables, lens, scale, out, lse.data_ptr<float>());
  return {out, lse};
}

// Rotary embedding in place on the flat batch's q and k heads, and the new K/V stored at their
// slots of one layer's cache views. Rounds after each operation exactly as the PyTorch path
// (x * cos + roll(x, dim / 2) * signed_sin, each in the tensor's dtype), so results are
// bit-identical to it.
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")  // x * cos + y * sin as two roundings, as PyTorch does
template <typename T>
void rope_store_impl(at::Tensor& qk, const at::Tensor& v, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& k_cache,
                     at::Tensor& v_cache, const at::Tensor& slot_blocks, const at::Tensor& slot_offsets, int64_t heads) {
  const int64_t tokens = qk.size(0), rows = qk.size(1), dim = qk.size(2), half = dim / 2;
  const int64_t kv_heads = rows - heads;
  T* qkp = qk.data_ptr<T>();
  const T* vp = v.const_data_ptr<T>();
  const T* cp = cos.const_data_ptr<T>();
  const T* sp = sin.const_data_ptr<T>();
  T* kc = k_cache.data_ptr<T>();
  T* vc = v_cache.data_ptr<T>();
  const int64_t* bp = slot_blocks.const_data_ptr<int64_t>();
  const int64_t* fp = slot_offsets.const_data_ptr<int64_t>();
  const int64_t qs = qk.stride(0), qh = qk.stride(1), vs = v.stride(0), vh = v.stride(1);
  const int64_t cs = cos.stride(0), ss = sin.stride(0);
  const int64_t kb = k_cache.stride(0), kt = k_cache.stride(1), kh = k_cache.stride(2);
  const int64_t wb = v_cache.stride(0), wt = v_cache.stride(1), wh = v_cache.stride(2);
  // Serial: a few KB per token, less than waking the thread pool costs on a busy machine.
  {
    std::vector<T> row(dim);
    for (int64_t t = 0; t < tokens; ++t) {
      const T* c = cp + t * cs;
      const T* sn = sp + t * ss;
      for (int64_t r = 0; r < rows; ++r) {
        T* x = qkp + t * qs + r * qh;
        std::copy(x, x + dim, row.begin());
        for (int64_t d = 0; d < half; ++d) {  // roll by half: the other half's element, no modulo
          const T a = static_cast<T>(row[d] * c[d]);
          const T b = static_cast<T>(row[d + half] * sn[d]);
          x[d] = static_cast<T>(a + b);
        }
        for (int64_t d = half; d < dim; ++d) {
          const T a = static_cast<T>(row[d] * c[d]);
          const T b = static_cast<T>(row[d - half] * sn[d]);
          x[d] = static_cast<T>(a + b);
        }
      }
      T* kdst = kc + bp[t] * kb + fp[t] * kt;
      T* vdst = vc + bp[t] * wb + fp[t] * wt;
      for (int64_t h = 0; h < kv_heads; ++h) {
        const T* ksrc = qkp + t * qs + (heads + h) * qh;
        const T* vsrc = vp + t * vs + h * vh;
        std::copy(ksrc, ksrc + dim, kdst + h * kh);
        std::copy(vsrc, vsrc + dim, vdst + h * wh);
      }
    }
  }
}
#pragma GCC pop_options

void rope_store(at::Tensor qk, const at::Tensor& v, const at::Tensor& cos, const at::Tensor& sin, at::Tensor k_cache,
                at::Tensor v_cache, const at::Tensor& slot_blocks, const at::Tensor& slot_offsets, int64_t heads) {
  TORCH_CHECK(qk.dim() == 3 && v.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "rope_store: bad ranks");
  TORCH_CHECK(qk.stride(2) == 1 && v.stride(2) == 1 && k_cache.stride(3) == 1 && v_cache.stride(3) == 1 &&
                  cos.stride(-1) == 1 && sin.stride(-1) == 1,
              "rope_store: dim not contiguous");
  const auto dtype = qk.scalar_type();
  TORCH_CHECK(v.scalar_type() == dtype && cos.scalar_type() == dtype && sin.scalar_type() == dtype &&
                  k_cache.scalar_type() == dtype && v_cache.scalar_type() == dtype,
              "rope_store: dtypes");
  TORCH_CHECK(qk.size(2) % 2 == 0 && qk.size(1) - heads == v.size(1) && v.size(1) == k_cache.size(2) &&
                  qk.size(2) == k_cache.size(3) && cos.size(0) == qk.size(0) && sin.size(0) == qk.size(0) &&
                  cos.size(-1) == qk.size(2) && v.size(0) == qk.size(0),
              "rope_store: shapes");
  TORCH_CHECK(slot_blocks.scalar_type() == at::kLong && slot_offsets.scalar_type() == at::kLong &&
                  slot_blocks.is_contiguous() && slot_offsets.is_contiguous() && slot_blocks.numel() == qk.size(0) &&
                  slot_offsets.numel() == qk.size(0),
              "rope_store: slots");
  switch (dtype) {
    case at::kFloat: rope_store_impl<float>(qk, v, cos, sin, k_cache, v_cache, slot_blocks, slot_offsets, heads); break;
    case at::kBFloat16:
      rope_store_impl<c10::BFloat16>(qk, v, cos, sin, k_cache, v_cache, slot_blocks, slot_offsets, heads);
      break;
    case at::kHalf: rope_store_impl<c10::Half>(qk, v, cos, sin, k_cache, v_cache, slot_blocks, slot_offsets, heads); break;
    default: TORCH_CHECK(false, "rope_store: unsupported dtype");
  }
}

}  // namespace

TORCH_LIBRARY(kvmesh, m) {
  m.def("rope_store(Tensor(a!) qk, Tensor v, Tensor cos, Tensor sin, Tensor(b!) k_cache, Tensor(c!) v_cache, "
        "Tensor slot_blocks, Tensor slot_offsets, int heads) -> ()");
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens, float scale) -> Tensor");
  m.def("paged_decode_lse(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_tables, Tensor context_lens, "
        "float scale) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) {
  m.impl("paged_decode", &paged_decode);
  m.impl("paged_decode_lse", &paged_decode_lse);
  m.impl("rope_store", &rope_store);
}
