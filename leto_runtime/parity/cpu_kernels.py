"""The C++ CPU parity kernels (cuda/parity_cpu.cpp) through ctypes.

Role: builds the kernels as a plain shared library with the system C++ compiler, into the
kernel cache (`leto_runtime.wire.kernel_cache`: keyed by the sources' digest), and gives them the
face the backends call (`CpuKernels`: the same four calls the torch extension had).  A plain
library rather than a torch extension: the kernels use nothing of torch, and torch's headers
alone took three quarters of the build (docs/BENCHMARKS.md, "Test-suite and kernel-build
times"); ctypes releases the GIL around every foreign call, as the extension did.

Calling contract:
    k = build_and_load()                       # CpuKernels, or raises OSError / BuildError
    k.syndrome_mix(pages, outs, coef, page_bytes)       # outs[i] = sum_t coef[i][t] S_t(pages)
    k.delta_update(outs, a, b, coef, page_bytes)        # outs[i] ^= sum_l coef[i][l] (a[l]^b[l])
    k.isa(); k.set_isa("avx2")                 # the vector width in use; force a narrower one
`pages`, `outs`, `a`, `b` are contiguous 1-D int64 CPU tensors of page addresses (0: an all-zero
page), `coef` a contiguous int32 CPU tensor (outputs x 16 for syndrome_mix, outputs x pages for
delta_update).  Arguments out of contract raise ValueError before anything is touched.  The
kernels split their work over torch.get_num_threads() threads.
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

NAME = "leto_parity_cpu"
SRC = "parity_cpu.cpp"           # with gf16_bitslice.h and parity_cpu_kernels.inc beside it
FLAGS = ["-O3", "-Wno-psabi", "-shared", "-fPIC", "-std=c++17"]
LIBS = ["-pthread"]
_NT = 16                         # syndrome window t = -7..8 (gf16.KERNEL_T)


def build() -> Path:
    """Compile cuda/parity_cpu.cpp into the kernel cache, once per source version; returns the
    library's path.  Raises OSError (no compiler) or kernel_cache.BuildError."""
    from leto_runtime.wire import kernel_cache as K
    cxx = K.cxx()
    if not cxx:
        raise OSError(K.NO_COMPILER)
    spec = K.Spec(NAME, "the C++ parity kernels", (SRC,), (cxx,), (*FLAGS, "|", *LIBS),
                  expect="about 10 s, once per machine and source version")
    return K.obtain(spec, lambda slot: K.compile_library(slot, cxx, FLAGS, LIBS, f"lib{NAME}.so")).path


def _addrs(t: torch.Tensor, what: str) -> int:
    if not (isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dtype == torch.int64
            and t.dim() == 1 and t.is_contiguous()):
        raise ValueError(f"{what} must be a contiguous 1-D int64 CPU tensor of addresses")
    return t.data_ptr()


def _coef(t: torch.Tensor, n: int, shape: str) -> int:
    if not (isinstance(t, torch.Tensor) and t.device.type == "cpu" and t.dtype == torch.int32
            and t.is_contiguous() and t.numel() == n):
        raise ValueError(f"coef must be a contiguous int32 CPU tensor of shape {shape}")
    return t.data_ptr()


def _page_bytes(page_bytes: int) -> int:
    if not (isinstance(page_bytes, int) and page_bytes > 0 and page_bytes % 1024 == 0):
        raise ValueError(f"page_bytes must be a positive multiple of 1024, not {page_bytes!r}")
    return page_bytes


class CpuKernels:
    """The loaded library (see the module docstring).  `__file__` is the library's path."""

    def __init__(self, path: Path):
        self.__file__ = str(path)
        lib = ctypes.CDLL(str(path))
        vp, i64 = ctypes.c_void_p, ctypes.c_int64
        self._mix = lib.leto_parity_syndrome_mix
        self._mix.argtypes = [vp, i64, vp, i64, vp, i64, i64]
        self._delta = lib.leto_parity_delta_update
        self._delta.argtypes = [vp, i64, vp, vp, i64, vp, i64, i64]
        for f in (self._mix, self._delta):
            f.restype = ctypes.c_int
        self._isa, self._set_isa = lib.leto_parity_isa, lib.leto_parity_set_isa
        self._isa.restype = self._set_isa.restype = ctypes.c_char_p
        self._set_isa.argtypes = [ctypes.c_char_p]

    def isa(self) -> str:
        """The vector ISA in use: avx512, avx2 or base."""
        return self._isa().decode()

    def set_isa(self, name: str) -> str:
        """Force a vector ISA (tests, benchmarks; never wider than the CPU has; "auto": the
        widest); returns the one in use."""
        got = self._set_isa(str(name).encode())
        if got is None:
            raise ValueError(f"unknown ISA {name!r} (avx512, avx2, base, auto)")
        return got.decode()

    def syndrome_mix(self, pages: torch.Tensor, outs: torch.Tensor, coef: torch.Tensor,
                     page_bytes: int) -> None:
        m = outs.numel()
        args = (_addrs(pages, "pages"), pages.numel(), _addrs(outs, "outs"), m,
                _coef(coef, m * _NT, "(outputs, 16)"), _page_bytes(page_bytes))
        self._call(self._mix, *args)

    def delta_update(self, outs: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                     coef: torch.Tensor, page_bytes: int) -> None:
        self._call(self._delta, *self._delta_args(outs, a, b, coef, page_bytes))

    def prepared_delta(self, outs: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                       coef: torch.Tensor, page_bytes: int):
        """`delta_update` with these arguments, checked once, as a call with nothing left to
        check (the RMU marker's per-record parity patch).  The call keeps the tensors alive."""
        return _Prepared(self._delta, self._delta_args(outs, a, b, coef, page_bytes),
                         (outs, a, b, coef))

    @staticmethod
    def _delta_args(outs, a, b, coef, page_bytes) -> tuple:
        m, n = outs.numel(), a.numel()
        if b.numel() != n:
            raise ValueError("a and b must list the same number of pages")
        return (_addrs(outs, "outs"), m, _addrs(a, "a"), _addrs(b, "b"), n,
                _coef(coef, m * n, "(outputs, pages)"), _page_bytes(page_bytes))

    @staticmethod
    def _call(fn, *args) -> None:
        if fn(*args, torch.get_num_threads()) != 0:     # the C side's own argument check
            raise ValueError(f"{fn.__name__}: arguments out of contract")


class _Prepared:
    """One kernel call with checked arguments; holds the tensors its addresses point into."""
    __slots__ = ("fn", "args", "keep")

    def __init__(self, fn, args: tuple, keep: tuple):
        self.fn, self.args, self.keep = fn, args, keep

    def __call__(self) -> None:
        if self.fn(*self.args, torch.get_num_threads()) != 0:
            raise ValueError(f"{self.fn.__name__}: arguments out of contract")


def build_and_load() -> CpuKernels:
    return CpuKernels(build())
