// mpnb::multi_tensor_scale on the CPU: dst = src * scale for every pair of a tensor list, in
// one pass, raising the flag when a scaled value is not finite (Apex's amp_C scale; the
// unscale of a loss-scaled backward). Checking the product catches a non-finite source for
// any scale (inf * s and NaN * s are never finite) and also a finite source that a huge or
// non-finite scale makes non-finite (0 * inf). Never skips work when the flag is already set.
#include <ATen/ATen.h>
#include <ATen/Dispatch_v2.h>
#include <torch/library.h>

#include "cpu/autograd.h"
#include "cpu/multi_tensor_apply.h"

namespace mpnb::cpu {
namespace {

template <typename in_t, typename out_t, typename Acc>
bool scale_range(const in_t* x, out_t* y, int64_t n, Acc s, bool stream) {
  using V = Vectorized<Acc>;
  using I = IO<in_t, Acc>;
  using O = IO<out_t, Acc>;
  constexpr int64_t W = I::kWidth;
  static_assert(W == O::kWidth, "mismatched block widths");
  const V vs(s);
  V bad(Acc(0)), a, b;
  auto part = [&](int64_t i, int64_t len) {
    I::load(x + i, len, a, b);
    a = a * vs;
    b = b * vs;
    accumulate_nonfinite(bad, a);
    accumulate_nonfinite(bad, b);
    O::store(y + i, len, a, b);
  };
  int64_t i = 0;
  if (stream) {
    const int64_t head = align_head(y, n);
    for (; i < head; i += W) part(i, std::min(W, head - i));
    for (; i + W <= n; i += W) {
      prefetch_ahead(x + i);
      I::load(x + i, a, b);
      a = a * vs;
      b = b * vs;
      accumulate_nonfinite(bad, a);
      accumulate_nonfinite(bad, b);
      O::stream(y + i, a, b);
    }
  } else {
    for (; i + W <= n; i += W) {
      prefetch_ahead(x + i);
      I::load(x + i, a, b);
      a = a * vs;
      b = b * vs;
      accumulate_nonfinite(bad, a);
      accumulate_nonfinite(bad, b);
      O::store(y + i, a, b);
    }
  }
  if (i < n) part(i, n - i);
  return all_finite(bad);
}

template <typename in_t, typename out_t>
void scale_lists(const at::Tensor& flag, const Tensors& src, const Tensors& dst, double scale,
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
    if (!v) {
      raise_flag(flag);
      break;
    }
}

void multi_tensor_scale_cpu(const at::Tensor& noop_flag, const Tensors& src, const Tensors& dst,
                            double scale, const std::optional<at::Tensor>& scale_tensor) {
  const char* op = "mpnb::multi_tensor_scale";
  check_list(src, op, "src", src.size());
  check_list(dst, op, "dst", src.size());
  check_same_sizes(src, dst, op, "dst");
  if (src.empty()) return;
  check_float(src, op, "src");
  check_float(dst, op, "dst");
  const auto ti = src[0].scalar_type(), to = dst[0].scalar_type();
  if (ti == at::kDouble || to == at::kDouble) {
    TORCH_CHECK_TYPE(ti == to, op, ": float64 lists mixed");
    return scale_lists<double, double>(noop_flag, src, dst, scale, scale_tensor);
  }
  AT_DISPATCH_V2(ti, "multi_tensor_scale", AT_WRAP([&] {
    using in_t = scalar_t;
    AT_DISPATCH_V2(to, "multi_tensor_scale", AT_WRAP([&] {
      scale_lists<in_t, scalar_t>(noop_flag, src, dst, scale, scale_tensor);
    }), at::kFloat, at::kHalf, at::kBFloat16);
  }), at::kFloat, at::kHalf, at::kBFloat16);
}

}  // namespace
}  // namespace mpnb::cpu

TORCH_LIBRARY_IMPL(mpnb, CPU, m) { m.impl("multi_tensor_scale", &mpnb::cpu::multi_tensor_scale_cpu); }
TORCH_LIBRARY_IMPL(mpnb, Autograd, m) { m.impl("multi_tensor_scale", mpnb::cpu::below_autograd()); }
