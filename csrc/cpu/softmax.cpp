// mpnb::scaled_softmax_fwd, scaled_masked_softmax_fwd, scaled_upper_triang_masked_softmax_fwd and
// scaled_softmax_bwd on the CPU: Apex's fused scaled (masked) softmax, the kernels behind
// FusedScaleMaskSoftmax. The schemas are defined in mpnb/core/ops/softmax.py.
//
// Softmax runs over the last dim; one thread owns whole rows. Forward: one pass reads the row
// from memory for its max; a second exponentiates it (scaled, masked, shifted) into an fp32
// scratch row (in L1/L2) and sums; the normalized row is written during the next row's second
// pass (two scratch rows per thread), so the output's stores (streaming for a large output
// whose memory is already backed: stream_into, fast_math.h) overlap the exp arithmetic, the
// bound of this kernel on AVX2. Each element is read from memory once and written once. Masked elements become -10000 after scaling (as Apex and Megatron do, so a fully
// masked row is uniform; with zero_all_masked, Apex's generic kernel, a fully masked row is all
// zeros instead); the upper-triangular (causal) variant has no mask tensor: row i keeps
// columns 0..i and writes zeros after them.
// Backward, shared by every variant: dx = scale * y * (dy - sum(dy * y)), reading y and dy once
// and writing dx once (the second pass finds the row in cache).
#include <ATen/ATen.h>
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstring>
#include <limits>
#include <optional>
#include <vector>

#include "cpu/fast_math.h"
#include "cpu/multi_tensor_apply.h"

namespace mpnb::cpu {
namespace {

constexpr float kMaskedValue = -10000.0f;

// max(a, b) lanewise; NaN need not propagate here (a NaN input makes the row's sum NaN anyway).
template <typename V>
inline V vmax(const V& a, const V& b) {
#if defined(CPU_CAPABILITY_AVX2) && !defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<V, fVec>) return fVec(_mm256_max_ps(a, b));
#endif
  return at::vec::maximum(a, b);
}

// Mask bytes per block of the row passes: one per lane of a and of b (16 with AVX2, 32 with
// AVX-512). A tail block (n < kMaskBlock) is copied into a zeroed buffer first.
constexpr int64_t kMaskBlock = 2 * fVec::size();

inline const uint8_t* mask_block(const uint8_t* m, int64_t n, uint8_t* buf) {
  if (n >= kMaskBlock) return m;
  std::memset(buf, 0, kMaskBlock);
  std::memcpy(buf, m, n);
  return buf;
}

#if defined(CPU_CAPABILITY_AVX512)
// The lanes of a block whose mask byte (kMaskBlock bytes at src) is set (kSet) or clear, as
// masks for a and b: one byte test per 16 lanes.
template <bool kSet>
C10_ALWAYS_INLINE void mask_lanes(const uint8_t* src, __mmask16& lo, __mmask16& hi) {
  const __m128i l = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + 16));
  lo = kSet ? _mm_test_epi8_mask(l, l) : _mm_testn_epi8_mask(l, l);
  hi = kSet ? _mm_test_epi8_mask(h, h) : _mm_testn_epi8_mask(h, h);
}
#endif

// Replace lanes whose mask byte is nonzero by `fill` (kMaskBlock mask bytes for a, b). The
// per-block helpers of the row passes are `inline`: a hint GCC's inliner weighs, which keeps
// them inside the hot loops (as they were when these kernels were one translation unit).
inline void apply_mask(const uint8_t* m, int64_t n, fVec& a, fVec& b, const fVec& fill) {
  alignas(64) uint8_t buf[kMaskBlock];
  const uint8_t* src = mask_block(m, n, buf);
#if defined(CPU_CAPABILITY_AVX512)
  __mmask16 lo, hi;
  mask_lanes<true>(src, lo, hi);
  a = _mm512_mask_blend_ps(lo, a, fill);
  b = _mm512_mask_blend_ps(hi, b, fill);
#elif defined(CPU_CAPABILITY_AVX2)
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  const __m256i zero = _mm256_setzero_si256();
  const __m256 lo = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_cvtepu8_epi32(bytes), zero));
  const __m256 hi = _mm256_castsi256_ps(
      _mm256_cmpgt_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8)), zero));
  a = _mm256_blendv_ps(a, fill, lo);
  b = _mm256_blendv_ps(b, fill, hi);
#else
  alignas(64) float fa[kMaskBlock];
  alignas(64) float ff[fVec::size()];
  a.store(fa);
  b.store(fa + fVec::size());
  fill.store(ff);
  for (int64_t i = 0; i < kMaskBlock; ++i)
    if (src[i]) fa[i] = ff[0];
  a = fVec::loadu(fa);
  b = fVec::loadu(fa + fVec::size());
#endif
}

inline void apply_mask(const uint8_t* m, int64_t n, dVec& a, dVec& b, const dVec& fill) {
  alignas(64) double da[2 * dVec::size()];
  alignas(64) double df[dVec::size()];
  a.store(da);
  b.store(da + dVec::size());
  fill.store(df);
  for (int64_t i = 0; i < std::min<int64_t>(n, 2 * dVec::size()); ++i)
    if (m[i]) da[i] = df[0];
  a = dVec::loadu(da);
  b = dVec::loadu(da + dVec::size());
}

// Lanes whose mask byte is nonzero set to 0: the exp of a masked score, when that underflows
// (see softmax_exp_pass). Bitwise and-ing after the exp takes no multiply-add port, which the
// blend before it (apply_mask) does on AVX2, where the exp alone keeps those ports busy.
// (AVX-512 folds this into the exp itself: exp_block.)
inline void zero_masked(const uint8_t* m, int64_t n, fVec& a, fVec& b) {
#if defined(CPU_CAPABILITY_AVX2) && !defined(CPU_CAPABILITY_AVX512)
  alignas(16) uint8_t buf[kMaskBlock];
  const uint8_t* src = mask_block(m, n, buf);
  const __m128i keep = _mm_cmpeq_epi8(_mm_loadu_si128(reinterpret_cast<const __m128i*>(src)),
                                      _mm_setzero_si128());
  a = _mm256_and_ps(a, _mm256_castsi256_ps(_mm256_cvtepi8_epi32(keep)));
  b = _mm256_and_ps(b, _mm256_castsi256_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(keep, 8))));
#else
  apply_mask(m, n, a, b, fVec(0.0f));
#endif
}

inline void zero_masked(const uint8_t* m, int64_t n, dVec& a, dVec& b) {
  apply_mask(m, n, a, b, dVec(0.0));
}

// a, b = softmax_exp(a, b); with kZero and a mask (m, n bytes), lanes whose mask byte is set
// zeroed after it (see softmax_exp_pass). On AVX-512 the zeroing folds into the exp's own
// underflow mask: two mask tests a block, where zero_masked adds two moves.
template <bool kZero, typename V>
inline void exp_block(const uint8_t* m, int64_t n, V& a, V& b) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (kZero && std::is_same_v<V, fVec>) {
    if (m) {
      alignas(64) uint8_t buf[kMaskBlock];
      __mmask16 keep_lo, keep_hi;
      mask_lanes<false>(mask_block(m, n, buf), keep_lo, keep_hi);
      a = softmax_exp(a, keep_lo);
      b = softmax_exp(b, keep_hi);
      return;
    }
  }
#endif
  a = softmax_exp(a);
  b = softmax_exp(b);
  if (kZero && m) zero_masked(m, n, a, b);
}

// The first k lanes of a (0 <= k <= size), the rest from v. ATen's Vectorized::set switches on
// k (a jump that mispredicts when k changes from row to row, as in causal rows); AVX-512
// blends under a mask instead.
template <typename V>
inline V first_lanes(const V& a, const V& v, int64_t k) {
#if defined(CPU_CAPABILITY_AVX512)
  using E = typename V::value_type;
  const uint64_t keep = k >= V::size() ? ~uint64_t(0) : (uint64_t(1) << k) - 1;
  if constexpr (std::is_same_v<E, float>) return _mm512_mask_blend_ps(static_cast<__mmask16>(keep), v, a);
  if constexpr (std::is_same_v<E, int16_t>) return _mm512_mask_blend_epi16(static_cast<__mmask32>(keep), v, a);
#endif
  return k >= V::size() ? a : V::set(v, a, k);
}

// Lanes k.. of a block (a, b) set to v.
template <typename V>
inline void pad_lanes(V& a, V& b, int64_t k, const V& v) {
  a = first_lanes(a, v, k);
  b = first_lanes(b, v, std::max<int64_t>(k - V::size(), 0));
}

// The largest (kMax) or smallest lane of an int16 register, in log-step shuffles (a loop over
// the lanes was 8% of a 1024-wide bf16 softmax row).
template <bool kMax>
inline int16_t reduce_i16(const Vectorized<int16_t>& v) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  auto op = [](__m128i a, __m128i b) { return kMax ? _mm_max_epi16(a, b) : _mm_min_epi16(a, b); };
#if defined(CPU_CAPABILITY_AVX512)
  const __m512i x = v;
  const __m256i lo = _mm512_castsi512_si256(x), hi = _mm512_extracti64x4_epi64(x, 1);
  const __m256i y = kMax ? _mm256_max_epi16(lo, hi) : _mm256_min_epi16(lo, hi);
#else
  const __m256i y = v;
#endif
  __m128i m = op(_mm256_castsi256_si128(y), _mm256_extracti128_si256(y, 1));
  m = op(m, _mm_shuffle_epi32(m, 0x4E));  // 64-bit halves swapped
  m = op(m, _mm_shuffle_epi32(m, 0xB1));  // 32-bit pairs swapped
  m = op(m, _mm_shufflelo_epi16(m, 0xB1));  // 16-bit pairs swapped
  return static_cast<int16_t>(_mm_extract_epi16(m, 0));
#else
  alignas(64) int16_t lanes[Vectorized<int16_t>::size()];
  v.store(lanes);
  const int16_t* end = lanes + Vectorized<int16_t>::size();
  return kMax ? *std::max_element(lanes, end) : *std::min_element(lanes, end);
#endif
}

// row_max of 16-bit floats, on their bits as int16 (no widening): a float's bits read as a
// signed integer order the non-negative floats as floats, and the negative ones in reverse (sign
// and magnitude). So the largest integer is the largest float when it is >= 0 (some element is
// non-negative), and when every element is negative, the largest float (the smallest magnitude)
// is the smallest integer. A max and a min per block, where widening took four ops and the float
// max two more; the same max for every row without NaN (a row with one has a NaN sum either way).
// kNeg flips the sign bits first: the max of -x.
template <typename T, bool kNeg>
inline float row_max_bits(const T* __restrict x, int64_t L, int64_t n) {
  using IV = Vectorized<int16_t>;
  constexpr int64_t K = IV::size();
  static_assert(K == IO<T, float>::kWidth, "one int16 register per block");
  constexpr int16_t kLow = std::numeric_limits<int16_t>::min(), kHigh = std::numeric_limits<int16_t>::max();
  const int16_t* p = reinterpret_cast<const int16_t*>(x);
  const IV flip(kLow);  // 0x8000, the sign bit
  IV hi0(kLow), hi1(kLow), lo0(kHigh), lo1(kHigh);
  int64_t i = 0;
  for (; i + 2 * K <= L; i += 2 * K) {
    IV a = IV::loadu(p + i), b = IV::loadu(p + i + K);
    if constexpr (kNeg) { a = a ^ flip; b = b ^ flip; }
    hi0 = at::vec::maximum(hi0, a); lo0 = at::vec::minimum(lo0, a);
    hi1 = at::vec::maximum(hi1, b); lo1 = at::vec::minimum(lo1, b);
  }
  for (; i < L; i += K) {
    const int64_t k = std::min<int64_t>(K, L - i), kl = std::min<int64_t>(K, n - i);
    IV a = kl == K ? IV::loadu(p + i) : IV::loadu(p + i, kl);
    if constexpr (kNeg) a = a ^ flip;
    hi0 = at::vec::maximum(hi0, first_lanes(a, IV(kLow), k));
    lo0 = at::vec::minimum(lo0, first_lanes(a, IV(kHigh), k));
  }
  const int16_t top = reduce_i16<true>(at::vec::maximum(hi0, hi1));
  const int16_t bottom = reduce_i16<false>(at::vec::minimum(lo0, lo1));
  const int16_t bits = top >= 0 ? top : bottom;
  T v;
  std::memcpy(&v, &bits, sizeof(v));
  return static_cast<float>(v);
}

// max(x[0:L)) (kNeg: max(-x[0:L)) = -min), four accumulators; the block holding L is loaded
// whole when the row (n) has it. 16-bit rows: row_max_bits.
template <typename T, bool kNeg, typename PF>
inline acc_t<T> row_max(const T* __restrict x, int64_t L, int64_t n, PF& pf) {
  if constexpr (sizeof(T) == 2) return row_max_bits<T, kNeg>(x, L, n);  // steps no pf: kEarlyPrefetch
  using Acc = acc_t<T>;
  using V = Vectorized<Acc>;
  using IOT = IO<T, Acc>;
  constexpr int64_t K = IOT::kWidth;
  const V ninf(-std::numeric_limits<Acc>::infinity()), zero(Acc(0));
  V h0 = ninf, h1 = ninf, h2 = ninf, h3 = ninf, a, b, c, d;
  int64_t i = 0;
  for (; i + 2 * K <= L; i += 2 * K) {
    if constexpr (kEarlyPrefetch<T>) pf.step();
    IOT::load(x + i, a, b);
    IOT::load(x + i + K, c, d);
    if constexpr (kNeg) { a = zero - a; b = zero - b; c = zero - c; d = zero - d; }
    h0 = vmax(h0, a); h1 = vmax(h1, b); h2 = vmax(h2, c); h3 = vmax(h3, d);
  }
  for (; i < L; i += K) {
    const int64_t k = std::min<int64_t>(K, L - i), kl = std::min<int64_t>(K, n - i);
    if (kl == K) IOT::load(x + i, a, b); else IOT::load(x + i, kl, a, b);
    if constexpr (kNeg) { a = zero - a; b = zero - b; }
    if (k < K) pad_lanes(a, b, k, ninf);
    h0 = vmax(h0, a); h1 = vmax(h1, b);
  }
  const V h = at::vec::maximum(at::vec::maximum(h0, h1), at::vec::maximum(h2, h3));
  return at::vec::vec_reduce_all<Acc>([](V& p, V& q) { return at::vec::maximum(p, q); }, h);
}

// A finished row waiting for its normalized write, y[0:Lp) = buf[0:Lp) * inv and y[Lp:n) = 0.
// Its full blocks are written during the next row's exp pass (see softmax_fwd_kernel); `done`
// counts the elements written so far.
template <typename T>
struct PendingRow {
  T* y = nullptr;
  const acc_t<T>* buf = nullptr;
  acc_t<T> inv = 0;
  int64_t Lp = 0, n = 0, done = 0;
  bool interleave = false;  // its blocks may be written one by one (aligned, or not streaming)
};

// The normalized block j of a pending row.
template <typename T>
inline void pending_block(const PendingRow<T>& p, int64_t j, Vectorized<acc_t<T>>& a,
                          Vectorized<acc_t<T>>& b) {
  using V = Vectorized<acc_t<T>>;
  const V inv(p.inv);
  a = V::loadu(p.buf + j) * inv;
  b = V::loadu(p.buf + j + V::size()) * inv;
}

// The rest of a pending row: the blocks from `done` on, then the zeros after Lp.
template <typename T>
inline void finish_row(const PendingRow<T>& p, bool stream) {
  using Acc = acc_t<T>;
  using V = Vectorized<Acc>;
  write_blocks<T, Acc, LayerIO<T, Acc>>(p.y + p.done, p.Lp - p.done, stream, [&](int64_t j, int64_t, V& a, V& b) {
    pending_block(p, p.done + j, a, b);
  });
  write_zeros<T, Acc, LayerIO<T, Acc>>(p.y + p.Lp, p.n - p.Lp, stream);
}

// Pass 2 of a row: buf = exp(x * scale - shift) over [0, L), masked lanes exp(-10000 - shift),
// lanes past L (to the end of L's block) zero; returns the sum. The block holding L is loaded
// whole when the row (n) has it: no partial (memcpy) load in causal rows. Steps the next row's
// prefetch (pf; its mask row mn here), and writes the pending row's full blocks as it goes
// (pend, may be null): the streaming stores of one row drain while the exp of the next keeps
// the arithmetic busy.
// kZero: masked lanes are zeroed after the exp instead of set to -10000 - shift before it, the
// same values whenever exp(-10000 - shift) underflows to 0 (the caller checks).
template <typename T, bool kZero, typename PF>
inline acc_t<T> softmax_exp_pass(const T* __restrict x, const uint8_t* __restrict mask,
                                 acc_t<T>* __restrict buf, int64_t L, int64_t n, acc_t<T> scale,
                                 acc_t<T> shift, PF& pf, const uint8_t* mn,
                                 PendingRow<T>* pend, bool stream) {
  using Acc = acc_t<T>;
  using V = Vectorized<Acc>;
  using IOT = IO<T, Acc>;
  constexpr int64_t K = IOT::kWidth;
  const V vs(scale), vm(-shift), fill(static_cast<Acc>(kMaskedValue) - shift);
  const V ninf(-std::numeric_limits<Acc>::infinity());
  const int64_t pend_end = pend && pend->interleave ? pend->Lp / K * K : 0;
  T* const py = pend ? pend->y : nullptr;
  V s0(Acc(0)), s1(Acc(0)), a, b, c, d;
  int64_t j = 0;
  for (; j + K <= L; j += K) {
    pf.step();
    if (mn && j % 64 == 0) prefetch_next(mn + j);
    IOT::load(x + j, a, b);
    a = at::vec::fmadd(a, vs, vm); b = at::vec::fmadd(b, vs, vm);
    if (mask && !kZero) apply_mask(mask + j, K, a, b, fill);
    exp_block<kZero>(mask ? mask + j : nullptr, K, a, b);
    a.store(buf + j); b.store(buf + j + V::size());
    s0 = s0 + a; s1 = s1 + b;
    if (j < pend_end) {
      pending_block(*pend, j, c, d);
      if (stream) LayerIO<T, Acc>::stream(py + j, c, d); else LayerIO<T, Acc>::store(py + j, c, d);
    }
  }
  if (pend) pend->done = std::min(j, pend_end);
  if (j < L) {
    const int64_t k = L - j, kl = std::min<int64_t>(K, n - j);
    if (kl == K) IOT::load(x + j, a, b); else IOT::load(x + j, kl, a, b);
    a = at::vec::fmadd(a, vs, vm); b = at::vec::fmadd(b, vs, vm);
    if (mask && !kZero) apply_mask(mask + j, k, a, b, fill);
    pad_lanes(a, b, k, ninf);  // exp(-inf) = 0
    exp_block<kZero>(mask ? mask + j : nullptr, k, a, b);
    a.store(buf + j); b.store(buf + j + V::size());
    s0 = s0 + a; s1 = s1 + b;
  }
  return static_cast<Acc>(hsum(s0 + s1));
}

// One row: buf[0:L) = exp(x[0:L) * scale - shift, masked), zero to the end of L's block; returns
// the sum (the caller writes y = buf / sum). Finishes the pending row (pend, may be null).
//
// Pass 1 reads the row from memory and finds its largest (smallest for scale < 0) element: the
// shift m = max(x * scale) follows without the mask, and with a mask m' = max(m, -10000) is an
// upper bound of the masked row's max. Pass 2 (in cache) computes e = exp(x * scale - m') with
// masked lanes at -10000 - m' into the fp32 scratch row and sums it. Softmax does not depend on
// the shift, and an upper bound is exact unless it lies far above the masked max (the unmasked
// entries underflow): when the sum is below 2^-20 (m' more than 13.9 above it, e.g. a fully
// masked row, or +inf at a masked position) or NaN (a masked NaN) pass 2 runs again with the
// exact masked max.
template <typename T, typename PF>
inline acc_t<T> softmax_row(const T* x, const uint8_t* mask, int64_t L, int64_t n, acc_t<T> scale,
                            acc_t<T>* buf, PF& pf, const uint8_t* mn, PendingRow<T>* pend,
                            bool stream) {
  using Acc = acc_t<T>;
  using V = Vectorized<Acc>;
  using IOT = IO<T, Acc>;
  constexpr int64_t K = IOT::kWidth;
  const V ninf(-std::numeric_limits<Acc>::infinity());
  V a, b;
  auto vmax_all = [](const V& v) {
    return at::vec::vec_reduce_all<Acc>([](V& p, V& q) { return at::vec::maximum(p, q); }, v);
  };
  Acc shift = scale >= Acc(0) ? row_max<T, false>(x, L, n, pf) * scale : -row_max<T, true>(x, L, n, pf) * scale;
  if (mask) shift = std::max(shift, static_cast<Acc>(kMaskedValue));
  // exp(-10000 - shift) is exactly 0 (fp32 and fp64) when -10000 - shift < -800
  const bool zero = mask && static_cast<Acc>(kMaskedValue) - shift < Acc(-800);
  Acc sum = zero ? softmax_exp_pass<T, true>(x, mask, buf, L, n, scale, shift, pf, mn, pend, stream)
                 : softmax_exp_pass<T, false>(x, mask, buf, L, n, scale, shift, pf, mn, pend, stream);
  pf.finish();
  if (pend) finish_row(*pend, stream);
  // rare: the exact masked max. Also when the sum is NaN: the unmasked bound saw a NaN or
  // +inf score at a masked position, which the mask ignores (Apex selects -10000 there).
  if (mask && !(sum >= Acc(1.0 / (1 << 20)))) {
    const V vs(scale), fill(static_cast<Acc>(kMaskedValue));
    V m0 = ninf, m1 = ninf;
    for (int64_t j = 0; j < L; j += K) {
      const int64_t k = std::min<int64_t>(K, L - j);
      if (k == K) IOT::load(x + j, a, b); else IOT::load(x + j, k, a, b);
      a = a * vs; b = b * vs;
      apply_mask(mask + j, k, a, b, fill);
      if (k < K) pad_lanes(a, b, k, ninf);
      m0 = at::vec::maximum(m0, a); m1 = at::vec::maximum(m1, b);
    }
    PF none(nullptr, nullptr, 0);
    sum = softmax_exp_pass<T, false>(x, mask, buf, L, n, scale,
                                     vmax_all(at::vec::maximum(m0, m1)), none, nullptr, nullptr,
                                     stream);
  }
  return sum;
}

// Rows of length sk; mask rows found through (b, h, i) strides (mask last dim contiguous).
struct MaskView {
  const uint8_t* data = nullptr;
  int64_t heads = 1, sq = 1, sb = 0, sh = 0, si = 0;
  const uint8_t* row(int64_t r) const {
    if (!data) return nullptr;
    const int64_t i = r % sq, h = (r / sq) % heads, b = r / (sq * heads);
    return data + b * sb + h * sh + i * si;
  }
  // The row the forward visits k-th: in memory order, except under a mask shared by the heads
  // ([b, 1, sq, sk]), where the heads' rows (b, h, i) follow each other for each (b, i), so the
  // mask row is read from memory once and from cache for the other heads (the memory order
  // reads the whole mask once per head: 8192 x 4096 bf16 scores in 4 heads, 160 MiB of traffic
  // instead of 136).
  int64_t order(int64_t k) const {
    if (!data || sh != 0 || heads == 1) return k;
    const int64_t u = k / heads, h = k % heads, b = u / sq, i = u % sq;
    return (b * heads + h) * sq + i;
  }
};

// Each thread keeps two scratch rows: row r's exponentials are normalized and written while row
// r + 1's are computed (software pipelining), so the output's streaming stores overlap the exp
// arithmetic instead of following it.
template <typename T>
void softmax_fwd_kernel(const T* X, T* Y, int64_t rows, int64_t sk, double scale, const MaskView& mv,
                        bool causal, int64_t sq, bool zero_all_masked, bool stream) {
  using Acc = acc_t<T>;
  constexpr int64_t K = IO<T, Acc>::kWidth;
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(sk, 1));
  at::parallel_for(0, rows, grain, [&](int64_t k0, int64_t k1) {
    const int64_t width = ((sk + K - 1) / K) * K + K;
    std::vector<Acc> bufs(2 * width);
    Acc* cur = bufs.data();
    Acc* prev = cur + width;
    PendingRow<T> pend;
    bool pending = false;
    const int64_t skip = rows_ahead(sk * static_cast<int64_t>(sizeof(T)));
    // this row and its mask row, found as the next one during the previous row
    int64_t r = mv.order(k0);
    const uint8_t* mrow = mv.row(r);
    for (int64_t k = k0; k < k1; ++k) {
      const bool next = k + 1 < k1;
      const int64_t rn = next ? mv.order(k + 1) : 0;
      const uint8_t* mnext = next ? mv.row(rn) : nullptr;
      const int64_t L = causal ? std::min<int64_t>(r % sq + 1, sk) : sk;
      Acc sum;
      if (zero_all_masked && mrow && std::memchr(mrow, 0, sk) == nullptr) {
        // every position masked: the row attends to nothing (Apex's generic kernel)
        if (pending) finish_row(pend, stream);
        std::fill(cur, cur + width, Acc(0));
        sum = Acc(1);
      } else {
        // a later row's reads (its first L + 1 when causal), prefetched over this row's passes
        const bool ahead = k + skip < k1;
        const int64_t ra = ahead ? mv.order(k + skip) : 0;
        const int64_t La = causal ? std::min<int64_t>(ra % sq + 1, sk) : sk;
        RowPrefetch<1, kBlockStep<T>> pf(ahead ? X + ra * sk : nullptr, nullptr,
                                          La * static_cast<int64_t>(sizeof(T)));
        sum = softmax_row<T>(X + r * sk, mrow, L, sk, static_cast<Acc>(scale), cur, pf, mnext,
                             pending ? &pend : nullptr, stream);
      }
      T* y = Y + r * sk;
      pend = {y, cur, static_cast<Acc>(1.0 / static_cast<double>(sum)),
              std::min<int64_t>(sk, (L + K - 1) / K * K), sk, 0,  // buf is 0 in [L, Lp)
              !stream || align_head(y, sk) == 0};
      pending = true;
      std::swap(cur, prev);
      r = rn;
      mrow = mnext;
    }
    if (pending) finish_row(pend, stream);
    if (stream) stream_fence();
  });
}

template <typename T>
void softmax_bwd_kernel(const T* DY, const T* Y, T* DX, int64_t rows, int64_t sk, double scale,
                        bool causal, int64_t sq, bool stream) {
  using Acc = acc_t<T>;
  using V = Vectorized<Acc>;
  using IOT = IO<T, Acc>;
  constexpr int64_t K = IOT::kWidth;
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(sk, 1));
  const int64_t skip = rows_ahead(2 * sk * static_cast<int64_t>(sizeof(T)));  // dy and y
  // Where a later row's prefetch steps. A causal row writes all sk outputs after reading L
  // inputs: stepped in its dot pass (as a full fp32 row is), the next rows' reads were all
  // issued before the write pass and the zeros after L, which then ran as a write-only phase
  // (streaming stores alone reach 57% of the add at 1 thread on an AMD EPYC Zen 1, reads and
  // stores together 91%). So a causal fp32 row steps it over its write pass and its zeros
  // instead: 32768 x 1024 fp32 at 1 thread 68-76% -> 79-85% of the add, 8192 x 4096 66-71% ->
  // 75-78%; at 2 threads 80-84% -> 83-86% (`mpnb bench layers`, five and two runs each).
  // 16-bit rows step in the write pass only (kEarlyPrefetch); over their zeros too they
  // measured slower (27-28% -> 24-26%).
  // The step is half a block (kSpreadStep): a plain fp32 row steps once per block in both of
  // its passes, a causal one two steps at once per block in its write pass and its zeros.
  const bool dot_steps = kEarlyPrefetch<T> && !causal;
  const bool zero_steps = kEarlyPrefetch<T> && causal;
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    V g0, g1, y0, y1;
    for (int64_t r = r0; r < r1; ++r) {
      const T* dy = DY + r * sk;
      const T* y = Y + r * sk;
      T* dx = DX + r * sk;
      const int64_t L = causal ? std::min<int64_t>(r % sq + 1, sk) : sk;
      const int64_t ra = r + skip;
      const bool ahead = ra < rows;
      const int64_t La = causal ? std::min<int64_t>(ra % sq + 1, sk) : sk;
      const int64_t Lp = std::min<int64_t>(sk, (L + K - 1) / K * K);
      // a later row's dy and y, prefetched over this row's two passes
      RowPrefetch<2, kSpreadStep<T>> pf(ahead ? DY + ra * sk : nullptr, ahead ? Y + ra * sk : nullptr,
                                         La * static_cast<int64_t>(sizeof(T)));
      auto write_step = [&]() C10_ALWAYS_INLINE_ATTRIBUTE {
        if constexpr (kEarlyPrefetch<T>) {
          if (causal) pf.template step<2>();
          else pf.step();
        } else {
          pf.step();
        }
      };
      V d0(Acc(0)), d1(Acc(0));
      int64_t i = 0;
      for (; i + K <= L; i += K) {
        if (dot_steps) pf.step();
        IOT::load(dy + i, g0, g1); IOT::load(y + i, y0, y1);
        d0 = at::vec::fmadd(g0, y0, d0); d1 = at::vec::fmadd(g1, y1, d1);
      }
      const V zero(Acc(0));
      if (i < L) {  // the block holding L, whole when the row has it; lanes from L zeroed
        const int64_t kl = std::min<int64_t>(K, sk - i);
        if (kl == K) { IOT::load(dy + i, g0, g1); IOT::load(y + i, y0, y1); }
        else { IOT::load(dy + i, kl, g0, g1); IOT::load(y + i, kl, y0, y1); }
        pad_lanes(g0, g1, L - i, zero); pad_lanes(y0, y1, L - i, zero);
        d0 = at::vec::fmadd(g0, y0, d0); d1 = at::vec::fmadd(g1, y1, d1);
      }
      const V dot(static_cast<Acc>(hsum(d0 + d1))), vs(static_cast<Acc>(scale));
      write_blocks<T, Acc, LayerIO<T, Acc>>(dx, Lp, stream, [&](int64_t j, int64_t n, V& p, V& q) {
        write_step();
        if (n == K) { IOT::load(dy + j, g0, g1); IOT::load(y + j, y0, y1); }
        else { IOT::load(dy + j, n, g0, g1); IOT::load(y + j, n, y0, y1); }
        if (j + K > L) {  // lanes from L on (a block past L only after an unaligned head)
          const int64_t k = std::max<int64_t>(L - j, 0);
          pad_lanes(g0, g1, k, zero); pad_lanes(y0, y1, k, zero);
        }
        p = vs * (y0 * (g0 - dot)); q = vs * (y1 * (g1 - dot));
      });
      if (zero_steps) write_zeros<T, Acc, LayerIO<T, Acc>>(dx + Lp, sk - Lp, stream, write_step);
      else write_zeros<T, Acc, LayerIO<T, Acc>>(dx + Lp, sk - Lp, stream);
      pf.finish();
    }
    if (stream) stream_fence();
  });
}

// ---- entry points ------------------------------------------------------------------------

void check_softmax_input(const at::Tensor& x, int64_t min_dim, const char* op) {
  TORCH_CHECK_TYPE(is_float_type(x.scalar_type()), op, ": dtype of input");
  TORCH_CHECK_VALUE(x.dim() >= min_dim, op, ": dims of input");
}

// A bool/uint8 mask [b or 1, np or 1, sq, sk] for [b, np, sq, sk] scores (true = masked out).
void check_mask(const at::Tensor& x, const at::Tensor& mask, const char* op) {
  TORCH_CHECK_VALUE(x.dim() == 4, op, ": input is not [b, np, sq, sk]");
  TORCH_CHECK_TYPE(mask.scalar_type() == at::kBool || mask.scalar_type() == at::kByte, op, ": dtype of mask");
  const bool fits = mask.dim() == 4 && (mask.size(0) == 1 || mask.size(0) == x.size(0)) &&
                    (mask.size(1) == 1 || mask.size(1) == x.size(1)) && mask.size(2) == x.size(2) &&
                    mask.size(3) == x.size(3);
  TORCH_CHECK_VALUE(fits, op, ": shape of mask");
  TORCH_CHECK_VALUE(mask.device() == x.device(), op, ": device of mask");
}

// The forward of every variant, after its checks (mask: checked by check_mask).
at::Tensor softmax_fwd(const at::Tensor& input, const std::optional<at::Tensor>& mask, double scale,
                       bool causal, bool zero_all_masked = false) {
  const auto x = input.contiguous();
  auto y = empty_output_like(x);
  const int64_t sk = x.dim() ? x.size(-1) : 1;
  const int64_t sq = x.dim() >= 2 ? x.size(-2) : 1;
  const int64_t rows = sk ? x.numel() / sk : 0;
  MaskView mv;
  at::Tensor m;
  if (mask.has_value()) {
    m = mask->contiguous().expand(x.sizes());
    mv = {reinterpret_cast<const uint8_t*>(m.const_data_ptr()), x.size(1), sq, m.stride(0), m.stride(1),
          m.stride(2)};
  }
  if (rows == 0) return y;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, x.scalar_type(), "mpnb", [&] {
    using T = scalar_t;
    softmax_fwd_kernel<T>(x.const_data_ptr<T>(), y.mutable_data_ptr<T>(), rows, sk, scale, mv, causal, sq,
                          zero_all_masked, stream_into(y));
  });
  return y;
}

at::Tensor scaled_softmax_fwd_cpu(const at::Tensor& input, double scale) {
  check_softmax_input(input, 1, "mpnb::scaled_softmax_fwd");
  return softmax_fwd(input, std::nullopt, scale, false);
}

at::Tensor scaled_masked_softmax_fwd_cpu(const at::Tensor& input, const at::Tensor& mask, double scale,
                                         bool zero_all_masked) {
  const char* op = "mpnb::scaled_masked_softmax_fwd";
  check_softmax_input(input, 1, op);
  check_mask(input, mask, op);  // four dims, and a mask that fits them
  return softmax_fwd(input, mask, scale, false, zero_all_masked);
}

at::Tensor scaled_upper_triang_masked_softmax_fwd_cpu(const at::Tensor& input, double scale) {
  const char* op = "mpnb::scaled_upper_triang_masked_softmax_fwd";
  check_softmax_input(input, 2, op);
  TORCH_CHECK_VALUE(input.size(-2) == input.size(-1), op, ": scores are not square");
  return softmax_fwd(input, std::nullopt, scale, true);
}

at::Tensor scaled_softmax_bwd_cpu(const at::Tensor& grad_out, const at::Tensor& output, double scale,
                                  bool upper_triang) {
  const char* op = "mpnb::scaled_softmax_bwd";
  check_softmax_input(output, upper_triang ? 2 : 1, op);
  TORCH_CHECK_VALUE(grad_out.sizes() == output.sizes() && grad_out.scalar_type() == output.scalar_type(),
                    op, ": grad_out does not match output");
  const auto dy = grad_out.contiguous(), y = output.contiguous();
  auto dx = empty_output_like(y);
  const int64_t sk = y.dim() ? y.size(-1) : 1;
  const int64_t sq = y.dim() >= 2 ? y.size(-2) : 1;
  const int64_t rows = sk ? y.numel() / sk : 0;
  if (rows == 0) return dx;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, y.scalar_type(), "mpnb", [&] {
    using T = scalar_t;
    softmax_bwd_kernel<T>(dy.const_data_ptr<T>(), y.const_data_ptr<T>(), dx.mutable_data_ptr<T>(), rows,
                          sk, scale, upper_triang, sq, stream_into(dx));
  });
  return dx;
}

}  // namespace
}  // namespace mpnb::cpu

TORCH_LIBRARY_IMPL(mpnb, CPU, m) {
  m.impl("scaled_softmax_fwd", &mpnb::cpu::scaled_softmax_fwd_cpu);
  m.impl("scaled_masked_softmax_fwd", &mpnb::cpu::scaled_masked_softmax_fwd_cpu);
  m.impl("scaled_upper_triang_masked_softmax_fwd", &mpnb::cpu::scaled_upper_triang_masked_softmax_fwd_cpu);
  m.impl("scaled_softmax_bwd", &mpnb::cpu::scaled_softmax_bwd_cpu);
}
