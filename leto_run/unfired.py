"""Injections that never fired, and why: an injection is never silently ignored.

Some injections can only be known to be impossible at run time: a step-triggered one in a
script that never reports a step (it does not call `leto_runtime.heartbeat(step)` or
`job.steps()`), one whose step, generation or restart attempt the job never reached, one at an
`rmu.*` point naming a protection group or chunk the model does not have (the runtime sees
that one itself and reports it with the datagram `unfired`).

`InjectLedger` (the agent's main thread only) records what the agent sees: a trainer of
(rank, attempt, generation of the attempt) running as the active (`ran`), the steps it reports
(`stepped`), every firing (`fired`, spec text as in the `inject` event) and every spec the
runtime reported as impossible (`reported`).  At the end of the job `unfired(specs, ranks)`
returns each of this node's specs that did neither, with `unfired_reason`; the agent turns
each into an `inject_unfired` warning event and one warning line.
"""
from __future__ import annotations

from collections import Counter


def unfired_reason(spec, ran: dict, last_attempt: int) -> str:
    """Why `spec` (a `leto_run.inject.InjectSpec` that did not fire) never fired, from what ran:
    `ran[(rank, attempt, generation)]` = the highest step that active reported (None: none)."""
    r, a, g = spec.rank, spec.attempt, spec.gen
    if a > last_attempt:
        return f"restart attempt {a} never started (the job ended in attempt {last_attempt})"
    key = (r, a, g)
    if key not in ran:
        return f"generation {g} of attempt {a} never ran on rank {r}"
    if spec.step is None:
        return (f"generation {g} of attempt {a} ended before after={spec.after_s:g}s on "
                f"rank {r}")
    top = ran[key]
    if top is None:
        return (f"rank {r} never reported a training step in generation {g} of attempt {a}: "
                "the script does not call leto_runtime.heartbeat(step) (or use job.steps()), "
                "so a step-triggered injection cannot fire")
    if top < spec.step:
        return f"rank {r} reported step {top} at most, never step {spec.step}"
    return f"rank {r} reached step {spec.step} but never the point at={spec.at}"


class InjectLedger:
    def __init__(self) -> None:
        self._ran: dict[tuple[int, int, int], int | None] = {}
        self._fired: Counter = Counter()
        self._reported: Counter = Counter()
        self.last_attempt = 0

    def ran(self, rank: int, attempt: int, generation: int) -> None:
        """An active of `rank` runs in (attempt, generation of that attempt)."""
        self._ran.setdefault((rank, attempt, generation), None)
        self.last_attempt = max(self.last_attempt, attempt)

    def stepped(self, rank: int, attempt: int, generation: int, step: int) -> None:
        key = (rank, attempt, generation)
        top = self._ran.get(key)
        self._ran[key] = step if top is None else max(top, step)

    def fired(self, text: str) -> None:
        self._fired[text] += 1

    def reported(self, text: str) -> None:
        self._reported[text] += 1

    def unfired(self, specs, ranks) -> list[tuple[object, str]]:
        """(spec, reason) for every spec of `ranks` that neither fired nor was reported."""
        left = self._fired + self._reported
        out = []
        for spec in specs:
            if spec.rank not in ranks:
                continue
            if left[spec.text] > 0:
                left[spec.text] -= 1
                continue
            out.append((spec, unfired_reason(spec, self._ran, self.last_attempt)))
        return out
