// mpnb::layer_norm_fwd and mpnb::layer_norm_bwd on the CPU: Apex's FusedLayerNorm and
// MixedFusedLayerNorm (fp32 weights with a half input). The row passes and the checks are
// shared with RMS norm (norm_common.h); the schemas are defined in mpnb/core/ops/layer_norm.py.
// torch_stats (autocast regions) rounds an fp16 layer's statistics as PyTorch's CPU kernel does.
#include <ATen/ATen.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <optional>
#include <tuple>

#include "cpu/norm_common.h"

namespace mpnb::cpu {
namespace {

// torch_stats: the statistics PyTorch's CPU native_layer_norm saves for an fp16 input with fp16
// parameters or none, which it computes in fp32, writes the output from, and stores in fp16
// (its backward reads them back from there); here they are rounded to fp16 after the rows
// (the same round-to-nearest-even as its store) and kept in fp32. Every other dtype, and fp32
// parameters with an fp16 input (PyTorch keeps fp32 statistics for those), is unchanged:
// mpnb/core/ops/_norm.py saves_half_stats is the same rule.
void round_half_stats(at::Tensor& t) {
  float* p = t.mutable_data_ptr<float>();
  for (int64_t i = 0, n = t.numel(); i < n; ++i) p[i] = static_cast<float>(c10::Half(p[i]));
}

bool saves_half_stats(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                      const std::optional<at::Tensor>& bias) {
  const auto& p = weight.has_value() ? weight : bias;
  return x.scalar_type() == at::kHalf && (!p.has_value() || p->scalar_type() == at::kHalf);
}

// memory_efficient changes only what autograd saves for the backward, not the forward.
std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_fwd_cpu(
    const at::Tensor& input, at::IntArrayRef normalized_shape, const std::optional<at::Tensor>& weight,
    const std::optional<at::Tensor>& bias, double eps, bool /*memory_efficient*/, bool torch_stats) {
  auto out = norm_fwd<false>(input, normalized_shape, weight, bias, eps, "mpnb::layer_norm_fwd");
  if (torch_stats && saves_half_stats(input, weight, bias)) {
    round_half_stats(std::get<1>(out));
    round_half_stats(std::get<2>(out));
  }
  return out;
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
