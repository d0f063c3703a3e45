// A probe, not a library kernel: fp32 products of many activation rows with a weight packed
// once, on CPUs with AVX2 + FMA: y = x W^T + b for x [M, K], W [N, K] and b [N]. Timed against
// oneDNN's packed product by benchmarks/cpu_gemm_probe.py (issue 30, 200M fp32 offline).
//
// Why: on AMD Zen 3 (2 cores, AVX2 + FMA, no AVX-512) oneDNN's fp32 kernel reaches 100-135
// GFLOP/s on a 200M Llama's shapes at 32-512 rows, against a 213 GFLOP/s FMA peak (160-180 for
// a 6 x 16 micro-kernel on L1 data with both cores busy); the products are ~80% of a
// compute-bound serving run there. The layout is the classic register-blocked one: the weight
// packed once in k-slices of 256, each [N / 16 panels][256][16] (zero-padded past N), the
// activations packed per call in tiles of 6 rows ([M / 6][K][6]), a 6 x 16 block of outputs
// held in 12 ymm accumulators while k runs over one slice (the weight slice, 16 KiB, stays in
// L1 for every tile that uses it).
//
// Loops, inside each thread's contiguous range of weight panels: k-slices, groups of 20 tiles
// (120 rows: their activation slices, 120 KiB, stay in L2), panels, tiles. The weight is read
// from memory once per tile group.
//
// Numerics: for each output, fp32 fused multiply-adds over k in order within a slice (one
// accumulator per output and lane), slices added in order, then the bias: an order that
// depends on neither M, nor the other rows, nor the thread count. It is not oneDNN's order:
// results differ from `F.linear` by fp32 rounding.

// Only the ATen / pybind headers used (see shardspeed/ops/cpu_gemv/gemv.cpp).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/zeros.h>
#include <torch/csrc/utils/pybind.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SS_GEMM_AVX2 1
#endif

namespace {

constexpr int64_t kNr = 16;     // outputs per weight panel (two ymm)
constexpr int64_t kMr = 6;      // activation rows per tile
constexpr int64_t kKc = 256;    // k-slice depth
constexpr int64_t kTiles = 20;  // tiles per group

bool available() {
#if defined(SS_GEMM_AVX2)
  return true;
#else
  return false;
#endif
}

// W [N, K] -> k-slices of kKc, each [panels][kc][16] (panels = ceil(N / 16), zero-padded past
// N): the slices a thread walks one after another lie one after another in memory.
at::Tensor pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.is_contiguous(),
              "gemm pack: the weight must be a contiguous 2-D fp32 tensor, got ", w.sizes(), " ",
              w.scalar_type());
  const int64_t N = w.size(0), K = w.size(1);
  const int64_t panels = (N + kNr - 1) / kNr;
  at::Tensor out = at::zeros({panels * kNr * K}, w.options());
  const float* src = w.data_ptr<float>();
  float* dst = out.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const int64_t n0 = p * kNr, nn = std::min(kNr, N - n0);
      for (int64_t k0 = 0; k0 < K; k0 += kKc) {
        const int64_t kc = std::min(kKc, K - k0);
        float* d = dst + k0 * panels * kNr + p * kc * kNr;
        for (int64_t j = 0; j < nn; ++j) {
          const float* s = src + (n0 + j) * K + k0;
          for (int64_t k = 0; k < kc; ++k) d[k * kNr + j] = s[k];
        }
      }
    }
  });
  return out;
}

#if defined(SS_GEMM_AVX2)
// x rows [m0, m0 + mr) -> [K][mr] at dst.
inline void pack_tile(const float* x, int64_t K, int64_t mr, float* dst) {
  for (int64_t k = 0; k < K; ++k)
    for (int64_t r = 0; r < mr; ++r) dst[k * mr + r] = x[r * K + k];
}

inline __m256i tail_mask(int64_t n) {
  alignas(32) static const int32_t ramp[8] = {0, 1, 2, 3, 4, 5, 6, 7};
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(n)),
                            _mm256_load_si256(reinterpret_cast<const __m256i*>(ramp)));
}

// y[r, 0:nn] (+)= xp[kc][MR] . wp[kc][16] for r < MR; `first`: no earlier slice, add bias.
template <int MR>
inline void block(const float* __restrict xp, const float* __restrict wp, int64_t kc,
                  float* __restrict y, int64_t ldy, int64_t nn, const float* bias, bool first) {
  __m256 acc0[MR], acc1[MR];
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r) {
    acc0[r] = _mm256_setzero_ps();
    acc1[r] = _mm256_setzero_ps();
  }
  for (int64_t k = 0; k < kc; ++k) {
    const __m256 b0 = _mm256_load_ps(wp + k * kNr);
    const __m256 b1 = _mm256_load_ps(wp + k * kNr + 8);
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
      const __m256 a = _mm256_broadcast_ss(xp + k * MR + r);
      acc0[r] = _mm256_fmadd_ps(a, b0, acc0[r]);
      acc1[r] = _mm256_fmadd_ps(a, b1, acc1[r]);
    }
  }
  if (nn == kNr) {
    __m256 c0 = _mm256_setzero_ps(), c1 = _mm256_setzero_ps();
    if (first && bias != nullptr) {
      c0 = _mm256_loadu_ps(bias);
      c1 = _mm256_loadu_ps(bias + 8);
    }
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
      float* yr = y + r * ldy;
      if (!first) {
        c0 = _mm256_loadu_ps(yr);
        c1 = _mm256_loadu_ps(yr + 8);
      }
      _mm256_storeu_ps(yr, _mm256_add_ps(c0, acc0[r]));
      _mm256_storeu_ps(yr + 8, _mm256_add_ps(c1, acc1[r]));
    }
    return;
  }
  const __m256i m0 = tail_mask(nn), m1 = tail_mask(nn - 8);
  __m256 c0 = _mm256_setzero_ps(), c1 = _mm256_setzero_ps();
  if (first && bias != nullptr) {
    c0 = _mm256_maskload_ps(bias, m0);
    c1 = _mm256_maskload_ps(bias + 8, m1);
  }
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r) {
    float* yr = y + r * ldy;
    if (!first) {
      c0 = _mm256_maskload_ps(yr, m0);
      c1 = _mm256_maskload_ps(yr + 8, m1);
    }
    _mm256_maskstore_ps(yr, m0, _mm256_add_ps(c0, acc0[r]));
    _mm256_maskstore_ps(yr + 8, m1, _mm256_add_ps(c1, acc1[r]));
  }
}

using BlockFn = void (*)(const float*, const float*, int64_t, float*, int64_t, int64_t,
                         const float*, bool);
constexpr BlockFn kBlocks[kMr + 1] = {nullptr,  &block<1>, &block<2>, &block<3>,
                                      &block<4>, &block<5>, &block<6>};
#endif

// x [M, K] @ W^T (+ bias) with W given by pack(): [M, N].
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                  const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "gemm linear: x must be a contiguous 2-D fp32 tensor, got ", x.sizes(), " ",
              x.scalar_type());
  const int64_t panels = (N + kNr - 1) / kNr;
  TORCH_CHECK(packed.dim() == 1 && packed.numel() == panels * kNr * x.size(1) &&
                  packed.scalar_type() == at::kFloat && packed.is_contiguous(),
              "gemm linear: the packed weight ", packed.sizes(), " does not fit x ", x.sizes(),
              " and N = ", N);
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous() &&
                    bias->scalar_type() == at::kFloat,
                "gemm linear: the bias must be a contiguous fp32 [", N, "], got ", bias->sizes());
    b = bias->data_ptr<float>();
  }
  const int64_t M = x.size(0), K = x.size(1);
  at::Tensor y = at::empty({M, N}, x.options());
#if defined(SS_GEMM_AVX2)
  const int64_t tiles = (M + kMr - 1) / kMr;
  std::vector<float> xp(static_cast<size_t>(tiles * kMr * K));
  const float* xs = x.data_ptr<float>();
  at::parallel_for(0, tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t)
      pack_tile(xs + t * kMr * K, K, std::min(kMr, M - t * kMr), xp.data() + t * kMr * K);
  });
  const float* wp = packed.data_ptr<float>();
  float* ys = y.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t k0 = 0; k0 < K; k0 += kKc) {
      const int64_t kc = std::min(kKc, K - k0);
      for (int64_t g0 = 0; g0 < tiles; g0 += kTiles) {
        const int64_t g1 = std::min(tiles, g0 + kTiles);
        for (int64_t p = begin; p < end; ++p) {
          const float* wslice = wp + k0 * panels * kNr + p * kc * kNr;
          const int64_t nn = std::min(kNr, N - p * kNr);
          const float* bp = b != nullptr ? b + p * kNr : nullptr;
          for (int64_t t = g0; t < g1; ++t) {
            const int64_t mr = std::min(kMr, M - t * kMr);
            kBlocks[mr](xp.data() + t * kMr * K + k0 * mr, wslice, kc,
                        ys + t * kMr * N + p * kNr, N, nn, bp, k0 == 0);
          }
        }
      }
    }
  });
  return y;
#else
  TORCH_CHECK(false, "gemm linear: this build has no AVX2 + FMA kernel");
  return y;
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &available, "whether this build has the AVX2 + FMA kernel");
  m.def("pack", &pack, "W [N, K] fp32 -> panels [ceil(N/16), K, 16]");
  m.def("linear", &linear, "x [M, K] @ W^T + bias with W packed by pack()");
}
