// Fused elementwise steps of the Llama-like decoder layer, on CPU, each in one pass over
// memory instead of the 3-10 eager torch kernels (and their temporaries) they replace:
//
//   rms_norm(x, w, eps, offset)         RMSNorm in fp32, cast back (Llama / Gemma forms)
//   add_rms_norm(x, a, w, eps, offset)  s = x + a (rounded to x's dtype); (s, rms_norm(s))
//   rope_(x, cos, sin)                  rotate-half RoPE on the first cos.size(1) dims, in place
//   silu_mul(gate_up)                   silu(gate) * up of a fused [N, 2I] projection
//
// Every rounding step of the eager formulas is kept: each product and sum is rounded to
// the tensor's dtype where torch rounds it, RMSNorm's row sums come from at::sum (torch's
// summation order), and silu uses torch's own exp (SLEEF's Sleef_expf16_u10, exported by
// libtorch_cpu) on the elements torch's AVX-512 kernel vectorises, glibc's expf on the tail
// it computes scalar. On a CPU where torch runs its AVX-512 kernels the results are the
// eager ops' bits.
//
// Work is split over rows with torch's intra-op threads (at::parallel_for); a grain of
// about 16k elements keeps decode-sized inputs on one thread.

#include <torch/extension.h>

#if defined(__AVX512F__)
#include <immintrin.h>
extern "C" __m512 Sleef_expf16_u10(__m512);
#endif

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstdint>

namespace {

constexpr int64_t kGrainElements = 16384;

int64_t row_grain(int64_t row_elements) {
  return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, row_elements));
}

// Rounds a float to T the way torch's kernels do (round to nearest even).
template <typename T>
inline float round_to(float v) {
  return static_cast<float>(static_cast<T>(v));
}

template <>
inline float round_to<float>(float v) {
  return v;
}

// ---------------------------------------------------------------------------- RMSNorm
// Three phases: (1) the squares (and the residual sum) row by row; (2) their row sums by
// at::sum, so the sum order and hence the scale are torch's own (eager RMSNorm is
// `mean(x.pow(2))`, i.e. at::sum over the same [rows, hidden] buffer, then a division);
// (3) the scaled, weighted output row by row.
template <typename T>
void rms_norm_rows(const T* x, const T* w, T* out, T* sum_out, const T* add, int64_t rows,
                   int64_t hidden, int64_t x_stride, int64_t a_stride, float eps, float offset,
                   float* squares, const at::Tensor& squares_t) {
  const int64_t grain = row_grain(hidden);
  // the input rows as floats: the residual sum when there is one, else x
  auto row_value = [&](int64_t r, int64_t i) -> float {
    return add != nullptr ? static_cast<float>(sum_out[r * hidden + i])
                          : static_cast<float>(x[r * x_stride + i]);
  };
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      float* sq = squares + r * hidden;
      if (add != nullptr) {  // residual add, rounded to T as torch's `x + a` is
        const T* xr = x + r * x_stride;
        const T* ar = add + r * a_stride;
        T* sr = sum_out + r * hidden;
        for (int64_t i = 0; i < hidden; ++i) {
          sr[i] = static_cast<T>(static_cast<float>(xr[i]) + static_cast<float>(ar[i]));
        }
      }
      for (int64_t i = 0; i < hidden; ++i) {
        const float v = row_value(r, i);
        sq[i] = v * v;
      }
    }
  });
  const at::Tensor sums = at::sum(squares_t, {1});  // [rows] fp32, torch's order
  const float* totals = sums.data_ptr<float>();
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float scale = 1.0f / std::sqrt(totals[r] / static_cast<float>(hidden) + eps);
      T* o = out + r * hidden;
      if (offset != 0.0f) {  // Gemma: (x * scale * (offset + w)) in fp32, one cast
        for (int64_t i = 0; i < hidden; ++i) {
          const float n = row_value(r, i) * scale;
          o[i] = static_cast<T>(n * (offset + static_cast<float>(w[i])));
        }
      } else {  // Llama: w * (x * scale).to(T), each product rounded to T
        for (int64_t i = 0; i < hidden; ++i) {
          const float n = round_to<T>(row_value(r, i) * scale);
          o[i] = static_cast<T>(static_cast<float>(w[i]) * n);
        }
      }
    }
  });
}

void check_rows(const at::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu(), name, " must be a CPU tensor");
  TORCH_CHECK(x.dim() == 2, name, " must be 2-D [rows, hidden]");
  TORCH_CHECK(x.stride(1) == 1, name, " must have contiguous rows");
}

std::vector<at::Tensor> norm_impl(const at::Tensor& x, const c10::optional<at::Tensor>& add,
                                  const at::Tensor& weight, double eps, double offset) {
  check_rows(x, "x");
  TORCH_CHECK(weight.dim() == 1 && weight.size(0) == x.size(1) && weight.is_contiguous(),
              "weight must be a contiguous [hidden] vector");
  TORCH_CHECK(weight.scalar_type() == x.scalar_type(), "weight and x must have one dtype");
  const int64_t rows = x.size(0), hidden = x.size(1);
  at::Tensor out = at::empty({rows, hidden}, x.options());
  at::Tensor sum;
  if (add.has_value()) {
    check_rows(*add, "a");
    TORCH_CHECK(add->sizes() == x.sizes() && add->scalar_type() == x.scalar_type(),
                "a must match x in shape and dtype");
    sum = at::empty({rows, hidden}, x.options());
  }
  at::Tensor squares = at::empty({rows, hidden}, x.options().dtype(at::kFloat));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rms_norm", [&] {
    rms_norm_rows<scalar_t>(
        x.data_ptr<scalar_t>(), weight.data_ptr<scalar_t>(), out.data_ptr<scalar_t>(),
        add.has_value() ? sum.data_ptr<scalar_t>() : nullptr,
        add.has_value() ? add->data_ptr<scalar_t>() : nullptr, rows, hidden, x.stride(0),
        add.has_value() ? add->stride(0) : 0, static_cast<float>(eps),
        static_cast<float>(offset), squares.data_ptr<float>(), squares);
  });
  if (add.has_value()) return {sum, out};
  return {out};
}

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, double offset) {
  return norm_impl(x, c10::nullopt, weight, eps, offset)[0];
}

std::vector<at::Tensor> add_rms_norm(const at::Tensor& x, const at::Tensor& a,
                                     const at::Tensor& weight, double eps, double offset) {
  return norm_impl(x, a, weight, eps, offset);
}

// ---------------------------------------------------------------------------- RoPE
template <typename T>
void rope_rows(T* x, const T* cos, const T* sin, int64_t tokens, int64_t heads, int64_t rot,
               int64_t tok_stride, int64_t head_stride) {
  const int64_t half = rot / 2;
  at::parallel_for(0, tokens, row_grain(heads * rot), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      const T* c = cos + n * rot;
      const T* s = sin + n * rot;
      for (int64_t h = 0; h < heads; ++h) {
        T* xh = x + n * tok_stride + h * head_stride;
        for (int64_t i = 0; i < half; ++i) {
          const float x1 = static_cast<float>(xh[i]);
          const float x2 = static_cast<float>(xh[i + half]);
          // eager: x * cos + cat(-x2, x1) * sin, each product and the sum rounded to T
          const float a1 = round_to<T>(x1 * static_cast<float>(c[i]));
          const float b1 = round_to<T>(-x2 * static_cast<float>(s[i]));
          const float a2 = round_to<T>(x2 * static_cast<float>(c[i + half]));
          const float b2 = round_to<T>(x1 * static_cast<float>(s[i + half]));
          xh[i] = static_cast<T>(a1 + b1);
          xh[i + half] = static_cast<T>(a2 + b2);
        }
      }
    }
  });
}

at::Tensor rope_(at::Tensor x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.device().is_cpu() && x.dim() == 3 && x.stride(2) == 1,
              "x must be a CPU [tokens, heads, head_dim] tensor with contiguous head_dim");
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == x.size(0) && cos.sizes() == sin.sizes() &&
                  cos.is_contiguous() && sin.is_contiguous(),
              "cos and sin must be contiguous [tokens, rot_dim]");
  TORCH_CHECK(cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "cos, sin and x must have one dtype");
  const int64_t rot = cos.size(1);
  TORCH_CHECK(rot % 2 == 0 && rot <= x.size(2), "rot_dim must be even and <= head_dim");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "rope_", [&] {
    rope_rows<scalar_t>(x.data_ptr<scalar_t>(), cos.data_ptr<scalar_t>(),
                        sin.data_ptr<scalar_t>(), x.size(0), x.size(1), rot, x.stride(0),
                        x.stride(1));
  });
  return x;
}

// ---------------------------------------------------------------------------- SiLU x up
// torch's silu kernel: x / (1 + exp(-x)) in fp32; its AVX-512 loop takes 2 vectors of T
// per iteration (32 floats for fp32, 64 elements for bf16 / fp16) and the rest of a row
// scalar, with std::exp.
template <typename T>
inline int64_t vector_span() {
  return sizeof(T) == 4 ? 32 : 64;
}

inline float silu_scalar(float g) { return g / (1.0f + std::exp(-g)); }

template <typename T>
void silu_mul_rows(const T* gu, T* out, int64_t rows, int64_t inter, int64_t in_stride) {
  at::parallel_for(0, rows, row_grain(inter), [&](int64_t begin, int64_t end) {
    std::vector<float> act(static_cast<size_t>(inter));
    for (int64_t r = begin; r < end; ++r) {
      const T* g = gu + r * in_stride;
      const T* u = g + inter;
      T* o = out + r * inter;
      float* a = act.data();
      int64_t i = 0;
#if defined(__AVX512F__)
      const int64_t vec_end = inter - inter % vector_span<T>();
      const __m512 one = _mm512_set1_ps(1.0f);
      alignas(64) float lanes[16];
      for (; i < vec_end; i += 16) {
        for (int k = 0; k < 16; ++k) lanes[k] = static_cast<float>(g[i + k]);
        const __m512 x = _mm512_load_ps(lanes);
        const __m512 e = Sleef_expf16_u10(_mm512_sub_ps(_mm512_setzero_ps(), x));
        _mm512_storeu_ps(a + i, _mm512_div_ps(x, _mm512_add_ps(one, e)));
      }
#endif
      for (; i < inter; ++i) a[i] = silu_scalar(static_cast<float>(g[i]));
      for (int64_t k = 0; k < inter; ++k) {
        o[k] = static_cast<T>(round_to<T>(a[k]) * static_cast<float>(u[k]));
      }
    }
  });
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must have an even number of columns");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  at::Tensor out = at::empty({rows, inter}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_mul",
                                  [&] {
                                    silu_mul_rows<scalar_t>(gate_up.data_ptr<scalar_t>(),
                                                            out.data_ptr<scalar_t>(), rows,
                                                            inter, gate_up.stride(0));
                                  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rms_norm", &rms_norm, "RMSNorm of [rows, hidden]", py::arg("x"), py::arg("weight"),
        py::arg("eps"), py::arg("offset"));
  m.def("add_rms_norm", &add_rms_norm, "(x + a, RMSNorm(x + a))", py::arg("x"), py::arg("a"),
        py::arg("weight"), py::arg("eps"), py::arg("offset"));
  m.def("rope_", &rope_, "rotate-half RoPE in place", py::arg("x"), py::arg("cos"),
        py::arg("sin"));
  m.def("silu_mul", &silu_mul, "silu(gate) * up", py::arg("gate_up"));
}
