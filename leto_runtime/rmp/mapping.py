"""Map the pages of one retained state back to back into one reserved virtual-address range.

Role: the memory half of the client.  Two kinds:

* `HostMapping` (`leto_runtime.wire.host_pages`, shared with the state manager): memfd pages (host state, all parity, and the CPU stand-in for device pages).
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

import contextlib
import logging
import os
from typing import Iterable, Sequence

from leto_runtime.wire import settings
from leto_runtime.wire.host_pages import close_fd, cu_check, cuda_driver, ensure_context

_probe_fn: object = None            # None: not resolved yet; False: unavailable


def native_probe():
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


@contextlib.contextmanager
def override_native_probe(fn):
    """Test seam: inside the block `native_probe()` starts from `fn` -- None: not resolved yet
    (the next probe loads the extension again), False: unavailable (the cuda-python loop), a
    function: that native probe -- and the previous resolution is restored on exit."""
    global _probe_fn
    old, _probe_fn = _probe_fn, fn
    try:
        yield
    finally:
        _probe_fn = old


def _native_map():
    """The native cold-attach loop (cuda/rmp_map.cpp through ctypes) when the knob
    LETO_RMP_MAP asks for it ("native") and it loads here; None: the cuda-python loop, the
    reference.  The knobs (docs/ARCHITECTURE.md, "Tuning knobs") are read at each attach."""
    if settings.get().rmp_map != "native":
        return None
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
        every fd is closed, success or not.  Native (cuda/rmp_map.cpp, LETO_RMP_MAP_THREADS
        workers) when LETO_RMP_MAP is "native" and the library loads, else `_map_pages_python`."""
        pairs = sorted(pairs)
        lib = _native_map()
        if lib is None:
            return self._map_pages_python(pairs, grant)
        bad = [i for i, _ in pairs if not 0 <= i < self.n_pages]
        if bad:
            for _, fd in pairs:
                close_fd(fd)
            raise IndexError(f"page {bad[0]} outside 0..{self.n_pages - 1}")
        idx = [i for i, _ in pairs]
        try:
            done = lib.map_pages(self.base, self.page_bytes, idx, [fd for _, fd in pairs],
                                 self.device, threads=settings.get().rmp_map_threads, grant=grant)
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
                close_fd(fd)
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
        lib = _native_map()
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
        lib = _native_map()
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
        `probe_python` (logged once)."""
        fn = native_probe()
        if fn is None:
            return self.probe_python(pages)
        want = None if pages is None else [int(i) for i in pages]
        if want == []:
            return []          # the native probe reads an empty list as "every page"
        return list(fn(self.base, self.page_bytes, self.n_pages, want,
                       settings.get().rmp_probe_threads))

    def probe_python(self, pages: Sequence[int] | None = None) -> list[int]:
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
