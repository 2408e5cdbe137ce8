// Fused LAMB on the CPU (Apex's FusedLAMB and FusedMixedPrecisionLamb): mpnb::fused_lamb_.
// The trust ratio ||w|| / ||u|| of each tensor's update u needs a per-tensor reduction before
// the elementwise update (see lamb_apply); the global grad norm of the clipping is computed
// by the caller over every dtype bucket at once and passed in as a one-element tensor.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <atomic>

#include "cpu/autograd.h"
#include "cpu/opt_common.h"
#include "cpu/rounding.h"

namespace mpnb::cpu::opt {

// ---- LAMB ------------------------------------------------------------------------------

// Per tensor: 1 / (1 - beta^step) rounded once from fp64 (1 without bias correction).
inline std::vector<float> reciprocal_corrections(const std::vector<double>& step, double beta,
                                                 bool bias_correction) {
  return per_step<float>(step, [&](double s) {
    return bias_correction ? static_cast<float>(1 / (1 - std::pow(beta, s))) : 1.0f;
  });
}

// The clipping and the bias corrections are multiplications by reciprocals (rounded once from
// fp64; the clipping one is skipped when nothing is clipped), leaving one division and one
// square root per element (Apex's kernel has four divisions). Forced inline: GCC otherwise
// calls it out of line from the norm pass and spills every register to memory.
struct LambUpdate {
  fVec rclip, wd, beta1, beta3, beta2, c2, eps;
  bool adam_w, has_wd, clipped;
  const std::vector<float>* rbc1;  // per tensor: 1 / (1 - beta1^t)
  const std::vector<float>* rbc2;  // per tensor: 1 / (1 - beta2^t)

  // The new moments m, v of one register (g unscaled).
  C10_ALWAYS_INLINE void moments(const fVec& w, fVec g, fVec& m, fVec& v) const {
    if (clipped) g = g * rclip;
    if (has_wd && !adam_w) g = g + wd * w;
    m = m * beta1 + beta3 * g;
    v = v * beta2 + c2 * g * g;
  }
  // The update direction u of one register, from the new moments.
  C10_ALWAYS_INLINE fVec direction(int64_t t, const fVec& w, const fVec& m, const fVec& v) const {
    fVec u = (m * fVec((*rbc1)[t])) / ((v * fVec((*rbc2)[t])).sqrt() + eps);
    if (has_wd && adam_w) u = u + wd * w;
    return u;
  }
};

// The weight of a chunk: the fp32 master, or the param itself (read as fp32).
template <typename p_t>
struct LambWeight {
  p_t* p;
  float* w;  // null without masters
  C10_ALWAYS_INLINE void load(int64_t i, int64_t k, fVec& a, fVec& b) const {
    if (k == kW) {  // full block: plain loads (the counted ones go through a buffer)
      if (w) IO<float, float>::load(w + i, a, b);
      else IO<p_t, float>::load(p + i, a, b);
    } else {
      if (w) IO<float, float>::load(w + i, k, a, b);
      else IO<p_t, float>::load(p + i, k, a, b);
    }
  }
  C10_ALWAYS_INLINE void prefetch(int64_t i) const {
    if (w) prefetch_ahead(w + i);
    else prefetch_ahead(p + i);
  }
  C10_ALWAYS_INLINE void store(int64_t i, int64_t k, const fVec& a, const fVec& b) const {
    if (k == kW) {
      if (w) IO<float, float>::store(w + i, a, b);
      IO<p_t, float>::store(p + i, a, b);
    } else {
      if (w) IO<float, float>::store(w + i, k, a, b);
      IO<p_t, float>::store(p + i, k, a, b);
    }
  }
};

template <typename T>
C10_ALWAYS_INLINE void load_f32(const T* x, int64_t i, int64_t k, fVec& a, fVec& b) {
  if (k == kW) IO<T, float>::load(x + i, a, b);
  else IO<T, float>::load(x + i, k, a, b);
}
C10_ALWAYS_INLINE void store_f32(float* x, int64_t i, int64_t k, const fVec& a,
                                        const fVec& b) {
  if (k == kW) IO<float, float>::store(x + i, a, b);
  else IO<float, float>::store(x + i, k, a, b);
}

// Pass 1 of one chunk: the new m, v are stored, u is stored to `u_out` when given, and
// sum(w^2), sum(u^2) are reduced in fp64.
template <typename p_t, typename g_t>
C10_ALWAYS_INLINE void lamb_pass1(const Chunk& ch, const TensorRefs& params,
                                  const TensorRefs& grads, const TensorRefs& masters,
                                  const TensorRefs& ms, const TensorRefs& vs,
                                  float inv, const LambUpdate& upd_, float* u_out, double& w2,
                                  double& u2) {
  // A local copy: stores through the vector intrinsics may alias anything, so members read
  // through a reference would be reloaded after every store.
  const LambUpdate upd = upd_;
  const fVec vinv(inv);
  const int64_t t = ch.tensor, off = ch.offset, n = ch.len;
  const g_t* g = cdata_of<g_t>(grads[t]) + off;
  const LambWeight<p_t> wt{data_of<p_t>(params[t]) + off,
                           masters.empty() ? nullptr : data_of<float>(masters[t]) + off};
  float* m = data_of<float>(ms[t]) + off;
  float* v = data_of<float>(vs[t]) + off;
  dVec a0(0.0), a1(0.0), b0(0.0), b1(0.0);
  fVec w0, w1, g0, g1, m0, m1, v0, v1;
  for (int64_t i = 0; i < n; i += kW) {
    const int64_t k = std::min(kW, n - i);
    prefetch_ahead(g + i);
    wt.prefetch(i);
    prefetch_ahead(m + i);
    prefetch_ahead(v + i);
    load_f32(g, i, k, g0, g1);
    wt.load(i, k, w0, w1);
    load_f32(m, i, k, m0, m1);
    load_f32(v, i, k, v0, v1);
    // Padding lanes are zero: their u is 0/(sqrt(0)+eps) = 0 and adds nothing.
    upd.moments(w0, g0 * vinv, m0, v0);
    upd.moments(w1, g1 * vinv, m1, v1);
    const fVec u0 = upd.direction(t, w0, m0, v0), u1 = upd.direction(t, w1, m1, v1);
    store_f32(m, i, k, m0, m1);
    store_f32(v, i, k, v0, v1);
    if (u_out) store_f32(u_out, i, k, u0, u1);
    accumulate_squares(a0, a1, w0);
    accumulate_squares(a0, a1, w1);
    accumulate_squares(b0, b1, u0);
    accumulate_squares(b0, b1, u1);
  }
  w2 = hsum(a0 + a1);
  u2 = hsum(b0 + b1);
}

// Pass 2 of one chunk: w -= ratio * u, with u read back from `u_in`, or (when null)
// recomputed from w and the new m, v that pass 1 stored; the same bits either way.
template <typename p_t>
C10_ALWAYS_INLINE void lamb_pass2(const Chunk& ch, const TensorRefs& params,
                                  const TensorRefs& masters, const TensorRefs& ms,
                                  const TensorRefs& vs, const LambUpdate& upd_,
                                  const float* u_in, float ratio) {
  const LambUpdate upd = upd_;
  const fVec r(ratio);
  const int64_t t = ch.tensor, off = ch.offset, n = ch.len;
  const LambWeight<p_t> wt{data_of<p_t>(params[t]) + off,
                           masters.empty() ? nullptr : data_of<float>(masters[t]) + off};
  const float* m = cdata_of<float>(ms[t]) + off;
  const float* v = cdata_of<float>(vs[t]) + off;
  fVec w0, w1, u0, u1, m0, m1, v0, v1;
  for (int64_t i = 0; i < n; i += kW) {
    const int64_t k = std::min(kW, n - i);
    wt.prefetch(i);
    if (u_in) {
      prefetch_ahead(u_in + i);
    } else {
      prefetch_ahead(m + i);
      prefetch_ahead(v + i);
    }
    wt.load(i, k, w0, w1);
    if (u_in) {
      load_f32(u_in, i, k, u0, u1);
    } else {
      load_f32(m, i, k, m0, m1);
      load_f32(v, i, k, v0, v1);
      u0 = upd.direction(t, w0, m0, v0);
      u1 = upd.direction(t, w1, m1, v1);
    }
    w0 = w0 - r * u0;
    w1 = w1 - r * u1;
    wt.store(i, k, w0, w1);
  }
}

// Tensors are taken in groups of consecutive tensors of at most this many elements in all (a
// larger tensor forms a group of its own). 640K elements hold a GPT's 4d x d matrices alone;
// one group per thread in flight: 2 x 11.5 MiB (18 B/element, see lamb_apply) fit in a large
// L3. A small one (8 MiB, AMD EPYC 7001) serves pass 2 from DRAM whatever the group size:
// groups sized to it, or every tensor on the large path, measured no faster there.
constexpr int64_t kLambGroupElems = int64_t(10) << 16;

// LAMB in two passes over each group of tensors (see kLambGroupElems):
//   pass 1 reads g, w, m, v, stores the new m, v (they do not depend on the trust ratio),
//          reduces ||w||^2 and ||u||^2 per chunk and, for a group of at most kLambGroupElems,
//          stores u to a per-thread scratch buffer (2.5 MiB at most);
//   pass 2 (the group's trust ratios known) reads w and u and stores w - ratio * u (master
//          and param).
// A group's g, w, m, v, u (18 B/element with bf16 grads and fp32 masters) stay in cache between
// the passes, so the step moves the bytes of one pass (28 B/element) instead of two (42), and
// pass 2 has no division or square root. Each thread takes whole groups (the next one from a
// shared counter) and runs both passes on its own: no barrier between the passes, and a thread
// the OS preempts only leaves more groups to the other. A tensor larger than a group is too
// large for the cache: both threads share its passes, pass 2 recomputes u from w and the
// stored m, v (40 B/element from memory) and walks each thread's chunks backward, so that it
// starts on what pass 1 left in cache. The chunk grid is the one of the whole list and each
// tensor's norms add its chunks' partials in chunk order: the bits depend neither on the
// grouping nor on the thread count, and u (stored or recomputed) is the same.
template <typename p_t, typename g_t>
void lamb_apply(const TensorRefs& params, const TensorRefs& grads, const TensorRefs& masters,
                const TensorRefs& ms, const TensorRefs& vs, float inv, const LambUpdate& upd,
                float lr, bool norms) {
  const int64_t nt = static_cast<int64_t>(params.size());
  auto table = make_chunks(params);
  const int64_t nc = static_cast<int64_t>(table.chunks.size());
  if (!norms) {  // every ratio is lr: one pass
    const LambUpdate* up = &upd;
    auto body = [up, vlr = fVec(lr)](int64_t t, fVec& w, fVec g, fVec* s)
                    C10_ALWAYS_INLINE_ATTRIBUTE {
      up->moments(w, g, s[0], s[1]);
      w = w - vlr * up->direction(t, w, s[0], s[1]);
    };
    apply_update<p_t, g_t, 2>(params, grads, masters, {&ms, &vs}, inv, body);
    return;
  }
  std::vector<double> pw(nc), pu(nc);
  std::vector<float> ratio(nt, lr);
  std::vector<int64_t> base(nt, 0);  // each tensor's first element in its group's scratch
  struct Group {
    int64_t t0, t1, elems;
  };
  std::vector<Group> small, large;
  int64_t small_elems = 0;
  for (int64_t t0 = 0; t0 < nt;) {
    int64_t t1 = t0 + 1, elems = params[t0].numel();
    while (t1 < nt && elems + params[t1].numel() <= kLambGroupElems) {
      base[t1] = elems;
      elems += params[t1++].numel();
    }
    if (elems <= kLambGroupElems) {
      small.push_back({t0, t1, elems});
      small_elems += elems;
    } else {
      large.push_back({t0, t1, elems});
    }
    t0 = t1;
  }
  auto ratios = [&](const Group& gr) {
    for (int64_t t = gr.t0; t < gr.t1; ++t) {
      double w2 = 0.0, u2 = 0.0;
      for (int64_t c = table.first_chunk[t]; c < table.first_chunk[t + 1]; ++c) {
        w2 += pw[c];
        u2 += pu[c];
      }
      const float pn = static_cast<float>(std::sqrt(w2));
      const float un = static_cast<float>(std::sqrt(u2));
      if (pn != 0.0f && un != 0.0f) ratio[t] = lr * (pn / un);
    }
  };
  auto pass1 = [&](int64_t c, float* u) C10_ALWAYS_INLINE_ATTRIBUTE {
    const Chunk& ch = table.chunks[c];
    lamb_pass1<p_t, g_t>(ch, params, grads, masters, ms, vs, inv, upd,
                         u ? u + base[ch.tensor] + ch.offset : nullptr, pw[c], pu[c]);
  };
  auto pass2 = [&](int64_t c, const float* u) C10_ALWAYS_INLINE_ATTRIBUTE {
    const Chunk& ch = table.chunks[c];
    lamb_pass2<p_t>(ch, params, masters, ms, vs, upd,
                    u ? u + base[ch.tensor] + ch.offset : nullptr, ratio[ch.tensor]);
  };
  // Small groups: whole groups per thread.
  std::atomic<int64_t> next{0};
  auto worker = [&](int64_t, int64_t) {
    static thread_local std::vector<float> scratch;
    for (int64_t k = next.fetch_add(1); k < static_cast<int64_t>(small.size());
         k = next.fetch_add(1)) {
      const Group& gr = small[k];
      if (static_cast<int64_t>(scratch.size()) < gr.elems) scratch.resize(gr.elems);
      const int64_t c0 = table.first_chunk[gr.t0], c1 = table.first_chunk[gr.t1];
      for (int64_t c = c0; c < c1; ++c) pass1(c, scratch.data());
      ratios(gr);
      for (int64_t c = c0; c < c1; ++c) pass2(c, scratch.data());
    }
  };
  if (!small.empty()) {
    if (small_elems < kSerialElems || small.size() == 1 || at::get_num_threads() == 1)
      worker(0, 1);
    else
      at::parallel_for(0, at::get_num_threads(), 1, worker);
  }
  // Large tensors: both threads on each, one pass after the other.
  for (const Group& gr : large) {
    const int64_t c0 = table.first_chunk[gr.t0], c1 = table.first_chunk[gr.t1];
    for_chunk_range(c0, c1, gr.elems, false, [&](int64_t c) { pass1(c, nullptr); });
    ratios(gr);
    for_chunk_range(c0, c1, gr.elems, true, [&](int64_t c) { pass2(c, nullptr); });
  }
}

inline void fused_lamb_cpu(const Tensors& params_, const Tensors& grads_, const Tensors& exp_avgs_,
                           const Tensors& exp_avg_sqs_, const Tensors& masters_,
                           const Tensors& steps_,
                           const at::Tensor& global_grad_norm, double lr, double beta1,
                           double beta2, double eps, double weight_decay, bool adam_w_mode,
                           bool bias_correction, bool grad_averaging, double max_grad_norm,
                           bool use_nvlamb, const std::optional<at::Tensor>& inv_scale,
                           const std::optional<at::Tensor>& found_inf) {
  const char* op = "mpnb::fused_lamb_";
  const TensorRefs params(params_), grads(grads_), exp_avgs(exp_avgs_), exp_avg_sqs(exp_avg_sqs_),
      masters(masters_), steps(steps_);
  check_opt_lists(op, params, grads, masters, exp_avgs, exp_avg_sqs);
  const int64_t n = static_cast<int64_t>(params.size());
  check_steps(steps, n, op);
  TORCH_CHECK_VALUE(global_grad_norm.numel() == 1, op, ": global_grad_norm must hold one value");
  if (n == 0 || step_skipped(found_inf, op)) return;
  const float inv = inv_of(inv_scale, op);
  const float gnorm = global_grad_norm.item<float>();
  const float mx = static_cast<float>(max_grad_norm);
  const float clip = (mx > 0.0f && gnorm > mx) ? gnorm / mx : 1.0f;
  const auto step = advance_steps(steps);
  const auto rbc1 = reciprocal_corrections(step, beta1, bias_correction);
  const auto rbc2 = reciprocal_corrections(step, beta2, bias_correction);
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
  dispatch_param_grad(params[0].scalar_type(), grads[0].scalar_type(),
                      [&]<typename p_t, typename g_t>() {
                        lamb_apply<p_t, g_t>(params, grads, masters, exp_avgs, exp_avg_sqs, inv, upd,
                                         static_cast<float>(lr),
                                         use_nvlamb || weight_decay != 0.0);
                      });
}

// ---- pure bf16: stochastic rounding or Kahan summation (rounding.h) ---------------------

// The fp32 direction of mpnb::fused_lamb_bf16_, one rounding per operation in the order of
// lamb.py's _lamb_plain (no fma; reciprocals for the clipping and the bias corrections).
struct LambPlain {
  fVec rclip, wd, beta1, beta3, beta2, c2, eps;
  bool adam_w, has_wd, clipped;
  const std::vector<float>* rbc1;
  const std::vector<float>* rbc2;

  C10_ALWAYS_INLINE fVec direction(int64_t t, const fVec& w, fVec g, fVec* s) const {
    if (clipped) g = g * rclip;
    if (has_wd && !adam_w) g = g + wd * w;
    s[0] = s[0] * beta1 + beta3 * g;
    s[1] = s[1] * beta2 + (c2 * g) * g;
    fVec u = (s[0] * fVec((*rbc1)[t])) / ((s[1] * fVec((*rbc2)[t])).sqrt() + eps);
    if (has_wd && adam_w) u = u + wd * w;
    return u;
  }
};

// lamb.py's NORM_BLOCK: each block's squares are added one after the other in fp64, then the
// blocks of a tensor in order. It divides the chunk size, so a chunk holds whole blocks.
constexpr int64_t kNormBlock = 4096;
static_assert(kChunkElems % kNormBlock == 0, "norm blocks must tile the chunks");

inline double sum_squares(const float* x, int64_t n) {
  double acc = 0.0;
  for (int64_t j = 0; j < n; ++j) {
    const double d = static_cast<double>(x[j]);
    acc += d * d;
  }
  return acc;
}

template <typename g_t>
void lamb_bf16_apply(const TensorRefs& params, const TensorRefs& grads, const TensorRefs& comps,
                     const TensorRefs& exp_avgs, const TensorRefs& exp_avg_sqs, float inv,
                     const LambPlain& upd, const Rounder& rounder, float lr, bool norms) {
  const int64_t n = static_cast<int64_t>(params.size());
  std::vector<int64_t> u_off(n + 1, 0), b_off(n + 1, 0);
  for (int64_t t = 0; t < n; ++t) {
    u_off[t + 1] = u_off[t] + params[t].numel();
    b_off[t + 1] = b_off[t] + (params[t].numel() + kNormBlock - 1) / kNormBlock;
  }
  // u of every tensor (fp32): the trust ratio needs its norm before the weights change.
  std::vector<float> u(u_off[n]);
  std::vector<double> pw(b_off[n]), pu(b_off[n]);
  auto table = make_chunks(params);
  for_each_chunk(table, [&](int64_t, const Chunk& ch) {
    const LambPlain body = upd;
    const int64_t t = ch.tensor;
    float* uc = u.data() + u_off[t] + ch.offset;
    alignas(64) float ws[kChunkElems];
    walk_chunk<g_t, 2>(ch, params, grads, {&exp_avgs, &exp_avg_sqs}, inv,
                       [&](int64_t i, int64_t cnt, bool full, fVec& w0, fVec& w1, fVec& g0,
                           fVec& g1, fVec* s0, fVec* s1) C10_ALWAYS_INLINE_ATTRIBUTE {
                         store_block(uc + i, cnt, full, body.direction(t, w0, g0, s0),
                                     body.direction(t, w1, g1, s1));
                         if (norms) store_block(ws + i, cnt, full, w0, w1);
                       });
    if (!norms) return;
    for (int64_t b = 0; b * kNormBlock < ch.len; ++b) {
      const int64_t at = b * kNormBlock, len = std::min(kNormBlock, ch.len - at);
      const int64_t k = b_off[t] + (ch.offset + at) / kNormBlock;
      pw[k] = sum_squares(ws + at, len);
      pu[k] = sum_squares(uc + at, len);
    }
  });
  std::vector<float> ratio(n, lr);
  if (norms) {
    for (int64_t t = 0; t < n; ++t) {
      double sw = 0.0, su = 0.0;
      for (int64_t k = b_off[t]; k < b_off[t + 1]; ++k) {
        sw += pw[k];
        su += pu[k];
      }
      const float pn = static_cast<float>(std::sqrt(sw)), un = static_cast<float>(std::sqrt(su));
      if (pn != 0.0f && un != 0.0f) ratio[t] = lr * (pn / un);
    }
  }
  for_each_chunk(table, [&](int64_t, const Chunk& ch) {
    const int64_t t = ch.tensor;
    const float* uc = u.data() + u_off[t] + ch.offset;
    const bf16* pc = cdata_of<bf16>(params[t]) + ch.offset;
    uint16_t* p = reinterpret_cast<uint16_t*>(data_of<bf16>(params[t])) + ch.offset;
    uint16_t* c = rounder.kahan
                      ? reinterpret_cast<uint16_t*>(data_of<bf16>(comps[t])) + ch.offset
                      : nullptr;
    const fVec r(ratio[t]);
    alignas(64) float xs[kW];
    fVec w0, w1, u0, u1;
    for (int64_t i = 0; i < ch.len; i += kW) {
      const int64_t cnt = std::min<int64_t>(kW, ch.len - i);
      const bool full = cnt == kW;
      load_block(pc + i, cnt, full, w0, w1);
      load_block(uc + i, cnt, full, u0, u1);
      IO<float, float>::store(xs, w0 - r * u0, w1 - r * u1);
      rounder.store(t, ch.offset + i, xs, cnt, p + i, c ? c + i : nullptr);
    }
  });
}

inline void fused_lamb_bf16_cpu(const Tensors& params_, const Tensors& grads_,
                                const Tensors& exp_avgs_, const Tensors& exp_avg_sqs_,
                                const Tensors& compensations_, const Tensors& steps_,
                                const at::Tensor& global_grad_norm, double lr, double beta1,
                                double beta2, double eps, double weight_decay, bool adam_w_mode,
                                bool bias_correction, bool grad_averaging, double max_grad_norm,
                                bool use_nvlamb, c10::string_view rounding, int64_t seed,
                                int64_t rng_step, const std::optional<at::Tensor>& inv_scale,
                                const std::optional<at::Tensor>& found_inf) {
  const char* op = "mpnb::fused_lamb_bf16_";
  const Tensors none;
  const TensorRefs params(params_), grads(grads_), exp_avgs(exp_avgs_),
      exp_avg_sqs(exp_avg_sqs_), comps(compensations_), steps(steps_), masters(none);
  check_opt_lists(op, params, grads, masters, exp_avgs, exp_avg_sqs);
  const int64_t n = static_cast<int64_t>(params.size());
  check_steps(steps, n, op);
  const bool kahan = check_rounding(op, params, comps, rounding);
  TORCH_CHECK_VALUE(global_grad_norm.numel() == 1, op, ": global_grad_norm must hold one value");
  if (n == 0 || step_skipped(found_inf, op)) return;
  const float inv = inv_of(inv_scale, op);
  const float gnorm = global_grad_norm.item<float>();
  const float mx = static_cast<float>(max_grad_norm);
  const bool clipped = mx > 0.0f && gnorm > mx;
  const float clip = clipped ? gnorm / mx : 1.0f;
  const auto step = advance_steps(steps);
  const auto rbc1 = reciprocal_corrections(step, beta1, bias_correction);
  const auto rbc2 = reciprocal_corrections(step, beta2, bias_correction);
  LambPlain upd{fVec(static_cast<float>(1.0 / static_cast<double>(clip))),
                fVec(static_cast<float>(weight_decay)),
                fVec(static_cast<float>(beta1)),
                fVec(grad_averaging ? static_cast<float>(1 - beta1) : 1.0f),
                fVec(static_cast<float>(beta2)),
                fVec(static_cast<float>(1 - beta2)),
                fVec(static_cast<float>(eps)),
                adam_w_mode,
                weight_decay != 0.0,
                clipped,
                &rbc1,
                &rbc2};
  const auto keys = kahan ? std::vector<uint32_t>() : tensor_keys(n, seed, rng_step);
  const Rounder rounder{kahan, &keys};
  dispatch_grad(grads[0].scalar_type(), [&]<typename g_t>() {
    lamb_bf16_apply<g_t>(params, grads, comps, exp_avgs, exp_avg_sqs, inv, upd, rounder,
                         static_cast<float>(lr), use_nvlamb || weight_decay != 0.0);
  });
}

}  // namespace mpnb::cpu::opt

TORCH_LIBRARY_IMPL(mpnb, CPU, m) {
  m.impl("fused_lamb_", &mpnb::cpu::opt::fused_lamb_cpu);
  m.impl("fused_lamb_bf16_", &mpnb::cpu::opt::fused_lamb_bf16_cpu);
}
TORCH_LIBRARY_IMPL(mpnb, Autograd, m) {
  m.impl("fused_lamb_", mpnb::cpu::below_autograd());
  m.impl("fused_lamb_bf16_", mpnb::cpu::below_autograd());
}
