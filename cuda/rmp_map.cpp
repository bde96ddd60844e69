// Native import + map of RMP device pages (the cold attach of a retained state).
// Python face: leto_runtime/rmp/native_map.py (ctypes; built with g++ on first use, no torch);
// caller: CudaMapping.map_pages (leto_runtime/rmp/mapping.py).  Reference: CudaMapping's
// cuda-python loop (`_map_pages_python`), which stays; tests check both map the same pages.
//
// Per page, exactly the reference's sequence: cuMemImportFromShareableHandle(fd, POSIX_FD) ->
// close(fd) -> cuMemMap(base + idx * page_bytes, page_bytes, 0, h, 0) -> cuMemRelease(h) (the
// mapping keeps the memory).  Then cuMemSetAccess once per maximal run of consecutive pages
// mapped by this call (grant != 0), or not at all (grant == 0: the caller grants later, e.g.
// once over the whole state).  What native code buys: no cuda-python argument conversion
// (~1-2 us a call, three calls a page), and optionally `threads` workers, each with the
// caller's context current, over contiguous slices (whether the driver scales is measured in
// benchmarks/rmp_bench.py).
//
// Contract: every fd is closed exactly once, success or not.  mapped[k] = 1 for each page k
// that ended up mapped (the caller records them; an error leaves the others unmapped).
// Returns 0, or the CUresult of the first failure; *err_call names it (1 import, 2 map,
// 3 set-access, 4 missing driver symbol) and *err_index is its position k (or -1).
//
// The driver comes from dlopen(libcuda.so.1) (loaded by torch already) or, for the CPU tests,
// from the library given to rmp_map_init (a fake driver that records calls).  cuda.h provides
// the types only.
#include <cuda.h>
#include <dlfcn.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <thread>
#include <vector>

namespace {

struct Driver {
  decltype(&cuMemImportFromShareableHandle) import_ = nullptr;
  decltype(&cuMemMap) map = nullptr;
  decltype(&cuMemRelease) release = nullptr;
  decltype(&cuMemSetAccess) set_access = nullptr;
  decltype(&cuMemUnmap) unmap = nullptr;
  decltype(&cuCtxGetCurrent) get_ctx = nullptr;
  decltype(&cuCtxSetCurrent) set_ctx = nullptr;
  bool ok() const {
    return import_ && map && release && set_access && unmap && get_ctx && set_ctx;
  }
};

Driver g_drv;
std::mutex g_init_mu;

template <class F>
void sym(void* lib, const char* name, F& out) {
  out = reinterpret_cast<F>(dlsym(lib, name));
}

}  // namespace

extern "C" {

// Resolve the driver entry points; path == nullptr: libcuda.so.1.  Returns 0 when all found.
int rmp_map_init(const char* path) {
  std::lock_guard<std::mutex> g(g_init_mu);
  const char* lib_name = path ? path : "libcuda.so.1";
  void* lib = path ? nullptr : dlopen(lib_name, RTLD_NOW | RTLD_NOLOAD);
  if (lib == nullptr) lib = dlopen(lib_name, RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) return 1;
  Driver d;
  sym(lib, "cuMemImportFromShareableHandle", d.import_);
  sym(lib, "cuMemMap", d.map);
  sym(lib, "cuMemRelease", d.release);
  sym(lib, "cuMemSetAccess", d.set_access);
  sym(lib, "cuMemUnmap", d.unmap);
  sym(lib, "cuCtxGetCurrent", d.get_ctx);
  sym(lib, "cuCtxSetCurrent", d.set_ctx);
  if (!d.ok()) return 2;
  g_drv = d;
  return 0;
}

int rmp_map_grant(uint64_t base, uint64_t page_bytes, const int64_t* idx, int64_t n, int device,
                  int64_t* err_index);

int rmp_map_pages(uint64_t base, uint64_t page_bytes, const int64_t* idx, const int32_t* fds,
                  int64_t n, int device, int threads, int grant, uint8_t* mapped,
                  int32_t* err_call, int64_t* err_index) {
  *err_call = 0;
  *err_index = -1;
  if (!g_drv.ok()) {
    for (int64_t k = 0; k < n; ++k) close(fds[k]);
    *err_call = 4;
    return 1;
  }
  std::fill(mapped, mapped + n, 0);
  std::atomic<int> first_rc{0};
  std::atomic<int64_t> first_k{-1};
  std::atomic<int> first_call{0};
  std::mutex err_mu;
  auto fail = [&](int rc, int call, int64_t k) {
    std::lock_guard<std::mutex> g(err_mu);
    if (first_rc.load() == 0) {
      first_rc = rc;
      first_call = call;
      first_k = k;
    }
  };
  auto work = [&](int64_t lo, int64_t hi) {
    for (int64_t k = lo; k < hi; ++k) {
      const int fd = fds[k];
      if (first_rc.load(std::memory_order_relaxed) != 0) {  // stop early; still close fds
        close(fd);
        continue;
      }
      CUmemGenericAllocationHandle h = 0;
      CUresult r = g_drv.import_(&h, reinterpret_cast<void*>(static_cast<intptr_t>(fd)),
                                 CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
      close(fd);
      if (r != CUDA_SUCCESS) {
        fail(r, 1, k);
        continue;
      }
      r = g_drv.map(static_cast<CUdeviceptr>(base + static_cast<uint64_t>(idx[k]) * page_bytes),
                    page_bytes, 0, h, 0);
      g_drv.release(h);
      if (r != CUDA_SUCCESS) {
        fail(r, 2, k);
        continue;
      }
      mapped[k] = 1;
    }
  };
  if (threads <= 1 || n < 2 * threads) {
    work(0, n);
  } else {
    CUcontext ctx = nullptr;
    g_drv.get_ctx(&ctx);
    std::vector<std::thread> pool;
    pool.reserve(threads);
    for (int t = 0; t < threads; ++t) {
      const int64_t lo = n * t / threads, hi = n * (t + 1) / threads;
      pool.emplace_back([&, lo, hi] {
        if (ctx != nullptr) g_drv.set_ctx(ctx);
        work(lo, hi);
      });
    }
    for (auto& th : pool) th.join();
  }
  if (grant) {
    std::vector<int64_t> done;
    done.reserve(n);
    for (int64_t k = 0; k < n; ++k)
      if (mapped[k]) done.push_back(idx[k]);
    int64_t at = -1;
    int rc = rmp_map_grant(base, page_bytes, done.data(), static_cast<int64_t>(done.size()),
                           device, &at);
    if (rc != 0 && first_rc.load() == 0) {
      first_rc = rc;
      first_call = 3;
      first_k = -1;
    }
  }
  *err_call = first_call.load();
  *err_index = first_k.load();
  return first_rc.load();
}

// cuMemSetAccess (read-write for `device`) once per maximal run of consecutive page indices
// among idx[0..n) (any order).  Returns 0 or the first failure's CUresult.
int rmp_map_grant(uint64_t base, uint64_t page_bytes, const int64_t* idx, int64_t n, int device,
                  int64_t* err_index) {
  *err_index = -1;
  if (!g_drv.ok()) return 1;
  std::vector<int64_t> s(idx, idx + n);
  std::sort(s.begin(), s.end());
  s.erase(std::unique(s.begin(), s.end()), s.end());
  CUmemAccessDesc acc = {};
  acc.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  acc.location.id = device;
  acc.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  size_t i = 0;
  while (i < s.size()) {
    size_t j = i + 1;
    while (j < s.size() && s[j] == s[j - 1] + 1) ++j;
    const CUresult r = g_drv.set_access(
        static_cast<CUdeviceptr>(base + static_cast<uint64_t>(s[i]) * page_bytes),
        (j - i) * page_bytes, &acc, 1);
    if (r != CUDA_SUCCESS) {
      *err_index = s[i];
      return r;
    }
    i = j;
  }
  return 0;
}

// cuMemUnmap of each listed page (teardown and in-place replacement); returns the number of
// pages whose unmap failed (they are reported in failed[k] = 1).
int64_t rmp_unmap_pages(uint64_t base, uint64_t page_bytes, const int64_t* idx, int64_t n,
                        uint8_t* failed) {
  if (!g_drv.ok()) return n;
  int64_t bad = 0;
  for (int64_t k = 0; k < n; ++k) {
    const CUresult r = g_drv.unmap(
        static_cast<CUdeviceptr>(base + static_cast<uint64_t>(idx[k]) * page_bytes), page_bytes);
    failed[k] = r != CUDA_SUCCESS;
    bad += failed[k];
  }
  return bad;
}

}  // extern "C"
