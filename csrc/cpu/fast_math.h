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
// The same code with AVX2 and AVX-512 (16 lanes); other builds use ATen's exp_u20. fp64 uses
// ATen's exp (Sleef, 1 ulp).
//
// Also here: empty_output_like, the output allocation of the layer kernels (norm_common.h,
// softmax.cpp).
#pragma once

#include <ATen/ATen.h>
#include <ATen/cpu/vec/vec.h>

#include <cstdint>

#if defined(__linux__)
#include <sys/mman.h>
#endif

namespace mpnb::cpu {

inline at::vec::Vectorized<double> softmax_exp(const at::vec::Vectorized<double>& x) {
  return x.exp();
}

inline at::vec::Vectorized<float> softmax_exp(const at::vec::Vectorized<float>& x) {
#if defined(CPU_CAPABILITY_AVX512)
  // The AVX2 code below on 16 lanes: the same operations, so the same result bit for bit.
  const __m512 v = x;
  const __m512 table = _mm512_setr_ps(  // 2^(j/8), twice: the index's 4th bit is ignored
      1.0f, 1.0905077326652577f, 1.1892071150027210f, 1.2968395546510096f, 1.4142135623730951f,
      1.5422108254079407f, 1.6817928305074290f, 1.8340080864093424f, 1.0f, 1.0905077326652577f,
      1.1892071150027210f, 1.2968395546510096f, 1.4142135623730951f, 1.5422108254079407f,
      1.6817928305074290f, 1.8340080864093424f);
  const __m512 magic = _mm512_set1_ps(12582912.0f);
  const __m512 t = _mm512_fmadd_ps(v, _mm512_set1_ps(11.541560327111707f), magic);
  const __m512 n = _mm512_sub_ps(t, magic);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f / 8), v);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f / 8), r);
  const __m512i ti = _mm512_castps_si512(t);
  const __m512i k = _mm512_and_si512(_mm512_slli_epi32(ti, 20), _mm512_set1_epi32(int(0xFF800000u)));
  const __m512 scale = _mm512_castsi512_ps(
      _mm512_add_epi32(_mm512_castps_si512(_mm512_permutexvar_ps(ti, table)), k));
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(0.16666874f), r, _mm512_set1_ps(0.50006455f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_mul_ps(p, r);
  const __m512 y = _mm512_fmadd_ps(p, scale, scale);
  const __mmask16 tiny = _mm512_cmp_ps_mask(v, _mm512_set1_ps(-87.33654475f), _CMP_LT_OQ);
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~tiny), y);
#elif defined(CPU_CAPABILITY_AVX2)
  const __m256 v = x;
  // 2^(j/8), j = 0..7, each rounded to nearest fp32
  const __m256 table = _mm256_setr_ps(1.0f, 1.0905077326652577f, 1.1892071150027210f,
                                      1.2968395546510096f, 1.4142135623730951f, 1.5422108254079407f,
                                      1.6817928305074290f, 1.8340080864093424f);
  const __m256 magic = _mm256_set1_ps(12582912.0f);  // 1.5 * 2^23: round to integer
  const __m256 t = _mm256_fmadd_ps(v, _mm256_set1_ps(11.541560327111707f), magic);  // 8 / ln 2
  const __m256 n = _mm256_sub_ps(t, magic);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f / 8), v);  // ln2/8, high part exact
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f / 8), r);
  // t's low mantissa bits hold n (two's complement): its low 3 bits pick the table entry, the
  // rest (shifted into the exponent field) is k.
  const __m256i ti = _mm256_castps_si256(t);
  const __m256i k = _mm256_and_si256(_mm256_slli_epi32(ti, 20), _mm256_set1_epi32(int(0xFF800000u)));
  const __m256 scale = _mm256_castsi256_ps(
      _mm256_add_epi32(_mm256_castps_si256(_mm256_permutevar8x32_ps(table, ti)), k));
  __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(0.16666874f), r, _mm256_set1_ps(0.50006455f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_mul_ps(p, r);  // e^r - 1
  const __m256 y = _mm256_fmadd_ps(p, scale, scale);
  const __m256 tiny = _mm256_cmp_ps(v, _mm256_set1_ps(-87.33654475f), _CMP_LT_OQ);
  return _mm256_andnot_ps(tiny, y);
#else
  return x.exp_u20();
#endif
}

// A contiguous output like x. Outputs of 16 MiB or more ask the kernel for transparent huge
// pages (madvise MADV_HUGEPAGE on the whole 2 MiB pages inside the buffer, what c10's
// THP_MEM_ALLOC_ENABLE=1 does for every large CPU allocation): a fresh buffer from mmap is then
// faulted in 2 MiB at a time instead of 4 KiB (128 MiB: 64 faults instead of 32768, ~10x less
// time in the kernel). Memory the allocator reuses is already backed; the advice changes nothing
// there. No effect where THP is "never"; only a hint, never an error.
inline at::Tensor empty_output_like(const at::Tensor& x) {
  auto y = at::empty_like(x, at::MemoryFormat::Contiguous);
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t(2) << 20;
  const uintptr_t bytes = static_cast<uintptr_t>(y.nbytes());
  if (bytes >= (uintptr_t(16) << 20)) {
    const uintptr_t p = reinterpret_cast<uintptr_t>(y.data_ptr());
    const uintptr_t a = (p + kHuge - 1) & ~(kHuge - 1), e = (p + bytes) & ~(kHuge - 1);
    if (e > a) (void)madvise(reinterpret_cast<void*>(a), e - a, MADV_HUGEPAGE);
  }
#endif
  return y;
}

}  // namespace mpnb::cpu
