"""Map the pages of one retained state back to back into one reserved virtual-address range.

Role: the memory half of the client (and of the state manager's host-page scan).  Two kinds:

* `HostMapping`: memfd pages (host state, all parity, and the CPU stand-in for device pages).
  The range is reserved PROT_NONE, then every page is mmap'ed MAP_SHARED|MAP_FIXED at its
  offset.  `probe()` is the real host localization path: MADV_POPULATE_READ over the range,
  recursive bisection of any part that fails with EHWPOISON (hardware poison) or EFAULT
  (nothing is there: e.g. a page truncated away, which is how a CPU stand-in device page
  "fails" -- see leto_run/state_manager/pool.py).  `pin()` registers the range with CUDA for
  fast host<->device copies.
* `CudaMapping`: cuMemCreate pages imported from POSIX fds (docs/MEMORY.md, "How a trainer maps
  them"): import, close the fd at once (an open fd pins memory), cuMemMap at the page's offset,
  cuMemRelease (the mapping keeps the memory), one cuMemSetAccess per contiguous run.  Each page is
  its own cuMemMap, so one page can be unmapped or replaced alone.  `probe()` asks the driver about
  every page (cuPointerGetAttribute, in a C++ loop: cuda/rmp_probe.cpp); an unmapped or retired
  page fails the query.

Calling contract: page fds handed to `map_page(s)` are consumed (closed) in every case.  Nothing
here tracks tensors: `tensors.ViewRegistry` does, and the owner must wait for it before
`close()`.  CUDA work needs a current context; `CudaMapping` makes the device's primary context
current (the one torch uses).  Nothing imports torch or cuda-python at module import.
"""
from __future__ import annotations

import ctypes
import errno
import logging
import mmap
import os
from typing import Iterable, Sequence

from leto_runtime import settings

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

PROT_NONE = 0                    # the mmap module lacks PROT_NONE on 3.11
MAP_FIXED = 0x10
MAP_NORESERVE = 0x4000
MAP_FAILED = ctypes.c_void_p(-1).value
MADV_POPULATE_READ = 22          # Linux >= 5.14; Python 3.11/3.12 lack the constant
EHWPOISON = 133                  # likewise missing from the errno module
_PROBE_FAIL = (EHWPOISON, errno.EFAULT)


def _check_mmap(addr: int | None, what: str) -> int:
    if addr is None or addr == MAP_FAILED:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")
    return addr


def _page_runs(pages) -> list[tuple[int, int]]:
    """Consecutive runs [lo, hi) of the sorted page indices `pages`."""
    out: list[list[int]] = []
    for i in pages:
        if out and out[-1][1] == i:
            out[-1][1] = i + 1
        else:
            out.append([i, i + 1])
    return [(lo, hi) for lo, hi in out]


def scan_range(base: int, n_pages: int, page_bytes: int, pages: Sequence[int] | None = None) -> list[int]:
    """Indices of pages in [0, n_pages) that MADV_POPULATE_READ cannot populate.

    One madvise over each contiguous run; a run that fails is halved until the failing pages
    are isolated (log2(n) calls per failed page).  `pages` restricts the scan to those indices.
    """
    runs = _page_runs(sorted(set(range(n_pages) if pages is None else pages)))
    failed: list[int] = []
    stack = list(reversed(runs))
    while stack:
        lo, hi = stack.pop()
        while True:
            r = _libc.madvise(base + lo * page_bytes, (hi - lo) * page_bytes, MADV_POPULATE_READ)
            err = ctypes.get_errno() if r else 0
            if err not in (errno.EINTR, errno.EAGAIN):
                break
        if r == 0:
            continue
        if err not in _PROBE_FAIL:
            raise OSError(err, f"madvise(MADV_POPULATE_READ) on pages {lo}..{hi - 1}: "
                               f"{os.strerror(err)}")
        if hi - lo == 1:
            failed.append(lo)
            continue
        mid = (lo + hi) // 2
        stack.append((mid, hi))
        stack.append((lo, mid))
    return sorted(failed)


class HostMapping:
    """`n_pages` memfd pages of `page_bytes`, back to back from `base`."""

    kind = "host"

    def __init__(self, n_pages: int, page_bytes: int):
        if page_bytes % mmap.PAGESIZE:
            raise ValueError(f"page_bytes={page_bytes} is not a multiple of {mmap.PAGESIZE}")
        self.n_pages, self.page_bytes = n_pages, page_bytes
        self.size = n_pages * page_bytes
        # PROT_NONE + NORESERVE: address space only; an unmapped page traps instead of reading zeros.
        self.base = _check_mmap(_libc.mmap(None, max(self.size, 1), PROT_NONE,
                                           mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_NORESERVE,
                                           -1, 0), "reserving address space")
        self.mapped: set[int] = set()
        self.pinned = False                  # page-locked (whole, or every readable run)
        self._runs: list[tuple[int, int]] = []   # registered page runs [lo, hi)

    def addr(self, i: int) -> int:
        return self.base + i * self.page_bytes

    def map_page(self, i: int, fd: int) -> None:
        """Map memfd `fd` as page i (replacing whatever was there); closes fd."""
        try:
            if not 0 <= i < self.n_pages:
                raise IndexError(f"page {i} outside 0..{self.n_pages - 1}")
            _check_mmap(_libc.mmap(self.addr(i), self.page_bytes, mmap.PROT_READ | mmap.PROT_WRITE,
                                   mmap.MAP_SHARED | MAP_FIXED, fd, 0), f"mapping page {i}")
            self.mapped.add(i)
        finally:
            os.close(fd)

    def map_pages(self, pairs: Iterable[tuple[int, int]], grant: bool = True) -> None:
        pairs = list(pairs)
        try:
            for n, (i, fd) in enumerate(pairs):
                self.map_page(i, fd)
        except BaseException:
            for _, fd in pairs[n + 1:]:
                _close(fd)
            raise

    replace_pages = map_pages          # MAP_FIXED replaces whatever was mapped there

    def grant_all(self) -> None:
        """Host pages are accessible once mapped (the CUDA mapping's deferred grant)."""

    def unmap_pages(self, pages: Iterable[int]) -> None:
        for i in sorted(set(pages)):
            self.unmap_page(i)

    def unmap_page(self, i: int) -> None:
        """Put an inaccessible hole where page i was (the reservation stays)."""
        _check_mmap(_libc.mmap(self.addr(i), self.page_bytes, PROT_NONE,
                               mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_FIXED | MAP_NORESERVE,
                               -1, 0), f"unmapping page {i}")
        self.mapped.discard(i)

    def probe(self, pages: Sequence[int] | None = None) -> list[int]:
        """Pages that cannot be read (poisoned, truncated away, or never mapped)."""
        want = range(self.n_pages) if pages is None else pages
        holes = [i for i in want if i not in self.mapped]
        return sorted(set(holes) | set(scan_range(self.base, self.n_pages, self.page_bytes,
                                                  [i for i in want if i in self.mapped])))

    def fill(self, i: int, byte: int) -> None:
        ctypes.memset(self.addr(i), byte, self.page_bytes)

    # ---- pinning (GPU machines): page-locked for fast, asynchronous copies -----------------
    def pin(self) -> bool:
        """Page-lock the range for CUDA; False where CUDA is absent (CPU machines).

        Through the driver API (cuMemHostRegister), whose failures leave no "last error" that
        torch's next kernel-launch check would report.  A range with a lost page in it (a
        truncated memfd: an injected or real loss not yet repaired) cannot be registered whole;
        then every readable run is, so attaching such a state works and the loss is repaired
        by localize/remap, which pins again."""
        if self.pinned or not self.size:
            return self.pinned
        import torch

        if not torch.cuda.is_available():
            return False
        ensure_context(torch.cuda.current_device())
        why = self._register(0, self.n_pages)
        if why is None:
            self._runs = [(0, self.n_pages)]
        else:
            lost = set(self.probe())
            runs = _page_runs(i for i in range(self.n_pages) if i not in lost)
            self._runs = [r for r in runs if self._register(*r) is None] if lost else []
            if not self._runs or len(self._runs) < len(runs):
                import warnings      # not fatal: copies still work, only slower and synchronous
                warnings.warn(f"leto rmp: page-locking {self.size} bytes of parity failed "
                              f"({why}); host<->device parity copies will not be pinned")
        self.pinned = bool(self._runs)
        return self.pinned

    def _register(self, lo: int, hi: int) -> str | None:
        cu = cuda_driver()
        r = cu.cuMemHostRegister(self.addr(lo), (hi - lo) * self.page_bytes, 0)
        return None if r[0] == cu.CUresult.CUDA_SUCCESS else getattr(r[0], "name", str(r[0]))

    def unpin(self) -> None:
        if self.pinned:
            cu = cuda_driver()
            for lo, _ in self._runs:
                cu.cuMemHostUnregister(self.addr(lo))
            self._runs, self.pinned = [], False

    def close(self) -> None:
        if self.base is None:
            return
        self.unpin()
        _libc.munmap(self.base, max(self.size, 1))
        self.base = None
        self.mapped.clear()


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


# ---- CUDA ------------------------------------------------------------------------------------
def cuda_driver():
    """`cuda.bindings.driver`, imported on first use only (CPU machines never need it)."""
    from cuda.bindings import driver as cu
    return cu


def cu_check(r, what: str):
    """Unpack a cuda-python result tuple; raise OSError naming the call on failure."""
    cu = cuda_driver()
    if r[0] != cu.CUresult.CUDA_SUCCESS:
        raise OSError(f"{what}: {r[0].name if hasattr(r[0], 'name') else r[0]}")
    return None if len(r) == 1 else (r[1] if len(r) == 2 else r[1:])


def ensure_context(device: int) -> None:
    """Make `device`'s primary context (torch's) current on this thread."""
    cu = cuda_driver()
    cu_check(cu.cuInit(0), "cuInit")                 # idempotent; the driver API needs it first
    ctx = cu_check(cu.cuCtxGetCurrent(), "cuCtxGetCurrent")
    if ctx is not None and int(ctx) != 0:
        dev = cu_check(cu.cuCtxGetDevice(), "cuCtxGetDevice")
        if int(dev) == device:
            return
    import torch

    torch.cuda.set_device(device)
    torch.empty(1, device=f"cuda:{device}")          # creates torch's primary context
    ctx = cu_check(cu.cuCtxGetCurrent(), "cuCtxGetCurrent")
    if ctx is not None and int(ctx) != 0:
        return                                        # torch made it current on this thread
    dev = cu.CUdevice(device)
    ctx = cu_check(cu.cuDevicePrimaryCtxRetain(dev), "cuDevicePrimaryCtxRetain")
    cu_check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    cu.cuDevicePrimaryCtxRelease(dev)                 # torch holds its own reference


# Threads of the native probe loop (1: the caller's thread; more only pays if the driver's
# pointer lookup scales, see docs/BENCHMARKS.md).  LETO_RMP_PROBE_THREADS overrides.
PROBE_THREADS = settings.get().rmp_probe_threads
_probe_fn: object = None            # None: not resolved yet; False: unavailable


def _native_probe():
    """`rmp_probe_unmapped` of the CUDA parity extension, or None (logged once) when that
    extension cannot be built or loaded here; the caller then uses the cuda-python loop."""
    global _probe_fn
    if _probe_fn is None:
        try:
            from leto_runtime.parity import _ext
            from leto_runtime.parity.errors import ParityBackendUnavailable
            try:
                _probe_fn = _ext.load_cuda().rmp_probe_unmapped
            except (ParityBackendUnavailable, AttributeError) as e:
                _probe_fn = False
                logging.getLogger("leto.rmp").warning(
                    "leto rmp: native device-page probe unavailable (%s); localization uses the "
                    "cuda-python loop (~1-1.8 us a page)", str(e).splitlines()[0][:300])
        except ImportError as e:      # pragma: no cover - the parity package is part of leto
            _probe_fn = False
            logging.getLogger("leto.rmp").warning("leto rmp: native probe unavailable: %s", e)
    return _probe_fn or None


# Cold attach (CudaMapping.map_pages): "native" (cuda/rmp_map.cpp through ctypes; falls back to
# the cuda-python loop, logged once, where it cannot be built) or "python" (the reference).
# MAP_THREADS: workers of the native import+map loop; MAP_BATCH: fds received before one native
# call (bounded by RLIMIT_NOFILE); GRANT_ONCE: one cuMemSetAccess pass over the whole state at
# the end of an attach instead of one per batch.  Defaults from docs/BENCHMARKS.md.
MAP_PATH = settings.get().rmp_map
MAP_THREADS = settings.get().rmp_map_threads
MAP_BATCH = settings.get().rmp_map_batch
GRANT_ONCE = settings.get().rmp_grant_once


def _native_map():
    from leto_runtime.rmp import native_map
    return native_map.load()


class CudaMapping:
    """`n_pages` VMM pages of `page_bytes` on `device`, back to back from `base`."""

    kind = "cuda"

    def __init__(self, n_pages: int, page_bytes: int, device: int):
        cu = cuda_driver()
        ensure_context(device)
        self.cu, self.device = cu, device
        self.n_pages, self.page_bytes = n_pages, page_bytes
        self.size = n_pages * page_bytes
        self._fd_type = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        va = cu_check(cu.cuMemAddressReserve(self.size, page_bytes, 0, 0), "cuMemAddressReserve")
        self.base = int(va)
        self.mapped: set[int] = set()
        acc = cu.CUmemAccessDesc()
        acc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        acc.location.id = device
        acc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
        self._access = [acc]
        self._attr = cu.CUpointer_attribute.CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL
        self._ok = cu.CUresult.CUDA_SUCCESS

    def addr(self, i: int) -> int:
        return self.base + i * self.page_bytes

    def map_pages(self, pairs: Iterable[tuple[int, int]], grant: bool = True) -> None:
        """Import, map and (unless `grant` is False: see `grant_all`) grant access to pages;
        every fd is closed, success or not.  Native (cuda/rmp_map.cpp, `MAP_THREADS` workers)
        when `MAP_PATH` is "native" and the library loads, else `_map_pages_python`."""
        pairs = sorted(pairs)
        lib = _native_map() if MAP_PATH == "native" else None
        if lib is None:
            return self._map_pages_python(pairs, grant)
        bad = [i for i, _ in pairs if not 0 <= i < self.n_pages]
        if bad:
            for _, fd in pairs:
                _close(fd)
            raise IndexError(f"page {bad[0]} outside 0..{self.n_pages - 1}")
        idx = [i for i, _ in pairs]
        try:
            done = lib.map_pages(self.base, self.page_bytes, idx, [fd for _, fd in pairs],
                                 self.device, threads=MAP_THREADS, grant=grant)
        except OSError as e:
            self.mapped.update(getattr(e, "mapped", ()))
            raise
        self.mapped.update(done)

    def _map_pages_python(self, pairs: list[tuple[int, int]], grant: bool = True) -> None:
        """Reference of the native path: the same driver calls per page through cuda-python."""
        cu, P = self.cu, self.page_bytes
        done: list[int] = []
        try:
            for n, (i, fd) in enumerate(pairs):
                if not 0 <= i < self.n_pages:
                    raise IndexError(f"page {i} outside 0..{self.n_pages - 1}")
                try:
                    h = cu_check(cu.cuMemImportFromShareableHandle(fd, self._fd_type),
                                 f"cuMemImportFromShareableHandle (page {i})")
                finally:
                    os.close(fd)
                try:
                    cu_check(cu.cuMemMap(self.base + i * P, P, 0, h, 0), f"cuMemMap (page {i})")
                finally:
                    cu.cuMemRelease(h)                   # the mapping keeps the memory alive
                self.mapped.add(i)
                done.append(i)
        except BaseException:
            for _, fd in pairs[n + 1:]:
                _close(fd)
            raise
        finally:
            if grant:
                self._grant(done)

    def _grant(self, pages: list[int]) -> None:
        """One cuMemSetAccess per contiguous run of newly mapped pages (cuda-python)."""
        P = self.page_bytes
        run: list[int] = []
        for i in sorted(pages) + [None]:
            if run and (i is None or i != run[-1] + 1):
                cu_check(self.cu.cuMemSetAccess(self.base + run[0] * P, len(run) * P,
                                                self._access, 1), "cuMemSetAccess")
                run = []
            if i is not None:
                run.append(i)

    def grant_all(self) -> None:
        """cuMemSetAccess over every mapped page, once per run of consecutive pages (after
        `map_pages(..., grant=False)`; granting a page twice is harmless)."""
        lib = _native_map() if MAP_PATH == "native" else None
        if lib is not None:
            lib.grant(self.base, self.page_bytes, sorted(self.mapped), self.device)
        else:
            self._grant(sorted(self.mapped))

    def map_page(self, i: int, fd: int) -> None:
        if i in self.mapped:
            self.unmap_page(i)
        self.map_pages([(i, fd)])

    def replace_pages(self, pairs: Iterable[tuple[int, int]]) -> None:
        """Map fresh fds over pages that may be mapped now (same addresses; no GPU work may
        use them meanwhile)."""
        pairs = list(pairs)
        self.unmap_pages([i for i, _ in pairs if i in self.mapped])
        self.map_pages(pairs)

    def unmap_page(self, i: int) -> None:
        self.cu.cuMemUnmap(self.base + i * self.page_bytes, self.page_bytes)
        self.mapped.discard(i)

    def unmap_pages(self, pages: Iterable[int]) -> None:
        pages = sorted(set(pages) & self.mapped)
        lib = _native_map() if MAP_PATH == "native" else None
        if lib is not None and pages:
            lib.unmap_pages(self.base, self.page_bytes, pages)
            self.mapped.difference_update(pages)
            return
        for i in pages:
            self.unmap_page(i)

    def probe(self, pages: Sequence[int] | None = None) -> list[int]:
        """Pages whose mapping the driver does not know (cuPointerGetAttribute fails), in the
        order probed.  Native loop (cuda/rmp_probe.cpp, ~0.3 us a page on the H200 instead of
        ~1-1.8 us through cuda-python) when the CUDA extension is available, else
        `_probe_python` (logged once)."""
        fn = _native_probe()
        if fn is None:
            return self._probe_python(pages)
        want = None if pages is None else [int(i) for i in pages]
        if want == []:
            return []          # the native probe reads an empty list as "every page"
        return list(fn(self.base, self.page_bytes, self.n_pages, want, PROBE_THREADS))

    def _probe_python(self, pages: Sequence[int] | None = None) -> list[int]:
        """Reference of the native probe: the same driver query per page through cuda-python."""
        get, attr, ok, base, P = (self.cu.cuPointerGetAttribute, self._attr, self._ok,
                                  self.base, self.page_bytes)
        want = range(self.n_pages) if pages is None else pages
        return [i for i in want if get(attr, base + i * P)[0] != ok]

    def fill(self, i: int, byte: int) -> None:
        cu_check(self.cu.cuMemsetD8(self.addr(i), byte, self.page_bytes), "cuMemsetD8")
        cu_check(self.cu.cuCtxSynchronize(), "cuCtxSynchronize")

    def pin(self) -> bool:
        return False

    def unpin(self) -> None:
        pass

    def close(self) -> None:
        if self.base is None:
            return
        ensure_context(self.device)
        self.cu.cuCtxSynchronize()
        self.unmap_pages(list(self.mapped))
        self.cu.cuMemAddressFree(self.base, self.size)
        self.mapped.clear()
        self.base = None
