// Apex's fused scaled (masked) softmax on the CPU (the kernels behind FusedScaleMaskSoftmax).
//
// Softmax runs over the last dim; one thread owns whole rows. Forward: one pass reads the row,
// scales and masks it into an fp32 scratch row (in L1/L2) tracking the max; a second pass
// exponentiates in the scratch and sums; a third writes the normalized row. So each element is
// read from memory once and written once. Masked elements become -10000 after scaling (as
// Apex and Megatron do, so a fully masked row is uniform); the upper-triangular (causal)
// variant has no mask tensor: row i keeps columns 0..i and writes zeros after them.
// Backward, shared by every variant: dx = scale * y * (dy - sum(dy * y)), reading y and dy once
// and writing dx once (the second pass finds the row in cache).
#pragma once

#include <ATen/Parallel.h>
#include <torch/library.h>

#include <cstring>
#include <limits>
#include <vector>

#include "cpu/multi_tensor_apply.h"

namespace mpnb::cpu {

constexpr float kMaskedValue = -10000.0f;

template <typename V>
inline V vexp(const V& x) {
  return x.exp_u20();
}

// Replace lanes whose mask byte is nonzero by `fill` (16 mask bytes for a, b).
inline void apply_mask(const uint8_t* m, int64_t n, fVec& a, fVec& b, const fVec& fill) {
  alignas(16) uint8_t buf[16] = {0};
  const uint8_t* src = m;
  if (n < 16) { std::memcpy(buf, m, n); src = buf; }
#if defined(CPU_CAPABILITY_AVX2)
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src));
  const __m256i zero = _mm256_setzero_si256();
  const __m256 lo = _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_cvtepu8_epi32(bytes), zero));
  const __m256 hi = _mm256_castsi256_ps(
      _mm256_cmpgt_epi32(_mm256_cvtepu8_epi32(_mm_srli_si128(bytes, 8)), zero));
  a = _mm256_blendv_ps(a, fill, lo);
  b = _mm256_blendv_ps(b, fill, hi);
#else
  alignas(64) float fa[2 * fVec::size()];
  a.store(fa);
  b.store(fa + fVec::size());
  for (int64_t i = 0; i < 2 * fVec::size() && i < 16; ++i)
    if (src[i]) fa[i] = kMaskedValue;
  a = fVec::loadu(fa);
  b = fVec::loadu(fa + fVec::size());
#endif
}

inline void apply_mask(const uint8_t* m, int64_t n, dVec& a, dVec& b, const dVec& /*fill*/) {
  alignas(64) double da[2 * dVec::size()];
  a.store(da);
  b.store(da + dVec::size());
  for (int64_t i = 0; i < std::min<int64_t>(n, 2 * dVec::size()); ++i)
    if (m[i]) da[i] = static_cast<double>(kMaskedValue);
  a = dVec::loadu(da);
  b = dVec::loadu(da + dVec::size());
}

// One row: y[0:L) = softmax(x[0:L) * scale, masked), y[L:n) = 0.
template <typename T>
inline void softmax_row(const T* x, const uint8_t* mask, T* y, int64_t L, int64_t n, acc_t<T> scale,
                        acc_t<T>* buf, const T* xn, const uint8_t* mn, bool stream) {
  using Acc = acc_t<T>;
  using V = Vectorized<Acc>;
  using IOT = IO<T, Acc>;
  constexpr int64_t K = IOT::kWidth;
  const V vs(scale), fill(static_cast<Acc>(kMaskedValue));
  const V lowest(-std::numeric_limits<Acc>::infinity());
  V m0 = lowest, m1 = lowest, a, b;
  int64_t i = 0;
  for (; i < L; i += K) {
    const int64_t k = std::min<int64_t>(K, L - i);
    if (k == K) IOT::load(x + i, a, b); else IOT::load(x + i, k, a, b);
    a = a * vs; b = b * vs;
    if (mask) apply_mask(mask + i, k, a, b, fill);
    if (k < K) {  // padded lanes must not raise the max
      a = k >= V::size() ? a : V::set(lowest, a, k);
      b = k >= 2 * V::size() ? b : (k > V::size() ? V::set(lowest, b, k - V::size()) : lowest);
    }
    a.store(buf + i); b.store(buf + i + V::size());
    m0 = at::vec::maximum(m0, a); m1 = at::vec::maximum(m1, b);
  }
  const Acc mx = at::vec::vec_reduce_all<Acc>([](V& p, V& q) { return at::vec::maximum(p, q); },
                                              at::vec::maximum(m0, m1));
  const V vm(mx);
  V s0(Acc(0)), s1(Acc(0));
  for (i = 0; i < L; i += K) {  // padded lanes hold -inf: exp gives 0
    if (xn) prefetch_next(xn + i);
    if (mn && i % 64 == 0) prefetch_next(mn + i);
    a = vexp(V::loadu(buf + i) - vm);
    b = vexp(V::loadu(buf + i + V::size()) - vm);
    a.store(buf + i); b.store(buf + i + V::size());
    s0 = s0 + a; s1 = s1 + b;
  }
  const V inv(static_cast<Acc>(1.0 / hsum(s0 + s1)));
  write_blocks<T, Acc>(y, L, stream, [&](int64_t j, int64_t, V& p, V& q) {
    p = V::loadu(buf + j) * inv;
    q = V::loadu(buf + j + V::size()) * inv;
  });
  write_zeros<T, Acc>(y + L, n - L, stream);
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
};

template <typename T>
void softmax_fwd_kernel(const T* X, T* Y, int64_t rows, int64_t sk, double scale, const MaskView& mv,
                        bool causal, int64_t sq) {
  using Acc = acc_t<T>;
  constexpr int64_t K = IO<T, Acc>::kWidth;
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(sk, 1));
  const bool stream = stream_output<T>(rows * sk);
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    std::vector<Acc> buf(((sk + K - 1) / K) * K + K);
    for (int64_t r = r0; r < r1; ++r) {
      const int64_t L = causal ? std::min<int64_t>(r % sq + 1, sk) : sk;
      const bool next = r + 1 < rows;
      softmax_row<T>(X + r * sk, mv.row(r), Y + r * sk, L, sk, static_cast<Acc>(scale), buf.data(),
                     next ? X + (r + 1) * sk : nullptr, next ? mv.row(r + 1) : nullptr, stream);
    }
    if (stream) stream_fence();
  });
}

template <typename T>
void softmax_bwd_kernel(const T* DY, const T* Y, T* DX, int64_t rows, int64_t sk, double scale,
                        bool causal, int64_t sq) {
  using Acc = acc_t<T>;
  using V = Vectorized<Acc>;
  using IOT = IO<T, Acc>;
  constexpr int64_t K = IOT::kWidth;
  const int64_t grain = std::max<int64_t>(1, 32768 / std::max<int64_t>(sk, 1));
  const bool stream = stream_output<T>(rows * sk);
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    V g0, g1, y0, y1;
    for (int64_t r = r0; r < r1; ++r) {
      const T* dy = DY + r * sk;
      const T* y = Y + r * sk;
      T* dx = DX + r * sk;
      const int64_t L = causal ? std::min<int64_t>(r % sq + 1, sk) : sk;
      V d0(Acc(0)), d1(Acc(0));
      int64_t i = 0;
      for (; i + K <= L; i += K) {
        IOT::load(dy + i, g0, g1); IOT::load(y + i, y0, y1);
        d0 = at::vec::fmadd(g0, y0, d0); d1 = at::vec::fmadd(g1, y1, d1);
      }
      if (i < L) {  // zero padding on both sides: products vanish
        IOT::load(dy + i, L - i, g0, g1); IOT::load(y + i, L - i, y0, y1);
        d0 = at::vec::fmadd(g0, y0, d0); d1 = at::vec::fmadd(g1, y1, d1);
      }
      const V dot(static_cast<Acc>(hsum(d0 + d1))), vs(static_cast<Acc>(scale));
      const bool next = r + 1 < rows;
      write_blocks<T, Acc>(dx, L, stream, [&](int64_t j, int64_t n, V& p, V& q) {
        if (next) { prefetch_next(dy + sk + j); prefetch_next(y + sk + j); }
        if (n == K) { IOT::load(dy + j, g0, g1); IOT::load(y + j, y0, y1); }
        else { IOT::load(dy + j, n, g0, g1); IOT::load(y + j, n, y0, y1); }
        p = vs * (y0 * (g0 - dot)); q = vs * (y1 * (g1 - dot));
      });
      write_zeros<T, Acc>(dx + L, sk - L, stream);
    }
    if (stream) stream_fence();
  });
}

// ---- entry points ------------------------------------------------------------------------

inline void check_softmax_input(const at::Tensor& x, int64_t min_dim, const char* op) {
  TORCH_CHECK(is_float_type(x.scalar_type()), op, ": input is ", x.scalar_type(),
              "; supported dtypes are float32, float16, bfloat16 and float64.");
  TORCH_CHECK(x.dim() >= min_dim, op, ": input must have at least ", min_dim, " dims, got shape ",
              x.sizes(), ".");
}

inline at::Tensor softmax_fwd(const at::Tensor& input, const std::optional<at::Tensor>& mask, double scale,
                              bool causal, const char* op) {
  const auto x = input.contiguous();
  auto y = at::empty_like(x, at::MemoryFormat::Contiguous);
  const int64_t sk = x.dim() ? x.size(-1) : 1;
  const int64_t sq = x.dim() >= 2 ? x.size(-2) : 1;
  const int64_t rows = sk ? x.numel() / sk : 0;
  MaskView mv;
  at::Tensor m;
  if (mask.has_value()) {
    TORCH_CHECK(x.dim() == 4, op, ": input must be [b, np, sq, sk], got ", x.sizes(), ".");
    TORCH_CHECK(mask->scalar_type() == at::kBool || mask->scalar_type() == at::kByte, op, ": mask is ",
                mask->scalar_type(), "; pass a bool or uint8 mask (true = masked out).");
    TORCH_CHECK(mask->dim() == 4 && (mask->size(0) == 1 || mask->size(0) == x.size(0)) &&
                    (mask->size(1) == 1 || mask->size(1) == x.size(1)) && mask->size(2) == sq &&
                    mask->size(3) == sk,
                op, ": mask of shape ", mask->sizes(), " does not fit input ", x.sizes(),
                "; Apex masks are [b or 1, np or 1, sq, sk].");
    m = mask->contiguous().expand(x.sizes());
    mv = {reinterpret_cast<const uint8_t*>(m.const_data_ptr()), x.size(1), sq, m.stride(0), m.stride(1),
          m.stride(2)};
  }
  if (rows == 0) return y;
  MPNB_DISPATCH_FLOAT(x.scalar_type(), T, [&] {
    softmax_fwd_kernel<T>(x.const_data_ptr<T>(), y.mutable_data_ptr<T>(), rows, sk, scale, mv, causal, sq);
  });
  return y;
}

inline at::Tensor scaled_softmax_fwd_cpu(const at::Tensor& input, double scale) {
  check_softmax_input(input, 1, "mpnb::scaled_softmax_fwd");
  return softmax_fwd(input, std::nullopt, scale, false, "mpnb::scaled_softmax_fwd");
}

inline at::Tensor scaled_masked_softmax_fwd_cpu(const at::Tensor& input, const at::Tensor& mask, double scale) {
  check_softmax_input(input, 4, "mpnb::scaled_masked_softmax_fwd");
  return softmax_fwd(input, mask, scale, false, "mpnb::scaled_masked_softmax_fwd");
}

inline at::Tensor scaled_upper_triang_masked_softmax_fwd_cpu(const at::Tensor& input, double scale) {
  const char* op = "mpnb::scaled_upper_triang_masked_softmax_fwd";
  check_softmax_input(input, 2, op);
  TORCH_CHECK(input.size(-2) == input.size(-1), op, ": the causal softmax needs square [.., sq, sk] ",
              "scores (sq == sk), got ", input.sizes(), ".");
  return softmax_fwd(input, std::nullopt, scale, true, op);
}

inline at::Tensor scaled_softmax_bwd_cpu(const at::Tensor& grad_out, const at::Tensor& output, double scale,
                                         bool upper_triang) {
  const char* op = "mpnb::scaled_softmax_bwd";
  check_softmax_input(output, upper_triang ? 2 : 1, op);
  TORCH_CHECK(grad_out.sizes() == output.sizes() && grad_out.scalar_type() == output.scalar_type(), op,
              ": grad_out ", grad_out.sizes(), " ", grad_out.scalar_type(), " does not match the ",
              "softmax output ", output.sizes(), " ", output.scalar_type(), ".");
  const auto dy = grad_out.contiguous(), y = output.contiguous();
  auto dx = at::empty_like(y, at::MemoryFormat::Contiguous);
  const int64_t sk = y.dim() ? y.size(-1) : 1;
  const int64_t sq = y.dim() >= 2 ? y.size(-2) : 1;
  const int64_t rows = sk ? y.numel() / sk : 0;
  if (rows == 0) return dx;
  MPNB_DISPATCH_FLOAT(y.scalar_type(), T, [&] {
    softmax_bwd_kernel<T>(dy.const_data_ptr<T>(), y.const_data_ptr<T>(), dx.mutable_data_ptr<T>(), rows,
                          sk, scale, upper_triang, sq);
  });
  return dx;
}

}  // namespace mpnb::cpu

TORCH_LIBRARY_FRAGMENT(mpnb, m) {
  m.def("scaled_softmax_fwd(Tensor input, float scale) -> Tensor");
  m.def("scaled_masked_softmax_fwd(Tensor input, Tensor mask, float scale) -> Tensor");
  m.def("scaled_upper_triang_masked_softmax_fwd(Tensor input, float scale) -> Tensor");
  m.def("scaled_softmax_bwd(Tensor grad_out, Tensor output, float scale, bool upper_triang=False) "
        "-> Tensor");
}

TORCH_LIBRARY_IMPL(mpnb, CPU, m) {
  m.impl("scaled_softmax_fwd", &mpnb::cpu::scaled_softmax_fwd_cpu);
  m.impl("scaled_masked_softmax_fwd", &mpnb::cpu::scaled_masked_softmax_fwd_cpu);
  m.impl("scaled_upper_triang_masked_softmax_fwd", &mpnb::cpu::scaled_upper_triang_masked_softmax_fwd_cpu);
  m.impl("scaled_softmax_bwd", &mpnb::cpu::scaled_softmax_bwd_cpu);
}
