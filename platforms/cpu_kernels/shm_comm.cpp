// Tensor-parallel collectives between CPU ranks on one machine, through one shared-memory
// segment that every rank maps (see shm_comm.py):
//
//   [flags: one 64-byte line per rank][data: 2 sets x world slots x slot_bytes]
//
// A call goes chunk by chunk (at most slot_bytes each). Chunk number s (counted across calls,
// from 1) uses slot set s % 2: a rank copies its chunk into its slot, publishes s in its flag,
// waits until every rank's flag reaches s, then reads every rank's slot. Two sets are enough:
// a rank writes set s % 2 again only at chunk s + 2, after every rank published s + 1, which
// each did only once done reading chunk s. Every rank sums the slots in rank order, so the
// ranks end with bit-identical results (their samplers then agree).
#include <ATen/ATen.h>

#include <immintrin.h>
#include <sched.h>

#include <chrono>
#include <cstring>

namespace {

constexpr int64_t kFlagBytes = 64;
constexpr double kTimeoutS = 600.0;

int64_t* flag_of(uint8_t* base, int64_t rank) { return reinterpret_cast<int64_t*>(base + rank * kFlagBytes); }

uint8_t* slot_of(uint8_t* base, int64_t world, int64_t slot_bytes, int64_t seq, int64_t rank) {
  return base + world * kFlagBytes + ((seq & 1) * world + rank) * slot_bytes;
}

void wait_for_all(uint8_t* base, int64_t world, int64_t seq) {
  for (int64_t r = 0; r < world; ++r) {
    int64_t* flag = flag_of(base, r);
    int64_t spins = 0;
    auto start = std::chrono::steady_clock::now();
    while (__atomic_load_n(flag, __ATOMIC_ACQUIRE) < seq) {
      _mm_pause();
      if (++spins % 256 == 0) sched_yield();  // (more ranks than free cores: let the others run)
      if (spins % (1 << 20) == 0) {
        double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        TORCH_CHECK(waited < kTimeoutS, "shared-memory collective: rank ", r, " did not arrive within ",
                    kTimeoutS, " s (did it die?)");
      }
    }
  }
}

void publish(uint8_t* base, int64_t rank, int64_t seq) { __atomic_store_n(flag_of(base, rank), seq, __ATOMIC_RELEASE); }

template <typename T>
void sum_slots(uint8_t* base, int64_t world, int64_t slot_bytes, int64_t seq, T* out, int64_t n) {
  const T* first = reinterpret_cast<const T*>(slot_of(base, world, slot_bytes, seq, 0));
  if constexpr (std::is_same_v<T, float>) {
    std::memcpy(out, first, n * sizeof(float));
    for (int64_t r = 1; r < world; ++r) {
      const float* part = reinterpret_cast<const float*>(slot_of(base, world, slot_bytes, seq, r));
#pragma omp simd
      for (int64_t i = 0; i < n; ++i) out[i] += part[i];
    }
  } else {  // half types: accumulate in float, round once
    for (int64_t i = 0; i < n; ++i) {
      float acc = static_cast<float>(first[i]);
      for (int64_t r = 1; r < world; ++r) {
        acc += static_cast<float>(reinterpret_cast<const T*>(slot_of(base, world, slot_bytes, seq, r))[i]);
      }
      out[i] = static_cast<T>(acc);
    }
  }
}

void check_args(const at::Tensor& buffer, const at::Tensor& x, int64_t rank, int64_t world, int64_t slot_bytes) {
  TORCH_CHECK(buffer.device().is_cpu() && buffer.scalar_type() == at::kByte && buffer.is_contiguous(),
              "the shared buffer must be a contiguous CPU uint8 tensor");
  TORCH_CHECK(x.device().is_cpu() && x.is_contiguous(), "shared-memory collectives take contiguous CPU tensors");
  TORCH_CHECK(world >= 1 && rank >= 0 && rank < world, "bad rank ", rank, " of ", world);
  TORCH_CHECK(buffer.numel() >= world * kFlagBytes + 2 * world * slot_bytes, "the shared buffer is too small");
  TORCH_CHECK(slot_bytes % x.element_size() == 0, "slot size not a multiple of the element size");
}

// Chunk by chunk (``slot_bytes`` at most): copy this rank's part of x into its slot, publish, wait
// for every rank, then ``use(seq, element offset, elements)`` reads the slots. Returns the next seq.
template <typename Use>
int64_t exchange_chunks(uint8_t* base, const at::Tensor& x, int64_t rank, int64_t world, int64_t slot_bytes,
                        int64_t seq, Use&& use) {
  const int64_t elem = x.element_size();
  const int64_t per_chunk = slot_bytes / elem;
  const int64_t total = x.numel();
  const uint8_t* data = static_cast<const uint8_t*>(x.data_ptr());
  for (int64_t start = 0; start < total; start += per_chunk, ++seq) {
    const int64_t n = std::min(per_chunk, total - start);
    std::memcpy(slot_of(base, world, slot_bytes, seq, rank), data + start * elem, n * elem);
    publish(base, rank, seq);
    wait_for_all(base, world, seq);
    use(seq, start, n);
  }
  return seq;
}

}  // namespace

// x += the other ranks' x, in place; returns the next chunk number.
int64_t shm_all_reduce(at::Tensor buffer, at::Tensor x, int64_t rank, int64_t world, int64_t slot_bytes,
                       int64_t seq) {
  check_args(buffer, x, rank, world, slot_bytes);
  uint8_t* base = buffer.data_ptr<uint8_t>();
  return exchange_chunks(base, x, rank, world, slot_bytes, seq, [&](int64_t s, int64_t start, int64_t n) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, x.scalar_type(), "shm_all_reduce", [&] {
      sum_slots<scalar_t>(base, world, slot_bytes, s, x.data_ptr<scalar_t>() + start, n);
    });
  });
}

// out[r] = rank r's x (out: [world, x.numel()] of x's dtype); returns the next chunk number.
int64_t shm_all_gather(at::Tensor buffer, at::Tensor x, at::Tensor out, int64_t rank, int64_t world,
                       int64_t slot_bytes, int64_t seq) {
  check_args(buffer, x, rank, world, slot_bytes);
  TORCH_CHECK(out.is_contiguous() && out.scalar_type() == x.scalar_type() && out.numel() == world * x.numel(),
              "all_gather: out must be a contiguous [world, numel] tensor of x's dtype");
  uint8_t* base = buffer.data_ptr<uint8_t>();
  const int64_t elem = x.element_size();
  const int64_t total = x.numel();
  uint8_t* dst = static_cast<uint8_t*>(out.data_ptr());
  return exchange_chunks(base, x, rank, world, slot_bytes, seq, [&](int64_t s, int64_t start, int64_t n) {
    for (int64_t r = 0; r < world; ++r) {
      std::memcpy(dst + (r * total + start) * elem, slot_of(base, world, slot_bytes, s, r), n * elem);
    }
  });
}
