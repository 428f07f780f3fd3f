// fp8 W8A8 GEMMs of the CPU platform on the panel GEMM (panel_gemm.h). Both operands become bf16
// through fp16 (an e4m3fn byte's magnitude shifted into fp16's bits is its value times 2^-8,
// subnormals included; an e5m2 byte is the high byte of an fp16): exact, so with per-token and
// per-channel (or per-tensor) scales the sums are those of the fp8 values, scaled once at the end:
//
//   fp8_gemm(a [M, K] fp8, qpack, scale_a [M, 1] | [1], scale_b [N, 1] | [1] | [ceil(N/Bn), ceil(K/Bk)],
//            bias [N]?, n, block_n, block_k, out_bf16, use_amx) -> out [M, n] float32 | bfloat16
//
//   block_n = block_k = 0: out = (a * scale_a) @ (b * scale_b).T + bias   (sums exact, scaled after)
//   block-scaled (DeepSeek-V3 style; scale_a [M, ceil(K/Bk)]): the exact sums of each group of Bk
//   inputs are scaled by scale_a[m, g] * scale_b[n / Bn, g] as they add up (panel_gemm.h's GroupScales).
//
// qpack [Np/16, KB, 16, 32] uint8 (built once at load by halserve.platforms.cpu_kernels.native_fp8):
// byte j of tile row r of (column tile t, k block kb) is the fp8 weight of column 16 t + j / 2,
// row 32 kb + 2 r + j % 2 (panel_gemm.h's B-tile order); padding is 0 (+0.0).
// e4m3fn's NaN (0x7F, 0xFF) reads as 480: checkpoints hold no NaN weights.
#include "panel_gemm.h"

namespace {

using namespace halserve_panel;

constexpr int64_t kFp8TileBytes = 16 * 32;  // packed bytes per (column tile, k block)

#ifdef HALSERVE_PANEL_BF16

// 32 fp8 bytes -> two halves of 16 floats: the value times 2^-8 (e4m3fn) or the value (e5m2)
inline void fp8_to_ps(const uint8_t* q, bool e5m2, __m512& lo, __m512& hi) {
  const __m512i v = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(q)));
  __m512i h;
  if (e5m2) {
    h = _mm512_slli_epi16(v, 8);
  } else {
    const __m512i mag = _mm512_slli_epi16(_mm512_and_si512(v, _mm512_set1_epi16(0x7F)), 7);
    h = _mm512_or_si512(mag, _mm512_slli_epi16(_mm512_and_si512(v, _mm512_set1_epi16(0x80)), 8));
  }
  lo = _mm512_cvtph_ps(_mm512_castsi512_si256(h));
  hi = _mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1));
}

inline __m512i to_bf16(__m512 lo, __m512 hi) { return (__m512i)_mm512_cvtne2ps_pbh(hi, lo); }

// One panel of the fp8 weight (qpack, KB blocks) as bf16 B tiles [KB][2][16][32], exactly
void dequant_fp8_panel(const uint8_t* qpack, int64_t KB, bool e5m2, int64_t nb, bf16* panel) {
  for (int64_t t = 0; t < 2; ++t) {
    for (int64_t kb = 0; kb < KB; ++kb) {
      const uint8_t* q = qpack + ((2 * nb + t) * KB + kb) * kFp8TileBytes;
      bf16* out = panel + (kb * 2 + t) * kTileElems;
      for (int r = 0; r < 16; ++r) {
        __m512 lo, hi;
        fp8_to_ps(q + r * 32, e5m2, lo, hi);
        _mm512_storeu_si512(out + r * 32, to_bf16(lo, hi));
      }
    }
  }
}

// a [M, K] fp8 -> [Mp, Kp] bf16, exactly (zero pads): a * 2^-8 (e4m3fn) or a (e5m2)
void fp8_rows_to_bf16(const uint8_t* a, int64_t M, int64_t K, int64_t Mp, int64_t Kp, bool e5m2, bf16* out) {
  at::parallel_for(0, Mp, 16, [&](int64_t begin, int64_t end) {
    alignas(64) uint8_t tail[32];
    for (int64_t m = begin; m < end; ++m) {
      bf16* row = out + m * Kp;
      std::memset(row, 0, Kp * sizeof(bf16));
      if (m >= M) continue;
      for (int64_t p = 0; p < K; p += 32) {
        const uint8_t* src = a + m * K + p;
        if (p + 32 > K) {  // the last partial block: zero bytes are +0.0
          std::memset(tail, 0, sizeof(tail));
          std::memcpy(tail, src, K - p);
          src = tail;
        }
        __m512 lo, hi;
        fp8_to_ps(src, e5m2, lo, hi);
        _mm512_storeu_si512(row + p, to_bf16(lo, hi));
      }
    }
  });
}

// rows m.. of the float32 sums -> out, times row_scale[m] * col_scale[n], plus bias[n]
template <typename T>
struct ScaledWriter {
  T* out;
  int64_t N;
  const float* row_scale;  // [M] or nullptr (1)
  const float* col_scale;  // [Np] or nullptr (1)
  const float* bias;       // [Np] or nullptr
  void operator()(const float* acc, int64_t ld, int64_t m, int64_t rows, int64_t col0) const {
    alignas(64) float row[kPanelN];
    const int64_t cols = std::min<int64_t>(kPanelN, N - col0);
    for (int64_t i = 0; i < rows; ++i) {
      const __m512 rs = _mm512_set1_ps(row_scale ? row_scale[m + i] : 1.0f);
      for (int h = 0; h < 2; ++h) {
        __m512 v = _mm512_mul_ps(_mm512_loadu_ps(acc + i * ld + h * kTileN), rs);
        if (col_scale) v = _mm512_mul_ps(v, _mm512_loadu_ps(col_scale + col0 + h * kTileN));
        if (bias) v = _mm512_add_ps(v, _mm512_loadu_ps(bias + col0 + h * kTileN));
        _mm512_store_ps(row + h * kTileN, v);
      }
      store_row(row, out + (m + i) * N + col0, cols);
    }
  }
};

#endif  // HALSERVE_PANEL_BF16

// a scale of one value, or of `count` values, as `count` floats
std::vector<float> expand_scale(const at::Tensor& scale, int64_t count, int64_t padded, const char* what) {
  auto s = scale.to(at::kFloat).contiguous();
  TORCH_CHECK(s.numel() == 1 || s.numel() == count, what, " must hold 1 or ", count, " values, got ", s.sizes());
  std::vector<float> v(padded, 0.0f);
  const float* p = s.data_ptr<float>();
  for (int64_t i = 0; i < count; ++i) v[i] = s.numel() == 1 ? p[0] : p[i];
  return v;
}

at::Tensor fp8_gemm(const at::Tensor& a, const at::Tensor& qpack, const at::Tensor& scale_a,
                       const at::Tensor& scale_b, const c10::optional<at::Tensor>& bias, int64_t n,
                       int64_t block_n, int64_t block_k, bool out_bf16, bool use_amx) {
  const bool e5m2 = a.scalar_type() == at::kFloat8_e5m2;
  TORCH_CHECK(a.dim() == 2 && (e5m2 || a.scalar_type() == at::kFloat8_e4m3fn),
              "fp8_gemm takes a float8_e4m3fn or float8_e5m2 [M, K], got ", a.scalar_type(), " ", a.sizes());
  TORCH_CHECK(qpack.dim() == 4 && qpack.scalar_type() == at::kByte && qpack.size(2) == 16 && qpack.size(3) == 32,
              "qpack must be uint8 [Np/16, KB, 16, 32], got ", qpack.sizes());
  const int64_t Np = qpack.size(0) * kTileN, KB = qpack.size(1), Kp = KB * kBlockK;
  const int64_t M = a.size(0), K = a.size(1);
  TORCH_CHECK(Np % kPanelN == 0 && n <= Np && n > Np - kPanelN, "n=", n, " does not match qpack's ", Np, " columns");
  TORCH_CHECK(K <= Kp && K > Kp - kBlockK, "a has K=", K, "; the weight was packed for ", Kp, " rows");
  const bool blocked = block_n > 0;
  TORCH_CHECK(!blocked || (block_n % kTileN == 0 && block_k % kBlockK == 0), "fp8_gemm: block sizes (", block_n, ", ",
              block_k, ") must be multiples of (16, 32)");
  auto out = at::empty({M, n}, a.options().dtype(out_bf16 ? at::kBFloat16 : at::kFloat));
  if (M == 0) return out;
#ifdef HALSERVE_PANEL_BF16
  TORCH_CHECK(!use_amx || amx_ready(), "fp8_gemm: AMX is not available (panel_gemm_isa() says which ISA is)");
  auto ac = a.contiguous(), qc = qpack.contiguous();
  const float unit = e5m2 ? 1.0f : 65536.0f;  // both operands read as value * 2^-8
  at::Tensor sa, sb;
  std::vector<float> row_scale, col_scale, bias_v;
  GroupScales groups{};
  if (blocked) {
    sa = scale_a.to(at::kFloat).contiguous();
    sb = scale_b.to(at::kFloat).contiguous();
    const int64_t num_groups = (K + block_k - 1) / block_k;
    TORCH_CHECK(sa.dim() == 2 && sa.size(0) == M && sa.size(1) == num_groups, "scale_a must be [", M, ", ",
                num_groups, "]");
    TORCH_CHECK(sb.dim() == 2 && sb.size(0) == (n + block_n - 1) / block_n && sb.size(1) == num_groups,
                "scale_b must be [ceil(N/", block_n, "), ", num_groups, "]");
    groups = GroupScales{sa.data_ptr<float>(), sb.data_ptr<float>(), block_k / kBlockK, num_groups, block_n,
                         sb.size(0), unit};
  } else {
    row_scale = expand_scale(scale_a, M, M, "scale_a");
    col_scale = expand_scale(scale_b, n, Np, "scale_b");
    for (auto& s : row_scale) s *= unit;
  }
  if (bias.has_value()) bias_v = expand_scale(*bias, n, Np, "bias");
  const int64_t Mp = (M + 15) / 16 * 16;
  auto xb = at::empty({Mp, Kp}, a.options().dtype(at::kBFloat16));
  fp8_rows_to_bf16(reinterpret_cast<const uint8_t*>(ac.data_ptr()), M, K, Mp, Kp, e5m2, xb.data_ptr<bf16>());
  const XRows xr{xb.data_ptr<bf16>(), nullptr, Mp, Kp};
  const uint8_t* q = qc.data_ptr<uint8_t>();
  auto dequant = [&](int64_t nb, bf16* panel) { dequant_fp8_panel(q, KB, e5m2, nb, panel); };
  const float* rs = blocked ? nullptr : row_scale.data();
  const float* cs = blocked ? nullptr : col_scale.data();
  const float* bp = bias_v.empty() ? nullptr : bias_v.data();
  const GroupScales* gs = blocked ? &groups : nullptr;
  if (out_bf16)
    panel_gemm(xr, M, KB, Np, dequant, ScaledWriter<bf16>{out.data_ptr<bf16>(), n, rs, cs, bp}, use_amx, gs);
  else
    panel_gemm(xr, M, KB, Np, dequant, ScaledWriter<float>{out.data_ptr<float>(), n, rs, cs, bp}, use_amx, gs);
  return out;
#else
  TORCH_CHECK(false, "fp8_gemm needs AVX512-BF16, which this build of the native kernels lacks");
#endif
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(halserve_cpu, m) {
  m.def("fp8_gemm(Tensor a, Tensor qpack, Tensor scale_a, Tensor scale_b, Tensor? bias, int n, int block_n, "
        "int block_k, bool out_bf16, bool use_amx) -> Tensor");
  m.impl("fp8_gemm", c10::DeviceType::CPU, &fp8_gemm);
}
