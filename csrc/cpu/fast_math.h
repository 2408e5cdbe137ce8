// Vectorized exp for kernels whose arguments are at most ~0 (softmax after max subtraction).
//
// softmax_exp(x) = 2^n * p(r), n = round(x / ln 2), r = x - n ln 2 (Cody-Waite, two steps),
// p a degree-6 polynomial fitted for relative error on [-ln2/2, ln2/2]. Error: at most ~1.3 ulp
// of the correctly rounded exp on [-87.33, 0] (measured against fp64 exp on 2M points). Below
// ln(FLT_MIN) = -87.33 (and for -inf) the result is exactly 0, not a subnormal, as ATen's
// exp_u20 does; NaN propagates. Arguments above ~88.7 are not supported (the softmax kernels
// never pass them: x - max(x) <= 0). 15 vector ops per register against ~20 for exp_u20 (whose
// degree-5 polynomial is good to ~2.3 ulp) and ~40 for Sleef's 1-ulp exp.
// fp64 uses ATen's exp (Sleef, 1 ulp).
//
// Also here: empty_output_like, the output allocation of the layer kernels (norm.h, softmax.h).
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
#if defined(CPU_CAPABILITY_AVX2) && !defined(CPU_CAPABILITY_AVX512)
  const __m256 v = x;
  const __m256 magic = _mm256_set1_ps(12582912.0f);  // 1.5 * 2^23: round to integer
  const __m256 t = _mm256_fmadd_ps(v, _mm256_set1_ps(1.44269504088896341f), magic);
  const __m256 n = _mm256_sub_ps(t, magic);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), v);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(0.001384413568302989f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.008374152705073357f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.04166799411177635f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.16666431725025177f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.4999999403953552f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  // t's low mantissa bits hold n (two's complement): (n + 127) << 23 is 2^n.
  const __m256i e = _mm256_add_epi32(_mm256_slli_epi32(_mm256_castps_si256(t), 23),
                                     _mm256_set1_epi32(127 << 23));
  const __m256 y = _mm256_mul_ps(p, _mm256_castsi256_ps(e));
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
