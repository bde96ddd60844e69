"""Zero-copy torch tensors over mapped pool memory, and the registry that knows when they die.

Role: turn (address, bytes, device) into a torch tensor that shares the memory, and record a
liveness token per tensor so that unmapping can wait until no view is left (torch never frees
this memory, so a view that outlived its mapping would read freed or remapped pages;
docs/MEMORY.md, "How a trainer maps them").

How liveness is tracked: each tensor is built from a small *holder* object that torch keeps
alive for exactly as long as the tensor's storage exists (every view, slice or reshape of it
shares that storage):
* CPU: a NumPy array over the address (`torch.from_numpy` holds the array until the storage
  is freed);
* CUDA: an object exposing `__cuda_array_interface__` (`torch.as_tensor` increfs it and its
  deleter decrefs it) -- the public zero-copy path, no private torch API.
The registry keeps weak references to the holders; when all are gone, no view is alive.

Calling contract: `make_tensor` never copies; the dtype must divide the byte count; `shape`
defaults to 1-D.  `ViewRegistry.wait_dead(timeout)` returns when no view is alive or raises
`ViewsAlive` naming how many remain.
"""
from __future__ import annotations

import ctypes
import gc
import threading
import time
import weakref
from typing import Sequence

from leto_runtime.wire.protocol import ViewsAlive

_DTYPES = ("uint8", "int8", "int16", "int32", "int64", "float16", "bfloat16", "float32",
           "float64", "bool")


def torch_dtype(name):
    import torch

    if isinstance(name, torch.dtype):
        return name
    if name not in _DTYPES:
        raise ValueError(f"dtype {name!r} is not one of {', '.join(_DTYPES)}")
    return getattr(torch, name)


class ViewRegistry:
    """Weak references to the holders of every tensor handed out for one mapping."""

    def __init__(self, label: str):
        self.label = label
        self._lock = threading.Lock()
        # keyed by a counter: a weakref hashes its referent, and NumPy arrays are unhashable
        self._refs: dict[int, weakref.ref] = {}
        self._n = 0

    def track(self, holder) -> None:
        with self._lock:
            self._n += 1
            key = self._n
            self._refs[key] = weakref.ref(holder, lambda _r, k=key: self._gone(k))

    def _gone(self, key: int) -> None:
        with self._lock:
            self._refs.pop(key, None)

    def alive(self) -> int:
        with self._lock:
            return sum(1 for r in self._refs.values() if r() is not None)

    def wait_dead(self, timeout: float) -> None:
        """Block until no view is alive (collecting reference cycles once), or raise."""
        if self.alive() == 0:
            return
        gc.collect()
        deadline = time.monotonic() + timeout
        while self.alive():
            if time.monotonic() >= deadline:
                raise ViewsAlive(f"{self.alive()} tensor view(s) of {self.label} are still alive; "
                                 "drop them (and synchronize streams) before unmapping",
                                 {"alive": self.alive()})
            time.sleep(0.005)


class _CudaHolder:
    """Exposes device memory through __cuda_array_interface__ v3 (uint8, 1-D)."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1",
                                         "data": (ptr, False), "version": 3, "strides": None}


def _shape(flat, dtype, shape: Sequence[int] | None):
    t = flat if dtype is None else flat.view(torch_dtype(dtype))
    return t if shape is None else t.view(tuple(int(s) for s in shape))


def make_tensor(ptr: int, nbytes: int, device: str, registry: ViewRegistry, *,
                dtype=None, shape: Sequence[int] | None = None):
    """A tensor over [ptr, ptr + nbytes) on `device` ("cpu" or "cuda:N"); no copy."""
    import numpy as np
    import torch

    if nbytes <= 0:
        raise ValueError(f"cannot view {nbytes} bytes")
    if device == "cpu":
        holder = np.ctypeslib.as_array((ctypes.c_uint8 * nbytes).from_address(ptr))
        registry.track(holder)
        flat = torch.from_numpy(holder)
    else:
        holder = _CudaHolder(ptr, nbytes)
        registry.track(holder)
        flat = torch.as_tensor(holder, device=device)
        if flat.data_ptr() != ptr:        # a copy would silently detach us from the pool
            raise RuntimeError("torch copied a __cuda_array_interface__ buffer; zero-copy failed")
    return _shape(flat, dtype, shape)
