// Fused Adam/AdamW on the CPU (Apex's FusedAdam): mpnb::fused_adam_.
//
// The arithmetic mirrors PyTorch's own CPU fused kernel operation by operation (an explicit
// fmadd where its build contracts one, no silent contraction elsewhere; the last partial vector
// of each tensor as its scalar tail rounds), so an fp32 step equals
// torch.optim.AdamW(fused=True) bit for bit at any size, and the one-pass mixed-precision step
// equals "unscale, check, update the fp32 master, cast" bit for bit.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "cpu/autograd.h"
#include "cpu/opt_common.h"
#include "cpu/rounding.h"

namespace mpnb::cpu::opt {

// ---- Adam / AdamW ----------------------------------------------------------------------

// The path of an fp32 step without masters, per tensor. A tensor of at least kTorchRouteElems
// elements goes to PyTorch's own fused CPU op (at::_fused_adamw_ / _fused_adam_), which
// computes the same bits (tests/core/ops/test_adam.py) and streams one large
// tensor at least as fast as the chunk walk; smaller tensors stay on the multi-tensor walk,
// which pays one parallel region for all of them where PyTorch's op pays one per tensor.
// Measured side by side in one process (one list of equal tensors, 8M elements in all, 1
// thread, time of PyTorch's op / time of ours, on a shared machine: +-10% noise): 2^12 1.14,
// 2^14 1.01, 2^16 0.84, 2^17 1.01, 2^18 1.01, 2^19 0.98, 2^20 0.90 (three runs: 0.89, 0.90,
// 0.99); the GPT workload of `mpnb bench optimizers` (76 tensors, the largest 8.9M elements)
// was 0.89 at 1 thread before this route. From 2^20 elements (28 MiB of traffic a step)
// ours shows no gain at 1 thread, and PyTorch's one parallel region per tensor (microseconds)
// is under 1% of the tensor's time at 2 threads, where our single region won on the GPT
// workload (1.05x). Mirrored in Python as mpnb.core.ops.adam.TORCH_ROUTE_ELEMS
// (tests/core/ops/test_adam_route.py checks that both agree; `mpnb doctor` shows the path it
// observes on each side of it).
constexpr int64_t kTorchRouteElems = int64_t{1} << 20;

// Flags the tensors that PyTorch's fused op takes (none unless the call is one its op computes
// bit for bit: fp32 params and grads, no masters, bias correction, no grad scale).
template <class L>
std::vector<char> torch_routed(const L& params, const L& grads, const L& masters,
                               bool bias_correction, float inv) {
  std::vector<char> out;
  if (!masters.empty() || !bias_correction || inv != 1.0f) return out;
  if (params[0].scalar_type() != at::kFloat || grads[0].scalar_type() != at::kFloat) return out;
  out.assign(params.size(), 0);
  bool any = false;
  for (size_t i = 0; i < params.size(); ++i) {
    out[i] = params[i].numel() >= kTorchRouteElems;
    any = any || out[i];
  }
  if (!any) out.clear();
  return out;
}

// Run PyTorch's fused step on the flagged tensors (their step counts already advanced, as
// torch.optim's fused AdamW does before it calls the op).
template <class L>
void torch_fused_step(const std::vector<char>& routed, const L& params, const L& grads,
                      const L& exp_avgs, const L& exp_avg_sqs, const L& steps, double lr,
                      double beta1, double beta2, double eps, double weight_decay,
                      bool adam_w_mode) {
  std::vector<at::Tensor> p, g, m, v, s;
  for (size_t i = 0; i < routed.size(); ++i) {
    if (!routed[i]) continue;
    p.push_back(params[i]);
    g.push_back(grads[i]);
    m.push_back(exp_avgs[i]);
    v.push_back(exp_avg_sqs[i]);
    s.push_back(steps[i]);
  }
  // Below autograd already (autograd.h bumps the version counters of every written tensor).
  at::AutoDispatchBelowADInplaceOrView guard;
  if (adam_w_mode)
    at::_fused_adamw_(p, g, m, v, {}, s, lr, beta1, beta2, weight_decay, eps, false, false);
  else
    at::_fused_adam_(p, g, m, v, {}, s, lr, beta1, beta2, weight_decay, eps, false, false);
}

struct AdamBody {
  fVec lerp_coeff, lerp_mask, beta2, c2, eps, wd, decay_mul;
  bool adam_w, has_wd;
  const std::vector<float>* neg_step_size;  // per tensor: -lr / bias_correction1
  const std::vector<ScalarDivisor>* bc2_sqrt;  // per tensor: sqrt(bias_correction2)

  template <bool kScalarTail>
  C10_ALWAYS_INLINE void update(int64_t t, fVec& w, fVec g, fVec* s) const {
    if (has_wd) {
      if (adam_w) w = w * decay_mul;
      else g = at::vec::fmadd(w, wd, g);
    }
    // exp_avg.lerp_(grad, 1 - beta1), as ATen's lerp: two formulas picked by |weight| < 0.5
    const fVec base = fVec::blendv(g, s[0], lerp_mask);
    s[0] = at::vec::fmadd(lerp_coeff, g - s[0], base);
    // ATen's build contracts `v * beta2 + (c2 * g) * g` into an fma: over the second product
    // in its vector loop, over the first in its scalar tail. Mirrored for parity.
    if constexpr (kScalarTail) s[1] = at::vec::fmadd(s[1], beta2, c2 * g * g);
    else s[1] = at::vec::fmadd(c2 * g, g, s[1] * beta2);
    const fVec denom = divide(s[1].sqrt(), (*bc2_sqrt)[t]) + eps;
    w = w + fVec((*neg_step_size)[t]) * s[0] / denom;
  }
  C10_ALWAYS_INLINE void operator()(int64_t t, fVec& w, fVec g, fVec* s) const {
    update<false>(t, w, g, s);
  }
  C10_ALWAYS_INLINE void tail(int64_t t, fVec& w, fVec g, fVec* s) const {
    update<true>(t, w, g, s);
  }
};

inline void fused_adam_cpu(const Tensors& params_, const Tensors& grads_,
                           const Tensors& exp_avgs_, const Tensors& exp_avg_sqs_,
                           const Tensors& masters_, const Tensors& steps_, double lr_,
                           double beta1, double beta2, double eps, double weight_decay,
                           bool adam_w_mode, bool bias_correction,
                           const std::optional<at::Tensor>& inv_scale,
                           const std::optional<at::Tensor>& found_inf,
                           const std::optional<at::Tensor>& lr_tensor) {
  const char* op = "mpnb::fused_adam_";
  const double lr = lr_of(lr_, lr_tensor, op);
  const TensorRefs params(params_), grads(grads_), exp_avgs(exp_avgs_),
      exp_avg_sqs(exp_avg_sqs_), masters(masters_), steps(steps_);
  check_opt_lists(op, params, grads, masters, exp_avgs, exp_avg_sqs);
  const int64_t n = static_cast<int64_t>(params.size());
  check_steps(steps, n, op);
  if (n == 0 || step_skipped(found_inf, op)) return;
  const float inv = inv_of(inv_scale, op);
  const auto step = advance_steps(steps);
  const auto routed = torch_routed(params, grads, masters, bias_correction, inv);
  if (!routed.empty())
    torch_fused_step(routed, params, grads, exp_avgs, exp_avg_sqs, steps, lr, beta1, beta2, eps,
                     weight_decay, adam_w_mode);
  const auto nss = per_step<float>(step, [&](double s) {
    return static_cast<float>(-(lr / (bias_correction ? 1 - std::pow(beta1, s) : 1.0)));
  });
  const auto bc2s = per_step<ScalarDivisor>(step, [&](double s) {
    return ScalarDivisor(
        static_cast<float>(std::sqrt(bias_correction ? 1 - std::pow(beta2, s) : 1.0)));
  });
  const float w = static_cast<float>(1 - beta1);
  const fVec weight(w);
  AdamBody body{
      std::abs(w) < 0.5f ? weight : weight - fVec(1.0f),
      weight.abs() < fVec(0.5f),
      fVec(static_cast<float>(beta2)),
      fVec(static_cast<float>(1 - beta2)),
      fVec(static_cast<float>(eps)),
      fVec(static_cast<float>(weight_decay)),
      fVec(static_cast<float>(1 - lr * weight_decay)),
      adam_w_mode,
      weight_decay != 0.0,
      &nss,
      &bc2s};
  dispatch_param_grad(params[0].scalar_type(), grads[0].scalar_type(),
                      [&]<typename p_t, typename g_t>() {
                        apply_update<p_t, g_t, 2>(params, grads, masters, {&exp_avgs, &exp_avg_sqs},
                                                  inv, body, routed.empty() ? nullptr : &routed);
                      });
}

// ---- pure bf16: stochastic rounding or Kahan summation (rounding.h) ---------------------

// The fp32 step of mpnb::fused_adam_bf16_, one rounding per operation in the order of
// adam.py's _adam_plain (no fma: the reference's torch ops round each operation).
struct AdamPlainBody {
  fVec decay, wd, beta1, c1, beta2, c2, eps;
  bool adam_w, has_wd;
  const std::vector<float>* neg_step;  // per tensor: -lr / bias_correction1
  const std::vector<ScalarDivisor>* bc2_sqrt;  // per tensor: sqrt(bias_correction2)

  C10_ALWAYS_INLINE void operator()(int64_t t, fVec& w, fVec g, fVec* s) const {
    if (has_wd) {
      if (adam_w) w = w * decay;
      else g = g + wd * w;
    }
    s[0] = s[0] * beta1 + c1 * g;
    s[1] = s[1] * beta2 + (c2 * g) * g;
    const fVec denom = divide(s[1].sqrt(), (*bc2_sqrt)[t]) + eps;
    w = w + (fVec((*neg_step)[t]) * s[0]) / denom;
  }
};

inline void fused_adam_bf16_cpu(const Tensors& params_, const Tensors& grads_,
                                const Tensors& exp_avgs_, const Tensors& exp_avg_sqs_,
                                const Tensors& compensations_, const Tensors& steps_, double lr_,
                                double beta1, double beta2, double eps, double weight_decay,
                                bool adam_w_mode, bool bias_correction,
                                c10::string_view rounding, int64_t seed, int64_t rng_step,
                                const std::optional<at::Tensor>& inv_scale,
                                const std::optional<at::Tensor>& found_inf,
                                const std::optional<at::Tensor>& lr_tensor) {
  const char* op = "mpnb::fused_adam_bf16_";
  const double lr = lr_of(lr_, lr_tensor, op);
  const Tensors none;
  const TensorRefs params(params_), grads(grads_), exp_avgs(exp_avgs_),
      exp_avg_sqs(exp_avg_sqs_), comps(compensations_), steps(steps_), masters(none);
  check_opt_lists(op, params, grads, masters, exp_avgs, exp_avg_sqs);
  const int64_t n = static_cast<int64_t>(params.size());
  check_steps(steps, n, op);
  const bool kahan = check_rounding(op, params, comps, rounding);
  if (n == 0 || step_skipped(found_inf, op)) return;
  const float inv = inv_of(inv_scale, op);
  const auto step = advance_steps(steps);
  const auto nss = per_step<float>(step, [&](double s) {
    return static_cast<float>(-(lr / (bias_correction ? 1 - std::pow(beta1, s) : 1.0)));
  });
  const auto bc2s = per_step<ScalarDivisor>(step, [&](double s) {
    return ScalarDivisor(
        static_cast<float>(std::sqrt(bias_correction ? 1 - std::pow(beta2, s) : 1.0)));
  });
  AdamPlainBody body{fVec(static_cast<float>(1 - lr * weight_decay)),
                     fVec(static_cast<float>(weight_decay)),
                     fVec(static_cast<float>(beta1)),
                     fVec(static_cast<float>(1 - beta1)),
                     fVec(static_cast<float>(beta2)),
                     fVec(static_cast<float>(1 - beta2)),
                     fVec(static_cast<float>(eps)),
                     adam_w_mode,
                     weight_decay != 0.0,
                     &nss,
                     &bc2s};
  const auto keys = kahan ? std::vector<uint32_t>() : tensor_keys(n, seed, rng_step);
  const Rounder rounder{kahan, &keys};
  dispatch_grad(grads[0].scalar_type(), [&]<typename g_t>() {
    rounded_update<g_t, 2>(params, grads, comps, {&exp_avgs, &exp_avg_sqs}, inv, rounder, body);
  });
}

}  // namespace mpnb::cpu::opt

TORCH_LIBRARY_IMPL(mpnb, CPU, m) {
  m.impl("fused_adam_", &mpnb::cpu::opt::fused_adam_cpu);
  m.impl("fused_adam_bf16_", &mpnb::cpu::opt::fused_adam_bf16_cpu);
}
TORCH_LIBRARY_IMPL(mpnb, Autograd, m) {
  m.impl("fused_adam_", mpnb::cpu::below_autograd());
  m.impl("fused_adam_bf16_", mpnb::cpu::below_autograd());
}
