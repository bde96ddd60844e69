"""What a live trainer does at every step boundary so that it never reads retained memory it
cannot trust: honour registered losses first, then scrub a slice (`scrub.Scrubber`).

Role: between two iterations (the previous update finished and settled, the next not begun)
every group's data agrees with its host parity.  That is where a page loss that struck while
the trainer lived -- registered by the state manager (an injected or a real fault: its loss
registry, `status()["pending_losses"]`) -- is repaired before any further read:

0. the state manager's loss bulletin (`leto_runtime.wire.bulletin`: a counter in shared memory)
   is read; only when it moved is the state manager asked (`status`) -- no round trip otherwise;
1. `localize` marks every lost page, `remap` puts fresh memory behind it (mapped in place: the
   same addresses, so views, prepared kernels and address arrays stay valid);
2. per protection group of a protected state, planned for every group before anything is
   written (`plan`, pure):
   - data intact, parity pages lost: the parity is recomputed from the data (tier 1 from the
     data, tier 2 from tier 1) -- never rebuilt from other parity, which may be what is wrong;
   - data pages lost: decoded from the surviving data and parity (`reconstruct`'s group
     repair), within the code's tolerance;
   - more than that: `Unrecoverable` (typed; nothing was written);
   - the gradients need nothing: every step overwrites them and re-encodes their parity;
3. the marks are cleared.

Calling contract: `Guard(ss, updater, report=..., scrub_budget=...)`; `at_boundary(t)` before
`Updater.begin(t)`.  Raises `leto_runtime.rmp.Unrecoverable` when the state cannot be trusted
(the trainer then ends with contract.UNRECOVERABLE_EXIT).  Without a memory pool (plain
torchrun: nothing is retained) it does nothing.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from leto_runtime.rmp.reconstruct import (GroupLoss, ReconstructReport, Unrecoverable,
                                          _feasible, _repair_group)
from leto_runtime.rmu.scrub import Scrubber


ASK_EVERY_S = 30.0          # the loss bulletin's safety net: one round trip per 30 s at most


@dataclass(frozen=True)
class Plan:
    encode: tuple = ()        # (state, group index): parity recomputed from the data
    decode: tuple = ()        # (state, GroupLoss): data (and parity) rebuilt from parity
    bad: tuple = ()           # GroupLoss beyond the tolerance
    ignored: int = 0          # lost pages that need no contents (gradients, RMU buffers)


def plan(protected, skip=()) -> Plan:
    """The repair of every marked group of `protected` states (RetainedState-like: `marks`,
    `groups`, `h1`, `h2`); states in `skip` only have their marks cleared.  Pure."""
    enc, dec, bad, ignored = [], [], [], 0
    for st in protected:
        if st in skip:
            ignored += st.marks.count()
            continue
        for g in st.groups:
            d = sorted(i for i in st.marks.data if g.first <= i < g.first + g.k)
            p1, p2 = st.marks.p1.get(g.index, []), st.marks.p2.get(g.index, [])
            if not (d or p1 or p2):
                continue
            if not d:
                enc.append((st, g.index))
                continue
            loss = GroupLoss(st.name, g.id, g.index, d, list(p1), list(p2), st.h1)
            (dec if _feasible(st, loss) else bad).append((st, loss))
    return Plan(tuple(enc), tuple(dec), tuple(loss for _, loss in bad), ignored)


@dataclass
class Repairs:
    count: int = 0
    pages: int = 0
    seconds: float = 0.0
    last: dict = field(default_factory=dict)
    checks: int = 0              # loss-registry checks (one state-manager round trip each)
    check_seconds: float = 0.0


class Guard:
    def __init__(self, ss, updater, *, report=None, scrub_budget: float = 0.0,
                 backend: str = "auto"):
        self.ss, self.up, self.backend = ss, updater, backend
        self.report = report or (lambda kind, **f: None)
        self.repairs = Repairs()
        self._seen = -1                   # loss bulletin value handled last (-1: never asked)
        self._asked = 0.0                 # perf_counter of the last status() question
        self.scrubber = Scrubber(ss, updater, scrub_budget, self.report) if ss.client else None

    def at_boundary(self, t: int) -> None:
        client = self.ss.client
        if client is None:
            return
        self.up.quiesce()
        t0 = time.perf_counter()
        seen = client.loss_count()
        # Also every ASK_EVERY_S: a state manager restarted without its bulletin would leave
        # the counter frozen (the repair would then wait for the next failure).
        if seen is None or seen != self._seen or t0 - self._asked > ASK_EVERY_S:
            self._asked = t0
            # the bulletin moved (or there is none): ask what is pending
            if client.status().get("pending_losses", 0):
                self._repair(t)
            self._seen = seen
        self.repairs.checks += 1
        self.repairs.check_seconds += time.perf_counter() - t0
        if self.scrubber is not None:
            self.scrubber.run(t)

    def _repair(self, t: int) -> None:
        t0 = time.perf_counter()
        ss, client = self.ss, self.ss.client
        if str(ss.device).startswith("cuda"):
            import torch
            torch.cuda.synchronize(ss.device)   # no queued work may touch a page remapped now
        loc = client.localize()
        if any(m.unmapped for m in loc.marks.values()):
            client.remap()
        protected = [st for st in ss.all if getattr(st, "protected", False)]
        p = plan(protected, skip=(ss.grads,))
        if p.bad:
            worst = max(p.bad, key=lambda g: g.erasures)
            raise Unrecoverable(
                f"pages lost at the boundary of step {t}: {len(p.bad)} protection group(s) lost "
                f"more than their parity tolerates (e.g. group {worst.index} of {worst.state!r}: "
                f"{len(worst.data)} data + {len(worst.p1)} tier-1 + {len(worst.p2)} tier-2 "
                f"pages, tolerance {worst.tolerance}); nothing was written",
                ReconstructReport(unrecoverable=list(p.bad)))
        for st, g in p.encode:
            self.up._encode_into_host(st, g)
        for st, loss in p.decode:
            _repair_group(st, loss, self.backend)
        self.up.fence()
        pages = sum(st.marks.count() for st in ss.all)
        for st in ss.all:
            if st.marks:
                client.clear_marks(st.name)
        rep = self.repairs
        rep.count += 1
        rep.pages += pages
        rep.seconds += time.perf_counter() - t0
        rep.last = dict(step=t, pages=pages, reencoded=[(st.name, g) for st, g in p.encode],
                        decoded=[(loss.state, loss.index, len(loss.data)) for _, loss in p.decode],
                        ignored=p.ignored, seconds=time.perf_counter() - t0)
        self.report("repair", **rep.last)
