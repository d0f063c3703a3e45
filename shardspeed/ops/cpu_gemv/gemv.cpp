// Products of a few activation rows with a plain row-major weight, on CPU: y = x W^T + b
// for x [M, K] with M <= 4 (a decode step at batch 1-4), W [N, K] and b [N], in fp32 or
// bf16, accumulated in fp32.
//
// Why: at these row counts a linear layer is a stream over its weight, and the product is
// bound by how fast the weight is read. oneDNN's kernel reads its blocked copy of the weight
// at 14-31 GB/s on a 2-core AVX-512 EPYC, where a plain sum over the same bytes runs at
// 24-43 GB/s; this kernel walks one weight row at a time, front to back, each thread over a
// contiguous range of rows, and reads at 18-43 GB/s at 1-2 rows (docs/inference.md has the
// table).
//
// Per output (m, n): 16 (fp32) or 16 x 2 (bf16, `vdpbf16ps` pairs) lane-wise partial sums
// over k in steps of one vector, then their horizontal sum, then the bias, then (bf16) one
// rounding to nearest even. The order does not depend on N, on the thread count or on the
// other rows, so a row gets the same result alone or beside others. It is not oneDNN's
// order: results differ from `F.linear` by fp32 rounding (bf16 outputs then by at most one
// bf16 step where the fp32 sums fall on different sides of a rounding boundary).

// Only the ATen / pybind headers used (not <torch/extension.h>, which pulls in all of libtorch's
// C++ API and triples the first-use build time: ~50 s -> ~20 s on a 2-core machine).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>

#include <cstdint>
#include <string>
#include <type_traits>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

// AVX2 + FMA without AVX-512 (e.g. AMD Zen 2/3): 8-lane vectors, two accumulators per row so
// each output still has 16 lane-wise partial sums over k; a bf16 weight is widened to fp32
// exactly (a 16-bit shift) and multiplied by the activations widened once per call, so every
// product is exact in fp32 and only the additions round, in an order fixed per output.
#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#define SS_GEMV_AVX2 1
#endif

namespace {

constexpr int64_t kMaxRows = 4;

#if defined(__AVX512F__)
template <int M>
inline void f32_row(const float* __restrict w, const float* __restrict x, int64_t K, float* sums) {
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const __m512 wv = _mm512_loadu_ps(w + k);
    for (int m = 0; m < M; ++m) acc[m] = _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + m * K + k), acc[m]);
  }
  if (k < K) {
    const __mmask16 mask = static_cast<__mmask16>((1u << (K - k)) - 1u);
    const __m512 wv = _mm512_maskz_loadu_ps(mask, w + k);
    for (int m = 0; m < M; ++m)
      acc[m] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(mask, x + m * K + k), acc[m]);
  }
  for (int m = 0; m < M; ++m) sums[m] = _mm512_reduce_add_ps(acc[m]);
}
#endif

#if defined(__AVX512BF16__) && defined(__AVX512BW__)
template <int M>
inline void bf16_row(const uint16_t* __restrict w, const uint16_t* __restrict x, int64_t K, float* sums) {
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    const __m512bh wv = (__m512bh)_mm512_loadu_si512(w + k);
    for (int m = 0; m < M; ++m)
      acc[m] = _mm512_dpbf16_ps(acc[m], wv, (__m512bh)_mm512_loadu_si512(x + m * K + k));
  }
  if (k < K) {
    const __mmask32 mask = static_cast<__mmask32>((uint64_t(1) << (K - k)) - 1u);
    const __m512bh wv = (__m512bh)_mm512_maskz_loadu_epi16(mask, w + k);
    for (int m = 0; m < M; ++m)
      acc[m] = _mm512_dpbf16_ps(acc[m], wv, (__m512bh)_mm512_maskz_loadu_epi16(mask, x + m * K + k));
  }
  for (int m = 0; m < M; ++m) sums[m] = _mm512_reduce_add_ps(acc[m]);
}
#endif

#if defined(SS_GEMV_AVX2)
inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// 8 weights as fp32: fp32 loaded, bf16 widened by a 16-bit shift (exact).
inline __m256 w8(const float* w) { return _mm256_loadu_ps(w); }
inline __m256 w8(const uint16_t* w) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(w));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}

inline __m256 w8(const int8_t* w) {
  const __m128i b = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(w));
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b));
}

// The last n < 8 elements, zero-padded.
template <typename TW>
inline __m256 w8_tail(const TW* w, int64_t n) {
  TW buf[8] = {};
  for (int64_t i = 0; i < n; ++i) buf[i] = w[i];
  return w8(buf);
}
inline __m256 x8_tail(const float* x, int64_t n) {
  float buf[8] = {};
  for (int64_t i = 0; i < n; ++i) buf[i] = x[i];
  return _mm256_loadu_ps(buf);
}

// sums[m] = sum_k w[k] x[m * K + k]; x is fp32 (bf16 activations are widened by the caller).
template <typename TW, int M>
inline void avx2_row(const TW* __restrict w, const float* __restrict x, int64_t K, float* sums) {
  __m256 lo[M], hi[M];
  for (int m = 0; m < M; ++m) lo[m] = hi[m] = _mm256_setzero_ps();
  int64_t k = 0;
  for (; k + 16 <= K; k += 16) {
    const __m256 a = w8(w + k), b = w8(w + k + 8);
    for (int m = 0; m < M; ++m) {
      lo[m] = _mm256_fmadd_ps(a, _mm256_loadu_ps(x + m * K + k), lo[m]);
      hi[m] = _mm256_fmadd_ps(b, _mm256_loadu_ps(x + m * K + k + 8), hi[m]);
    }
  }
  if (k + 8 <= K) {
    const __m256 a = w8(w + k);
    for (int m = 0; m < M; ++m) lo[m] = _mm256_fmadd_ps(a, _mm256_loadu_ps(x + m * K + k), lo[m]);
    k += 8;
  }
  if (k < K) {
    const __m256 b = w8_tail(w + k, K - k);
    for (int m = 0; m < M; ++m) hi[m] = _mm256_fmadd_ps(b, x8_tail(x + m * K + k, K - k), hi[m]);
  }
  for (int m = 0; m < M; ++m) sums[m] = hsum8(_mm256_add_ps(lo[m], hi[m]));
}

template <typename TW, int M>
inline void avx2_passes(const TW* w, const float* x, int64_t K, float* sums) {
  if constexpr (M <= 2) {
    avx2_row<TW, M>(w, x, K, sums);
  } else {
    avx2_row<TW, 2>(w, x, K, sums);
    avx2_passes<TW, M - 2>(w, x + 2 * K, K, sums + 2);
  }
}

// One thread's output rows [begin, end): T is the weight / bias / output dtype.
template <typename T, int M>
void avx2_rows(const T* w, const float* x, const T* bias, T* out, int64_t N, int64_t K,
               int64_t begin, int64_t end) {
  using TW = std::conditional_t<std::is_same_v<T, float>, float, uint16_t>;
  float sums[M];
  for (int64_t n = begin; n < end; ++n) {
    avx2_passes<TW, M>(reinterpret_cast<const TW*>(w + n * K), x, K, sums);
    const float b = bias != nullptr ? static_cast<float>(bias[n]) : 0.0f;
    for (int m = 0; m < M; ++m) out[m * N + n] = static_cast<T>(sums[m] + b);
  }
}

// int8 weight rows [begin, end) with per-row scales (T: activation / scale / output dtype).
template <typename T, int M>
void avx2_int8_rows(const int8_t* q, const float* x, const T* scales, T* out, int64_t N,
                    int64_t K, int64_t begin, int64_t end) {
  float sums[M];
  for (int64_t n = begin; n < end; ++n) {
    avx2_passes<int8_t, M>(q + n * K, x, K, sums);
    const float s = static_cast<float>(scales[n]);
    for (int m = 0; m < M; ++m) out[m * N + n] = static_cast<T>(sums[m] * s);
  }
}

template <typename T>
void avx2_dispatch(const T* w, const float* x, const T* bias, T* out, int64_t M, int64_t N,
                   int64_t K) {
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    switch (M) {
      case 1: avx2_rows<T, 1>(w, x, bias, out, N, K, begin, end); break;
      case 2: avx2_rows<T, 2>(w, x, bias, out, N, K, begin, end); break;
      case 3: avx2_rows<T, 3>(w, x, bias, out, N, K, begin, end); break;
      default: avx2_rows<T, 4>(w, x, bias, out, N, K, begin, end); break;
    }
  });
}
#endif

// Rows are taken two at a time per pass over a weight row: the row (at most a few KB) is read
// from DRAM by the first pass and from L1 by the second. One pass over 4 rows keeps 5 load
// streams going (the weight and 4 activation rows), and on the EPYC of these numbers that
// halved the weight's read rate (63M-Llama shapes, 1 thread: 4 rows in 13.0 ms against 7.3 ms
// in two passes of 2, 7.1 ms for 1 row). The sums are the same either way: each output's
// accumulator sees the same products in the same order.
constexpr int kRowsPerPass = 2;

// int8 weights (per-output-channel scales applied after the sum): each group of 16 int8 is
// widened to fp32 exactly, then multiplied as above (bf16 activations are widened too, so
// every product is exact in fp32 and only the additions round).
#if defined(__AVX512F__)
template <typename T>
inline __m512 act16(const T* x, __mmask16 mask) {
  if constexpr (std::is_same_v<T, float>) {
    return _mm512_maskz_loadu_ps(mask, x);
  } else {
    const __m256i h = _mm256_maskz_loadu_epi16(mask, x);
    return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
  }
}

template <typename T, int M>
inline void int8_row(const int8_t* __restrict w, const T* __restrict x, int64_t K, float* sums) {
  __m512 acc[M];
  for (int m = 0; m < M; ++m) acc[m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    const __mmask16 mask = K - k >= 16 ? static_cast<__mmask16>(0xFFFF)
                                       : static_cast<__mmask16>((1u << (K - k)) - 1u);
    const __m512 wv =
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_maskz_loadu_epi8(mask, w + k)));
    for (int m = 0; m < M; ++m) acc[m] = _mm512_fmadd_ps(wv, act16<T>(x + m * K + k, mask), acc[m]);
  }
  for (int m = 0; m < M; ++m) sums[m] = _mm512_reduce_add_ps(acc[m]);
}

template <typename T, int M>
inline void int8_passes(const int8_t* w, const T* x, int64_t K, float* sums) {
  if constexpr (M <= kRowsPerPass) {
    int8_row<T, M>(w, x, K, sums);
  } else {
    int8_row<T, kRowsPerPass>(w, x, K, sums);
    int8_passes<T, M - kRowsPerPass>(w, x + kRowsPerPass * K, K, sums + kRowsPerPass);
  }
}

template <typename T, int M>
void int8_rows(const int8_t* w, const T* x, const T* scales, T* out, int64_t N, int64_t K,
               int64_t begin, int64_t end) {
  float sums[M];
  for (int64_t n = begin; n < end; ++n) {
    int8_passes<T, M>(w + n * K, x, K, sums);
    const float s = static_cast<float>(scales[n]);
    for (int m = 0; m < M; ++m) out[m * N + n] = static_cast<T>(sums[m] * s);
  }
}
#endif


template <typename T, int M>
inline void row_pass(const T* w, const T* x, int64_t K, float* sums) {
  if constexpr (std::is_same_v<T, float>) {
#if defined(__AVX512F__)
    f32_row<M>(w, x, K, sums);
#endif
  } else {
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
    bf16_row<M>(reinterpret_cast<const uint16_t*>(w), reinterpret_cast<const uint16_t*>(x), K, sums);
#endif
  }
}

template <typename T, int M>
inline void row_passes(const T* w, const T* x, int64_t K, float* sums) {
  if constexpr (M <= kRowsPerPass) {
    row_pass<T, M>(w, x, K, sums);
  } else {
    row_pass<T, kRowsPerPass>(w, x, K, sums);
    row_passes<T, M - kRowsPerPass>(w, x + kRowsPerPass * K, K, sums + kRowsPerPass);
  }
}

// One thread's rows [begin, end) of the output, for M activation rows.
template <typename T, int M>
void rows(const T* w, const T* x, const T* bias, T* out, int64_t N, int64_t K, int64_t begin,
          int64_t end) {
  float sums[M];
  for (int64_t n = begin; n < end; ++n) {
    row_passes<T, M>(w + n * K, x, K, sums);
    const float b = bias != nullptr ? static_cast<float>(bias[n]) : 0.0f;
    for (int m = 0; m < M; ++m) out[m * N + n] = static_cast<T>(sums[m] + b);
  }
}

template <typename T>
void dispatch(const T* w, const T* x, const T* bias, T* out, int64_t M, int64_t N, int64_t K) {
  // Contiguous row ranges per thread; 16 rows at least so a thread's stream is long enough.
  at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
    switch (M) {
      case 1: rows<T, 1>(w, x, bias, out, N, K, begin, end); break;
      case 2: rows<T, 2>(w, x, bias, out, N, K, begin, end); break;
      case 3: rows<T, 3>(w, x, bias, out, N, K, begin, end); break;
      default: rows<T, 4>(w, x, bias, out, N, K, begin, end); break;
    }
  });
}

}  // namespace

// The dtypes this build has a kernel for (empty on a CPU without AVX-512 or AVX2 + FMA).
std::vector<std::string> dtypes() {
  std::vector<std::string> out;
#if defined(__AVX512F__) || defined(SS_GEMV_AVX2)
  out.emplace_back("float32");
#endif
#if (defined(__AVX512BF16__) && defined(__AVX512BW__)) || defined(SS_GEMV_AVX2)
  out.emplace_back("bfloat16");
#endif
  return out;
}

at::Tensor linear(const at::Tensor& x, const at::Tensor& w, const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && w.dim() == 2 && x.size(1) == w.size(1),
              "gemv linear: x must be [M, K] and w [N, K], got ", x.sizes(), " and ", w.sizes());
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxRows, "gemv linear: 1 to ", kMaxRows,
              " rows, got ", x.size(0));
  TORCH_CHECK(x.scalar_type() == w.scalar_type() && x.is_contiguous() && w.is_contiguous() &&
                  x.device().is_cpu() && w.device().is_cpu(),
              "gemv linear: x and w must be contiguous CPU tensors of one dtype");
  const bool has_bias = bias.has_value() && bias->defined();
  if (has_bias) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == w.size(0) && bias->is_contiguous() &&
                    bias->scalar_type() == w.scalar_type(),
                "gemv linear: bias must be a contiguous [N] tensor of w's dtype");
  }
  const int64_t M = x.size(0), K = x.size(1), N = w.size(0);
  auto out = at::empty({M, N}, x.options());
#if defined(__AVX512F__)
  if (x.scalar_type() == at::kFloat) {
    dispatch<float>(w.data_ptr<float>(), x.data_ptr<float>(),
                    has_bias ? bias->data_ptr<float>() : nullptr, out.data_ptr<float>(), M, N, K);
    return out;
  }
#endif
#if defined(__AVX512BF16__) && defined(__AVX512BW__)
  if (x.scalar_type() == at::kBFloat16) {
    using B = c10::BFloat16;
    dispatch<B>(w.data_ptr<B>(), x.data_ptr<B>(), has_bias ? bias->data_ptr<B>() : nullptr,
                out.data_ptr<B>(), M, N, K);
    return out;
  }
#endif
#if defined(SS_GEMV_AVX2)
  if (x.scalar_type() == at::kFloat) {
    avx2_dispatch<float>(w.data_ptr<float>(), x.data_ptr<float>(),
                         has_bias ? bias->data_ptr<float>() : nullptr, out.data_ptr<float>(), M, N,
                         K);
    return out;
  }
  if (x.scalar_type() == at::kBFloat16) {
    using B = c10::BFloat16;
    const at::Tensor x32 = x.to(at::kFloat);  // exact; once per call, not per weight row
    avx2_dispatch<B>(w.data_ptr<B>(), x32.data_ptr<float>(),
                     has_bias ? bias->data_ptr<B>() : nullptr, out.data_ptr<B>(), M, N, K);
    return out;
  }
#endif
  TORCH_CHECK(false, "gemv linear: no kernel for ", x.scalar_type(), " in this build");
}

// x [M <= 4, K] (fp32 or bf16) times int8 q [N, K] with per-row scales [N] of x's dtype:
// y[m, n] = scales[n] * sum_k x[m, k] q[n, k], as aten._weight_int8pack_mm defines it.
at::Tensor linear_int8(const at::Tensor& x, const at::Tensor& q, const at::Tensor& scales) {
  TORCH_CHECK(x.dim() == 2 && q.dim() == 2 && x.size(1) == q.size(1),
              "gemv linear_int8: x must be [M, K] and q [N, K], got ", x.sizes(), " and ", q.sizes());
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxRows, "gemv linear_int8: 1 to ", kMaxRows,
              " rows, got ", x.size(0));
  TORCH_CHECK(q.scalar_type() == at::kChar && q.is_contiguous() && x.is_contiguous() &&
                  x.device().is_cpu() && q.device().is_cpu(),
              "gemv linear_int8: x and q must be contiguous CPU tensors, q int8");
  TORCH_CHECK(scales.dim() == 1 && scales.size(0) == q.size(0) && scales.is_contiguous() &&
                  scales.scalar_type() == x.scalar_type(),
              "gemv linear_int8: scales must be a contiguous [N] tensor of x's dtype");
  const int64_t M = x.size(0), K = x.size(1), N = q.size(0);
  auto out = at::empty({M, N}, x.options());
#if defined(__AVX512F__)
  const int8_t* qp = q.data_ptr<int8_t>();
  auto run = [&](auto* xp, auto* sp, auto* op) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(xp)>>;
    at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
      switch (M) {
        case 1: int8_rows<T, 1>(qp, xp, sp, op, N, K, begin, end); break;
        case 2: int8_rows<T, 2>(qp, xp, sp, op, N, K, begin, end); break;
        case 3: int8_rows<T, 3>(qp, xp, sp, op, N, K, begin, end); break;
        default: int8_rows<T, 4>(qp, xp, sp, op, N, K, begin, end); break;
      }
    });
  };
  if (x.scalar_type() == at::kFloat) {
    run(x.data_ptr<float>(), scales.data_ptr<float>(), out.data_ptr<float>());
    return out;
  }
  if (x.scalar_type() == at::kBFloat16) {
    using B = c10::BFloat16;
    run(x.data_ptr<B>(), scales.data_ptr<B>(), out.data_ptr<B>());
    return out;
  }
#endif
#if defined(SS_GEMV_AVX2)
  if (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16) {
    const at::Tensor x32 = x.to(at::kFloat);  // exact; once per call
    const int8_t* qp = q.data_ptr<int8_t>();
    const float* xp = x32.data_ptr<float>();
    auto run = [&](auto* sp, auto* op) {
      using T = std::remove_const_t<std::remove_pointer_t<decltype(sp)>>;
      at::parallel_for(0, N, 16, [&](int64_t begin, int64_t end) {
        switch (M) {
          case 1: avx2_int8_rows<T, 1>(qp, xp, sp, op, N, K, begin, end); break;
          case 2: avx2_int8_rows<T, 2>(qp, xp, sp, op, N, K, begin, end); break;
          case 3: avx2_int8_rows<T, 3>(qp, xp, sp, op, N, K, begin, end); break;
          default: avx2_int8_rows<T, 4>(qp, xp, sp, op, N, K, begin, end); break;
        }
      });
    };
    if (x.scalar_type() == at::kFloat) {
      run(scales.data_ptr<float>(), out.data_ptr<float>());
    } else {
      using B = c10::BFloat16;
      run(scales.data_ptr<B>(), out.data_ptr<B>());
    }
    return out;
  }
#endif
  TORCH_CHECK(false, "gemv linear_int8: no kernel for ", x.scalar_type(), " in this build");
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("dtypes", &dtypes, "dtypes with a kernel in this build");
  m.def("linear", &linear, "x [M <= 4, K] @ w[N, K]^T + bias, fp32 accumulation");
  m.def("linear_int8", &linear_int8, "x [M <= 4, K] @ (scales * q[N, K])^T, int8 q");
}
