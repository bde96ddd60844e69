// Torch face of the CUDA parity kernels (parity_cuda.cu): checks tensors, takes the current
// stream and device, and calls the launchers.  Reference: leto_runtime/parity/reference.py.
#include <torch/extension.h>
#include <c10/cuda/CUDAStream.h>
#include <c10/cuda/CUDAGuard.h>

#include <optional>
#include <stdexcept>
#include <vector>

#include "parity_cuda.h"
#include "rmp_probe.h"

namespace {

void check_ptrs(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.is_cuda() && t.scalar_type() == torch::kInt64 && t.dim() == 1 && t.is_contiguous(),
              what, " must be a contiguous 1-D int64 CUDA tensor of device addresses");
}

void syndrome_mix(const torch::Tensor& pages, const torch::Tensor& outs, const torch::Tensor& coef,
                  int64_t page_bytes, int64_t variant, const std::optional<torch::Tensor>& bases,
                  int64_t batch, const std::optional<torch::Tensor>& scale) {
  check_ptrs(pages, "pages");
  check_ptrs(outs, "outs");
  TORCH_CHECK(pages.device() == outs.device(), "pages and outs on different devices");
  TORCH_CHECK(page_bytes > 0 && page_bytes % 1024 == 0, "page_bytes must be a multiple of 1024");
  TORCH_CHECK(batch >= 1 && batch <= 65535, "batch must be 1..65535");
  TORCH_CHECK(pages.numel() % batch == 0 && outs.numel() % batch == 0,
              "pages and outs must hold batch equal-sized address arrays");
  const int64_t m_out = outs.numel() / batch;
  TORCH_CHECK(m_out >= 1 && m_out <= 16, "1..16 outputs");
  TORCH_CHECK(pages.numel() / batch < (1 << 30), "too many pages");
  TORCH_CHECK(!coef.is_cuda() && coef.scalar_type() == torch::kInt32 && coef.is_contiguous() &&
                  coef.numel() == m_out * 16,
              "coef must be a contiguous int32 CPU tensor of shape (outputs, 16)");
  std::vector<uint16_t> c(static_cast<size_t>(m_out * 16));
  const int32_t* cp = coef.data_ptr<int32_t>();
  for (size_t i = 0; i < c.size(); ++i) c[i] = static_cast<uint16_t>(cp[i]);
  const c10::cuda::CUDAGuard guard(pages.device());
  SyndromeArgs a{};
  a.pages = reinterpret_cast<const uint8_t* const*>(pages.data_ptr<int64_t>());
  a.n = static_cast<int>(pages.numel() / batch);
  a.outs = reinterpret_cast<uint8_t* const*>(outs.data_ptr<int64_t>());
  a.m_out = static_cast<int>(m_out);
  a.page_bytes = page_bytes;
  a.batch = static_cast<int>(batch);
  if (bases) {
    check_ptrs(*bases, "bases");
    TORCH_CHECK(bases->device() == outs.device() && bases->numel() == outs.numel(),
                "bases must list one page per output, on the outputs' device");
    a.bases = reinterpret_cast<const uint8_t* const*>(bases->data_ptr<int64_t>());
  }
  if (scale) {
    TORCH_CHECK(!scale->is_cuda() && scale->scalar_type() == torch::kInt32 && scale->is_contiguous() &&
                    scale->numel() == 16, "scale must be a contiguous int32 CPU tensor of 16 GF(2^16) values");
    a.scaled = 1;
    for (int t = 0; t < 16; ++t) a.scale[t] = static_cast<uint32_t>(scale->data_ptr<int32_t>()[t]) & 0xFFFFu;
  }
  try {
    leto_cuda::syndrome_mix(a, c.data(), static_cast<int>(variant), c10::cuda::getCurrentCUDAStream().stream());
  } catch (const std::runtime_error& e) {
    TORCH_CHECK(false, "leto parity CUDA: ", e.what());
  }
}

void delta_update(const torch::Tensor& outs, const torch::Tensor& a_ptrs, const torch::Tensor& b_ptrs,
                  const torch::Tensor& coef, int64_t page_bytes) {
  check_ptrs(outs, "outs");
  check_ptrs(a_ptrs, "a");
  check_ptrs(b_ptrs, "b");
  TORCH_CHECK(page_bytes > 0 && page_bytes % 1024 == 0, "page_bytes must be a multiple of 1024");
  const int64_t m_out = outs.numel(), n = a_ptrs.numel();
  TORCH_CHECK(b_ptrs.numel() == n, "a and b must list the same number of pages");
  TORCH_CHECK(coef.is_cuda() && coef.device() == outs.device() && coef.scalar_type() == torch::kInt32 &&
                  coef.is_contiguous() && coef.numel() == m_out * n,
              "coef must be a contiguous int32 tensor of shape (outputs, pages) on the pages' device");
  const c10::cuda::CUDAGuard guard(outs.device());
  DeltaArgs d{};
  d.outs = reinterpret_cast<uint8_t* const*>(outs.data_ptr<int64_t>());
  d.m_out = static_cast<int>(m_out);
  d.a = reinterpret_cast<const uint8_t* const*>(a_ptrs.data_ptr<int64_t>());
  d.b = reinterpret_cast<const uint8_t* const*>(b_ptrs.data_ptr<int64_t>());
  d.n = static_cast<int>(n);
  d.coef = coef.data_ptr<int32_t>();
  d.page_bytes = page_bytes;
  try {
    leto_cuda::delta_update(d, c10::cuda::getCurrentCUDAStream().stream());
  } catch (const std::runtime_error& e) {
    TORCH_CHECK(false, "leto parity CUDA: ", e.what());
  }
}

bool coef_is_baked(const torch::Tensor& coef) {
  TORCH_CHECK(!coef.is_cuda() && coef.scalar_type() == torch::kInt32 && coef.is_contiguous() &&
                  coef.numel() % 16 == 0, "coef must be an int32 CPU tensor of shape (outputs, 16)");
  std::vector<uint16_t> c(static_cast<size_t>(coef.numel()));
  for (size_t i = 0; i < c.size(); ++i) c[i] = static_cast<uint16_t>(coef.data_ptr<int32_t>()[i]);
  return leto_cuda::coef_is_baked(c.data(), static_cast<int>(coef.numel() / 16));
}

// RMP localization (rmp_probe.cpp): returns the failed page indices as a Python list.  The GIL
// is released for the driver loop.
std::vector<int64_t> rmp_probe_unmapped(uint64_t base, int64_t page_bytes, int64_t n_pages,
                                        const std::optional<std::vector<int64_t>>& pages,
                                        int64_t threads) {
  TORCH_CHECK(page_bytes > 0 && n_pages >= 0, "rmp_probe_unmapped: bad page geometry");
  py::gil_scoped_release nogil;
  try {
    return leto_rmp::probe_unmapped(base, page_bytes, pages ? pages->data() : nullptr,
                                    pages ? static_cast<int64_t>(pages->size()) : 0, n_pages,
                                    static_cast<int>(threads));
  } catch (const std::runtime_error& e) {
    TORCH_CHECK(false, "leto rmp probe: ", e.what());
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Leto parity codec, CUDA kernels (see cuda/README.md)";
  m.def("syndrome_mix", &syndrome_mix,
        "outs[i] = [bases[i] ^] sum_t coef[i][t] * [scale[t] *] sum_j x^(j t) pages[j], t = -7..8, per batch",
        py::arg("pages"), py::arg("outs"), py::arg("coef"), py::arg("page_bytes"), py::arg("variant") = 0,
        py::arg("bases") = py::none(), py::arg("batch") = 1, py::arg("scale") = py::none());
  m.def("delta_update", &delta_update, "outs[i] ^= sum_l coef[i][l] * (a[l] ^ b[l])");
  m.def("coef_is_baked", &coef_is_baked, "whether these mix coefficients take the compiled-in path");
  m.def("rmp_probe_unmapped", &rmp_probe_unmapped,
        "indices of the pages at base + i * page_bytes that cuPointerGetAttribute does not know",
        py::arg("base"), py::arg("page_bytes"), py::arg("n_pages"), py::arg("pages") = py::none(),
        py::arg("threads") = 1);
  m.attr("VARIANTS") = py::dict(py::arg("auto") = 0, py::arg("simple") = 1, py::arg("nb2") = 2,
                                py::arg("nobake") = 3, py::arg("plain") = 4,
                                py::arg("unrolled") = 5);
}
