// Fused elementwise steps of the Llama-like decoder layer, on CPU, each in one pass over
// memory instead of the 3-10 eager torch kernels (and their temporaries) they replace:
//
//   rms_norm(x, w, eps, offset)         RMSNorm in fp32, cast back (Llama / Gemma forms)
//   add_rms_norm(x, a, w, eps, offset)  s = x + a (rounded to x's dtype); (s, rms_norm(s))
//   rope_(x, cos, sin)                  rotate-half RoPE on the first cos.size(1) dims, in place
//   silu_mul(gate_up)                   silu(gate) * up of a fused [N, 2I] projection
//   row_argmax(logits)                  torch.argmax of each row (greedy sampling)
//
// Every rounding step of the eager formulas is kept: each product and sum is rounded to
// the tensor's dtype where torch rounds it (round to nearest even, as c10's conversions),
// RMSNorm's row sums come from at::sum (torch's summation order), and silu uses torch's own
// exp (SLEEF's Sleef_expf16_u10, exported by libtorch_cpu) on the elements torch's AVX-512
// kernel vectorises, glibc's expf on the tail it computes scalar. On a CPU where torch runs
// its AVX-512 kernels the results are the eager ops' bits; on an AVX2 CPU silu_mul takes
// torch's AVX2 exp (Sleef_expf8_u10) and spans, so its results are the eager op's bits there.
//
// With AVX-512 (F, BW, VL) the loops run on 16 floats at a time; with AVX2 silu_mul runs on 8;
// otherwise a scalar loop computes the same roundings. Work is split over rows with torch's intra-op threads
// (at::parallel_for); a grain of about 16k elements keeps decode-sized inputs on one thread.

// Only the ATen / pybind headers used (not <torch/extension.h>, which pulls in all of libtorch's
// C++ API and triples the first-use build time: ~50 s -> ~20 s on a 2-core machine).
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/sum.h>
#include <torch/csrc/utils/pybind.h>

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define SS_FUSED_VEC 1
#include <immintrin.h>
extern "C" __m512 Sleef_expf16_u10(__m512);
#elif defined(__AVX2__) && defined(__F16C__)
// AVX2 without AVX-512 (AMD Zen 2/3, for one): torch runs its AVX2 kernels there, and
// silu_mul follows them on 8 floats at a time (with torch's AVX2 exp, Sleef_expf8_u10). The
// other kernels keep their scalar loops, which measured as fast as the eager ops on such a
// CPU (2-core EPYC 7xx3: RMSNorm at 32 rows 3x faster, at 512 rows even).
#define SS_FUSED_AVX2 1
#include <immintrin.h>
extern "C" __m256 Sleef_expf8_u10(__m256);
#endif

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

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

#if defined(SS_FUSED_VEC)
// ---------------------------------------------------------------- 16-lane loads / stores
inline __mmask16 lanes(int64_t n) {
  return n >= 16 ? static_cast<__mmask16>(0xFFFF) : static_cast<__mmask16>((1u << n) - 1u);
}

// bf16 bits of each float, rounded to nearest even (NaN -> 0x7FC0), as c10::BFloat16 does.
inline __m512i bf16_bits(__m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  const __m512i bias = _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF));
  const __m512i hi = _mm512_srli_epi32(_mm512_add_epi32(b, bias), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_mov_epi32(hi, nan, _mm512_set1_epi32(0x7FC0));
}

template <typename T>
struct Vec {  // no 16-lane path (double): the scalar loops run
  static constexpr bool ok = false;
};

template <>
struct Vec<float> {
  static constexpr bool ok = true;
  static __m512 load(const float* p, int64_t n) { return _mm512_maskz_loadu_ps(lanes(n), p); }
  static void store(float* p, __m512 v, int64_t n) { _mm512_mask_storeu_ps(p, lanes(n), v); }
  static __m512 round(__m512 v) { return v; }
};

template <>
struct Vec<c10::BFloat16> {
  static constexpr bool ok = true;
  static __m512 load(const c10::BFloat16* p, int64_t n) {
    const __m256i h = _mm256_maskz_loadu_epi16(lanes(n), p);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
  static void store(c10::BFloat16* p, __m512 v, int64_t n) {
    _mm256_mask_storeu_epi16(p, lanes(n), _mm512_cvtepi32_epi16(bf16_bits(v)));
  }
  static __m512 round(__m512 v) {
    return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(v), 16));
  }
};

template <>
struct Vec<c10::Half> {
  static constexpr bool ok = true;
  static __m512 load(const c10::Half* p, int64_t n) {
    return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(lanes(n), p));
  }
  static void store(c10::Half* p, __m512 v, int64_t n) {
    _mm256_mask_storeu_epi16(p, lanes(n), _mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }
  static __m512 round(__m512 v) {
    return _mm512_cvtph_ps(_mm512_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }
};
#endif

#if defined(SS_FUSED_AVX2)
// ------------------------------------------------------------------ 8-lane loads / stores
template <typename T>
struct Vec8 {  // no 8-lane path (double): the scalar loop runs
  static constexpr bool ok = false;
};

template <>
struct Vec8<float> {
  static constexpr bool ok = true;
  static __m256 load(const float* p) { return _mm256_loadu_ps(p); }
  static void store(float* p, __m256 v) { _mm256_storeu_ps(p, v); }
  static __m256 round(__m256 v) { return v; }
};

// bf16 bits of each float in the low 16 bits of its lane, rounded to nearest even (NaN ->
// 0x7FC0), as c10::BFloat16 does.
inline __m256i bf16_bits8(__m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  const __m256i hi =
      _mm256_srli_epi32(_mm256_add_epi32(b, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256 nan = _mm256_cmp_ps(v, v, _CMP_UNORD_Q);
  return _mm256_castps_si256(
      _mm256_blendv_ps(_mm256_castsi256_ps(hi), _mm256_castsi256_ps(_mm256_set1_epi32(0x7FC0)), nan));
}

template <>
struct Vec8<c10::BFloat16> {
  static constexpr bool ok = true;
  static __m256 load(const c10::BFloat16* p) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
  static void store(c10::BFloat16* p, __m256 v) {
    // lanes hold 0 .. 0xFFFF, so the saturating pack is exact; it packs within 128-bit
    // halves, and the permute brings the two halves' 4 results together
    const __m256i bits = bf16_bits8(v);
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(bits, bits), 0x08);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_castsi256_si128(packed));
  }
  static __m256 round(__m256 v) {
    return _mm256_castsi256_ps(_mm256_slli_epi32(bf16_bits8(v), 16));
  }
};

template <>
struct Vec8<c10::Half> {
  static constexpr bool ok = true;
  static __m256 load(const c10::Half* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  }
  static void store(c10::Half* p, __m256 v) {
    _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }
  static __m256 round(__m256 v) {
    return _mm256_cvtph_ps(_mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
  }
};
#endif

// ---------------------------------------------------------------------------- RMSNorm
// Three phases: (1) the squares (and the residual sum) row by row; (2) their row sums by
// at::sum, so the sum order and hence the scale are torch's own (eager RMSNorm is
// `mean(x.pow(2))`, i.e. at::sum over the same [rows, hidden] buffer, then a division);
// (3) the scaled, weighted output row by row.
template <typename T>
void norm_squares_row(const T* x, const T* a, T* s, float* sq, int64_t hidden) {
  int64_t i = 0;
#if defined(SS_FUSED_VEC)
  if constexpr (Vec<T>::ok) {
  for (; i < hidden; i += 16) {
    const int64_t n = hidden - i;
    __m512 v = Vec<T>::load(x + i, n);
    if (a != nullptr) {  // residual add, rounded to T as torch's `x + a` is
      v = Vec<T>::round(_mm512_add_ps(v, Vec<T>::load(a + i, n)));
      Vec<T>::store(s + i, v, n);
    }
    _mm512_mask_storeu_ps(sq + i, lanes(n), _mm512_mul_ps(v, v));
  }
  }
#endif
  for (; i < hidden; ++i) {
    float v = static_cast<float>(x[i]);
    if (a != nullptr) {
      s[i] = static_cast<T>(v + static_cast<float>(a[i]));
      v = static_cast<float>(s[i]);
    }
    sq[i] = v * v;
  }
}

template <typename T>
void norm_output_row(const T* v_in, const T* w, T* out, float scale, float offset,
                     int64_t hidden) {
  int64_t i = 0;
#if defined(SS_FUSED_VEC)
  if constexpr (Vec<T>::ok) {
  const __m512 sv = _mm512_set1_ps(scale);
  const __m512 ov = _mm512_set1_ps(offset);
  for (; i < hidden; i += 16) {
    const int64_t n = hidden - i;
    const __m512 x = _mm512_mul_ps(Vec<T>::load(v_in + i, n), sv);
    const __m512 wv = Vec<T>::load(w + i, n);
    // Gemma: x * (offset + w) in fp32, one cast; Llama: w * x.to(T), the product rounded
    const __m512 o = offset != 0.0f ? _mm512_mul_ps(x, _mm512_add_ps(ov, wv))
                                    : _mm512_mul_ps(wv, Vec<T>::round(x));
    Vec<T>::store(out + i, o, n);
  }
  }
#endif
  for (; i < hidden; ++i) {
    const float x = static_cast<float>(v_in[i]) * scale;
    out[i] = offset != 0.0f ? static_cast<T>(x * (offset + static_cast<float>(w[i])))
                            : static_cast<T>(static_cast<float>(w[i]) * round_to<T>(x));
  }
}

template <typename T>
void rms_norm_rows(const T* x, const T* w, T* out, T* sum_out, const T* add, int64_t rows,
                   int64_t hidden, int64_t x_stride, int64_t a_stride, float eps, float offset,
                   const at::Tensor& squares) {
  const int64_t grain = row_grain(hidden);
  float* sq = squares.data_ptr<float>();
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      norm_squares_row<T>(x + r * x_stride, add != nullptr ? add + r * a_stride : nullptr,
                          add != nullptr ? sum_out + r * hidden : nullptr, sq + r * hidden,
                          hidden);
    }
  });
  const at::Tensor sums = at::sum(squares, {1});  // [rows] fp32, torch's order
  const float* totals = sums.data_ptr<float>();
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const float scale = 1.0f / std::sqrt(totals[r] / static_cast<float>(hidden) + eps);
      const T* v = add != nullptr ? sum_out + r * hidden : x + r * x_stride;
      norm_output_row<T>(v, w, out + r * hidden, scale, offset, hidden);
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
        static_cast<float>(offset), squares);
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
// eager: x * cos + cat(-x2, x1) * sin, each product and the sum rounded to T
template <typename T>
void rope_head(T* xh, const T* c, const T* s, int64_t half) {
  int64_t i = 0;
#if defined(SS_FUSED_VEC)
  if constexpr (Vec<T>::ok) {
  for (; i < half; i += 16) {
    const int64_t n = half - i;
    const __m512 x1 = Vec<T>::load(xh + i, n), x2 = Vec<T>::load(xh + half + i, n);
    const __m512 a1 = Vec<T>::round(_mm512_mul_ps(x1, Vec<T>::load(c + i, n)));
    const __m512 b1 = Vec<T>::round(
        _mm512_mul_ps(_mm512_sub_ps(_mm512_setzero_ps(), x2), Vec<T>::load(s + i, n)));
    const __m512 a2 = Vec<T>::round(_mm512_mul_ps(x2, Vec<T>::load(c + half + i, n)));
    const __m512 b2 = Vec<T>::round(_mm512_mul_ps(x1, Vec<T>::load(s + half + i, n)));
    Vec<T>::store(xh + i, _mm512_add_ps(a1, b1), n);
    Vec<T>::store(xh + half + i, _mm512_add_ps(a2, b2), n);
  }
  }
#endif
  for (; i < half; ++i) {
    const float x1 = static_cast<float>(xh[i]);
    const float x2 = static_cast<float>(xh[i + half]);
    const float a1 = round_to<T>(x1 * static_cast<float>(c[i]));
    const float b1 = round_to<T>(-x2 * static_cast<float>(s[i]));
    const float a2 = round_to<T>(x2 * static_cast<float>(c[i + half]));
    const float b2 = round_to<T>(x1 * static_cast<float>(s[i + half]));
    xh[i] = static_cast<T>(a1 + b1);
    xh[i + half] = static_cast<T>(a2 + b2);
  }
}

template <typename T>
void rope_rows(T* x, const T* cos, const T* sin, int64_t tokens, int64_t heads, int64_t rot,
               int64_t tok_stride, int64_t head_stride) {
  at::parallel_for(0, tokens, row_grain(heads * rot), [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      for (int64_t h = 0; h < heads; ++h) {
        rope_head<T>(x + n * tok_stride + h * head_stride, cos + n * rot, sin + n * rot,
                     rot / 2);
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
// torch's silu kernel: x / (1 + exp(-x)) in fp32; its vector loop takes 2 vectors of T per
// iteration and the rest of a row scalar, with std::exp. With AVX-512 that is 32 floats for
// fp32 and 64 elements for bf16 / fp16; with AVX2, 16 and 32.
template <typename T>
inline int64_t vector_span() {
#if defined(SS_FUSED_VEC)
  return sizeof(T) == 4 ? 32 : 64;
#else
  return sizeof(T) == 4 ? 16 : 32;
#endif
}

template <typename T>
void silu_mul_row(const T* g, const T* u, T* o, int64_t inter) {
  int64_t i = 0;
#if defined(SS_FUSED_VEC)
  if constexpr (Vec<T>::ok) {
  const int64_t vec_end = inter - inter % vector_span<T>();
  const __m512 one = _mm512_set1_ps(1.0f);
  for (; i < vec_end; i += 16) {
    const __m512 x = Vec<T>::load(g + i, 16);
    const __m512 e = Sleef_expf16_u10(_mm512_sub_ps(_mm512_setzero_ps(), x));
    const __m512 act = Vec<T>::round(_mm512_div_ps(x, _mm512_add_ps(one, e)));
    Vec<T>::store(o + i, _mm512_mul_ps(act, Vec<T>::load(u + i, 16)), 16);
  }
  }
#elif defined(SS_FUSED_AVX2)
  if constexpr (Vec8<T>::ok) {
  const int64_t vec_end = inter - inter % vector_span<T>();
  const __m256 one = _mm256_set1_ps(1.0f);
  for (; i < vec_end; i += 8) {
    const __m256 x = Vec8<T>::load(g + i);
    const __m256 e = Sleef_expf8_u10(_mm256_sub_ps(_mm256_setzero_ps(), x));
    const __m256 act = Vec8<T>::round(_mm256_div_ps(x, _mm256_add_ps(one, e)));
    Vec8<T>::store(o + i, _mm256_mul_ps(act, Vec8<T>::load(u + i)));
  }
  }
#endif
  for (; i < inter; ++i) {
    const float x = static_cast<float>(g[i]);
    const float act = round_to<T>(x / (1.0f + std::exp(-x)));
    o[i] = static_cast<T>(act * static_cast<float>(u[i]));
  }
}

at::Tensor silu_mul(const at::Tensor& gate_up) {
  check_rows(gate_up, "gate_up");
  TORCH_CHECK(gate_up.size(1) % 2 == 0, "gate_up must have an even number of columns");
  const int64_t rows = gate_up.size(0), inter = gate_up.size(1) / 2;
  const int64_t stride = gate_up.stride(0);
  at::Tensor out = at::empty({rows, inter}, gate_up.options());
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kBFloat16, at::kHalf, gate_up.scalar_type(), "silu_mul", [&] {
        const scalar_t* in = gate_up.data_ptr<scalar_t>();
        scalar_t* o = out.data_ptr<scalar_t>();
        at::parallel_for(0, rows, row_grain(inter), [&](int64_t begin, int64_t end) {
          for (int64_t r = begin; r < end; ++r) {
            silu_mul_row<scalar_t>(in + r * stride, in + r * stride + inter, o + r * inter,
                                   inter);
          }
        });
      });
  return out;
}

// ------------------------------------------------------------------------- row argmax
// torch.argmax of each row: the first maximum, where a NaN counts as larger than any number
// (so the first NaN wins). Two passes over the row in fp32 (bf16 / fp16 widen exactly, so the
// order is the original values'): the maximum, with an early exit at the first NaN, then the
// first element equal to it. -0.0 and +0.0 compare equal, as in torch's comparisons.
template <typename T>
int64_t argmax_row(const T* x, int64_t n) {
  int64_t i = 0;
  float best = -std::numeric_limits<float>::infinity();
#if defined(SS_FUSED_VEC)
  if constexpr (Vec<T>::ok) {
    __m512 vmax = _mm512_set1_ps(best);
    for (; i < n; i += 16) {
      const __m512 v = Vec<T>::load(x + i, n - i);  // masked-off lanes load 0.0
      const __mmask16 valid = lanes(n - i);
      const __mmask16 nan = _mm512_mask_cmp_ps_mask(valid, v, v, _CMP_UNORD_Q);
      if (nan) return i + __builtin_ctz(nan);
      vmax = _mm512_mask_max_ps(vmax, valid, vmax, v);
    }
    best = _mm512_reduce_max_ps(vmax);
    const __m512 b = _mm512_set1_ps(best);
    for (i = 0; i < n; i += 16) {
      const __mmask16 hit =
          _mm512_mask_cmp_ps_mask(lanes(n - i), Vec<T>::load(x + i, n - i), b, _CMP_EQ_OQ);
      if (hit) return i + __builtin_ctz(hit);
    }
    return 0;  // not reached: the maximum is one of the elements
  }
#endif
  for (; i < n; ++i) {
    const float v = static_cast<float>(x[i]);
    if (std::isnan(v)) return i;
    best = std::max(best, v);
  }
  for (i = 0; i < n; ++i) {
    if (static_cast<float>(x[i]) == best) return i;
  }
  return 0;
}

at::Tensor row_argmax(const at::Tensor& x) {
  check_rows(x, "logits");
  TORCH_CHECK(x.size(1) > 0, "row_argmax: rows must not be empty");
  const int64_t rows = x.size(0), n = x.size(1), stride = x.stride(0);
  at::Tensor out = at::empty({rows}, x.options().dtype(at::kLong));
  int64_t* o = out.data_ptr<int64_t>();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "row_argmax", [&] {
    const scalar_t* p = x.data_ptr<scalar_t>();
    at::parallel_for(0, rows, row_grain(n), [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) o[r] = argmax_row<scalar_t>(p + r * stride, n);
    });
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
  m.def("row_argmax", &row_argmax, "argmax of each row (first maximum, NaN largest)",
        py::arg("logits"));
}
