// The row passes and argument checks shared by the two norm kernels, layer_norm.cpp and
// rms_norm.cpp (Apex's fused layer norm and RMS norm on the CPU, forward and backward).
//
// The input is viewed as rows [M, N] (N = prod(normalized_shape)). One thread owns whole rows:
// the statistics pass reads a row from memory, the later passes find it in L1/L2, so every
// element crosses the memory bus once per direction. Statistics are fp32 for fp32/fp16/bf16
// data (fp64 for fp64): mean first, then the centred sum of squares (two-pass, stable).
// Weights may be the input's dtype or fp32 ("mixed": half input, fp32 weights), widened to fp32
// once per call; the output always has the input's dtype. Row reductions use four
// accumulators, and every pass is a plain function over local registers (lambdas capturing the
// block registers by reference made GCC keep them on the stack), and the per-block helpers of
// the backward are forced inline (C10_ALWAYS_INLINE): compiled in its own translation unit, GCC
// left bwd_write out of line for bf16 and the bf16 layer-norm backward took twice as long
// (8.3 ms instead of 4.0 ms on 8192 x 4096, 2 threads). The weight/bias gradients
// are summed per row block into fp32 partials that are added in block order, so the result is
// the same on every run with the same number of threads.
//
// The checks raise the Python exceptions (TypeError, ValueError) and messages of the
// references' checks (mpnb/core/ops/_norm.py): the problem and the fix.
#pragma once

#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <tuple>
#include <utility>
#include <vector>

#include "cpu/fast_math.h"
#include "cpu/multi_tensor_apply.h"

#if defined(__linux__)
#include <unistd.h>
#endif

namespace mpnb::cpu {

// Zero the lanes past `n` (a tail block): keeps padded lanes out of row reductions.
template <typename V>
C10_ALWAYS_INLINE void keep_first(V& a, V& b, int64_t n) {
  const int64_t s = V::size();
  a = n >= s ? a : V::set(V(0), a, n);
  b = n >= 2 * s ? b : (n > s ? V::set(V(0), b, n - s) : V(0));
}

struct NormShape {
  int64_t rows, cols;
};

inline void check_float_input(const at::Tensor& x, const char* op, const char* what) {
  TORCH_CHECK_TYPE(is_float_type(x.scalar_type()), op, ": dtype of ", what);
}

inline NormShape norm_shape(const at::Tensor& x, at::IntArrayRef nshape, const char* op) {
  const int64_t k = static_cast<int64_t>(nshape.size());
  bool ok = k >= 1 && x.dim() >= k;
  for (int64_t i = 0; ok && i < k; ++i) ok = x.size(x.dim() - k + i) == nshape[i];
  TORCH_CHECK_VALUE(ok, op, ": normalized_shape ", nshape, " of ", x.sizes());
  int64_t cols = 1;
  for (int64_t i = 0; i < k; ++i) cols *= nshape[i];
  return {cols == 0 ? 0 : x.numel() / cols, cols};
}

inline void check_param(const std::optional<at::Tensor>& p, const at::Tensor& x, int64_t cols,
                        const char* op, const char* what) {
  if (!p.has_value()) return;
  TORCH_CHECK_VALUE(p->device() == x.device() && p->numel() == cols, op, ": size of ", what);
  const auto t = p->scalar_type();
  TORCH_CHECK_TYPE(t == x.scalar_type() || (t == at::kFloat && x.scalar_type() != at::kDouble), op,
                   ": dtype of ", what);
}

inline void check_params(const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
                         const at::Tensor& x, int64_t cols, const char* op) {
  check_param(weight, x, cols, op, "weight");
  check_param(bias, x, cols, op, "bias");
  TORCH_CHECK_TYPE(!weight.has_value() || !bias.has_value() ||
                       weight->scalar_type() == bias->scalar_type(),
                   op, ": dtypes of weight and bias");
}

// buf holding n copies of v (a missing weight or bias, a scratch row of partials): its data.
template <typename Acc>
inline Acc* filled(std::vector<Acc>& buf, int64_t n, Acc v) {
  buf.assign(n, v);
  return buf.data();
}

// Weights (and biases) widened to Acc once per call: the row passes load them without
// conversion (16-bit weights cost four extra ops per block otherwise). A missing one is n
// copies of `missing` (ones for a weight; a bias's zero), so the row passes never test for it.
template <typename W, typename Acc>
inline const Acc* widen_param(const W* p, int64_t n, std::vector<Acc>& buf, Acc missing) {
  if (!p) return filled(buf, n, missing);
  if constexpr (std::is_same_v<W, Acc>) {
    return p;
  } else {
    buf.resize(n);
    for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<Acc>(p[i]);
    return buf.data();
  }
}

template <typename Acc>
C10_ALWAYS_INLINE void load_acc(const Acc* p, int64_t j, int64_t n, Vectorized<Acc>& a, Vectorized<Acc>& b) {
  if (n == IO<Acc, Acc>::kWidth) IO<Acc, Acc>::load(p + j, a, b);
  else IO<Acc, Acc>::load(p + j, n, a, b);
}

// ---- forward -----------------------------------------------------------------------------

// Sum of a row: two blocks per step into four accumulators (an add's latency is 3-4 cycles).
template <typename T, typename PF>
inline acc_t<T> row_sum(const T* __restrict x, int64_t N, PF& pf) {
  using Acc = acc_t<T>;
  using V = Vectorized<Acc>;
  using IOT = IO<T, Acc>;
  constexpr int64_t K = IOT::kWidth;
  V s0(Acc(0)), s1(Acc(0)), s2(Acc(0)), s3(Acc(0)), a, b, c, d;
  int64_t i = 0;
  for (; i + 2 * K <= N; i += 2 * K) {
    if constexpr (kEarlyPrefetch<T>) pf.step();
    IOT::load(x + i, a, b); IOT::load(x + i + K, c, d);
    s0 = s0 + a; s1 = s1 + b; s2 = s2 + c; s3 = s3 + d;
  }
  for (; i < N; i += K) {
    if constexpr (kEarlyPrefetch<T>) pf.step();
    if (i + K <= N) IOT::load(x + i, a, b); else IOT::load(x + i, N - i, a, b);  // zero padded
    s0 = s0 + a; s1 = s1 + b;
  }
  return static_cast<Acc>(hsum((s0 + s1) + (s2 + s3)));
}

// Sum of (x - mu)^2 over a row, four accumulators (kCentre false: mu is 0, no subtraction).
template <typename T, bool kCentre, typename PF>
inline acc_t<T> row_centred_squares(const T* __restrict x, int64_t N, acc_t<T> mu, PF& pf) {
  using Acc = acc_t<T>;
  using V = Vectorized<Acc>;
  using IOT = IO<T, Acc>;
  constexpr int64_t K = IOT::kWidth;
  const V vm(mu);
  V q0(Acc(0)), q1(Acc(0)), q2(Acc(0)), q3(Acc(0)), a, b, c, d;
  int64_t i = 0;
  for (; i + 2 * K <= N; i += 2 * K) {
    if constexpr (kEarlyPrefetch<T>) pf.step();
    IOT::load(x + i, a, b); IOT::load(x + i + K, c, d);
    if constexpr (kCentre) { a = a - vm; b = b - vm; c = c - vm; d = d - vm; }
    q0 = at::vec::fmadd(a, a, q0); q1 = at::vec::fmadd(b, b, q1);
    q2 = at::vec::fmadd(c, c, q2); q3 = at::vec::fmadd(d, d, q3);
  }
  for (; i < N; i += K) {
    if constexpr (kEarlyPrefetch<T>) pf.step();
    const int64_t n = std::min<int64_t>(K, N - i);
    if (n == K) IOT::load(x + i, a, b); else IOT::load(x + i, n, a, b);
    if constexpr (kCentre) { a = a - vm; b = b - vm; }
    if (n < K) keep_first(a, b, n);
    q0 = at::vec::fmadd(a, a, q0); q1 = at::vec::fmadd(b, b, q1);
  }
  return static_cast<Acc>(hsum((q0 + q1) + (q2 + q3)));
}

// y = (x - mu) * rs * w + b over a row (w, b widened; kCentre: layer norm, with b; else RMS
// norm, without). x - mu first: the shorter x * rs - mu * rs would cancel digits for rows with
// a large mean. norm_fwd_kernel passes ones for a missing weight and -0 for a missing bias:
// fma(a, w, -0) rounds a * w once as the product alone does (p + -0 is p, signed zeros too),
// fma(a, 1, b) is a + b and fma(a, 1, -0) is a, so the loop has no branch on them (32768 x
// 1024 fp32 at 1 thread on an AMD EPYC Zen 1, one process per build, % of the same-run add:
// layer norm forward 62-67% -> 70-78%, RMS norm forward 71-74% -> 83-93%; the same bits).
template <typename T, bool kCentre, typename PF>
inline void norm_write_row(const T* __restrict x, T* __restrict y, int64_t N, acc_t<T> mu,
                           acc_t<T> rs, const acc_t<T>* __restrict w, const acc_t<T>* __restrict b,
                           PF& pf, bool stream) {
  using Acc = acc_t<T>;
  using V = Vectorized<Acc>;
  using IOT = LayerIO<T, Acc>;
  constexpr int64_t K = IOT::kWidth;
  const V vr(rs), vm(mu);
  auto block = [=](int64_t j, int64_t n, V& a, V& c) {
    if (n == K) IOT::load(x + j, a, c); else IOT::load(x + j, n, a, c);
    if constexpr (kCentre) { a = a - vm; c = c - vm; }
    a = a * vr; c = c * vr;
    V w0, w1;
    load_acc(w, j, n, w0, w1);
    if constexpr (kCentre) {
      V b0, b1;
      load_acc(b, j, n, b0, b1);
      a = at::vec::fmadd(a, w0, b0); c = at::vec::fmadd(c, w1, b1);
    } else {
      a = a * w0; c = c * w1;
    }
  };
  V a, c;
  int64_t j = 0;
  if (stream) {
    const int64_t head = align_head(y, N);
    while (j < head) {
      const int64_t n = std::min<int64_t>(K, head - j);
      block(j, n, a, c);
      IOT::store(y + j, n, a, c);
      j += n;
    }
    for (; j + K <= N; j += K) {
      pf.step();
      block(j, K, a, c);
      IOT::stream(y + j, a, c);
    }
  } else {
    for (; j + K <= N; j += K) {
      pf.step();
      block(j, K, a, c);
      IOT::store(y + j, a, c);
    }
  }
  if (j < N) {
    block(j, N - j, a, c);
    IOT::store(y + j, N - j, a, c);
  }
}

template <typename T, typename W, bool kRms>
void norm_fwd_kernel(const T* X, const W* w, const W* b, T* Y, acc_t<T>* MEAN, acc_t<T>* RSTD,
                     int64_t M, int64_t N, double eps, bool stream) {
  using Acc = acc_t<T>;
  std::vector<Acc> wbuf, bbuf;
  const Acc* wf = widen_param<W, Acc>(w, N, wbuf, Acc(1));
  const Acc* bf = kRms ? nullptr : widen_param<W, Acc>(b, N, bbuf, -Acc(0));
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(N, 1));
  const int64_t skip = rows_ahead(N * static_cast<int64_t>(sizeof(T)));
  at::parallel_for(0, M, grain, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* x = X + r * N;
      RowPrefetch<1, kSpreadStep<T>> pf(r + skip < M ? x + skip * N : nullptr, nullptr,
                                        N * static_cast<int64_t>(sizeof(T)));
      Acc mu = 0;
      if constexpr (!kRms) mu = static_cast<Acc>(row_sum<T>(x, N, pf) / static_cast<double>(N));
      const Acc var = static_cast<Acc>(row_centred_squares<T, !kRms>(x, N, mu, pf) / static_cast<double>(N));
      const Acc rs = Acc(1) / std::sqrt(var + static_cast<Acc>(eps));
      if constexpr (!kRms) MEAN[r] = mu;
      RSTD[r] = rs;
      norm_write_row<T, !kRms>(x, Y + r * N, N, mu, rs, wf, bf, pf, stream);
      pf.finish();
    }
    if (stream) stream_fence();
  });
}

// ---- backward ----------------------------------------------------------------------------

// xhat of one block: from the input (x - mean) * rstd, or from the output (y - b) / w.
template <typename T>
struct NormBwdRow {
  using Acc = acc_t<T>;
  using V = Vectorized<Acc>;
  const T* dy;
  const T* s;
  T* dx;
  V vr, vm;  // rstd, mean
  V c1, c2;   // the row's mean of g*w*xhat and of g*w
};

template <typename T, bool kCentre, bool kFromY>
C10_ALWAYS_INLINE void bwd_load(const T* __restrict dy, const T* __restrict s, int64_t j, int64_t n,
                     const Vectorized<acc_t<T>>& vr, const Vectorized<acc_t<T>>& vm,
                     const acc_t<T>* __restrict w, const acc_t<T>* __restrict b,
                     Vectorized<acc_t<T>>& g0, Vectorized<acc_t<T>>& g1, Vectorized<acc_t<T>>& h0,
                     Vectorized<acc_t<T>>& h1, Vectorized<acc_t<T>>& w0, Vectorized<acc_t<T>>& w1) {
  using Acc = acc_t<T>;
  using V = Vectorized<Acc>;
  using IOT = IO<T, Acc>;
  const bool full = n == IOT::kWidth;
  if (full) { IOT::load(dy + j, g0, g1); IOT::load(s + j, h0, h1); }
  else { IOT::load(dy + j, n, g0, g1); IOT::load(s + j, n, h0, h1); }
  load_acc(w, j, n, w0, w1);
  if constexpr (kFromY) {
    V b0, b1;
    load_acc(b, j, n, b0, b1);
    h0 = (h0 - b0) / w0; h1 = (h1 - b1) / w1;
  } else {
    if constexpr (kCentre) { h0 = h0 - vm; h1 = h1 - vm; }
    h0 = h0 * vr; h1 = h1 * vr;
  }
  if (!full) keep_first(h0, h1, n);
}

// Row statistics of the backward: c1 = mean(g*w*xhat), c2 = mean(g*w) (0 for RMS). With kDb,
// also the bias gradient partial db += g (see bwd_rows).
template <typename T, bool kRms, bool kFromY, bool kDb, typename PF>
C10_ALWAYS_INLINE void bwd_stats(NormBwdRow<T>& row, int64_t N, const acc_t<T>* __restrict w,
                      const acc_t<T>* __restrict b, PF& pf, acc_t<T>* __restrict db) {
  using Acc = acc_t<T>;
  using V = Vectorized<Acc>;
  using IOA = IO<Acc, Acc>;
  constexpr int64_t K = IO<T, Acc>::kWidth;
  const T* __restrict dy = row.dy;
  const T* __restrict s = row.s;
  V s1a(Acc(0)), s1b(Acc(0)), s2a(Acc(0)), s2b(Acc(0)), g0, g1, h0, h1, w0, w1;
  for (int64_t j = 0; j < N; j += K) {
    if constexpr (kEarlyPrefetch<T>) pf.step();
    const int64_t n = std::min<int64_t>(K, N - j);
    bwd_load<T, !kRms, kFromY>(dy, s, j, n, row.vr, row.vm, w, b, g0, g1, h0, h1, w0, w1);
    const V ga = g0 * w0, gb = g1 * w1;
    if constexpr (!kRms) { s1a = s1a + ga; s1b = s1b + gb; }
    s2a = at::vec::fmadd(ga, h0, s2a); s2b = at::vec::fmadd(gb, h1, s2b);
    if constexpr (kDb) {
      V e0, e1;
      load_acc(db, j, n, e0, e1);
      e0 = e0 + g0; e1 = e1 + g1;
      if (n == K) IOA::store(db + j, e0, e1); else IOA::store(db + j, n, e0, e1);
    }
  }
  const Acc inv_n = Acc(1) / static_cast<Acc>(N);
  row.c1 = V(static_cast<Acc>(hsum(s2a + s2b)) * inv_n);
  row.c2 = V(kRms ? Acc(0) : static_cast<Acc>(hsum(s1a + s1b)) * inv_n);
}

template <typename T>
C10_ALWAYS_INLINE void store_block(T* p, int64_t n, bool nt, const Vectorized<acc_t<T>>& a,
                        const Vectorized<acc_t<T>>& b) {
  using IOT = LayerIO<T, acc_t<T>>;
  if (n < IOT::kWidth) IOT::store(p, n, a, b);
  else if (nt) IOT::stream(p, a, b);
  else IOT::store(p, a, b);
}

// Rows the backward's write pass takes together (norm_bwd_kernel): per block, the weight/bias
// gradient partials are loaded and stored once for the group instead of once per row. A
// 4096-wide row's partials (two fp32 arrays, 32 KiB) and weight did not stay in a 48 KiB L1
// beside the row; with the weight they were 62% (fp32) and 77% (bf16) of the write pass's bytes.
// (Two rows per pass, each row's blocks in step with the other's, measured slower on an AMD
// EPYC: four input streams and two prefetch streams per block. Here each row's blocks are
// visited in turn, a column block at a time.)
// 8192 x 4096, `mpnb bench layers` side by side on an AVX-512 Xeon (% of the same-run add, one
// row at a time -> four): layer norm fp32 65-70% -> 70-77% at 1 thread, 65-66% -> 74-79% at 2;
// RMS norm fp32 66-67% -> 71-79%, 65-67% -> 76-81%; layer norm bf16 60-63% -> 64-71% at 1
// thread. Groups of two measured the same for fp32 and 61-64% for bf16; of eight, 63-65% and
// fp32 76-77%. Narrow rows stay one at a time: 1024 wide, their partials (8 KiB) stay in L1 and
// the grouped pass measured slower (32768 x 1024 bf16 at 1 thread, 71-72% -> 63-64%). The rule:
// group when the weight and the two partials, in the accumulation type, take 24 KiB or more
// (N >= 2048 for fp32 accumulation), on a CPU whose L1 data cache holds 48 KiB or more.
// With 32 KiB (AMD EPYC Zen 1, as Zen 2 to 4), one 4096-wide fp32 row's dy and x fill it
// alone, and four rows at a time measured slower than one, with the branch-free loops below
// (8192 x 4096 fp32, isolated, % of the same-run add, one row -> four): 1 thread, layer norm
// backward 60% -> 52%, RMS 68% -> 58%; 2 threads 70% -> 61%, 77% -> 69%; bf16 the same (24-29%).
// 1024 wide, two rows at a time measured slower still (RMS 66% -> 52% at 1 thread).
inline constexpr int kBwdGroup = 4;
inline constexpr int64_t kBwdGroupL1 = int64_t(48) << 10;

// The L1 data cache's size in bytes (0 where the system does not say).
inline int64_t l1d_bytes() {
  static const int64_t bytes = [] {
#if defined(__linux__) && defined(_SC_LEVEL1_DCACHE_SIZE)
    const long v = sysconf(_SC_LEVEL1_DCACHE_SIZE);
    return v > 0 ? static_cast<int64_t>(v) : int64_t(0);
#else
    return int64_t(0);
#endif
  }();
  return bytes;
}

// MPNB_CPU_NORM_BWD_ROWS=1 or 4 sets the rows per write pass for every width instead (read at
// each call): how the tests run both passes on any CPU, and how to measure them on a new one.
inline int bwd_group_rows(int64_t N, int64_t acc_bytes) {
  if (const char* env = std::getenv("MPNB_CPU_NORM_BWD_ROWS")) {
    if (std::strcmp(env, "1") == 0) return 1;
    if (std::strcmp(env, "4") == 0) return kBwdGroup;
  }
  return l1d_bytes() >= kBwdGroupL1 && 3 * N * acc_bytes >= (int64_t(24) << 10) ? kBwdGroup : 1;
}

// What every row of one backward call shares.
template <typename T>
struct NormBwdArgs {
  const T* DY;
  const T* S;
  const acc_t<T>* MEAN;
  const acc_t<T>* RSTD;
  const acc_t<T>* w;  // widened to the accumulation type (ones without a weight)
  const acc_t<T>* b;  // the same, with kFromY (zeros without a bias); else unused
  T* DX;
  int64_t M, N;
  int64_t skip;  // how many rows on a row's write pass prefetches (whole groups)
  bool stream;
};

// The write pass of kG rows: dx of each, and the weight/bias gradient partials (dw += g*xhat,
// with kDb db += g), accumulated in row order as one row at a time would (the same bits).
// pfs[i]: row i's later-row prefetch (RowPrefetch, vec_io.h), stepped once per block.
template <typename T, bool kRms, bool kFromY, bool kDb, int kG, typename PF>
C10_ALWAYS_INLINE void bwd_write(const NormBwdRow<T>* rows, PF* pfs, int64_t N,
                      const acc_t<T>* __restrict w, const acc_t<T>* __restrict b,
                      bool stream, acc_t<T>* __restrict dw, acc_t<T>* __restrict db) {
  using Acc = acc_t<T>;
  using V = Vectorized<Acc>;
  using IOA = IO<Acc, Acc>;
  constexpr int64_t K = IO<T, Acc>::kWidth;
  bool nt[kG];
  for (int i = 0; i < kG; ++i) nt[i] = stream && align_head(rows[i].dx, N) == 0;
  for (int64_t j = 0; j < N; j += K) {
    const int64_t n = std::min<int64_t>(K, N - j);
    V a0, a1, e0, e1;
    for (int i = 0; i < kG; ++i) {  // the partials loaded with the first row, stored after the last
      const NormBwdRow<T>& row = rows[i];
      pfs[i].step();
      V g0, g1, h0, h1, w0, w1;
      bwd_load<T, !kRms, kFromY>(row.dy, row.s, j, n, row.vr, row.vm, w, b, g0, g1, h0, h1, w0, w1);
      V d0 = at::vec::fnmadd(h0, row.c1, g0 * w0), d1 = at::vec::fnmadd(h1, row.c1, g1 * w1);
      if constexpr (!kRms) { d0 = d0 - row.c2; d1 = d1 - row.c2; }
      store_block<T>(row.dx + j, n, nt[i], d0 * row.vr, d1 * row.vr);
      if (i == 0) load_acc(dw, j, n, a0, a1);
      a0 = at::vec::fmadd(g0, h0, a0); a1 = at::vec::fmadd(g1, h1, a1);
      if (i == kG - 1) { if (n == K) IOA::store(dw + j, a0, a1); else IOA::store(dw + j, n, a0, a1); }
      if constexpr (kDb) {
        if (i == 0) load_acc(db, j, n, e0, e1);
        e0 = e0 + g0; e1 = e1 + g1;
        if (i == kG - 1) { if (n == K) IOA::store(db + j, e0, e1); else IOA::store(db + j, n, e0, e1); }
      }
    }
  }
}

template <typename PF, typename F, size_t... I>
C10_ALWAYS_INLINE std::array<PF, sizeof...(I)> each_row(F f, std::index_sequence<I...>) {
  return {f(static_cast<int>(I))...};
}

// Rows r0 .. r0 + kG - 1 of the backward: each row's statistics pass, then their write pass.
// The layer norm's bias gradient partial (db += g) of a single fp32/fp64 row is summed in its
// statistics pass: the write pass held three stores per block (dx, dw, db: twelve 128-bit
// stores per 16 floats on Zen 1, which stores one a cycle) and the statistics pass none. The
// same adds in the same order, so the same bits. (AMD EPYC Zen 1, `mpnb bench layers`, three
// runs each, layer norm backward fp32 at 1 thread, % of the same-run add: 32768 x 1024 65-66%
// -> 71%, 8192 x 4096 61-63% -> 63-65%.) A group adds it once per group in the write pass, and
// a 16-bit row's statistics pass is bound by widening the data: both keep it there.
template <typename T, bool kRms, bool kFromY, int kG>
C10_ALWAYS_INLINE void bwd_rows(const NormBwdArgs<T>& a, int64_t r0, acc_t<T>* dw, acc_t<T>* db) {
  using Acc = acc_t<T>;
  using V = Vectorized<Acc>;
  using PF = RowPrefetch<2, kSpreadStep<T>>;
  constexpr bool kDbInStats = !kRms && kG == 1 && sizeof(T) >= 4;
  // a's fields as locals, read once: the vector stores may alias any memory, so fields read in
  // the block loop would be read again after every store
  const int64_t N = a.N;
  const Acc* __restrict w = a.w;
  const Acc* __restrict b = a.b;
  auto later = [&](int i) {  // row r0 + i's prefetch: the row `skip` on, when there is one
    const int64_t r = r0 + i + a.skip;
    const bool ahead = r < a.M;
    return PF(ahead ? a.DY + r * N : nullptr, ahead ? a.S + r * N : nullptr,
              N * static_cast<int64_t>(sizeof(T)));
  };
  std::array<PF, kG> pf = each_row<PF>(later, std::make_index_sequence<kG>{});
  NormBwdRow<T> row[kG];
  for (int i = 0; i < kG; ++i) {
    const int64_t r = r0 + i;
    row[i].dy = a.DY + r * N; row[i].s = a.S + r * N; row[i].dx = a.DX + r * N;
    const Acc rs = a.RSTD[r], mu = kRms || kFromY ? Acc(0) : a.MEAN[r];
    row[i].vr = V(rs); row[i].vm = V(mu);
    bwd_stats<T, kRms, kFromY, kDbInStats>(row[i], N, w, b, pf[i], db);
  }
  bwd_write<T, kRms, kFromY, !kRms && !kDbInStats, kG>(row, pf.data(), N, w, b, a.stream, dw, db);
  for (int i = 0; i < kG; ++i) pf[i].finish();
}

// The rows of one backward call, split into P = min(M, threads) contiguous ranges, one per
// thread, each with its own row of the weight/bias gradient partials DW, DB ([P, N]).
template <typename T, bool kRms, bool kFromY>
void norm_bwd_rows(const NormBwdArgs<T>& a, acc_t<T>* DW, acc_t<T>* DB, int64_t P, int g) {
  using Acc = acc_t<T>;
  const int64_t M = a.M, N = a.N;
  at::parallel_for(0, P, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      Acc* dw = DW + p * N;
      Acc* db = kRms ? nullptr : DB + p * N;
      const int64_t end = (p + 1) * M / P;
      int64_t r = p * M / P;
      if (g == kBwdGroup) {
        for (; r + kBwdGroup <= end; r += kBwdGroup) bwd_rows<T, kRms, kFromY, kBwdGroup>(a, r, dw, db);
      }
      for (; r < end; ++r) bwd_rows<T, kRms, kFromY, 1>(a, r, dw, db);
    }
    if (a.stream) stream_fence();
  });
}

// The block loops have no branch on what a call has: a missing weight is read as ones (and a
// missing bias, with from_y, as zeros), which gives the same bits (g * 1, (y - 0) / 1), and the
// gradient partials a call does not return are summed into scratch rows and dropped; from_y
// (memory_efficient) is a template flag. With the optional arrays tested in the loops, GCC
// kept the tests as branches and spilled block registers to the stack around them. Measured on
// an AMD EPYC (Zen 1, AVX2), one process per build, % of the same-run in-place add, 1 thread:
// 32768 x 1024 fp32 RMS norm backward 62% -> 73-77% (in cache 59-83% -> 82-110%), layer norm
// backward 55-60% -> 64-65%; 8192 x 4096 fp32 RMS 52-53% -> 62-63%, layer 44% -> 55-56%;
// bf16 unchanged (bound by widening). The outputs are bitwise those of the branching loops
// (216 configurations: 6 dtype pairs, 3 shapes, weight/bias/memory_efficient on and off).
template <typename T, typename W, bool kRms>
void norm_bwd_kernel(const T* DY, const T* S, const acc_t<T>* MEAN, const acc_t<T>* RSTD,
                     const W* w, const W* b, T* DX, acc_t<T>* DW, acc_t<T>* DB, int64_t M,
                     int64_t N, bool from_y, bool stream) {
  using Acc = acc_t<T>;
  std::vector<Acc> wbuf, bbuf;
  const Acc* wf = widen_param<W, Acc>(w, N, wbuf, Acc(1));
  const Acc* bf = from_y ? widen_param<W, Acc>(b, N, bbuf, Acc(0)) : nullptr;
  const int64_t P = std::max<int64_t>(1, std::min<int64_t>(M, at::get_num_threads()));
  std::vector<Acc> dw_scratch, db_scratch;
  if (!DW) DW = filled(dw_scratch, P * N, Acc(0));
  if (!kRms && !DB) DB = filled(db_scratch, P * N, Acc(0));
  const int g = bwd_group_rows(N, sizeof(Acc));
  const int64_t ahead = rows_ahead(2 * N * static_cast<int64_t>(sizeof(T)));  // dy and saved
  const NormBwdArgs<T> a{DY, S, MEAN, RSTD, wf, bf, DX, M, N, (ahead + g - 1) / g * g, stream};
  if (from_y) norm_bwd_rows<T, kRms, true>(a, DW, DB, P, g);
  else norm_bwd_rows<T, kRms, false>(a, DW, DB, P, g);
}

// ---- typed entry points ------------------------------------------------------------------

// Calls f(T*, W*) with the input's type T and the parameters' type W (T, or float for the mixed
// layers: fp32 weight and/or bias with a half input; the checks made both one dtype).
template <typename F>
inline void dispatch_norm(const at::Tensor& x, const std::optional<at::Tensor>& w,
                          const std::optional<at::Tensor>& b, const F& f) {
  const auto& p = w.has_value() ? w : b;
  const bool mixed = p.has_value() && p->scalar_type() != x.scalar_type();
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "mpnb", [&] {
    using T = scalar_t;
    if constexpr (std::is_same_v<T, double>) {
      f(static_cast<T*>(nullptr), static_cast<T*>(nullptr));
    } else {
      if (mixed) f(static_cast<T*>(nullptr), static_cast<float*>(nullptr));
      else f(static_cast<T*>(nullptr), static_cast<T*>(nullptr));
    }
  });
}

template <typename W>
inline const W* opt_ptr(const std::optional<at::Tensor>& t) {
  return t.has_value() ? t->const_data_ptr<W>() : nullptr;
}

inline at::ScalarType acc_type(const at::Tensor& x) {
  return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

template <bool kRms>
std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_fwd(const at::Tensor& input, at::IntArrayRef nshape,
                                                        const std::optional<at::Tensor>& weight,
                                                        const std::optional<at::Tensor>& bias, double eps,
                                                        const char* op) {
  check_float_input(input, op, "input");
  const auto sh = norm_shape(input, nshape, op);
  check_params(weight, bias, input, sh.cols, op);
  const auto x = input.contiguous();
  const auto w = weight.has_value() ? std::optional<at::Tensor>(weight->contiguous()) : std::nullopt;
  const auto b = bias.has_value() ? std::optional<at::Tensor>(bias->contiguous()) : std::nullopt;
  auto y = empty_output_like(x);
  auto stat_opts = x.options().dtype(acc_type(x));
  auto mean = at::empty({kRms ? 0 : sh.rows}, stat_opts);
  auto rstd = at::empty({sh.rows}, stat_opts);
  if (sh.rows == 0) return {y, mean, rstd};
  dispatch_norm(x, w, b, [&](auto* tp, auto* wp) {
    using T = std::remove_pointer_t<decltype(tp)>;
    using Wt = std::remove_pointer_t<decltype(wp)>;
    norm_fwd_kernel<T, Wt, kRms>(x.const_data_ptr<T>(), opt_ptr<Wt>(w), opt_ptr<Wt>(b),
                                 y.mutable_data_ptr<T>(), kRms ? nullptr : mean.mutable_data_ptr<acc_t<T>>(),
                                 rstd.mutable_data_ptr<acc_t<T>>(), sh.rows, sh.cols, eps, stream_into(y));
  });
  return {y, mean, rstd};
}

template <bool kRms>
std::tuple<at::Tensor, at::Tensor, at::Tensor> norm_bwd(
    const at::Tensor& grad_out, const at::Tensor& saved, const at::Tensor& mean, const at::Tensor& rstd,
    at::IntArrayRef nshape, const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias,
    bool memory_efficient, const char* op) {
  check_float_input(saved, op, "saved");
  const auto sh = norm_shape(saved, nshape, op);
  TORCH_CHECK_VALUE(grad_out.sizes() == saved.sizes() && grad_out.scalar_type() == saved.scalar_type(),
                    op, ": grad_out does not match saved");
  TORCH_CHECK_VALUE(rstd.numel() == sh.rows && rstd.scalar_type() == acc_type(saved), op,
                    ": invvar per row");
  TORCH_CHECK_VALUE(kRms || memory_efficient || mean.numel() == sh.rows, op, ": mean per row");
  check_params(weight, bias, saved, sh.cols, op);
  const auto dy = grad_out.contiguous(), s = saved.contiguous();
  const auto w = weight.has_value() ? std::optional<at::Tensor>(weight->contiguous()) : std::nullopt;
  const auto b = bias.has_value() ? std::optional<at::Tensor>(bias->contiguous()) : std::nullopt;
  const auto m = mean.contiguous(), r = rstd.contiguous();
  auto dx = empty_output_like(s);
  const int64_t P = std::max<int64_t>(1, std::min<int64_t>(sh.rows, at::get_num_threads()));
  auto opts = s.options().dtype(acc_type(s));
  at::Tensor dw_part = w ? at::zeros({P, sh.cols}, opts) : at::Tensor();
  at::Tensor db_part = b ? at::zeros({P, sh.cols}, opts) : at::Tensor();
  if (sh.rows > 0) {
    dispatch_norm(s, w, b, [&](auto* tp, auto* wp) {
      using T = std::remove_pointer_t<decltype(tp)>;
      using Wt = std::remove_pointer_t<decltype(wp)>;
      using Acc = acc_t<T>;
      norm_bwd_kernel<T, Wt, kRms>(
          dy.const_data_ptr<T>(), s.const_data_ptr<T>(),
          kRms || memory_efficient ? nullptr : m.const_data_ptr<Acc>(), r.const_data_ptr<Acc>(),
          opt_ptr<Wt>(w), memory_efficient ? opt_ptr<Wt>(b) : nullptr, dx.mutable_data_ptr<T>(),
          w ? dw_part.mutable_data_ptr<Acc>() : nullptr, b ? db_part.mutable_data_ptr<Acc>() : nullptr,
          sh.rows, sh.cols, memory_efficient, stream_into(dx));
    });
  }
  auto reduce = [&](const at::Tensor& part, const std::optional<at::Tensor>& p) {
    if (!p) return at::empty({0}, s.options());
    return part.sum(0).to(p->scalar_type()).view(p->sizes());
  };
  return {dx, reduce(dw_part, w), reduce(db_part, b)};
}

}  // namespace mpnb::cpu
