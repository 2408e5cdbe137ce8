// Fused SGD with momentum on the CPU (Apex's FusedSGD; torch.optim.SGD's arithmetic: an fp32
// step equals torch.optim.SGD's for-loop step bit for bit).
//
// Per element, in PyTorch's operation order (fmadd where ATen's add(..., alpha) uses one):
//   g = g + wd * w                     (unless wd_after_momentum)
//   buf = g on the first step, else buf * momentum + (1 - dampening) * g
//   g = g + momentum * buf (nesterov) or g = buf
//   g = g + wd * w                     (wd_after_momentum)
//   w = w + g * (-lr)
#include <ATen/ATen.h>
#include <torch/library.h>

#include "cpu/autograd.h"
#include "cpu/opt_common.h"
#include "cpu/rounding.h"

namespace mpnb::cpu::opt {

struct SgdBody {
  fVec wd, mom, damp1, neg_lr;
  bool has_wd, wd_after, has_mom, nesterov;
  const std::vector<uint8_t>* first;  // per tensor: no momentum buffer yet

  C10_ALWAYS_INLINE void operator()(int64_t t, fVec& w, fVec g, fVec* s) const {
    if (has_wd && !wd_after) g = at::vec::fmadd(w, wd, g);
    if (has_mom) {
      s[0] = (*first)[t] ? g : at::vec::fmadd(damp1, g, s[0] * mom);
      g = nesterov ? at::vec::fmadd(s[0], mom, g) : s[0];
    }
    if (has_wd && wd_after) g = at::vec::fmadd(w, wd, g);
    w = at::vec::fmadd(g, neg_lr, w);
  }
};

inline void fused_sgd_cpu(const Tensors& params_, const Tensors& grads_,
                          const Tensors& momentum_buffers_, const Tensors& masters_,
                          const c10::List<bool>& first_run, double lr, double momentum,
                          double dampening, double weight_decay, bool nesterov,
                          bool wd_after_momentum, const std::optional<at::Tensor>& inv_scale,
                          const std::optional<at::Tensor>& found_inf) {
  const char* op = "mpnb::fused_sgd_";
  const TensorRefs params(params_), grads(grads_), momentum_buffers(momentum_buffers_),
      masters(masters_);
  const bool has_mom = momentum != 0.0;
  const int64_t n = static_cast<int64_t>(params.size());
  if (has_mom) {
    check_opt_lists(op, params, grads, masters, momentum_buffers);
    TORCH_CHECK_VALUE(static_cast<int64_t>(first_run.size()) == n, op,
                      ": 'first_run' must hold one flag per param, got ", first_run.size(),
                      " for ", n, "; pass True for each param whose momentum buffer is new.");
  } else {
    check_opt_lists(op, params, grads, masters);
  }
  if (n == 0 || step_skipped(found_inf, op)) return;
  const float inv = inv_of(inv_scale, op);
  std::vector<uint8_t> first(n, 0);
  if (has_mom)
    for (int64_t i = 0; i < n; ++i) first[i] = first_run.get(i) ? 1 : 0;
  SgdBody body{fVec(static_cast<float>(weight_decay)), fVec(static_cast<float>(momentum)),
               fVec(static_cast<float>(1 - dampening)), fVec(static_cast<float>(-lr)),
               weight_decay != 0.0, wd_after_momentum, has_mom, nesterov, &first};
  dispatch_param_grad(params[0].scalar_type(), grads[0].scalar_type(),
                      [&]<typename p_t, typename g_t>() {
                        if (has_mom)
                          apply_update<p_t, g_t, 1>(params, grads, masters, {&momentum_buffers},
                                                    inv, body);
                        else
                          apply_update<p_t, g_t, 0>(params, grads, masters, {}, inv, body);
                      });
}

// ---- pure bf16: stochastic rounding or Kahan summation (rounding.h) ---------------------

// The fp32 step of mpnb::fused_sgd_bf16_, one rounding per operation in the order of sgd.py's
// _sgd_plain (no fma).
struct SgdPlainBody {
  fVec wd, mom, damp1, lr;
  bool has_wd, wd_after, has_mom, nesterov;
  const std::vector<uint8_t>* first;

  C10_ALWAYS_INLINE void operator()(int64_t t, fVec& w, fVec g, fVec* s) const {
    if (has_wd && !wd_after) g = g + wd * w;
    if (has_mom) {
      s[0] = (*first)[t] ? g : s[0] * mom + damp1 * g;
      g = nesterov ? g + mom * s[0] : s[0];
    }
    if (has_wd && wd_after) g = g + wd * w;
    w = w - lr * g;
  }
};

inline void fused_sgd_bf16_cpu(const Tensors& params_, const Tensors& grads_,
                               const Tensors& momentum_buffers_, const Tensors& comps_,
                               const c10::List<bool>& first_run, double lr, double momentum,
                               double dampening, double weight_decay, bool nesterov,
                               bool wd_after_momentum, c10::string_view rounding, int64_t seed,
                               int64_t rng_step, const std::optional<at::Tensor>& inv_scale,
                               const std::optional<at::Tensor>& found_inf) {
  const char* op = "mpnb::fused_sgd_bf16_";
  const Tensors none;
  const TensorRefs params(params_), grads(grads_), momentum_buffers(momentum_buffers_),
      comps(comps_), masters(none);
  const bool has_mom = momentum != 0.0;
  const int64_t n = static_cast<int64_t>(params.size());
  if (has_mom) {
    check_opt_lists(op, params, grads, masters, momentum_buffers);
    TORCH_CHECK_VALUE(static_cast<int64_t>(first_run.size()) == n, op,
                      ": 'first_run' must hold one flag per param, got ", first_run.size(),
                      " for ", n, "; pass True for each param whose momentum buffer is new.");
  } else {
    check_opt_lists(op, params, grads, masters);
  }
  const bool kahan = check_rounding(op, params, comps, rounding);
  if (n == 0 || step_skipped(found_inf, op)) return;
  const float inv = inv_of(inv_scale, op);
  std::vector<uint8_t> first(n, 0);
  if (has_mom)
    for (int64_t i = 0; i < n; ++i) first[i] = first_run.get(i) ? 1 : 0;
  SgdPlainBody body{fVec(static_cast<float>(weight_decay)), fVec(static_cast<float>(momentum)),
                    fVec(static_cast<float>(1 - dampening)), fVec(static_cast<float>(lr)),
                    weight_decay != 0.0, wd_after_momentum, has_mom, nesterov, &first};
  const auto keys = kahan ? std::vector<uint32_t>() : tensor_keys(n, seed, rng_step);
  const Rounder rounder{kahan, &keys};
  dispatch_grad(grads[0].scalar_type(), [&]<typename g_t>() {
    if (has_mom)
      rounded_update<g_t, 1>(params, grads, comps, {&momentum_buffers}, inv, rounder, body);
    else
      rounded_update<g_t, 0>(params, grads, comps, {}, inv, rounder, body);
  });
}

}  // namespace mpnb::cpu::opt

TORCH_LIBRARY_IMPL(mpnb, CPU, m) {
  m.impl("fused_sgd_", &mpnb::cpu::opt::fused_sgd_cpu);
  m.impl("fused_sgd_bf16_", &mpnb::cpu::opt::fused_sgd_bf16_cpu);
}
TORCH_LIBRARY_IMPL(mpnb, Autograd, m) {
  m.impl("fused_sgd_", mpnb::cpu::below_autograd());
  m.impl("fused_sgd_bf16_", mpnb::cpu::below_autograd());
}
