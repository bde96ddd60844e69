// C++ CPU parity kernels: syndrome_mix (encode / decode / scrub) and delta_update.
//
// Reference: leto_runtime/parity/reference.py; Python face: leto_runtime/parity/backends.py.
//
// The same kernels are compiled for three vector widths (16-byte baseline, AVX2, AVX-512F) and
// picked at run time with cpuid, so one build runs on any x86-64 host; XOR and AND are exact,
// so every width produces the same bytes.  On other architectures only the baseline exists
// (GCC vector extensions lower it to whatever the target has).  Threads: parallel_blocks below
// splits the blocks over at::get_num_threads() threads, so torch.set_num_threads(1) gives the
// single-core figure.
//
// Pages are passed as arrays of raw addresses (int64 tensors): pages of one group need not be
// contiguous.  A zero address stands for an all-zero page.  The caller (Python) has checked
// sizes, dtypes and devices; nothing here allocates page memory.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "gf16_bitslice.h"

#ifndef LETO_CHUNK
#define LETO_CHUNK 8  // pages per L1 chunk (see parity_cpu_kernels.inc)
#endif

namespace {

// Runs fn(b0, b1) over [0, n) split into contiguous ranges on at::get_num_threads() threads
// (std::thread: at::parallel_for is an OpenMP pragma in a header, which this extension is not
// compiled with, so it would run serially).  Small jobs (< ~4 MB touched) run inline.
template <class F>
void parallel_blocks(int64_t n, int64_t bytes_per_item, F&& fn) {
  const int64_t want = std::min<int64_t>(at::get_num_threads(), n);
  const int64_t threads = std::min<int64_t>(want, std::max<int64_t>(1, n * bytes_per_item >> 22));
  if (threads <= 1) return fn(int64_t(0), n);
  std::vector<std::thread> pool;
  const int64_t per = (n + threads - 1) / threads;
  for (int64_t b = per; b < n; b += per) pool.emplace_back([&, b] { fn(b, std::min(n, b + per)); });
  fn(int64_t(0), std::min(n, per));
  for (auto& t : pool) t.join();
}

// For each output i and plane r: the (t, c) syndrome planes whose XOR gives plane r of
// sum_t coef[i][t] * S_t.  Bit r of coef*x^c is the (r, c) entry of coef's bit matrix.
struct MixPlan {
  std::vector<int> active;                    // t indices (0..15) with a non-zero column
  std::vector<std::vector<uint16_t>> rows;    // [i*16 + r] -> list of t*16 + c
};

MixPlan make_plan(const int32_t* coef, int64_t m_out) {
  MixPlan p;
  p.rows.resize(static_cast<size_t>(m_out) * 16);
  for (int t = 0; t < leto_gf::kNT; ++t) {
    bool any = false;
    for (int64_t i = 0; i < m_out; ++i) any |= coef[i * leto_gf::kNT + t] != 0;
    if (any) p.active.push_back(t);
  }
  for (int64_t i = 0; i < m_out; ++i) {
    for (int t : p.active) {
      uint32_t col = static_cast<uint32_t>(coef[i * leto_gf::kNT + t]) & 0xFFFFu;
      for (int c = 0; c < 16; ++c) {  // col = coef * x^c
        for (int r = 0; r < 16; ++r)
          if ((col >> r) & 1u) p.rows[i * 16 + r].push_back(static_cast<uint16_t>(t * 16 + c));
        col <<= 1;
        if (col & 0x10000u) col ^= leto_gf::kPoly;
      }
    }
  }
  return p;
}

}  // namespace

#if defined(__x86_64__) && defined(__GNUC__)
#pragma GCC push_options
#pragma GCC target("avx512f")
#define LETO_ISA avx512
#define LETO_VBYTES 64
#include "parity_cpu_kernels.inc"
#undef LETO_ISA
#undef LETO_VBYTES
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2")
#define LETO_ISA avx2
#define LETO_VBYTES 32
#include "parity_cpu_kernels.inc"
#undef LETO_ISA
#undef LETO_VBYTES
#pragma GCC pop_options
#define LETO_HAVE_X86_VARIANTS 1
#endif

#define LETO_ISA base
#define LETO_VBYTES 16
#include "parity_cpu_kernels.inc"
#undef LETO_ISA
#undef LETO_VBYTES

namespace {

enum class Isa { kBase, kAvx2, kAvx512 };

Isa detect_isa() {
#ifdef LETO_HAVE_X86_VARIANTS
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f")) return Isa::kAvx512;
  if (__builtin_cpu_supports("avx2")) return Isa::kAvx2;
#endif
  return Isa::kBase;
}

Isa g_isa = detect_isa();

const char* isa_name(Isa i) {
  return i == Isa::kAvx512 ? "avx512" : i == Isa::kAvx2 ? "avx2" : "base";
}

std::string get_isa() { return isa_name(g_isa); }

// For tests and benchmarks: force a narrower variant (never a wider one than the CPU has).
std::string set_isa(const std::string& name) {
  const Isa best = detect_isa();
  Isa want = name == "avx512" ? Isa::kAvx512 : name == "avx2" ? Isa::kAvx2 : Isa::kBase;
  TORCH_CHECK(name == "avx512" || name == "avx2" || name == "base" || name == "auto",
              "unknown ISA '", name, "' (avx512, avx2, base, auto)");
  if (name == "auto" || static_cast<int>(want) > static_cast<int>(best)) want = best;
  g_isa = want;
  return isa_name(g_isa);
}

template <class T>
const T* ptr_array(const torch::Tensor& t, const char* what) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == torch::kInt64 && t.dim() == 1 &&
                  t.is_contiguous(),
              what, " must be a contiguous 1-D int64 CPU tensor of addresses");
  return reinterpret_cast<const T*>(t.data_ptr<int64_t>());
}

void syndrome_mix(const torch::Tensor& pages, const torch::Tensor& outs, const torch::Tensor& coef,
                  int64_t page_bytes) {
  TORCH_CHECK(page_bytes > 0 && page_bytes % 1024 == 0, "page_bytes must be a multiple of 1024");
  const int64_t m_out = outs.numel();
  TORCH_CHECK(coef.scalar_type() == torch::kInt32 && coef.is_contiguous() &&
                  coef.numel() == m_out * leto_gf::kNT,
              "coef must be a contiguous int32 tensor of shape (outputs, 16)");
  const auto* in = ptr_array<const uint8_t*>(pages, "pages");
  auto* const* out = ptr_array<uint8_t*>(outs, "outs");
  const MixPlan plan = make_plan(coef.data_ptr<int32_t>(), m_out);
  const int64_t n = pages.numel();
  const size_t S = static_cast<size_t>(page_bytes);
  switch (g_isa) {
#ifdef LETO_HAVE_X86_VARIANTS
    case Isa::kAvx512: return avx512::syndrome_mix(in, n, out, m_out, plan, S);
    case Isa::kAvx2: return avx2::syndrome_mix(in, n, out, m_out, plan, S);
#endif
    default: return base::syndrome_mix(in, n, out, m_out, plan, S);
  }
}

void delta_update(const torch::Tensor& outs, const torch::Tensor& a, const torch::Tensor& b,
                  const torch::Tensor& coef, int64_t page_bytes) {
  TORCH_CHECK(page_bytes > 0 && page_bytes % 1024 == 0, "page_bytes must be a multiple of 1024");
  const int64_t m_out = outs.numel(), n = a.numel();
  TORCH_CHECK(b.numel() == n, "a and b must list the same number of pages");
  TORCH_CHECK(coef.scalar_type() == torch::kInt32 && coef.is_contiguous() &&
                  coef.numel() == m_out * n,
              "coef must be a contiguous int32 tensor of shape (outputs, pages)");
  std::vector<uint16_t> c(static_cast<size_t>(m_out * n));
  const int32_t* cp = coef.data_ptr<int32_t>();
  for (size_t i = 0; i < c.size(); ++i) c[i] = static_cast<uint16_t>(cp[i]);
  auto* const* out = ptr_array<uint8_t*>(outs, "outs");
  const auto* pa = ptr_array<const uint8_t*>(a, "a");
  const auto* pb = ptr_array<const uint8_t*>(b, "b");
  const size_t S = static_cast<size_t>(page_bytes);
  switch (g_isa) {
#ifdef LETO_HAVE_X86_VARIANTS
    case Isa::kAvx512: return avx512::delta_update(out, m_out, pa, pb, n, c.data(), S);
    case Isa::kAvx2: return avx2::delta_update(out, m_out, pa, pb, n, c.data(), S);
#endif
    default: return base::delta_update(out, m_out, pa, pb, n, c.data(), S);
  }
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "Leto parity codec, C++ CPU kernels (see cuda/README.md)";
  m.def("syndrome_mix", &syndrome_mix, py::call_guard<py::gil_scoped_release>(),
        "outs[i] = sum_t coef[i][t] * sum_j x^(j t) pages[j], t = -7..8");
  m.def("delta_update", &delta_update, py::call_guard<py::gil_scoped_release>(),
        "outs[i] ^= sum_l coef[i][l] * (a[l] ^ b[l])");
  m.def("isa", &get_isa, "vector ISA in use: avx512, avx2 or base");
  m.def("set_isa", &set_isa, "force a vector ISA (tests/benchmarks); returns the one in use");
}
