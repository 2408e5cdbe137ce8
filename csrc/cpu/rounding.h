// Pure-bf16 optimizer steps (mpnb::fused_{adam,sgd,lamb}_bf16_): the new weight is computed in
// fp32 from the bf16 param and rounded back to bf16 stochastically or with Kahan summation.
// The math, defined once in mpnb/core/ops/_rounding.py and matched here bit for bit:
//
//   stochastic: bf16 = upper 16 bits of (bits(x) + r), r = 16 random bits; NaN -> 0x7FC0
//   kahan:      y = (x - p) + c;  p' = rne(p + y);  c' = rne(y - (p' - p))   (fp32, rne to bf16)
//
// The random bits are a pure function of (seed, step, tensor index t, element index i):
//   key = mix64(mix64(mix64(seed) ^ step) ^ t) mod 2^32,  r = fmix32(i * 0x9E3779B1 + key) >> 16
// so neither the thread count nor the chunking changes a bit.
//
// The fp32 updates are written one rounding per operation (the build passes
// -ffp-contract=off: no fma), in the order of the references; only the rounding stage is
// scalar code (a loop over one block that GCC vectorizes).
#pragma once

#include <c10/util/string_view.h>

#include <cstring>

#include "cpu/opt_common.h"

namespace mpnb::cpu::opt {

using bf16 = c10::BFloat16;

// splitmix64's step (Steele, Lea, Flood 2014).
constexpr uint64_t mix64(uint64_t z) {
  z += 0x9E3779B97F4A7C15ull;
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

inline uint32_t tensor_key(int64_t seed, int64_t step, int64_t t) {
  return static_cast<uint32_t>(
      mix64(mix64(mix64(static_cast<uint64_t>(seed)) ^ static_cast<uint64_t>(step)) ^
            static_cast<uint64_t>(t)));
}

// The 16 random bits of element i under a tensor's key (murmur3's fmix32).
C10_ALWAYS_INLINE uint32_t element_bits(uint32_t i, uint32_t key) {
  uint32_t x = i * 0x9E3779B1u + key;
  x ^= x >> 16;
  x *= 0x85EBCA6Bu;
  x ^= x >> 13;
  x *= 0xC2B2AE35u;
  x ^= x >> 16;
  return x >> 16;
}

C10_ALWAYS_INLINE uint32_t bits_of(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}
C10_ALWAYS_INLINE float float_of_bf16(uint16_t h) {
  const uint32_t b = static_cast<uint32_t>(h) << 16;
  float x;
  std::memcpy(&x, &b, sizeof x);
  return x;
}
C10_ALWAYS_INLINE bool is_nan_bits(uint32_t b) { return (b & 0x7FFFFFFFu) > 0x7F800000u; }

// fp32 -> bf16 bits, stochastically (r: 16 random bits).
C10_ALWAYS_INLINE uint16_t round_stochastic(float x, uint32_t r) {
  const uint32_t b = bits_of(x);
  return is_nan_bits(b) ? uint16_t(0x7FC0) : static_cast<uint16_t>((b + r) >> 16);
}
// fp32 -> bf16 bits, to nearest even.
C10_ALWAYS_INLINE uint16_t round_nearest(float x) {
  const uint32_t b = bits_of(x);
  const uint32_t lsb = (b >> 16) & 1u;
  return is_nan_bits(b) ? uint16_t(0x7FC0) : static_cast<uint16_t>((b + 0x7FFFu + lsb) >> 16);
}

// The memory guards behind _rounding.check_rounding (which names each problem and its fix):
// bf16 params below 2^32 elements, one contiguous bf16 compensation per param for Kahan (none
// for stochastic rounding). Returns true for Kahan.
template <class L>
inline bool check_rounding(const char* op, const L& params, const L& comps,
                           c10::string_view rounding) {
  const bool kahan = rounding == "kahan";
  TORCH_CHECK_VALUE(kahan || rounding == "stochastic", op, ": rounding '", rounding, "'");
  const size_t n = params.size();
  TORCH_CHECK_TYPE(n == 0 || params[0].scalar_type() == at::kBFloat16, op, ": dtype of params");
  for (size_t i = 0; i < n; ++i)
    TORCH_CHECK_VALUE(params[i].numel() < (int64_t(1) << 32), op, ": size of params[", i, "]");
  if (!kahan) {
    TORCH_CHECK_VALUE(comps.empty(), op, ": list length of compensations");
    return false;
  }
  TORCH_CHECK_VALUE(comps.size() == n, op, ": list length of compensations");
  for (size_t i = 0; i < n; ++i) {
    const at::Tensor& c = comps[i];
    TORCH_CHECK_TYPE(c.scalar_type() == at::kBFloat16 && c.numel() == params[i].numel() &&
                         c.is_contiguous() && c.device().is_cpu(),
                     op, ": compensations[", i, "]");
  }
  return true;
}

// Where a tensor's new weights go: its bf16 param (and compensation), its key, its mode.
struct Rounder {
  bool kahan;
  const std::vector<uint32_t>* keys;  // per tensor (stochastic rounding)

  // Round the new fp32 weights xs[0..cnt) of elements [first, first + cnt) of tensor t.
  C10_ALWAYS_INLINE void store(int64_t t, int64_t first, const float* xs, int64_t cnt,
                               uint16_t* p, uint16_t* c) const {
    if (!kahan) {
      const uint32_t key = (*keys)[t];
      const uint32_t i0 = static_cast<uint32_t>(first);
      for (int64_t j = 0; j < cnt; ++j)
        p[j] = round_stochastic(xs[j], element_bits(i0 + static_cast<uint32_t>(j), key));
      return;
    }
    for (int64_t j = 0; j < cnt; ++j) {
      const float w = float_of_bf16(p[j]);
      const float y = (xs[j] - w) + float_of_bf16(c[j]);
      const uint16_t np = round_nearest(w + y);
      c[j] = round_nearest(y - (float_of_bf16(np) - w));
      p[j] = np;
    }
  }
};

inline std::vector<uint32_t> tensor_keys(int64_t n, int64_t seed, int64_t step) {
  std::vector<uint32_t> keys(n);
  for (int64_t t = 0; t < n; ++t) keys[t] = tensor_key(seed, step, t);
  return keys;
}

template <typename T>
C10_ALWAYS_INLINE void load_block(const T* x, int64_t cnt, bool full, fVec& a, fVec& b) {
  if (full) IO<T, float>::load(x, a, b);
  else IO<T, float>::load(x, cnt, a, b);
}
C10_ALWAYS_INLINE void store_block(float* x, int64_t cnt, bool full, const fVec& a,
                                   const fVec& b) {
  if (full) IO<float, float>::store(x, a, b);
  else IO<float, float>::store(x, cnt, a, b);
}

// Walk one chunk of bf16 params block by block: fn(i, cnt, full, w0, w1, g0, g1, s0, s1) gets
// the param (fp32), the unscaled grad and the NS fp32 states of elements [off + i, + cnt).
template <typename g_t, size_t NS, typename F>
C10_ALWAYS_INLINE void walk_chunk(const Chunk& ch, const TensorRefs& params,
                                  const TensorRefs& grads,
                                  const std::array<const TensorRefs*, NS>& states, float inv,
                                  const F& fn) {
  const int64_t t = ch.tensor, off = ch.offset, n = ch.len;
  const bool scaled = inv != 1.0f;
  const fVec vinv(inv);
  const g_t* g = cdata_of<g_t>(grads[t]) + off;
  const bf16* p = cdata_of<bf16>(params[t]) + off;
  std::array<float*, NS> sp;
  for (size_t k = 0; k < NS; ++k) sp[k] = data_of<float>((*states[k])[t]) + off;
  fVec w0, w1, g0, g1;
  std::array<fVec, NS> s0, s1;
  for (int64_t i = 0; i < n; i += kW) {
    const int64_t cnt = std::min<int64_t>(kW, n - i);
    const bool full = cnt == kW;
    load_block(g + i, cnt, full, g0, g1);
    load_block(p + i, cnt, full, w0, w1);
    for (size_t k = 0; k < NS; ++k) load_block(sp[k] + i, cnt, full, s0[k], s1[k]);
    if (scaled) {
      g0 = g0 * vinv;
      g1 = g1 * vinv;
    }
    fn(i, cnt, full, w0, w1, g0, g1, s0.data(), s1.data());
    for (size_t k = 0; k < NS; ++k) store_block(sp[k] + i, cnt, full, s0[k], s1[k]);
  }
}

// The elementwise pure-bf16 step: body(t, w, g, s) turns w into the new fp32 weight (and
// updates the states s); the Rounder stores it. In parallel over the chunk table.
template <typename g_t, size_t NS, typename Body>
void rounded_update(const TensorRefs& params, const TensorRefs& grads, const TensorRefs& comps,
                    const std::array<const TensorRefs*, NS>& states, float inv,
                    const Rounder& rounder, const Body& body_) {
  auto table = make_chunks(params);
  for_each_chunk(table, [&](int64_t, const Chunk& ch) {
    const Body body = body_;  // a local copy: stores may alias the members otherwise
    const int64_t t = ch.tensor;
    uint16_t* p = reinterpret_cast<uint16_t*>(data_of<bf16>(params[t])) + ch.offset;
    uint16_t* c = rounder.kahan
                      ? reinterpret_cast<uint16_t*>(data_of<bf16>(comps[t])) + ch.offset
                      : nullptr;
    alignas(64) float xs[kW];
    walk_chunk<g_t, NS>(ch, params, grads, states, inv,
                        [&](int64_t i, int64_t cnt, bool full, fVec& w0, fVec& w1, fVec& g0,
                            fVec& g1, fVec* s0, fVec* s1) C10_ALWAYS_INLINE_ATTRIBUTE {
                          body(t, w0, g0, s0);
                          body(t, w1, g1, s1);
                          IO<float, float>::store(xs, w0, w1);
                          (void)full;
                          rounder.store(t, ch.offset + i, xs, cnt, p + i, c ? c + i : nullptr);
                        });
  });
}

// Dispatch the grad dtype (fp32, fp16, bf16): f.template operator()<g_t>().
template <typename F>
void dispatch_grad(at::ScalarType gt, const F& f) {
  AT_DISPATCH_V2(gt, "mpnb pure-bf16 optimizer grads",
                 AT_WRAP([&] { f.template operator()<scalar_t>(); }), at::kFloat, at::kHalf,
                 at::kBFloat16);
}

}  // namespace mpnb::cpu::opt
