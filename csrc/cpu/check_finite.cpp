// mpnb::multi_tensor_check_finite on the CPU: raise the flag if any element of a tensor list
// is inf or NaN. Read-only, one pass over the raw bits (no conversion, no write).
#include <ATen/ATen.h>
#include <ATen/Dispatch_v2.h>
#include <torch/library.h>

#include "cpu/autograd.h"
#include "cpu/multi_tensor_apply.h"

namespace mpnb::cpu {
namespace {

void multi_tensor_check_finite_cpu(const at::Tensor& noop_flag, const Tensors& tensors) {
  const char* op = "mpnb::multi_tensor_check_finite";
  check_list(tensors, op, "tensors", tensors.size());
  if (tensors.empty()) return;
  check_float(tensors, op, "tensors");
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, tensors[0].scalar_type(),
                                  "multi_tensor_check_finite", [&] {
    using T = scalar_t;
    auto table = make_chunks(tensors);
    std::vector<uint8_t> ok(table.chunks.size(), 1);
    for_each_chunk(table, [&](int64_t c, const Chunk& ch) {
      ok[c] = all_finite_bits<T>(tensors[ch.tensor].const_data_ptr<T>() + ch.offset, ch.len);
    });
    for (auto v : ok)
      if (!v) { raise_flag(noop_flag); break; }
  });
}

}  // namespace
}  // namespace mpnb::cpu

TORCH_LIBRARY_IMPL(mpnb, CPU, m) {
  m.impl("multi_tensor_check_finite", &mpnb::cpu::multi_tensor_check_finite_cpu);
}
TORCH_LIBRARY_IMPL(mpnb, Autograd, m) {
  m.impl("multi_tensor_check_finite", mpnb::cpu::below_autograd());
}
