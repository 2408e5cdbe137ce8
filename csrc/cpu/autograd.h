// The Autograd-key kernel of the in-place list ops (optimizer steps, multi-tensor ops).
//
// An op with no Autograd kernel gets PyTorch's boxed autograd fallback, which inspects every
// tensor of every list on each call. These ops are not differentiable: what autograd needs
// from them is that the version counter of every tensor they write is bumped (so a saved
// tensor that an op overwrote is caught at backward) and that an op returning tensors refuses
// inputs that require grad instead of silently dropping a gradient. This kernel does exactly
// that, reading the schema's write annotations, and redispatches below autograd, boxed (no
// per-tensor conversion of the lists). Registered per op at the bottom of its .cpp:
//
//   TORCH_LIBRARY_IMPL(mpnb, Autograd, m) { m.impl("fused_adam_", mpnb::cpu::below_autograd()); }
#pragma once

#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/GradMode.h>
#include <torch/library.h>

namespace mpnb::cpu {

inline void bump_version(const c10::IValue& v) {
  if (v.isTensor()) {
    const at::Tensor& t = v.toTensor();
    if (t.defined() && !t.is_inference()) t.unsafeGetTensorImpl()->bump_version();
  } else if (v.isTensorList()) {
    for (const c10::IValue& e : v.toListRef()) bump_version(e);
  }
}

inline bool requires_grad(const c10::IValue& v) {
  if (v.isTensor()) return v.toTensor().defined() && v.toTensor().requires_grad();
  if (v.isTensorList()) {
    for (const c10::IValue& e : v.toListRef())
      if (requires_grad(e)) return true;
  }
  return false;
}

inline void below_autograd_boxed(const c10::OperatorHandle& op, c10::DispatchKeySet ks,
                                 torch::jit::Stack* stack) {
  const auto& schema = op.schema();
  const auto& args = schema.arguments();
  const auto first = stack->end() - static_cast<std::ptrdiff_t>(args.size());
  if (!schema.returns().empty() && c10::GradMode::is_enabled()) {
    for (auto it = first; it != stack->end(); ++it)
      TORCH_CHECK(!requires_grad(*it), op.operator_name(),
                  " is not differentiable but an input requires grad; call it under "
                  "torch.no_grad() (or detach the inputs).");
  }
  // Bumped before the kernel runs (the stack owns the arguments only until then); a kernel
  // validates every argument before it writes anything.
  for (size_t i = 0; i < args.size(); ++i) {
    const auto* alias = args[i].alias_info();
    if (alias != nullptr && alias->isWrite()) bump_version(*(first + static_cast<std::ptrdiff_t>(i)));
  }
  op.redispatchBoxed(ks & c10::after_autograd_keyset, stack);
}

inline torch::CppFunction below_autograd() {
  return torch::CppFunction::makeFromBoxedFunction<&below_autograd_boxed>();
}

}  // namespace mpnb::cpu
