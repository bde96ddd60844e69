"""Parity codec of the Resilient Memory Pool: GF(2^16) Reed-Solomon over pages (docs/PARITY.md).

Public API (see code.py for the calling contract):

    ParityCode(k, m, page_bytes, backend=...)   encode / update / update_delta / decode / scrub
    ProtectionGroup(D, H1, H2, page_bytes)      two tiers: tier-2 parity over the tier-1 pages
    ScrubReport, Recovery                       results
    TooManyErasures, ParityBackendUnavailable   typed errors (errors.py)

Backends: 'reference' (NumPy, always available), 'cpu' (C++ kernels, built on first use),
'cuda' (CUDA kernels, where torch has CUDA and nvcc exists), 'auto' (by device, warns when it
falls back).  All produce identical bytes.
"""
from .backends import BACKENDS
from .code import DEFAULT_PAGE_BYTES, ParityCode, ProtectionGroup, Recovery, ScrubReport
from .errors import PageShapeError, ParityBackendUnavailable, ParityError, TooManyErasures

__all__ = [
    "BACKENDS", "DEFAULT_PAGE_BYTES", "ParityCode", "ProtectionGroup", "Recovery", "ScrubReport",
    "PageShapeError", "ParityBackendUnavailable", "ParityError", "TooManyErasures",
]
