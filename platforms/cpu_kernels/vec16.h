// 16-float vectors for the CPU kernels: one AVX-512 register, or a pair of 8-lane vectors
// (two AVX2 registers) where the build targets no AVX-512 (see the note on v16 below).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>

#if defined(__AVX512F__) || defined(__AVX2__)
#include <immintrin.h>
#endif
#include <type_traits>

namespace halserve_cpu {

// A v16 is 16 float lanes; vi16/vu16 16 int32/uint32 lanes. With AVX-512 they are GCC vector
// types of one 512-bit register. Without it (AVX2, or any other target) GCC has no register for
// a 64-byte vector: it keeps such values in memory and lowers comparisons and selects lane by
// lane through the stack (measured on an AVX-512 machine built with -march=x86-64-v3: decode
// attention 3.8x, SiLU-and-mul 8.5x slower than the AVX-512 build). There a v16 is a pair of
// 8-lane vectors, which stay in two ymm registers. Kernels use only what both provide: the
// arithmetic and bitwise operators (lane-wise, a scalar operand broadcast), v16{} for zero, and
// the functions below for comparisons, selects, conversions and reinterpreting casts.
#if defined(__AVX512F__)
typedef float v16 __attribute__((vector_size(64), aligned(4)));
typedef int32_t vi16 __attribute__((vector_size(64), aligned(4)));
typedef uint32_t vu16 __attribute__((vector_size(64), aligned(4)));

// One 64-byte move: GCC splits a 64-byte memcpy into two 32-byte ones on targets that prefer
// 256-bit vectors, and a v16 that then reaches memory and is read back whole stalls on store
// forwarding (measured: 35% of the bf16 RMSNorm's time on one such load).
inline v16 load16(const float* p) { return (v16)_mm512_loadu_ps(p); }
inline void store16(float* p, v16 v) { _mm512_storeu_ps(p, (__m512)v); }

inline v16 select16(vi16 m, v16 a, v16 b) { return m ? a : b; }   // m ? a : b, lane-wise
inline vu16 select16(vi16 m, vu16 a, vu16 b) { return m ? a : b; }
inline v16 max16(v16 a, v16 b) { return a > b ? a : b; }           // (a NaN a gives b)
inline v16 min16(v16 a, v16 b) { return a < b ? a : b; }
inline vi16 lt16(v16 a, v16 b) { return a < b; }
inline vi16 isnan16(v16 a) { return a != a; }
inline vi16 le16(vi16 a, int32_t b) { return a <= b; }
inline vi16 lt16(vi16 a, int32_t b) { return a < b; }
inline vi16 gt16(vi16 a, int32_t b) { return a > b; }
inline vi16 trunc_to_int16(v16 a) { return __builtin_convertvector(a, vi16); }
inline v16 as_v16(vi16 a) { return (v16)a; }
inline v16 as_v16(vu16 a) { return (v16)a; }
inline vu16 as_vu16(v16 a) { return (vu16)a; }
inline float hsum16(v16 v) { return _mm512_reduce_add_ps((__m512)v); }
inline float hmax16(v16 v) { return _mm512_reduce_max_ps((__m512)v); }
inline vi16 iota16() { return vi16{0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15}; }
#else
typedef float v8 __attribute__((vector_size(32), aligned(4)));
typedef int32_t vi8 __attribute__((vector_size(32), aligned(4)));
typedef uint32_t vu8 __attribute__((vector_size(32), aligned(4)));

template <typename H>
struct Pair16 {
  H lo, hi;  // lanes 0-7, 8-15
};
typedef Pair16<v8> v16;
typedef Pair16<vi8> vi16;
typedef Pair16<vu8> vu16;

#define HALSERVE_PAIR16_OP(op)                                                                       \
  template <typename H>                                                                              \
  inline Pair16<H> operator op(Pair16<H> a, Pair16<H> b) { return {a.lo op b.lo, a.hi op b.hi}; }    \
  template <typename H, typename S, typename = std::enable_if_t<std::is_arithmetic_v<S>>>            \
  inline Pair16<H> operator op(Pair16<H> a, S s) { return {a.lo op s, a.hi op s}; }                  \
  template <typename H, typename S, typename = std::enable_if_t<std::is_arithmetic_v<S>>>            \
  inline Pair16<H> operator op(S s, Pair16<H> a) { return {s op a.lo, s op a.hi}; }                  \
  template <typename H>                                                                              \
  inline Pair16<H>& operator op##=(Pair16<H>& a, Pair16<H> b) { return a = a op b; }                 \
  template <typename H, typename S, typename = std::enable_if_t<std::is_arithmetic_v<S>>>            \
  inline Pair16<H>& operator op##=(Pair16<H>& a, S s) { return a = a op s; }
HALSERVE_PAIR16_OP(+)
HALSERVE_PAIR16_OP(-)
HALSERVE_PAIR16_OP(*)
HALSERVE_PAIR16_OP(/)
HALSERVE_PAIR16_OP(&)
HALSERVE_PAIR16_OP(|)
HALSERVE_PAIR16_OP(^)
HALSERVE_PAIR16_OP(<<)
HALSERVE_PAIR16_OP(>>)
#undef HALSERVE_PAIR16_OP
template <typename H>
inline Pair16<H> operator-(Pair16<H> a) { return {-a.lo, -a.hi}; }

inline v16 load16(const float* p) {
  v16 v;
  __builtin_memcpy(&v.lo, p, sizeof(v8));
  __builtin_memcpy(&v.hi, p + 8, sizeof(v8));
  return v;
}
inline void store16(float* p, v16 v) {
  __builtin_memcpy(p, &v.lo, sizeof(v8));
  __builtin_memcpy(p + 8, &v.hi, sizeof(v8));
}

inline v16 select16(vi16 m, v16 a, v16 b) { return {m.lo ? a.lo : b.lo, m.hi ? a.hi : b.hi}; }
inline vu16 select16(vi16 m, vu16 a, vu16 b) { return {m.lo ? a.lo : b.lo, m.hi ? a.hi : b.hi}; }
inline v16 max16(v16 a, v16 b) { return {a.lo > b.lo ? a.lo : b.lo, a.hi > b.hi ? a.hi : b.hi}; }
inline v16 min16(v16 a, v16 b) { return {a.lo < b.lo ? a.lo : b.lo, a.hi < b.hi ? a.hi : b.hi}; }
inline vi16 lt16(v16 a, v16 b) { return {a.lo < b.lo, a.hi < b.hi}; }
inline vi16 isnan16(v16 a) { return {a.lo != a.lo, a.hi != a.hi}; }
inline vi16 le16(vi16 a, int32_t b) { return {a.lo <= b, a.hi <= b}; }
inline vi16 lt16(vi16 a, int32_t b) { return {a.lo < b, a.hi < b}; }
inline vi16 gt16(vi16 a, int32_t b) { return {a.lo > b, a.hi > b}; }
inline vi16 trunc_to_int16(v16 a) { return {__builtin_convertvector(a.lo, vi8), __builtin_convertvector(a.hi, vi8)}; }
inline v16 as_v16(vi16 a) { return {(v8)a.lo, (v8)a.hi}; }
inline v16 as_v16(vu16 a) { return {(v8)a.lo, (v8)a.hi}; }
inline vu16 as_vu16(v16 a) { return {(vu8)a.lo, (vu8)a.hi}; }
#if defined(__AVX2__)
inline float hsum8(v8 v) {
  __m128 a = _mm_add_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
  a = _mm_add_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_add_ss(a, _mm_movehdup_ps(a)));
}
inline float hmax8(v8 v) {
  __m128 a = _mm_max_ps(_mm256_castps256_ps128((__m256)v), _mm256_extractf128_ps((__m256)v, 1));
  a = _mm_max_ps(a, _mm_movehl_ps(a, a));
  return _mm_cvtss_f32(_mm_max_ss(a, _mm_movehdup_ps(a)));
}
#else
inline float hsum8(v8 v) {
  float s = 0.f;
  for (int i = 0; i < 8; ++i) s += v[i];
  return s;
}
inline float hmax8(v8 v) {
  float m = v[0];
  for (int i = 1; i < 8; ++i) m = std::max(m, v[i]);
  return m;
}
#endif
inline float hsum16(v16 v) { return hsum8(v.lo + v.hi); }
inline float hmax16(v16 v) { return hmax8(v.lo > v.hi ? v.lo : v.hi); }
inline vi16 iota16() { return {vi8{0, 1, 2, 3, 4, 5, 6, 7}, vi8{8, 9, 10, 11, 12, 13, 14, 15}}; }
#endif
inline v16 splat16(float x) { return v16{} + x; }

// exp(x) on 16 lanes: Cephes expf's range reduction (x = n ln2 + r, |r| <= ln2 / 2) and
// degree-6 polynomial, about 1 ulp. Lanes below -87.3 (-inf included: masked positions)
// give exactly 0 (the true value would be subnormal).
inline v16 exp16(v16 x) {
  const v16 lo = splat16(-87.33654f), hi = splat16(88.0f);
  const vi16 underflow = lt16(x, lo);
  x = select16(underflow, lo, x);
  x = select16(lt16(hi, x), hi, x);  // (a NaN fails both tests and stays NaN)
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
  const vi16 bits = (trunc_to_int16(n) + 127) << 23;  // 2^n
  const v16 out = y * as_v16(bits);
  return select16(underflow, v16{}, out);
}

// bfloat16 storage (caches, q, out of the attention kernels): values are widened to float
// on load and all arithmetic is float32. bf16 -> float is exact (the bf16 bits are the
// float's top 16 bits): zero-extend to 32 bits and shift, which GCC lowers to
// vpmovzxwd + vpslld. float -> bf16 rounds to nearest even (c10::BFloat16's constructor).
// float -> bf16 on 16 lanes exactly as c10::BFloat16's constructor: round to nearest even
// on the bits, NaN -> 0x7FC0 (AVX512-BF16's vcvtneps2bf16 differs: it flushes subnormals).
inline vu16 bf16_bits16(v16 v) {
  const vu16 bits = as_vu16(v);
  // unsigned: only a NaN can wrap, and NaNs take the other branch
  const vu16 rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return select16(isnan16(v), vu16{} + 0x7FC0u, rounded);
}
#if defined(__AVX512F__)
typedef uint16_t vh16 __attribute__((vector_size(32), aligned(2)));
inline v16 load16(const c10::BFloat16* p) {
  vh16 h;
  __builtin_memcpy(&h, p, sizeof(vh16));
  return (v16)(__builtin_convertvector(h, vi16) << 16);
}
inline void store16(c10::BFloat16* p, v16 v) {
  const vh16 h = __builtin_convertvector(bf16_bits16(v), vh16);
  __builtin_memcpy(p, &h, sizeof(vh16));
}
#else
typedef uint16_t vh8 __attribute__((vector_size(16), aligned(2)));
inline v16 load16(const c10::BFloat16* p) {
  vh8 a, b;
  __builtin_memcpy(&a, p, sizeof(vh8));
  __builtin_memcpy(&b, p + 8, sizeof(vh8));
  return as_v16(vi16{__builtin_convertvector(a, vi8) << 16, __builtin_convertvector(b, vi8) << 16});
}
inline void store16(c10::BFloat16* p, v16 v) {
  const vu16 bits = bf16_bits16(v);
  const vh8 a = __builtin_convertvector(bits.lo, vh8), b = __builtin_convertvector(bits.hi, vh8);
  __builtin_memcpy(p, &a, sizeof(vh8));
  __builtin_memcpy(p + 8, &b, sizeof(vh8));
}
#endif
// v rounded to bf16 and widened back: the value a bf16 tensor would hold.
inline v16 round_bf16(v16 v) {
  return as_v16(bf16_bits16(v) << 16);
}
// float16 storage (kv_cache_dtype="float16", llama.cpp's default cache type): widened on load, rounded to
// nearest even on store, as c10::Half's constructor (F16C's vcvtph2ps / vcvtps2ph: past 65504 a value becomes
// inf, as torch's .to(float16) makes it). Without F16C, lane by lane through c10::Half.
#if defined(__AVX512F__)
inline v16 load16(const c10::Half* p) {
  return (v16)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
inline void store16(c10::Half* p, v16 v) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtps_ph((__m512)v, _MM_FROUND_TO_NEAREST_INT));
}
#elif defined(__F16C__)
inline v16 load16(const c10::Half* p) {
  return {(v8)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          (v8)_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline void store16(c10::Half* p, v16 v) {
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm256_cvtps_ph((__m256)v.lo, _MM_FROUND_TO_NEAREST_INT));
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p + 8), _mm256_cvtps_ph((__m256)v.hi, _MM_FROUND_TO_NEAREST_INT));
}
#else
inline v16 load16(const c10::Half* p) {
  float f[16];
  for (int i = 0; i < 16; ++i) f[i] = static_cast<float>(p[i]);
  return load16(f);
}
inline void store16(c10::Half* p, v16 v) {
  float f[16];
  store16(f, v);
  for (int i = 0; i < 16; ++i) p[i] = c10::Half(f[i]);
}
#endif
inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(c10::Half x) { return static_cast<float>(x); }
template <typename T>
inline T from_float(float x) { return T(x); }  // float: the value itself; bf16, f16: rounded

// Prefetches n elements from p into L2 (prefetcht1), one 64-byte line at a time. A whole cache block's lines
// at once into L1 (prefetcht0) overran its few miss buffers: on a 2-core Zen 4 the decode attention of 64
// requests x 192 tokens x 30 layers took 34.6 ms (float32) / 19.4 ms (bfloat16 cache) with T0 and 26.6 / 12.2 with
// T1 (BENCHMARKS.md, "A bfloat16 KV cache").
template <typename T>
inline void prefetch_lines(const T* p, int64_t n) {
  for (int64_t i = 0; i < n; i += 64 / static_cast<int64_t>(sizeof(T))) __builtin_prefetch(p + i, 0, 2);
}


}  // namespace halserve_cpu
