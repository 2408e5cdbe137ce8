// Fused SGD with momentum on the CPU (Apex's FusedSGD; torch.optim.SGD's arithmetic: an fp32
// step equals torch.optim.SGD's for-loop step bit for bit).
//
// Per element, in PyTorch's operation order (fmadd where ATen's add(..., alpha) uses one):
//   g = g + wd * w                     (unless wd_after_momentum)
//   buf = g on the first step, else buf * momentum + (1 - dampening) * g
//   g = g + momentum * buf (nesterov) or g = buf
//   g = g + wd * w                     (wd_after_momentum)
//   w = w + g * (-lr)
//
// The momentum buffer is fp32, or (without masters) in the param's dtype as torch.optim.SGD and
// Apex keep it: then it is computed in fp32 as above and stored rounded, and the step uses the
// unrounded value (Apex's kernel). With `stepwise` (no masters; buffers in the param dtype) every
// operation above is rounded to the param dtype, and buf * momentum before the sum:
// torch.optim.SGD's ops on half tensors, bit for bit.
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

// One fp32 register rounded to T and widened back.
template <typename T>
C10_ALWAYS_INLINE fVec round_to(const fVec& v) {
  if constexpr (std::is_same_v<T, float>) {
    return v;
  } else {
    return std::get<0>(at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(v, v)));
  }
}

// SgdBody with every operation rounded to T: torch.optim.SGD's ops on T tensors as ATen's
// vectorized CPU kernels compute them. x.mul_(s) is one fp32 product rounded to T; x.add(y,
// alpha=a) rounds a to T first (ATen casts the alpha of a T tensor to T), then a*y + x in fp32
// and one rounding. (ATen's scalar code for the last elements of a thread's range also rounds
// a*y to T: those few elements can differ by one ulp.)
template <typename T>
struct SgdStepwiseBody {
  SgdBody b;  // its wd, damp1, neg_lr and the mom of the nesterov add hold T-rounded values
  fVec mom_mul;  // the momentum of buf.mul_(momentum), fp32

  C10_ALWAYS_INLINE void operator()(int64_t t, fVec& w, fVec g, fVec* s) const {
    g = round_to<T>(g);  // the grad as torch holds it: in the param dtype (unscaled first)
    if (b.has_wd && !b.wd_after) g = round_to<T>(at::vec::fmadd(w, b.wd, g));
    if (b.has_mom) {
      s[0] = (*b.first)[t] ? g : round_to<T>(at::vec::fmadd(b.damp1, g, round_to<T>(s[0] * mom_mul)));
      g = b.nesterov ? round_to<T>(at::vec::fmadd(s[0], b.mom, g)) : s[0];
    }
    if (b.has_wd && b.wd_after) g = round_to<T>(at::vec::fmadd(w, b.wd, g));
    w = at::vec::fmadd(g, b.neg_lr, w);  // rounded when stored
  }
};

// The scalar an ATen add(..., alpha) on T tensors multiplies with: alpha rounded to T.
template <typename T>
inline float alpha_of(double alpha) {
  return static_cast<float>(static_cast<T>(static_cast<float>(alpha)));
}

inline void fused_sgd_cpu(const Tensors& params_, const Tensors& grads_,
                          const Tensors& momentum_buffers_, const Tensors& masters_,
                          const c10::List<bool>& first_run, double lr, double momentum,
                          double dampening, double weight_decay, bool nesterov,
                          bool wd_after_momentum, const std::optional<at::Tensor>& inv_scale,
                          const std::optional<at::Tensor>& found_inf, bool stepwise) {
  const char* op = "mpnb::fused_sgd_";
  const TensorRefs params(params_), grads(grads_), momentum_buffers(momentum_buffers_),
      masters(masters_);
  const bool has_mom = momentum != 0.0;
  const int64_t n = static_cast<int64_t>(params.size());
  check_opt_lists(op, params, grads, masters);
  bool buf_fp32 = true;
  if (has_mom) {
    check_list(momentum_buffers, op, "state", n);
    check_same_sizes(params, momentum_buffers, op, "state");
    TORCH_CHECK_VALUE(static_cast<int64_t>(first_run.size()) == n, op, ": list length of first_run");
    if (n > 0) {
      const auto bt = momentum_buffers[0].scalar_type(), pt = params[0].scalar_type();
      buf_fp32 = bt == at::kFloat;
      TORCH_CHECK_TYPE(buf_fp32 || (bt == pt && masters.empty()), op, ": dtype of momentum_buffers");
      TORCH_CHECK_TYPE(!stepwise || bt == pt, op, ": dtype of momentum_buffers");
    }
  }
  TORCH_CHECK_VALUE(!stepwise || masters.empty(), op, ": stepwise with masters");
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
                        SgdBody tb = body;
                        tb.wd = fVec(alpha_of<p_t>(weight_decay));
                        tb.mom = fVec(alpha_of<p_t>(momentum));
                        tb.damp1 = fVec(alpha_of<p_t>(1 - dampening));
                        tb.neg_lr = fVec(alpha_of<p_t>(-lr));
                        const SgdStepwiseBody<p_t> sbody{tb, fVec(static_cast<float>(momentum))};
                        if (stepwise && has_mom)
                          apply_update<p_t, g_t, 1, p_t>(params, grads, masters,
                                                         {&momentum_buffers}, inv, sbody);
                        else if (stepwise)
                          apply_update<p_t, g_t, 0>(params, grads, masters, {}, inv, sbody);
                        else if (has_mom && buf_fp32)
                          apply_update<p_t, g_t, 1>(params, grads, masters, {&momentum_buffers},
                                                    inv, body);
                        else if (has_mom)  // buffers in the param dtype
                          apply_update<p_t, g_t, 1, p_t>(params, grads, masters,
                                                         {&momentum_buffers}, inv, body);
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
                               const Tensors& momentum_buffers_, const Tensors& compensations_,
                               const c10::List<bool>& first_run, double lr, double momentum,
                               double dampening, double weight_decay, bool nesterov,
                               bool wd_after_momentum, c10::string_view rounding, int64_t seed,
                               int64_t rng_step, const std::optional<at::Tensor>& inv_scale,
                               const std::optional<at::Tensor>& found_inf) {
  const char* op = "mpnb::fused_sgd_bf16_";
  const Tensors none;
  const TensorRefs params(params_), grads(grads_), momentum_buffers(momentum_buffers_),
      comps(compensations_), masters(none);
  const bool has_mom = momentum != 0.0;
  const int64_t n = static_cast<int64_t>(params.size());
  if (has_mom) {
    check_opt_lists(op, params, grads, masters, momentum_buffers);
    TORCH_CHECK_VALUE(static_cast<int64_t>(first_run.size()) == n, op, ": list length of first_run");
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
