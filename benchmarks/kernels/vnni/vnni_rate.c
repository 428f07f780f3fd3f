// The integer unit's rate on this CPU (BENCHMARKS.md, "The GGUF kernel's two int8 levels summed in integers"):
// 12 independent chains of 512-bit vpdpbusd, 256-bit vpdpbusd and 512-bit FMA, one core; run two copies at once
// for both cores:  gcc -O2 -mavx512f -mavx512vnni -mavx512vl -mavx512bw -mfma vnni_rate.c -o /tmp/vnni_rate && /tmp/vnni_rate
#include <immintrin.h>
#include <stdio.h>
#include <time.h>
static double now(){struct timespec t;clock_gettime(CLOCK_MONOTONIC,&t);return t.tv_sec+t.tv_nsec*1e-9;}
int main(){
  __m512i a[12]; __m512i b=_mm512_set1_epi8(3), c=_mm512_set1_epi8(5);
  for(int i=0;i<12;i++) a[i]=_mm512_set1_epi32(i);
  long N=200000000; double t=now();
  for(long n=0;n<N;n++){
    #pragma GCC unroll 12
    for(int i=0;i<12;i++) a[i]=_mm512_dpbusd_epi32(a[i],b,c);
    __asm__ volatile("" : "+v"(b));
  }
  t=now()-t; long s=0; for(int i=0;i<12;i++) s+=_mm512_reduce_add_epi32(a[i]);
  printf("zmm vpdpbusd: %.2f G/s (%ld)\n", N*12/t/1e9, s);
  __m256i y[12]; __m256i yb=_mm256_set1_epi8(3), yc=_mm256_set1_epi8(5);
  for(int i=0;i<12;i++) y[i]=_mm256_set1_epi32(i);
  t=now();
  for(long n=0;n<N;n++){
    #pragma GCC unroll 12
    for(int i=0;i<12;i++) y[i]=_mm256_dpbusd_epi32(y[i],yb,yc);
    __asm__ volatile("" : "+v"(yb));
  }
  t=now()-t; s=0; for(int i=0;i<12;i++) s+=_mm256_extract_epi32(y[i],0);
  printf("ymm vpdpbusd: %.2f G/s (%ld)\n", N*12/t/1e9, s);
  __m512 f[12]; __m512 fb=_mm512_set1_ps(1.0001f), fc=_mm512_set1_ps(0.9999f);
  for(int i=0;i<12;i++) f[i]=_mm512_set1_ps(i);
  t=now();
  for(long n=0;n<N;n++){
    #pragma GCC unroll 12
    for(int i=0;i<12;i++) f[i]=_mm512_fmadd_ps(f[i],fb,fc);
    __asm__ volatile("" : "+v"(fb));
  }
  t=now()-t; float fs=0; for(int i=0;i<12;i++) fs+=_mm512_reduce_add_ps(f[i]);
  printf("zmm fma: %.2f G/s (%f)\n", N*12/t/1e9, fs);
}
