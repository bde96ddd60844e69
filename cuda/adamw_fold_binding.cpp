// Torch face of the benchmarks' chunk kernels (adamw_fold.cu, adamw_onecta.cu, adamw_ws_bench.cu), an extension
// (`leto_runtime.rmu.fused.load_fold`): the updater does not use it (docs/BENCHMARKS.md says
// what it costs).  Reference: adamw_syndrome on an undo copy made beforehand.
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include <optional>
#include <tuple>

#include "adamw_chunk_args.h"
#include "adamw_syndrome.h"

namespace {

// The same chunk with the undo copy folded in: p, m, v <- AdamW(p, m, v; g) in place, their
// old values written to up, um, uv, and the same parity pages; progress (optional, int32, 3 x
// 4 KiB tiles of a page, zeroed by the caller): the stages whose undo copy is visible.
void adamw_syndrome_fold(torch::Tensor p, torch::Tensor m, torch::Tensor v, const torch::Tensor& g,
                         torch::Tensor up, torch::Tensor um, torch::Tensor uv,
                         const std::optional<torch::Tensor>& coef, const torch::Tensor& outs,
                         const torch::Tensor& bases, const torch::Tensor& mix, const torch::Tensor& scale,
                         int64_t page_bytes, double decay, double beta1, double beta2, double eps,
                         double bc2_sqrt, double step_size, bool has_decay,
                         const std::optional<torch::Tensor>& progress) {
  ChunkCall c = chunk_call(p, m, v, g, up, um, uv, coef, outs, bases, mix, scale, page_bytes, decay, beta1,
                           beta2, eps, bc2_sqrt, step_size, has_decay);
  if (progress) {
    const int64_t tiles = (page_bytes / 1024 + 3) / 4;
    TORCH_CHECK(progress->is_cuda() && progress->device() == p.device() && progress->scalar_type() == torch::kInt32 &&
                    progress->is_contiguous() && progress->numel() == 3 * tiles,
                "adamw_syndrome_fold: progress must be a contiguous int32 tensor of 3 x ", tiles,
                " stage counts (one per state and 4 KiB tile) on ", p.device());
    c.f.progress = reinterpret_cast<uint32_t*>(progress->data_ptr<int32_t>());
  }
  const c10::cuda::CUDAGuard guard(p.device());
  try {
    leto_rmu::adamw_syndrome_fold(c.a, c.f, c.coef.data(), p.device().index(),
                                  c10::cuda::getCurrentCUDAStream().stream());
  } catch (const std::runtime_error& e) {
    TORCH_CHECK(false, "leto rmu CUDA: ", e.what());
  }
}

// One CTA per tile for the three states (adamw_onecta.cu; adamw_ws.cu: warp-specialized):
// p, m, v <- AdamW(undo copies; g) (fold = false), or read in place with their old values
// written to up, um, uv (fold = true); the same parity.
using TileKernel = void (*)(const SyndromeArgs&, const leto_rmu::AdamWSyndromeArgs&, const uint16_t*, bool,
                            cudaStream_t);
template <TileKernel K>
void adamw_syndrome_tile(torch::Tensor p, torch::Tensor m, torch::Tensor v, const torch::Tensor& g,
                         torch::Tensor up, torch::Tensor um, torch::Tensor uv,
                         const std::optional<torch::Tensor>& coef, const torch::Tensor& outs,
                         const torch::Tensor& bases, const torch::Tensor& mix, const torch::Tensor& scale,
                         int64_t page_bytes, double decay, double beta1, double beta2, double eps,
                         double bc2_sqrt, double step_size, bool has_decay, bool fold) {
  const ChunkCall c = chunk_call(p, m, v, g, up, um, uv, coef, outs, bases, mix, scale, page_bytes, decay, beta1,
                                 beta2, eps, bc2_sqrt, step_size, has_decay);
  const c10::cuda::CUDAGuard guard(p.device());
  try {
    K(c.a, c.f, c.coef.data(), fold, c10::cuda::getCurrentCUDAStream().stream());
  } catch (const std::runtime_error& e) {
    TORCH_CHECK(false, "leto rmu CUDA: ", e.what());
  }
}

// The folded chunk with its counts (adamw_ws_bench.cu): as the updater's adamw_syndrome_fold,
// counting every `batch` stages (1, 2 or 4).
void adamw_syndrome_ws_counts(torch::Tensor p, torch::Tensor m, torch::Tensor v, const torch::Tensor& g,
                              torch::Tensor up, torch::Tensor um, torch::Tensor uv,
                              const std::optional<torch::Tensor>& coef, const torch::Tensor& outs,
                              const torch::Tensor& bases, const torch::Tensor& mix, const torch::Tensor& scale,
                              int64_t page_bytes, double decay, double beta1, double beta2, double eps,
                              double bc2_sqrt, double step_size, bool has_decay, torch::Tensor counts0,
                              torch::Tensor counts1, int64_t tag, int64_t batch) {
  ChunkCall c = chunk_call(p, m, v, g, up, um, uv, coef, outs, bases, mix, scale, page_bytes, decay, beta1,
                           beta2, eps, bc2_sqrt, step_size, has_decay);
  set_counts(c, p, counts0, counts1, tag, page_bytes, batch);
  const c10::cuda::CUDAGuard guard(p.device());
  try {
    leto_rmu::adamw_syndrome_ws(c.a, c.f, c.coef.data(), true, c10::cuda::getCurrentCUDAStream().stream());
  } catch (const std::exception& e) {
    TORCH_CHECK(false, "leto rmu CUDA: ", e.what());
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Leto RMU CUDA, benchmarks only: chunk kernels the updater does not use "
            "(adamw_fold.cu, adamw_onecta.cu, adamw_ws.cu)";
  m.def("adamw_syndrome_fold", &adamw_syndrome_fold,
        "one chunk with the undo copy folded in: AdamW in place, old values to up, um, uv, same parity",
        py::arg("p"), py::arg("m"), py::arg("v"), py::arg("g"), py::arg("up"), py::arg("um"), py::arg("uv"),
        py::arg("coef"), py::arg("outs"), py::arg("bases"), py::arg("mix"), py::arg("scale"),
        py::arg("page_bytes"), py::arg("decay"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
        py::arg("bc2_sqrt"), py::arg("step_size"), py::arg("has_decay"), py::arg("progress"));
  m.def("adamw_syndrome_ws_counts", &adamw_syndrome_ws_counts,
        "the folded chunk with per-unit stage counts, a count every `batch` stages",
        py::arg("p"), py::arg("m"), py::arg("v"), py::arg("g"), py::arg("up"), py::arg("um"), py::arg("uv"),
        py::arg("coef"), py::arg("outs"), py::arg("bases"), py::arg("mix"), py::arg("scale"),
        py::arg("page_bytes"), py::arg("decay"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
        py::arg("bc2_sqrt"), py::arg("step_size"), py::arg("has_decay"), py::arg("counts0"), py::arg("counts1"),
        py::arg("tag"), py::arg("batch"));
  for (const auto& [name, fn, doc] :
       {std::tuple{"adamw_syndrome_onecta", &adamw_syndrome_tile<leto_rmu::adamw_syndrome_onecta>,
                   "one chunk, one CTA per tile for the three states (fold: read in place, old values to up, um, uv)"},
        std::tuple{"adamw_syndrome_ws", &adamw_syndrome_tile<leto_rmu::adamw_syndrome_ws>,
                   "the same with warp-specialized CTAs (producer warps, Horner warps)"}})
    m.def(name, fn, doc, py::arg("p"), py::arg("m"), py::arg("v"), py::arg("g"), py::arg("up"), py::arg("um"),
          py::arg("uv"), py::arg("coef"), py::arg("outs"), py::arg("bases"), py::arg("mix"), py::arg("scale"),
          py::arg("page_bytes"), py::arg("decay"), py::arg("beta1"), py::arg("beta2"), py::arg("eps"),
          py::arg("bc2_sqrt"), py::arg("step_size"), py::arg("has_decay"), py::arg("fold"));
}
