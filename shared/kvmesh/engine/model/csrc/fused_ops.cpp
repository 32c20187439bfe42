// The decoder's elementwise steps fused, one pass over each token's row:
//
// rms_norm(x, weight, eps): RMSNorm of each row of x (T, H).
// add_rms_norm(residual, x, weight, eps): residual += x in place (the residual stream), then
//   RMSNorm of the new residual; one op where PyTorch runs an add and the norm's eight.
// silu_mul(gate_up, width): silu(gate) * up of each row of gate_up (T, 2 * width).
//
// Each rounds where PyTorch rounds, so the results equal F.rms_norm's / F.silu's except where
// a float32 sum or exp is one unit in the last place apart: the row is read as float32, its
// mean square computed, x * rsqrt(mean + eps) * weight in float32 rounded to the dtype once
// (torch 2.13's fused rms_norm; not Hugging Face's, which rounds before the weight); an add
// or a silu is rounded to the dtype before it is used, as a separate PyTorch op's output is. Rows run in parallel only when there are many (prefill); a decode
// step's few rows run on the calling thread, which is cheaper than waking the pool.

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include "cpu_math.h"

#include <cmath>
#include <cstdint>

namespace {

using kvmesh::cpu::exp_shifted;
using kvmesh::cpu::from_float;
using kvmesh::cpu::to_float;

template <typename T>
inline T round_to(float x) {
  return from_float<T>(x);
}

// Rows per task: a few tens of thousands of elements, so a decode step stays on one thread.
inline int64_t rows_per_task(int64_t width) { return width >= 32768 ? 1 : 32768 / (width > 0 ? width : 1); }

#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")  // each multiply and add rounded, as PyTorch's separate ops are
template <typename T>
void norm_row(const T* x, const T* w, T* out, int64_t width, float eps) {
  float squares = 0.f;
#pragma omp simd reduction(+ : squares)
  for (int64_t i = 0; i < width; ++i) {
    const float v = to_float(x[i]);
    squares += v * v;
  }
  const float mean = squares / static_cast<float>(width);
  const float inv = 1.f / std::sqrt(mean + eps);
#pragma omp simd
  for (int64_t i = 0; i < width; ++i) out[i] = round_to<T>(to_float(x[i]) * inv * to_float(w[i]));
}

template <typename T>
void add_row(T* residual, const T* x, int64_t width) {
#pragma omp simd
  for (int64_t i = 0; i < width; ++i) residual[i] = round_to<T>(to_float(residual[i]) + to_float(x[i]));
}

// silu(g) = g / (1 + exp(-g)), exp through the vector math library a chunk at a time.
template <typename T>
void silu_mul_row(const T* gate, const T* up, T* out, int64_t width) {
  constexpr int64_t kChunk = 256;
  float e[kChunk];
  for (int64_t start = 0; start < width; start += kChunk) {
    const int64_t n = width - start < kChunk ? width - start : kChunk;
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) e[i] = -to_float(gate[start + i]);
    exp_shifted(e, n, 0.f);
#pragma omp simd
    for (int64_t i = 0; i < n; ++i) {
      const float g = to_float(gate[start + i]);
      const float silu = to_float(round_to<T>(g / (1.f + e[i])));
      out[start + i] = round_to<T>(silu * to_float(up[start + i]));
    }
  }
}
#pragma GCC pop_options

void check_rows(const at::Tensor& x, const char* what) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 2 && x.stride(1) == 1, what, ": a CPU (tokens, width) tensor, rows contiguous");
}

template <typename F>
void dispatch(at::ScalarType dtype, const char* what, F&& f) {
  switch (dtype) {
    case at::kFloat: f(float{}); break;
    case at::kBFloat16: f(c10::BFloat16{}); break;
    case at::kHalf: f(c10::Half{}); break;
    default: TORCH_CHECK(false, what, ": unsupported dtype");
  }
}

at::Tensor norm(at::Tensor residual, const at::Tensor* x, const at::Tensor& weight, double eps, const char* what) {
  check_rows(residual, what);
  TORCH_CHECK(weight.dim() == 1 && weight.is_contiguous() && weight.size(0) == residual.size(1) &&
                  weight.scalar_type() == residual.scalar_type(),
              what, ": weight");
  if (x != nullptr) {
    check_rows(*x, what);
    TORCH_CHECK(x->sizes() == residual.sizes() && x->scalar_type() == residual.scalar_type(), what, ": x and residual differ");
  }
  const int64_t tokens = residual.size(0), width = residual.size(1);
  auto out = at::empty({tokens, width}, residual.options());
  dispatch(residual.scalar_type(), what, [&](auto tag) {
    using T = decltype(tag);
    T* rp = residual.data_ptr<T>();
    const T* xp = x != nullptr ? x->const_data_ptr<T>() : nullptr;
    const T* wp = weight.const_data_ptr<T>();
    T* op = out.data_ptr<T>();
    const int64_t rs = residual.stride(0), xs = x != nullptr ? x->stride(0) : 0;
    at::parallel_for(0, tokens, rows_per_task(width), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) {
        if (xp != nullptr) add_row<T>(rp + t * rs, xp + t * xs, width);
        norm_row<T>(rp + t * rs, wp, op + t * width, width, static_cast<float>(eps));
      }
    });
  });
  return out;
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps) {
  return norm(x, nullptr, weight, eps, "rms_norm");
}

at::Tensor add_rms_norm(at::Tensor residual, const at::Tensor& x, const at::Tensor& weight, double eps) {
  return norm(residual, &x, weight, eps, "add_rms_norm");
}

at::Tensor silu_mul(const at::Tensor& gate_up, int64_t width) {
  check_rows(gate_up, "silu_mul");
  TORCH_CHECK(gate_up.size(1) == 2 * width, "silu_mul: gate_up is not (tokens, 2 * width)");
  const int64_t tokens = gate_up.size(0);
  auto out = at::empty({tokens, width}, gate_up.options());
  dispatch(gate_up.scalar_type(), "silu_mul", [&](auto tag) {
    using T = decltype(tag);
    const T* gp = gate_up.const_data_ptr<T>();
    T* op = out.data_ptr<T>();
    const int64_t gs = gate_up.stride(0);
    at::parallel_for(0, tokens, rows_per_task(width), [&](int64_t begin, int64_t end) {
      for (int64_t t = begin; t < end; ++t) silu_mul_row<T>(gp + t * gs, gp + t * gs + width, op + t * width, width);
    });
  });
  return out;
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(kvmesh, m) {
  m.def("rms_norm(Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("add_rms_norm(Tensor(a!) residual, Tensor x, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor gate_up, int width) -> Tensor");
}

TORCH_LIBRARY_IMPL(kvmesh, CPU, m) {
  m.impl("rms_norm", &rms_norm);
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("silu_mul", &silu_mul);
}
