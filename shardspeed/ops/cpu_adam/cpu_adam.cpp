// Native CPU Adam / AdamW step for ShardSpeed's DeepSpeedCPUAdam.
//
// One call updates every tensor of a parameter group: fp32, CPU, contiguous parameters,
// gradients and optimizer states (exp_avg, exp_avg_sq), and increments each tensor's step
// count (a 0-dim tensor, as in torch's Adam state). The arithmetic follows torch's AdamW
// (torch.optim.AdamW, fused=True; torch 2.13's x86 build) operation by operation, fused
// multiply-adds included, with one exception, so that the two agree to about one ulp:
//
//   AdamW:  p = p * float(1 - lr * wd)          Adam (L2):  g = fma(p, wd, g)
//   m = fma(1 - beta1, g - m, m)                (torch's lerp)
//   v = fma((1 - beta2) * g, g, v * beta2)
//   denom = sqrt(v) * float(1 / sqrt(1 - beta2^t)) + eps
//   p = p + (-lr / (1 - beta1^t) * m) / denom
//
// m and v come out bit-identical to torch's fused kernel. The exception: torch divides
// sqrt(v) by sqrt(1 - beta2^t); multiplying by its inverse saves one vector division per
// element (11% of the step on in-cache shards) and changes denom by at most one ulp, so
// about 6% of the parameters differ from torch's by one ulp after a few steps. Bias
// corrections are computed in double, as torch does.
//
// Speed. On in-cache shards the step is bound by sqrt/div throughput, on larger ones by
// memory bandwidth. For the latter the AVX-512 / AVX2 path loads a block of 8 (AVX2: 4)
// vectors of each array before computing on any of them: a plain loop has one vector of
// each array in flight per iteration, its long sqrt/div chains fill the reorder buffer, and
// fewer cache misses overlap (measured: 4-5% slower than DeepSpeed's op at 10M elements,
// the blocked loop 2-3% faster). Other CPUs use a plain loop that the compiler vectorises.
// Both run the same templated update, so they round identically.
//
// Build flags (see builder.py): -O3 -march=native; -ffp-contract=off so that the compiler
// fuses no multiply-add except the explicit ones (torch's rounding); -fno-math-errno so
// that sqrt is a vector instruction; -fopenmp so that at::parallel_for runs on torch's
// intra-op OpenMP threads (torch.set_num_threads applies).

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/csrc/utils/pybind.h>

#include <cmath>
#include <cstdint>
#include <vector>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#define SHARDSPEED_CPU_ADAM_X86_VECTORS 1
#endif

namespace {

// Elements per at::parallel_for task: 32K fp32 = 128 KiB per array, large enough that
// small tensors stay on one thread and threads never share a cache line.
constexpr int64_t kGrainSize = 1 << 15;

enum class Decay { kNone, kL2, kDecoupled };

// Loop-invariant single-precision coefficients of one tensor's update.
struct Coefficients {
  float beta2;
  float one_minus_beta2;
  float lerp_weight;  // (1 - beta1), or (1 - beta1) - 1 when it is >= 0.5 (see below)
  bool lerp_from_grad;  // torch's lerp starts from the end point for weights >= 0.5
  float eps;
  float decay;  // kDecoupled: 1 - lr * wd; kL2: wd
  float neg_step_size;  // -lr / bias_correction1
  float inv_bias_correction2_sqrt;
};

// The coefficients as values of T (float, or a SIMD vector with every lane equal).
template <typename T>
struct Constants {
  explicit Constants(const Coefficients& c)
      : beta2(c.beta2),
        one_minus_beta2(c.one_minus_beta2),
        lerp_weight(c.lerp_weight),
        eps(c.eps),
        decay(c.decay),
        neg_step_size(c.neg_step_size),
        inv_bias_correction2_sqrt(c.inv_bias_correction2_sqrt),
        lerp_from_grad(c.lerp_from_grad) {}
  T beta2, one_minus_beta2, lerp_weight, eps, decay, neg_step_size, inv_bias_correction2_sqrt;
  bool lerp_from_grad;
};

inline float fused_multiply_add(float a, float b, float c) {
#ifdef __FMA__
  return std::fma(a, b, c);
#else
  return a * b + c;
#endif
}

inline float square_root(float x) {
  return std::sqrt(x);
}

// One element's (or one vector's) update, in torch's order of operations.
template <Decay kDecay, typename T>
inline void adam_update(T& p, T g, T& m, T& v, const Constants<T>& k) {
  if constexpr (kDecay == Decay::kDecoupled) {
    p = p * k.decay;
  } else if constexpr (kDecay == Decay::kL2) {
    g = fused_multiply_add(p, k.decay, g);
  }
  m = fused_multiply_add(k.lerp_weight, g - m, k.lerp_from_grad ? g : m);
  v = fused_multiply_add(k.one_minus_beta2 * g, g, v * k.beta2);
  const T denom = square_root(v) * k.inv_bias_correction2_sqrt + k.eps;
  p = p + (k.neg_step_size * m) / denom;
}

// Elements [begin, end) with a loop the compiler vectorises.
template <Decay kDecay>
void adam_loop(
    float* __restrict__ param,
    const float* __restrict__ grad,
    float* __restrict__ exp_avg,
    float* __restrict__ exp_avg_sq,
    int64_t begin,
    int64_t end,
    const Coefficients& c) {
  const Constants<float> k(c);
#pragma omp simd
  for (int64_t i = begin; i < end; ++i) {
    float p = param[i];
    float m = exp_avg[i];
    float v = exp_avg_sq[i];
    adam_update<kDecay>(p, grad[i], m, v, k);
    exp_avg[i] = m;
    exp_avg_sq[i] = v;
    param[i] = p;
  }
}

#ifdef SHARDSPEED_CPU_ADAM_X86_VECTORS
// A SIMD vector of floats with the few operations adam_update needs.
struct Vec {
#ifdef __AVX512F__
  using Raw = __m512;
  static constexpr int kLanes = 16;
  static constexpr int kGroup = 8;  // vectors per array per block (32 registers)
  static Raw broadcast(float x) { return _mm512_set1_ps(x); }
  static Vec load(const float* src) { return {_mm512_loadu_ps(src)}; }
  void store(float* dst) const { _mm512_storeu_ps(dst, raw); }
  friend Vec operator+(Vec a, Vec b) { return {_mm512_add_ps(a.raw, b.raw)}; }
  friend Vec operator-(Vec a, Vec b) { return {_mm512_sub_ps(a.raw, b.raw)}; }
  friend Vec operator*(Vec a, Vec b) { return {_mm512_mul_ps(a.raw, b.raw)}; }
  friend Vec operator/(Vec a, Vec b) { return {_mm512_div_ps(a.raw, b.raw)}; }
  friend Vec fused_multiply_add(Vec a, Vec b, Vec c) { return {_mm512_fmadd_ps(a.raw, b.raw, c.raw)}; }
  friend Vec square_root(Vec a) { return {_mm512_sqrt_ps(a.raw)}; }
#else
  using Raw = __m256;
  static constexpr int kLanes = 8;
  static constexpr int kGroup = 4;  // vectors per array per block (16 registers)
  static Raw broadcast(float x) { return _mm256_set1_ps(x); }
  static Vec load(const float* src) { return {_mm256_loadu_ps(src)}; }
  void store(float* dst) const { _mm256_storeu_ps(dst, raw); }
  friend Vec operator+(Vec a, Vec b) { return {_mm256_add_ps(a.raw, b.raw)}; }
  friend Vec operator-(Vec a, Vec b) { return {_mm256_sub_ps(a.raw, b.raw)}; }
  friend Vec operator*(Vec a, Vec b) { return {_mm256_mul_ps(a.raw, b.raw)}; }
  friend Vec operator/(Vec a, Vec b) { return {_mm256_div_ps(a.raw, b.raw)}; }
  friend Vec fused_multiply_add(Vec a, Vec b, Vec c) { return {_mm256_fmadd_ps(a.raw, b.raw, c.raw)}; }
  friend Vec square_root(Vec a) { return {_mm256_sqrt_ps(a.raw)}; }
#endif
  Vec() = default;
  Vec(Raw r) : raw(r) {}  // NOLINT(google-explicit-constructor)
  Vec(float x) : raw(broadcast(x)) {}  // NOLINT(google-explicit-constructor)
  Raw raw;
};

// Whole blocks of [begin, end); returns where the remainder starts. Each block loads
// kGroup vectors of every array before computing (see "Speed" above).
template <Decay kDecay>
int64_t adam_blocks(
    float* __restrict__ param,
    const float* __restrict__ grad,
    float* __restrict__ exp_avg,
    float* __restrict__ exp_avg_sq,
    int64_t begin,
    int64_t end,
    const Coefficients& c) {
  constexpr int kGroup = Vec::kGroup;
  constexpr int64_t kBlock = kGroup * Vec::kLanes;
  const Constants<Vec> k(c);
  int64_t i = begin;
  for (; i + kBlock <= end; i += kBlock) {
    Vec g[kGroup], m[kGroup], v[kGroup], p[kGroup];
    for (int j = 0; j < kGroup; ++j) g[j] = Vec::load(grad + i + j * Vec::kLanes);
    for (int j = 0; j < kGroup; ++j) m[j] = Vec::load(exp_avg + i + j * Vec::kLanes);
    for (int j = 0; j < kGroup; ++j) v[j] = Vec::load(exp_avg_sq + i + j * Vec::kLanes);
    for (int j = 0; j < kGroup; ++j) p[j] = Vec::load(param + i + j * Vec::kLanes);
    for (int j = 0; j < kGroup; ++j) adam_update<kDecay>(p[j], g[j], m[j], v[j], k);
    for (int j = 0; j < kGroup; ++j) p[j].store(param + i + j * Vec::kLanes);
    for (int j = 0; j < kGroup; ++j) m[j].store(exp_avg + i + j * Vec::kLanes);
    for (int j = 0; j < kGroup; ++j) v[j].store(exp_avg_sq + i + j * Vec::kLanes);
  }
  return i;
}
#endif  // SHARDSPEED_CPU_ADAM_X86_VECTORS

template <Decay kDecay>
void adam_span(
    float* param,
    const float* grad,
    float* exp_avg,
    float* exp_avg_sq,
    int64_t begin,
    int64_t end,
    const Coefficients& c) {
#ifdef SHARDSPEED_CPU_ADAM_X86_VECTORS
  begin = adam_blocks<kDecay>(param, grad, exp_avg, exp_avg_sq, begin, end, c);
#endif
  adam_loop<kDecay>(param, grad, exp_avg, exp_avg_sq, begin, end, c);
}

void check_operand(const at::Tensor& t, const at::Tensor& param, const char* what, size_t i) {
  TORCH_CHECK(
      t.device().is_cpu() && t.scalar_type() == at::kFloat && t.is_contiguous(),
      "shardspeed cpu_adam: ", what, "[", i, "] must be a contiguous float32 CPU tensor, got ",
      t.scalar_type(), " on ", t.device(), t.is_contiguous() ? "" : " (non-contiguous)");
  TORCH_CHECK(
      t.numel() == param.numel(), "shardspeed cpu_adam: ", what, "[", i, "] has ", t.numel(),
      " elements but params[", i, "] has ", param.numel());
}

// steps[i] += 1 (in the tensor's dtype, like torch's _foreach_add_); returns the new count.
double increment_step(const at::Tensor& step) {
  if (step.device().is_cpu() && step.scalar_type() == at::kFloat) {
    float* count = step.data_ptr<float>();
    *count += 1.0f;
    return *count;
  }
  step.add_(1);
  return step.item<double>();
}

using Tensors = std::vector<at::Tensor>;

void adam_step_(
    const Tensors& params,
    const Tensors& grads,
    const Tensors& exp_avgs,
    const Tensors& exp_avg_sqs,
    const Tensors& steps,
    double lr,
    double beta1,
    double beta2,
    double eps,
    double weight_decay,
    bool adamw_mode,
    bool bias_correction) {
  const size_t n = params.size();
  TORCH_CHECK(
      grads.size() == n && exp_avgs.size() == n && exp_avg_sqs.size() == n && steps.size() == n,
      "shardspeed cpu_adam: params, grads, exp_avgs, exp_avg_sqs and steps must have the same "
      "length, got ", n, ", ", grads.size(), ", ", exp_avgs.size(), ", ", exp_avg_sqs.size(),
      ", ", steps.size());
  const Decay decay_mode =
      weight_decay == 0.0 ? Decay::kNone : (adamw_mode ? Decay::kDecoupled : Decay::kL2);
  const double lerp_weight = 1.0 - beta1;
  for (size_t i = 0; i < n; ++i) {  // validate everything before changing anything
    check_operand(params[i], params[i], "params", i);
    check_operand(grads[i], params[i], "grads", i);
    check_operand(exp_avgs[i], params[i], "exp_avgs", i);
    check_operand(exp_avg_sqs[i], params[i], "exp_avg_sqs", i);
    TORCH_CHECK(steps[i].numel() == 1, "shardspeed cpu_adam: steps[", i, "] must hold one value");
  }
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& param = params[i];
    const double step = increment_step(steps[i]);
    const double bias_correction1 = bias_correction ? 1.0 - std::pow(beta1, step) : 1.0;
    const double bias_correction2 = bias_correction ? 1.0 - std::pow(beta2, step) : 1.0;
    Coefficients c{};
    c.beta2 = static_cast<float>(beta2);
    c.one_minus_beta2 = static_cast<float>(1.0 - beta2);
    c.lerp_from_grad = !(std::abs(static_cast<float>(lerp_weight)) < 0.5f);
    c.lerp_weight = c.lerp_from_grad ? static_cast<float>(lerp_weight) - 1.0f
                                     : static_cast<float>(lerp_weight);
    c.eps = static_cast<float>(eps);
    c.decay = static_cast<float>(adamw_mode ? 1.0 - lr * weight_decay : weight_decay);
    c.neg_step_size = static_cast<float>(-(lr / bias_correction1));
    c.inv_bias_correction2_sqrt = static_cast<float>(1.0 / std::sqrt(bias_correction2));

    float* p = param.data_ptr<float>();
    const float* g = grads[i].data_ptr<float>();
    float* m = exp_avgs[i].data_ptr<float>();
    float* v = exp_avg_sqs[i].data_ptr<float>();
    at::parallel_for(0, param.numel(), kGrainSize, [&](int64_t begin, int64_t end) {
      switch (decay_mode) {
        case Decay::kNone:
          adam_span<Decay::kNone>(p, g, m, v, begin, end, c);
          break;
        case Decay::kL2:
          adam_span<Decay::kL2>(p, g, m, v, begin, end, c);
          break;
        case Decay::kDecoupled:
          adam_span<Decay::kDecoupled>(p, g, m, v, begin, end, c);
          break;
      }
    });
  }
}

}  // namespace

// A Python module (pybind11) rather than a torch.ops operator: a call costs ~0.3 us instead
// of ~3.7 us through the dispatcher, and the GIL is released while the kernel runs.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "ShardSpeed's native CPU Adam/AdamW step (shardspeed/ops/cpu_adam)";
  m.def(
      "adam_step_",
      &adam_step_,
      "In-place Adam/AdamW step of fp32 contiguous CPU tensors; increments each step count.",
      pybind11::arg("params"),
      pybind11::arg("grads"),
      pybind11::arg("exp_avgs"),
      pybind11::arg("exp_avg_sqs"),
      pybind11::arg("steps"),
      pybind11::arg("lr"),
      pybind11::arg("beta1"),
      pybind11::arg("beta2"),
      pybind11::arg("eps"),
      pybind11::arg("weight_decay"),
      pybind11::arg("adamw_mode"),
      pybind11::arg("bias_correction"),
      pybind11::call_guard<pybind11::gil_scoped_release>());
}
