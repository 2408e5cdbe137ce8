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

struct AdamBody {
  fVec lerp_coeff, lerp_mask, beta2, c2, eps, wd, decay_mul;
  bool adam_w, has_wd;
  const std::vector<float>* neg_step_size;  // per tensor: -lr / bias_correction1
  const std::vector<float>* bc2_sqrt;       // per tensor: sqrt(bias_correction2)

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
    const fVec denom = s[1].sqrt() / fVec((*bc2_sqrt)[t]) + eps;
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
                           const Tensors& masters_, const Tensors& steps_, double lr, double beta1,
                           double beta2, double eps, double weight_decay, bool adam_w_mode,
                           bool bias_correction,
                           const std::optional<at::Tensor>& inv_scale,
                           const std::optional<at::Tensor>& found_inf) {
  const char* op = "mpnb::fused_adam_";
  const TensorRefs params(params_), grads(grads_), exp_avgs(exp_avgs_),
      exp_avg_sqs(exp_avg_sqs_), masters(masters_), steps(steps_);
  check_opt_lists(op, params, grads, masters, exp_avgs, exp_avg_sqs);
  const int64_t n = static_cast<int64_t>(params.size());
  check_steps(steps, n, op);
  if (n == 0 || step_skipped(found_inf, op)) return;
  const float inv = inv_of(inv_scale, op);
  const auto step = advance_steps(steps);
  const auto nss = per_step<float>(step, [&](double s) {
    return static_cast<float>(-(lr / (bias_correction ? 1 - std::pow(beta1, s) : 1.0)));
  });
  const auto bc2s = per_step<float>(step, [&](double s) {
    return static_cast<float>(std::sqrt(bias_correction ? 1 - std::pow(beta2, s) : 1.0));
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
                                                  inv, body);
                      });
}

// ---- pure bf16: stochastic rounding or Kahan summation (rounding.h) ---------------------

// The fp32 step of mpnb::fused_adam_bf16_, one rounding per operation in the order of
// adam.py's _adam_plain (no fma: the reference's torch ops round each operation).
struct AdamPlainBody {
  fVec decay, wd, beta1, c1, beta2, c2, eps;
  bool adam_w, has_wd;
  const std::vector<float>* neg_step;  // per tensor: -lr / bias_correction1
  const std::vector<float>* bc2_sqrt;  // per tensor: sqrt(bias_correction2)

  C10_ALWAYS_INLINE void operator()(int64_t t, fVec& w, fVec g, fVec* s) const {
    if (has_wd) {
      if (adam_w) w = w * decay;
      else g = g + wd * w;
    }
    s[0] = s[0] * beta1 + c1 * g;
    s[1] = s[1] * beta2 + (c2 * g) * g;
    const fVec denom = s[1].sqrt() / fVec((*bc2_sqrt)[t]) + eps;
    w = w + (fVec((*neg_step)[t]) * s[0]) / denom;
  }
};

inline void fused_adam_bf16_cpu(const Tensors& params_, const Tensors& grads_,
                                const Tensors& exp_avgs_, const Tensors& exp_avg_sqs_,
                                const Tensors& comps_, const Tensors& steps_, double lr,
                                double beta1, double beta2, double eps, double weight_decay,
                                bool adam_w_mode, bool bias_correction,
                                c10::string_view rounding, int64_t seed, int64_t rng_step,
                                const std::optional<at::Tensor>& inv_scale,
                                const std::optional<at::Tensor>& found_inf) {
  const char* op = "mpnb::fused_adam_bf16_";
  const Tensors none;
  const TensorRefs params(params_), grads(grads_), exp_avgs(exp_avgs_),
      exp_avg_sqs(exp_avg_sqs_), comps(comps_), steps(steps_), masters(none);
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
  const auto bc2s = per_step<float>(step, [&](double s) {
    return static_cast<float>(std::sqrt(bias_correction ? 1 - std::pow(beta2, s) : 1.0));
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
