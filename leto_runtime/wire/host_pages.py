"""Memfd pages mapped back to back into one reserved range: the host page layout both sides use.

Role: the part of the page mapping that the state manager (its host-page scan and the CPU
stand-in for device pages) and the trainer's client (`leto_runtime.rmp.mapping`, host state and
parity) share.  `HostMapping`: the range is reserved PROT_NONE, then every page is mmap'ed
MAP_SHARED|MAP_FIXED at its offset.  `probe()` is the real host localization path:
MADV_POPULATE_READ over the range, recursive bisection of any part that fails with EHWPOISON
(hardware poison) or EFAULT (nothing is there: e.g. a page truncated away, which is how a CPU
stand-in device page "fails" -- see leto_run/state_manager/pool.py).  `pin()` registers the
range with CUDA for fast host<->device copies.  `cuda_driver`, `cu_check` and `ensure_context`
are the driver-API helpers both sides call (cuda-python is imported on first use only).

`PAGE_KEYS`: the parameters of a `pages` injection the state manager accepts.

Calling contract: page fds handed to `map_page(s)` are consumed (closed) in every case.
"""
from __future__ import annotations

import ctypes
import errno
import mmap
import os
from typing import Iterable, Sequence

PAGE_KEYS = ("tier", "count", "first", "part", "group")

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
                close_fd(fd)
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


def close_fd(fd: int) -> None:
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
