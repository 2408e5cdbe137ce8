// mpnb::bias_act_bwd on the CPU: the backward epilogue of a dense layer and its activation
// (apex.mlp, apex.fused_dense). The schema is defined in mpnb/core/ops/dense.py.
//
// After y = act(x W^T + b), the backward needs dz = dy * act'(.) and db = sum_rows(dz). Done
// by PyTorch ops that is three passes (act', multiply, column sum); here one pass reads dy and
// the saved tensor once, writes dz once and sums db into fp32 per-block partials that are
// added in block order (deterministic). act: 0 none, 1 relu (from y), 2 sigmoid (from y),
// 3 gelu (erf form, from the pre-activation h).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>

#include "cpu/multi_tensor_apply.h"

namespace mpnb::cpu {
namespace {

template <typename V>
inline V act_grad(const V& s, int64_t act) {
  using Acc = typename V::value_type;
  const V one(Acc(1)), zero(Acc(0));
  switch (act) {
    case 1: return V::blendv(zero, one, s > zero);
    case 2: return s * (one - s);
    case 3: {
      const V half(Acc(0.5)), inv_sqrt2(Acc(0.70710678118654752440)),
          inv_sqrt_2pi(Acc(0.39894228040143267794)), mhalf(Acc(-0.5));
      const V cdf = half * (one + (s * inv_sqrt2).erf());
      const V pdf = inv_sqrt_2pi * (mhalf * s * s).exp();
      return cdf + s * pdf;
    }
    default: return one;
  }
}

template <typename T>
void act_bwd_kernel(const T* DY, const T* S, T* DZ, acc_t<T>* DB, int64_t M, int64_t N, int64_t act) {
  using Acc = acc_t<T>;
  using V = Vectorized<Acc>;
  using IOT = IO<T, Acc>;
  using IOA = IO<Acc, Acc>;
  constexpr int64_t K = IOT::kWidth;
  const int64_t P = std::max<int64_t>(1, std::min<int64_t>(M, at::get_num_threads()));
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      Acc* db = DB ? DB + p * N : nullptr;
      for (int64_t r = p * M / P; r < (p + 1) * M / P; ++r) {
        for (int64_t j = 0; j < N; j += K) {
          const int64_t n = std::min<int64_t>(K, N - j);
          V g0, g1, s0, s1;
          IOT::load(DY + r * N + j, n, g0, g1);
          IOT::load(S + r * N + j, n, s0, s1);
          g0 = g0 * act_grad(s0, act);
          g1 = g1 * act_grad(s1, act);
          IOT::store(DZ + r * N + j, n, g0, g1);
          if (db) {  // padded lanes: dy = 0, so they add nothing
            V a0, a1;
            IOA::load(db + j, n, a0, a1);
            IOA::store(db + j, n, a0 + g0, a1 + g1);
          }
        }
      }
    }
  });
}

std::tuple<at::Tensor, at::Tensor> bias_act_bwd_cpu(const at::Tensor& grad, const at::Tensor& saved,
                                                    int64_t activation, bool bias_grad) {
  const char* op = "mpnb::bias_act_bwd";
  TORCH_CHECK_TYPE(is_float_type(grad.scalar_type()), op, ": dtype of grad");
  TORCH_CHECK_VALUE(grad.sizes() == saved.sizes() && grad.scalar_type() == saved.scalar_type(),
                    op, ": grad does not match saved");
  TORCH_CHECK_VALUE(activation >= 0 && activation <= 3, op, ": activation ", activation);
  TORCH_CHECK_VALUE(grad.dim() >= 1, op, ": grad is a scalar");
  const auto dy = grad.contiguous(), s = saved.contiguous();
  auto dz = at::empty_like(dy, at::MemoryFormat::Contiguous);
  const int64_t N = dy.size(-1), M = N ? dy.numel() / N : 0;
  const int64_t P = std::max<int64_t>(1, std::min<int64_t>(M, at::get_num_threads()));
  const auto acc = dy.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor part = bias_grad ? at::zeros({P, N}, dy.options().dtype(acc)) : at::Tensor();
  if (M > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, dy.scalar_type(), "mpnb", [&] {
      using T = scalar_t;
      act_bwd_kernel<T>(dy.const_data_ptr<T>(), s.const_data_ptr<T>(), dz.mutable_data_ptr<T>(),
                        bias_grad ? part.mutable_data_ptr<acc_t<T>>() : nullptr, M, N, activation);
    });
  }
  at::Tensor db = bias_grad ? part.sum(0).to(dy.scalar_type()) : at::empty({0}, dy.options());
  return {dz, db};
}

}  // namespace
}  // namespace mpnb::cpu

TORCH_LIBRARY_IMPL(mpnb, CPU, m) { m.impl("bias_act_bwd", &mpnb::cpu::bias_act_bwd_cpu); }
