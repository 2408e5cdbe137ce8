// mpnb::layer_norm_fwd and mpnb::layer_norm_bwd on the CPU: Apex's FusedLayerNorm and
// MixedFusedLayerNorm (fp32 weights with a half input). The row passes and the checks are
// shared with RMS norm (norm_common.h); the schemas are defined in mpnb/core/ops/layer_norm.py.
#include <ATen/ATen.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "cpu/norm_common.h"

namespace mpnb::cpu {
namespace {

// memory_efficient changes only what autograd saves for the backward, not the forward.
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_fwd_cpu(
    const at::Tensor& input, at::IntArrayRef normalized_shape, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, bool /*memory_efficient*/) {
  return norm_fwd<false>(input, normalized_shape, weight, bias, eps, "mpnb::layer_norm_fwd");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_bwd_cpu(
    const at::Tensor& grad_out, const at::Tensor& saved, const at::Tensor& mean, const at::Tensor& invvar,
    at::IntArrayRef normalized_shape, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, bool memory_efficient) {
  return norm_bwd<false>(grad_out, saved, mean, invvar, normalized_shape, weight, bias, memory_efficient,
                         "mpnb::layer_norm_bwd");
}

}  // namespace
}  // namespace mpnb::cpu

TORCH_LIBRARY_IMPL(mpnb, CPU, m) {
  m.impl("layer_norm_fwd", &mpnb::cpu::layer_norm_fwd_cpu);
  m.impl("layer_norm_bwd", &mpnb::cpu::layer_norm_bwd_cpu);
}
