// Paged-attention decode for the CPU platform: one query token per request, reading K/V
// straight from the paged cache (no gather copy), softmax in fp32.
//
//   q            [N, Hq, D]            float32, contiguous
//   key_cache    [num_blocks, B, Hk, D] float32, contiguous (value_cache likewise)
//   block_table  [N, max_blocks]       int32: physical block of each logical block
//   seq_lens     [N]                   int32: context length including the query token
//   out          [N, Hq, D]
//
// Token t of request n lives at key_cache[block_table[n][t / B], t % B, h, :]. The query
// sits at position seq_len - 1; with a sliding window W only keys t > seq_len - 1 - W
// are visible. Work is split over (request, kv head) pairs with at::parallel_for (torch's
// own thread pool, so torch.set_num_threads applies); each task reads every K/V row of its
// head once and serves all G = Hq / Hk query heads of the group from it.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor key_cache, torch::Tensor value_cache,
                           torch::Tensor block_table, torch::Tensor seq_lens, double scale,
                           int64_t sliding_window, double soft_cap) {
  TORCH_CHECK(q.dim() == 3 && key_cache.dim() == 4, "q must be [N, Hq, D] and caches [blocks, B, Hk, D]");
  TORCH_CHECK(q.scalar_type() == torch::kFloat && key_cache.scalar_type() == torch::kFloat &&
                  value_cache.scalar_type() == torch::kFloat,
              "paged_decode takes float32 tensors");
  TORCH_CHECK(q.is_contiguous() && key_cache.is_contiguous() && value_cache.is_contiguous(),
              "paged_decode needs contiguous q and caches");
  TORCH_CHECK(block_table.scalar_type() == torch::kInt && seq_lens.scalar_type() == torch::kInt,
              "block_table and seq_lens must be int32");
  const int64_t N = q.size(0), Hq = q.size(1), D = q.size(2);
  const int64_t B = key_cache.size(1), Hk = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == D && Hq % Hk == 0, "head sizes / head counts do not match");
  const int64_t G = Hq / Hk;
  const int64_t max_blocks = block_table.size(1);
  auto bt = block_table.contiguous();
  auto sl = seq_lens.contiguous();
  auto out = torch::empty_like(q);

  const float* qp = q.data_ptr<float>();
  const float* kp = key_cache.data_ptr<float>();
  const float* vp = value_cache.data_ptr<float>();
  const int32_t* btp = bt.data_ptr<int32_t>();
  const int32_t* slp = sl.data_ptr<int32_t>();
  float* op = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  const float cap = static_cast<float>(soft_cap);
  const int64_t row_stride = Hk * D;  // floats between consecutive tokens of one head

  at::parallel_for(0, N * Hk, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    std::vector<float> acc(G * D);
    for (int64_t task = begin; task < end; ++task) {
      const int64_t n = task / Hk, h = task % Hk;
      const int64_t len = slp[n];
      TORCH_CHECK(len >= 1 && len <= max_blocks * B, "seq_len out of range for the block table");
      const int64_t start = sliding_window > 0 ? std::max<int64_t>(0, len - sliding_window) : 0;
      const int64_t span = len - start;
      scores.assign(G * span, 0.f);
      const float* qh = qp + (n * Hq + h * G) * D;  // the G query heads of this kv head
      const int32_t* row = btp + n * max_blocks;
      // scores[g][t] = scale * <q_g, k_t>
      for (int64_t t = start; t < len; ++t) {
        const float* k = kp + (static_cast<int64_t>(row[t / B]) * B + t % B) * row_stride + h * D;
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qh + g * D;
          float dot = 0.f;
#pragma omp simd reduction(+ : dot)
          for (int64_t d = 0; d < D; ++d) dot += qg[d] * k[d];
          dot *= fscale;
          if (cap > 0.f) dot = std::tanh(dot / cap) * cap;
          scores[g * span + (t - start)] = dot;
        }
      }
      // softmax per query head
      for (int64_t g = 0; g < G; ++g) {
        float* s = scores.data() + g * span;
        float mx = -std::numeric_limits<float>::infinity();
        for (int64_t i = 0; i < span; ++i) mx = std::max(mx, s[i]);
        float sum = 0.f;
        for (int64_t i = 0; i < span; ++i) {
          s[i] = std::exp(s[i] - mx);
          sum += s[i];
        }
        const float inv = 1.f / sum;
        for (int64_t i = 0; i < span; ++i) s[i] *= inv;
      }
      // out_g = sum_t p[g][t] * v_t
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = start; t < len; ++t) {
        const float* v = vp + (static_cast<int64_t>(row[t / B]) * B + t % B) * row_stride + h * D;
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * span + (t - start)];
          float* a = acc.data() + g * D;
#pragma omp simd
          for (int64_t d = 0; d < D; ++d) a[d] += p * v[d];
        }
      }
      float* o = op + (n * Hq + h * G) * D;
      std::copy(acc.begin(), acc.end(), o);
    }
  });
  return out;
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "paged attention decode over a paged KV cache (float32)");
}
