// What shares the unit vpdpbusd issues on (BENCHMARKS.md, "The GGUF kernel's two int8 levels summed in integers"):
// 8 vpdpbusd a loop alone, then with 4 vpaddd / vfmadd231ps / vcvtdq2ps / vpslld / vpandd added (ns per loop):
//   gcc -O3 -mavx512f -mavx512vnni -mavx512vl -mavx512bw -mfma vnni_ports.c -o /tmp/vnni_ports && /tmp/vnni_ports
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
#define N 100000000L
int main(){
  __m512i a[8], c2[4]; __m512i b=_mm512_set1_epi8(3), c=_mm512_set1_epi8(5);
  __m512 f[4]; __m512 fb=_mm512_set1_ps(1.0001f);
  _Pragma("GCC unroll 8") for(int i=0;i<8;i++) a[i]=_mm512_set1_epi32(i);
  for(int i=0;i<4;i++){ c2[i]=_mm512_set1_epi32(i); f[i]=_mm512_set1_ps(i);}
  double t; long s=0;
  // 8 vnni alone
  t=now(); for(long n=0;n<N;n++){ _Pragma("GCC unroll 8") for(int i=0;i<8;i++) a[i]=_mm512_dpbusd_epi32(a[i],b,c); __asm__ volatile(""::"v"(b)); }
  t=now()-t; printf("8 vnni: %.2f cyc-equiv ns/iter %.3f\n", 0.0, t/N*1e9);
  // 8 vnni + 4 vpaddd
  t=now(); for(long n=0;n<N;n++){ _Pragma("GCC unroll 8") for(int i=0;i<8;i++) a[i]=_mm512_dpbusd_epi32(a[i],b,c); _Pragma("GCC unroll 4") for(int i=0;i<4;i++) c2[i]=_mm512_add_epi32(c2[i],b); __asm__ volatile(""::"v"(b)); }
  t=now()-t; printf("8 vnni + 4 int add: ns/iter %.3f\n", t/N*1e9);
  // 8 vnni + 4 fma
  t=now(); for(long n=0;n<N;n++){ _Pragma("GCC unroll 8") for(int i=0;i<8;i++) a[i]=_mm512_dpbusd_epi32(a[i],b,c); _Pragma("GCC unroll 4") for(int i=0;i<4;i++) f[i]=_mm512_fmadd_ps(f[i],fb,fb); __asm__ volatile(""::"v"(b)); }
  t=now()-t; printf("8 vnni + 4 fma: ns/iter %.3f\n", t/N*1e9);
  // 8 vnni + 4 cvt
  __m512 g[4]; for(int i=0;i<4;i++) g[i]=f[i];
  t=now(); for(long n=0;n<N;n++){ _Pragma("GCC unroll 8") for(int i=0;i<8;i++) a[i]=_mm512_dpbusd_epi32(a[i],b,c); _Pragma("GCC unroll 4") for(int i=0;i<4;i++) g[i]=_mm512_cvtepi32_ps(c2[i]); __asm__ volatile(""::"v"(b),"v"(c2[0]),"v"(c2[1]),"v"(c2[2]),"v"(c2[3])); __asm__ volatile(""::"v"(g[0]),"v"(g[1]),"v"(g[2]),"v"(g[3]));}
  t=now()-t; printf("8 vnni + 4 cvt: ns/iter %.3f\n", t/N*1e9);
  // 8 vnni + 4 shift
  t=now(); for(long n=0;n<N;n++){ _Pragma("GCC unroll 8") for(int i=0;i<8;i++) a[i]=_mm512_dpbusd_epi32(a[i],b,c); _Pragma("GCC unroll 4") for(int i=0;i<4;i++) c2[i]=_mm512_slli_epi32(c2[i],1); __asm__ volatile(""::"v"(b)); }
  t=now()-t; printf("8 vnni + 4 shift: ns/iter %.3f\n", t/N*1e9);
  // 8 vnni + 4 and
  t=now(); for(long n=0;n<N;n++){ _Pragma("GCC unroll 8") for(int i=0;i<8;i++) a[i]=_mm512_dpbusd_epi32(a[i],b,c); _Pragma("GCC unroll 4") for(int i=0;i<4;i++) c2[i]=_mm512_and_si512(c2[i],b); __asm__ volatile(""::"v"(b)); }
  t=now()-t; printf("8 vnni + 4 and: ns/iter %.3f\n", t/N*1e9);
  for(int i=0;i<8;i++) s+=_mm512_reduce_add_epi32(a[i]); for(int i=0;i<4;i++) s+=_mm512_reduce_add_epi32(c2[i])+(long)_mm512_reduce_add_ps(f[i])+(long)_mm512_reduce_add_ps(g[i]);
  printf("%ld\n", s);
}
