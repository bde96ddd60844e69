// Torch face of the fused AdamW chunk kernel (adamw_cuda.cu): checks tensors, takes the current
// stream and device, converts the Python scalars like torch does.  Reference:
// leto_runtime/rmu/adamw.py `adamw_chunk_`.
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include <optional>

#include "adamw_cuda.h"
#include "adamw_syndrome.h"

namespace {

void check(const torch::Tensor& t, const torch::Tensor& like, const char* name, torch::ScalarType dt) {
  TORCH_CHECK(t.is_cuda() && t.device() == like.device(), "adamw_fused: ", name, " must be on ", like.device());
  TORCH_CHECK(t.scalar_type() == dt && t.dim() == 1 && t.is_contiguous() && t.numel() == like.numel(),
              "adamw_fused: ", name, " must be a contiguous 1-D tensor of ", like.numel(), " elements of ", dt);
}

// Python floats become fp32 the way c10::Scalar::to<float> converts a double (round to nearest).
// `v.sqrt() / x` multiplies by the reciprocal of the CPU scalar x, taken in double and then
// rounded (tests/gpu/test_rmu_fused_gpu.py: 1.0f / float(x) differs for x = sqrt(1 - 0.999)).
leto_rmu::AdamWScalars scalars(double decay, double beta1, double beta2, double eps, double bc2_sqrt,
                               double step_size, bool has_coef, bool has_decay) {
  leto_rmu::AdamWScalars s{};
  s.decay = static_cast<float>(decay);
  s.w1 = static_cast<float>(1.0 - beta1);
  s.beta2 = static_cast<float>(beta2);
  s.w2 = static_cast<float>(1.0 - beta2);
  s.inv_bc2 = static_cast<float>(1.0 / bc2_sqrt);
  s.inv_bc2_f = 1.0f / static_cast<float>(bc2_sqrt);
  s.eps = static_cast<float>(eps);
  s.nstep = static_cast<float>(-step_size);
  s.has_coef = has_coef ? 1 : 0;
  s.has_decay = has_decay ? 1 : 0;
  return s;
}

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
// parity delta of (undo ^ new).  outs / bases: int64 CUDA tensors of 3 x m_out page addresses;
// mix: int32 CPU (m_out, 16) coefficients (t = -7..8); scale: int32 CPU (16,) run scale.
void adamw_syndrome(torch::Tensor p, torch::Tensor m, torch::Tensor v, const torch::Tensor& g,
                    const torch::Tensor& up, const torch::Tensor& um, const torch::Tensor& uv,
                    const std::optional<torch::Tensor>& coef, const torch::Tensor& outs,
                    const torch::Tensor& bases, const torch::Tensor& mix, const torch::Tensor& scale,
                    int64_t page_bytes, double decay, double beta1, double beta2, double eps,
                    double bc2_sqrt, double step_size, bool has_decay, int64_t variant, int64_t layout) {
  for (auto* t : {&p, &m, &v}) check(*t, p, "state", torch::kFloat32);
  check(g, p, "g", torch::kFloat32);
  for (const auto* t : {&up, &um, &uv}) check(*t, p, "undo", torch::kFloat32);
  TORCH_CHECK(page_bytes > 0 && page_bytes % 1024 == 0 && (p.numel() * 4) % page_bytes == 0,
              "adamw_syndrome: the chunk must be whole pages of a multiple of 1024 bytes");
  // The kernel reads only the undo copies and g and writes only the states: overlap would race.
  const auto span = [](const torch::Tensor& t) {
    const auto b = reinterpret_cast<uintptr_t>(t.data_ptr());
    return std::make_pair(b, b + static_cast<uintptr_t>(t.numel()) * 4);
  };
  for (const auto* w : {&p, &m, &v})
    for (const auto* r : {&up, &um, &uv, &g}) {
      const auto a = span(*w), b = span(*r);
      TORCH_CHECK(a.second <= b.first || b.second <= a.first,
                  "adamw_syndrome: a state overlaps an undo copy or the gradients");
    }
  for (const auto* t : {&outs, &bases})
    TORCH_CHECK(t->is_cuda() && t->device() == p.device() && t->scalar_type() == torch::kInt64 &&
                    t->dim() == 1 && t->is_contiguous() && t->numel() % 3 == 0,
                "adamw_syndrome: outs and bases must be int64 CUDA tensors of 3 x m_out page addresses");
  TORCH_CHECK(outs.numel() == bases.numel(), "adamw_syndrome: one base page per output page");
  const int64_t m_out = outs.numel() / 3;
  TORCH_CHECK(m_out >= 1 && m_out <= 16, "adamw_syndrome: 1..16 parity pages per state");
  TORCH_CHECK(!mix.is_cuda() && mix.scalar_type() == torch::kInt32 && mix.is_contiguous() && mix.numel() == m_out * 16,
              "adamw_syndrome: mix must be a contiguous int32 CPU tensor of shape (m_out, 16)");
  TORCH_CHECK(!scale.is_cuda() && scale.scalar_type() == torch::kInt32 && scale.is_contiguous() && scale.numel() == 16,
              "adamw_syndrome: scale must be a contiguous int32 CPU tensor of 16 GF(2^16) values");
  std::vector<uint16_t> c(static_cast<size_t>(m_out * 16));
  for (size_t i = 0; i < c.size(); ++i) c[i] = static_cast<uint16_t>(mix.data_ptr<int32_t>()[i]);
  SyndromeArgs a{};
  a.n = static_cast<int>(p.numel() * 4 / page_bytes);
  a.outs = reinterpret_cast<uint8_t* const*>(outs.data_ptr<int64_t>());
  a.bases = reinterpret_cast<const uint8_t* const*>(bases.data_ptr<int64_t>());
  a.m_out = static_cast<int>(m_out);
  a.page_bytes = page_bytes;
  a.scaled = 1;
  for (int t = 0; t < 16; ++t) a.scale[t] = static_cast<uint32_t>(scale.data_ptr<int32_t>()[t]) & 0xFFFFu;
  leto_rmu::AdamWSyndromeArgs f{};
  f.state[0] = p.data_ptr<float>();
  f.state[1] = m.data_ptr<float>();
  f.state[2] = v.data_ptr<float>();
  f.old[0] = up.data_ptr<float>();
  f.old[1] = um.data_ptr<float>();
  f.old[2] = uv.data_ptr<float>();
  f.g = g.data_ptr<float>();
  if (coef) {
    TORCH_CHECK(coef->is_cuda() && coef->device() == p.device() && coef->scalar_type() == torch::kFloat32 &&
                    coef->numel() == 1, "adamw_syndrome: coef must be a 1-element fp32 tensor on ", p.device());
    f.coef = coef->data_ptr<float>();
  }
  f.s = scalars(decay, beta1, beta2, eps, bc2_sqrt, step_size, coef.has_value(), has_decay);
  const c10::cuda::CUDAGuard guard(p.device());
  try {
    leto_rmu::adamw_syndrome(a, f, c.data(), static_cast<int>(variant), static_cast<int>(layout),
                             c10::cuda::getCurrentCUDAStream().stream());
  } catch (const std::runtime_error& e) {
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
  register_marker_stream(m);
}
