// Fused Adagrad on the CPU (Apex's FusedAdagrad): mpnb::fused_adagrad_. In fp32 within an ulp
// or two of torch.optim.Adagrad(fused=True), whose build contracts some of these products into
// fmas (not bit for bit).
#include <ATen/ATen.h>
#include <torch/library.h>

#include "cpu/autograd.h"
#include "cpu/opt_common.h"

namespace mpnb::cpu::opt {

// ---- Adagrad ---------------------------------------------------------------------------

struct AdagradBody {
  fVec eps, wd, lr;
  bool w_mode, has_wd;
  const std::vector<float>* neg_clr;  // per tensor: -lr / (1 + (step - 1) * lr_decay)

  C10_ALWAYS_INLINE void operator()(int64_t t, fVec& w, fVec g, fVec* s) const {
    if (has_wd && !w_mode) g = g + w * wd;
    s[0] = s[0] + g * g;
    const fVec std_ = s[0].sqrt() + eps;
    if (w_mode) w = w - lr * (g / std_ + wd * w);  // Apex's adagrad_w_mode (decoupled decay)
    else w = w + fVec((*neg_clr)[t]) * g / std_;
  }
};

inline void fused_adagrad_cpu(const Tensors& params_, const Tensors& grads_, const Tensors& sums_,
                              const Tensors& masters_, const Tensors& steps_, double lr, double eps,
                              double weight_decay, double lr_decay, bool adagrad_w_mode,
                              const std::optional<at::Tensor>& inv_scale,
                              const std::optional<at::Tensor>& found_inf) {
  const char* op = "mpnb::fused_adagrad_";
  const TensorRefs params(params_), grads(grads_), sums(sums_), masters(masters_), steps(steps_);
  check_opt_lists(op, params, grads, masters, sums);
  const int64_t n = static_cast<int64_t>(params.size());
  check_steps(steps, n, op);
  if (n == 0 || step_skipped(found_inf, op)) return;
  const float inv = inv_of(inv_scale, op);
  const auto step = advance_steps(steps);
  const auto nclr = per_step<float>(
      step, [&](double s) { return static_cast<float>(-(lr / (1 + (s - 1) * lr_decay))); });
  AdagradBody body{fVec(static_cast<float>(eps)), fVec(static_cast<float>(weight_decay)),
                   fVec(static_cast<float>(lr)), adagrad_w_mode, weight_decay != 0.0, &nclr};
  dispatch_param_grad(params[0].scalar_type(), grads[0].scalar_type(),
                      [&]<typename p_t, typename g_t>() {
                        apply_update<p_t, g_t, 1>(params, grads, masters, {&sums}, inv, body);
                      });
}

}  // namespace mpnb::cpu::opt

TORCH_LIBRARY_IMPL(mpnb, CPU, m) {
  m.impl("fused_adagrad_", &mpnb::cpu::opt::fused_adagrad_cpu);
}
TORCH_LIBRARY_IMPL(mpnb, Autograd, m) {
  m.impl("fused_adagrad_", mpnb::cpu::below_autograd());
}
