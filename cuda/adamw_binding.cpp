// Torch face of the fused AdamW chunk kernel (adamw_cuda.cu): checks tensors, takes the current
// stream and device, converts the Python scalars like torch does.  Reference:
// leto_runtime/rmu/adamw.py `adamw_chunk_`.
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include <optional>

#include "adamw_chunk_args.h"
#include "adamw_cuda.h"
#include "adamw_syndrome.h"

namespace {

void adamw_fused(torch::Tensor p, torch::Tensor m, torch::Tensor v, const torch::Tensor& g,
                 const std::optional<torch::Tensor>& coef, const std::optional<std::vector<torch::Tensor>>& deltas,
                 double decay, double beta1, double beta2, double eps, double bc2_sqrt, double step_size,
                 bool has_decay, int64_t variant) {
  check(p, p, "p", torch::kFloat32);
  check(m, p, "m", torch::kFloat32);
  check(v, p, "v", torch::kFloat32);
  check(g, p, "g", torch::kFloat32);
  leto_rmu::AdamWArgs a{};
  a.p = p.data_ptr<float>();
  a.m = m.data_ptr<float>();
  a.v = v.data_ptr<float>();
  a.g = g.data_ptr<float>();
  a.n = p.numel();
  if (coef) {
    TORCH_CHECK(coef->is_cuda() && coef->device() == p.device() && coef->scalar_type() == torch::kFloat32 &&
                    coef->numel() == 1, "adamw_fused: coef must be a 1-element fp32 tensor on ", p.device());
    a.coef = coef->data_ptr<float>();
  }
  if (deltas) {
    TORCH_CHECK(deltas->size() == 3, "adamw_fused: deltas must be 3 tensors (params, exp_avg, exp_avg_sq)");
    uint32_t** outs[3] = {&a.dp, &a.dm, &a.dv};
    for (int i = 0; i < 3; ++i) {
      const auto& d = (*deltas)[i];
      TORCH_CHECK(d.is_cuda() && d.device() == p.device() && d.is_contiguous() &&
                      d.numel() * d.element_size() == a.n * 4,
                  "adamw_fused: each delta must be a contiguous tensor of ", a.n * 4, " bytes on ", p.device());
      *outs[i] = reinterpret_cast<uint32_t*>(d.data_ptr());
    }
  }
  a.s = scalars(decay, beta1, beta2, eps, bc2_sqrt, step_size, coef.has_value(), has_decay);
  const c10::cuda::CUDAGuard guard(p.device());
  int sms = 0;
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, p.device().index());
  try {
    leto_rmu::adamw_fused(a, static_cast<int>(variant), sms, c10::cuda::getCurrentCUDAStream().stream());
  } catch (const std::runtime_error& e) {
    TORCH_CHECK(false, "leto rmu CUDA: ", e.what());
  }
}

// One chunk: p, m, v <- AdamW(undo copies up, um, uv; g) and, per state, outs = bases ^ the
// parity delta of (undo ^ new).
void adamw_syndrome(torch::Tensor p, torch::Tensor m, torch::Tensor v, const torch::Tensor& g,
                    const torch::Tensor& up, const torch::Tensor& um, const torch::Tensor& uv,
                    const std::optional<torch::Tensor>& coef, const torch::Tensor& outs,
                    const torch::Tensor& bases, const torch::Tensor& mix, const torch::Tensor& scale,
                    int64_t page_bytes, double decay, double beta1, double beta2, double eps,
                    double bc2_sqrt, double step_size, bool has_decay, int64_t variant, int64_t layout) {
  const ChunkCall c = chunk_call(p, m, v, g, up, um, uv, coef, outs, bases, mix, scale, page_bytes, decay, beta1,
                                 beta2, eps, bc2_sqrt, step_size, has_decay);
  const c10::cuda::CUDAGuard guard(p.device());
  try {
    leto_rmu::adamw_syndrome(c.a, c.f, c.coef.data(), static_cast<int>(variant), static_cast<int>(layout),
                             c10::cuda::getCurrentCUDAStream().stream());
  } catch (const std::runtime_error& e) {
    TORCH_CHECK(false, "leto rmu CUDA: ", e.what());
  }
}

// The folded chunk (adamw_ws.cu, fold with counts): p, m, v <- AdamW(p, m, v; g) in place, their
// old values to up, um, uv, the same parity pages; counts: int64 CUDA tensors (two copies, in
// different pages) of one word per 512-byte column of a page, (tag << 16) | the stages whose
// undo copy is visible (leto_runtime/rmu/fold.py reads them), stored every `batch` stages (1 or 4).
void adamw_syndrome_fold(torch::Tensor p, torch::Tensor m, torch::Tensor v, const torch::Tensor& g,
                         torch::Tensor up, torch::Tensor um, torch::Tensor uv,
                         const std::optional<torch::Tensor>& coef, const torch::Tensor& outs,
                         const torch::Tensor& bases, const torch::Tensor& mix, const torch::Tensor& scale,
                         int64_t page_bytes, double decay, double beta1, double beta2, double eps,
                         double bc2_sqrt, double step_size, bool has_decay, torch::Tensor counts0,
                         torch::Tensor counts1, int64_t tag, int64_t batch) {
  ChunkCall c = chunk_call(p, m, v, g, up, um, uv, coef, outs, bases, mix, scale, page_bytes, decay, beta1,
                           beta2, eps, bc2_sqrt, step_size, has_decay);
  TORCH_CHECK(batch == 1 || batch == 4, "adamw_syndrome_fold: a count every 1 or 4 stages in this build");
  set_counts(c, p, counts0, counts1, tag, page_bytes, batch);
  const c10::cuda::CUDAGuard guard(p.device());
  try {
    leto_rmu::adamw_syndrome_ws(c.a, c.f, c.coef.data(), true, c10::cuda::getCurrentCUDAStream().stream());
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "leto rmu CUDA: ", e.what());
  }
}

}  // namespace

void register_marker_stream(pybind11::module& m);  // marker_stream.cpp

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Leto RMU CUDA: fused AdamW chunk kernel (adamw_cuda.cu), stream-ordered marker writes (marker_stream.cpp)";
  m.def("adamw_fused", &adamw_fused, "in-place AdamW of one chunk, optionally writing old ^ new",
        py::arg("p"), py::arg("m"), py::arg("v"), py::arg("g"), py::arg("coef"), py::arg("deltas"),
        py::arg("decay"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"), py::arg("bc2_sqrt"),
        py::arg("step_size"), py::arg("has_decay"), py::arg("variant") = 0);
  m.def("adamw_syndrome", &adamw_syndrome,
        "one chunk: AdamW from the undo copies into the states, and per state outs = bases ^ parity delta",
        py::arg("p"), py::arg("m"), py::arg("v"), py::arg("g"), py::arg("up"), py::arg("um"), py::arg("uv"),
        py::arg("coef"), py::arg("outs"), py::arg("bases"), py::arg("mix"), py::arg("scale"),
        py::arg("page_bytes"), py::arg("decay"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
        py::arg("bc2_sqrt"), py::arg("step_size"), py::arg("has_decay"), py::arg("variant") = 0,
        py::arg("layout") = 0);
  m.def("adamw_syndrome_fold", &adamw_syndrome_fold,
        "one chunk with the undo copy folded in (ws): AdamW in place, old values to up, um, uv, the same "
        "parity; per-unit stage counts in counts0 and counts1",
        py::arg("p"), py::arg("m"), py::arg("v"), py::arg("g"), py::arg("up"), py::arg("um"), py::arg("uv"),
        py::arg("coef"), py::arg("outs"), py::arg("bases"), py::arg("mix"), py::arg("scale"),
        py::arg("page_bytes"), py::arg("decay"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
        py::arg("bc2_sqrt"), py::arg("step_size"), py::arg("has_decay"), py::arg("counts0"), py::arg("counts1"),
        py::arg("tag"), py::arg("batch") = 1);
  register_marker_stream(m);
}
