"""Page reconstruction for the trainer: tier 2 repairs tier 1, tier 1 repairs data, in place.

Role (paper §4.2, DESIGN.md §5): after `RmpClient.localize()` marked the failed pages and
`RmpClient.remap()` put fresh memory behind them, rebuild the contents of every protected
state's failed pages from the surviving data and parity (PARITY.md), then tell the state
manager the marks are cleared.  Per protection group (k data pages, H1 tier-1, H2 tier-2):

1. lost tier-1 pages are rebuilt from the tier-2 code (k=H1, m=H2) when at most H2 of the
   group's H1+H2 parity pages are lost; otherwise they become erasures of step 2;
2. lost data pages (and tier-1 pages step 1 could not rebuild) are decoded from the tier-1
   code (k, m=H1): at most H1 erasures per group;
3. lost tier-2 pages are re-encoded from the (now complete) tier-1 pages.

Every group is checked *before anything is written*: if any group lost more than it tolerates,
`Unrecoverable` is raised (typed: the recovery protocol falls back to a checkpoint) and no page
of any state is touched -- no silent overwrite.  Unprotected state has nothing to rebuild: its
remapped pages are reported as "contents undefined".

The parity must be consistent with the data (the trainer -- RMU -- keeps it so); `protect()`
encodes every group from scratch (first initialization, tests).

Codec: `leto_runtime.parity` (GF(2^16), PARITY.md).  `_Codec` is the one place that calls it, so
a change of the codec's API is a change here only.

Calling contract: `recover(client)` = localize + remap + reconstruct; `reconstruct(client)`
requires that no page awaits remapping.  Both return a `ReconstructReport` or raise
`Unrecoverable` (an `RmpError` with code "unrecoverable", carrying the report).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np

from leto_runtime.rmp import protocol as P


class Unrecoverable(P.RmpError):
    """More pages lost in some group than its parity tolerates; nothing was written."""

    code = P.ErrorCode.UNRECOVERABLE

    def __init__(self, message: str, report: "ReconstructReport"):
        self.report = report
        super().__init__(message, {"groups": [g.__dict__ for g in report.unrecoverable]})


class NotRemapped(P.RmpError):
    """Some failed pages still have no memory behind them: call `RmpClient.remap()` first."""

    code = P.ErrorCode.BAD_ARGUMENT


@dataclass
class GroupLoss:
    state: str
    group: int                 # pool-wide group id
    index: int                 # position in the state
    data: list[int]            # lost data pages (indices in the state)
    p1: list[int]
    p2: list[int]
    tolerance: int             # H1

    @property
    def erasures(self) -> int:
        return len(self.data)


@dataclass
class ReconstructReport:
    repaired: list[GroupLoss] = field(default_factory=list)
    unrecoverable: list[GroupLoss] = field(default_factory=list)
    undefined: list[dict] = field(default_factory=list)   # unprotected pages remapped empty
    seconds: float = 0.0
    backend: str = ""

    @property
    def pages(self) -> int:
        return sum(len(g.data) + len(g.p1) + len(g.p2) for g in self.repaired)


# ---- the codec adapter -------------------------------------------------------------------
class _Codec:
    """encode / decode on (n, S) uint8 pages, through leto_runtime.parity."""

    def __init__(self, backend: str = "reference"):
        from leto_runtime.parity import gf16, reference

        self.gf16, self.ref, self.backend = gf16, reference, backend

    def encode(self, data: list, m: int, page_bytes: int) -> np.ndarray:
        k = len(data)
        return self.ref.syndrome_mix([self._np(d) for d in data], self.gf16.encode_matrix(k, m),
                                     self.gf16.exponents(m), page_bytes)

    def decode(self, pages: list, m: int, lost: tuple[int, ...], page_bytes: int) -> np.ndarray:
        """Pages at positions `lost` (ascending) of a k+m codeword; `pages` has None there."""
        k = len(pages) - m
        if len(lost) > m:
            from leto_runtime.parity.errors import TooManyErasures
            raise TooManyErasures(lost, m)
        coef = self.gf16.decode_matrix(k, m, tuple(lost))
        return self.ref.syndrome_mix([None if p is None else self._np(p) for p in pages], coef,
                                     self.gf16.exponents(m)[:len(lost)], page_bytes)

    @staticmethod
    def _np(t) -> np.ndarray:
        if isinstance(t, np.ndarray):
            return t
        if t.device.type != "cpu":
            t = t.cpu()                      # device pages: host round trip (correct, not fast)
        return t.numpy()


def _write(dst, src: np.ndarray) -> None:
    """Copy a host page into a tensor page (host or device)."""
    import torch

    dst.copy_(torch.from_numpy(np.ascontiguousarray(src)))


# ---- planning ----------------------------------------------------------------------------
def _losses(client, names) -> tuple[list[GroupLoss], list[str]]:
    losses, waiting = [], []
    for name in names:
        st = client.states[name]
        if st.marks.unmapped:
            waiting.append(name)
        if not st.protected:
            continue
        for g in st.groups:
            d = [i for i in st.marks.data if g.first <= i < g.first + g.k]
            p1, p2 = st.marks.p1.get(g.index, []), st.marks.p2.get(g.index, [])
            if d or p1 or p2:
                losses.append(GroupLoss(name, g.id, g.index, d, list(p1), list(p2), st.h1))
    return losses, waiting


def _tier2_can_repair(st, loss: GroupLoss) -> bool:
    return st.h2 > 0 and len(loss.p1) + len(loss.p2) <= st.h2


def _feasible(st, loss: GroupLoss) -> bool:
    unrepaired_p1 = 0 if _tier2_can_repair(st, loss) else len(loss.p1)
    return len(loss.data) + unrepaired_p1 <= st.h1


# ---- the API -----------------------------------------------------------------------------
def reconstruct(client, names: list[str] | None = None, *, backend: str = "reference",
                clear: bool = True) -> ReconstructReport:
    """Rebuild every marked page of the attached protected states (see module docstring)."""
    t0 = time.perf_counter()
    names = list(client.states) if names is None else names
    losses, waiting = _losses(client, names)
    if waiting:
        raise NotRemapped(f"states {waiting} have pages awaiting remap; call remap() first")
    report = ReconstructReport(backend=backend,
                               undefined=[e for e in getattr(client, "last_remap", [])
                                          if e.get("contents") == "undefined"])
    for loss in losses:
        if not _feasible(client.states[loss.state], loss):
            report.unrecoverable.append(loss)
    if report.unrecoverable:
        report.seconds = time.perf_counter() - t0
        worst = max(report.unrecoverable, key=lambda g: g.erasures)
        raise Unrecoverable(f"{len(report.unrecoverable)} protection group(s) lost more pages "
                            f"than their parity tolerates (e.g. group {worst.group} of "
                            f"{worst.state!r}: {len(worst.data)} data + {len(worst.p1)} tier-1 "
                            f"+ {len(worst.p2)} tier-2 lost, tolerance {worst.tolerance}); "
                            "nothing was written: recover from a checkpoint", report)
    codec = _Codec(backend)
    for loss in losses:
        _repair_group(client.states[loss.state], loss, codec)
        report.repaired.append(loss)
    _sync(client, names)
    if clear:
        for name in {g.state for g in losses}:
            client.clear_marks(name)
    report.seconds = time.perf_counter() - t0
    return report


def _sync(client, names) -> None:
    for n in names:
        if client.states[n].device.startswith("cuda"):
            import torch
            torch.cuda.synchronize(client.states[n].device)
            return


def _repair_group(st, loss: GroupLoss, codec: _Codec) -> None:
    S, H1, H2 = st.page_bytes, st.h1, st.h2
    g = st.groups[loss.index]
    data = st.group_pages(loss.index)                # (k, S) views
    p1 = st.tier1(loss.index)
    p2 = st.tier2(loss.index)
    rebuilt_p1 = False
    # 1. tier 2 -> tier 1
    if loss.p1 and _tier2_can_repair(st, loss):
        lost = tuple(sorted(loss.p1) + [H1 + i for i in sorted(loss.p2)])
        pages = [None if i in loss.p1 else p1[i] for i in range(H1)] + \
                [None if i in loss.p2 else p2[i] for i in range(H2)]
        out = codec.decode(pages, H2, lost, S)
        for r, pos in enumerate(lost):
            if pos < H1:
                _write(p1[pos], out[r])
        rebuilt_p1 = True
    # 2. tier 1 -> data (plus tier-1 pages that tier 2 could not rebuild)
    bad_p1 = [] if rebuilt_p1 or not loss.p1 else sorted(loss.p1)
    lost_d = sorted(i - g.first for i in loss.data)
    if lost_d or bad_p1:
        lost = tuple(lost_d + [g.k + i for i in bad_p1])
        pages = [None if j in lost_d else data[j] for j in range(g.k)] + \
                [None if i in bad_p1 else p1[i] for i in range(H1)]
        out = codec.decode(pages, H1, lost, S)
        for r, pos in enumerate(lost):
            _write(data[pos] if pos < g.k else p1[pos - g.k], out[r])
    # 3. tier 1 -> tier 2 (re-encode: also covers tier-2 pages lost with nothing else)
    if H2 and (loss.p2 or bad_p1):
        out = codec.encode([p1[i] for i in range(H1)], H2, S)
        for i in range(H2):
            _write(p2[i], out[i])


def protect(state, *, backend: str = "reference") -> None:
    """Encode every group's tier-1 parity from its data and tier 2 from tier 1 (full encode)."""
    codec = _Codec(backend)
    for g in state.groups:
        data = state.group_pages(g.index)
        p1 = state.tier1(g.index)
        out = codec.encode([data[j] for j in range(g.k)], state.h1, state.page_bytes)
        for i in range(state.h1):
            _write(p1[i], out[i])
        if state.h2:
            p2 = state.tier2(g.index)
            out2 = codec.encode([p1[i] for i in range(state.h1)], state.h2, state.page_bytes)
            for i in range(state.h2):
                _write(p2[i], out2[i])


def recover(client, names: list[str] | None = None, **kw) -> tuple:
    """localize -> remap -> reconstruct; returns (LocalizeReport, ReconstructReport)."""
    loc = client.localize()
    if any(m.unmapped for m in loc.marks.values()):
        client.remap(names)
    return loc, reconstruct(client, names, **kw)
