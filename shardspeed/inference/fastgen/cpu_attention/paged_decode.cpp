// Decode attention over FastGen's blocked KV cache, on CPU, in one call for every decoding
// sequence of a step.
//
// Each decoding sequence g has one query token at position context_lens[g] - 1; its keys
// live in k_cache[block_table[g][p / BS], p % BS] for p < context_lens[g]. The kernel reads
// them in place (no gathered copy of the blocks), accumulates in fp32 whatever the storage
// type (fp32, bf16, fp16), and writes the output in the query's type.
//
// Work item = (sequence, its KV heads; single KV heads when there are few sequences): the
// query heads that share a KV head (GQA) are computed together, so each key and value row
// is read and converted to fp32 once. Items are spread over torch's intra-op threads
// (at::parallel_for).
//
// Per item:  s[r, p] = scale * <q_r, k_p>          (optionally softcap * tanh(s / softcap))
//            w[r, p] = exp(s[r, p] - max_p s[r, p]) / sum_p exp(...)
//            out_r   = sum_p w[r, p] v_p
// over the keys p of the item's window (all of 0 .. ctx-1, or the last `window` of them).

// Only the ATen / pybind headers used (not <torch/extension.h>, which pulls in all of libtorch's
// C++ API and triples the first-use build time: ~50 s -> ~20 s on a 2-core machine).
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/csrc/utils/pybind.h>

#if defined(__AVX512F__)
#include <immintrin.h>
extern "C" __m512 Sleef_expf16_u10(__m512);  // torch's vectorised exp (libtorch_cpu exports it)
#define SS_PD_TILED 1
#elif defined(__AVX2__) && defined(__FMA__)
// AVX2 + FMA without AVX-512 (AMD Zen 2/3, for one): the same tiled path on 8-lane vectors,
// tiles of 8 keys.
#include <immintrin.h>
#define SS_PD_AVX2 1
#define SS_PD_TILED 1
#endif

#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

namespace {

template <typename T>
inline void load_float(const T* src, float* dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<float>(src[i]);
}

template <>
inline void load_float<float>(const float* src, float* dst, int64_t n) {
  std::memcpy(dst, src, static_cast<size_t>(n) * sizeof(float));
}

template <>
inline void load_float<c10::BFloat16>(const c10::BFloat16* src, float* dst, int64_t n) {
  // bf16 is the high half of an fp32: a shift, which the compiler vectorises.
  const uint16_t* bits = reinterpret_cast<const uint16_t*>(src);
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t wide = static_cast<uint32_t>(bits[i]) << 16;
    float value;
    std::memcpy(&value, &wide, sizeof(value));
    dst[i] = value;
  }
}

// exp(x) for x <= 0 (softmax of max-subtracted scores): 2^n * p(r) with x = n ln2 + r,
// |r| <= ln2 / 2, p a degree-6 polynomial (relative error ~2e-7). Branch-free, so the loop
// that calls it vectorises; std::exp does not.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.38888889e-3f;
  p = p * r + 8.33333333e-3f;
  p = p * r + 4.16666667e-2f;
  p = p * r + 1.66666667e-1f;
  p = p * r + 0.5f;
  p = p * r + 1.0f;
  p = p * r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

#if defined(__AVX512F__)
inline float dot(const float* a, const float* b, int64_t n) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  }
  if (i < n) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - i)) - 1u);
    acc = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(tail, a + i), _mm512_maskz_loadu_ps(tail, b + i),
                          acc);
  }
  return _mm512_reduce_add_ps(acc);
}

inline void axpy(float w, const float* x, float* y, int64_t n) {
  const __m512 wv = _mm512_set1_ps(w);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    _mm512_storeu_ps(y + i, _mm512_fmadd_ps(wv, _mm512_loadu_ps(x + i), _mm512_loadu_ps(y + i)));
  }
  if (i < n) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (n - i)) - 1u);
    const __m512 sum = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(tail, x + i),
                                       _mm512_maskz_loadu_ps(tail, y + i));
    _mm512_mask_storeu_ps(y + i, tail, sum);
  }
}

// The 16 horizontal sums of v[0..15], as one vector in key order: a shuffle tree (about 3
// instructions per sum instead of ~8 for a reduce per vector).
inline __m512 sum16(const __m512* v) {
  __m512 w[8];
  for (int i = 0; i < 8; ++i) {  // each 128-bit lane pair of w[i]: partials of v[2i], v[2i+1]
    const __m512 a = _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0));
    const __m512 b = _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2));
    w[i] = _mm512_add_ps(a, b);
  }
  __m512 x[4];
  for (int i = 0; i < 4; ++i) {  // 128-bit lane k of x[i]: 4 partials of v[4i + k]
    const __m512 a = _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0));
    const __m512 b = _mm512_shuffle_f32x4(w[2 * i], w[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1));
    x[i] = _mm512_add_ps(a, b);
  }
  const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(x[0], x[1]), _mm512_unpackhi_ps(x[0], x[1]));
  const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(x[2], x[3]), _mm512_unpackhi_ps(x[2], x[3]));
  const __m512 r = _mm512_add_ps(
      _mm512_castpd_ps(_mm512_unpacklo_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23))),
      _mm512_castpd_ps(_mm512_unpackhi_pd(_mm512_castps_pd(s01), _mm512_castps_pd(s23))));
  // element 4k + m of r is the sum of v[4m + k]
  const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  return _mm512_permutexvar_ps(order, r);
}

// out[j] = <q, tile[j]> for the 16 fp32 rows tile + j * stride (rows past the keys: any
// finite values).
inline void dots_tile(const float* q, const float* tile, int64_t stride, int64_t d, float* out) {
  __m512 acc[16];
  for (int j = 0; j < 16; ++j) acc[j] = _mm512_setzero_ps();
  int64_t c = 0;
  for (; c + 16 <= d; c += 16) {
    const __m512 qv = _mm512_loadu_ps(q + c);
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) {
      acc[j] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(tile + j * stride + c), acc[j]);
    }
  }
  if (c < d) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (d - c)) - 1u);
    const __m512 qv = _mm512_maskz_loadu_ps(tail, q + c);
#pragma GCC unroll 16
    for (int j = 0; j < 16; ++j) {
      acc[j] = _mm512_fmadd_ps(qv, _mm512_maskz_loadu_ps(tail, tile + j * stride + c), acc[j]);
    }
  }
  _mm512_storeu_ps(out, sum16(acc));
}

// acc += sum_j w[j] * tile[j] over the first n fp32 rows tile + j * stride.
inline void weighted_rows(const float* w, const float* tile, int64_t stride, int64_t n, int64_t d,
                          float* acc) {
  int64_t c = 0;
  for (; c + 16 <= d; c += 16) {
    __m512 a = _mm512_loadu_ps(acc + c);
    for (int64_t j = 0; j < n; ++j) {
      a = _mm512_fmadd_ps(_mm512_set1_ps(w[j]), _mm512_loadu_ps(tile + j * stride + c), a);
    }
    _mm512_storeu_ps(acc + c, a);
  }
  if (c < d) {
    const __mmask16 tail = static_cast<__mmask16>((1u << (d - c)) - 1u);
    __m512 a = _mm512_maskz_loadu_ps(tail, acc + c);
    for (int64_t j = 0; j < n; ++j) {
      a = _mm512_fmadd_ps(_mm512_set1_ps(w[j]),
                          _mm512_maskz_loadu_ps(tail, tile + j * stride + c), a);
    }
    _mm512_mask_storeu_ps(acc + c, tail, a);
  }
}
#else
inline float dot(const float* a, const float* b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

inline void axpy(float w, const float* x, float* y, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) y[i] += w * x[i];
}
#endif

#if defined(SS_PD_AVX2)
// Lanes [0, n) of 8 set (n <= 8).
inline __m256i lanes8(int64_t n) {
  return _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int32_t>(n)),
                            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
}

// The 8 horizontal sums of v[0..7], as one vector in key order: two rounds of pairwise adds
// within 128-bit halves, then the halves added.
inline __m256 sum8(const __m256* v) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(v[0], v[1]), _mm256_hadd_ps(v[2], v[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(v[4], v[5]), _mm256_hadd_ps(v[6], v[7]));
  // u0's low half: v[0..3] summed over elements 0-3; its high half: over elements 4-7
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// out[j] = <q, tile[j]> for the 8 fp32 rows tile + j * stride (rows past the keys: any
// finite values).
inline void dots_tile(const float* q, const float* tile, int64_t stride, int64_t d, float* out) {
  __m256 acc[8];
  for (int j = 0; j < 8; ++j) acc[j] = _mm256_setzero_ps();
  int64_t c = 0;
  for (; c + 8 <= d; c += 8) {
    const __m256 qv = _mm256_loadu_ps(q + c);
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      acc[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(tile + j * stride + c), acc[j]);
    }
  }
  if (c < d) {
    const __m256i tail = lanes8(d - c);
    const __m256 qv = _mm256_maskload_ps(q + c, tail);
#pragma GCC unroll 8
    for (int j = 0; j < 8; ++j) {
      acc[j] = _mm256_fmadd_ps(qv, _mm256_maskload_ps(tile + j * stride + c, tail), acc[j]);
    }
  }
  _mm256_storeu_ps(out, sum8(acc));
}

// acc += sum_j w[j] * tile[j] over the first n fp32 rows tile + j * stride.
inline void weighted_rows(const float* w, const float* tile, int64_t stride, int64_t n, int64_t d,
                          float* acc) {
  int64_t c = 0;
  for (; c + 8 <= d; c += 8) {
    __m256 a = _mm256_loadu_ps(acc + c);
    for (int64_t j = 0; j < n; ++j) {
      a = _mm256_fmadd_ps(_mm256_set1_ps(w[j]), _mm256_loadu_ps(tile + j * stride + c), a);
    }
    _mm256_storeu_ps(acc + c, a);
  }
  if (c < d) {
    const __m256i tail = lanes8(d - c);
    __m256 a = _mm256_maskload_ps(acc + c, tail);
    for (int64_t j = 0; j < n; ++j) {
      a = _mm256_fmadd_ps(_mm256_set1_ps(w[j]), _mm256_maskload_ps(tile + j * stride + c, tail),
                          a);
    }
    _mm256_maskstore_ps(acc + c, tail, a);
  }
}
#endif

// s[0..n) <- exp(scale * s - max) (scores capped first with softcap > 0); *inv_total gets
// 1 / their sum (the normalisation is applied to the output).
inline void softmax_row(float* s, int64_t n, float scale, float softcap, float* inv_total) {
  float mx = -std::numeric_limits<float>::infinity();
  if (softcap > 0.f) {
    for (int64_t j = 0; j < n; ++j) {
      s[j] = std::tanh(s[j] * scale / softcap) * softcap;
      mx = std::max(mx, s[j]);
    }
  } else {
#if defined(__AVX512F__)
    const __m512 sv = _mm512_set1_ps(scale);
    __m512 mv = _mm512_set1_ps(mx);
    int64_t j = 0;
    for (; j + 16 <= n; j += 16) {
      const __m512 v = _mm512_mul_ps(_mm512_loadu_ps(s + j), sv);
      _mm512_storeu_ps(s + j, v);
      mv = _mm512_max_ps(mv, v);
    }
    mx = _mm512_reduce_max_ps(mv);
    for (; j < n; ++j) {
      s[j] *= scale;
      mx = std::max(mx, s[j]);
    }
#else
    for (int64_t j = 0; j < n; ++j) {
      s[j] *= scale;
      mx = std::max(mx, s[j]);
    }
#endif
  }
  float total = 0.f;
#if defined(__AVX512F__)
  const __m512 mv = _mm512_set1_ps(mx);
  __m512 tv = _mm512_setzero_ps();
  int64_t j = 0;
  for (; j + 16 <= n; j += 16) {
    const __m512 e = Sleef_expf16_u10(_mm512_sub_ps(_mm512_loadu_ps(s + j), mv));
    _mm512_storeu_ps(s + j, e);
    tv = _mm512_add_ps(tv, e);
  }
  total = _mm512_reduce_add_ps(tv);
  for (; j < n; ++j) {
    s[j] = exp_nonpositive(s[j] - mx);
    total += s[j];
  }
#else
#pragma omp simd reduction(+ : total)
  for (int64_t j = 0; j < n; ++j) {
    s[j] = exp_nonpositive(s[j] - mx);
    total += s[j];
  }
#endif
  *inv_total = 1.f / total;
}

#if defined(SS_PD_TILED)
// Asks for the `bytes` at `p` to be brought to the cache ahead of use: the next tile of a
// sequence is in another block, anywhere in the cache, which no hardware prefetcher predicts.
inline void prefetch_rows(const void* p, int64_t bytes) {
  const char* c = static_cast<const char*>(p);
  for (int64_t off = 0; off < bytes; off += 64) _mm_prefetch(c + off, _MM_HINT_T0);
}

// Keys per tile: one vector of scores (16 with AVX-512, 8 with AVX2).
#if defined(SS_PD_AVX2)
constexpr int64_t kTile = 8;
#else
constexpr int64_t kTile = 16;
#endif

// One tile of up to kTile consecutive keys (or values) of one sequence inside one block, as
// fp32 rows for the heads h0 .. h0 + group: head hh's row j is at
// `rows + hh * head_step + j * stride`.
struct Tile {
  const float* rows;
  int64_t head_step, stride, count, stop;
};

// The tile starting at key p (the next tile's rows prefetched): converted into `buf`
// ([group, kTile, D]), or read in place for an fp32 cache when the tile has at least
// `in_place_rows` keys (a reader of all kTile rows must not run past a short tile's block).
template <typename T>
Tile load_tile(const T* cache, const int64_t* blocks, int64_t p, int64_t ctx,
               int64_t block_size, int64_t num_kv, int64_t h0, int64_t group, int64_t head_dim,
               int64_t in_place_rows, float* buf) {
  const int64_t row_elems = num_kv * head_dim;
  const int64_t stop = std::min({ctx, (p / block_size + 1) * block_size, p + kTile});
  const int64_t nt = stop - p;
  const T* first = cache + (blocks[p / block_size] * block_size + p % block_size) * row_elems +
                   h0 * head_dim;
  if (stop < ctx) {  // the next tile is in another block, which no prefetcher predicts
    const int64_t next = blocks[stop / block_size] * block_size + stop % block_size;
    for (int64_t j = 0; j < std::min<int64_t>(kTile, ctx - stop); ++j) {
      prefetch_rows(cache + (next + j) * row_elems + h0 * head_dim,
                    group * head_dim * static_cast<int64_t>(sizeof(T)));
    }
  }
  if (std::is_same<T, float>::value && nt >= in_place_rows) {
    return {reinterpret_cast<const float*>(first), head_dim, row_elems, nt, stop};
  }
  if (group == num_kv) {  // every head: the tile's rows are one contiguous run, one loop
    load_float<T>(first, buf, nt * row_elems);  // [nt, num_kv, D], as the cache lays it out
    return {buf, head_dim, row_elems, nt, stop};
  }
  for (int64_t j = 0; j < nt; ++j) {  // each row read once, all heads of the item
    for (int64_t hh = 0; hh < group; ++hh) {
      load_float<T>(first + j * row_elems + hh * head_dim, buf + (hh * kTile + j) * head_dim,
                    head_dim);
    }
  }
  return {buf, kTile * head_dim, head_dim, nt, stop};
}
#endif

// Keys per sequence up to which the vector path scores tiles of kTile keys (AVX-512: measured
// 1.2-2.5x the per-key loop for 8-24 decodes of 30-380 keys); longer contexts keep the
// per-key loop, which measured faster for 64 decodes of 100-1000 keys (DRAM-bound there).
#if defined(SS_PD_AVX2)
// With AVX2 (tiles of 8) the tiled path measured faster at every length: 64 decodes of
// 100-1000 keys, 16 / 4 heads, 2 threads, fp32 8.2 against 10.1 ms, bf16 6.0 against 9.3.
constexpr int64_t kMaxTiledContext = std::numeric_limits<int64_t>::max();
#else
constexpr int64_t kMaxTiledContext = 512;
#endif

template <typename T>
void decode_impl(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                 const at::Tensor& block_table, const at::Tensor& context_lens, at::Tensor& out,
                 double scale, int64_t window, double softcap) {
  const int64_t num_seqs = q.size(0), num_heads = q.size(1), head_dim = q.size(2);
  const int64_t block_size = k_cache.size(1), num_kv = k_cache.size(2);
  const int64_t rep = num_heads / num_kv;
  const int64_t max_blocks = block_table.size(1);
  const T* qp = q.data_ptr<T>();
  const T* kp = k_cache.data_ptr<T>();
  const T* vp = v_cache.data_ptr<T>();
  T* op = out.data_ptr<T>();
  const int64_t* table = block_table.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  const float fscale = static_cast<float>(scale);
  const float fcap = static_cast<float>(softcap);

  // Work item = (sequence, a run of `group` consecutive KV heads). With enough sequences a
  // run is every KV head: each key / value row (all heads side by side) is then read once,
  // whole cache lines, by one thread. With few sequences (batch-1 decode) items are single
  // heads so that every thread gets work.
  const int64_t group = num_seqs >= 2 * at::get_num_threads() ? num_kv : 1;
  const int64_t runs = num_kv / group;
  at::parallel_for(0, num_seqs * runs, 1, [&](int64_t begin, int64_t end) {
    const int64_t rows = group * rep;  // query heads of one item
    std::vector<float> qf(rows * head_dim), row(head_dim), acc(rows * head_dim), inv_sum(rows);
    std::vector<float> scores;
    std::vector<float> tile(group * 16 * head_dim);  // [group, kTile, D]: key or value rows, fp32
    alignas(64) float tile_scores[16];
    for (int64_t item = begin; item < end; ++item) {
      const int64_t g = item / runs, h0 = (item % runs) * group;
      const int64_t ctx = lens[g];
      const int64_t first = (window > 0 && ctx > window) ? ctx - window : 0;
      const int64_t n = ctx - first;
      scores.resize(static_cast<size_t>(rows * n));
      const int64_t q_row = g * num_heads + h0 * rep;  // first query head of this item
      for (int64_t r = 0; r < rows; ++r) {
        load_float<T>(qp + (q_row + r) * head_dim, qf.data() + r * head_dim, head_dim);
      }
      const int64_t* blocks = table + g * max_blocks;
#if defined(SS_PD_TILED)
      if (n <= kMaxTiledContext) {
        // keys first .. ctx-1 in tiles of up to kTile inside one block: a KV head's key rows are
        // converted to fp32 once into `tile`, then each query head takes kTile dot products at a
        // time (rows of `tile` past the tile's keys hold stale finite values or zeros, whose
        // dot products are never stored)
        for (int64_t p = first; p < ctx;) {
          const Tile t = load_tile<T>(kp, blocks, p, ctx, block_size, num_kv, h0, group,
                                      head_dim, kTile, tile.data());  // dots_tile reads kTile rows
          for (int64_t hh = 0; hh < group; ++hh) {
            for (int64_t r = hh * rep; r < (hh + 1) * rep; ++r) {
              dots_tile(qf.data() + r * head_dim, t.rows + hh * t.head_step, t.stride, head_dim,
                     tile_scores);
              std::copy(tile_scores, tile_scores + t.count, scores.data() + r * n + (p - first));
            }
          }
          p = t.stop;
        }
      } else
#endif
      {
        // keys first .. ctx-1, walked block by block (no division per key)
        for (int64_t p = first; p < ctx;) {
          const int64_t base = blocks[p / block_size] * block_size;
          const int64_t stop = std::min(ctx, (p / block_size + 1) * block_size);
          for (; p < stop; ++p) {
            const T* key = kp + ((base + p % block_size) * num_kv + h0) * head_dim;
            float* col = scores.data() + (p - first);
            for (int64_t hh = 0; hh < group; ++hh) {
              load_float<T>(key + hh * head_dim, row.data(), head_dim);
              for (int64_t r = hh * rep; r < (hh + 1) * rep; ++r) {
                col[r * n] = dot(qf.data() + r * head_dim, row.data(), head_dim);
              }
            }
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        softmax_row(scores.data() + r * n, n, fscale, fcap, &inv_sum[r]);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
#if defined(SS_PD_TILED)
      if (n <= kMaxTiledContext) {
        for (int64_t p = first; p < ctx;) {  // the same tiles: value rows converted once
          const Tile t = load_tile<T>(vp, blocks, p, ctx, block_size, num_kv, h0, group,
                                      head_dim, 1, tile.data());
          for (int64_t hh = 0; hh < group; ++hh) {
            for (int64_t r = hh * rep; r < (hh + 1) * rep; ++r) {
              weighted_rows(scores.data() + r * n + (p - first), t.rows + hh * t.head_step,
                            t.stride, t.count, head_dim, acc.data() + r * head_dim);
            }
          }
          p = t.stop;
        }
      } else
#endif
      {
        for (int64_t p = first; p < ctx;) {
          const int64_t base = blocks[p / block_size] * block_size;
          const int64_t stop = std::min(ctx, (p / block_size + 1) * block_size);
          for (; p < stop; ++p) {
            const T* value = vp + ((base + p % block_size) * num_kv + h0) * head_dim;
            for (int64_t hh = 0; hh < group; ++hh) {
              load_float<T>(value + hh * head_dim, row.data(), head_dim);
              for (int64_t r = hh * rep; r < (hh + 1) * rep; ++r) {
                axpy(scores[r * n + (p - first)], row.data(), acc.data() + r * head_dim, head_dim);
              }
            }
          }
        }
      }
      for (int64_t r = 0; r < rows; ++r) {
        T* dst = op + (q_row + r) * head_dim;
        const float* src = acc.data() + r * head_dim;
        for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<T>(src[d] * inv_sum[r]);
      }
    }
  });
}

at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                        const at::Tensor& block_table, const at::Tensor& context_lens,
                        double scale, int64_t window, double softcap) {
  TORCH_CHECK(q.dim() == 3, "q must be [num_seqs, num_heads, head_dim], got ", q.sizes());
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.sizes() == k_cache.sizes(),
              "k_cache / v_cache must both be [num_blocks, block_size, num_kv_heads, head_dim]");
  TORCH_CHECK(k_cache.size(3) == q.size(2), "head_dim of q and the cache differ");
  TORCH_CHECK(q.size(1) % k_cache.size(2) == 0, "num_heads must be a multiple of num_kv_heads");
  TORCH_CHECK(q.scalar_type() == k_cache.scalar_type() &&
                  q.scalar_type() == v_cache.scalar_type(),
              "q and the KV cache must have one dtype");
  TORCH_CHECK(block_table.scalar_type() == at::kLong && context_lens.scalar_type() == at::kLong,
              "block_table and context_lens must be int64");
  TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) == q.size(0) &&
                  context_lens.numel() == q.size(0),
              "block_table must be [num_seqs, max_blocks] and context_lens [num_seqs]");
  TORCH_CHECK(q.device().is_cpu() && k_cache.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(k_cache.is_contiguous() && v_cache.is_contiguous(), "the cache must be contiguous");
  const at::Tensor qc = q.contiguous();
  const at::Tensor table = block_table.contiguous();
  const at::Tensor lens = context_lens.contiguous();
  at::Tensor out = at::empty_like(qc);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, qc.scalar_type(), "paged_decode", [&] {
    decode_impl<scalar_t>(qc, k_cache, v_cache, table, lens, out, scale, window, softcap);
  });
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode,
        "Decode attention of one query token per sequence over the blocked KV cache",
        py::arg("q"), py::arg("k_cache"), py::arg("v_cache"), py::arg("block_table"),
        py::arg("context_lens"), py::arg("scale"), py::arg("window"), py::arg("softcap"));
}
