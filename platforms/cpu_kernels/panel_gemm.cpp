// The panel GEMM's non-template parts (see panel_gemm.h): AMX permission, x in bf16.
#include "panel_gemm.h"

#include <type_traits>


namespace halserve_panel {

bool amx_ready() {
#ifdef HALSERVE_PANEL_AMX
  return halserve_amx::tile_data_granted();
#else
  return false;
#endif
}

std::string panel_gemm_isa() {
#ifdef HALSERVE_PANEL_BF16
  return amx_ready() ? "amx" : "avx512_bf16";
#else
  return "";
#endif
}

namespace {

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
        continue;
      }
      int64_t p = 0;
#ifdef HALSERVE_PANEL_BF16
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
  });
}

}  // namespace

XRows prepare_x(const at::Tensor& x, const int64_t* src, int64_t Kp, bool use_amx, at::Tensor& storage) {
  const int64_t M = x.size(0), K = x.size(1);
  const int64_t M16 = M / 16 * 16, Mp = (M + 15) / 16 * 16;
  XRows xr{nullptr, nullptr, 0, Kp};
  if (x.scalar_type() == at::kBFloat16 && x.is_contiguous() && !src && K == Kp) {
    // x itself; AMX reads whole 16-row tiles, so its last M % 16 rows go to a zero-padded tail
    xr.main = x.data_ptr<bf16>();
    xr.main_rows = use_amx ? M16 : M;
    if (use_amx && M16 < M) {
      storage = at::zeros({16, Kp}, x.options());
      storage.narrow(0, 0, M - M16).copy_(x.narrow(0, M16, M - M16));
      xr.tail = storage.data_ptr<bf16>();
    }
    return xr;
  }
  storage = at::empty({Mp, Kp}, x.options().dtype(at::kBFloat16));
  auto xc = x.contiguous();
  bf16* xb = storage.data_ptr<bf16>();
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "the panel GEMM takes x float32 or bfloat16, got ", x.scalar_type());
  if (x.scalar_type() == at::kFloat)
    gather_x(xc.data_ptr<float>(), M, K, src, Mp, Kp, xb);
  else
    gather_x(xc.data_ptr<bf16>(), M, K, src, Mp, Kp, xb);
  xr.main = storage.data_ptr<bf16>();
  xr.main_rows = Mp;
  return xr;
}

}  // namespace halserve_panel

// This file is compiled into each library whose GEMM runs on the panel (__init__.py's LIBRARIES: int4,
// fp8), and an op may be registered once per process: each library names its ISA query through
// -DHALSERVE_PANEL_ISA_OP (torch.ops.halserve_cpu.int4_panel_gemm_isa, ...).
#ifndef HALSERVE_PANEL_ISA_OP
#define HALSERVE_PANEL_ISA_OP panel_gemm_isa
#endif
#define HALSERVE_PANEL_STR2(x) #x
#define HALSERVE_PANEL_STR(x) HALSERVE_PANEL_STR2(x)

TORCH_LIBRARY_FRAGMENT(halserve_cpu, m) {
  m.def(HALSERVE_PANEL_STR(HALSERVE_PANEL_ISA_OP) "() -> str", &halserve_panel::panel_gemm_isa);
}
