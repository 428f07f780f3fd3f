// 16-float vectors for the CPU kernels (GCC vector extensions: one AVX-512 register, two
// AVX2 registers; GCC lowers them for whatever -march the build targets).
#pragma once

#include <c10/util/BFloat16.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace halserve_cpu {

// 16 floats: one AVX-512 register (two AVX2 registers; GCC lowers it for any target).
typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef int32_t vi16 __attribute__((vector_size(64), aligned(4)));

#if defined(__AVX512F__)
// One 64-byte move: GCC splits a 64-byte memcpy into two 32-byte ones on targets that prefer
// 256-bit vectors, and a v16 that then reaches memory and is read back whole stalls on store
// forwarding (measured: 35% of the bf16 RMSNorm's time on one such load).
inline v16 load16(const float* p) { return (v16)_mm512_loadu_ps(p); }
inline void store16(float* p, v16 v) { _mm512_storeu_ps(p, (__m512)v); }
#else
inline v16 load16(const float* p) {
  v16 v;
  __builtin_memcpy(&v, p, sizeof(v16));
  return v;
}
inline void store16(float* p, v16 v) { __builtin_memcpy(p, &v, sizeof(v16)); }
#endif
inline v16 splat16(float x) { return v16{} + x; }

// exp(x) on 16 lanes: Cephes expf's range reduction (x = n ln2 + r, |r| <= ln2 / 2) and
// degree-6 polynomial, about 1 ulp. Lanes below -87.3 (-inf included: masked positions)
// give exactly 0 (the true value would be subnormal).
inline v16 exp16(v16 x) {
  const v16 lo = splat16(-87.33654f), hi = splat16(88.0f);
  const vi16 underflow = x < lo;
  x = x < lo ? lo : x;
  x = x > hi ? hi : x;
  // n = round(x / ln2) by the 1.5 * 2^23 trick (exact for |n| < 2^22)
  const v16 magic = splat16(12582912.0f);
  const v16 n = (x * 1.44269504088896341f + magic) - magic;
  v16 r = x - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  const v16 z = r * r;
  v16 y = splat16(1.9875691500e-4f);
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * z + r + 1.0f;
  const vi16 bits = (__builtin_convertvector(n, vi16) + 127) << 23;  // 2^n
  const v16 out = y * (v16)bits;
  return underflow ? v16{} : out;
}

#if defined(__AVX512F__)
inline float hsum16(v16 v) { return _mm512_reduce_add_ps((__m512)v); }
inline float hmax16(v16 v) { return _mm512_reduce_max_ps((__m512)v); }
#else
inline float hsum16(v16 v) {
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
}
inline float hmax16(v16 v) {
  float m = v[0];
  for (int i = 1; i < 16; ++i) m = std::max(m, v[i]);
  return m;
}
#endif

// bfloat16 storage (caches, q, out of the attention kernels): values are widened to float
// on load and all arithmetic is float32. bf16 -> float is exact (the bf16 bits are the
// float's top 16 bits): zero-extend to 32 bits and shift, which GCC lowers to
// vpmovzxwd + vpslld. float -> bf16 rounds to nearest even (c10::BFloat16's constructor).
typedef uint16_t vh16 __attribute__((vector_size(32), aligned(2)));

inline v16 load16(const c10::BFloat16* p) {
  vh16 h;
  __builtin_memcpy(&h, p, sizeof(vh16));
  return (v16)(__builtin_convertvector(h, vi16) << 16);
}
// float -> bf16 on 16 lanes exactly as c10::BFloat16's constructor: round to nearest even
// on the bits, NaN -> 0x7FC0 (AVX512-BF16's vcvtneps2bf16 differs: it flushes subnormals).
typedef uint32_t vu16 __attribute__((vector_size(64), aligned(4)));
inline vu16 bf16_bits16(v16 v) {
  const vu16 bits = (vu16)v;
  // unsigned: only a NaN can wrap, and NaNs take the other branch
  const vu16 rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return v != v ? vu16{} + 0x7FC0u : rounded;
}
inline void store16(c10::BFloat16* p, v16 v) {
  const vh16 h = __builtin_convertvector(bf16_bits16(v), vh16);
  __builtin_memcpy(p, &h, sizeof(vh16));
}
// v rounded to bf16 and widened back: the value a bf16 tensor would hold.
inline v16 round_bf16(v16 v) {
  return (v16)(bf16_bits16(v) << 16);
}
inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
template <typename T>
inline T from_float(float x) { return T(x); }  // float: the value itself; bf16: rounded

// Prefetches n elements from p into all cache levels, one 64-byte line at a time.
template <typename T>
inline void prefetch_lines(const T* p, int64_t n) {
  for (int64_t i = 0; i < n; i += 64 / static_cast<int64_t>(sizeof(T))) __builtin_prefetch(p + i, 0, 3);
}

// 0, 1, ..., 15: lane offsets of 16 consecutive positions.
inline vi16 iota16() { return vi16{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}; }

}  // namespace halserve_cpu
