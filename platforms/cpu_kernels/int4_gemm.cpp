// 4-bit weight-only GEMM (GPTQ, AWQ) of the CPU platform: the weight is dequantized to bf16
// one 32-column panel at a time into a per-thread buffer that stays in L2, and multiplied
// there with AMX tiles (or AVX512-BF16 dot products where AMX is missing or refused), with
// float32 accumulation. torch's int4 kernel re-dequantizes the weight every 4 rows of x; here
// one panel serves every row of a chunk of up to ~1 MB of x. Up to four rows (int4_gemv) the
// nibbles feed the dot products directly as bf16(128 + q), centred and scaled once per group.
//
//   int4_gemm(x [M, K] f32 | bf16, qpack, scales, zeros, block_group, src?, n, use_amx)
//       -> out [M, n] in x's dtype
//
// Prepared layout (built once at load by halserve.platforms.cpu_kernels.native_int4):
//   qpack  [Np/16, KB, 16, 16] uint8   KB = Kp / 32 blocks of 32 rows, Np = N rounded up to 32
//       byte b of tile row r of (column tile t, k block kb) holds elements j = b (low nibble)
//       and j = b + 16 (high nibble) of the AMX bf16 B-tile row r, the "VNNI" pair order:
//           element j -> column 16 t + j / 2, row 32 kb + 2 r + j % 2
//   scales [G, Np] f32, zeros [G, Np] f32:  w = (q - zeros[g]) * scales[g]
//   block_group [KB] int32: the group g of each block of 32 rows (act-order included)
//   src [Kp] int64 | None: the column of x feeding each packed row (K: a zero input pad)
//
// x is read in place when it is bf16 in the packed column order, else copied into bf16 [Mp, Kp]
// (columns in the packed order); AMX's 16-row tiles get x's last M % 16 rows zero-padded.
#include "int4_gemm.h"

#include <cstring>
#include <type_traits>
#include <vector>

namespace {

using namespace halserve_int4;

// The OS must grant AMX's tile data to a process once (Linux arch_prctl); oneDNN asks the
// same. False: AMX is absent from this build or refused by the kernel.
bool amx_ready() {
#ifdef HALSERVE_INT4_AMX
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
#else
  return false;
#endif
}

// x [M, K] -> xb [Mp, Kp] bf16: columns in the packed row order, zero pads.
template <typename T>
void gather_x(const T* x, int64_t M, int64_t K, const int64_t* src, int64_t Mp, int64_t Kp, bf16* xb) {
  at::parallel_for(0, Mp, 16, [&](int64_t begin, int64_t end) {
    for (int64_t m = begin; m < end; ++m) {
      bf16* row = xb + m * Kp;
      if (m >= M) {
        std::memset(row, 0, Kp * sizeof(bf16));
        continue;
      }
      const T* xr = x + m * K;
      if (src != nullptr) {
        for (int64_t p = 0; p < Kp; ++p) row[p] = src[p] < K ? bf16(static_cast<float>(xr[src[p]])) : bf16(0.0f);
      } else {
        int64_t p = 0;
#ifdef HALSERVE_INT4_BF16
        if constexpr (std::is_same_v<T, float>) {
          for (; p + 32 <= K; p += 32) {
            const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(xr + p + 16), _mm512_loadu_ps(xr + p));
            _mm512_storeu_si512(row + p, (__m512i)v);
          }
        }
#endif
        for (; p < K; ++p) row[p] = bf16(static_cast<float>(xr[p]));
        for (p = K; p < Kp; ++p) row[p] = bf16(0.0f);
      }
    }
  });
}

#ifdef HALSERVE_INT4_BF16


// One panel (column tiles 2 nb, 2 nb + 1) as bf16 B tiles: panel [KB][2][16 rows][32].
void dequant_panel(const Int4Weight& w, int64_t nb, bf16* panel) {
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
      const uint8_t* q = w.qpack + (tile * w.KB + kb) * kTileBytes;
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

// AVX512-BF16: RB rows of x against one panel; acc [RB][32] float32
template <int RB>
void dot_rows(const bf16* xb, int64_t ld, const bf16* panel, int64_t KB, float* acc) {
  __m512 c0[RB], c1[RB];
  for (int i = 0; i < RB; ++i) c0[i] = c1[i] = _mm512_setzero_ps();
  for (int64_t kb = 0; kb < KB; ++kb) {
    const bf16* b0 = panel + kb * 2 * kTileElems;
    const bf16* b1 = b0 + kTileElems;
    for (int r = 0; r < 16; ++r) {
      const __m512bh w0 = (__m512bh)_mm512_loadu_si512(b0 + r * 32);
      const __m512bh w1 = (__m512bh)_mm512_loadu_si512(b1 + r * 32);
      for (int i = 0; i < RB; ++i) {
        int32_t pair;  // x[i, 32 kb + 2 r], x[i, 32 kb + 2 r + 1]
        std::memcpy(&pair, xb + i * ld + kb * kBlockK + 2 * r, sizeof(pair));
        const __m512bh a = (__m512bh)_mm512_set1_epi32(pair);
        c0[i] = _mm512_dpbf16_ps(c0[i], a, w0);
        c1[i] = _mm512_dpbf16_ps(c1[i], a, w1);
      }
    }
  }
  for (int i = 0; i < RB; ++i) {
    _mm512_storeu_ps(acc + i * kPanelN, c0[i]);
    _mm512_storeu_ps(acc + i * kPanelN + kTileN, c1[i]);
  }
}

template <typename T>
void panel_avx512(const XRows& xr, int64_t m_begin, int64_t rows, const bf16* panel, int64_t KB, T* out, int64_t N,
                  int64_t col0) {
  float acc[8 * kPanelN];
  for (int64_t m = 0; m < rows;) {
    const int64_t left = rows - m;
    const int rb = left >= 8 ? 8 : left >= 4 ? 4 : left >= 2 ? 2 : 1;
    const bf16* x = xr.row(m_begin + m);  // the AVX512 path is given main_rows >= M
    if (rb == 8) dot_rows<8>(x, xr.ld, panel, KB, acc);
    else if (rb == 4) dot_rows<4>(x, xr.ld, panel, KB, acc);
    else if (rb == 2) dot_rows<2>(x, xr.ld, panel, KB, acc);
    else dot_rows<1>(x, xr.ld, panel, KB, acc);
    write_rows(acc, kPanelN, rb, out + m * N, N, col0);
    m += rb;
  }
}

#ifdef HALSERVE_INT4_AMX

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tiles 0-3: C (2 row blocks x 2 column tiles), 4-5: A (x rows), 6-7: B (the panel); all 16 x 64 B
void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

// rows [m_begin, m_begin + valid_rows) of x (16-row tiles: padded in xr) against one panel with AMX
template <typename T>
void panel_amx(const XRows& xr, int64_t m_begin, int64_t valid_rows, const bf16* panel, int64_t KB, T* out,
               int64_t N, int64_t col0) {
  alignas(64) float acc[32 * kPanelN];
  const int64_t x_stride = xr.ld * sizeof(bf16);
  for (int64_t m = 0; m < valid_rows; m += 32) {
    const bf16* x0 = xr.row(m_begin + m);
    const bool two = valid_rows - m > 16;
    const bf16* x1 = two ? xr.row(m_begin + m + 16) : nullptr;
    _tile_zero(0);
    _tile_zero(1);
    if (two) {
      _tile_zero(2);
      _tile_zero(3);
    }
    for (int64_t kb = 0; kb < KB; ++kb) {
      const bf16* b = panel + kb * 2 * kTileElems;
      _tile_loadd(6, b, 64);
      _tile_loadd(7, b + kTileElems, 64);
      _tile_loadd(4, x0 + kb * kBlockK, x_stride);
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      if (two) {
        _tile_loadd(5, x1 + kb * kBlockK, x_stride);
        _tile_dpbf16ps(2, 5, 6);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    const int64_t ld = kPanelN * sizeof(float);
    _tile_stored(0, acc, ld);
    _tile_stored(1, acc + kTileN, ld);
    if (two) {
      _tile_stored(2, acc + 16 * kPanelN, ld);
      _tile_stored(3, acc + 16 * kPanelN + kTileN, ld);
    }
    write_rows(acc, kPanelN, std::min<int64_t>(32, valid_rows - m), out + m * N, N, col0);
  }
}

#endif  // HALSERVE_INT4_AMX

template <typename T>
void int4_gemm_impl(const XRows& xr, int64_t M, int64_t Kp, const Int4Weight& w, T* out, int64_t N, bool use_amx) {
  if (M <= kGemvRows) return int4_gemv(xr, M, w, out, N);
  const int64_t num_panels = w.Np / kPanelN;
  // rows of x per pass over the panels: ~1 MB of bf16 x, a multiple of 32
  const int64_t chunk = std::max<int64_t>(32, kChunkBytes / (Kp * int64_t(sizeof(bf16))) / 32 * 32);
  at::parallel_for(0, num_panels, 1, [&](int64_t begin, int64_t end) {
    std::vector<bf16> panel(w.KB * 2 * kTileElems);
#ifdef HALSERVE_INT4_AMX
    if (use_amx) configure_tiles();
#endif
    for (int64_t m0 = 0; m0 < M; m0 += chunk) {
      const int64_t valid = std::min(chunk, M - m0);
      for (int64_t nb = begin; nb < end; ++nb) {
        dequant_panel(w, nb, panel.data());
        const int64_t col0 = nb * kPanelN;
#ifdef HALSERVE_INT4_AMX
        if (use_amx) {
          panel_amx(xr, m0, valid, panel.data(), w.KB, out + m0 * N, N, col0);
          continue;
        }
#endif
        panel_avx512(xr, m0, valid, panel.data(), w.KB, out + m0 * N, N, col0);
      }
    }
#ifdef HALSERVE_INT4_AMX
    if (use_amx) _tile_release();
#endif
  });
}

#endif  // HALSERVE_INT4_BF16

// "amx", "avx512_bf16" or "" (no native 4-bit GEMM in this build)
std::string int4_gemm_isa() {
#ifdef HALSERVE_INT4_BF16
  return amx_ready() ? "amx" : "avx512_bf16";
#else
  return "";
#endif
}

torch::Tensor int4_gemm(const torch::Tensor& x, const torch::Tensor& qpack, const torch::Tensor& scales,
                        const torch::Tensor& zeros, const torch::Tensor& block_group,
                        const c10::optional<torch::Tensor>& src, int64_t n, bool use_amx) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == torch::kFloat || x.scalar_type() == torch::kBFloat16),
              "int4_gemm takes x float32 or bfloat16 [M, K], got ", x.scalar_type(), " ", x.sizes());
  TORCH_CHECK(qpack.dim() == 4 && qpack.scalar_type() == torch::kByte && qpack.size(2) == 16 && qpack.size(3) == 16,
              "qpack must be uint8 [Np/16, KB, 16, 16], got ", qpack.sizes());
  const int64_t Np = qpack.size(0) * kTileN, KB = qpack.size(1), Kp = KB * kBlockK;
  TORCH_CHECK(Np % kPanelN == 0 && n <= Np && n > Np - kPanelN, "n=", n, " does not match qpack's ", Np, " columns");
  TORCH_CHECK(scales.scalar_type() == torch::kFloat && zeros.scalar_type() == torch::kFloat && scales.dim() == 2 &&
                  scales.sizes() == zeros.sizes() && scales.size(1) == Np,
              "scales and zeros must be float32 [G, ", Np, "]");
  TORCH_CHECK(block_group.scalar_type() == torch::kInt && block_group.numel() == KB, "block_group must be int32 [",
              KB, "]");
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t* src_ptr = nullptr;
  torch::Tensor src_c;
  if (src.has_value()) {
    src_c = src->contiguous();
    TORCH_CHECK(src_c.scalar_type() == torch::kLong && src_c.numel() == Kp, "src must be int64 [", Kp, "]");
    src_ptr = src_c.data_ptr<int64_t>();
  } else {
    TORCH_CHECK(K <= Kp && K > Kp - kBlockK, "x has K=", K, "; the weight was packed for ", Kp, " rows");
  }
  auto out = torch::empty({M, n}, x.options());
  if (M == 0) return out;
#ifdef HALSERVE_INT4_BF16
  TORCH_CHECK(!use_amx || amx_ready(), "int4_gemm: AMX is not available (int4_gemm_isa() says which ISA is)");
  // x itself when it is already bf16 in the packed order, else a bf16 copy; AMX reads whole
  // 16-row tiles, so x's last M % 16 rows go to a zero-padded tail
  const bool direct = x.scalar_type() == torch::kBFloat16 && x.is_contiguous() && !src_ptr && K == Kp;
  const int64_t M16 = M / 16 * 16, Mp = (M + 15) / 16 * 16;
  torch::Tensor xb;
  XRows xr{nullptr, nullptr, 0, Kp};
  if (direct) {
    xr.main = x.data_ptr<bf16>();
    xr.main_rows = use_amx ? M16 : M;
    if (use_amx && M16 < M) {
      xb = torch::zeros({16, Kp}, x.options());
      xb.narrow(0, 0, M - M16).copy_(x.narrow(0, M16, M - M16));
      xr.tail = xb.data_ptr<bf16>();
    }
  } else {
    xb = torch::empty({Mp, Kp}, x.options().dtype(torch::kBFloat16));
    auto xc = x.contiguous();
    if (x.scalar_type() == torch::kFloat)
      gather_x(xc.data_ptr<float>(), M, K, src_ptr, Mp, Kp, xb.data_ptr<bf16>());
    else
      gather_x(xc.data_ptr<bf16>(), M, K, src_ptr, Mp, Kp, xb.data_ptr<bf16>());
    xr.main = xb.data_ptr<bf16>();
    xr.main_rows = Mp;
  }
  auto qc = qpack.contiguous(), sc = scales.contiguous(), zc = zeros.contiguous(), bg = block_group.contiguous();
  const Int4Weight w{qc.data_ptr<uint8_t>(), sc.data_ptr<float>(), zc.data_ptr<float>(), bg.data_ptr<int32_t>(), KB,
                     Np};
  if (x.scalar_type() == torch::kFloat)
    int4_gemm_impl(xr, M, Kp, w, out.data_ptr<float>(), n, use_amx);
  else
    int4_gemm_impl(xr, M, Kp, w, out.data_ptr<bf16>(), n, use_amx);
  return out;
#else
  TORCH_CHECK(false, "int4_gemm needs AVX512-BF16, which this build of the native kernels lacks");
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(halserve_cpu, m) {
  m.def("int4_gemm(Tensor x, Tensor qpack, Tensor scales, Tensor zeros, Tensor block_group, Tensor? src, int n, "
        "bool use_amx) -> Tensor");
  m.impl("int4_gemm", torch::kCPU, &int4_gemm);
  m.def("int4_gemm_isa() -> str", &int4_gemm_isa);
}
