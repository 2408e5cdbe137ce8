// Apex's fused layer norm and RMS norm on the CPU, forward and backward.
//
// The input is viewed as rows [M, N] (N = prod(normalized_shape)). One thread owns whole rows:
// the statistics pass reads a row from memory, the later passes find it in L1/L2, so every
// element crosses the memory bus once per direction. Statistics are fp32 for fp32/fp16/bf16
// data (fp64 for fp64): mean first, then the centred sum of squares (two-pass, stable).
// Weights may be the input's dtype or fp32 ("mixed": half input, fp32 weights); the output
// always has the input's dtype. The weight/bias gradients are summed per row block into fp32
// partials that are added in block order, so the result is the same on every run.
#pragma once

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "cpu/multi_tensor_apply.h"

namespace mpnb::cpu {

// Zero the lanes past `n` (a tail block): keeps padded lanes out of row reductions.
template <typename V>
inline void keep_first(V& a, V& b, int64_t n) {
  const int64_t s = V::size();
  a = n >= s ? a : V::set(V(0), a, n);
  b = n >= 2 * s ? b : (n > s ? V::set(V(0), b, n - s) : V(0));
}

struct NormShape {
  int64_t rows, cols;
};

inline NormShape norm_shape(const at::Tensor& x, at::IntArrayRef nshape, const char* op) {
  const int64_t k = static_cast<int64_t>(nshape.size());
  TORCH_CHECK(k >= 1 && x.dim() >= k, op, ": normalized_shape ", nshape, " needs an input with at ",
              "least ", k, " dims, got shape ", x.sizes(), ".");
  int64_t cols = 1;
  for (int64_t i = 0; i < k; ++i) {
    TORCH_CHECK(x.size(x.dim() - k + i) == nshape[i], op, ": input shape ", x.sizes(),
                " does not end with normalized_shape ", nshape, "; pass the trailing dims.");
    cols *= nshape[i];
  }
  return {cols == 0 ? 0 : x.numel() / cols, cols};
}

inline void check_param(const std::optional<at::Tensor>& p, const at::Tensor& x, int64_t cols,
                        const char* op, const char* what) {
  if (!p.has_value()) return;
  TORCH_CHECK(p->device() == x.device(), op, ": ", what, " is on ", p->device(), " but the input is on ",
              x.device(), "; move them to one device.");
  TORCH_CHECK(p->numel() == cols, op, ": ", what, " has ", p->numel(), " elements but normalized_shape ",
              "holds ", cols, "; pass a ", what, " of normalized_shape.");
  const auto t = p->scalar_type();
  TORCH_CHECK(t == x.scalar_type() || (t == at::kFloat && x.scalar_type() != at::kDouble), op, ": ",
              what, " is ", t, " but the input is ", x.scalar_type(), "; use the input's dtype or ",
              "float32 (mixed).");
}

// ---- forward -----------------------------------------------------------------------------

template <typename T, typename W, bool kRms>
void norm_fwd_kernel(const T* X, const W* w, const W* b, T* Y, acc_t<T>* MEAN, acc_t<T>* RSTD,
                     int64_t M, int64_t N, double eps) {
  using Acc = acc_t<T>;
  using V = Vectorized<Acc>;
  using IOT = IO<T, Acc>;
  using IOW = IO<W, Acc>;
  constexpr int64_t K = IOT::kWidth;
  static_assert(K == IOW::kWidth, "input and weight blocks differ");
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(N, 1));
  const bool stream = stream_output<T>(M * N);
  at::parallel_for(0, M, grain, [&](int64_t r0, int64_t r1) {
    V a, c, w0(Acc(1)), w1(Acc(1)), b0(Acc(0)), b1(Acc(0));
    for (int64_t r = r0; r < r1; ++r) {
      const T* x = X + r * N;
      T* y = Y + r * N;
      Acc mu = 0;
      if constexpr (!kRms) {
        V s0(Acc(0)), s1(Acc(0));
        int64_t i = 0;
        for (; i + K <= N; i += K) { IOT::load(x + i, a, c); s0 = s0 + a; s1 = s1 + c; }
        if (i < N) { IOT::load(x + i, N - i, a, c); s0 = s0 + a; s1 = s1 + c; }
        mu = static_cast<Acc>(hsum(s0 + s1) / static_cast<double>(N));
      }
      const V vm(mu);
      V q0(Acc(0)), q1(Acc(0));
      int64_t i = 0;
      for (; i + K <= N; i += K) {
        IOT::load(x + i, a, c);
        a = a - vm; c = c - vm;
        q0 = at::vec::fmadd(a, a, q0); q1 = at::vec::fmadd(c, c, q1);
      }
      if (i < N) {
        IOT::load(x + i, N - i, a, c);
        a = a - vm; c = c - vm;
        keep_first(a, c, N - i);
        q0 = at::vec::fmadd(a, a, q0); q1 = at::vec::fmadd(c, c, q1);
      }
      const Acc var = static_cast<Acc>(hsum(q0 + q1) / static_cast<double>(N));
      const Acc rs = Acc(1) / std::sqrt(var + static_cast<Acc>(eps));
      if constexpr (!kRms) MEAN[r] = mu;
      RSTD[r] = rs;
      const V vr(rs);
      const T* xn = r + 1 < M ? x + N : nullptr;
      write_blocks<T, Acc>(y, N, stream, [&](int64_t j, int64_t n, V& a, V& c) {
        if (xn) prefetch_next(xn + j);
        if (n == K) IOT::load(x + j, a, c); else IOT::load(x + j, n, a, c);
        a = (a - vm) * vr; c = (c - vm) * vr;
        if (w) { if (n == K) IOW::load(w + j, w0, w1); else IOW::load(w + j, n, w0, w1); a = a * w0; c = c * w1; }
        if (b) { if (n == K) IOW::load(b + j, b0, b1); else IOW::load(b + j, n, b0, b1); a = a + b0; c = c + b1; }
      });
    }
    if (stream) stream_fence();
  });
}

// ---- backward ----------------------------------------------------------------------------

// xhat of one block: from the input (x - mean) * rstd, or from the output (y - b) / w.
template <typename T, typename W, bool kRms>
void norm_bwd_kernel(const T* DY, const T* S, const acc_t<T>* MEAN, const acc_t<T>* RSTD,
                     const W* w, const W* b, T* DX, acc_t<T>* DW, acc_t<T>* DB, int64_t M,
                     int64_t N, bool from_y) {
  using Acc = acc_t<T>;
  using V = Vectorized<Acc>;
  using IOT = IO<T, Acc>;
  using IOW = IO<W, Acc>;
  constexpr int64_t K = IOT::kWidth;
  const int64_t P = std::max<int64_t>(1, std::min<int64_t>(M, at::get_num_threads()));
  const bool stream = stream_output<T>(M * N);
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      Acc* dw = DW ? DW + p * N : nullptr;
      Acc* db = DB ? DB + p * N : nullptr;
      for (int64_t r = p * M / P; r < (p + 1) * M / P; ++r) {
        const T* dy = DY + r * N;
        const T* s = S + r * N;
        T* dx = DX + r * N;
        const V vm(kRms || from_y ? Acc(0) : MEAN[r]), vr(RSTD[r]);
        V g0, g1, h0, h1, w0(Acc(1)), w1(Acc(1)), b0(Acc(0)), b1(Acc(0));
        // Loads one block: g = dy * w, h = xhat (zero past n).
        auto block = [&](int64_t j, int64_t n) {
          const bool full = n == K;
          if (full) { IOT::load(dy + j, g0, g1); IOT::load(s + j, h0, h1); }
          else { IOT::load(dy + j, n, g0, g1); IOT::load(s + j, n, h0, h1); }
          if (w) { if (full) IOW::load(w + j, w0, w1); else IOW::load(w + j, n, w0, w1); }
          if (from_y) {
            if (b) { if (full) IOW::load(b + j, b0, b1); else IOW::load(b + j, n, b0, b1); }
            if (w || b) { h0 = (h0 - b0) / w0; h1 = (h1 - b1) / w1; }
          } else {
            h0 = (h0 - vm) * vr; h1 = (h1 - vm) * vr;
          }
          if (!full) keep_first(h0, h1, n);
        };
        V s1a(Acc(0)), s1b(Acc(0)), s2a(Acc(0)), s2b(Acc(0));
        int64_t j = 0;
        auto reduce = [&](int64_t jj, int64_t n) {
          block(jj, n);
          const V ga = g0 * w0, gb = g1 * w1;
          s1a = s1a + ga; s1b = s1b + gb;
          s2a = at::vec::fmadd(ga, h0, s2a); s2b = at::vec::fmadd(gb, h1, s2b);
        };
        for (; j + K <= N; j += K) reduce(j, K);
        if (j < N) reduce(j, N - j);
        const Acc inv_n = Acc(1) / static_cast<Acc>(N);
        const V c1(static_cast<Acc>(hsum(s2a + s2b)) * inv_n);
        const V c2(kRms ? Acc(0) : static_cast<Acc>(hsum(s1a + s1b)) * inv_n);
        const T* dyn = r + 1 < M ? dy + N : nullptr;
        write_blocks<T, Acc>(dx, N, stream, [&](int64_t jj, int64_t n, V& d0, V& d1) {
          if (dyn) { prefetch_next(dyn + jj); prefetch_next(s + N + jj); }
          block(jj, n);
          const bool full = n == K;
          d0 = vr * (g0 * w0 - c2 - h0 * c1); d1 = vr * (g1 * w1 - c2 - h1 * c1);
          if (dw) {
            V a0, a1;
            if (full) IO<Acc, Acc>::load(dw + jj, a0, a1); else IO<Acc, Acc>::load(dw + jj, n, a0, a1);
            a0 = at::vec::fmadd(g0, h0, a0); a1 = at::vec::fmadd(g1, h1, a1);
            if (full) IO<Acc, Acc>::store(dw + jj, a0, a1); else IO<Acc, Acc>::store(dw + jj, n, a0, a1);
          }
          if (db) {
            V a0, a1;
            if (full) IO<Acc, Acc>::load(db + jj, a0, a1); else IO<Acc, Acc>::load(db + jj, n, a0, a1);
            a0 = a0 + g0; a1 = a1 + g1;
            if (full) IO<Acc, Acc>::store(db + jj, a0, a1); else IO<Acc, Acc>::store(db + jj, n, a0, a1);
          }
        });
      }
    }
    if (stream) stream_fence();
  });
}

// ---- typed entry points ------------------------------------------------------------------

template <typename F>
inline void dispatch_norm(const at::Tensor& x, const std::optional<at::Tensor>& w, const F& f) {
  const bool mixed = w.has_value() && w->scalar_type() != x.scalar_type();
  MPNB_DISPATCH_FLOAT(x.scalar_type(), T, [&] {
    if constexpr (std::is_same_v<T, double>) {
      f(static_cast<T*>(nullptr), static_cast<T*>(nullptr));
    } else {
      if (mixed) f(static_cast<T*>(nullptr), static_cast<float*>(nullptr));
      else f(static_cast<T*>(nullptr), static_cast<T*>(nullptr));
    }
  });
}

template <typename W>
inline const W* opt_ptr(const std::optional<at::Tensor>& t) {
  return t.has_value() ? t->const_data_ptr<W>() : nullptr;
}

inline at::ScalarType acc_type(const at::Tensor& x) {
  return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

template <bool kRms>
std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_fwd(const at::Tensor& input, at::IntArrayRef nshape,
                                                        const std::optional<at::Tensor>& weight,
                                                        const std::optional<at::Tensor>& bias, double eps,
                                                        const char* op) {
  TORCH_CHECK(is_float_type(input.scalar_type()), op, ": input is ", input.scalar_type(),
              "; supported dtypes are float32, float16, bfloat16 and float64.");
  const auto sh = norm_shape(input, nshape, op);
  check_param(weight, input, sh.cols, op, "weight");
  check_param(bias, input, sh.cols, op, "bias");
  TORCH_CHECK(!weight.has_value() || !bias.has_value() || weight->scalar_type() == bias->scalar_type(),
              op, ": weight is ", weight->scalar_type(), " but bias is ", bias->scalar_type(),
              "; give them one dtype.");
  TORCH_CHECK(!bias.has_value() || weight.has_value() || !kRms, op, ": bias needs a weight.");
  const auto x = input.contiguous();
  const auto w = weight.has_value() ? std::optional<at::Tensor>(weight->contiguous()) : std::nullopt;
  const auto b = bias.has_value() ? std::optional<at::Tensor>(bias->contiguous()) : std::nullopt;
  auto y = at::empty_like(x, at::MemoryFormat::Contiguous);
  auto stat_opts = x.options().dtype(acc_type(x));
  auto mean = at::empty({kRms ? 0 : sh.rows}, stat_opts);
  auto rstd = at::empty({sh.rows}, stat_opts);
  if (sh.rows == 0) return {y, mean, rstd};
  dispatch_norm(x, w, [&](auto* tp, auto* wp) {
    using T = std::remove_pointer_t<decltype(tp)>;
    using Wt = std::remove_pointer_t<decltype(wp)>;
    norm_fwd_kernel<T, Wt, kRms>(x.const_data_ptr<T>(), opt_ptr<Wt>(w), opt_ptr<Wt>(b),
                                 y.mutable_data_ptr<T>(), kRms ? nullptr : mean.mutable_data_ptr<acc_t<T>>(),
                                 rstd.mutable_data_ptr<acc_t<T>>(), sh.rows, sh.cols, eps);
  });
  return {y, mean, rstd};
}

template <bool kRms>
std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_bwd(
    const at::Tensor& grad_out, const at::Tensor& saved, const at::Tensor& mean, const at::Tensor& rstd,
    at::IntArrayRef nshape, const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    bool memory_efficient, const char* op) {
  const auto sh = norm_shape(saved, nshape, op);
  TORCH_CHECK(grad_out.sizes() == saved.sizes() && grad_out.scalar_type() == saved.scalar_type(), op,
              ": grad_out ", grad_out.sizes(), " ", grad_out.scalar_type(), " does not match the saved ",
              "tensor ", saved.sizes(), " ", saved.scalar_type(), ".");
  TORCH_CHECK(rstd.numel() == sh.rows && rstd.scalar_type() == acc_type(saved), op,
              ": invvar must hold one ", acc_type(saved), " per row (", sh.rows, "), got ", rstd.numel(),
              " of ", rstd.scalar_type(), ".");
  TORCH_CHECK(kRms || memory_efficient || mean.numel() == sh.rows, op, ": mean must hold one value ",
              "per row (", sh.rows, "), got ", mean.numel(), ".");
  check_param(weight, saved, sh.cols, op, "weight");
  check_param(bias, saved, sh.cols, op, "bias");
  const auto dy = grad_out.contiguous(), s = saved.contiguous();
  const auto w = weight.has_value() ? std::optional<at::Tensor>(weight->contiguous()) : std::nullopt;
  const auto b = bias.has_value() ? std::optional<at::Tensor>(bias->contiguous()) : std::nullopt;
  const auto m = mean.contiguous(), r = rstd.contiguous();
  auto dx = at::empty_like(s, at::MemoryFormat::Contiguous);
  const int64_t P = std::max<int64_t>(1, std::min<int64_t>(sh.rows, at::get_num_threads()));
  auto opts = s.options().dtype(acc_type(s));
  at::Tensor dw_part = w ? at::zeros({P, sh.cols}, opts) : at::Tensor();
  at::Tensor db_part = b ? at::zeros({P, sh.cols}, opts) : at::Tensor();
  if (sh.rows > 0) {
    dispatch_norm(s, w, [&](auto* tp, auto* wp) {
      using T = std::remove_pointer_t<decltype(tp)>;
      using Wt = std::remove_pointer_t<decltype(wp)>;
      using Acc = acc_t<T>;
      norm_bwd_kernel<T, Wt, kRms>(
          dy.const_data_ptr<T>(), s.const_data_ptr<T>(),
          kRms || memory_efficient ? nullptr : m.const_data_ptr<Acc>(), r.const_data_ptr<Acc>(),
          opt_ptr<Wt>(w), memory_efficient ? opt_ptr<Wt>(b) : nullptr, dx.mutable_data_ptr<T>(),
          w ? dw_part.mutable_data_ptr<Acc>() : nullptr, b ? db_part.mutable_data_ptr<Acc>() : nullptr,
          sh.rows, sh.cols, memory_efficient);
    });
  }
  auto reduce = [&](const at::Tensor& part, const std::optional<at::Tensor>& p) {
    if (!p) return at::empty({0}, s.options());
    return part.sum(0).to(p->scalar_type()).view(p->sizes());
  };
  return {dx, reduce(dw_part, w), reduce(db_part, b)};
}

inline std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_fwd_cpu(
    const at::Tensor& input, at::IntArrayRef normalized_shape, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, bool /*memory_efficient: autograd only*/) {
  return norm_fwd<false>(input, normalized_shape, weight, bias, eps, "mpnb::layer_norm_fwd");
}

inline std::tuple<at::Tensor, at::Tensor> rms_norm_fwd_cpu(const at::Tensor& input,
                                                           at::IntArrayRef normalized_shape,
                                                           const std::optional<at::Tensor>& weight,
                                                           double eps, bool /*memory_efficient*/) {
  auto [y, mean, rstd] = norm_fwd<true>(input, normalized_shape, weight, std::nullopt, eps,
                                        "mpnb::rms_norm_fwd");
  return {y, rstd};
}

inline std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_bwd_cpu(
    const at::Tensor& grad_out, const at::Tensor& saved, const at::Tensor& mean, const at::Tensor& invvar,
    at::IntArrayRef normalized_shape, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, bool memory_efficient) {
  return norm_bwd<false>(grad_out, saved, mean, invvar, normalized_shape, weight, bias, memory_efficient,
                         "mpnb::layer_norm_bwd");
}

inline std::tuple<at::Tensor, at::Tensor> rms_norm_bwd_cpu(const at::Tensor& grad_out,
                                                           const at::Tensor& saved, const at::Tensor& invvar,
                                                           at::IntArrayRef normalized_shape,
                                                           const std::optional<at::Tensor>& weight,
                                                           bool memory_efficient) {
  auto [dx, dw, db] = norm_bwd<true>(grad_out, saved, invvar, invvar, normalized_shape, weight,
                                     std::nullopt, memory_efficient, "mpnb::rms_norm_bwd");
  return {dx, dw};
}

}  // namespace mpnb::cpu

TORCH_LIBRARY_FRAGMENT(mpnb, m) {
  m.def("layer_norm_fwd(Tensor input, int[] normalized_shape, Tensor? weight, Tensor? bias, "
        "float eps, bool memory_efficient=False) -> (Tensor, Tensor, Tensor)");
  m.def("layer_norm_bwd(Tensor grad_out, Tensor saved, Tensor mean, Tensor invvar, "
        "int[] normalized_shape, Tensor? weight, Tensor? bias, bool memory_efficient) "
        "-> (Tensor, Tensor, Tensor)");
  m.def("rms_norm_fwd(Tensor input, int[] normalized_shape, Tensor? weight, float eps, "
        "bool memory_efficient=False) -> (Tensor, Tensor)");
  m.def("rms_norm_bwd(Tensor grad_out, Tensor saved, Tensor invvar, int[] normalized_shape, "
        "Tensor? weight, bool memory_efficient) -> (Tensor, Tensor)");
}

TORCH_LIBRARY_IMPL(mpnb, CPU, m) {
  m.impl("layer_norm_fwd", &mpnb::cpu::layer_norm_fwd_cpu);
  m.impl("layer_norm_bwd", &mpnb::cpu::layer_norm_bwd_cpu);
  m.impl("rms_norm_fwd", &mpnb::cpu::rms_norm_fwd_cpu);
  m.impl("rms_norm_bwd", &mpnb::cpu::rms_norm_bwd_cpu);
}
