"""Native import + map of device pages (cuda/rmp_map.cpp) through ctypes.

Role: the fast path of `CudaMapping.map_pages` (the cold attach of a retained state).  The
library is plain C++ against the CUDA driver API (no torch, no pybind): built with the system
C++ compiler on first use (~1 s) into the kernel cache (`leto_runtime.wire.kernel_cache`: keyed by
the source's digest), and loaded with ctypes (whose foreign calls release the GIL).  Where it
cannot be built or loaded (no compiler, no cuda.h) `load()` returns None, logged once, and the
caller keeps the cuda-python loop (the reference).

    lib = load()                                   # NativeMap or None
    mapped = lib.map_pages(base, page_bytes, idx, fds, device, threads=1, grant=True)
    lib.grant(base, page_bytes, idx, device)       # cuMemSetAccess per run of consecutive pages

`map_pages` closes every fd, returns the indices that ended up mapped, and raises
`NativeMapError` (with `.mapped`: what did get mapped) naming the failed driver call.
Tests can bind the library to a fake driver: `load(driver="/path/libfakecuda.so")`.
"""
from __future__ import annotations

import ctypes
import logging
import os
import shutil
import threading

from leto_runtime.wire import settings

NAME = "rmp_map"
SRC = "rmp_map.cpp"            # in the kernel sources (leto_runtime.wire.kernel_cache.source_dir())
_CALLS = {1: "cuMemImportFromShareableHandle", 2: "cuMemMap", 3: "cuMemSetAccess",
          4: "the CUDA driver entry points (libcuda.so.1)"}
_lock = threading.Lock()
_loaded: dict = {}           # driver path (None: libcuda) -> NativeMap | False
log = logging.getLogger("leto.rmp")


class NativeMapError(OSError):
    def __init__(self, msg: str, mapped: list[int]):
        super().__init__(msg)
        self.mapped = mapped


def _cuda_include() -> str | None:
    cands = [settings.get().cuda_home, settings.get().cuda_path, "/usr/local/cuda"]
    nvcc = shutil.which("nvcc")
    if nvcc:
        cands.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    for c in cands:
        if c and os.path.isfile(os.path.join(c, "include", "cuda.h")):
            return os.path.join(c, "include")
    try:                       # pip wheels of the CUDA toolkit headers
        import nvidia.cuda_runtime as nr   # type: ignore
        inc = os.path.join(os.path.dirname(nr.__file__), "include")
        if os.path.isfile(os.path.join(inc, "cuda.h")):
            return inc
    except Exception:
        pass
    return None


def build() -> str:
    """Compile cuda/rmp_map.cpp into the kernel cache, once per source version
    (`leto_runtime.wire.kernel_cache`); returns the library's path."""
    from leto_runtime.wire import kernel_cache as K

    inc = _cuda_include()
    if inc is None:
        raise OSError("cuda.h not found (set CUDA_HOME)")
    cxx = K.cxx()
    if not cxx:
        raise OSError(K.NO_COMPILER)
    before, after = ["-O2", "-shared", "-fPIC", "-std=c++17", f"-I{inc}"], ["-ldl", "-pthread"]
    spec = K.Spec(NAME, "the native page mapper", (SRC,), (cxx,), (*before, "|", *after),
                  include_dirs=(inc,))
    return str(K.obtain(spec, lambda slot: K.compile_library(slot, cxx, before, after,
                                                             f"lib{NAME}.so")).path)


class NativeMap:
    def __init__(self, so: str, driver: str | None):
        lib = ctypes.CDLL(so)
        i64p, u8p = ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_uint8)
        lib.rmp_map_init.argtypes = [ctypes.c_char_p]
        lib.rmp_map_pages.argtypes = [ctypes.c_uint64, ctypes.c_uint64, i64p,
                                      ctypes.POINTER(ctypes.c_int32), ctypes.c_int64,
                                      ctypes.c_int, ctypes.c_int, ctypes.c_int, u8p,
                                      ctypes.POINTER(ctypes.c_int32), i64p]
        lib.rmp_map_grant.argtypes = [ctypes.c_uint64, ctypes.c_uint64, i64p, ctypes.c_int64,
                                      ctypes.c_int, i64p]
        lib.rmp_unmap_pages.argtypes = [ctypes.c_uint64, ctypes.c_uint64, i64p, ctypes.c_int64,
                                        u8p]
        lib.rmp_unmap_pages.restype = ctypes.c_int64
        rc = lib.rmp_map_init(None if driver is None else driver.encode())
        if rc != 0:
            raise OSError(f"rmp_map_init({driver or 'libcuda.so.1'}) = {rc}: driver entry "
                          "points not found")
        self.lib, self.so = lib, so

    def map_pages(self, base: int, page_bytes: int, idx, fds, device: int, *,
                  threads: int = 1, grant: bool = True) -> list[int]:
        n = len(idx)
        if n != len(fds):
            raise ValueError(f"{n} page indices for {len(fds)} fds")
        if n == 0:
            return []
        ia = (ctypes.c_int64 * n)(*idx)
        fa = (ctypes.c_int32 * n)(*fds)
        ma = (ctypes.c_uint8 * n)()
        call, at = ctypes.c_int32(0), ctypes.c_int64(-1)
        rc = self.lib.rmp_map_pages(base, page_bytes, ia, fa, n, device, threads, int(grant),
                                    ma, ctypes.byref(call), ctypes.byref(at))
        mapped = [idx[k] for k in range(n) if ma[k]]
        if rc:
            where = f" (page {idx[at.value]})" if 0 <= at.value < n else ""
            raise NativeMapError(f"{_CALLS.get(call.value, 'driver call')}{where}: CUresult {rc}",
                                 mapped)
        return mapped

    def grant(self, base: int, page_bytes: int, idx, device: int) -> None:
        n = len(idx)
        if n == 0:
            return
        at = ctypes.c_int64(-1)
        rc = self.lib.rmp_map_grant(base, page_bytes, (ctypes.c_int64 * n)(*idx), n, device,
                                    ctypes.byref(at))
        if rc:
            raise OSError(f"cuMemSetAccess (run from page {at.value}): CUresult {rc}")

    def unmap_pages(self, base: int, page_bytes: int, idx) -> list[int]:
        """cuMemUnmap each page; returns the indices whose unmap failed."""
        n = len(idx)
        if n == 0:
            return []
        fa = (ctypes.c_uint8 * n)()
        self.lib.rmp_unmap_pages(base, page_bytes, (ctypes.c_int64 * n)(*idx), n, fa)
        return [idx[k] for k in range(n) if fa[k]]


def load(driver: str | None = None) -> NativeMap | None:
    """The native mapper bound to `driver` (None: libcuda.so.1), or None (logged once)."""
    with _lock:
        got = _loaded.get(driver)
        if got is None:
            try:
                got = NativeMap(build(), driver)
            except Exception as e:
                got = False
                log.warning("leto rmp: native page mapping unavailable (%s); attach uses the "
                            "cuda-python loop", str(e).splitlines()[0][:300])
            _loaded[driver] = got
        return got or None
