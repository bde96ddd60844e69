"""cuda/rmp_map.cpp (native import + map of device pages) against a fake CUDA driver that
records every call, on CPU: same pages as the reference sequence, every fd closed exactly once,
access granted per run of consecutive pages, errors reported with what did get mapped; and
CudaMapping's deferred grant.  The real driver is exercised in tests/gpu/test_rmp_perf_paths.py."""
from __future__ import annotations

import ctypes
import os
import shutil
import subprocess

import pytest

from leto_runtime.rmp import native_map

FAKE = r"""
#include <cuda.h>
#include <mutex>
#include <sys/stat.h>
#include <vector>
static std::mutex mu;
static std::vector<long long> imports, maps, access_lo, access_len;
static int live = 0;
extern "C" {
CUresult cuMemImportFromShareableHandle(CUmemGenericAllocationHandle* h, void* os,
                                        CUmemAllocationHandleType t) {
  struct stat st;
  int fd = (int)(long)os;
  if (t != CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR || fstat(fd, &st) || !S_ISREG(st.st_mode))
    return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard<std::mutex> g(mu);
  imports.push_back(st.st_ino); *h = st.st_ino; ++live; return CUDA_SUCCESS;
}
CUresult cuMemMap(CUdeviceptr p, size_t size, size_t off, CUmemGenericAllocationHandle h,
                  unsigned long long f) {
  std::lock_guard<std::mutex> g(mu); maps.push_back((long long)p); return CUDA_SUCCESS;
}
CUresult cuMemRelease(CUmemGenericAllocationHandle h) {
  std::lock_guard<std::mutex> g(mu); --live; return CUDA_SUCCESS;
}
CUresult cuMemSetAccess(CUdeviceptr p, size_t n, const CUmemAccessDesc* d, size_t c) {
  if (c != 1 || d->location.type != CU_MEM_LOCATION_TYPE_DEVICE ||
      d->flags != CU_MEM_ACCESS_FLAGS_PROT_READWRITE) return CUDA_ERROR_INVALID_VALUE;
  std::lock_guard<std::mutex> g(mu);
  access_lo.push_back((long long)p); access_len.push_back((long long)n); return CUDA_SUCCESS;
}
CUresult cuMemUnmap(CUdeviceptr p, size_t n) {
  std::lock_guard<std::mutex> g(mu); maps.push_back(-(long long)p); return CUDA_SUCCESS;
}
CUresult cuCtxGetCurrent(CUcontext* c) { *c = nullptr; return CUDA_SUCCESS; }
CUresult cuCtxSetCurrent(CUcontext c) { return CUDA_SUCCESS; }
long long fake_count(int which) {
  std::lock_guard<std::mutex> g(mu);
  return which == 0 ? imports.size() : which == 1 ? maps.size() : which == 2 ? access_lo.size()
       : live;
}
long long fake_get(int which, int i) {
  std::lock_guard<std::mutex> g(mu);
  return which == 1 ? maps[i] : which == 2 ? access_lo[i] : access_len[i];
}
void fake_reset() { std::lock_guard<std::mutex> g(mu); imports.clear(); maps.clear();
                    access_lo.clear(); access_len.clear(); live = 0; }
}
"""

BASE, PAGE = 1 << 40, 2 << 20


@pytest.fixture(scope="module")
def fake(tmp_path_factory):
    inc, cxx = native_map._cuda_include(), shutil.which("g++")
    if inc is None or cxx is None:
        pytest.skip("needs cuda.h and g++ to build the native mapper")
    d = tmp_path_factory.mktemp("fakecuda")
    (d / "fake.cpp").write_text(FAKE)
    so = str(d / "libfakecuda.so")
    subprocess.run([cxx, "-shared", "-fPIC", "-std=c++17", f"-I{inc}", "-o", so,
                    str(d / "fake.cpp")], check=True)
    lib = native_map.load(driver=so)
    assert lib is not None
    drv = ctypes.CDLL(so)
    drv.fake_count.restype = drv.fake_get.restype = ctypes.c_longlong
    return lib, drv


def memfds(n):
    return [os.memfd_create(f"p{i}") for i in range(n)]


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("threads", [1, 4])
def test_maps_the_same_pages_and_closes_every_fd(fake, threads):
    lib, drv = fake
    drv.fake_reset()
    before = open_fds()
    idx = [5, 1, 2, 3, 9, 10, 40] + list(range(100, 150))
    fds = memfds(len(idx))
    done = lib.map_pages(BASE, PAGE, idx, fds, 0, threads=threads, grant=True)
    assert sorted(done) == sorted(idx)
    assert open_fds() == before                          # closed, each exactly once
    assert drv.fake_count(0) == len(idx) and drv.fake_count(3) == 0   # every handle released
    mapped = sorted(drv.fake_get(1, i) for i in range(drv.fake_count(1)))
    assert mapped == sorted(BASE + i * PAGE for i in idx)
    runs = sorted((drv.fake_get(2, i), drv.fake_get(3, i)) for i in range(drv.fake_count(2)))
    assert runs == [(BASE + 1 * PAGE, 3 * PAGE), (BASE + 5 * PAGE, PAGE),
                    (BASE + 9 * PAGE, 2 * PAGE), (BASE + 40 * PAGE, PAGE),
                    (BASE + 100 * PAGE, 50 * PAGE)]


def test_deferred_grant_and_errors(fake):
    lib, drv = fake
    drv.fake_reset()
    fds = memfds(6)
    assert lib.map_pages(BASE, PAGE, [0, 1, 2, 3, 4, 5], fds, 0, grant=False) == list(range(6))
    assert drv.fake_count(2) == 0
    lib.grant(BASE, PAGE, [3, 4, 5, 0, 1, 2], 0)
    assert [(drv.fake_get(2, 0), drv.fake_get(3, 0))] == [(BASE, 6 * PAGE)]
    # a pipe cannot be imported: the error names the call and the page; every fd is closed
    drv.fake_reset()
    before = open_fds()
    r, w = os.pipe()
    fds = memfds(2) + [r] + memfds(2)
    with pytest.raises(native_map.NativeMapError) as ei:
        lib.map_pages(BASE, PAGE, [0, 1, 2, 3, 4], fds, 0)
    assert "cuMemImportFromShareableHandle (page 2)" in str(ei.value)
    assert ei.value.mapped == [0, 1]                     # stops at the first failure
    os.close(w)
    assert open_fds() == before
    assert lib.unmap_pages(BASE, PAGE, [0, 1]) == []
