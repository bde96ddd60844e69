"""Page owners: where a state manager's memory comes from, as file descriptors only.

* `MemfdPages`: host pages (retained host state and all parity) and, on machines without CUDA,
  the stand-in for device pages (docs/MEMORY.md, "Pages as fds").  Created with memfd_create,
  sized, and fallocate'd so that "out of memory" is an allocation error, not a later SIGBUS.
* `CudaPages`: one cuMemCreate allocation per page with POSIX-fd handles, exported, then the
  handle is released: the fd alone keeps the memory (docs/MEMORY.md, "Pages as fds").  Only
  context-free driver calls are made (cuInit, device attributes, granularity, cuMemCreate,
  export): the state manager never creates a CUDA context and uses 0 bytes of HBM for itself.

Calling contract: `device_owner(spec, slot)` picks the device pages' owner; `create(nbytes)`
returns a new page's fd (the caller owns it) or raises `protocol.PoolOutOfMemory`; `info()`
describes the owner for `hello`/`status`.
"""
from __future__ import annotations

import fcntl
import os

from leto_runtime.wire import protocol as P


class MemfdPages:
    """memfd pages.  `sealed`: they cannot grow (host pages).  No page is sealed against
    shrinking: truncation is how a lost page is emulated -- the one operation that makes every
    mapping of it trap at once, as real poison does (see `Pool._fault_pages`)."""

    kind = "memfd"

    def __init__(self, label: str, sealed: bool):
        self.label, self.sealed = label, sealed

    def create(self, nbytes: int) -> int:
        fd = os.memfd_create(f"leto-{self.label}", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, nbytes)
            os.posix_fallocate(fd, 0, nbytes)
            if self.sealed:
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_GROW)
            return fd
        except OSError as e:
            os.close(fd)
            raise P.PoolOutOfMemory(f"memfd page of {nbytes} bytes: {e.strerror}") from None

    def info(self) -> dict:
        return {"kind": "memfd"}


class CudaPages:
    """GPU pages through the CUDA driver's virtual-memory API, without a context."""

    kind = "cuda"

    def __init__(self, ordinal: int):
        from leto_runtime.wire.host_pages import cuda_driver

        try:
            cu = cuda_driver()
        except ImportError as e:
            raise P.DeviceUnavailable(f"cuda-python is not installed ({e}); "
                                      "pip install cuda-python matching the driver") from None
        self.cu, self.ordinal = cu, ordinal
        ok = cu.CUresult.CUDA_SUCCESS

        def call(r, what):
            if r[0] != ok:
                raise P.DeviceUnavailable(f"GPU {ordinal}: {what} failed: {r[0]!r}")
            return r[1] if len(r) == 2 else None

        try:
            call(cu.cuInit(0), "cuInit")
        except P.DeviceUnavailable:
            raise
        except Exception as e:    # no driver library at all (cuda-python raises, not returns)
            raise P.DeviceUnavailable(f"GPU {ordinal}: no CUDA driver ({type(e).__name__}: "
                                      f"{str(e)[:200]})") from None
        count = call(cu.cuDeviceGetCount(), "cuDeviceGetCount")
        if not 0 <= ordinal < count:
            raise P.DeviceUnavailable(f"GPU {ordinal} does not exist ({count} visible)")
        dev = call(cu.cuDeviceGet(ordinal), "cuDeviceGet")
        A = cu.CUdevice_attribute
        attr = lambda a: call(cu.cuDeviceGetAttribute(a, dev), f"cuDeviceGetAttribute({a.name})")
        if not attr(A.CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED):
            raise P.DeviceUnavailable(f"GPU {ordinal} does not support CUDA virtual memory "
                                      "management (cuMemCreate); it cannot serve a memory pool")
        if not attr(A.CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED):
            raise P.DeviceUnavailable(f"GPU {ordinal} cannot export memory as POSIX fds")
        mode = attr(A.CU_DEVICE_ATTRIBUTE_COMPUTE_MODE)
        if mode != int(cu.CUcomputemode.CU_COMPUTEMODE_DEFAULT):
            raise P.DeviceUnavailable(
                f"GPU {ordinal} is in compute mode {mode}, not DEFAULT: the state manager, the "
                "active and the shadow trainer share the GPU; run `nvidia-smi -c DEFAULT`")
        self.name = call(cu.cuDeviceGetName(64, dev), "cuDeviceGetName").split(b"\0")[0].decode()
        p = cu.CUmemAllocationProp()
        p.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
        p.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
        p.location.id = ordinal
        p.requestedHandleTypes = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        self.prop = p
        self.fd_type = p.requestedHandleTypes
        self.granularity = int(call(cu.cuMemGetAllocationGranularity(
            p, cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_RECOMMENDED),
            "cuMemGetAllocationGranularity"))

    def create(self, nbytes: int) -> int:
        cu = self.cu
        r = cu.cuMemCreate(nbytes, self.prop, 0)
        if r[0] != cu.CUresult.CUDA_SUCCESS:
            if r[0] == cu.CUresult.CUDA_ERROR_OUT_OF_MEMORY:
                raise P.PoolOutOfMemory(f"GPU {self.ordinal}: cuMemCreate({nbytes}) out of memory")
            raise P.DeviceUnavailable(f"GPU {self.ordinal}: cuMemCreate({nbytes}): {r[0]!r}")
        h = r[1]
        try:
            r = cu.cuMemExportToShareableHandle(h, self.fd_type, 0)
            if r[0] != cu.CUresult.CUDA_SUCCESS:
                raise P.DeviceUnavailable(f"GPU {self.ordinal}: export: {r[0]!r}")
            fd = int(r[1])
        finally:
            cu.cuMemRelease(h)          # the exported fd alone keeps the memory
        fcntl.fcntl(fd, fcntl.F_SETFD, fcntl.FD_CLOEXEC)
        return fd

    def info(self) -> dict:
        return {"kind": "cuda", "ordinal": self.ordinal, "name": self.name,
                "granularity": self.granularity}


def _cuda_device_count() -> int:
    """GPUs the driver sees (cuInit creates no context), 0 without a usable driver."""
    try:
        from cuda.bindings import driver as cu
        if cu.cuInit(0)[0] != cu.CUresult.CUDA_SUCCESS:
            return 0
        r = cu.cuDeviceGetCount()
        return int(r[1]) if r[0] == cu.CUresult.CUDA_SUCCESS else 0
    except Exception:
        return 0


def device_owner(spec: str, slot: int):
    """`cpu` -> memfd stand-in; `cuda:N` -> GPU N; `auto` -> GPU `slot` if CUDA works, else cpu."""
    if spec == "cpu":
        return MemfdPages("device", sealed=False)
    if spec.startswith("cuda:"):
        return CudaPages(int(spec.split(":", 1)[1]))
    if spec == "auto":
        try:
            return CudaPages(slot)
        except P.DeviceUnavailable:
            n = _cuda_device_count()
            if n and slot >= n:
                # More local ranks than GPUs (e.g. several gloo ranks on one GPU): the trainer
                # of slot s uses GPU s % n, so its pool must live there too.
                return CudaPages(slot % n)
            return MemfdPages("device", sealed=False)
    raise ValueError(f"device {spec!r}: use cpu, cuda:N or auto")
