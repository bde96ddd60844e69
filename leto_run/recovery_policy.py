"""The agent's bookkeeping behind the failure policy of `decisions.decide_inplace`.

The policy itself is pure (`decisions.classify_failure`, `decisions.inplace_budget`); this
module keeps what it needs across generations and restarts: the history of recovered failures
and the in-place budget (`recovery.max_inplace_recoveries` per `recovery.inplace_window`).

Calling contract (the agent's main thread only): `facts(slots, generation, failures)` turns the
agent's `FailureRecord`s of `generation` into `decisions.Failure`s -- step, error identity, hang
verdict, the fault Leto injected into the process, and whether the generation completed a step
on this node; `record(failure, generation, now, inplace)` adds a recovered failure (in place, or
by a group restart) to `history`.  The history outlives restarts on purpose: a restarted group
that fails the same way again is the same deterministic failure.
"""
from __future__ import annotations

from leto_run.decisions import Budget, Failure, PastFailure


class FailurePolicy:
    def __init__(self, max_recoveries: int, window: float):
        self.budget = Budget(max_recoveries, window)
        self._history: list[PastFailure] = []

    @property
    def history(self) -> tuple[PastFailure, ...]:
        return tuple(self._history)

    @property
    def inplace_enabled(self) -> bool:
        return self.budget.max_recoveries > 0

    def facts(self, slots, generation: int, failures) -> list[Failure]:
        """`decisions.Failure` of every failure of `generation`, in observation order."""
        mine = [f for f in failures if f.generation == generation]
        if not mine:
            return []
        procs = {sp.proc.pid: sp for s in slots for sp in s.all()}
        progressed = any(s.active is not None and s.active.generation == generation
                         and s.active.completed_step for s in slots)
        out = []
        for f in mine:
            sp = procs.get(f.pid)
            out.append(Failure(rank=f.rank, exitcode=f.exitcode, how=f.how, step=f.step,
                               error=f.error, hang=f.hang, script_error=f.script_error,
                               injected=sp.injected if sp is not None else None,
                               progressed=progressed))
        return out

    def record(self, failure: Failure | None, generation: int, now: float,
               inplace: bool) -> None:
        """`failure` (None: a HOF another node declared) was recovered at `now`.  Entries older
        than the budget's window are dropped unless they are the last one (the repeat rule
        compares with the last recovered failure, however old)."""
        self._history.append(PastFailure.of(failure, generation, now, inplace))
        window = self.budget.window
        self._history = [h for i, h in enumerate(self._history)
                         if now - h.mono < window or i == len(self._history) - 1]
