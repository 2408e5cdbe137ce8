// mpnb::multi_tensor_l2norm on the CPU: the L2 norm of a whole tensor list and optionally of
// each tensor (of x * inv_scale when given: Apex's unscale_l2norm), in one pass.
#include <ATen/ATen.h>
#include <ATen/Dispatch_v2.h>
#include <torch/library.h>

#include "cpu/autograd.h"
#include "cpu/multi_tensor_apply.h"

namespace mpnb::cpu {
namespace {

// Sum of squares in fp64: exact enough for any finite input, used as the fallback.
template <typename T, typename Acc, bool kScaled>
inline double sumsq_fp64(const T* x, int64_t n, Acc inv) {
  using V = Vectorized<Acc>;
  constexpr int64_t W = IO<T, Acc>::kWidth;
  const V vi(inv);
  dVec s0(0.0), s1(0.0), s2(0.0), s3(0.0);
  V a, b;
  for (int64_t i = 0; i < n; i += W) {
    if (i + W <= n) IO<T, Acc>::load(x + i, a, b);
    else IO<T, Acc>::load(x + i, n - i, a, b);
    if constexpr (kScaled) { a = a * vi; b = b * vi; }
    accumulate_squares(s0, s1, a);
    accumulate_squares(s2, s3, b);
  }
  return hsum((s0 + s1) + (s2 + s3));
}

// Fast path: squares summed in fp32 lanes over blocks of kL2Block elements, each block's lanes
// widened into fp64. A block error stays near 1e-7 relative; a chunk that overflows fp32
// (|x| > 1.8e19) or underflows it (tiny values) is summed again in fp64.
constexpr int64_t kL2Block = 1024;
// The read prefetch distance of the fast path (vec_io.h prefetch_stream). Zen 1, bf16 grads of
// the GPT workload (20M elements in 76 tensors): 5.1 -> 4.2-4.4 ms at 1 thread, 3.2 -> 2.5 ms
// at 2 (1024 B: 4.6 and 2.7; 512 B: 4.6 and 2.8).
constexpr int64_t kL2PrefetchBytes = 2048;

template <typename T, typename Acc, bool kScaled>
inline double sumsq_range(const T* x, int64_t n, Acc inv) {
  if constexpr (std::is_same_v<Acc, double>) {
    return sumsq_fp64<T, Acc, kScaled>(x, n, inv);
  } else {
    constexpr int64_t W = IO<T, float>::kWidth;
    const fVec vi(inv);
    dVec d0(0.0), d1(0.0);
    fVec a, b;
    for (int64_t blk = 0; blk < n; blk += kL2Block) {
      const int64_t end = std::min(n, blk + kL2Block);
      // Four independent fma chains: one chain is bound by the fma latency (4 cycles on
      // Zen 3), not by the loads; the lanes are combined in a fixed order.
      fVec f0(0.f), f1(0.f), f2(0.f), f3(0.f);
      fVec c, e;
      int64_t i = blk;
      for (; i + 2 * W <= end; i += 2 * W) {
        prefetch_stream<kL2PrefetchBytes>(x + i);  // one line a step for 16-bit x, two for fp32
        if constexpr (sizeof(T) == 4) prefetch_stream<kL2PrefetchBytes + kCacheLine>(x + i);
        IO<T, float>::load(x + i, a, b);
        IO<T, float>::load(x + i + W, c, e);
        if constexpr (kScaled) { a = a * vi; b = b * vi; c = c * vi; e = e * vi; }
        f0 = at::vec::fmadd(a, a, f0);
        f1 = at::vec::fmadd(b, b, f1);
        f2 = at::vec::fmadd(c, c, f2);
        f3 = at::vec::fmadd(e, e, f3);
      }
      for (; i < end; i += W) {
        if (i + W <= end) IO<T, float>::load(x + i, a, b);
        else IO<T, float>::load(x + i, end - i, a, b);
        if constexpr (kScaled) { a = a * vi; b = b * vi; }
        f0 = at::vec::fmadd(a, a, f0);
        f1 = at::vec::fmadd(b, b, f1);
      }
      widen_add(d0, d1, (f0 + f1) + (f2 + f3));
    }
    const double s = hsum(d0 + d1);
    if (!std::isfinite(s) || s < 1e-30) return sumsq_fp64<T, Acc, kScaled>(x, n, inv);
    return s;
  }
}

template <typename T>
std::tuple<at::Tensor, at::Tensor> l2norm_lists(const at::Tensor& flag, const Tensors& xs,
                                                bool per_tensor, double inv_scale) {
  using Acc = acc_t<T>;
  const auto out_dtype = std::is_same_v<T, double> ? at::kDouble : at::kFloat;
  auto table = make_chunks(xs);
  std::vector<double> partial(table.chunks.size(), 0.0);
  const Acc inv = static_cast<Acc>(inv_scale);
  const bool scaled = inv_scale != 1.0;
  for_each_chunk(table, [&](int64_t c, const Chunk& ch) {
    const T* x = xs[ch.tensor].const_data_ptr<T>() + ch.offset;
    partial[c] = scaled ? sumsq_range<T, Acc, true>(x, ch.len, inv)
                        : sumsq_range<T, Acc, false>(x, ch.len, inv);
  });
  const int64_t nt = static_cast<int64_t>(xs.size());
  auto opts = at::TensorOptions().dtype(at::kDouble);
  at::Tensor per = at::empty({per_tensor ? nt : 0}, opts);
  double total = 0.0;
  for (int64_t t = 0; t < nt; ++t) {
    double s = 0.0;
    for (int64_t c = table.first_chunk[t]; c < table.first_chunk[t + 1]; ++c) s += partial[c];
    total += s;
    if (per_tensor) per.data_ptr<double>()[t] = std::sqrt(s);
  }
  at::Tensor norm = at::full({1}, std::sqrt(total), opts).to(out_dtype);
  if (!std::isfinite(norm.item<double>())) raise_flag(flag);
  return {norm, per.to(out_dtype)};
}

std::tuple<at::Tensor, at::Tensor> multi_tensor_l2norm_cpu(
    const at::Tensor& noop_flag, const Tensors& tensors, bool per_tensor,
    const std::optional<at::Tensor>& inv_scale) {
  const char* op = "mpnb::multi_tensor_l2norm";
  check_list(tensors, op, "tensors", tensors.size());
  const double inv = scalar_of(inv_scale, op, "inv_scale");
  if (tensors.empty()) {
    auto opts = at::TensorOptions().dtype(at::kFloat);
    return {at::zeros({1}, opts), at::empty({0}, opts)};
  }
  check_float(tensors, op, "tensors");
  return AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, tensors[0].scalar_type(), "multi_tensor_l2norm",
      [&] { return l2norm_lists<scalar_t>(noop_flag, tensors, per_tensor, inv); });
}

}  // namespace
}  // namespace mpnb::cpu

TORCH_LIBRARY_IMPL(mpnb, CPU, m) { m.impl("multi_tensor_l2norm", &mpnb::cpu::multi_tensor_l2norm_cpu); }
TORCH_LIBRARY_IMPL(mpnb, Autograd, m) { m.impl("multi_tensor_l2norm", mpnb::cpu::below_autograd()); }
