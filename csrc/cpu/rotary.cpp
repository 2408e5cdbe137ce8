// mpnb::rope on the CPU: Apex's fused rotary position embedding (RoPE), forward and backward
// (the backward is the transposed rotation, one flag of the same op). The schema is defined in
// mpnb/core/ops/rotary.py.
//
// t is [S, B, H, D], [B, S, H, D] or [B, H, S, D] (`layout` names its dims) with any strides
// (the last dim contiguous, else copied); the kernel sees it as an [S, B, H, D] view and walks
// the S*B*H rows in t's memory order (its three row dims sorted by stride; blocks of positions
// when s is the fastest), so a transposed or permuted view reads (and, its output laid out as
// t, writes) memory as sequentially as a contiguous tensor. cos/sin are fp32 (fp64 for fp64) tables [S, D2] with D2 <= D. The first D2 channels are cut into groups of `group`
// channels, each rotated as rotate_half (first half paired with the second half); channels
// D2..D pass through. One group per rotary axis: group == D2 for 1-D RoPE, two groups of D/2
// for the 2-D (image) variant. Each element is read once and written once.
//
//   forward:  y1 = x1 c1 - x2 s1,       y2 = x2 c2 + x1 s2
//   backward: dx1 = dy1 c1 + dy2 s2,    dx2 = dy2 c2 - dy1 s1
//
// Computed in fp32 and rounded once to t's dtype; with `stepwise` (Apex's kernel, and torch's
// unfused expression in t's dtype) the table values, each product and the sum are rounded to
// t's dtype (fp16/bf16 only: for fp32/fp64 the two rules are the same). A large output whose
// memory is already backed is written with streaming stores (stream_into, fast_math.h).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <array>
#include <limits>

#include "cpu/fast_math.h"
#include "cpu/multi_tensor_apply.h"

namespace mpnb::cpu {
namespace {

// The pair (a, b) rounded to T and widened back; nothing to do when T is the compute type.
template <typename T, typename V>
C10_ALWAYS_INLINE void round_to(V& a, V& b) {
  if constexpr (!std::is_same_v<T, acc_t<T>>)
    std::tie(a, b) = at::vec::convert_to_float<T>(at::vec::convert_from_float<T>(a, b));
}

template <typename T, bool kStepwise>
void rope_kernel(const at::Tensor& t, const at::Tensor& cos, const at::Tensor& sin, at::Tensor& out,
                 int64_t group, bool backward, bool stream) {
  using Acc = acc_t<T>;
  using V = Vectorized<Acc>;
  using IOT = IO<T, Acc>;
  using IOA = IO<Acc, Acc>;
  using OUT = LayerIO<T, Acc>;  // stores: the CPU's own bf16 conversion where it has one
  constexpr int64_t K = IOT::kWidth;
  const int64_t D = t.size(3), D2 = cos.size(1);
  const int64_t half = group / 2;
  const T* X = t.const_data_ptr<T>();
  T* Y = out.mutable_data_ptr<T>();
  const Acc* C = cos.const_data_ptr<Acc>();
  const Acc* Sn = sin.const_data_ptr<Acc>();
  // The row dims (0..2 of the [S, B, H, D] view) from the largest input stride to the smallest,
  // o[2] the fastest. The walk goes by units of up to TS consecutive rows along o[2]; a unit is
  // (i0, i1, block), in memory order. When s is the fastest dim ([B, H, S, D] memory) each row
  // needs the next table row, and a walk in memory order would read all S table rows again for
  // every (b, h): as much traffic as t itself. There the units go (block, i0, i1): one block's
  // TS table rows (cos and sin, at most 16 KiB) stay in L1 while every (b, h) reads its TS
  // contiguous rows of t (16 rows of 128 channels: measured as fast as larger blocks of 64).
  std::array<int64_t, 3> o{0, 1, 2};
  std::stable_sort(o.begin(), o.end(), [&](int64_t a, int64_t b) { return t.stride(a) > t.stride(b); });
  const int64_t n0 = t.size(o[0]), n1 = t.size(o[1]), n2 = t.size(o[2]);
  const std::array<int64_t, 3> xs{t.stride(o[0]), t.stride(o[1]), t.stride(o[2])};
  const std::array<int64_t, 3> ys{out.stride(o[0]), out.stride(o[1]), out.stride(o[2])};
  const int sdim = static_cast<int>(std::find(o.begin(), o.end(), 0) - o.begin());
  const bool s_fastest = sdim == 2;
  const int64_t TS = std::max<int64_t>(1, 2048 / std::max<int64_t>(D, 1));
  // The input rows are prefetched about 4 KiB ahead of the walk (see `advance` below): the
  // hardware prefetcher alone kept too few reads in flight (64 MiB bf16 RoPE at 1 thread,
  // [S, B, H, D]: 11.5 -> 8.8 ms, `mpnb bench layers`).
  const int64_t ahead = rows_covering(4096, D * static_cast<int64_t>(sizeof(T)),
                                      std::numeric_limits<int64_t>::max());
  const int64_t blocks = (n2 + TS - 1) / TS;
  const int64_t units = n0 * n1 * blocks;
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(D, 1) / TS);
  // A unit's first row (its index) and its row count.
  auto unit_start = [&](int64_t unit, int64_t& rows) {
    const int64_t blk = s_fastest ? unit / (n0 * n1) : unit % blocks;
    const int64_t rest = s_fastest ? unit % (n0 * n1) : unit / blocks;
    rows = std::min(n2, (blk + 1) * TS) - blk * TS;
    return std::array<int64_t, 3>{rest / n1, rest % n1, blk * TS};
  };
  at::parallel_for(0, units, grain, [&](int64_t u0, int64_t u1) {
    V a0, a1, b0, b1, c0, c1, s0, s1, d0, d1, e0, e1;
    // The walk `ahead` rows on (unit pu, its row pk), whose input row is prefetched meanwhile:
    // the software prefetch keeps enough reads in flight, and follows the walk from one unit to
    // the next (in [B, H, S, D] memory the next unit is far away in memory).
    int64_t pu = u0, pk = 0, prows = 0;
    const T* pbase = nullptr;
    auto enter = [&]() {
      if (pu < u1) {
        const auto pi = unit_start(pu, prows);
        pbase = X + pi[0] * xs[0] + pi[1] * xs[1] + pi[2] * xs[2];
      } else {
        pbase = X;  // past this thread's rows: a line it has read (a prefetch never faults)
        prows = std::numeric_limits<int64_t>::max();
      }
    };
    auto advance = [&]() {
      if (++pk == prows) { ++pu; pk = 0; enter(); }
    };
    enter();
    for (int64_t i = 0; i < ahead; ++i) advance();
    for (int64_t unit = u0; unit < u1; ++unit) {
      int64_t rows = 0;
      std::array<int64_t, 3> idx = unit_start(unit, rows);
      const int64_t end = idx[2] + rows;
      for (; idx[2] < end; ++idx[2]) {
        const T* x = X + idx[0] * xs[0] + idx[1] * xs[1] + idx[2] * xs[2];
        T* y = Y + idx[0] * ys[0] + idx[1] * ys[1] + idx[2] * ys[2];
        const Acc* cr = C + idx[sdim] * D2;
        const Acc* sr = Sn + idx[sdim] * D2;
        const T* xp = pu < u1 ? pbase + pk * xs[2] : pbase;
        advance();
        for (int64_t g = 0; g < D2; g += group) {
          for (int64_t q = 0; q < half; q += K) {
            const int64_t n = std::min<int64_t>(K, half - q);
            const int64_t i = g + q, j = g + half + q;  // partner channels
            auto ld = [&](auto io, const auto* p, V& u, V& v) {
              if (n == K) decltype(io)::load(p, u, v); else decltype(io)::load(p, n, u, v);
            };
            prefetch_block<K>(xp + i);
            prefetch_block<K>(xp + j);
            ld(IOT{}, x + i, a0, a1);
            ld(IOT{}, x + j, b0, b1);
            ld(IOA{}, cr + i, c0, c1);
            ld(IOA{}, sr + i, s0, s1);
            ld(IOA{}, cr + j, d0, d1);
            ld(IOA{}, sr + j, e0, e1);
            V o0, o1, p0, p1;
            if constexpr (kStepwise) {
              round_to<T>(c0, c1); round_to<T>(s0, s1); round_to<T>(d0, d1); round_to<T>(e0, e1);
              // y = round(round(x * c) -/+ round(x' * s)): each product rounded, the sum on store
              V u0 = a0 * c0, u1 = a1 * c1, w0 = b0 * d0, w1 = b1 * d1;
              V f0 = backward ? b0 * e0 : b0 * s0, f1 = backward ? b1 * e1 : b1 * s1;
              V h0 = backward ? a0 * s0 : a0 * e0, h1 = backward ? a1 * s1 : a1 * e1;
              round_to<T>(u0, u1); round_to<T>(w0, w1); round_to<T>(f0, f1); round_to<T>(h0, h1);
              if (!backward) {
                o0 = u0 - f0; o1 = u1 - f1; p0 = w0 + h0; p1 = w1 + h1;
              } else {
                o0 = u0 + f0; o1 = u1 + f1; p0 = w0 - h0; p1 = w1 - h1;
              }
            } else if (!backward) {
              o0 = a0 * c0 - b0 * s0; o1 = a1 * c1 - b1 * s1;
              p0 = b0 * d0 + a0 * e0; p1 = b1 * d1 + a1 * e1;
            } else {
              o0 = a0 * c0 + b0 * e0; o1 = a1 * c1 + b1 * e1;
              p0 = b0 * d0 - a0 * s0; p1 = b1 * d1 - a1 * s1;
            }
            if (n < K) { OUT::store(y + i, n, o0, o1); OUT::store(y + j, n, p0, p1); }
            else if (stream && align_head(y + i, K) == 0 && align_head(y + j, K) == 0) {
              OUT::stream(y + i, o0, o1); OUT::stream(y + j, p0, p1);
            } else { OUT::store(y + i, o0, o1); OUT::store(y + j, p0, p1); }
          }
        }
        for (int64_t i = D2; i < D; i += K) {  // pass-through channels
          const int64_t n = std::min<int64_t>(K, D - i);
          IOT::load(x + i, n, a0, a1);
          IOT::store(y + i, n, a0, a1);
        }
      }
    }
    if (stream) stream_fence();
  });
}

// The permutation that views a `layout` tensor as [S, B, H, D]; the layouts are checked in
// Python, here only that it is a permutation (any is memory-safe).
std::array<int64_t, 4> sbhd_of(c10::string_view layout) {
  std::array<int64_t, 4> p{};
  TORCH_CHECK_VALUE(layout.size() == 4, "mpnb::rope: layout");
  for (int64_t k = 0; k < 4; ++k) {
    const auto at = layout.find("sbhd"[k]);
    TORCH_CHECK_VALUE(at != c10::string_view::npos, "mpnb::rope: layout");
    p[k] = static_cast<int64_t>(at);
  }
  return p;
}

at::Tensor rope_cpu(const at::Tensor& t_, const at::Tensor& cos, const at::Tensor& sin, int64_t group,
                    bool transpose_output, bool backward, bool stepwise, c10::string_view layout) {
  const char* op = "mpnb::rope";
  TORCH_CHECK_TYPE(is_float_type(t_.scalar_type()), op, ": dtype of t");
  TORCH_CHECK_VALUE(t_.dim() == 4, op, ": t is not 4-D");
  const auto perm = sbhd_of(layout);
  const at::Tensor t = t_.permute(perm);  // a view: [S, B, H, D]
  const auto acc = t.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const char* acc_name = acc == at::kDouble ? "float64" : "float32";
  const int64_t S = t.size(0), D = t.size(3);
  for (const auto* tab : {&cos, &sin}) {
    const char* name = tab == &cos ? "cos" : "sin";
    TORCH_CHECK_VALUE(tab->dim() == 2 && tab->size(0) == S && tab->size(1) <= D && tab->scalar_type() == acc,
                      op, ": table ", name);
    TORCH_CHECK_VALUE(tab->device() == t.device(), op, ": device of ", name);
  }
  TORCH_CHECK_VALUE(cos.sizes() == sin.sizes(), op, ": cos and sin differ");
  const int64_t D2 = cos.size(1);
  TORCH_CHECK_VALUE(group > 0 && group % 2 == 0 && D2 % group == 0, op, ": group ", group);
  const auto x = t.stride(3) == 1 ? t : t.contiguous();
  const auto c = cos.contiguous(), s = sin.contiguous();
  // The result: laid out as t (empty_like keeps a dense t's strides) unless that puts a stride
  // other than 1 on d (the kernel writes rows of d contiguous channels; then contiguous), or as
  // [B, S, H, D] (mpnb/core/ops/rotary.py's _output is the same rule).
  // Large results come from the output cache (output_cache.h), smaller ones are fresh with huge
  // pages advised (dense in every branch: a fresh 64 MiB output faults 2 MiB at a time).
  const bool cached = cacheable(t.nbytes());
  at::Tensor result;
  if (transpose_output) {
    const std::vector<int64_t> sbhd{t.size(1), t.size(0), t.size(2), t.size(3)};
    result = (cached ? cached_empty(sbhd, t.options()) : at::empty(sbhd, t.options())).transpose(0, 1);
  } else if (!cached) {
    result = at::empty_like(t_);
    if (result.stride(3) != 1) result = at::empty(t_.sizes(), t_.options());
  } else {  // empty_like's strides, read off a meta tensor (no memory), then from the cache
    const auto like = at::empty_like(t_, t_.options().device(at::kMeta));
    result = like.stride(3) == 1 ? cached_empty_strided(like.sizes(), like.strides(), t_.options())
                                 : cached_empty(t_.sizes(), t_.options());
  }
  if (!cached) advise_huge_pages(result);
  at::Tensor out = transpose_output ? result : result.permute(perm);
  if (t.numel() == 0) return result;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, t.scalar_type(), "mpnb", [&] {
    // streaming stores for large outputs already backed (see stream_into), rows of d contiguous
    const bool stream = stream_into(result);
    if (stepwise) rope_kernel<scalar_t, true>(x, c, s, out, group, backward, stream);
    else rope_kernel<scalar_t, false>(x, c, s, out, group, backward, stream);
  });
  return result;
}

}  // namespace
}  // namespace mpnb::cpu

TORCH_LIBRARY_IMPL(mpnb, CPU, m) { m.impl("rope", &mpnb::cpu::rope_cpu); }
