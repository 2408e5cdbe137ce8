// Apex's amp_C multi-tensor kernels on the CPU: scale (copy-and-scale with overflow flag),
// axpby, l2norm (optionally of unscaled values), a read-only finite check, and the
// hysteresis loss-scale update. Semantics follow Apex: none of these skip work when the flag
// is already set (they propagate infs/NaNs); they only ever set the flag, never clear it.
#pragma once

#include <torch/library.h>

#include <optional>
#include <tuple>

#include "cpu/multi_tensor_apply.h"

namespace mpnb::cpu {

// ---- scale: dst = src * scale, flag if any src is not finite -----------------------------

template <typename in_t, typename out_t, typename Acc>
inline bool scale_range(const in_t* x, out_t* y, int64_t n, Acc s, bool stream) {
  using V = Vectorized<Acc>;
  using I = IO<in_t, Acc>;
  using O = IO<out_t, Acc>;
  constexpr int64_t W = I::kWidth;
  static_assert(W == O::kWidth, "mismatched block widths");
  const V vs(s);
  V bad(Acc(0)), a, b;
  auto part = [&](int64_t i, int64_t len) {
    I::load(x + i, len, a, b);
    accumulate_nonfinite(bad, a);
    accumulate_nonfinite(bad, b);
    O::store(y + i, len, a * vs, b * vs);
  };
  int64_t i = 0;
  if (stream) {
    const int64_t head = align_head(y, n);
    for (; i < head; i += W) part(i, std::min(W, head - i));
    for (; i + W <= n; i += W) {
      I::load(x + i, a, b);
      accumulate_nonfinite(bad, a);
      accumulate_nonfinite(bad, b);
      O::stream(y + i, a * vs, b * vs);
    }
  } else {
    for (; i + W <= n; i += W) {
      I::load(x + i, a, b);
      accumulate_nonfinite(bad, a);
      accumulate_nonfinite(bad, b);
      O::store(y + i, a * vs, b * vs);
    }
  }
  if (i < n) part(i, n - i);
  return all_finite(bad);
}

inline double scalar_of(const std::optional<at::Tensor>& t, const char* op, const char* what) {
  if (!t.has_value()) return 1.0;
  TORCH_CHECK_VALUE(t->numel() == 1, op, ": '", what, "' must hold one value, got ", t->numel(), ".");
  return t->item<double>();
}

template <typename in_t, typename out_t>
void scale_lists(const at::Tensor& flag, at::TensorList src, at::TensorList dst, double scale,
                 const std::optional<at::Tensor>& scale_tensor) {
  using Acc = acc_t<in_t>;
  Acc s;
  if constexpr (std::is_same_v<Acc, double>) {
    s = scale * scalar_of(scale_tensor, "multi_tensor_scale", "scale_tensor");
  } else {  // the float path rounds both factors to fp32 first, as a float32 tensor op would
    s = static_cast<float>(scale);
    if (scale_tensor.has_value())
      s = s * static_cast<float>(scalar_of(scale_tensor, "multi_tensor_scale", "scale_tensor"));
  }
  auto table = make_chunks(src);
  const bool stream = table.numel * static_cast<int64_t>(sizeof(out_t)) >= kStreamMinBytes;
  std::vector<uint8_t> ok(table.chunks.size(), 1);
  for_each_chunk(table, [&](int64_t c, const Chunk& ch) {
    const in_t* x = src[ch.tensor].const_data_ptr<in_t>() + ch.offset;
    out_t* y = dst[ch.tensor].mutable_data_ptr<out_t>() + ch.offset;
    ok[c] = scale_range<in_t, out_t, Acc>(x, y, ch.len, s, stream);
  });
  if (stream) stream_fence();
  for (auto v : ok)
    if (!v) { raise_flag(flag); break; }
}

inline void multi_tensor_scale_cpu(const at::Tensor& noop_flag, at::TensorList src,
                                   at::TensorList dst, double scale,
                                   const std::optional<at::Tensor>& scale_tensor) {
  const char* op = "mpnb::multi_tensor_scale";
  check_list(src, op, "src", src.size());
  check_list(dst, op, "dst", src.size());
  check_same_sizes(src, dst, op, "dst");
  if (src.empty()) return;
  check_float(src, op, "src");
  check_float(dst, op, "dst");
  const auto ti = src[0].scalar_type(), to = dst[0].scalar_type();
  if (ti == at::kDouble || to == at::kDouble) {
    TORCH_CHECK_TYPE(ti == to, op, ": float64 lists can only be paired with float64 lists, got ",
                ti, " and ", to, ".");
    return scale_lists<double, double>(noop_flag, src, dst, scale, scale_tensor);
  }
  MPNB_DISPATCH_HALF_FLOAT(ti, in_t, [&] {
    MPNB_DISPATCH_HALF_FLOAT(to, out_t, [&] {
      scale_lists<in_t, out_t>(noop_flag, src, dst, scale, scale_tensor);
    });
  });
}

// ---- axpby: out = a*x + b*y, flag by arg_to_check (-1 both, 0 x, 1 y) -------------------

template <typename x_t, typename y_t, typename o_t, typename Acc>
inline bool axpby_range(const x_t* x, const y_t* y, o_t* o, int64_t n, Acc a, Acc b,
                        int64_t check, bool stream) {
  using V = Vectorized<Acc>;
  using O = IO<o_t, Acc>;
  constexpr int64_t W = IO<x_t, Acc>::kWidth;
  static_assert(W == IO<y_t, Acc>::kWidth && W == O::kWidth, "mismatched widths");
  const V va(a), vb(b);
  V bad(Acc(0)), x0, x1, y0, y1;
  auto load = [&](int64_t i, int64_t len) {
    if (len == W) {
      IO<x_t, Acc>::load(x + i, x0, x1);
      IO<y_t, Acc>::load(y + i, y0, y1);
    } else {
      IO<x_t, Acc>::load(x + i, len, x0, x1);
      IO<y_t, Acc>::load(y + i, len, y0, y1);
    }
    if (check != 1) { accumulate_nonfinite(bad, x0); accumulate_nonfinite(bad, x1); }
    if (check != 0) { accumulate_nonfinite(bad, y0); accumulate_nonfinite(bad, y1); }
  };
  auto part = [&](int64_t i, int64_t len) {
    load(i, len);
    O::store(o + i, len, va * x0 + vb * y0, va * x1 + vb * y1);
  };
  int64_t i = 0;
  if (stream) {
    const int64_t head = align_head(o, n);
    for (; i < head; i += W) part(i, std::min(W, head - i));
    for (; i + W <= n; i += W) {
      load(i, W);
      O::stream(o + i, va * x0 + vb * y0, va * x1 + vb * y1);
    }
  } else {
    for (; i + W <= n; i += W) {
      load(i, W);
      O::store(o + i, va * x0 + vb * y0, va * x1 + vb * y1);
    }
  }
  if (i < n) part(i, n - i);
  return all_finite(bad);
}

template <typename x_t, typename y_t, typename o_t>
void axpby_lists(const at::Tensor& flag, at::TensorList xs, at::TensorList ys, at::TensorList os,
                 double a, double b, int64_t check) {
  using Acc = acc_t<x_t>;
  auto table = make_chunks(xs);
  // Streaming stores only when out is a separate buffer: in place, the line is already owned.
  const bool in_place = !xs.empty() && (xs[0].data_ptr() == os[0].data_ptr() ||
                                        ys[0].data_ptr() == os[0].data_ptr());
  const bool stream =
      !in_place && table.numel * static_cast<int64_t>(sizeof(o_t)) >= kStreamMinBytes;
  std::vector<uint8_t> ok(table.chunks.size(), 1);
  for_each_chunk(table, [&](int64_t c, const Chunk& ch) {
    ok[c] = axpby_range<x_t, y_t, o_t, Acc>(
        xs[ch.tensor].const_data_ptr<x_t>() + ch.offset,
        ys[ch.tensor].const_data_ptr<y_t>() + ch.offset,
        os[ch.tensor].mutable_data_ptr<o_t>() + ch.offset, ch.len, static_cast<Acc>(a),
        static_cast<Acc>(b), check, stream);
  });
  if (stream) stream_fence();
  for (auto v : ok)
    if (!v) { raise_flag(flag); break; }
}

inline void multi_tensor_axpby_cpu(const at::Tensor& noop_flag, at::TensorList x, at::TensorList y,
                                   at::TensorList out, double a, double b, int64_t arg_to_check) {
  const char* op = "mpnb::multi_tensor_axpby";
  TORCH_CHECK_VALUE(arg_to_check >= -1 && arg_to_check <= 1, op, ": arg_to_check must be -1 (both), ",
              "0 (x) or 1 (y), got ", arg_to_check, ".");
  check_list(x, op, "x", x.size());
  check_list(y, op, "y", x.size());
  check_list(out, op, "out", x.size());
  check_same_sizes(x, y, op, "y");
  check_same_sizes(x, out, op, "out");
  if (x.empty()) return;
  check_float(x, op, "x");
  check_float(y, op, "y");
  check_float(out, op, "out");
  const auto tx = x[0].scalar_type(), ty = y[0].scalar_type(), to = out[0].scalar_type();
  if (tx == at::kDouble || ty == at::kDouble || to == at::kDouble) {
    TORCH_CHECK_TYPE(tx == ty && ty == to, op, ": float64 lists can only be mixed with float64 lists.");
    return axpby_lists<double, double, double>(noop_flag, x, y, out, a, b, arg_to_check);
  }
  MPNB_DISPATCH_HALF_FLOAT(tx, x_t, [&] {
    MPNB_DISPATCH_HALF_FLOAT(ty, y_t, [&] {
      MPNB_DISPATCH_HALF_FLOAT(to, o_t, [&] {
        axpby_lists<x_t, y_t, o_t>(noop_flag, x, y, out, a, b, arg_to_check);
      });
    });
  });
}

// ---- l2norm: global and per-tensor norms (optionally of x * inv_scale) -------------------

// Sum of squares in fp64: exact enough for any finite input, used as the fallback.
template <typename T, typename Acc, bool kScaled>
inline double sumsq_fp64(const T* x, int64_t n, Acc inv) {
  using V = Vectorized<Acc>;
  constexpr int64_t W = IO<T, Acc>::kWidth;
  const V vi(inv);
  dVec s0(0.0), s1(0.0), s2(0.0), s3(0.0);
  V a, b;
  for (int64_t i = 0; i < n; i += W) {
    if (i + W <= n) IO<T, Acc>::load(x + i, a, b);
    else IO<T, Acc>::load(x + i, n - i, a, b);
    if constexpr (kScaled) { a = a * vi; b = b * vi; }
    accumulate_squares(s0, s1, a);
    accumulate_squares(s2, s3, b);
  }
  return hsum((s0 + s1) + (s2 + s3));
}

// Fast path: squares summed in fp32 lanes over blocks of kL2Block elements, each block's lanes
// widened into fp64. A block error stays near 1e-7 relative; a chunk that overflows fp32
// (|x| > 1.8e19) or underflows it (tiny values) is summed again in fp64.
constexpr int64_t kL2Block = 1024;

template <typename T, typename Acc, bool kScaled>
inline double sumsq_range(const T* x, int64_t n, Acc inv) {
  if constexpr (std::is_same_v<Acc, double>) {
    return sumsq_fp64<T, Acc, kScaled>(x, n, inv);
  } else {
    constexpr int64_t W = IO<T, float>::kWidth;
    const fVec vi(inv);
    dVec d0(0.0), d1(0.0);
    fVec a, b;
    for (int64_t blk = 0; blk < n; blk += kL2Block) {
      const int64_t end = std::min(n, blk + kL2Block);
      // Four independent fma chains: one chain is bound by the fma latency (4 cycles on
      // Zen 3), not by the loads; the lanes are combined in a fixed order.
      fVec f0(0.f), f1(0.f), f2(0.f), f3(0.f);
      fVec c, e;
      int64_t i = blk;
      for (; i + 2 * W <= end; i += 2 * W) {
        IO<T, float>::load(x + i, a, b);
        IO<T, float>::load(x + i + W, c, e);
        if constexpr (kScaled) { a = a * vi; b = b * vi; c = c * vi; e = e * vi; }
        f0 = at::vec::fmadd(a, a, f0);
        f1 = at::vec::fmadd(b, b, f1);
        f2 = at::vec::fmadd(c, c, f2);
        f3 = at::vec::fmadd(e, e, f3);
      }
      for (; i < end; i += W) {
        if (i + W <= end) IO<T, float>::load(x + i, a, b);
        else IO<T, float>::load(x + i, end - i, a, b);
        if constexpr (kScaled) { a = a * vi; b = b * vi; }
        f0 = at::vec::fmadd(a, a, f0);
        f1 = at::vec::fmadd(b, b, f1);
      }
      widen_add(d0, d1, (f0 + f1) + (f2 + f3));
    }
    const double s = hsum(d0 + d1);
    if (!std::isfinite(s) || s < 1e-30) return sumsq_fp64<T, Acc, kScaled>(x, n, inv);
    return s;
  }
}

template <typename T>
std::tuple<at::Tensor, at::Tensor> l2norm_lists(const at::Tensor& flag, at::TensorList xs,
                                                bool per_tensor, double inv_scale) {
  using Acc = acc_t<T>;
  const auto out_dtype = std::is_same_v<T, double> ? at::kDouble : at::kFloat;
  auto table = make_chunks(xs);
  std::vector<double> partial(table.chunks.size(), 0.0);
  const Acc inv = static_cast<Acc>(inv_scale);
  const bool scaled = inv_scale != 1.0;
  for_each_chunk(table, [&](int64_t c, const Chunk& ch) {
    const T* x = xs[ch.tensor].const_data_ptr<T>() + ch.offset;
    partial[c] = scaled ? sumsq_range<T, Acc, true>(x, ch.len, inv)
                        : sumsq_range<T, Acc, false>(x, ch.len, inv);
  });
  const int64_t nt = static_cast<int64_t>(xs.size());
  auto opts = at::TensorOptions().dtype(at::kDouble);
  at::Tensor per = at::empty({per_tensor ? nt : 0}, opts);
  double total = 0.0;
  for (int64_t t = 0; t < nt; ++t) {
    double s = 0.0;
    for (int64_t c = table.first_chunk[t]; c < table.first_chunk[t + 1]; ++c) s += partial[c];
    total += s;
    if (per_tensor) per.data_ptr<double>()[t] = std::sqrt(s);
  }
  at::Tensor norm = at::full({1}, std::sqrt(total), opts).to(out_dtype);
  if (!std::isfinite(norm.item<double>())) raise_flag(flag);
  return {norm, per.to(out_dtype)};
}

inline std::tuple<at::Tensor, at::Tensor> multi_tensor_l2norm_cpu(
    const at::Tensor& noop_flag, at::TensorList tensors, bool per_tensor,
    const std::optional<at::Tensor>& inv_scale) {
  const char* op = "mpnb::multi_tensor_l2norm";
  check_list(tensors, op, "tensors", tensors.size());
  const double inv = scalar_of(inv_scale, op, "inv_scale");
  if (tensors.empty()) {
    auto opts = at::TensorOptions().dtype(at::kFloat);
    return {at::zeros({1}, opts), at::empty({0}, opts)};
  }
  check_float(tensors, op, "tensors");
  return MPNB_DISPATCH_FLOAT(tensors[0].scalar_type(), T, [&] {
    return l2norm_lists<T>(noop_flag, tensors, per_tensor, inv);
  });
}

// ---- read-only finite check ---------------------------------------------------------------

inline void multi_tensor_check_finite_cpu(const at::Tensor& noop_flag, at::TensorList tensors) {
  const char* op = "mpnb::multi_tensor_check_finite";
  check_list(tensors, op, "tensors", tensors.size());
  if (tensors.empty()) return;
  check_float(tensors, op, "tensors");
  MPNB_DISPATCH_FLOAT(tensors[0].scalar_type(), T, [&] {
    auto table = make_chunks(tensors);
    std::vector<uint8_t> ok(table.chunks.size(), 1);
    for_each_chunk(table, [&](int64_t c, const Chunk& ch) {
      ok[c] = all_finite_bits<T>(tensors[ch.tensor].const_data_ptr<T>() + ch.offset, ch.len);
    });
    for (auto v : ok)
      if (!v) { raise_flag(noop_flag); break; }
  });
}

// ---- loss-scale update with hysteresis (Apex's update_scale_hysteresis) -------------------

// One step of the rule on host-visible state (the tensors are one-element CPU tensors).
inline void hysteresis_step(float* scale, int32_t* growth, int32_t* hyst, double inf,
                            double growth_factor, double backoff_factor, int64_t growth_interval,
                            int64_t hysteresis) {
  if (inf > 0) {
    *hyst -= 1;
    if (*hyst > 0) {  // still inside the hysteresis window: keep the scale, restart growth
      *growth = 0;
      return;
    }
  }
  if (inf != 0) {
    *scale = static_cast<float>(static_cast<double>(*scale) * backoff_factor);
    *growth = 0;
  } else {
    const int64_t successful = static_cast<int64_t>(*growth) + 1;
    if (successful == growth_interval) {
      const float grown = static_cast<float>(static_cast<double>(*scale) * growth_factor);
      if (std::isfinite(grown)) *scale = grown;  // never grow past the fp32 range
      *growth = 0;
    } else {
      *growth = static_cast<int32_t>(successful);
    }
  }
  if (inf <= 0) *hyst = static_cast<int32_t>(hysteresis);
}

inline void check_scaler_state(const char* op, const at::Tensor& current_scale,
                               const at::Tensor& growth_tracker, const at::Tensor& hysteresis_tracker,
                               const at::Tensor& found_inf, int64_t growth_interval) {
  TORCH_CHECK_TYPE(current_scale.scalar_type() == at::kFloat && current_scale.numel() == 1, op,
              ": current_scale must be a one-element float32 tensor.");
  TORCH_CHECK_TYPE(growth_tracker.scalar_type() == at::kInt && growth_tracker.numel() == 1, op,
              ": growth_tracker must be a one-element int32 tensor.");
  TORCH_CHECK_TYPE(hysteresis_tracker.scalar_type() == at::kInt && hysteresis_tracker.numel() == 1, op,
              ": hysteresis_tracker must be a one-element int32 tensor.");
  TORCH_CHECK_VALUE(found_inf.numel() == 1, op, ": found_inf must hold one value.");
  TORCH_CHECK_VALUE(growth_interval > 0, op, ": growth_interval must be positive, got ", growth_interval, ".");
}

inline void update_scale_hysteresis_cpu(const at::Tensor& current_scale, const at::Tensor& growth_tracker,
                                        const at::Tensor& hysteresis_tracker, const at::Tensor& found_inf,
                                        double growth_factor, double backoff_factor,
                                        int64_t growth_interval, int64_t hysteresis) {
  check_scaler_state("mpnb::update_scale_hysteresis", current_scale, growth_tracker,
                     hysteresis_tracker, found_inf, growth_interval);
  hysteresis_step(current_scale.mutable_data_ptr<float>(), growth_tracker.mutable_data_ptr<int32_t>(),
                  hysteresis_tracker.mutable_data_ptr<int32_t>(), found_inf.item<double>(),
                  growth_factor, backoff_factor, growth_interval, hysteresis);
}

// ---- the whole dynamic loss-scale update of one step ---------------------------------------
// update_scale_hysteresis, then the clamp to [min_scale, max_scale] and inv_scale = 1/scale:
// one call where a scaler otherwise makes three (hysteresis, clamp_, reciprocal).

inline void update_loss_scale_cpu(const at::Tensor& current_scale, const at::Tensor& inv_scale,
                                  const at::Tensor& growth_tracker, const at::Tensor& hysteresis_tracker,
                                  const at::Tensor& found_inf, double growth_factor,
                                  double backoff_factor, int64_t growth_interval, int64_t hysteresis,
                                  double min_scale, double max_scale) {
  const char* op = "mpnb::update_loss_scale_";
  check_scaler_state(op, current_scale, growth_tracker, hysteresis_tracker, found_inf, growth_interval);
  TORCH_CHECK_TYPE(inv_scale.scalar_type() == at::kFloat && inv_scale.numel() == 1, op,
              ": inv_scale must be a one-element float32 tensor.");
  TORCH_CHECK_VALUE(min_scale <= max_scale, op, ": min_scale (", min_scale,
                    ") is above max_scale (", max_scale, "); pass min_scale <= max_scale.");
  float* scale = current_scale.mutable_data_ptr<float>();
  const double inf = found_inf.scalar_type() == at::kFloat ? *found_inf.const_data_ptr<float>()
                                                            : found_inf.item<double>();
  hysteresis_step(scale, growth_tracker.mutable_data_ptr<int32_t>(),
                  hysteresis_tracker.mutable_data_ptr<int32_t>(), inf, growth_factor,
                  backoff_factor, growth_interval, hysteresis);
  // As clamp_ on a float32 tensor: bounds rounded to float32, NaN kept.
  const float lo = static_cast<float>(min_scale), hi = static_cast<float>(max_scale);
  float s = *scale;
  if (s < lo) s = lo;
  if (s > hi) s = hi;
  *scale = s;
  *inv_scale.mutable_data_ptr<float>() = 1.0f / s;
}

}  // namespace mpnb::cpu

TORCH_LIBRARY_FRAGMENT(mpnb, m) {
  m.def("multi_tensor_scale(Tensor(a!) noop_flag, Tensor[] src, Tensor(b!)[] dst, float scale, "
        "Tensor? scale_tensor=None) -> ()");
  m.def("multi_tensor_axpby(Tensor(a!) noop_flag, Tensor[] x, Tensor[] y, Tensor(b!)[] out, "
        "float a, float b, int arg_to_check) -> ()");
  m.def("multi_tensor_l2norm(Tensor(a!) noop_flag, Tensor[] tensors, bool per_tensor=False, "
        "Tensor? inv_scale=None) -> (Tensor, Tensor)");
  m.def("multi_tensor_check_finite(Tensor(a!) noop_flag, Tensor[] tensors) -> ()");
  m.def("update_scale_hysteresis(Tensor(a!) current_scale, Tensor(b!) growth_tracker, "
        "Tensor(c!) hysteresis_tracker, Tensor found_inf, float growth_factor, "
        "float backoff_factor, int growth_interval, int hysteresis) -> ()");
  m.def("update_loss_scale_(Tensor(a!) current_scale, Tensor(b!) inv_scale, "
        "Tensor(c!) growth_tracker, Tensor(d!) hysteresis_tracker, Tensor found_inf, "
        "float growth_factor, float backoff_factor, int growth_interval, int hysteresis, "
        "float min_scale, float max_scale) -> ()");
}

TORCH_LIBRARY_IMPL(mpnb, CPU, m) {
  m.impl("multi_tensor_scale", &mpnb::cpu::multi_tensor_scale_cpu);
  m.impl("multi_tensor_axpby", &mpnb::cpu::multi_tensor_axpby_cpu);
  m.impl("multi_tensor_l2norm", &mpnb::cpu::multi_tensor_l2norm_cpu);
  m.impl("multi_tensor_check_finite", &mpnb::cpu::multi_tensor_check_finite_cpu);
  m.impl("update_scale_hysteresis", &mpnb::cpu::update_scale_hysteresis_cpu);
  m.impl("update_loss_scale_", &mpnb::cpu::update_loss_scale_cpu);
}
