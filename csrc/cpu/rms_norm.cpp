// mpnb::rms_norm_fwd and mpnb::rms_norm_bwd on the CPU: Apex's FusedRMSNorm and
// MixedFusedRMSNorm (an fp32 weight with a half input). The row passes and the checks are
// shared with layer norm (norm_common.h, with the centring turned off); the schemas are
// defined in mpnb/core/ops/rms_norm.py.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "cpu/norm_common.h"

namespace mpnb::cpu {
namespace {

// memory_efficient changes only what autograd saves for the backward, not the forward.
std::tuple<at::Tensor, at::Tensor> rms_norm_fwd_cpu(const at::Tensor& input, at::IntArrayRef normalized_shape,
                                                    const std::optional<at::Tensor>& weight, double eps,
                                                    bool /*memory_efficient*/) {
  auto [y, mean, rstd] = norm_fwd<true>(input, normalized_shape, weight, std::nullopt, eps,
                                        "mpnb::rms_norm_fwd");
  return {y, rstd};
}

// The shared backward takes a mean it never reads for RMS norm: invvar stands in for it.
std::tuple<at::Tensor, at::Tensor> rms_norm_bwd_cpu(const at::Tensor& grad_out, const at::Tensor& saved,
                                                    const at::Tensor& invvar, at::IntArrayRef normalized_shape,
                                                    const std::optional<at::Tensor>& weight,
                                                    bool memory_efficient) {
  auto [dx, dw, db] = norm_bwd<true>(grad_out, saved, invvar, invvar, normalized_shape, weight,
                                     std::nullopt, memory_efficient, "mpnb::rms_norm_bwd");
  return {dx, dw};
}

}  // namespace
}  // namespace mpnb::cpu

TORCH_LIBRARY_IMPL(mpnb, CPU, m) {
  m.impl("rms_norm_fwd", &mpnb::cpu::rms_norm_fwd_cpu);
  m.impl("rms_norm_bwd", &mpnb::cpu::rms_norm_bwd_cpu);
}
