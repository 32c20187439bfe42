// Helpers the compiled CPU kernels share: float32 from and to each dtype's bits (one value,
// or 16 bfloat16 at once), and exp over a row of floats in the CPU's widest vectors.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace kvmesh::cpu {

inline float to_float(float x) { return x; }
inline float to_float(c10::Half x) { return static_cast<float>(x); }
inline float to_float(c10::BFloat16 x) {  // the bits shift, which vectorizes (the c10 conversion does not)
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// float32 to the dtype, rounding to nearest even. bfloat16: as c10::BFloat16(float) does (a
// NaN stays a quiet NaN), in integer operations the compiler vectorizes (c10's does not).
template <typename T>
inline T from_float(float x) {
  return static_cast<T>(x);
}
template <>
inline float from_float<float>(float x) {
  return x;
}
template <>
inline c10::BFloat16 from_float<c10::BFloat16>(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  c10::BFloat16 out;
  out.x = static_cast<uint16_t>(x != x ? 0x7FC0u : rounded);
  return out;
}

#if defined(__AVX512F__)
// 16 bfloat16 values (their bits) widened to float32, exactly: the bits shift.
inline __m512 bf16x16_to_float(__m256i bits) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16));
}
#endif

// x[i] = exp(x[i] - shift) for n floats, through glibc's vector math library (libmvec, linked
// with -lmvec; accurate to 1 ulp) in the CPU's widest vectors. GCC calls it by itself only
// under -ffast-math, which would also drop the IEEE semantics the rest relies on: without
// these explicit calls every exp here was a scalar expf call.
#if defined(__AVX512F__)
extern "C" __m512 _ZGVeN16v_expf(__m512);
#elif defined(__AVX2__)
extern "C" __m256 _ZGVdN8v_expf(__m256);
#elif defined(__SSE2__)
extern "C" __m128 _ZGVbN4v_expf(__m128);
#endif
inline float exp_shifted(float* x, int64_t n, float shift) {  // returns the sum of the results
  int64_t i = 0;
  float total = 0.f;
#if defined(__AVX512F__)
  const __m512 sub = _mm512_set1_ps(shift);
  __m512 sum = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m512 e = _ZGVeN16v_expf(_mm512_sub_ps(_mm512_loadu_ps(x + i), sub));
    _mm512_storeu_ps(x + i, e);
    sum = _mm512_add_ps(sum, e);
  }
  total = _mm512_reduce_add_ps(sum);
#elif defined(__AVX2__)
  const __m256 sub = _mm256_set1_ps(shift);
  for (; i + 8 <= n; i += 8) {
    const __m256 e = _ZGVdN8v_expf(_mm256_sub_ps(_mm256_loadu_ps(x + i), sub));
    _mm256_storeu_ps(x + i, e);
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, e);
    for (int l = 0; l < 8; ++l) total += lanes[l];
  }
#elif defined(__SSE2__)
  const __m128 sub = _mm_set1_ps(shift);
  for (; i + 4 <= n; i += 4) {
    const __m128 e = _ZGVbN4v_expf(_mm_sub_ps(_mm_loadu_ps(x + i), sub));
    _mm_storeu_ps(x + i, e);
    alignas(16) float lanes[4];
    _mm_store_ps(lanes, e);
    for (int l = 0; l < 4; ++l) total += lanes[l];
  }
#endif
  for (; i < n; ++i) {
    x[i] = std::exp(x[i] - shift);
    total += x[i];
  }
  return total;
}

}  // namespace kvmesh::cpu
