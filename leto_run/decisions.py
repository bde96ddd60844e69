"""Pure decision functions of the control loop: (state, options) -> action + reason.

Nothing here touches processes, clocks or I/O, so every rule is unit-tested directly and the
reason string is logged verbatim (ANCHORS.md §3, principle 5).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from leto_run.slot import ProcState, TERMINAL


class Action(str, enum.Enum):
    CONTINUE = "continue"        # keep supervising
    SUCCEED = "succeed"          # every worker finished with exit code 0
    RESTART = "restart"          # stop the group, new rendezvous round, respawn
    GIVE_UP = "give_up"          # stop the group and end the job with the failure


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str
    counts_as_restart: bool = False


def decide_group(states: list[ProcState], failed_ranks: list[int], remaining_restarts: int,
                 max_restarts: int, nodes_waiting: int = 0) -> Decision:
    """What the group of local active workers should do next (torchrun semantics)."""
    if failed_ranks:
        first = failed_ranks[0]
        if remaining_restarts > 0:
            used = max_restarts - remaining_restarts + 1
            return Decision(Action.RESTART,
                            f"rank {first} failed; restarting the worker group "
                            f"(restart {used} of {max_restarts})", counts_as_restart=True)
        if max_restarts == 0:
            why = "no restarts allowed (--max-restarts 0)"
        else:
            why = f"all {max_restarts} restarts used"
        return Decision(Action.GIVE_UP, f"rank {first} failed; {why}")
    if states and all(s == ProcState.SUCCEEDED for s in states):
        return Decision(Action.SUCCEED, "every local worker exited with code 0")
    if nodes_waiting > 0 and not all(s in TERMINAL for s in states):
        # torchrun: membership changes restart the group but do not count as retries.
        return Decision(Action.RESTART, f"{nodes_waiting} node(s) waiting to join the "
                        "rendezvous (a peer restarted or a node joined); re-forming the group")
    return Decision(Action.CONTINUE, "workers running")


def hang_verdict(now: float, deadline: float | None, last_beat: float | None,
                 timeout: float) -> tuple[bool, str]:
    """Has a heartbeating process missed its deadline?  Only after its first heartbeat:
    start-up (imports, compilation) is not a hang."""
    if timeout <= 0 or deadline is None or last_beat is None:
        return False, "hang detection off or no heartbeat yet"
    if now < deadline:
        return False, f"last heartbeat {now - last_beat:.3f} s ago"
    return True, f"no heartbeat for {now - last_beat:.1f} s (--hang-timeout {timeout:g} s)"
