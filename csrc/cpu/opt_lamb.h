// Fused LAMB and NovoGrad on the CPU (Apex's FusedLAMB, FusedMixedPrecisionLamb and
// FusedNovoGrad). Both need a per-tensor quantity before the elementwise update:
//   LAMB:     the trust ratio ||w|| / ||u|| of each tensor's update u. Pass 1 computes u in
//             registers and reduces ||w||^2, ||u||^2 per chunk (nothing is written); pass 2
//             recomputes the same u bit for bit, writes m, v and w - ratio * u. Recomputing u
//             costs arithmetic only, where storing it would move 8 more bytes per element.
//   NovoGrad: the per-tensor grad norm, computed by the caller (mpnb::multi_tensor_l2norm or
//             a max-abs reduction) together with the overflow check.
// The global grad norm of LAMB's clipping is likewise computed by the caller over every dtype
// bucket at once and passed in as a one-element tensor.
#pragma once

#include "cpu/opt_common.h"

namespace mpnb::cpu::opt {

// ---- LAMB ------------------------------------------------------------------------------

// Both passes compute u, and on one thread LAMB is bound by arithmetic, not by memory: the
// clipping and the bias corrections are multiplications by reciprocals (rounded once from
// fp64; the clipping one is skipped when nothing is clipped), leaving one division and one
// square root per element and pass (Apex's kernel has four divisions). Forced inline: GCC
// otherwise calls it out of line from the norm pass and spills every register to memory.
struct LambUpdate {
  fVec rclip, wd, beta1, beta3, beta2, c2, eps;
  bool adam_w, has_wd, clipped;
  const std::vector<float>* rbc1;  // per tensor: 1 / (1 - beta1^t)
  const std::vector<float>* rbc2;  // per tensor: 1 / (1 - beta2^t)

  // The update direction u of one register; m, v receive their new values.
  C10_ALWAYS_INLINE fVec operator()(int64_t t, const fVec& w, fVec g, fVec& m, fVec& v) const {
    if (clipped) g = g * rclip;
    if (has_wd && !adam_w) g = g + wd * w;
    m = m * beta1 + beta3 * g;
    v = v * beta2 + c2 * g * g;
    fVec u = (m * fVec((*rbc1)[t])) / ((v * fVec((*rbc2)[t])).sqrt() + eps);
    if (has_wd && adam_w) u = u + wd * w;
    return u;
  }
};

template <typename p_t, typename g_t>
void lamb_norms(at::TensorList params, at::TensorList grads, at::TensorList masters,
                at::TensorList ms, at::TensorList vs, float inv, const LambUpdate& upd,
                std::vector<double>& w2, std::vector<double>& u2) {
  auto table = make_chunks(params);
  std::vector<double> pw(table.chunks.size()), pu(table.chunks.size());
  const bool has_master = !masters.empty();
  const fVec vinv(inv);
  for_each_chunk(table, [&](int64_t c, const Chunk& ch) {
    const int64_t t = ch.tensor, off = ch.offset, n = ch.len;
    const g_t* g = grads[t].const_data_ptr<g_t>() + off;
    const p_t* p = params[t].const_data_ptr<p_t>() + off;
    const float* w = has_master ? masters[t].const_data_ptr<float>() + off : nullptr;
    const float* m = ms[t].const_data_ptr<float>() + off;
    const float* v = vs[t].const_data_ptr<float>() + off;
    dVec a0(0.0), a1(0.0), b0(0.0), b1(0.0);
    fVec w0, w1, g0, g1, m0, m1, v0, v1;
    for (int64_t i = 0; i < n; i += kW) {
      const int64_t k = std::min(kW, n - i);
      if (k == kW) {  // full block: plain loads (the counted ones go through a buffer)
        IO<g_t, float>::load(g + i, g0, g1);
        if (has_master) IO<float, float>::load(w + i, w0, w1);
        else IO<p_t, float>::load(p + i, w0, w1);
        IO<float, float>::load(m + i, m0, m1);
        IO<float, float>::load(v + i, v0, v1);
      } else {
        IO<g_t, float>::load(g + i, k, g0, g1);
        if (has_master) IO<float, float>::load(w + i, k, w0, w1);
        else IO<p_t, float>::load(p + i, k, w0, w1);
        IO<float, float>::load(m + i, k, m0, m1);
        IO<float, float>::load(v + i, k, v0, v1);
      }
      // Padding lanes are zero: their u is 0/(sqrt(0)+eps) = 0 and adds nothing.
      const fVec u0 = upd(t, w0, g0 * vinv, m0, v0), u1 = upd(t, w1, g1 * vinv, m1, v1);
      accumulate_squares(a0, a1, w0);
      accumulate_squares(a0, a1, w1);
      accumulate_squares(b0, b1, u0);
      accumulate_squares(b0, b1, u1);
    }
    pw[c] = hsum(a0 + a1);
    pu[c] = hsum(b0 + b1);
  });
  const int64_t nt = static_cast<int64_t>(params.size());
  for (int64_t t = 0; t < nt; ++t)
    for (int64_t c = table.first_chunk[t]; c < table.first_chunk[t + 1]; ++c) {
      w2[t] += pw[c];
      u2[t] += pu[c];
    }
}

inline void fused_lamb_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                           at::TensorList exp_avg_sqs, at::TensorList masters, at::TensorList steps,
                           const at::Tensor& global_grad_norm, double lr, double beta1,
                           double beta2, double eps, double weight_decay, bool adam_w_mode,
                           bool bias_correction, bool grad_averaging, double max_grad_norm,
                           bool use_nvlamb, const std::optional<at::Tensor>& inv_scale,
                           const std::optional<at::Tensor>& found_inf) {
  const char* op = "mpnb::fused_lamb_";
  check_opt_lists(op, params, grads, masters, {exp_avgs, exp_avg_sqs});
  const int64_t n = static_cast<int64_t>(params.size());
  if (n == 0 || step_skipped(found_inf, op)) return;
  TORCH_CHECK(global_grad_norm.numel() == 1, op, ": global_grad_norm must hold one value.");
  const float inv = inv_of(inv_scale, op);
  const float gnorm = global_grad_norm.item<float>();
  const float mx = static_cast<float>(max_grad_norm);
  const float clip = (mx > 0.0f && gnorm > mx) ? gnorm / mx : 1.0f;
  const auto step = advance_steps(steps, n, op);
  std::vector<float> rbc1(n, 1.0f), rbc2(n, 1.0f);
  if (bias_correction)
    for (int64_t i = 0; i < n; ++i) {
      rbc1[i] = static_cast<float>(1 / (1 - std::pow(beta1, step[i])));
      rbc2[i] = static_cast<float>(1 / (1 - std::pow(beta2, step[i])));
    }
  LambUpdate upd{fVec(static_cast<float>(1.0 / static_cast<double>(clip))),
                 fVec(static_cast<float>(weight_decay)),
                 fVec(static_cast<float>(beta1)),
                 fVec(grad_averaging ? static_cast<float>(1 - beta1) : 1.0f),
                 fVec(static_cast<float>(beta2)),
                 fVec(static_cast<float>(1 - beta2)),
                 fVec(static_cast<float>(eps)),
                 adam_w_mode,
                 weight_decay != 0.0,
                 clip != 1.0f,
                 &rbc1,
                 &rbc2};
  std::vector<float> ratio(n, static_cast<float>(lr));
  MPNB_DISPATCH_OPT(params[0].scalar_type(), grads[0].scalar_type(), [&] {
    if (use_nvlamb || weight_decay != 0.0) {
      std::vector<double> w2(n, 0.0), u2(n, 0.0);
      lamb_norms<p_t, g_t>(params, grads, masters, exp_avgs, exp_avg_sqs, inv, upd, w2, u2);
      for (int64_t t = 0; t < n; ++t) {
        const float pn = static_cast<float>(std::sqrt(w2[t]));
        const float un = static_cast<float>(std::sqrt(u2[t]));
        if (pn != 0.0f && un != 0.0f) ratio[t] = static_cast<float>(lr) * (pn / un);
      }
    }
    auto body = [&](int64_t t, fVec& w, fVec g, fVec* s) C10_ALWAYS_INLINE_ATTRIBUTE {
      const fVec u = upd(t, w, g, s[0], s[1]);
      w = w - fVec(ratio[t]) * u;
    };
    apply_update<p_t, g_t, 2>(params, grads, masters, {exp_avgs, exp_avg_sqs}, inv, body);
  }());
}

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
  auto body = [&](int64_t t, fVec& w, fVec g, fVec* s) C10_ALWAYS_INLINE_ATTRIBUTE {
    if (reg_inside_moment) {
      g = g * fVec(rd_[t]) + vwd * w;
      s[0] = vb1 * s[0] + vb3 * g;
      w = w - vlr * (s[0] * fVec(rbc1_[t]));
    } else {
      s[0] = vb1 * s[0] + vb3 * g;
      w = w - vlr * (s[0] * fVec(rbd_[t]) + vwd * w);
    }
  };
  MPNB_DISPATCH_OPT(params[0].scalar_type(), grads[0].scalar_type(),
                    apply_update<p_t, g_t, 1>(params, grads, masters, {exp_avgs}, inv, body));
}

}  // namespace mpnb::cpu::opt

TORCH_LIBRARY_FRAGMENT(mpnb, m) {
  m.def("fused_lamb_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
        "Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] masters, Tensor(e!)[] steps, "
        "Tensor global_grad_norm, float lr, float beta1, float beta2, float eps, "
        "float weight_decay, bool adam_w_mode, bool bias_correction, bool grad_averaging, "
        "float max_grad_norm, bool use_nvlamb, Tensor? inv_scale=None, "
        "Tensor? found_inf=None) -> ()");
  m.def("fused_novograd_(Tensor(a!)[] params, Tensor[] grads, Tensor(b!)[] exp_avgs, "
        "Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] masters, Tensor(e!)[] steps, "
        "Tensor grad_norms, float lr, float beta1, float beta2, float eps, float weight_decay, "
        "bool bias_correction, bool grad_averaging, bool reg_inside_moment, int norm_type, "
        "bool init_zero, Tensor? inv_scale=None, Tensor? found_inf=None) -> ()");
}

TORCH_LIBRARY_IMPL(mpnb, CPU, m) {
  m.impl("fused_lamb_", &mpnb::cpu::opt::fused_lamb_cpu);
  m.impl("fused_novograd_", &mpnb::cpu::opt::fused_novograd_cpu);
}
