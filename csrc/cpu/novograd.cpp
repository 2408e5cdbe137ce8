// Fused NovoGrad on the CPU (Apex's FusedNovoGrad): mpnb::fused_novograd_. The per-tensor
// grad norms are computed by the caller (mpnb::multi_tensor_l2norm or a max-abs reduction)
// together with the overflow check, and passed in.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "cpu/autograd.h"
#include "cpu/opt_common.h"

namespace mpnb::cpu::opt {

// ---- NovoGrad --------------------------------------------------------------------------

inline void fused_novograd_cpu(const Tensors& params_, const Tensors& grads_,
                               const Tensors& exp_avgs_, const Tensors& exp_avg_sqs_,
                               const Tensors& masters_, const Tensors& steps_,
                               const at::Tensor& grad_norms, double lr, double beta1,
                               double beta2, double eps, double weight_decay,
                               bool bias_correction, bool grad_averaging, bool reg_inside_moment,
                               int64_t norm_type, bool init_zero,
                               const std::optional<at::Tensor>& inv_scale,
                               const std::optional<at::Tensor>& found_inf) {
  const char* op = "mpnb::fused_novograd_";
  const TensorRefs params(params_), grads(grads_), exp_avgs(exp_avgs_), exp_avg_sqs(exp_avg_sqs_),
      masters(masters_), steps(steps_);
  check_opt_lists(op, params, grads, masters, exp_avgs);
  const int64_t n = static_cast<int64_t>(params.size());
  check_steps(steps, n, op);
  TORCH_CHECK_VALUE(norm_type == 0 || norm_type == 2, op, ": norm_type ", norm_type);
  TORCH_CHECK_VALUE(grad_norms.scalar_type() == at::kFloat && grad_norms.numel() == n && grad_norms.is_contiguous(),
                    op, ": grad_norms");
  bool sqs_ok = static_cast<int64_t>(exp_avg_sqs.size()) == n;
  for (size_t t = 0; sqs_ok && t < exp_avg_sqs.size(); ++t)
    sqs_ok = exp_avg_sqs[t].numel() == 1 && exp_avg_sqs[t].scalar_type() == at::kFloat &&
             exp_avg_sqs[t].device().is_cpu();
  TORCH_CHECK_VALUE(sqs_ok, op, ": exp_avg_sqs");
  if (n == 0 || step_skipped(found_inf, op)) return;
  const float inv = inv_of(inv_scale, op);
  const auto step = advance_steps(steps);
  const float* gn = cdata_of<float>(grad_norms);
  const float b2 = static_cast<float>(beta2), c2 = static_cast<float>(1 - beta2);
  // Per tensor, rounded once from fp64: 1/d, 1/(1 - beta1^t) and 1/((1 - beta1^t) d), so the
  // elementwise update multiplies instead of dividing twice.
  const auto bc1s = per_step<double>(
      step, [&](double s) { return bias_correction ? 1 - std::pow(beta1, s) : 1.0; });
  const auto bc2s = per_step<double>(
      step, [&](double s) { return bias_correction ? std::sqrt(1 - std::pow(beta2, s)) : 1.0; });
  std::vector<float> rd_(n), rbc1_(n), rbd_(n);
  for (int64_t t = 0; t < n; ++t) {
    float* v = data_of<float>(exp_avg_sqs[t]);
    if (step[t] == 1.0 && !init_zero) *v = gn[t];  // the first blend has no effect (Apex)
    else if (norm_type == 2) *v = std::sqrt(b2 * (*v * *v) + c2 * (gn[t] * gn[t]));
    else *v = b2 * *v + c2 * gn[t];
    const double bc1 = bc1s[t], bc2 = bc2s[t];
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
                        apply_update<p_t, g_t, 1>(params, grads, masters, {&exp_avgs}, inv, body);
                      });
}

}  // namespace mpnb::cpu::opt

TORCH_LIBRARY_IMPL(mpnb, CPU, m) {
  m.impl("fused_novograd_", &mpnb::cpu::opt::fused_novograd_cpu);
}
TORCH_LIBRARY_IMPL(mpnb, Autograd, m) {
  m.impl("fused_novograd_", mpnb::cpu::below_autograd());
}
