"""The restart policy: torchrun's answer to a failure that in-place recovery does not take.

Role: `RestartPolicy` applies a RESTART decision (`decisions.decide_group`) to the worker group:
every trainer of the group is stopped, the restart is counted against `--max-restarts` when the
decision says it counts (a membership change does not), and the agent's loop then starts the
next attempt (`WorkerGroup.begin_attempt` / `start`: a new rendezvous round).  It has the shape
of the in-place policy (`leto_run.inplace.InplaceRecovery`): an `action` it applies, over the
group, never over the agent.

Calling contract: the agent's main thread; `remaining` and `count` are what the next decision
and the next attempt read.
"""
from __future__ import annotations

from leto_run.decisions import Action, Decision
from leto_run.group import WorkerGroup


class RestartPolicy:
    action = Action.RESTART

    def __init__(self, group: WorkerGroup, max_restarts: int):
        self.group = group
        self.remaining = max_restarts      # restarts left (`--max-restarts`)
        self.count = 0                     # restarts done: TORCHELASTIC_RESTART_COUNT

    def apply(self, decision: Decision) -> None:
        """Stop the group for `decision` (a RESTART); the loop starts the next attempt."""
        self.group.stop(decision.reason)
        if decision.counts_as_restart:
            self.remaining -= 1
            self.count += 1
        self.group.events.emit("restart", self.group.generation, reason=decision.reason,
                               restart_count=self.count)

    def note_fallback(self) -> None:
        """A checkpoint fallback starts a new attempt too (TORCHELASTIC_RESTART_COUNT + 1, so an
        injection of attempt N does not fire again), without using up `--max-restarts`."""
        self.count += 1
