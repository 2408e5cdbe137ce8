// mpnb::multi_tensor_axpby on the CPU: out = a*x + b*y for every triple of the lists, in one
// pass (Apex's amp_C axpby), flagging non-finite inputs: both (-1), x (0) or y (1).
#include <ATen/ATen.h>
#include <ATen/Dispatch_v2.h>
#include <torch/library.h>

#include "cpu/autograd.h"
#include "cpu/multi_tensor_apply.h"

namespace mpnb::cpu {
namespace {

template <typename x_t, typename y_t, typename o_t, typename Acc>
inline bool axpby_range(const x_t* x, const y_t* y, o_t* o, int64_t n, Acc a, Acc b,
                        int64_t check, bool stream) {
  using V = Vectorized<Acc>;
  using O = IO<o_t, Acc>;
  constexpr int64_t W = IO<x_t, Acc>::kWidth;
  static_assert(W == IO<y_t, Acc>::kWidth && W == O::kWidth, "mismatched widths");
  const V va(a), vb(b);
  V bad(Acc(0)), x0, x1, y0, y1;
  auto load = [&](int64_t i, int64_t len) {
    if (len == W) {
      prefetch_ahead(x + i);
      prefetch_ahead(y + i);
      IO<x_t, Acc>::load(x + i, x0, x1);
      IO<y_t, Acc>::load(y + i, y0, y1);
    } else {
      IO<x_t, Acc>::load(x + i, len, x0, x1);
      IO<y_t, Acc>::load(y + i, len, y0, y1);
    }
    if (check != 1) { accumulate_nonfinite(bad, x0); accumulate_nonfinite(bad, x1); }
    if (check != 0) { accumulate_nonfinite(bad, y0); accumulate_nonfinite(bad, y1); }
  };
  auto part = [&](int64_t i, int64_t len) {
    load(i, len);
    O::store(o + i, len, va * x0 + vb * y0, va * x1 + vb * y1);
  };
  int64_t i = 0;
  if (stream) {
    const int64_t head = align_head(o, n);
    for (; i < head; i += W) part(i, std::min(W, head - i));
    for (; i + W <= n; i += W) {
      load(i, W);
      O::stream(o + i, va * x0 + vb * y0, va * x1 + vb * y1);
    }
  } else {
    for (; i + W <= n; i += W) {
      load(i, W);
      O::store(o + i, va * x0 + vb * y0, va * x1 + vb * y1);
    }
  }
  if (i < n) part(i, n - i);
  return all_finite(bad);
}

template <typename x_t, typename y_t, typename o_t>
void axpby_lists(const at::Tensor& flag, const Tensors& xs, const Tensors& ys, const Tensors& os,
                 double a, double b, int64_t check) {
  using Acc = acc_t<x_t>;
  auto table = make_chunks(xs);
  // Streaming stores only when out is a separate buffer: in place, the line is already owned.
  const bool in_place = !xs.empty() && (xs[0].data_ptr() == os[0].data_ptr() ||
                                        ys[0].data_ptr() == os[0].data_ptr());
  const bool stream =
      !in_place && table.numel * static_cast<int64_t>(sizeof(o_t)) >= kStreamMinBytes;
  std::vector<uint8_t> ok(table.chunks.size(), 1);
  for_each_chunk(table, [&](int64_t c, const Chunk& ch) {
    ok[c] = axpby_range<x_t, y_t, o_t, Acc>(
        xs[ch.tensor].const_data_ptr<x_t>() + ch.offset,
        ys[ch.tensor].const_data_ptr<y_t>() + ch.offset,
        os[ch.tensor].mutable_data_ptr<o_t>() + ch.offset, ch.len, static_cast<Acc>(a),
        static_cast<Acc>(b), check, stream);
  });
  if (stream) stream_fence();
  for (auto v : ok)
    if (!v) { raise_flag(flag); break; }
}

void multi_tensor_axpby_cpu(const at::Tensor& noop_flag, const Tensors& x, const Tensors& y,
                                   const Tensors& out, double a, double b, int64_t arg_to_check) {
  const char* op = "mpnb::multi_tensor_axpby";
  TORCH_CHECK_VALUE(arg_to_check >= -1 && arg_to_check <= 1, op, ": arg_to_check ", arg_to_check);
  check_list(x, op, "x", x.size());
  check_list(y, op, "y", x.size());
  check_list(out, op, "out", x.size());
  check_same_sizes(x, y, op, "y");
  check_same_sizes(x, out, op, "out");
  if (x.empty()) return;
  check_float(x, op, "x");
  check_float(y, op, "y");
  check_float(out, op, "out");
  const auto tx = x[0].scalar_type(), ty = y[0].scalar_type(), to = out[0].scalar_type();
  if (tx == at::kDouble || ty == at::kDouble || to == at::kDouble) {
    TORCH_CHECK_TYPE(tx == ty && ty == to, op, ": float64 lists mixed");
    return axpby_lists<double, double, double>(noop_flag, x, y, out, a, b, arg_to_check);
  }
  AT_DISPATCH_V2(tx, "multi_tensor_axpby", AT_WRAP([&] {
    using x_t = scalar_t;
    AT_DISPATCH_V2(ty, "multi_tensor_axpby", AT_WRAP([&] {
      using y_t = scalar_t;
      AT_DISPATCH_V2(to, "multi_tensor_axpby", AT_WRAP([&] {
        axpby_lists<x_t, y_t, scalar_t>(noop_flag, x, y, out, a, b, arg_to_check);
      }), at::kFloat, at::kHalf, at::kBFloat16);
    }), at::kFloat, at::kHalf, at::kBFloat16);
  }), at::kFloat, at::kHalf, at::kBFloat16);
}

}  // namespace
}  // namespace mpnb::cpu

TORCH_LIBRARY_IMPL(mpnb, CPU, m) { m.impl("multi_tensor_axpby", &mpnb::cpu::multi_tensor_axpby_cpu); }
TORCH_LIBRARY_IMPL(mpnb, Autograd, m) { m.impl("multi_tensor_axpby", mpnb::cpu::below_autograd()); }
