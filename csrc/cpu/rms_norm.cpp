// RMS norm on the CPU (Apex's FusedRMSNorm / MixedFusedRMSNorm): mpnb::rms_norm_fwd and
// mpnb::rms_norm_bwd. The row passes are shared with layer norm (norm_common.h).
#include <ATen/ATen.h>
#include <torch/library.h>

#include "cpu/norm_common.h"

namespace mpnb::cpu {

std::tuple<at::Tensor, at::Tensor> rms_norm_fwd_cpu(const at::Tensor& input,
                                                           at::IntArrayRef normalized_shape,
                                                           const std::optional<at::Tensor>& weight,
                                                           double eps, bool /*memory_efficient*/) {
  auto [y, mean, rstd] = norm_fwd<true>(input, normalized_shape, weight, std::nullopt, eps,
                                        "mpnb::rms_norm_fwd");
  return {y, rstd};
}


std::tuple<at::Tensor, at::Tensor> rms_norm_bwd_cpu(const at::Tensor& grad_out,
                                                           const at::Tensor& saved, const at::Tensor& invvar,
                                                           at::IntArrayRef normalized_shape,
                                                           const std::optional<at::Tensor>& weight,
                                                           bool memory_efficient) {
  auto [dx, dw, db] = norm_bwd<true>(grad_out, saved, invvar, invvar, normalized_shape, weight,
                                     std::nullopt, memory_efficient, "mpnb::rms_norm_bwd");
  return {dx, dw};
}

}  // namespace mpnb::cpu

TORCH_LIBRARY_IMPL(mpnb, CPU, m) {
  m.impl("rms_norm_fwd", &mpnb::cpu::rms_norm_fwd_cpu);
  m.impl("rms_norm_bwd", &mpnb::cpu::rms_norm_bwd_cpu);
}
