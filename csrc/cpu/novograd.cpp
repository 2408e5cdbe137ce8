// Fused NovoGrad on the CPU (Apex's FusedNovoGrad): mpnb::fused_novograd_. The per-tensor
// grad norms are computed by the caller (mpnb::multi_tensor_l2norm or a max-abs reduction)
// together with the overflow check, and passed in.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "cpu/autograd.h"
#include "cpu/opt_common.h"

namespace mpnb::cpu::opt {

// ---- NovoGrad --------------------------------------------------------------------------

inline void fused_novograd_cpu(at::TensorList params, at::TensorList grads,
                               at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                               at::TensorList masters, at::TensorList steps,
                               const at::Tensor& grad_norms, double lr, double beta1,
                               double beta2, double eps, double weight_decay,
                               bool bias_correction, bool grad_averaging, bool reg_inside_moment,
                               int64_t norm_type, bool init_zero,
                               const std::optional<at::Tensor>& inv_scale,
                               const std::optional<at::Tensor>& found_inf) {
  const char* op = "mpnb::fused_novograd_";
  check_opt_lists(op, params, grads, masters, {exp_avgs});
  const int64_t n = static_cast<int64_t>(params.size());
  TORCH_CHECK(norm_type == 0 || norm_type == 2, op, ": norm_type must be 0 (max) or 2 (L2), got ",
              norm_type, ".");
  TORCH_CHECK(grad_norms.scalar_type() == at::kFloat && grad_norms.numel() == n &&
                  grad_norms.is_contiguous(),
              op, ": grad_norms must be a contiguous float32 tensor with one norm per param.");
  TORCH_CHECK(static_cast<int64_t>(exp_avg_sqs.size()) == n, op,
              ": exp_avg_sqs must hold one one-element float32 tensor per param.");
  if (n == 0 || step_skipped(found_inf, op)) return;
  const float inv = inv_of(inv_scale, op);
  const auto step = advance_steps(steps, n, op);
  const float* gn = grad_norms.const_data_ptr<float>();
  const float b2 = static_cast<float>(beta2), c2 = static_cast<float>(1 - beta2);
  // Per tensor, rounded once from fp64: 1/d, 1/(1 - beta1^t) and 1/((1 - beta1^t) d), so the
  // elementwise update multiplies instead of dividing twice.
  std::vector<float> rd_(n), rbc1_(n), rbd_(n);
  for (int64_t t = 0; t < n; ++t) {
    TORCH_CHECK(exp_avg_sqs[t].numel() == 1 && exp_avg_sqs[t].scalar_type() == at::kFloat, op,
                ": exp_avg_sq ", t, " must be a one-element float32 tensor.");
    float* v = exp_avg_sqs[t].mutable_data_ptr<float>();
    if (step[t] == 1.0 && !init_zero) *v = gn[t];  // the first blend has no effect (Apex)
    else if (norm_type == 2) *v = std::sqrt(b2 * (*v * *v) + c2 * (gn[t] * gn[t]));
    else *v = b2 * *v + c2 * gn[t];
    const double bc1 = bias_correction ? 1 - std::pow(beta1, step[t]) : 1.0;
    const double bc2 = bias_correction ? std::sqrt(1 - std::pow(beta2, step[t])) : 1.0;
    const double denom = *v / static_cast<float>(bc2) + static_cast<float>(eps);
    rd_[t] = static_cast<float>(1 / denom);
    rbc1_[t] = static_cast<float>(1 / bc1);
    rbd_[t] = static_cast<float>(1 / (bc1 * denom));
  }
  const fVec vb1(static_cast<float>(beta1)),
      vb3(grad_averaging ? static_cast<float>(1 - beta1) : 1.0f),
      vwd(static_cast<float>(weight_decay)), vlr(static_cast<float>(lr));
  // Captured by value: update_chunk runs a local copy, kept in registers.
  auto body = [reg_inside_moment, vb1, vb3, vwd, vlr, rd = rd_.data(), rbc1 = rbc1_.data(),
               rbd = rbd_.data()](int64_t t, fVec& w, fVec g, fVec* s)
                  C10_ALWAYS_INLINE_ATTRIBUTE {
    if (reg_inside_moment) {
      g = g * fVec(rd[t]) + vwd * w;
      s[0] = vb1 * s[0] + vb3 * g;
      w = w - vlr * (s[0] * fVec(rbc1[t]));
    } else {
      s[0] = vb1 * s[0] + vb3 * g;
      w = w - vlr * (s[0] * fVec(rbd[t]) + vwd * w);
    }
  };
  dispatch_param_grad(params[0].scalar_type(), grads[0].scalar_type(),
                      [&]<typename p_t, typename g_t>() {
                        apply_update<p_t, g_t, 1>(params, grads, masters, {exp_avgs}, inv, body);
                      });
}

}  // namespace mpnb::cpu::opt

TORCH_LIBRARY_IMPL(mpnb, CPU, m) {
  m.impl("fused_novograd_", &mpnb::cpu::opt::fused_novograd_cpu);
}
TORCH_LIBRARY_IMPL(mpnb, Autograd, m) {
  m.impl("fused_novograd_", mpnb::cpu::below_autograd());
}
