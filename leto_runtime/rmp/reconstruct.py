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

Codec: `leto_runtime.parity.ParityCode` (GF(2^16), PARITY.md), one code per tier and group
shape; `backend` is passed through ('auto': CUDA kernels for GPU pages, C++ for host pages).
On GPUs the group's parity (host, pinned) is staged to the device, decoded there with the data
pages rebuilt in place, and the repaired parity rows are copied back to the host.

Calling contract: `recover(client)` = localize + remap + reconstruct; `reconstruct(client)`
requires that no page awaits remapping.  Both return a `ReconstructReport` or raise
`Unrecoverable` (an `RmpError` with code "unrecoverable", carrying the report).
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

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


# ---- the codec ---------------------------------------------------------------------------
class _Tiers:
    """The two codes of one group shape, through `leto_runtime.parity.ParityCode`."""

    def __init__(self, k: int, h1: int, h2: int, page_bytes: int, backend: str):
        from leto_runtime.parity import ParityCode

        self.t1 = ParityCode(k, h1, page_bytes, backend=backend)
        self.t2 = ParityCode(h1, h2, page_bytes, backend=backend) if h2 else None


def _staged(host, device):
    """Parity pages on the data's device: the host tensor itself on CPU, a (pinned) copy on GPU."""
    if host is None or device.type == "cpu":
        return host
    return host.to(device, non_blocking=True)


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
def reconstruct(client, names: list[str] | None = None, *, backend: str = "auto",
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
    for loss in losses:
        _repair_group(client.states[loss.state], loss, backend)
        report.repaired.append(loss)
    for n in names:
        _sync_state(client.states[n])
    if clear:
        for name in {g.state for g in losses}:
            client.clear_marks(name)
    report.seconds = time.perf_counter() - t0
    return report


def _repair_group(st, loss: GroupLoss, backend: str) -> None:
    H1, H2 = st.h1, st.h2
    g = st.groups[loss.index]
    codes = _Tiers(g.k, H1, H2, st.page_bytes, backend)
    data = st.group_pages(loss.index)                # (k, S) zero-copy view, device or host
    dev = data.device
    p1h, p2h = st.tier1(loss.index), st.tier2(loss.index)
    p1, p2 = _staged(p1h, dev), _staged(p2h, dev)
    lost_d = sorted(i - g.first for i in loss.data)
    lost1, lost2 = sorted(loss.p1), sorted(loss.p2)
    changed1: set[int] = set()
    changed2: set[int] = set()
    # 1. tier 2 -> tier 1 (decode writes straight into the staged parity rows)
    via_t2 = bool(lost1) and _tier2_can_repair(st, loss)
    if via_t2:
        pages = [None if i in lost1 else p1[i] for i in range(H1)] + \
                [None if i in lost2 else p2[i] for i in range(H2)]
        codes.t2.decode(pages, out={**{i: p1[i] for i in lost1}, **{H1 + i: p2[i] for i in lost2}})
        changed1.update(lost1)
        changed2.update(lost2)
    # 2. tier 1 -> data pages, in place (plus the tier-1 pages tier 2 could not rebuild)
    bad1 = [] if via_t2 else lost1
    if lost_d or bad1:
        rows = list(data.unbind(0))
        pages = [None if j in lost_d else rows[j] for j in range(g.k)] + \
                [None if i in bad1 else p1[i] for i in range(H1)]
        codes.t1.decode(pages, out={**{j: rows[j] for j in lost_d},
                                    **{g.k + i: p1[i] for i in bad1}})
        changed1.update(bad1)
    # 3. tier 1 -> tier 2 (lost tier-2 pages, or tier-1 pages rebuilt by tier 1)
    if H2 and ((lost2 and not via_t2) or bad1):
        codes.t2.encode(p1, out=p2)
        changed2.update(range(H2))
    if dev.type != "cpu":                            # the host parity is the authoritative copy
        for i in sorted(changed1):
            p1h[i].copy_(p1[i])
        for i in sorted(changed2):
            p2h[i].copy_(p2[i])


def protect(state, *, backend: str = "auto") -> None:
    """Encode every group's tier-1 parity from its data and tier 2 from tier 1 (full encode)."""
    for g in state.groups:
        codes = _Tiers(g.k, state.h1, state.h2, state.page_bytes, backend)
        data = state.group_pages(g.index)
        p1h, p2h = state.tier1(g.index), state.tier2(g.index)
        p1 = codes.t1.encode(data) if data.device.type != "cpu" else codes.t1.encode(data, out=p1h)
        if codes.t2 is not None:
            p2 = codes.t2.encode(p1) if data.device.type != "cpu" else codes.t2.encode(p1, out=p2h)
        if data.device.type != "cpu":
            p1h.copy_(p1)
            if codes.t2 is not None:
                p2h.copy_(p2)
    _sync_state(state)


def _sync_state(st) -> None:
    if st.device.startswith("cuda"):
        import torch
        torch.cuda.synchronize(st.device)


def recover(client, names: list[str] | None = None, **kw) -> tuple:
    """localize -> remap -> reconstruct; returns (LocalizeReport, ReconstructReport)."""
    loc = client.localize()
    if any(m.unmapped for m in loc.marks.values()):
        client.remap(names)
    return loc, reconstruct(client, names, **kw)
