// mpnb::welford_mean_var and mpnb::welford_parallel on the CPU: SyncBatchNorm's per-channel
// batch statistics (Welford/Chan mean and biased variance). The schemas are defined in
// mpnb/core/ops/welford.py.
//
// welford_mean_var(input, channel_last) reads the input once per pass and returns, per channel,
// the mean and the biased variance in fp32 (fp64 for fp64 input). The work is cut into chunks
// whose boundaries depend only on the shape (not on the thread count); each chunk is reduced
// two-pass (mean, then the centred sum of squares: stable), and the chunk results are merged
// in chunk order with Chan's formula in fp64, so the result is the same on every run and on
// every rank for the same data.
//   channels first: input (N, C, L) contiguous; a chunk is one channel over a block of rows.
//   channel last:   input (M, C) contiguous; a chunk is a block of rows, vectorized over C.
// welford_parallel(mean[W,C], var[W,C], count[W]) merges W ranks' statistics (Chan, fp64).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <tuple>
#include <utility>
#include <vector>

#include "cpu/multi_tensor_apply.h"

namespace mpnb::cpu {
namespace {

struct Moments {
  double n = 0, mean = 0, m2 = 0;
  // Chan et al.'s pairwise merge; exact for n == 0 on either side.
  void merge(double nb, double mb, double m2b) {
    if (nb == 0) return;
    const double tot = n + nb, d = mb - mean;
    mean += d * nb / tot;
    m2 += m2b + d * d * n * nb / tot;
    n = tot;
  }
};

// Two-pass moments of one contiguous run of n values: returns (mean, m2) in Acc.
template <typename T>
inline std::pair<acc_t<T>, acc_t<T>> run_moments(const T* x, int64_t n) {
  using Acc = acc_t<T>;
  using V = Vectorized<Acc>;
  using IOT = IO<T, Acc>;
  constexpr int64_t K = IOT::kWidth;
  V a, b, s0(Acc(0)), s1(Acc(0));
  int64_t i = 0;
  for (; i + K <= n; i += K) { IOT::load(x + i, a, b); s0 = s0 + a; s1 = s1 + b; }
  Acc s = static_cast<Acc>(hsum(s0 + s1));
  for (int64_t j = i; j < n; ++j) s += static_cast<Acc>(x[j]);
  const Acc mu = s / static_cast<Acc>(n);
  const V vm(mu);
  V q0(Acc(0)), q1(Acc(0));
  for (i = 0; i + K <= n; i += K) {
    IOT::load(x + i, a, b);
    a = a - vm; b = b - vm;
    q0 = at::vec::fmadd(a, a, q0); q1 = at::vec::fmadd(b, b, q1);
  }
  Acc q = static_cast<Acc>(hsum(q0 + q1));
  for (int64_t j = i; j < n; ++j) { const Acc d = static_cast<Acc>(x[j]) - mu; q += d * d; }
  return {mu, q};
}

// (N, C, L): chunk (c, row block) -> partial moments, merged per channel in block order.
template <typename T>
void welford_cf(const T* X, acc_t<T>* MEAN, acc_t<T>* VAR, int64_t N, int64_t C, int64_t L) {
  const int64_t rows = std::max<int64_t>(1, std::min<int64_t>(N, 16384 / std::max<int64_t>(L, 1)));
  const int64_t nb = (N + rows - 1) / rows;
  std::vector<Moments> part(static_cast<size_t>(C * nb));
  at::parallel_for(0, C * nb, 1, [&](int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; ++k) {
      const int64_t c = k / nb, blk = k % nb;
      Moments m;
      for (int64_t r = blk * rows; r < std::min(N, (blk + 1) * rows); ++r) {
        auto [mu, q] = run_moments(X + (r * C + c) * L, L);
        m.merge(static_cast<double>(L), mu, q);
      }
      part[k] = m;
    }
  });
  for (int64_t c = 0; c < C; ++c) {
    Moments m;
    for (int64_t blk = 0; blk < nb; ++blk) { const auto& p = part[c * nb + blk]; m.merge(p.n, p.mean, p.m2); }
    MEAN[c] = static_cast<acc_t<T>>(m.mean);
    VAR[c] = static_cast<acc_t<T>>(m.n > 0 ? m.m2 / m.n : 0.0);
  }
}

// (M, C): chunk = row block, two passes vectorized across the channels.
template <typename T>
void welford_cl(const T* X, acc_t<T>* MEAN, acc_t<T>* VAR, int64_t M, int64_t C) {
  using Acc = acc_t<T>;
  using V = Vectorized<Acc>;
  using IOT = IO<T, Acc>;
  constexpr int64_t K = IOT::kWidth;
  const int64_t rows = std::max<int64_t>(1, 16384 / std::max<int64_t>(C, 1));
  const int64_t nb = (M + rows - 1) / rows;
  std::vector<Acc> pmean(static_cast<size_t>(nb * C)), pm2(static_cast<size_t>(nb * C));
  at::parallel_for(0, nb, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t blk = b0; blk < b1; ++blk) {
      const int64_t r0 = blk * rows, r1 = std::min(M, r0 + rows);
      const Acc inv = Acc(1) / static_cast<Acc>(r1 - r0);
      Acc* mu = pmean.data() + blk * C;
      Acc* q = pm2.data() + blk * C;
      int64_t c = 0;
      for (; c + K <= C; c += K) {
        V a, b, s0(Acc(0)), s1(Acc(0));
        for (int64_t r = r0; r < r1; ++r) { IOT::load(X + r * C + c, a, b); s0 = s0 + a; s1 = s1 + b; }
        const V m0 = s0 * V(inv), m1 = s1 * V(inv);
        V q0(Acc(0)), q1(Acc(0));
        for (int64_t r = r0; r < r1; ++r) {
          IOT::load(X + r * C + c, a, b);
          a = a - m0; b = b - m1;
          q0 = at::vec::fmadd(a, a, q0); q1 = at::vec::fmadd(b, b, q1);
        }
        IO<Acc, Acc>::store(mu + c, m0, m1);
        IO<Acc, Acc>::store(q + c, q0, q1);
      }
      for (; c < C; ++c) {
        Acc s = 0;
        for (int64_t r = r0; r < r1; ++r) s += static_cast<Acc>(X[r * C + c]);
        const Acc m = s * inv;
        Acc qq = 0;
        for (int64_t r = r0; r < r1; ++r) { const Acc d = static_cast<Acc>(X[r * C + c]) - m; qq += d * d; }
        mu[c] = m; q[c] = qq;
      }
    }
  });
  for (int64_t c = 0; c < C; ++c) {
    Moments m;
    for (int64_t blk = 0; blk < nb; ++blk) {
      const double n = static_cast<double>(std::min(M, (blk + 1) * rows) - blk * rows);
      m.merge(n, pmean[blk * C + c], pm2[blk * C + c]);
    }
    MEAN[c] = static_cast<Acc>(m.mean);
    VAR[c] = static_cast<Acc>(m.n > 0 ? m.m2 / m.n : 0.0);
  }
}

std::tuple<at::Tensor, at::Tensor> welford_mean_var_cpu(const at::Tensor& input, bool channel_last) {
  const char* op = "mpnb::welford_mean_var";
  TORCH_CHECK_TYPE(is_float_type(input.scalar_type()), op, ": dtype of input");
  TORCH_CHECK_VALUE(input.dim() >= 2, op, ": input has no channel dim");
  const auto x = input.contiguous();
  const int64_t C = channel_last ? x.size(-1) : x.size(1);
  const auto acc = x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  auto mean = at::zeros({C}, x.options().dtype(acc));
  auto var = at::zeros({C}, x.options().dtype(acc));
  if (x.numel() == 0) return {mean, var};
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "mpnb", [&] {
    using T = scalar_t;
    using Acc = acc_t<T>;
    if (channel_last) {
      welford_cl<T>(x.const_data_ptr<T>(), mean.mutable_data_ptr<Acc>(), var.mutable_data_ptr<Acc>(),
                    x.numel() / C, C);
    } else {
      const int64_t N = x.size(0), L = x.numel() / (N * C);
      welford_cf<T>(x.const_data_ptr<T>(), mean.mutable_data_ptr<Acc>(), var.mutable_data_ptr<Acc>(),
                    N, C, L);
    }
  });
  return {mean, var};
}

std::tuple<at::Tensor, at::Tensor> welford_parallel_cpu(const at::Tensor& mean, const at::Tensor& var,
                                                        const at::Tensor& count) {
  const char* op = "mpnb::welford_parallel";
  TORCH_CHECK_VALUE(mean.dim() == 2 && var.sizes() == mean.sizes() && count.dim() == 1 && count.size(0) == mean.size(0),
                    op, ": shapes of mean, var, count");
  TORCH_CHECK_TYPE(at::isFloatingType(mean.scalar_type()) && var.scalar_type() == mean.scalar_type() && count.scalar_type() == mean.scalar_type(),
                   op, ": dtypes of mean, var, count");
  const auto m = mean.to(at::kDouble).contiguous(), v = var.to(at::kDouble).contiguous();
  const auto n = count.to(at::kDouble).contiguous();
  const int64_t W = m.size(0), C = m.size(1);
  auto om = at::empty({C}, m.options()), ov = at::empty({C}, m.options());
  const double *pm = m.const_data_ptr<double>(), *pv = v.const_data_ptr<double>(), *pn = n.const_data_ptr<double>();
  double *qm = om.mutable_data_ptr<double>(), *qv = ov.mutable_data_ptr<double>();
  for (int64_t c = 0; c < C; ++c) {
    Moments acc;
    for (int64_t w = 0; w < W; ++w) acc.merge(pn[w], pm[w * C + c], pv[w * C + c] * pn[w]);
    qm[c] = acc.mean;
    qv[c] = acc.n > 0 ? acc.m2 / acc.n : 0.0;
  }
  return {om.to(mean.scalar_type()), ov.to(mean.scalar_type())};
}

}  // namespace
}  // namespace mpnb::cpu

TORCH_LIBRARY_IMPL(mpnb, CPU, m) {
  m.impl("welford_mean_var", &mpnb::cpu::welford_mean_var_cpu);
  m.impl("welford_parallel", &mpnb::cpu::welford_parallel_cpu);
}
