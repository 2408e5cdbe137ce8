// Vector load/store with conversion, for kernels that read and write fp32/fp16/bf16/fp64
// memory but compute in fp32 (fp64 for fp64 data).
//
// Every kernel processes blocks of IO<T, Acc>::kWidth elements as two Vectorized<Acc>
// registers, so fp16/bf16 data is loaded with one 16-bit vector load and widened in
// registers. Tails use the counted loadu/store of ATen's Vectorized (zero padding).
#pragma once

#include <ATen/ATen.h>
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <type_traits>

namespace mpnb::cpu {

using at::vec::Vectorized;
using fVec = Vectorized<float>;
using dVec = Vectorized<double>;

// ---- non-temporal stores ----------------------------------------------------------------
// Outputs much larger than the caches are written with streaming stores: no read-for-ownership
// of the destination lines (a third less memory traffic for a copy-and-scale) and no eviction
// of the inputs. Small outputs use ordinary stores: the next kernel will read them from cache.
constexpr int64_t kStreamAlign = sizeof(Vectorized<float>);
constexpr int64_t kStreamMinBytes = int64_t(16) << 20;

template <typename T, typename V>
inline void stream_vec(T* p, const V& v) {
#if defined(CPU_CAPABILITY_AVX512)
  _mm512_stream_si512(reinterpret_cast<__m512i*>(p), _mm512_castps_si512(reinterpret_cast<const __m512&>(v)));
#elif defined(CPU_CAPABILITY_AVX2)
  _mm256_stream_si256(reinterpret_cast<__m256i*>(p), reinterpret_cast<const __m256i&>(v));
#else
  v.store(p);
#endif
}

inline void stream_fence() {
#if defined(CPU_CAPABILITY_AVX512) || defined(CPU_CAPABILITY_AVX2)
  _mm_sfence();
#endif
}

// Elements before p + i is aligned for streaming (at most n).
template <typename T>
inline int64_t align_head(const T* p, int64_t n) {
  const auto addr = reinterpret_cast<uintptr_t>(p);
  const int64_t mis = static_cast<int64_t>(addr % kStreamAlign);
  if (mis == 0) return 0;
  if (mis % static_cast<int64_t>(sizeof(T)) != 0) return n;  // cannot align: no streaming
  return std::min<int64_t>(n, (kStreamAlign - mis) / static_cast<int64_t>(sizeof(T)));
}

// fp64 data computes in fp64, everything else in fp32 (as Apex does on the GPU).
template <typename T>
using acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

template <typename T, typename Acc = acc_t<T>>
struct IO;

// Full-precision types: two registers per block.
template <typename T>
struct IO<T, T> {
  using V = Vectorized<T>;
  static constexpr int64_t kWidth = 2 * V::size();
  static inline void load(const T* p, V& a, V& b) {
    a = V::loadu(p);
    b = V::loadu(p + V::size());
  }
  static inline void load(const T* p, int64_t n, V& a, V& b) {
    a = V::loadu(p, std::min<int64_t>(n, V::size()));
    b = n > V::size() ? V::loadu(p + V::size(), n - V::size()) : V(T(0));
  }
  static inline void store(T* p, const V& a, const V& b) {
    a.store(p);
    b.store(p + V::size());
  }
  static inline void store(T* p, int64_t n, const V& a, const V& b) {
    a.store(p, std::min<int64_t>(n, V::size()));
    if (n > V::size()) b.store(p + V::size(), n - V::size());
  }
  // Non-temporal store of a full block; p must be aligned to kStreamAlign.
  static inline void stream(T* p, const V& a, const V& b) {
    stream_vec(p, a);
    stream_vec(p + V::size(), b);
  }
};

// 16-bit floats computed in fp32: one 16-bit register holds exactly one block.
template <typename H>
struct IO16 {
  using V = fVec;
  using HV = Vectorized<H>;
  static_assert(HV::size() == 2 * fVec::size(), "16-bit vector must hold two fp32 vectors");
  static constexpr int64_t kWidth = HV::size();
  static inline void load(const H* p, V& a, V& b) {
    std::tie(a, b) = at::vec::convert_to_float<H>(HV::loadu(p));
  }
  static inline void load(const H* p, int64_t n, V& a, V& b) {
    std::tie(a, b) = at::vec::convert_to_float<H>(HV::loadu(p, n));
  }
  static inline void store(H* p, const V& a, const V& b) {
    at::vec::convert_from_float<H>(a, b).store(p);
  }
  static inline void store(H* p, int64_t n, const V& a, const V& b) {
    at::vec::convert_from_float<H>(a, b).store(p, n);
  }
  static inline void stream(H* p, const V& a, const V& b) {
    stream_vec(p, at::vec::convert_from_float<H>(a, b));
  }
};

// bf16 widened straight from memory: a bf16 is the high half of its fp32, so each half block is
// one zero-extending load (vpmovzxwd) and a shift. ATen's convert_to_float loads the whole block
// and extracts its high half first: one more shuffle per block, on the port the widening uses
// (the bf16 norm and softmax passes are bound by these conversions). Exact either way.
template <>
struct IO<c10::BFloat16, float> : IO16<c10::BFloat16> {
  using IO16<c10::BFloat16>::load;
#if defined(CPU_CAPABILITY_AVX512)
  static inline void load(const c10::BFloat16* p, fVec& a, fVec& b) {
    const auto* q = reinterpret_cast<const __m256i*>(p);
    a = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(q)), 16));
    b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(q + 1)), 16));
  }
#elif defined(CPU_CAPABILITY_AVX2)
  static inline void load(const c10::BFloat16* p, fVec& a, fVec& b) {
    const auto* q = reinterpret_cast<const __m128i*>(p);
    a = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(q)), 16));
    b = _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(q + 1)), 16));
  }
#endif
};
template <>
struct IO<c10::Half, float> : IO16<c10::Half> {};

// IO with the CPU's own bf16 conversion for the stores of the layer kernels (norms, softmax,
// RoPE): one vcvtne2ps2bf16 per block where ATen's convert_from_float takes 14 integer ops
// (the bf16 store was half the instructions of a bf16 RoPE or norm row in cache). The same bits
// as IO: the instruction rounds to nearest even as ATen does, and a block with a NaN (ATen
// writes 0xffff) or a subnormal (the instruction reads it as zero, ATen rounds it) takes
// ATen's conversion instead. Other types and ISAs: IO itself.
template <typename T, typename Acc = acc_t<T>>
struct LayerIO : IO<T, Acc> {};

#if defined(CPU_CAPABILITY_AVX512) && defined(__AVX512BF16__)
// Blocks of 32 fp32 values (a: the first 16) as 32 bf16, rounded to nearest even.
C10_ALWAYS_INLINE __m512i bf16_pack(const fVec& a, const fVec& b) {
  constexpr int kNanOrSubnormal = 0x01 | 0x20 | 0x80;  // quiet NaN, subnormal, signalling NaN
  // one kortest on the two masks (moving them to integer registers to or them took three ops)
  if (C10_UNLIKELY(!_kortestz_mask16_u8(_mm512_fpclass_ps_mask(a, kNanOrSubnormal),
                                        _mm512_fpclass_ps_mask(b, kNanOrSubnormal))))
    return at::vec::convert_from_float<c10::BFloat16>(a, b);
  return reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(b, a));  // b to the high half
}

template <>
struct LayerIO<c10::BFloat16, float> : IO<c10::BFloat16, float> {
  using H = c10::BFloat16;
  static inline void store(H* p, const fVec& a, const fVec& b) {
    _mm512_storeu_si512(reinterpret_cast<void*>(p), bf16_pack(a, b));
  }
  static inline void store(H* p, int64_t n, const fVec& a, const fVec& b) {
    Vectorized<H>(bf16_pack(a, b)).store(p, n);
  }
  static inline void stream(H* p, const fVec& a, const fVec& b) {
    _mm512_stream_si512(reinterpret_cast<__m512i*>(p), bf16_pack(a, b));
  }
};
#endif

// Block width shared by two types computed in the same Acc (fp16/bf16/fp32 all use 16 on AVX2).
template <typename A, typename B, typename Acc>
inline constexpr int64_t kBlock = IO<A, Acc>::kWidth;

// NaN-propagating finiteness accumulator: x - x is 0 for finite x and NaN for inf/NaN, so
// `bad += (x - x)` is NaN at the end iff some x was not finite. Two vector ops per register.
template <typename V>
inline void accumulate_nonfinite(V& bad, const V& x) {
  bad = bad + (x - x);
}

template <typename V>
inline bool all_finite(const V& bad) {
  using T = typename V::value_type;
  alignas(64) T buf[V::size()];
  bad.store(buf);
  T s = T(0);
  for (int64_t i = 0; i < V::size(); ++i) s += buf[i];
  return !std::isnan(s);
}

// Raw-bit finiteness: a float is inf/NaN iff its exponent bits are all ones. For the read-only
// check this avoids widening 16-bit data: one AND and one compare per register.
template <typename T>
struct Bits;
template <>
struct Bits<float> { using I = int32_t; static constexpr I kExp = 0x7f800000; };
template <>
struct Bits<double> { using I = int64_t; static constexpr I kExp = 0x7ff0000000000000LL; };
template <>
struct Bits<c10::BFloat16> { using I = int16_t; static constexpr I kExp = 0x7f80; };
template <>
struct Bits<c10::Half> { using I = int16_t; static constexpr I kExp = 0x7c00; };

// A read prefetch kBytes past p into every cache level, for a loop that streams an array once
// and reads one cache line per iteration. The hardware prefetcher alone keeps too few lines in
// flight for a read-only stream on AMD EPYC 7001 (Zen 1): one core read bf16 at 8-9 GB/s, where
// PyTorch's fp32 sum reads 11.5 (see all_finite_bits and l2norm.cpp's sumsq_range).
template <int64_t kBytes, typename T>
C10_ALWAYS_INLINE void prefetch_stream(const T* p) {
  __builtin_prefetch(reinterpret_cast<const char*>(p) + kBytes, 0, 3);
}

// How far ahead (in elements) a pass that streams arrays prefetches each one it reads (1 KiB of
// fp32): the optimizer passes (opt_common.h's chunk walk, lamb.cpp), multi_tensor_scale and
// multi_tensor_axpby. On Zen 1 the hardware prefetcher alone left the memory bus idle while a
// block's arithmetic ran. GPT workload, % of the bench's same-run bandwidth row: O2 LAMB's
// passes alone, 2 threads 67-68% -> 72% (512 elements: 71-72%), 1 thread 56% -> 61% (512:
// 59%; 128: 56%); every optimizer pass, 2 threads: O2 LAMB 63 -> 73, O2 AdamW 82 -> 90,
// pure-bf16 round to nearest 75 -> 94; 1 thread: axpby fp32 82-88 -> 105, scale 88-91 -> 110.
constexpr int64_t kStreamAheadElems = 256;

// The read prefetch of x + kStreamAheadElems.
template <typename T>
C10_ALWAYS_INLINE void prefetch_ahead(const T* x) {
  prefetch_stream<kStreamAheadElems * static_cast<int64_t>(sizeof(T))>(x);
}

// all_finite_bits' prefetch distance. Zen 1, bf16 grads of the GPT workload (40 MB): 4.0 ->
// 3.6-3.9 ms at 1 thread, 2.9 -> 2.35-2.4 ms at 2 (2048 B: 4.25 and 2.6; 512 B: 3.6 and 2.4).
constexpr int64_t kFinitePrefetchBytes = 1024;

template <typename T>
inline bool all_finite_bits(const T* x, int64_t n) {
  using I = typename Bits<T>::I;
  using IV = Vectorized<I>;
  const I* p = reinterpret_cast<const I*>(x);
  const IV exp(Bits<T>::kExp);
  IV bad0(I(0)), bad1(I(0));
  int64_t i = 0;
  for (; i + 2 * IV::size() <= n; i += 2 * IV::size()) {
    prefetch_stream<kFinitePrefetchBytes>(p + i);
    bad0 = bad0 | ((IV::loadu(p + i) & exp) == exp);
    bad1 = bad1 | ((IV::loadu(p + i + IV::size()) & exp) == exp);
  }
  alignas(64) I buf[IV::size()];
  (bad0 | bad1).store(buf);
  for (int64_t k = 0; k < IV::size(); ++k)
    if (buf[k]) return false;
  for (; i < n; ++i)
    if ((p[i] & Bits<T>::kExp) == Bits<T>::kExp) return false;
  return true;
}

// Widen fp32 lanes to fp64 into a pair of fp64 registers.
inline void widen(const fVec& x, dVec& a, dVec& b) {
#if defined(CPU_CAPABILITY_AVX2)
  __m256 v = x;
  a = dVec(_mm256_cvtps_pd(_mm256_castps256_ps128(v)));
  b = dVec(_mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
#elif defined(CPU_CAPABILITY_AVX512)
  __m512 v = x;
  a = dVec(_mm512_cvtps_pd(_mm512_castps512_ps256(v)));
  b = dVec(_mm512_cvtps_pd(_mm512_extractf32x8_ps(v, 1)));
#else
  alignas(64) float f[fVec::size()];
  alignas(64) double d[fVec::size()];
  x.store(f);
  for (int64_t i = 0; i < fVec::size(); ++i) d[i] = f[i];
  a = dVec::loadu(d);
  b = dVec::loadu(d + dVec::size());
#endif
}

inline void widen_add(dVec& lo, dVec& hi, const fVec& x) {
  dVec a, b;
  widen(x, a, b);
  lo = lo + a;
  hi = hi + b;
}

// Add x*x (fp32 lanes widened to fp64) to two fp64 accumulators.
inline void accumulate_squares(dVec& lo, dVec& hi, const fVec& x) {
  dVec a, b;
  widen(x, a, b);
  lo = at::vec::fmadd(a, a, lo);
  hi = at::vec::fmadd(b, b, hi);
}

inline void accumulate_squares(dVec& lo, dVec& /*hi*/, const dVec& x) {
  lo = at::vec::fmadd(x, x, lo);
}

template <typename T>
inline double hsum(const Vectorized<T>& v) {
  alignas(64) T buf[Vectorized<T>::size()];
  v.store(buf);
  double s = 0.0;
  for (int64_t i = 0; i < Vectorized<T>::size(); ++i) s += static_cast<double>(buf[i]);
  return s;
}

// Writes y[0, n) block by block, for kernels that produce a row (or range) in registers:
// f(j, len, a, b) fills the block at y + j (len < kWidth only for a head or tail block). With
// `stream`, the full blocks from the first kStreamAlign boundary on use non-temporal stores
// (the caller fences once per thread with stream_fence() before its results are read); the
// values, and so the results, are the same either way.
template <typename T, typename Acc, typename IOT = IO<T, Acc>, typename F>
inline void write_blocks(T* y, int64_t n, bool stream, const F& f) {
  constexpr int64_t K = IOT::kWidth;
  Vectorized<Acc> a, b;
  int64_t j = 0;
  if (stream) {
    const int64_t head = align_head(y, n);
    while (j < head) {
      const int64_t len = std::min<int64_t>(K, head - j);
      f(j, len, a, b);
      IOT::store(y + j, len, a, b);
      j += len;
    }
    for (; j + K <= n; j += K) {
      f(j, K, a, b);
      IOT::stream(y + j, a, b);
    }
  } else {
    for (; j + K <= n; j += K) {
      f(j, K, a, b);
      IOT::store(y + j, a, b);
    }
  }
  if (j < n) {
    f(j, n - j, a, b);
    IOT::store(y + j, n - j, a, b);
  }
}

// y[0, n) = 0, streamed like write_blocks (the masked-out tail of a causal softmax row); each()
// runs once per block (a kernel's RowPrefetch step, so that reads run beside these stores).
template <typename T, typename Acc, typename IOT = IO<T, Acc>, typename F>
inline void write_zeros(T* y, int64_t n, bool stream, const F& each) {
  write_blocks<T, Acc, IOT>(y, n, stream, [&](int64_t, int64_t, Vectorized<Acc>& a, Vectorized<Acc>& b) {
    each();
    a = Vectorized<Acc>(Acc(0));
    b = a;
  });
}

template <typename T, typename Acc, typename IOT = IO<T, Acc>>
inline void write_zeros(T* y, int64_t n, bool stream) {
  write_zeros<T, Acc, IOT>(y, n, stream, [] {});
}

// True when an output of `numel` elements of T is large enough to be streamed.
template <typename T>
inline bool stream_output(int64_t numel) {
  return numel * static_cast<int64_t>(sizeof(T)) >= kStreamMinBytes;
}

// Row kernels read a row from memory once and then make their later passes over it in cache;
// prefetching the next row during those passes keeps the memory bus busy while they run
// (the hardware prefetcher alone stops a few lines ahead). Into L2: a row of 1K-4K elements
// plus the current one fits there, and L1 is left to the current row and the weights.
// Forced inline: a prefetch has no visible effect, so GCC's interprocedural analysis marks an
// out-of-line prefetch_next `const` and deletes every call to it (this happened in the norm
// backward, which then ran 1.8x slower on bf16).
template <typename T>
C10_ALWAYS_INLINE void prefetch_next(const T* p) {
  __builtin_prefetch(p, 0, 2);
}

// The cache line the prefetches below count in.
constexpr int64_t kCacheLine = 64;

// prefetch_next for every cache line of a block of K elements at p.
template <int64_t K, typename T>
C10_ALWAYS_INLINE void prefetch_block(const T* p) {
  constexpr int64_t kBytes = K * static_cast<int64_t>(sizeof(T));
  for (int64_t off = 0; off < kBytes; off += kCacheLine)
    prefetch_next(reinterpret_cast<const char*>(p) + off);
}

// A later row's prefetch (rows_ahead below), issued over every pass a row kernel makes over the
// current row: each pass calls step() once per block (or pair of blocks) it visits, and each step
// prefetches the next `kBytes` of that row's arrays (one or two, at the same offsets; whole lines,
// or half a line) until the row is covered; finish() issues what is left. The first passes (in
// cache, arithmetic only) then keep the memory bus busy with that row's reads, and the write pass
// with the output's streaming stores. (The earlier prefetch ran in the write pass only and fetched
// one line per block, half of an fp32 row: 8192 x 4096 fp32 at 1 thread, layer norm forward 21.3 ->
// 17.1 ms, layer norm backward 38.4 -> 28.6 ms, `mpnb bench layers`.) 16-bit rows step only in the
// write pass (kEarlyPrefetch). A step is four instructions and no branch: past the end it
// prefetches the row's last line again. Without such a row it prefetches one idle line.
template <int kArrays, int kBytes>
class RowPrefetch {
  static_assert(kArrays == 1 || kArrays == 2, "one or two arrays");
  static_assert(kBytes == 32 || kBytes % kCacheLine == 0, "half a line or whole lines a step");

 public:
  // a, b: the arrays of the row to prefetch (`bytes` each; b only with kArrays == 2); a null: none.
  RowPrefetch(const void* a, const void* b, int64_t bytes) {
    if (a == nullptr || bytes <= 0) {
      p_ = last_ = idle_line();
      delta_ = 0;
    } else {
      p_ = static_cast<const char*>(a);
      last_ = p_ + ((bytes - 1) & ~(kCacheLine - 1));
      delta_ = kArrays == 2 ? static_cast<const char*>(b) - p_ : 0;
    }
  }
  // kTimes steps at once (kTimes * kBytes bytes): a pass that visits a row's blocks at half the
  // pace of the others.
  template <int kTimes = 1>
  C10_ALWAYS_INLINE void step() {
    constexpr int kSpan = kBytes * kTimes;
    if constexpr (kSpan < kCacheLine) {  // every line twice, a step apart: no counter, no branch
      prefetch_next(p_);
      if constexpr (kArrays == 2) prefetch_next(p_ + delta_);
      const char* n = p_ + kSpan;
      p_ = n <= last_ ? n : p_;
    } else {
      for (int l = 0; l < kSpan / kCacheLine; ++l) {
        prefetch_next(p_);
        if constexpr (kArrays == 2) prefetch_next(p_ + delta_);
        const char* n = p_ + kCacheLine;
        p_ = n <= last_ ? n : p_;
      }
    }
  }
  C10_ALWAYS_INLINE void finish() {
    for (; p_ < last_; p_ += kCacheLine) {
      const char* q = std::min(p_ + kCacheLine, last_);  // p_ mid-line: its next line
      prefetch_next(q);
      if constexpr (kArrays == 2) prefetch_next(q + delta_);
    }
  }

 private:
  static const char* idle_line() {
    alignas(kCacheLine) static const char line[kCacheLine] = {};
    return line;
  }
  const char* p_;
  const char* last_;
  std::ptrdiff_t delta_;
};

// Whether the passes before a row kernel's write pass step its RowPrefetch: for fp32/fp64 rows,
// not for 16-bit rows, whose earlier passes are bound by widening the data (measured with the
// early steps, 8192 x 4096 bf16 softmax backward at 1 thread: 75% -> 61% of the in-place add);
// their write pass alone covers the next row.
template <typename T>
inline constexpr bool kEarlyPrefetch = sizeof(T) >= 4;

// How many rows ahead a row kernel prefetches (row_bytes: one row of all the arrays it reads):
// enough that about kPrefetchAhead bytes are on their way, 1 to 4 rows. One row ahead, the rows
// of a kernel whose first pass reads faster than memory delivers were still arriving when it
// started: 8192 x 4096 bf16 softmax forward at 1 thread 9.3 -> 7.7 ms two rows ahead, the
// 32768 x 1024 bf16 softmax backward 55% -> 63% of the in-place add.
constexpr int64_t kPrefetchAhead = int64_t(16) << 10;

// Rows of row_bytes that cover `bytes`, at least 1 and at most `most`: a prefetch distance in
// rows (rows_ahead; RoPE's walk, rotary.cpp).
inline int64_t rows_covering(int64_t bytes, int64_t row_bytes, int64_t most) {
  return std::clamp<int64_t>(bytes / std::max<int64_t>(row_bytes, 1), 1, most);
}

inline int64_t rows_ahead(int64_t row_bytes) { return rows_covering(kPrefetchAhead, row_bytes, 4); }

// Bytes of one block of IO<T, Acc> (32 fp32 values with AVX-512: 128; 16 with AVX2: 64).
template <typename T, typename Acc = acc_t<T>>
inline constexpr int kBlockBytes = static_cast<int>(IO<T, Acc>::kWidth * static_cast<int64_t>(sizeof(T)));

// The RowPrefetch step (bytes) of a pass that keeps pace with the row: a block's whole lines
// (at least one: a 16-bit AVX2 block is half a line).
template <typename T, typename Acc = acc_t<T>>
inline constexpr int kBlockStep = std::max(static_cast<int>(kCacheLine), kBlockBytes<T, Acc>);

// The RowPrefetch step (bytes) of a row kernel that steps once per block in two or more passes
// over the row (the norms; the plain softmax backward): half a block, so that the next row's
// reads spread over all of a row's passes, the write pass included, and no pass is left with
// the output's stores alone on the memory bus. An AVX2 fp32 block is one line: half a line a
// step, each line prefetched twice a step apart (whole lines, one a block, had issued the
// next row in the first pass). 16-bit rows step in the write pass only (kEarlyPrefetch): a
// whole line. AMD EPYC Zen 1 (AVX2), fp32, % of the same-run in-place add, one process per
// build alternating, medians, whole lines -> half lines: 32768 x 1024 at 2 threads, layer norm
// backward 68-70% -> 80-81%, RMS norm backward 77-80% -> 100%; at 1 thread 63-71% -> 82-90%
// and 74-86% -> 91-96%; 8192 x 4096 at 1 thread, layer norm forward 81-82% -> 93-99%, backward
// 68-69% -> 83%, RMS norm backward 75-79% -> 88-90%; plain softmax backward 71-77% -> 89-95%
// at 1 thread and 83-86% -> 94-99% at 2 (both widths); 16-bit rows unchanged. On AVX-512 (a
// 128-byte fp32 block) it is one line a block, as before: 8192 x 4096 fp32 at 1 thread on an
// AVX-512 CPU, layer norm forward 74% -> 81%, backward 67% -> 74%, RMS norm backward 70% -> 78%
// (against two lines a block, the next row read during the statistics passes only).
template <typename T, typename Acc = acc_t<T>>
inline constexpr int kSpreadStep =
    std::max(kEarlyPrefetch<T> ? 32 : 64, kBlockBytes<T, Acc> / 2);

}  // namespace mpnb::cpu
