// The dynamic loss-scale update on the CPU: mpnb::update_scale_hysteresis (Apex's rule with
// hysteresis) and mpnb::update_loss_scale_ (that rule, the clamp to [min_scale, max_scale]
// and inv_scale = 1/scale in one call). The scaler's state lives in one-element CPU tensors,
// read and written in place; the rule's numbers arrive as arguments.
#include <ATen/ATen.h>
#include <ATen/Dispatch_v2.h>
#include <torch/library.h>

#include <cmath>

#include "cpu/autograd.h"
#include "cpu/multi_tensor_apply.h"

namespace mpnb::cpu {
namespace {

// A new scale below float32's smallest normal is stored as a zero of its sign, as Apex's CUDA
// kernel (built with --use_fast_math, which flushes subnormals) stores it.
float flush_subnormal(float x) {
  return std::fpclassify(x) == FP_SUBNORMAL ? std::copysign(0.0f, x) : x;
}

// One step of the rule on host-visible state (the tensors are one-element CPU tensors).
void hysteresis_step(float* scale, int32_t* growth, int32_t* hyst, double inf,
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
    *scale = flush_subnormal(static_cast<float>(static_cast<double>(*scale) * backoff_factor));
    *growth = 0;
  } else {
    const int64_t successful = static_cast<int64_t>(*growth) + 1;
    if (successful == growth_interval) {
      const float grown =
          flush_subnormal(static_cast<float>(static_cast<double>(*scale) * growth_factor));
      if (std::isfinite(grown)) *scale = grown;  // never grow past the fp32 range
      *growth = 0;
    } else {
      *growth = static_cast<int32_t>(successful);
    }
  }
  if (inf <= 0) *hyst = static_cast<int32_t>(hysteresis);
}

void check_scaler_state(const char* op, const at::Tensor& current_scale,
                               const at::Tensor& growth_tracker, const at::Tensor& hysteresis_tracker,
                               const at::Tensor& found_inf, int64_t growth_interval) {
  TORCH_CHECK_TYPE(current_scale.scalar_type() == at::kFloat && current_scale.numel() == 1,
                   op, ": current_scale");
  TORCH_CHECK_TYPE(growth_tracker.scalar_type() == at::kInt && growth_tracker.numel() == 1,
                   op, ": growth_tracker");
  TORCH_CHECK_TYPE(hysteresis_tracker.scalar_type() == at::kInt && hysteresis_tracker.numel() == 1,
                   op, ": hysteresis_tracker");
  TORCH_CHECK_VALUE(found_inf.numel() == 1, op, ": found_inf must hold one value");
  TORCH_CHECK_VALUE(growth_interval > 0, op, ": growth_interval ", growth_interval);
}

void update_scale_hysteresis_cpu(const at::Tensor& current_scale, const at::Tensor& growth_tracker,
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

void update_loss_scale_cpu(const at::Tensor& current_scale, const at::Tensor& inv_scale,
                                  const at::Tensor& growth_tracker, const at::Tensor& hysteresis_tracker,
                                  const at::Tensor& found_inf, double growth_factor,
                                  double backoff_factor, int64_t growth_interval, int64_t hysteresis,
                                  double min_scale, double max_scale) {
  const char* op = "mpnb::update_loss_scale_";
  check_scaler_state(op, current_scale, growth_tracker, hysteresis_tracker, found_inf, growth_interval);
  TORCH_CHECK_TYPE(inv_scale.scalar_type() == at::kFloat && inv_scale.numel() == 1, op, ": inv_scale");
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

}  // namespace
}  // namespace mpnb::cpu

TORCH_LIBRARY_IMPL(mpnb, CPU, m) {
  m.impl("update_scale_hysteresis", &mpnb::cpu::update_scale_hysteresis_cpu);
  m.impl("update_loss_scale_", &mpnb::cpu::update_loss_scale_cpu);
}
TORCH_LIBRARY_IMPL(mpnb, Autograd, m) {
  m.impl("update_scale_hysteresis", mpnb::cpu::below_autograd());
  m.impl("update_loss_scale_", mpnb::cpu::below_autograd());
}
