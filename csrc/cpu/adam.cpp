// Fused Adam/AdamW on the CPU (Apex's FusedAdam): mpnb::fused_adam_.
//
// The arithmetic mirrors PyTorch's own CPU fused kernel operation by operation (an explicit
// fmadd where it uses one, no silent contraction elsewhere), so an fp32 step equals
// torch.optim.AdamW(fused=True) bit for bit, and the one-pass mixed-precision step equals
// "unscale, check, update the fp32 master, cast" bit for bit.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "cpu/autograd.h"
#include "cpu/opt_common.h"

namespace mpnb::cpu::opt {

// ---- Adam / AdamW ----------------------------------------------------------------------

struct AdamBody {
  fVec lerp_coeff, lerp_mask, beta2, c2, eps, wd, decay_mul;
  bool adam_w, has_wd;
  const std::vector<float>* neg_step_size;  // per tensor: -lr / bias_correction1
  const std::vector<float>* bc2_sqrt;       // per tensor: sqrt(bias_correction2)

  C10_ALWAYS_INLINE void operator()(int64_t t, fVec& w, fVec g, fVec* s) const {
    if (has_wd) {
      if (adam_w) w = w * decay_mul;
      else g = at::vec::fmadd(w, wd, g);
    }
    // exp_avg.lerp_(grad, 1 - beta1), as ATen's lerp: two formulas picked by |weight| < 0.5
    const fVec base = fVec::blendv(g, s[0], lerp_mask);
    s[0] = at::vec::fmadd(lerp_coeff, g - s[0], base);
    // ATen's build contracts `v * beta2 + (c2 * g) * g` into this fma; mirrored for parity.
    s[1] = at::vec::fmadd(c2 * g, g, s[1] * beta2);
    const fVec denom = s[1].sqrt() / fVec((*bc2_sqrt)[t]) + eps;
    w = w + fVec((*neg_step_size)[t]) * s[0] / denom;
  }
};

inline void fused_adam_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                           at::TensorList exp_avg_sqs, at::TensorList masters, at::TensorList steps,
                           double lr, double beta1, double beta2, double eps, double weight_decay,
                           bool adam_w_mode, bool bias_correction,
                           const std::optional<at::Tensor>& inv_scale,
                           const std::optional<at::Tensor>& found_inf) {
  const char* op = "mpnb::fused_adam_";
  check_opt_lists(op, params, grads, masters, {exp_avgs, exp_avg_sqs});
  const int64_t n = static_cast<int64_t>(params.size());
  if (n == 0 || step_skipped(found_inf, op)) return;
  const float inv = inv_of(inv_scale, op);
  const auto step = advance_steps(steps, n, op);
  std::vector<float> nss(n), bc2s(n);
  for (int64_t i = 0; i < n; ++i) {
    const double bc1 = bias_correction ? 1 - std::pow(beta1, step[i]) : 1.0;
    const double bc2 = bias_correction ? 1 - std::pow(beta2, step[i]) : 1.0;
    nss[i] = static_cast<float>(-(lr / bc1));
    bc2s[i] = static_cast<float>(std::sqrt(bc2));
  }
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
                        apply_update<p_t, g_t, 2>(params, grads, masters, {exp_avgs, exp_avg_sqs},
                                              inv, body);
                      });
}

}  // namespace mpnb::cpu::opt

TORCH_LIBRARY_IMPL(mpnb, CPU, m) {
  m.impl("fused_adam_", &mpnb::cpu::opt::fused_adam_cpu);
}
TORCH_LIBRARY_IMPL(mpnb, Autograd, m) {
  m.impl("fused_adam_", mpnb::cpu::below_autograd());
}
