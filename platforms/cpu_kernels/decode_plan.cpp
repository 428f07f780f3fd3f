// A Llama-family decode step's decoder layers in one C++ call (models/llama_flat.py's flat loop, without Python
// between the kernels): for a single stream the step was ~2 ms of Python and op dispatch around ~4 ms of kernels
// (SmolLM2-135M Q4_0, 2 cores: the second thread spun in libgomp while the first ran Python; BENCHMARKS.md).
//
//   plan = DecodePlan(cos_sin [P, R] f32, is_neox, w_final [H], eps_final)
//   plan.add_layer(w_in, eps_in, w_post, eps_post, qkv, o, gate_up, down,      (each linear: a GgufLinear)
//                  num_heads, num_kv_heads, head_size, kv_cache, block_size, scale, window, soft_cap)
//   hidden = plan.run(hidden [T, H] f32, positions [T], slot_mapping [T], block_table [T, max_blocks] i32,
//                     seq_lens [T] i32, levels)      (None: a GGUF weight was written since the plan was made)
//
// run() is, layer by layer, exactly the flat loop's calls on a plain decode step (every request one token), the same
// functions with the same arguments in the same order, so its output is bit-identical to it:
//
//   x = rms_norm(hidden, w_in)                     first layer (at::rms_norm, as F.rms_norm), residual = hidden
//   x, residual = add_rms_norm(hidden, residual, w_in)                    later layers
//   attn = rotary_write_decode(gemm(x, qkv), ...)                          [T, Hq D]
//   x, residual = add_rms_norm(gemm(attn, o), residual, w_post)
//   hidden = gemm(silu_and_mul(gemm(x, gate_up)), down)
//   hidden = add_rms_norm(hidden, residual, w_final)[0]                    after the last layer
//
// gemm is the GGUF library's ``halserve_cpu_gguf::gguf_gemm_packed`` (native_gguf.py's bound call: the repacked
// weight, ``levels`` int8 levels) plus the layer's bias, called through the dispatcher (that library is a separate
// extension, loaded before any plan is made). The GIL is released for the whole call.
#include <torch/extension.h>
#include <ATen/core/dispatch/Dispatcher.h>

#include <optional>
#include <string>
#include <vector>

std::vector<torch::Tensor> add_rms_norm(torch::Tensor x, torch::Tensor residual, torch::Tensor weight, double eps);
torch::Tensor silu_and_mul(torch::Tensor x);
torch::Tensor rotary_write_decode(torch::Tensor qkv, torch::Tensor positions, torch::Tensor cos_sin, int64_t num_heads,
                                  int64_t num_kv_heads, int64_t head_size, bool is_neox, torch::Tensor kv_cache,
                                  torch::Tensor slot_mapping, torch::Tensor block_table, torch::Tensor seq_lens,
                                  int64_t block_size, double scale, int64_t sliding_window, double soft_cap);

namespace {

using GemmPackedFn = at::Tensor(const at::Tensor&, const at::Tensor&, int64_t, int64_t, int64_t, int64_t, int64_t);

// One linear layer as native_gguf.NativeGgufGemm.bind calls it: gguf_gemm_packed(x, packed, qtype, n, k, isa, levels),
// then + bias (float32) where the layer has one.
struct GgufLinear {
  at::Tensor packed;  // uint8, gguf_repack's copy
  int64_t qtype, n, k, isa;
  std::optional<at::Tensor> bias;  // float32 [n]
  at::Tensor source;  // the GGUF weight the copy was made from, and its version and data then: a weight written
  int64_t source_version;  // in place or given new data since makes the plan stale (run() returns None)
  const void* source_data;

  bool is_current() const { return source._version() == source_version && source.data_ptr() == source_data; }
};

struct LayerPlan {
  at::Tensor w_in, w_post;
  double eps_in, eps_post;
  GgufLinear qkv, o, gate_up, down;
  int64_t num_heads, num_kv_heads, head_size;
  at::Tensor kv_cache;
  int64_t block_size;
  double scale;
  int64_t window;
  double soft_cap;
};

class DecodePlan {
 public:
  DecodePlan(at::Tensor cos_sin, bool is_neox, at::Tensor w_final, double eps_final)
      : cos_sin_(std::move(cos_sin)), is_neox_(is_neox), w_final_(std::move(w_final)), eps_final_(eps_final),
        gemm_(c10::Dispatcher::singleton()
                  .findSchemaOrThrow("halserve_cpu_gguf::gguf_gemm_packed", "")
                  .typed<GemmPackedFn>()) {
    TORCH_CHECK(cos_sin_.scalar_type() == at::kFloat && cos_sin_.dim() == 2,
                "DecodePlan: cos_sin must be the float32 [positions, rotary dim] table");
    TORCH_CHECK(w_final_.scalar_type() == at::kFloat, "DecodePlan: the final norm's weight must be float32");
  }

  void add_layer(at::Tensor w_in, double eps_in, at::Tensor w_post, double eps_post, GgufLinear qkv, GgufLinear o,
                 GgufLinear gate_up, GgufLinear down, int64_t num_heads, int64_t num_kv_heads, int64_t head_size,
                 at::Tensor kv_cache, int64_t block_size, double scale, int64_t window, double soft_cap) {
    TORCH_CHECK(qkv.n == (num_heads + 2 * num_kv_heads) * head_size,
                "DecodePlan.add_layer: the qkv projection gives ", qkv.n, " columns, not (", num_heads, " + 2 x ",
                num_kv_heads, ") x ", head_size);
    TORCH_CHECK(w_in.scalar_type() == at::kFloat && w_post.scalar_type() == at::kFloat,
                "DecodePlan.add_layer: norm weights must be float32");
    layers_.push_back(LayerPlan{std::move(w_in), std::move(w_post), eps_in, eps_post, std::move(qkv), std::move(o),
                                std::move(gate_up), std::move(down), num_heads, num_kv_heads, head_size,
                                std::move(kv_cache), block_size, scale, window, soft_cap});
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // Every GGUF weight is as it was when its repacked copy was taken.
  bool is_current() const {
    for (const LayerPlan& l : layers_)
      if (!l.qkv.is_current() || !l.o.is_current() || !l.gate_up.is_current() || !l.down.is_current()) return false;
    return true;
  }

  // The step's hidden states after the final norm, or nullopt: a weight changed since the plan was made (make another).
  std::optional<at::Tensor> run(at::Tensor hidden, at::Tensor positions, at::Tensor slot_mapping,
                                at::Tensor block_table, at::Tensor seq_lens, int64_t levels) {
    TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == at::kFloat, "DecodePlan.run: hidden must be float32 [T, H]");
    TORCH_CHECK(!layers_.empty(), "DecodePlan.run: the plan has no layers");
    if (!is_current()) return std::nullopt;
    at::Tensor residual;
    for (const LayerPlan& l : layers_) {
      at::Tensor x;
      if (!residual.defined()) {
        residual = hidden;
        x = at::rms_norm(hidden, {hidden.size(-1)}, l.w_in, l.eps_in);
      } else {
        auto normed = add_rms_norm(hidden, residual, l.w_in, l.eps_in);
        x = normed[0];
        residual = normed[1];
      }
      at::Tensor qkv = gemm(x, l.qkv, levels);  // [T, (Hq + 2 Hk) D]
      at::Tensor attn = rotary_write_decode(qkv, positions, cos_sin_, l.num_heads, l.num_kv_heads, l.head_size,
                                            is_neox_, l.kv_cache, slot_mapping, block_table, seq_lens, l.block_size,
                                            l.scale, l.window, l.soft_cap);  // [T, Hq D]
      auto normed = add_rms_norm(gemm(attn, l.o, levels), residual, l.w_post, l.eps_post);
      residual = normed[1];
      hidden = gemm(silu_and_mul(gemm(normed[0], l.gate_up, levels)), l.down, levels);
    }
    return add_rms_norm(hidden, residual, w_final_, eps_final_)[0];
  }

 private:
  at::Tensor gemm(const at::Tensor& x, const GgufLinear& w, int64_t levels) const {
    at::Tensor out = gemm_.call(x, w.packed, w.qtype, w.n, w.k, w.isa, levels);  // [T, n] float32
    return w.bias ? out + *w.bias : out;
  }

  at::Tensor cos_sin_;
  bool is_neox_;
  at::Tensor w_final_;
  double eps_final_;
  c10::TypedOperatorHandle<GemmPackedFn> gemm_;
  std::vector<LayerPlan> layers_;
};

}  // namespace

void register_decode_plan(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<GgufLinear>(m, "GgufLinear", "one GGUF linear layer of a DecodePlan: gguf_gemm_packed's weight and sizes")
      .def(py::init([](at::Tensor packed, int64_t qtype, int64_t n, int64_t k, int64_t isa, at::Tensor source,
                       std::optional<at::Tensor> bias) {
             TORCH_CHECK(packed.scalar_type() == at::kByte, "GgufLinear: packed must be gguf_repack's uint8 copy");
             TORCH_CHECK(!bias || (bias->scalar_type() == at::kFloat && bias->numel() == n),
                         "GgufLinear: the bias must be float32 [", n, "]");
             const int64_t version = source._version();
             const void* data = source.data_ptr();
             return GgufLinear{std::move(packed), qtype, n, k, isa, std::move(bias), std::move(source), version, data};
           }),
           py::arg("packed"), py::arg("qtype"), py::arg("n"), py::arg("k"), py::arg("isa"), py::arg("source"),
           py::arg("bias") = py::none());
  py::class_<DecodePlan>(m, "DecodePlan", "a Llama-family decode step's decoder layers in one call (decode_plan.cpp)")
      .def(py::init<at::Tensor, bool, at::Tensor, double>(), py::arg("cos_sin"), py::arg("is_neox"),
           py::arg("w_final"), py::arg("eps_final"))
      .def("add_layer", &DecodePlan::add_layer)
      .def_property_readonly("num_layers", &DecodePlan::num_layers)
      .def("is_current", &DecodePlan::is_current)
      .def("run", &DecodePlan::run, py::call_guard<py::gil_scoped_release>());
}
