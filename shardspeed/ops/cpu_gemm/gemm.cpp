// fp32 products of many activation rows with a weight packed once, on CPUs with AVX2 + FMA and
// no AVX-512: y = x W^T + b for x [M, K], W [N, K] and b [N].
//
// Why: on such a CPU (AMD Zen 2/3) oneDNN's fp32 kernel reaches 100-135 GFLOP/s on a 200M
// Llama's shapes against a 213 GFLOP/s FMA peak on 2 cores, and the products are ~80% of a
// compute-bound FastGen run there (issue 30; docs/serving.md has the measurements).
//
// Layout: the weight is packed once in k-slices of kKc, each [panels][kc][16] (panels =
// ceil(N / 16), zero past N), so one k step of one panel is one 64-byte line. The activation
// rows are read as stored. A thread owns a contiguous range of panels; its loops are k-slices,
// groups of up to kTiles tiles (their rows' slice stays in L2), panels, tiles. One tile is 4-6
// rows (M is cut into ceil(M / 6) tiles as evenly as possible), whose 16 outputs per row sit
// in 2 x rows ymm accumulators while k runs over the slice; the weight slice (16 KiB) stays in
// L1 for all the group's tiles. Each block asks for its outputs' lines before it starts (they
// are re-read from L3 once per k-slice), and in small groups (decode: the weight is streamed
// from memory, used by at most kStreamTiles tiles) each block also asks for its share of the
// next panel's slice.
//
// Numerics: for each output, fp32 fused multiply-adds over k in order within a slice (one
// accumulator per output), the bias plus the first slice, then each later slice added in
// order: an order that depends on neither M, nor the other rows, nor the thread count, so a
// row gets the same result alone or in any batch. It is not oneDNN's order: results differ
// from `F.linear` by fp32 rounding.

// Only the ATen / pybind headers used (see shardspeed/ops/cpu_gemv/gemv.cpp).
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#if !defined(__AVX512F__) && defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define SS_GEMM_AVX2 1
#endif

namespace {

constexpr int64_t kNr = 16;          // outputs per weight panel (two ymm)
constexpr int64_t kMr = 6;           // most rows per tile
constexpr int64_t kKc = 256;         // k-slice depth (a panel's slice: 16 KiB)
constexpr int64_t kTiles = 20;       // tiles per group (120 rows: 120 KiB of activations)
constexpr int64_t kStreamTiles = 6;  // groups this small prefetch the next panel's slice

bool available() {
#if defined(SS_GEMM_AVX2)
  return true;
#else
  return false;
#endif
}

// Ask for 2 MiB pages over the 2 MiB-aligned part of a fresh buffer, before its first touch: a
// decode step streams every weight once, and with 4 KiB pages the page walks of ~800 MB of
// weights per step (200k pages) miss the caches too. Only an advice: where transparent huge
// pages are off ("never") or the call fails, the buffer keeps 4 KiB pages.
void advise_huge_pages(void* data, size_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t{1} << 21;
  const uintptr_t begin = (reinterpret_cast<uintptr_t>(data) + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (reinterpret_cast<uintptr_t>(data) + bytes) & ~(kHuge - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)data;
  (void)bytes;
#endif
}

// W [N, K] -> k-slices of kKc, each [panels][kc][16] (zero-padded past N).
at::Tensor pack(const at::Tensor& w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == at::kFloat && w.is_contiguous(),
              "cpu_gemm.pack: the weight must be a contiguous 2-D fp32 tensor, got ", w.sizes(),
              " ", w.scalar_type());
  const int64_t N = w.size(0), K = w.size(1);
  const int64_t panels = (N + kNr - 1) / kNr;
  at::Tensor out = at::empty({panels * kNr * K}, w.options());
  float* dst = out.data_ptr<float>();
  advise_huge_pages(dst, out.numel() * sizeof(float));
  std::fill(dst, dst + out.numel(), 0.0f);  // the padding past N (after the advice: first touch)
  const float* src = w.data_ptr<float>();
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
inline __m256i tail_mask(int64_t n) {
  alignas(32) static const int32_t ramp[8] = {0, 1, 2, 3, 4, 5, 6, 7};
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(n)),
                            _mm256_load_si256(reinterpret_cast<const __m256i*>(ramp)));
}

// The k loop of one block: acc[r] += x[r, k] * w[k, 0:16] for k in [k0, k1).
template <int MR>
inline void accumulate(const float* __restrict x, int64_t ldx, const float* __restrict wp,
                       int64_t k0, int64_t k1, __m256 (&acc0)[MR], __m256 (&acc1)[MR]) {
  for (int64_t k = k0; k < k1; ++k) {
    const __m256 b0 = _mm256_load_ps(wp + k * kNr);
    const __m256 b1 = _mm256_load_ps(wp + k * kNr + 8);
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
      const __m256 a = _mm256_broadcast_ss(x + r * ldx + k);
      acc0[r] = _mm256_fmadd_ps(a, b0, acc0[r]);
      acc1[r] = _mm256_fmadd_ps(a, b1, acc1[r]);
    }
  }
}

// y[r, 0:nn] (+)= x[r, 0:kc] . wp[kc][16] for r < MR (x at the slice's first column, rows
// ldx apart); `first`: the first k-slice, which adds the bias (if any) instead of y. `pf`:
// where `lines` lines of the next weight slice start, asked for one every kc / lines steps.
template <int MR>
void block(const float* __restrict x, int64_t ldx, const float* __restrict wp, int64_t kc,
           float* __restrict y, int64_t ldy, int64_t nn, const float* bias, bool first,
           const float* pf, int64_t lines) {
  if (!first) {
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
      __builtin_prefetch(y + r * ldy, 1, 3);
      __builtin_prefetch(y + r * ldy + 8, 1, 3);
    }
  }
  __m256 acc0[MR], acc1[MR];
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r) {
    acc0[r] = _mm256_setzero_ps();
    acc1[r] = _mm256_setzero_ps();
  }
  if (pf != nullptr && lines > 0) {
    const int64_t every = std::max<int64_t>(1, kc / lines);
    for (int64_t k0 = 0; k0 < kc; k0 += every) {
      if (lines-- > 0) __builtin_prefetch(pf + (k0 / every) * kNr, 0, 2);
      accumulate<MR>(x, ldx, wp, k0, std::min(kc, k0 + every), acc0, acc1);
    }
  } else {
    accumulate<MR>(x, ldx, wp, 0, kc, acc0, acc1);
  }
  const bool full = nn == kNr;
  const __m256i m0 = tail_mask(nn), m1 = tail_mask(nn - 8);
  __m256 c0 = _mm256_setzero_ps(), c1 = _mm256_setzero_ps();
  if (first && bias != nullptr) {
    c0 = full ? _mm256_loadu_ps(bias) : _mm256_maskload_ps(bias, m0);
    c1 = full ? _mm256_loadu_ps(bias + 8) : _mm256_maskload_ps(bias + 8, m1);
  }
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r) {
    float* yr = y + r * ldy;
    if (!first) {
      c0 = full ? _mm256_loadu_ps(yr) : _mm256_maskload_ps(yr, m0);
      c1 = full ? _mm256_loadu_ps(yr + 8) : _mm256_maskload_ps(yr + 8, m1);
    }
    if (full) {
      _mm256_storeu_ps(yr, _mm256_add_ps(c0, acc0[r]));
      _mm256_storeu_ps(yr + 8, _mm256_add_ps(c1, acc1[r]));
    } else {
      _mm256_maskstore_ps(yr, m0, _mm256_add_ps(c0, acc0[r]));
      _mm256_maskstore_ps(yr + 8, m1, _mm256_add_ps(c1, acc1[r]));
    }
  }
}

using BlockFn = void (*)(const float*, int64_t, const float*, int64_t, float*, int64_t, int64_t,
                         const float*, bool, const float*, int64_t);
constexpr BlockFn kBlocks[kMr + 1] = {nullptr,  &block<1>, &block<2>, &block<3>,
                                      &block<4>, &block<5>, &block<6>};
#endif

// x [M, K] @ W^T (+ bias) with W given by pack(): [M, N].
at::Tensor linear(const at::Tensor& x, const at::Tensor& packed, int64_t N,
                  const c10::optional<at::Tensor>& bias) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous(),
              "cpu_gemm.linear: x must be a contiguous 2-D fp32 tensor, got ", x.sizes(), " ",
              x.scalar_type());
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t panels = (N + kNr - 1) / kNr;
  TORCH_CHECK(N > 0 && K > 0 && packed.dim() == 1 && packed.numel() == panels * kNr * K &&
                  packed.scalar_type() == at::kFloat && packed.is_contiguous(),
              "cpu_gemm.linear: the packed weight ", packed.sizes(), " does not fit x ",
              x.sizes(), " and N = ", N);
  const float* b = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->dim() == 1 && bias->size(0) == N && bias->is_contiguous() &&
                    bias->scalar_type() == at::kFloat,
                "cpu_gemm.linear: the bias must be a contiguous fp32 [", N, "], got ",
                bias->sizes());
    b = bias->data_ptr<float>();
  }
  at::Tensor y = at::empty({M, N}, x.options());
  if (M == 0) return y;
#if defined(SS_GEMM_AVX2)
  // tiles of 4-6 rows (fewer when M < 4): tile t starts at row t * base + min(t, extra)
  const int64_t tiles = (M + kMr - 1) / kMr, base = M / tiles, extra = M % tiles;
  const float* xs = x.data_ptr<float>();
  const float* wp = packed.data_ptr<float>();
  float* ys = y.data_ptr<float>();
  at::parallel_for(0, panels, 1, [&](int64_t begin, int64_t end) {
    for (int64_t k0 = 0; k0 < K; k0 += kKc) {
      const int64_t kc = std::min(kKc, K - k0);
      const float* slice = wp + k0 * panels * kNr;
      for (int64_t g0 = 0; g0 < tiles; g0 += kTiles) {
        const int64_t g1 = std::min(tiles, g0 + kTiles), group = g1 - g0;
        // streamed weight: each block asks for its share of the next panel's slice (the
        // last panel of the range: this thread's first panel of the next k-slice)
        const int64_t share = group <= kStreamTiles ? (kc + group - 1) / group : 0;
        for (int64_t p = begin; p < end; ++p) {
          const float* wslice = slice + p * kc * kNr;
          const float* next = nullptr;
          int64_t next_lines = 0;
          if (share > 0) {
            if (p + 1 < end) {
              next = wslice + kc * kNr;
              next_lines = kc;
            } else if (k0 + kKc < K) {
              const int64_t kn = std::min(kKc, K - k0 - kKc);
              next = wp + (k0 + kKc) * panels * kNr + begin * kn * kNr;
              next_lines = kn;
            }
          }
          const int64_t nn = std::min(kNr, N - p * kNr);
          const float* bp = b != nullptr ? b + p * kNr : nullptr;
          for (int64_t t = g0; t < g1; ++t) {
            const int64_t row = t * base + std::min(t, extra);
            const int64_t mr = base + (t < extra ? 1 : 0);
            const int64_t done = (t - g0) * share;
            const bool asks = next != nullptr && done < next_lines;
            kBlocks[mr](xs + row * K + k0, K, wslice, kc, ys + row * N + p * kNr, N, nn, bp,
                        k0 == 0, asks ? next + done * kNr : nullptr,
                        asks ? std::min(share, next_lines - done) : 0);
          }
        }
      }
    }
  });
  return y;
#else
  TORCH_CHECK(false, "cpu_gemm.linear: this build has no AVX2 + FMA kernel (it is for CPUs "
                     "with AVX2 + FMA and no AVX-512)");
  return y;
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("available", &available, "whether this build has the AVX2 + FMA kernel");
  m.def("pack", &pack, "W [N, K] fp32 -> k-slices of [ceil(N/16)][kc][16]");
  m.def("linear", &linear, "x [M, K] @ W^T + bias with W packed by pack()");
}
