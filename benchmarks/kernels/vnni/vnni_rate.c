// The integer unit's rate on this CPU (BENCHMARKS.md, "The GGUF kernel's two int8 levels summed in integers"):
// 12 independent chains of 512-bit vpdpbusd, 256-bit vpdpbusd and 512-bit FMA, one core; run two copies at once
// for both cores:  gcc -O2 -mavx512f -mavx512vnni -mavx512vl -mavx512bw -mfma vnni_rate.c -o /tmp/vnni_rate && /tmp/vnni_rate
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
// 12 chains of OP(acc, b, c) on vectors of type T (acc set by INIT(i), b and c by SET), N times; prints G ops/s
// and a checksum (REDUCE) so the work is kept.
#define RATE(label, T, INIT, SET, OP, REDUCE)                                                    \
  {                                                                                                   \
    T a[12], b = SET(3), c = SET(5);                                                                  \
    for (int i = 0; i < 12; i++) a[i] = INIT(i);                                                      \
    double t = now();                                                                                 \
    for (long n = 0; n < N; n++) {                                                                    \
      _Pragma("GCC unroll 12") for (int i = 0; i < 12; i++) a[i] = OP(a[i], b, c);                    \
      __asm__ volatile("" : "+v"(b));                                                                 \
    }                                                                                                 \
    t = now() - t;                                                                                    \
    double s = 0;                                                                                     \
    for (int i = 0; i < 12; i++) s += (double)REDUCE(a[i]);                                          \
    printf("%s: %.2f G/s (%g)\n", label, N * 12 / t / 1e9, s);                                        \
  }
#define SET8_512(v) _mm512_set1_epi8(v)
#define SET8_256(v) _mm256_set1_epi8(v)
#define SETF_512(v) _mm512_set1_ps((v) == 3 ? 1.0001f : 0.9999f)
#define Y0(y) _mm256_extract_epi32(y, 0)
#define INITF_512(i) _mm512_set1_ps((float)(i))
int main(){
  const long N = 200000000;
  RATE("zmm vpdpbusd", __m512i, _mm512_set1_epi32, SET8_512, _mm512_dpbusd_epi32, _mm512_reduce_add_epi32)
  RATE("ymm vpdpbusd", __m256i, _mm256_set1_epi32, SET8_256, _mm256_dpbusd_epi32, Y0)
  RATE("zmm fma", __m512, INITF_512, SETF_512, _mm512_fmadd_ps, _mm512_reduce_add_ps)
}
