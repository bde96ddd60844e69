"""Typed errors of the parity codec.

`leto_runtime` never imports `leto_run`, so these do not derive from `leto_run.errors.LetoError`;
the launcher maps them (e.g. `TooManyErasures` -> an unrecoverable retained state) where it
catches them.
"""
from __future__ import annotations


class ParityError(Exception):
    """Base of every error the parity codec raises on purpose."""


class TooManyErasures(ParityError):
    """More pages are lost than the code can rebuild; nothing was written.

    `lost` are the lost positions, `tolerance` how many the code (or both tiers) could rebuild.
    """

    def __init__(self, lost, tolerance: int, detail: str = ""):
        self.lost = tuple(lost)
        self.tolerance = tolerance
        msg = f"{len(self.lost)} lost pages {list(self.lost)[:20]} exceed what the code rebuilds ({tolerance})"
        super().__init__(msg + (f": {detail}" if detail else ""))


class ParityBackendUnavailable(ParityError):
    """The requested backend cannot run here (no compiler, no CUDA, wrong device); `fix` says what to do."""

    def __init__(self, backend: str, reason: str, fix: str = ""):
        self.backend, self.reason, self.fix = backend, reason, fix
        super().__init__(f"parity backend '{backend}' unavailable: {reason}" + (f" -- fix: {fix}" if fix else ""))


class PageShapeError(ParityError, ValueError):
    """Pages have the wrong count, size, dtype, device or layout for the code."""
