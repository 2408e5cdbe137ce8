// Vectorized exp for kernels whose arguments are at most ~0 (softmax after max subtraction).
//
// softmax_exp(x) = 2^k * 2^(j/8) * e^r with n = 8k + j = round(8 x / ln 2) and r = x - n ln2/8
// (Cody-Waite, two steps; |r| <= ln2/16). 2^(j/8) comes from an 8-entry table held in one
// register (one vpermps, indexed by the low bits of n), 2^k is added into its exponent field,
// and e^r - 1 = r (1 + c2 r + c3 r^2) is a degree-3 polynomial fitted for relative error on
// [-ln2/16, ln2/16] (2.6e-8); the result is t + t (e^r - 1) with t = 2^k 2^(j/8), one rounding.
// Error: at most 1.15 ulp of the correctly rounded exp on [-87.33, 0] (measured against fp64
// exp at every float in [-1, 0] and every 7th below). Below ln(FLT_MIN) = -87.33 (and for -inf)
// the result is exactly 0, not a subnormal, as ATen's exp_u20 does; NaN propagates. Arguments
// above ~88.7 are not supported (the softmax kernels never pass them: x - max(x) <= 0).
// 7 multiply-add-pipe ops per register (the limit of the softmax forward on AVX2) against 11
// for a degree-6 polynomial on [-ln2/2, ln2/2], ~15 for exp_u20 and ~30 for Sleef's 1-ulp exp.
// fp64 uses ATen's exp (Sleef, 1 ulp).
//
// Also here: empty_output_like, the output allocation of the layer kernels (norm_common.h,
// softmax.cpp; large outputs come from the output cache, output_cache.h), and stream_into,
// their choice of stores for it.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cpu/vec/vec.h>

#include <cstdint>

#include "cpu/output_cache.h"
#include "cpu/vec_io.h"

#if defined(__linux__)
#include <sys/mman.h>
#include <unistd.h>
#endif

namespace mpnb::cpu {

inline at::vec::Vectorized<double> softmax_exp(const at::vec::Vectorized<double>& x) {
  return x.exp();
}

#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
namespace exp_detail {

using fV = at::vec::Vectorized<float>;

// 2^(j/8), j = 0..7, each rounded to nearest fp32, as bits less j << 20: scale_of adds n << 20
// to an entry, whose bits 20-22 (j) the table takes back, leaving k = n >> 3 in the exponent
// field. (Built from constants, so the compiler keeps the register out of the row loops.)
C10_ALWAYS_INLINE __m256 two_to_eighths() {
  return _mm256_castsi256_ps(_mm256_setr_epi32(0x3f800000, 0x3f7b95c2, 0x3f7837f0, 0x3f75fed7,
                                               0x3f7504f3, 0x3f75672a, 0x3f7744fd, 0x3f7ac0c7));
}

// t's low mantissa bits hold n = 8k + j (two's complement): its low 3 bits pick an entry from
// the table (one permute), and t << 20 (n << 20 mod 2^32) added to it gives the bits of
// 2^(j/8) * 2^k: the j << 20 the sum adds cancels the entry's, the rest is k in the exponent
// field. Exactly the bits of 2^(j/8) with k added to its exponent, one integer op fewer than
// masking k out of t << 20 first.
C10_ALWAYS_INLINE fV scale_of(const fV& t) {
#if defined(CPU_CAPABILITY_AVX512)
  const __m512 table = _mm512_broadcast_f32x8(two_to_eighths());  // index bit 3 ignored
  const __m512i ti = _mm512_castps_si512(t);
  return _mm512_castsi512_ps(_mm512_add_epi32(_mm512_castps_si512(_mm512_permutexvar_ps(ti, table)),
                                              _mm512_slli_epi32(ti, 20)));
#else
  const __m256i ti = _mm256_castps_si256(t);
  const __m256 entry = _mm256_permutevar8x32_ps(two_to_eighths(), ti);
  return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(entry), _mm256_slli_epi32(ti, 20)));
#endif
}

// y, with 0 in the lanes where x < lo (not where x is NaN: the NaN propagates).
C10_ALWAYS_INLINE fV zero_below(const fV& y, const fV& x, float lo) {
#if defined(CPU_CAPABILITY_AVX512)
  const __mmask16 below = _mm512_cmp_ps_mask(x, _mm512_set1_ps(lo), _CMP_LT_OQ);
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~below), y);
#else
  return _mm256_andnot_ps(_mm256_cmp_ps(x, _mm256_set1_ps(lo), _CMP_LT_OQ), y);
#endif
}

// Below ln(FLT_MIN) the result is 0.
constexpr float kLow = -87.33654475f;

// The exp before the underflow to 0.
C10_ALWAYS_INLINE fV unclamped(const fV& x) {
  using at::vec::fmadd;
  using at::vec::fnmadd;
  const fV magic(12582912.0f);                            // 1.5 * 2^23: round to integer
  const fV t = fmadd(x, fV(11.541560327111707f), magic);  // 8 / ln 2
  const fV n = t - magic;
  fV r = fnmadd(n, fV(0.693359375f / 8), x);  // ln2/8, high part exact
  r = fnmadd(n, fV(-2.12194440e-4f / 8), r);
  const fV scale = scale_of(t);
  fV p = fmadd(fV(0.16666874f), r, fV(0.50006455f));
  p = fmadd(p, r, fV(1.0f));
  p = p * r;  // e^r - 1
  return fmadd(p, scale, scale);
}

}  // namespace exp_detail
#endif

// One algorithm for AVX2 and AVX-512 (8 or 16 lanes, the same result bit for bit); only the
// table lookup and the underflow mask are written per width. Other builds: ATen's exp_u20.
// Forced inline: left out of line, the masked softmax forward ran 15% slower.
C10_ALWAYS_INLINE at::vec::Vectorized<float> softmax_exp(const at::vec::Vectorized<float>& x) {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  return exp_detail::zero_below(exp_detail::unclamped(x), x, exp_detail::kLow);
#else
  return x.exp_u20();
#endif
}

#if defined(CPU_CAPABILITY_AVX512)
// softmax_exp(x) in the lanes of `keep` and 0 in the others (the masked softmax's masked
// lanes): the zeroing rides on the underflow mask's compare, no op of its own.
C10_ALWAYS_INLINE at::vec::Vectorized<float> softmax_exp(const at::vec::Vectorized<float>& x,
                                                         __mmask16 keep) {
  const __mmask16 k = _mm512_mask_cmp_ps_mask(keep, x, _mm512_set1_ps(exp_detail::kLow), _CMP_NLT_UQ);
  return _mm512_maskz_mov_ps(k, exp_detail::unclamped(x));
}
#endif

// Ask the kernel for transparent huge pages for a fresh output y of 16 MiB or more: madvise
// MADV_HUGEPAGE on the whole 2 MiB pages inside its memory (what c10's THP_MEM_ALLOC_ENABLE=1
// does for every large CPU allocation). A fresh buffer from mmap is then faulted in 2 MiB at a
// time instead of 4 KiB (128 MiB: 64 faults instead of 32768, ~10x less time in the kernel).
// Memory the allocator reuses is already backed; the advice changes nothing there. No effect
// where THP is "never"; only a hint, never an error. y must be dense (its bytes contiguous).
inline void advise_huge_pages(const at::Tensor& y) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t(2) << 20;
  const uintptr_t bytes = static_cast<uintptr_t>(y.nbytes());
  if (bytes >= (uintptr_t(16) << 20)) {
    const uintptr_t p = reinterpret_cast<uintptr_t>(y.const_data_ptr());
    const uintptr_t a = (p + kHuge - 1) & ~(kHuge - 1), e = (p + bytes) & ~(kHuge - 1);
    if (e > a) (void)madvise(reinterpret_cast<void*>(a), e - a, MADV_HUGEPAGE);
  }
#else
  (void)y;
#endif
}

// A contiguous output like x: from the output cache when large (output_cache.h: memory an
// earlier output gave back, already backed), else fresh with huge pages advised.
inline at::Tensor empty_output_like(const at::Tensor& x) {
  if (cacheable(x.nbytes())) return cached_empty(x.sizes(), x.options());
  auto y = at::empty_like(x, at::MemoryFormat::Contiguous);
  advise_huge_pages(y);
  return y;
}

// True when the memory of [p, p + bytes) is backed now (sampled: its first and last whole
// pages), false for a buffer fresh from mmap. Where the answer is not known: true.
inline bool pages_backed(const void* p, size_t bytes) {
#if defined(__linux__)
  const long page_size = sysconf(_SC_PAGESIZE);
  if (page_size <= 0) return true;
  const uintptr_t page = static_cast<uintptr_t>(page_size);
  const uintptr_t a = (reinterpret_cast<uintptr_t>(p) + page - 1) & ~(page - 1);
  const uintptr_t e = (reinterpret_cast<uintptr_t>(p) + bytes) & ~(page - 1);
  if (e <= a) return true;
  unsigned char first = 1, last = 1;
  if (mincore(reinterpret_cast<void*>(a), page, &first) != 0) return true;
  if (mincore(reinterpret_cast<void*>(e - page), page, &last) != 0) return true;
  return (first & 1) && (last & 1);
#else
  (void)p;
  (void)bytes;
  return true;
#endif
}

// Whether a layer kernel writes its output y with streaming stores: y is large (see
// stream_output) and its pages are already backed (memory the allocator reuses). A fresh
// buffer is faulted in by the kernel's first write to each page, and the OS zeroes the page
// then, which leaves its lines in cache: ordinary stores hit them, streaming stores write every
// line to memory a second time (measured, 1 thread, 8192 x 4096 layer norm forward: 16% faster
// into a fresh output with ordinary stores, 21% slower into a backed one).
inline bool stream_into(const at::Tensor& y) {
  return static_cast<int64_t>(y.nbytes()) >= kStreamMinBytes && pages_backed(y.const_data_ptr(), y.nbytes());
}

}  // namespace mpnb::cpu
