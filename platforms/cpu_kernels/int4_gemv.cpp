// The native 4-bit GEMM's few-rows path (see int4_gemm.h, int4_gemm.cpp).
#include "int4_gemm.h"

#include <cstring>
#include <vector>

namespace halserve_panel {

#ifdef HALSERVE_PANEL_BF16

namespace {

// Few rows (decode of one to four sequences): x against one panel straight from the packed
// nibbles, with no bf16 weights written. bf16(128 + q) is the bit pattern 0x4300 | q, so each
// product x * (128 + q) is exact in float32, and each group's sums are scaled once:
//   out[i, n] = sum_g s[g, n] * (sum_{k in g} x[i, k] (128 + q[k, n]) - (128 + z[g, n]) sum_{k in g} x[i, k])
// bsum [RB, KB]: x's sum over each block of 32 packed rows.
template <int RB, typename T>
void gemv_panel(const bf16* x, int64_t ld, const float* bsum, const Int4Weight& w, int64_t nb, T* out, int64_t N) {
  const __m512i low4 = _mm512_set1_epi16(0xF), bias = _mm512_set1_epi16(0x4300);
  const __m512 c128 = _mm512_set1_ps(128.0f);
  __m512 res[RB][2], acc[RB][2];
  float rs[RB];
  for (int i = 0; i < RB; ++i) {
    res[i][0] = res[i][1] = acc[i][0] = acc[i][1] = _mm512_setzero_ps();
    rs[i] = 0.0f;
  }
  const uint8_t* q0 = w.qpack + 2 * nb * w.KB * kInt4TileBytes;
  const uint8_t* q1 = q0 + w.KB * kInt4TileBytes;
  for (int64_t kb = 0; kb < w.KB; ++kb) {
    for (int r = 0; r < 16; r += 2) {
      __m512i wt[2][2];  // [tile][row r, r + 1]
      for (int t = 0; t < 2; ++t) {
        // rows r, r + 1: 32 bytes -> 16-bit lanes [row r's 16 bytes | row r + 1's]
        const uint8_t* q = (t == 0 ? q0 : q1) + kb * kInt4TileBytes + r * 16;
        const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
        const __m512i lo = _mm512_ternarylogic_epi32(v, low4, bias, 0xEA);  // (v & 0xF) | 0x4300
        const __m512i hi = _mm512_or_si512(_mm512_srli_epi16(v, 4), bias);
        wt[t][0] = _mm512_shuffle_i64x2(lo, hi, 0x44);  // row r: elements 0-15 (low), 16-31 (high)
        wt[t][1] = _mm512_shuffle_i64x2(lo, hi, 0xEE);  // row r + 1
      }
      for (int i = 0; i < RB; ++i) {
        int32_t pair[2];  // x[i, 32 kb + 2 r .. + 3]
        std::memcpy(pair, x + i * ld + kb * kBlockK + 2 * r, sizeof(pair));
        const __m512bh a0 = (__m512bh)_mm512_set1_epi32(pair[0]), a1 = (__m512bh)_mm512_set1_epi32(pair[1]);
        for (int t = 0; t < 2; ++t) {
          acc[i][t] = _mm512_dpbf16_ps(acc[i][t], a0, (__m512bh)wt[t][0]);
          acc[i][t] = _mm512_dpbf16_ps(acc[i][t], a1, (__m512bh)wt[t][1]);
        }
      }
    }
    for (int i = 0; i < RB; ++i) rs[i] += bsum[i * w.KB + kb];
    const int64_t g = w.block_group[kb];
    if (kb + 1 < w.KB && w.block_group[kb + 1] == g) continue;
    for (int t = 0; t < 2; ++t) {  // the group's last block: scale its sums
      const int64_t col = g * w.Np + (2 * nb + t) * kTileN;
      const __m512 s = _mm512_loadu_ps(w.scales + col), zz = _mm512_add_ps(_mm512_loadu_ps(w.zeros + col), c128);
      for (int i = 0; i < RB; ++i) {
        const __m512 centred = _mm512_fnmadd_ps(zz, _mm512_set1_ps(rs[i]), acc[i][t]);
        res[i][t] = _mm512_fmadd_ps(s, centred, res[i][t]);
        acc[i][t] = _mm512_setzero_ps();
      }
    }
    for (int i = 0; i < RB; ++i) rs[i] = 0.0f;
  }
  alignas(64) float row[kPanelN];
  for (int i = 0; i < RB; ++i) {
    _mm512_store_ps(row, res[i][0]);
    _mm512_store_ps(row + kTileN, res[i][1]);
    write_rows(row, kPanelN, 1, out + i * N, N, nb * kPanelN);
  }
}


}  // namespace

template <typename T>
void int4_gemv(const XRows& xr, int64_t M, const Int4Weight& w, T* out, int64_t N) {
  std::vector<float> bsum(M * w.KB);  // [M, KB]
  for (int64_t i = 0; i < M; ++i) {
    const bf16* x = xr.row(i);
    for (int64_t kb = 0; kb < w.KB; ++kb) {
      float sum = 0.0f;
      for (int64_t j = 0; j < kBlockK; ++j) sum += static_cast<float>(x[kb * kBlockK + j]);
      bsum[i * w.KB + kb] = sum;
    }
  }
  at::parallel_for(0, w.Np / kPanelN, 1, [&](int64_t begin, int64_t end) {
    for (int64_t nb = begin; nb < end; ++nb) {
      const bf16* x = xr.row(0);
      if (M == 1) gemv_panel<1>(x, xr.ld, bsum.data(), w, nb, out, N);
      else if (M == 2) gemv_panel<2>(x, xr.ld, bsum.data(), w, nb, out, N);
      else if (M == 3) gemv_panel<3>(x, xr.ld, bsum.data(), w, nb, out, N);
      else gemv_panel<4>(x, xr.ld, bsum.data(), w, nb, out, N);
    }
  });
}

template void int4_gemv<float>(const XRows&, int64_t, const Int4Weight&, float*, int64_t);
template void int4_gemv<bf16>(const XRows&, int64_t, const Int4Weight&, bf16*, int64_t);

#endif  // HALSERVE_PANEL_BF16

}  // namespace halserve_panel
