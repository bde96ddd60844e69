"""Backend selection and the two primitives every backend implements.

Role: map the codec's two primitives onto the NumPy reference, the C++ CPU kernels or the CUDA
kernels, and pick one explicitly (`reference`, `cpu`, `cuda`) or by device (`auto`, which warns
when it has to fall back to the reference); `none` computes nothing (unprotected plain runs).

    syndrome_mix(pages, outs, coef, ts, page_bytes)
        outs[i] = sum_c coef[i][c] * sum_j x^(j ts[c]) pages[j]   (pages[j] None = all-zero page)
    delta_update(outs, olds, news, coef, page_bytes)
        outs[i] ^= sum_l coef[i][l] * (olds[l] ^ news[l])        (news[l] None: olds[l] is the delta)

Delta updates of a contiguous run of pages may instead go through syndrome_mix (delta.py picks;
`max_outputs` says how many outputs one syndrome_mix call takes).

Calling contract: pages are validated 1-D uint8 tensors of `page_bytes` bytes on one device (the
code object does that); outputs are written in place; work is queued on the current CUDA
stream for CUDA pages (nothing synchronizes).  The kernels cover exponents t = -7..8, i.e. codes
with m <= 16; wider codes need the reference backend.
"""
from __future__ import annotations

import logging
import warnings
from typing import Optional, Sequence

import numpy as np
import torch

from . import _ext, gf16, reference
from .errors import ParityBackendUnavailable

from leto_runtime.wire import settings

log = logging.getLogger("leto.parity")

BACKENDS = ("auto", "reference", "cpu", "cuda", "none")
Page = Optional[torch.Tensor]


class NullBackend:
    """No parity at all, for states nothing can ever read back: a plain run (torchrun, no state
    manager) retains nothing, so it protects nothing -- and builds and loads no kernel
    (leto_runtime/job.py picks it).  Outputs are left as they are: never use it where parity is
    read (decode, scrub, recovery)."""

    name = "none"
    max_outputs = None

    def syndrome_mix(self, pages, outs, coef, ts, page_bytes) -> None:
        return None

    def delta_update(self, outs, olds, news, coef, page_bytes) -> None:
        return None

    def prepared_delta(self, outs, olds, news, coef, page_bytes):
        return lambda: None


class ReferenceBackend:
    """NumPy on the host; CUDA pages are copied to the host and the results back."""

    name = "reference"
    max_outputs = None          # syndrome_mix outputs per call: unbounded

    @staticmethod
    def _np(t: Page) -> Optional[np.ndarray]:
        return None if t is None else t.detach().cpu().reshape(-1).view(torch.uint8).numpy()

    @staticmethod
    def _copy_back(dst: torch.Tensor, src: np.ndarray) -> None:
        dst.reshape(-1).view(torch.uint8).copy_(torch.from_numpy(src))

    def syndrome_mix(self, pages: Sequence[Page], outs: Sequence[torch.Tensor], coef: np.ndarray,
                     ts: Sequence[int], page_bytes: int) -> None:
        used = [c for c in range(len(ts)) if coef[:, c].any()]
        res = reference.syndrome_mix([self._np(p) for p in pages], coef[:, used],
                                     [ts[c] for c in used], page_bytes)
        for o, r in zip(outs, res):
            self._copy_back(o, r)

    def delta_update(self, outs: Sequence[torch.Tensor], olds: Sequence[torch.Tensor],
                     news: Sequence[Page], coef: np.ndarray, page_bytes: int) -> None:
        par = [self._np(o).copy() for o in outs]
        reference.delta_update(par, coef, [self._np(o) for o in olds], [self._np(n) for n in news])
        for o, r in zip(outs, par):
            self._copy_back(o, r)


class _KernelBackend:
    """Shared plumbing of the C++ and CUDA backends: address arrays and the t = -7..8 window."""

    name = "?"

    def __init__(self, ext) -> None:
        self.ext = ext
        self._ptr_cache: dict[tuple, tuple] = {}        # key -> (address array, its stream)

    def _ptrs(self, pages: Sequence[Page], device: torch.device) -> torch.Tensor:
        key = (device, tuple(0 if p is None else p.data_ptr() for p in pages))
        hit = self._ptr_cache.get(key)
        if hit is None:
            # Small LRU: re-encoding the same group (the common case) reuses its address array.
            if len(self._ptr_cache) >= 64:
                self._ptr_cache.pop(next(iter(self._ptr_cache)))
            hit = torch.tensor(key[1], dtype=torch.int64)
            stream = None
            if device.type == "cuda":
                hit = hit.to(device, non_blocking=True)
                stream = torch.cuda.current_stream(device)
            self._ptr_cache[key] = hit, stream
            return hit
        hit, stream = hit
        if stream is not None and torch.cuda.current_stream(device) != stream:
            # used on another stream (RMU's side stream): its memory is not reused by the
            # allocating stream before this use is done, evicted or not
            hit.record_stream(torch.cuda.current_stream(device))
        return hit

    @staticmethod
    def _window(coef: np.ndarray, ts: Sequence[int]) -> torch.Tensor:
        if min(ts) < gf16.T_LO_MIN or max(ts) > gf16.T_HI_MAX:
            raise ParityBackendUnavailable(
                "cpu/cuda", f"the kernels cover codes with m <= 16 (exponents -7..8), not {list(ts)}",
                "use backend='reference' for wider codes")
        return torch.from_numpy(gf16.kernel_mix(coef, tuple(ts)).astype(np.int32))


class CpuBackend(_KernelBackend):
    name = "cpu"
    max_outputs = None

    def syndrome_mix(self, pages, outs, coef, ts, page_bytes) -> None:
        cpu = torch.device("cpu")
        self.ext.syndrome_mix(self._ptrs(pages, cpu), self._ptrs(outs, cpu), self._window(coef, ts), page_bytes)

    def delta_update(self, outs, olds, news, coef, page_bytes) -> None:
        cpu = torch.device("cpu")
        c = torch.from_numpy(np.ascontiguousarray(coef, dtype=np.int32))
        self.ext.delta_update(self._ptrs(outs, cpu), self._ptrs(olds, cpu), self._ptrs(news, cpu), c, page_bytes)

    def prepared_delta(self, outs, olds, news, coef, page_bytes):
        """delta_update with these fixed pages and coefficients, as a call with nothing left to
        look up (the RMU marker patches the same block's parity twice per record)."""
        cpu = torch.device("cpu")
        assert all(t.device == cpu for t in (*outs, *olds, *news))
        args = (torch.tensor([p.data_ptr() for p in outs], dtype=torch.int64),
                torch.tensor([p.data_ptr() for p in olds], dtype=torch.int64),
                torch.tensor([p.data_ptr() for p in news], dtype=torch.int64),
                torch.from_numpy(np.ascontiguousarray(coef, dtype=np.int32)).clone(), page_bytes)
        return self.ext.prepared_delta(*args)


class CudaBackend(_KernelBackend):
    name = "cuda"
    max_outputs = 16            # the CUDA syndrome_mix launcher takes 1..16 outputs

    def __init__(self, ext) -> None:
        super().__init__(ext)
        # LETO_PARITY_CUDA_VARIANT: auto | simple | nb2 | nobake | rolled (benchmarks, cross-checks).
        self.variant = settings.get().parity_cuda_variant

    def syndrome_mix(self, pages, outs, coef, ts, page_bytes) -> None:
        self.syndrome_mix_batch([pages], [outs], coef, ts, page_bytes)

    def syndrome_mix_batch(self, pages: Sequence[Sequence[Page]], outs: Sequence[Sequence[torch.Tensor]],
                           coef: np.ndarray, ts: Sequence[int], page_bytes: int, *,
                           bases: Optional[Sequence[Sequence[torch.Tensor]]] = None,
                           scale: Optional[np.ndarray] = None) -> None:
        """One launch for len(pages) independent problems with the same coefficients:
        outs[y][i] = [bases[y][i] ^] sum_t coef[i][t] [scale[t]] S_t(pages[y])."""
        dev = outs[0][0].device
        flat = lambda ls: [p for pl in ls for p in pl]  # noqa: E731
        sc = None if scale is None else self.scale_window(ts, scale)
        self.ext.syndrome_mix(self._ptrs(flat(pages), dev), self._ptrs(flat(outs), dev), self._window(coef, ts),
                              page_bytes, self.ext.VARIANTS[self.variant],
                              None if bases is None else self._ptrs(flat(bases), dev), len(pages), sc)

    @staticmethod
    def scale_window(ts: Sequence[int], scale: np.ndarray) -> torch.Tensor:
        """The per-syndrome scale of exponents ts, placed in the kernels' t = -7..8 window."""
        w = np.zeros(len(gf16.KERNEL_T), dtype=np.int32)
        for t, c in zip(ts, scale):
            w[t - gf16.T_LO_MIN] = int(c)
        return torch.from_numpy(w)

    def delta_update(self, outs, olds, news, coef, page_bytes) -> None:
        dev = outs[0].device
        c = torch.from_numpy(np.ascontiguousarray(coef, dtype=np.int32)).to(dev, non_blocking=True)
        self.ext.delta_update(self._ptrs(outs, dev), self._ptrs(olds, dev), self._ptrs(news, dev), c, page_bytes)


_REFERENCE = ReferenceBackend()
_NULL = NullBackend()
_warned: set[str] = set()


def _warn_once(msg: str) -> None:
    if msg not in _warned:
        _warned.add(msg)
        log.warning(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=4)


def cpu_backend() -> CpuBackend:
    ext = _ext.load_cpu()
    global _CPU
    if _CPU is None or _CPU.ext is not ext:
        _CPU = CpuBackend(ext)
    return _CPU


def cuda_backend() -> CudaBackend:
    ext = _ext.load_cuda()
    global _CUDA
    if _CUDA is None or _CUDA.ext is not ext:
        _CUDA = CudaBackend(ext)
    return _CUDA


_CPU: Optional[CpuBackend] = None
_CUDA: Optional[CudaBackend] = None


def select(backend: str, device: torch.device, m: int):
    """The backend object for pages on `device`.  Explicit names raise ParityBackendUnavailable;
    'auto' falls back to the reference with a warning (once per reason)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if backend == "reference":
        return _REFERENCE
    if backend == "none":
        return _NULL
    if backend == "cpu" and device.type != "cpu":
        raise ParityBackendUnavailable("cpu", f"pages are on {device}", "use backend='cuda' or 'auto'")
    if backend == "cuda" and device.type != "cuda":
        raise ParityBackendUnavailable("cuda", f"pages are on {device}", "use backend='cpu' or 'auto'")
    want = backend if backend != "auto" else ("cuda" if device.type == "cuda" else "cpu")
    if m > 16:
        err = ParityBackendUnavailable(want, f"the kernels support m <= 16 (this code has m={m})",
                                       "use backend='reference'")
        if backend != "auto":
            raise err
        _warn_once(f"leto.parity: falling back to the NumPy reference: {err}")
        return _REFERENCE
    try:
        return cuda_backend() if want == "cuda" else cpu_backend()
    except ParityBackendUnavailable as e:
        if backend != "auto":
            raise
        _warn_once(f"leto.parity: backend 'auto' falls back to the NumPy reference (slow): {e}")
        return _REFERENCE
