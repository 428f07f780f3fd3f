// Paged attention for the CPU platform's `cpu_native` backend (float32).
//
// Cache layout, one tensor per layer: kv_cache [2, num_blocks, Hk, B * D] where
//   keys   kv_cache[0][blk][h] is [D, B]   (token-minor: B consecutive tokens per d)
//   values kv_cache[1][blk][h] is [B, D]   (row per token)
// Keys are stored transposed so that q . k for the B tokens of a block is D vector
// FMAs of width B with no horizontal sums; values keep rows so p * v is D-wide FMAs.
//
//   decode(q [N, Hq, D], kv_cache, block_table [N, max_blocks] int32, seq_lens [N] int32)
//     one query per request at position seq_len - 1; keys t with
//     seq_len - 1 - window < t < seq_len are visible (window 0 = no window).
// Work is split over (request, kv head) pairs with at::parallel_for (torch's thread
// pool); each task reads its head's blocks once and serves the G = Hq / Hk query heads
// that share it.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace {

// 16 floats: one AVX-512 register (two AVX2 registers; GCC lowers it for any target).
typedef float v16 __attribute__((vector_size(64), aligned(4)));

// s[g][0:16] = sum_d q[g][d] * kb[d][0:16] for a block of 16 tokens, G accumulators in
// registers (keys are stored [D, B] per block, so each d is one 16-wide load).
template <int G>
inline void score_block16(const float* qh, const float* kb, int64_t D, float* s) {
  v16 acc[G];
  for (int g = 0; g < G; ++g) acc[g] = v16{};
  for (int64_t d = 0; d < D; ++d) {
    v16 k;
    __builtin_memcpy(&k, kb + d * 16, sizeof(v16));
    for (int g = 0; g < G; ++g) acc[g] += qh[g * D + d] * k;
  }
  for (int g = 0; g < G; ++g) __builtin_memcpy(s + g * 16, &acc[g], sizeof(v16));
}

// Generic fallback: any block size, any group size.
inline void score_block(const float* qh, const float* kb, int64_t D, int64_t B, int64_t G, float* s) {
  std::fill(s, s + G * B, 0.f);
  for (int64_t d = 0; d < D; ++d) {
    const float* kd = kb + d * B;
    for (int64_t g = 0; g < G; ++g) {
      const float qv = qh[g * D + d];
      float* sg = s + g * B;
#pragma omp simd
      for (int64_t t = 0; t < B; ++t) sg[t] += qv * kd[t];
    }
  }
}

inline void score_any(const float* qh, const float* kb, int64_t D, int64_t B, int64_t G, float* s) {
  if (B == 16) {
    switch (G) {
      case 1: return score_block16<1>(qh, kb, D, s);
      case 2: return score_block16<2>(qh, kb, D, s);
      case 3: return score_block16<3>(qh, kb, D, s);
      case 4: return score_block16<4>(qh, kb, D, s);
      case 5: return score_block16<5>(qh, kb, D, s);
      case 6: return score_block16<6>(qh, kb, D, s);
      case 7: return score_block16<7>(qh, kb, D, s);
      case 8: return score_block16<8>(qh, kb, D, s);
      default: break;
    }
  }
  score_block(qh, kb, D, B, G, s);
}

// acc[g][0:D] += p[g] * v[0:D] over the rows of one block, accumulators in registers
// when D = 16 * NV (G * NV <= 24 registers).
template <int G, int NV>
inline void pv_rows(const float* vb, const float* p, int64_t p_stride, int64_t base, int64_t lo, int64_t hi, int64_t t0, float* acc) {
  constexpr int D = 16 * NV;
  v16 a[G][NV];
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < NV; ++j) __builtin_memcpy(&a[g][j], acc + g * D + j * 16, sizeof(v16));
  for (int64_t t = lo; t < hi; ++t) {
    const float* v = vb + (t - t0) * D;
    v16 vr[NV];
    for (int j = 0; j < NV; ++j) __builtin_memcpy(&vr[j], v + j * 16, sizeof(v16));
    for (int g = 0; g < G; ++g) {
      const float pg = p[g * p_stride + (t - base)];
      for (int j = 0; j < NV; ++j) a[g][j] += pg * vr[j];
    }
  }
  for (int g = 0; g < G; ++g)
    for (int j = 0; j < NV; ++j) __builtin_memcpy(acc + g * D + j * 16, &a[g][j], sizeof(v16));
}

inline void pv_generic(const float* vb, const float* p, int64_t p_stride, int64_t base, int64_t lo, int64_t hi, int64_t t0,
                       int64_t G, int64_t D, float* acc) {
  for (int64_t t = lo; t < hi; ++t) {
    const float* v = vb + (t - t0) * D;
    for (int64_t g = 0; g < G; ++g) {
      const float pg = p[g * p_stride + (t - base)];
      float* a = acc + g * D;
#pragma omp simd
      for (int64_t d = 0; d < D; ++d) a[d] += pg * v[d];
    }
  }
}

// p: the [G, p_stride] probabilities; position t is column t - base.
inline void pv_any(const float* vb, const float* p, int64_t p_stride, int64_t base, int64_t lo, int64_t hi, int64_t t0,
                   int64_t G, int64_t D, float* acc) {
#define HALSERVE_PV(GG, NN) \
  if (G == GG && D == 16 * NN) return pv_rows<GG, NN>(vb, p, p_stride, base, lo, hi, t0, acc);
  HALSERVE_PV(1, 4) HALSERVE_PV(2, 4) HALSERVE_PV(3, 4) HALSERVE_PV(4, 4) HALSERVE_PV(5, 4) HALSERVE_PV(6, 4)
  HALSERVE_PV(1, 8) HALSERVE_PV(2, 8)
#undef HALSERVE_PV
  pv_generic(vb, p, p_stride, base, lo, hi, t0, G, D, acc);
}

void check(const torch::Tensor& q, const torch::Tensor& kv, const torch::Tensor& bt, const torch::Tensor& sl) {
  TORCH_CHECK(q.dim() == 3 && q.scalar_type() == torch::kFloat && q.is_contiguous(), "q must be contiguous float32 [N, Hq, D]");
  TORCH_CHECK(kv.dim() == 4 && kv.size(0) == 2 && kv.scalar_type() == torch::kFloat && kv.is_contiguous(),
              "kv_cache must be contiguous float32 [2, num_blocks, Hk, B*D]");
  TORCH_CHECK(bt.scalar_type() == torch::kInt && sl.scalar_type() == torch::kInt, "block_table/seq_lens must be int32");
  TORCH_CHECK(bt.size(0) == q.size(0) && sl.size(0) == q.size(0), "one block-table row and seq_len per query");
}

}  // namespace

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor kv_cache, torch::Tensor block_table, torch::Tensor seq_lens,
                           int64_t block_size, double scale, int64_t sliding_window, double soft_cap) {
  check(q, kv_cache, block_table, seq_lens);
  const int64_t N = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t NB = kv_cache.size(1), Hk = kv_cache.size(2), B = block_size;
  TORCH_CHECK(kv_cache.size(3) == B * D, "kv_cache last dim must be block_size * head_size");
  TORCH_CHECK(Hq % Hk == 0, "num_heads must be a multiple of num_kv_heads");
  const int64_t G = Hq / Hk;
  const int64_t max_blocks = block_table.size(1);
  auto bt = block_table.contiguous();
  auto sl = seq_lens.contiguous();
  auto out = torch::empty_like(q);

  const float* qp = q.data_ptr<float>();
  const float* kp = kv_cache.data_ptr<float>();
  const float* vp = kp + NB * Hk * B * D;
  const int32_t* btp = bt.data_ptr<int32_t>();
  const int32_t* slp = sl.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  const float cap = static_cast<float>(soft_cap);
  const int64_t head_stride = B * D;       // floats of one (block, head)
  const int64_t block_stride = Hk * B * D;  // floats of one block

  at::parallel_for(0, N * Hk, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;   // [G, span_padded]
    std::vector<float> acc(G * D);
    std::vector<float> sblk(G * B);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / Hk, h = task % Hk;
      const int64_t len = slp[n];
      TORCH_CHECK(len >= 1 && len <= max_blocks * B, "seq_len out of range for the block table");
      const int64_t start = sliding_window > 0 ? std::max<int64_t>(0, len - sliding_window) : 0;
      const int64_t first_blk = start / B, last_blk = (len - 1) / B;
      const int64_t base = first_blk * B;  // position of scores[.][0]
      const int64_t span = (last_blk + 1) * B - base;
      scores.assign(G * span, -std::numeric_limits<float>::infinity());
      const float* qh = qp + (n * Hq + h * G) * D;
      const int32_t* row = btp + n * max_blocks;

      // scores: per block, s[g][0:B] = sum_d q[g][d] * K[d][0:B]
      for (int64_t lb = first_blk; lb <= last_blk; ++lb) {
        const int64_t blk = row[lb];
        TORCH_CHECK(blk >= 0 && blk < NB, "block id out of range");
        const float* kb = kp + blk * block_stride + h * head_stride;  // [D, B]
        score_any(qh, kb, D, B, G, sblk.data());
        const int64_t t0 = lb * B;
        const int64_t lo = std::max(start, t0), hi = std::min(len, t0 + B);
        for (int64_t g = 0; g < G; ++g) {
          for (int64_t t = lo; t < hi; ++t) {
            float x = sblk[g * B + (t - t0)] * fscale;
            if (cap > 0.f) x = std::tanh(x / cap) * cap;
            scores[g * span + (t - base)] = x;
          }
        }
      }
      // softmax per query head (masked positions are -inf -> 0)
      for (int64_t g = 0; g < G; ++g) {
        float* s = scores.data() + g * span;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t i = 0; i < span; ++i) mx = std::max(mx, s[i]);
        float sum = 0.f;
        for (int64_t i = 0; i < span; ++i) {
          const float e = std::exp(s[i] - mx);
          s[i] = e;
          sum += e;
        }
        const float inv = 1.f / sum;
        for (int64_t i = 0; i < span; ++i) s[i] *= inv;
      }
      // out[g][0:D] = sum_t p[g][t] * V[t][0:D]
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t lb = first_blk; lb <= last_blk; ++lb) {
        const float* vb = vp + static_cast<int64_t>(row[lb]) * block_stride + h * head_stride;  // [B, D]
        const int64_t t0 = lb * B;
        const int64_t lo = std::max(start, t0), hi = std::min(len, t0 + B);
        pv_any(vb, scores.data(), span, base, lo, hi, t0, G, D, acc.data());
      }
      std::copy(acc.begin(), acc.end(), op + (n * Hq + h * G) * D);
    }
  });
  return out;
}

std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
std::vector<torch::Tensor> rotary(torch::Tensor positions, torch::Tensor q, torch::Tensor k, torch::Tensor cos_sin,
                                  int64_t head_size, bool is_neox);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("add_rms_norm", &add_rms_norm, "fused residual add + RMSNorm (float32)");
  m.def("rotary", &rotary, "rotary embedding of q and k (float32, neox or gpt-j pairs)");
  m.def("paged_decode", &paged_decode,
        "paged attention decode over a [2, blocks, Hk, B*D] float32 cache (keys stored [D, B] per block)");
}
