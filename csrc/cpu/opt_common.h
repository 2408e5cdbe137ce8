// Shared machinery of the fused optimizer kernels (adam.cpp, adagrad.cpp, sgd.cpp, lamb.cpp,
// novograd.cpp).
//
// Every update is elementwise over (param, grad, fp32 state...) and walks the chunk table of
// multi_tensor_apply.h. With a master list the fp32 master weight is the one updated and the
// model param (fp16/bf16) receives its rounded copy in the same pass: the "one-pass
// mixed-precision step". The grad is unscaled (multiplied by inv_scale) in registers.
//
// Overflow protocol: the kernels never check grads themselves. When a loss scaler is in
// play the Python side first runs a read-only finite check over *all* grads (every dtype
// bucket; mpnb::multi_tensor_check_finite, 2 bytes/param for bf16 grads), then calls the
// update kernels with found_inf; an update kernel whose found_inf is already nonzero returns
// without writing anything (params, masters, state and step counts stay bitwise unchanged).
// Why a pre-pass and not a check inside the update pass: "nothing written on overflow" needs
// the verdict before the first write, and an overflow can sit in the last chunk (or another
// dtype bucket) while the first chunks are already updated. Undoing is impossible for
// in-place state, and a two-phase per-chunk scheme still needs a global barrier between the
// phases. The pre-pass reads 2 B/param of the 30 B/param a bf16 O2 AdamW step moves (~7%).
#pragma once

#include <ATen/Dispatch_v2.h>
#include <torch/library.h>

#include <array>
#include <cfloat>
#include <cmath>
#include <optional>
#include <vector>

#include "cpu/multi_tensor_apply.h"

namespace mpnb::cpu::opt {

static_assert(IO<float, float>::kWidth == IO<c10::BFloat16, float>::kWidth,
              "fp32 and 16-bit blocks must have the same width");
constexpr int64_t kW = IO<float, float>::kWidth;
// Lanes of the compiler-vectorized scalar tail of PyTorch's fused kernels (see update_chunk).
constexpr int64_t kTailVecLanes = 8;

// True when the caller's found_inf says an overflow was already seen: skip the whole step.
inline bool step_skipped(const std::optional<at::Tensor>& found_inf, const char* op) {
  if (!found_inf.has_value()) return false;
  TORCH_CHECK_VALUE(found_inf->numel() == 1, op, ": found_inf must hold one value");
  return found_inf->item<double>() != 0.0;
}

// The step's learning rate: the host number, or the value lr_tensor holds (the learning rate on
// the device that a captured step follows; on the CPU, reading it is a load, not a sync).
inline double lr_of(double lr, const std::optional<at::Tensor>& lr_tensor, const char* op) {
  if (!lr_tensor.has_value()) return lr;
  TORCH_CHECK_VALUE(lr_tensor->numel() == 1, op, ": lr_tensor must hold one value");
  return lr_tensor->item<double>();
}

// The grad multiplier: 1 without a scaler, else the fp32 value of inv_scale.
inline float inv_of(const std::optional<at::Tensor>& inv_scale, const char* op) {
  if (!inv_scale.has_value()) return 1.0f;
  TORCH_CHECK_VALUE(inv_scale->numel() == 1, op, ": inv_scale must hold one value");
  return inv_scale->item<float>();
}

// One Tensor[] argument read once from the dispatcher's list (multi_tensor_apply.h's Tensors):
// the list is taken by reference, never converted, and each element is looked up once here
// (c10::List's operator[] goes through the IValue on every access; the kernels index each
// list several times per tensor). The references live as long as the kernel's arguments.
class TensorRefs {
 public:
  explicit TensorRefs(const Tensors& list) {
    refs_.reserve(list.size());
    for (size_t i = 0; i < list.size(); ++i) refs_.push_back(&list[i]);
  }
  size_t size() const { return refs_.size(); }
  bool empty() const { return refs_.empty(); }
  const at::Tensor& operator[](size_t i) const { return *refs_[i]; }

 private:
  std::vector<const at::Tensor*> refs_;
};

// The data of a tensor whose dtype the kernel has already checked (check_opt_lists,
// check_steps): no second dtype check per access.
template <typename T>
C10_ALWAYS_INLINE T* data_of(const at::Tensor& t) {
  return static_cast<T*>(t.mutable_data_ptr());
}
template <typename T>
C10_ALWAYS_INLINE const T* cdata_of(const at::Tensor& t) {
  return static_cast<const T*>(t.const_data_ptr());
}

// Guard one optimizer call's lists (checked in Python before; short messages, see
// multi_tensor_apply.h): params/grads of one dtype each (fp32/fp16/bf16), every state and
// master list fp32 and the same sizes as params.
template <class L, class... States>
inline void check_opt_lists(const char* op, const L& params, const L& grads, const L& masters,
                            const States&... states) {
  const int64_t n = static_cast<int64_t>(params.size());
  check_list(params, op, "params", n);
  check_list(grads, op, "grads", n);
  check_same_sizes(params, grads, op, "grads");
  TORCH_CHECK_VALUE(masters.empty() || static_cast<int64_t>(masters.size()) == n, op,
                    ": list length of masters");
  if (!masters.empty()) {
    check_list(masters, op, "masters", n);
    check_same_sizes(params, masters, op, "masters");
  }
  (check_list(states, op, "state", n), ...);
  (check_same_sizes(params, states, op, "state"), ...);
  if (n == 0) return;
  auto opt_dtype = [&](const L& l, const char* what) {
    const auto t = l[0].scalar_type();
    TORCH_CHECK_TYPE(t == at::kFloat || t == at::kHalf || t == at::kBFloat16, op, ": dtype of ",
                     what);
  };
  opt_dtype(params, "params");
  opt_dtype(grads, "grads");
  auto fp32_state = [&](const L& s) {
    TORCH_CHECK_TYPE(s[0].scalar_type() == at::kFloat, op, ": dtype of state");
  };
  (fp32_state(states), ...);
  TORCH_CHECK_TYPE(masters.empty() || masters[0].scalar_type() == at::kFloat, op,
                   ": dtype of masters");
}

// Check the per-param one-element fp32 CPU step tensors (before anything is written).
template <class L>
inline void check_steps(const L& steps, int64_t n, const char* op) {
  TORCH_CHECK_VALUE(static_cast<int64_t>(steps.size()) == n, op, ": list length of steps");
  for (int64_t i = 0; i < n; ++i) {
    const at::Tensor& s = steps[i];
    TORCH_CHECK_TYPE(s.numel() == 1 && s.scalar_type() == at::kFloat, op, ": steps[", i, "]");
    TORCH_CHECK_VALUE(s.device().is_cpu(), op, ": steps[", i, "] is not on the CPU");
  }
}

// Advance the (checked) step tensors by one and return their new values.
template <class L>
inline std::vector<double> advance_steps(const L& steps) {
  const int64_t n = static_cast<int64_t>(steps.size());
  std::vector<double> out(n);
  for (int64_t i = 0; i < n; ++i) {
    float* s = data_of<float>(steps[i]);
    *s = *s + 1.0f;
    out[i] = static_cast<double>(*s);
  }
  return out;
}

// Per-tensor factors that depend only on the step count, computed once per run of equal
// counts (the params of one optimizer mostly share a step count): factor(step) -> T.
template <typename T, typename F>
inline std::vector<T> per_step(const std::vector<double>& steps, const F& factor) {
  std::vector<T> out(steps.size());
  for (size_t i = 0; i < steps.size(); ++i)
    out[i] = (i > 0 && steps[i] == steps[i - 1]) ? out[i - 1] : factor(steps[i]);
  return out;
}

// ---- division by a per-tensor scalar, bit for bit, without the divider ------------------
//
// Adam divides sqrt(exp_avg_sq) by sqrt(bias_correction2), a number fixed for a tensor, and
// then divides by the denominator. Both are IEEE divisions in PyTorch's fused kernel, so both
// must round as a division does; on the CPUs here the divider (shared with the square root)
// is what an Adam step waits on once its data is in cache. The scalar division becomes one
// multiply and two fmas with the same result (Markstein's theorem: if y is within half an
// ulp of 1/d and q within one ulp of x/d, then r = x - q d is exact and RN(q + r y) is
// RN(x/d); P. Markstein, IBM J. Res. Dev. 34(1), 1990; Handbook of Floating-Point
// Arithmetic, ch. 4): y = RN(1/d) once per tensor, q = RN(x y), r = fma(-q, d, x), and the
// quotient is fma(r, y, q).
//
// The theorem needs no overflow or underflow on the way. The kernels pass x = sqrt(v) for an
// fp32 v >= 0, so x is 0, +inf, NaN or in [2^-75, 2^64], and the divisor route is taken only
// for d in [2^-60, 2] (every valid beta2 gives d in [2^-27, 1]); then q <= 2^124 and a
// nonzero r >= 2^-102, both normal. x = 0 gives q = r = 0 and the quotient 0. x = +inf gives
// q = +inf and r = inf - inf = NaN: r is clamped with a min whose NaN operand yields the
// other one (minps returns its second operand when either is NaN), so r = FLT_MAX and the
// quotient is +inf, as inf / d is. A NaN x gives a NaN quotient (q is NaN). Any other d
// (beta2 outside [0, 1) reaching the op directly: 0, NaN, huge) divides as before.
// Checked against vdivps at every fp32 significand of x for 21,000 significands of d (the
// 3,000 lowest and highest and the 3,000 from 1.5 up, 12,000 at random): no difference;
// tests/core/ops/test_adam.py holds the step to PyTorch's bit for bit at 1,200
// step counts.
struct ScalarDivisor {
  float d = 1.0f;      // the divisor
  float recip = 1.0f;  // RN(1/d)
  bool by_recip = false;

  ScalarDivisor() = default;
  explicit ScalarDivisor(float d_)
      : d(d_), recip(1.0f / d_), by_recip(d_ >= 0x1p-60f && d_ <= 2.0f) {}
};

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
// c - a b with one rounding (at::vec's generic fnmadd rounds the product first).
C10_ALWAYS_INLINE fVec fnmadd_fused(const fVec& a, const fVec& b, const fVec& c) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_fnmadd_ps(a, b, c);
#else
  return _mm256_fnmadd_ps(a, b, c);
#endif
}

// min(a, b), b where either is NaN (minps; at::vec's minimum propagates the NaN).
C10_ALWAYS_INLINE fVec min_or_second(const fVec& a, const fVec& b) {
#if defined(CPU_CAPABILITY_AVX512)
  return _mm512_min_ps(a, b);
#else
  return _mm256_min_ps(a, b);
#endif
}
#endif

// x / div.d, rounded as IEEE division (see ScalarDivisor for the range of x it is exact on).
C10_ALWAYS_INLINE fVec divide(const fVec& x, const ScalarDivisor& div) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  if (div.by_recip) {
    const fVec y(div.recip);
    const fVec q = x * y;
    const fVec r = min_or_second(fnmadd_fused(q, fVec(div.d), x), fVec(FLT_MAX));
    return at::vec::fmadd(r, y, q);
  }
#endif
  return x / fVec(div.d);
}

// Call fn(c) for each chunk index c in [begin, end) (`numel` elements in all), in parallel when
// the work is worth it (the rule of for_each_chunk). Each thread gets one contiguous range of
// chunks; with `backward` it walks its range from the last chunk to the first (a second pass
// over data a first forward pass just read then starts on what is still in cache).
template <typename F>
inline void for_chunk_range(int64_t begin, int64_t end, int64_t numel, bool backward,
                            const F& fn) {
  auto run = [&](int64_t b, int64_t e) {
    if (backward)
      for (int64_t c = e - 1; c >= b; --c) fn(c);
    else
      for (int64_t c = b; c < e; ++c) fn(c);
  };
  if (end <= begin) return;
  if (numel < kSerialElems || end - begin == 1 || at::get_num_threads() == 1) {
    run(begin, end);
    return;
  }
  at::parallel_for(begin, end, 1, run);
}

// The update of one chunk: apply `body(tensor, w, g, s)` to each fp32 register of 8 lanes.
// (Forced inline, like `block` and every body: left to itself GCC calls the body out of line
// and spills all registers, which halved the bf16 AdamW step. Bodies are small; the loop
// stays one straight-line block.)
// w is the weight (the fp32 master when `masters` is non-empty, else the param widened), g the
// unscaled grad, s[k] the k-th state. The new w (rounded to the param dtype, and also to the
// master) and the new states are stored. Tails use counted loads/stores (zero padding): the
// padding lanes are computed and discarded, never stored. A register of the tensor's last
// partial vector goes to `body.tail(...)` when the body has one: PyTorch's fused kernels
// compute those elements in scalar code, whose rounding a body may mirror there. That scalar
// loop is itself vectorized by the compiler kTailVecLanes lanes at a time, with the vector
// loop's rounding, when the tail holds that many (only with AVX-512, whose 16-lane vectors
// leave tails of 8 to 15): those leading lanes take `body(...)`, the last (tail % 8) `tail`.
//
// s_t is the states' storage type: fp32, except SGD's momentum buffer of a half param without a
// master (torch.optim.SGD's and Apex's), which is loaded widened and stored rounded like the
// param.
template <typename p_t, typename g_t, size_t NS, typename s_t = float, typename Body>
C10_ALWAYS_INLINE void update_chunk(const Chunk& ch, const TensorRefs& params,
                                    const TensorRefs& grads, const TensorRefs& masters,
                                    const std::array<const TensorRefs*, NS>& states, float inv,
                                    const Body& body_) {
  // A local copy of the body (and of the members it holds by value): stores through the
  // vector intrinsics may alias anything, so members read through a reference would be
  // reloaded after every store.
  const Body body = body_;
  const bool has_master = !masters.empty();
  const bool scaled = inv != 1.0f;
  const fVec vinv(inv);
  const int64_t t = ch.tensor, off = ch.offset, n = ch.len;
  const g_t* g = cdata_of<g_t>(grads[t]) + off;
  p_t* p = data_of<p_t>(params[t]) + off;
  float* w = has_master ? data_of<float>(masters[t]) + off : nullptr;
  std::array<s_t*, NS> sp;
  for (size_t k = 0; k < NS; ++k) sp[k] = data_of<s_t>((*states[k])[t]) + off;
  fVec w0, w1, g0, g1;
  std::array<fVec, NS> s0, s1;
  // lanes: the register's elements of the tensor when it is partial
  auto step = [&](fVec& w_, const fVec& g_, fVec* s_, bool partial,
                  int64_t lanes) C10_ALWAYS_INLINE_ATTRIBUTE {
    if constexpr (requires { body.tail(t, w_, g_, s_); }) {
      if (partial) {
        const int64_t vec_lanes = lanes / kTailVecLanes * kTailVecLanes;
        if (vec_lanes == 0) return body.tail(t, w_, g_, s_);
        fVec wv = w_;
        std::array<fVec, NS> sv;
        for (size_t k = 0; k < NS; ++k) sv[k] = s_[k];
        body(t, wv, g_, sv.data());
        body.tail(t, w_, g_, s_);
        const fVec lead = fVec::arange(0.0f, 1.0f) < fVec(static_cast<float>(vec_lanes));
        w_ = fVec::blendv(w_, wv, lead);
        for (size_t k = 0; k < NS; ++k) s_[k] = fVec::blendv(s_[k], sv[k], lead);
        return;
      }
    }
    body(t, w_, g_, s_);
  };
  auto block = [&](int64_t i, int64_t cnt, bool full) C10_ALWAYS_INLINE_ATTRIBUTE {
    if (full) {
      prefetch_ahead(g + i);
      if (has_master) prefetch_ahead(w + i);
      else prefetch_ahead(p + i);
      for (size_t k = 0; k < NS; ++k) prefetch_ahead(sp[k] + i);
      IO<g_t, float>::load(g + i, g0, g1);
      if (has_master) IO<float, float>::load(w + i, w0, w1);
      else IO<p_t, float>::load(p + i, w0, w1);
      for (size_t k = 0; k < NS; ++k) IO<s_t, float>::load(sp[k] + i, s0[k], s1[k]);
    } else {
      IO<g_t, float>::load(g + i, cnt, g0, g1);
      if (has_master) IO<float, float>::load(w + i, cnt, w0, w1);
      else IO<p_t, float>::load(p + i, cnt, w0, w1);
      for (size_t k = 0; k < NS; ++k) IO<s_t, float>::load(sp[k] + i, cnt, s0[k], s1[k]);
    }
    if (scaled) {
      g0 = g0 * vinv;
      g1 = g1 * vinv;
    }
    // A chunk ends a tensor unless it is a full kChunkElems (a multiple of kW): in the counted
    // block, the first register is partial below fVec::size() elements, the second above.
    constexpr int64_t V = fVec::size();
    step(w0, g0, s0.data(), !full && cnt < V, cnt);
    step(w1, g1, s1.data(), !full && cnt > V, cnt - V);
    if (full) {
      for (size_t k = 0; k < NS; ++k) IO<s_t, float>::store(sp[k] + i, s0[k], s1[k]);
      if (has_master) IO<float, float>::store(w + i, w0, w1);
      IO<p_t, float>::store(p + i, w0, w1);
    } else {
      for (size_t k = 0; k < NS; ++k) IO<s_t, float>::store(sp[k] + i, cnt, s0[k], s1[k]);
      if (has_master) IO<float, float>::store(w + i, cnt, w0, w1);
      IO<p_t, float>::store(p + i, cnt, w0, w1);
    }
  };
  int64_t i = 0;
  for (; i + kW <= n; i += kW) block(i, kW, true);
  if (i < n) block(i, n - i, false);
}

// Update every chunk of the lists (see update_chunk), in parallel. `states` points at the
// state lists (one per state of the update), stored as s_t. Tensors flagged in `skip` (when
// given) are left alone: the op updates them with another kernel.
template <typename p_t, typename g_t, size_t NS, typename s_t = float, typename Body>
void apply_update(const TensorRefs& params, const TensorRefs& grads, const TensorRefs& masters,
                  const std::array<const TensorRefs*, NS>& states, float inv, const Body& body,
                  const std::vector<char>* skip = nullptr) {
  auto table = make_chunks(params, kChunkElems, skip);
  for_each_chunk(table, [&](int64_t, const Chunk& ch) {
    update_chunk<p_t, g_t, NS, s_t>(ch, params, grads, masters, states, inv, body);
  });
}

// Dispatch (param dtype, grad dtype) over fp32/fp16/bf16 and call fn.template operator()<p_t, g_t>.
// Calls f.template operator()<p_t, g_t>() with the C++ types of the params' and grads' dtypes
// (fp32, fp16 or bf16 each; the state is always fp32).
template <typename F>
void dispatch_param_grad(at::ScalarType pt, at::ScalarType gt, const F& f) {
  AT_DISPATCH_V2(pt, "mpnb optimizer params", AT_WRAP([&] {
    using p_t = scalar_t;
    AT_DISPATCH_V2(gt, "mpnb optimizer grads", AT_WRAP([&] { f.template operator()<p_t, scalar_t>(); }),
                   at::kFloat, at::kHalf, at::kBFloat16);
  }), at::kFloat, at::kHalf, at::kBFloat16);
}

}  // namespace mpnb::cpu::opt
