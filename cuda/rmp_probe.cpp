// Device-page localization for the RMP client: which pages of a reserved VA range have no
// mapping the driver knows about.  Python face: CudaMapping.probe (leto_runtime/rmp/mapping.py).
// Reference: CudaMapping._probe_python, the cuda-python loop it replaces (tests check that both
// report the same pages).  Per page: cuPointerGetAttribute(CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL,
// base + i * page_bytes); any result other than CUDA_SUCCESS (unmapped page: the emulated
// retirement; outside the reservation; no current context) marks the page as failed -- exactly
// the reference's rule.  The loop is here only because cuda-python costs ~1.8 us per call in
// argument conversion; the driver call itself is the same function.
//
// The driver entry point comes from dlsym on libcuda.so.1 (already loaded by torch in every
// process that maps device pages), so the extension needs no -lcuda and no driver-version
// coupling; cuda.h only provides the types and the attribute's value.
#include <cuda.h>
#include <dlfcn.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "rmp_probe.h"

namespace leto_rmp {
namespace {

using GetAttrFn = decltype(&cuPointerGetAttribute);

GetAttrFn get_attr_fn() {
  // Resolved once; a magic static makes this thread safe.
  static GetAttrFn fn = []() -> GetAttrFn {
    void* lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD);
    if (lib == nullptr) lib = dlopen("libcuda.so.1", RTLD_NOW);
    if (lib == nullptr) return nullptr;
    return reinterpret_cast<GetAttrFn>(dlsym(lib, "cuPointerGetAttribute"));
  }();
  if (fn == nullptr) throw std::runtime_error("cuPointerGetAttribute not found in libcuda.so.1");
  return fn;
}

inline bool page_failed(GetAttrFn fn, uint64_t base, int64_t page_bytes, int64_t i) {
  int ordinal = -1;
  const CUdeviceptr p = static_cast<CUdeviceptr>(base + static_cast<uint64_t>(i * page_bytes));
  return fn(&ordinal, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, p) != CUDA_SUCCESS;
}

}  // namespace

std::vector<int64_t> probe_unmapped(uint64_t base, int64_t page_bytes, const int64_t* idx,
                                    int64_t n_idx, int64_t n_pages, int threads) {
  GetAttrFn fn = get_attr_fn();
  const int64_t n = idx ? n_idx : n_pages;
  auto page = [&](int64_t k) { return idx ? idx[k] : k; };
  // The driver is called from the caller's thread by default: the current context is per
  // thread, and the workers below make it current explicitly only when threads > 1.
  if (threads <= 1 || n < 4096) {
    std::vector<int64_t> bad;
    for (int64_t k = 0; k < n; ++k)
      if (page_failed(fn, base, page_bytes, page(k))) bad.push_back(page(k));
    return bad;
  }
  // Several threads (benchmark option): each takes a contiguous slice and binds the caller's
  // context, so the answers are the same; results are concatenated in order.
  static auto get_ctx = reinterpret_cast<decltype(&cuCtxGetCurrent)>(
      dlsym(dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD), "cuCtxGetCurrent"));
  static auto set_ctx = reinterpret_cast<decltype(&cuCtxSetCurrent)>(
      dlsym(dlopen("libcuda.so.1", RTLD_NOW | RTLD_NOLOAD), "cuCtxSetCurrent"));
  if (get_ctx == nullptr || set_ctx == nullptr) throw std::runtime_error("cuCtx{Get,Set}Current not found");
  CUcontext ctx = nullptr;
  get_ctx(&ctx);
  std::vector<std::vector<int64_t>> part(threads);
  std::vector<std::thread> pool;
  for (int t = 0; t < threads; ++t) {
    pool.emplace_back([&, t] {
      if (ctx != nullptr) set_ctx(ctx);
      const int64_t lo = n * t / threads, hi = n * (t + 1) / threads;
      for (int64_t k = lo; k < hi; ++k)
        if (page_failed(fn, base, page_bytes, page(k))) part[t].push_back(page(k));
    });
  }
  for (auto& th : pool) th.join();
  std::vector<int64_t> bad;
  for (auto& p : part) bad.insert(bad.end(), p.begin(), p.end());
  return bad;
}

}  // namespace leto_rmp
