"""Device memory as the driver sees it, for the agent's preinitialization controller, through
NVML (libnvidia-ml, loaded with ctypes): no CUDA context in the agent, microseconds a query.

`Nvml.open()` returns None where there is no NVIDIA driver (CPU machines): the controller then
has nothing to observe and keeps the policy's level.  `memory(index)` is one device's
(total, free) bytes; `process_bytes(index)` the device memory each process holds (pid -> bytes;
empty where the driver hides other processes, e.g. in a container's pid namespace).

Device indices: `device_of(local_rank, uuid)` is NVML's index of the device by the UUID the
slot's active reported (`leto_runtime.job`); before that report, `physical(local_rank)` maps
`local_rank % visible` over CUDA_VISIBLE_DEVICES (as `leto_runtime` picks it) to NVML's index
(integers -- taken as NVML's, right with CUDA_DEVICE_ORDER=PCI_BUS_ID or identical GPUs -- or
GPU UUIDs; anything else: the local rank itself).

Calling contract: one `Nvml` per agent, used from its loop thread; every call returns what the
driver answers now or raises `NvmlError` (the caller skips that sample).
"""
from __future__ import annotations

import ctypes

from leto_runtime.wire import settings


class NvmlError(RuntimeError):
    pass


class _Memory(ctypes.Structure):
    _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong),
                ("used", ctypes.c_ulonglong)]


class _ProcessInfoV2(ctypes.Structure):
    _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong),
                ("gpuInstanceId", ctypes.c_uint), ("computeInstanceId", ctypes.c_uint)]


_NOT_AVAILABLE = (1 << 64) - 1          # NVML_VALUE_NOT_AVAILABLE for usedGpuMemory
_INSUFFICIENT_SIZE = 7


class Nvml:
    def __init__(self, lib) -> None:
        self.lib = lib
        self._handles: dict[int, ctypes.c_void_p] = {}

    @classmethod
    def open(cls) -> "Nvml | None":
        try:
            lib = ctypes.CDLL("libnvidia-ml.so.1")
        except OSError:
            return None
        if lib.nvmlInit_v2() != 0:
            return None
        return cls(lib)

    def _check(self, rc: int, what: str) -> None:
        if rc != 0:
            self.lib.nvmlErrorString.restype = ctypes.c_char_p
            raise NvmlError(f"{what}: {self.lib.nvmlErrorString(rc).decode(errors='replace')}")

    def count(self) -> int:
        n = ctypes.c_uint()
        self._check(self.lib.nvmlDeviceGetCount_v2(ctypes.byref(n)), "nvmlDeviceGetCount")
        return n.value

    def _handle(self, index: int):
        h = self._handles.get(index)
        if h is None:
            h = ctypes.c_void_p()
            self._check(self.lib.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(h)),
                        f"device {index}")
            self._handles[index] = h
        return h

    def memory(self, index: int) -> tuple[int, int]:
        m = _Memory()
        self._check(self.lib.nvmlDeviceGetMemoryInfo(self._handle(index), ctypes.byref(m)),
                    f"memory of device {index}")
        return int(m.total), int(m.free)

    def process_bytes(self, index: int) -> dict[int, int]:
        n = ctypes.c_uint(64)
        for _ in range(3):
            buf = (_ProcessInfoV2 * n.value)()
            rc = self.lib.nvmlDeviceGetComputeRunningProcesses_v2(self._handle(index),
                                                                  ctypes.byref(n), buf)
            if rc == _INSUFFICIENT_SIZE:
                n = ctypes.c_uint(n.value * 2)
                continue
            self._check(rc, f"processes of device {index}")
            return {int(p.pid): int(p.usedGpuMemory) for p in buf[:n.value]
                    if p.usedGpuMemory != _NOT_AVAILABLE}
        return {}

    def physical(self, local_rank: int) -> int:
        vis = settings.visible_devices()
        if vis is None:
            return local_rank % max(1, self.count())
        items = [v.strip() for v in vis.split(",") if v.strip()]
        if not items:
            raise NvmlError("CUDA_VISIBLE_DEVICES is empty: no device to observe")
        item = items[local_rank % len(items)]
        if item.isdigit():
            return int(item)
        if item.startswith(("GPU-", "MIG-")):
            return self.index_of_uuid(item)
        return local_rank

    def index_of_uuid(self, uuid: str) -> int:
        h = ctypes.c_void_p()
        self._check(self.lib.nvmlDeviceGetHandleByUUID(uuid.encode(), ctypes.byref(h)),
                    f"device {uuid}")
        idx = ctypes.c_uint()
        self._check(self.lib.nvmlDeviceGetIndex(h, ctypes.byref(idx)), f"index of {uuid}")
        return int(idx.value)

    def device_of(self, local_rank: int, uuid: str | None) -> int:
        """NVML's index of a local rank's device: by the UUID its trainer reported when it
        did (a digit in CUDA_VISIBLE_DEVICES is a CUDA ordinal, which follows CUDA_DEVICE_ORDER
        -- fastest first by default -- where NVML counts in PCI order), else `physical`."""
        return self.index_of_uuid(uuid) if uuid else self.physical(local_rank)
