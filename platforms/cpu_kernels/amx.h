// AMX tile setup shared by the CPU platform's AMX kernels (panel_gemm.h: bf16; int8_gemm.cpp: int8).
#pragma once

#if defined(__AMX_TILE__) && defined(__linux__)
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstdint>

namespace halserve_amx {

// Whether Linux granted this process AMX's tile data (arch_prctl, asked once; oneDNN asks the same).
inline bool tile_data_granted() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette_id = 1;
  uint8_t start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// tiles 0-7 all 16 rows x 64 bytes (the kernels use 0-3 for C, 4-5 for A, 6-7 for B)
inline void configure_tiles() {
  TileConfig cfg;
  for (int t = 0; t < 8; ++t) {
    cfg.rows[t] = 16;
    cfg.colsb[t] = 64;
  }
  _tile_loadconfig(&cfg);
}

}  // namespace halserve_amx
#endif
