// Shared machinery of the fused optimizer kernels (opt_adam.h, opt_sgd.h, opt_lamb.h).
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
#include <cmath>
#include <optional>
#include <vector>

#include "cpu/multi_tensor_apply.h"

namespace mpnb::cpu::opt {

static_assert(IO<float, float>::kWidth == IO<c10::BFloat16, float>::kWidth,
              "fp32 and 16-bit blocks must have the same width");
constexpr int64_t kW = IO<float, float>::kWidth;

// True when the caller's found_inf says an overflow was already seen: skip the whole step.
inline bool step_skipped(const std::optional<at::Tensor>& found_inf, const char* op) {
  if (!found_inf.has_value()) return false;
  TORCH_CHECK(found_inf->numel() == 1, op, ": found_inf must hold one value, got ",
              found_inf->numel(), ".");
  return found_inf->item<double>() != 0.0;
}

// The grad multiplier: 1 without a scaler, else the fp32 value of inv_scale.
inline float inv_of(const std::optional<at::Tensor>& inv_scale, const char* op) {
  if (!inv_scale.has_value()) return 1.0f;
  TORCH_CHECK(inv_scale->numel() == 1, op, ": inv_scale must hold one value, got ",
              inv_scale->numel(), ".");
  return inv_scale->item<float>();
}

// Validate one optimizer call's lists: params/grads of one dtype each (fp32/fp16/bf16), every
// state and master list fp32 and the same sizes as params.
inline void check_opt_lists(const char* op, at::TensorList params, at::TensorList grads,
                            at::TensorList masters, std::initializer_list<at::TensorList> states) {
  const int64_t n = static_cast<int64_t>(params.size());
  check_list(params, op, "params", n);
  check_list(grads, op, "grads", n);
  check_same_sizes(params, grads, op, "grads");
  TORCH_CHECK_VALUE(masters.empty() || static_cast<int64_t>(masters.size()) == n, op,
              ": 'masters' must be empty (no master weights) or hold one fp32 tensor per param, ",
              "got ", masters.size(), " for ", n, " params.");
  if (!masters.empty()) {
    check_list(masters, op, "masters", n);
    check_same_sizes(params, masters, op, "masters");
  }
  for (auto s : states) {
    check_list(s, op, "state", n);
    check_same_sizes(params, s, op, "state");
  }
  if (n == 0) return;
  for (auto s : states)
    TORCH_CHECK_TYPE(s[0].scalar_type() == at::kFloat, op, ": optimizer state must be float32, got ",
                s[0].scalar_type(), "; keep state in fp32 (the optimizers do).");
  TORCH_CHECK_TYPE(masters.empty() || masters[0].scalar_type() == at::kFloat, op,
              ": master weights must be float32, got ", masters[0].scalar_type(), ".");
}

// Check the per-param one-element fp32 step tensors and return their values after +1.
inline std::vector<double> advance_steps(at::TensorList steps, int64_t n, const char* op) {
  TORCH_CHECK(static_cast<int64_t>(steps.size()) == n, op, ": 'steps' must hold one tensor per ",
              "param, got ", steps.size(), " for ", n, ".");
  std::vector<double> out(n);
  for (int64_t i = 0; i < n; ++i) {
    TORCH_CHECK(steps[i].numel() == 1 && steps[i].scalar_type() == at::kFloat &&
                    steps[i].device().is_cpu(),
                op, ": step ", i, " must be a one-element float32 CPU tensor (torch's fused ",
                "optimizers' format), got ", steps[i].scalar_type(), " with ", steps[i].numel(),
                " elements.");
    float* s = steps[i].mutable_data_ptr<float>();
    *s = *s + 1.0f;
    out[i] = static_cast<double>(*s);
  }
  return out;
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
// (Forced inline, like `block` and every body: left to itself GCC stops inlining once the one
// translation unit of csrc/ grows, calls the body out of line and spills all registers, which
// halved the bf16 AdamW step. Bodies are small; the loop stays one straight-line block.)
// w is the weight (the fp32 master when `masters` is non-empty, else the param widened), g the
// unscaled grad, s[k] the k-th state. The new w (rounded to the param dtype, and also to the
// master) and the new states are stored. Tails use counted loads/stores (zero padding): the
// padding lanes are computed and discarded, never stored.
template <typename p_t, typename g_t, size_t NS, typename Body>
C10_ALWAYS_INLINE void update_chunk(const Chunk& ch, at::TensorList params, at::TensorList grads,
                                    at::TensorList masters,
                                    const std::array<at::TensorList, NS>& states, float inv,
                                    const Body& body_) {
  // A local copy of the body (and of the members it holds by value): stores through the
  // vector intrinsics may alias anything, so members read through a reference would be
  // reloaded after every store.
  const Body body = body_;
  const bool has_master = !masters.empty();
  const bool scaled = inv != 1.0f;
  const fVec vinv(inv);
  const int64_t t = ch.tensor, off = ch.offset, n = ch.len;
  const g_t* g = grads[t].const_data_ptr<g_t>() + off;
  p_t* p = params[t].mutable_data_ptr<p_t>() + off;
  float* w = has_master ? masters[t].mutable_data_ptr<float>() + off : nullptr;
  std::array<float*, NS> sp;
  for (size_t k = 0; k < NS; ++k) sp[k] = states[k][t].template mutable_data_ptr<float>() + off;
  fVec w0, w1, g0, g1;
  std::array<fVec, NS> s0, s1;
  auto block = [&](int64_t i, int64_t cnt, bool full) C10_ALWAYS_INLINE_ATTRIBUTE {
    if (full) {
      IO<g_t, float>::load(g + i, g0, g1);
      if (has_master) IO<float, float>::load(w + i, w0, w1);
      else IO<p_t, float>::load(p + i, w0, w1);
      for (size_t k = 0; k < NS; ++k) IO<float, float>::load(sp[k] + i, s0[k], s1[k]);
    } else {
      IO<g_t, float>::load(g + i, cnt, g0, g1);
      if (has_master) IO<float, float>::load(w + i, cnt, w0, w1);
      else IO<p_t, float>::load(p + i, cnt, w0, w1);
      for (size_t k = 0; k < NS; ++k) IO<float, float>::load(sp[k] + i, cnt, s0[k], s1[k]);
    }
    if (scaled) {
      g0 = g0 * vinv;
      g1 = g1 * vinv;
    }
    body(t, w0, g0, s0.data());
    body(t, w1, g1, s1.data());
    if (full) {
      for (size_t k = 0; k < NS; ++k) IO<float, float>::store(sp[k] + i, s0[k], s1[k]);
      if (has_master) IO<float, float>::store(w + i, w0, w1);
      IO<p_t, float>::store(p + i, w0, w1);
    } else {
      for (size_t k = 0; k < NS; ++k) IO<float, float>::store(sp[k] + i, cnt, s0[k], s1[k]);
      if (has_master) IO<float, float>::store(w + i, cnt, w0, w1);
      IO<p_t, float>::store(p + i, cnt, w0, w1);
    }
  };
  int64_t i = 0;
  for (; i + kW <= n; i += kW) block(i, kW, true);
  if (i < n) block(i, n - i, false);
}

// Update every chunk of the lists (see update_chunk), in parallel.
template <typename p_t, typename g_t, size_t NS, typename Body>
void apply_update(at::TensorList params, at::TensorList grads, at::TensorList masters,
                  const std::array<at::TensorList, NS>& states, float inv, const Body& body) {
  auto table = make_chunks(params);
  for_each_chunk(table, [&](int64_t, const Chunk& ch) {
    update_chunk<p_t, g_t, NS>(ch, params, grads, masters, states, inv, body);
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
