// 4-bit weight-only GEMM (GPTQ, AWQ) of the CPU platform on the panel GEMM (panel_gemm.h): a
// panel's nibbles become bf16 weights w = q * s + zf (float32, zf = -z * s exact for fp16
// scales, rounded once). torch's int4 kernel re-dequantizes the weight every 4 rows of x; here
// one panel serves a chunk of up to ~1 MB of x. Up to four rows (int4_gemv.cpp) the nibbles
// feed the dot products directly as bf16(128 + q), centred and scaled once per group.
//
//   int4_gemm(x [M, K] f32 | bf16, qpack, scales, zeros, block_group, src?, n, use_amx)
//       -> out [M, n] in x's dtype
//
// Prepared layout (built once at load by halserve.platforms.cpu_kernels.native_int4):
//   qpack  [Np/16, KB, 16, 16] uint8   KB = Kp / 32 blocks of 32 rows, Np = N rounded up to 32
//       byte b of tile row r of (column tile t, k block kb) holds elements j = b (low nibble)
//       and j = b + 16 (high nibble) of the B-tile row r (panel_gemm.h's element order)
//   scales [G, Np] f32, zeros [G, Np] f32:  w = (q - zeros[g]) * scales[g]
//   block_group [KB] int32: the group g of each block of 32 rows (act-order included)
//   src [Kp] int64 | None: the column of x feeding each packed row (K: a zero input pad)
#include "int4_gemm.h"

namespace {

using namespace halserve_panel;

#ifdef HALSERVE_PANEL_BF16

// One panel (column tiles 2 nb, 2 nb + 1) as bf16 B tiles: panel [KB][2][16 rows][32].
void dequant_int4_panel(const Int4Weight& w, int64_t nb, bf16* panel) {
  const __m512i pair_lo = _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const __m512i pair_hi = _mm512_set_epi32(15, 15, 14, 14, 13, 13, 12, 12, 11, 11, 10, 10, 9, 9, 8, 8);
  const __m512i low4 = _mm512_set1_epi32(0xF);
  for (int64_t kb = 0; kb < w.KB; ++kb) {
    const int64_t g = w.block_group[kb];
    for (int64_t t = 0; t < 2; ++t) {
      const int64_t tile = 2 * nb + t;
      const __m512 s = _mm512_loadu_ps(w.scales + g * w.Np + tile * kTileN);
      const __m512 z = _mm512_loadu_ps(w.zeros + g * w.Np + tile * kTileN);
      // element j of a row is column j / 2: lanes 0-15 take columns 0-7, lanes 16-31 8-15
      const __m512 s_lo = _mm512_permutexvar_ps(pair_lo, s), s_hi = _mm512_permutexvar_ps(pair_hi, s);
      // zf = -z * s, exact for fp16 scales: w = q * s + zf rounds once
      const __m512 z_lo = _mm512_fnmadd_ps(_mm512_permutexvar_ps(pair_lo, z), s_lo, _mm512_setzero_ps());
      const __m512 z_hi = _mm512_fnmadd_ps(_mm512_permutexvar_ps(pair_hi, z), s_hi, _mm512_setzero_ps());
      const uint8_t* q = w.qpack + (tile * w.KB + kb) * kInt4TileBytes;
      bf16* out = panel + (kb * 2 + t) * kTileElems;
      for (int r = 0; r < 16; ++r) {
        const __m512i v = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q + r * 16)));
        const __m512 lo = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_and_si512(v, low4)), s_lo, z_lo);
        const __m512 hi = _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_srli_epi32(v, 4)), s_hi, z_hi);
        _mm512_storeu_si512(out + r * 32, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
      }
    }
  }
}

template <typename T>
void int4_gemm_impl(const XRows& xr, int64_t M, const Int4Weight& w, T* out, int64_t N, bool use_amx) {
  if (M <= kGemvRows) return int4_gemv(xr, M, w, out, N);
  panel_gemm(
      xr, M, w.KB, w.Np, [&](int64_t nb, bf16* panel) { dequant_int4_panel(w, nb, panel); },
      [&](const float* acc, int64_t ld, int64_t m, int64_t rows, int64_t col0) {
        write_rows(acc, ld, rows, out + m * N, N, col0);
      },
      use_amx);
}

#endif  // HALSERVE_PANEL_BF16

at::Tensor int4_gemm(const at::Tensor& x, const at::Tensor& qpack, const at::Tensor& scales,
                        const at::Tensor& zeros, const at::Tensor& block_group,
                        const c10::optional<at::Tensor>& src, int64_t n, bool use_amx) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16),
              "int4_gemm takes x float32 or bfloat16 [M, K], got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(qpack.dim() == 4 && qpack.scalar_type() == at::kByte && qpack.size(2) == 16 && qpack.size(3) == 16,
              "qpack must be uint8 [Np/16, KB, 16, 16], got ", qpack.sizes());
  const int64_t Np = qpack.size(0) * kTileN, KB = qpack.size(1), Kp = KB * kBlockK;
  TORCH_CHECK(Np % kPanelN == 0 && n <= Np && n > Np - kPanelN, "n=", n, " does not match qpack's ", Np, " columns");
  TORCH_CHECK(scales.scalar_type() == at::kFloat && zeros.scalar_type() == at::kFloat && scales.dim() == 2 &&
                  scales.sizes() == zeros.sizes() && scales.size(1) == Np,
              "scales and zeros must be float32 [G, ", Np, "]");
  TORCH_CHECK(block_group.scalar_type() == at::kInt && block_group.numel() == KB, "block_group must be int32 [",
              KB, "]");
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t* src_ptr = nullptr;
  at::Tensor src_c;
  if (src.has_value()) {
    src_c = src->contiguous();
    TORCH_CHECK(src_c.scalar_type() == at::kLong && src_c.numel() == Kp, "src must be int64 [", Kp, "]");
    src_ptr = src_c.data_ptr<int64_t>();
  } else {
    TORCH_CHECK(K <= Kp && K > Kp - kBlockK, "x has K=", K, "; the weight was packed for ", Kp, " rows");
  }
  auto out = at::empty({M, n}, x.options());
  if (M == 0) return out;
#ifdef HALSERVE_PANEL_BF16
  TORCH_CHECK(!use_amx || amx_ready(), "int4_gemm: AMX is not available (panel_gemm_isa() says which ISA is)");
  at::Tensor storage;
  const XRows xr = prepare_x(x, src_ptr, Kp, use_amx, storage);
  auto qc = qpack.contiguous(), sc = scales.contiguous(), zc = zeros.contiguous(), bg = block_group.contiguous();
  const Int4Weight w{qc.data_ptr<uint8_t>(), sc.data_ptr<float>(), zc.data_ptr<float>(), bg.data_ptr<int32_t>(), KB,
                     Np};
  if (x.scalar_type() == at::kFloat)
    int4_gemm_impl(xr, M, w, out.data_ptr<float>(), n, use_amx);
  else
    int4_gemm_impl(xr, M, w, out.data_ptr<bf16>(), n, use_amx);
  return out;
#else
  TORCH_CHECK(false, "int4_gemm needs AVX512-BF16, which this build of the native kernels lacks");
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(halserve_cpu, m) {
  m.def("int4_gemm(Tensor x, Tensor qpack, Tensor scales, Tensor zeros, Tensor block_group, Tensor? src, int n, "
        "bool use_amx) -> Tensor");
  m.impl("int4_gemm", c10::DeviceType::CPU, &int4_gemm);
}
