"""Pure decision functions of the control loop: (state, options) -> action + reason.

Nothing here touches processes, clocks or I/O, so every rule is unit-tested directly and the
reason string is logged verbatim (ANCHORS.md §3, principle 5).
"""
from __future__ import annotations

import enum
from dataclasses import dataclass

from leto_run.slot import ProcState, TERMINAL
from leto_runtime.contract import UNRECOVERABLE_EXIT


class Action(str, enum.Enum):
    CONTINUE = "continue"        # keep supervising
    SUCCEED = "succeed"          # every worker finished with exit code 0
    RESTART = "restart"          # stop the group, new rendezvous round, respawn
    GIVE_UP = "give_up"          # stop the group and end the job with the failure
    INPLACE = "inplace"          # HOF: promote the shadows of the next generation in place
    FALL_BACK = "fall_back"      # no in-place recovery possible: `decide_group` decides
    UNRECOVERABLE = "unrecoverable"   # retained state lost: end the job (checkpoint fallback later)


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


def blame_hangs(silent: dict, others_progressing: bool = False) -> tuple[set, str]:
    """Which of the processes past their heartbeat deadline hung, given {key: in_collective}
    (its last beat said it was entering a collective).  A rank blocked in a collective waits
    for a peer, so it is not blamed while a peer on this node still makes progress
    (`others_progressing`: beating within its deadline, or still starting up, which is never
    a hang) or while another silent rank is outside a collective -- that one is blamed, and
    the waiters fail (or are demoted) once it is gone.  Only when every silent rank is in a
    collective and nothing else moves are they all blamed (a collective that hangs by itself)."""
    outside = {k for k, in_coll in silent.items() if not in_coll}
    if outside and len(outside) < len(silent):
        return outside, "the other silent ranks are blocked in a collective, waiting for it"
    if not outside and others_progressing:
        return set(), "the silent ranks wait in a collective for peers that still make progress"
    return set(silent), "every silent rank" if len(silent) > 1 else "the only silent rank"


@dataclass(frozen=True)
class SlotView:
    """What `decide_inplace` needs to know about one local slot."""

    rank: int
    inplace: bool                    # its active announced in-place mode (called init())
    shadow_generation: int | None    # generation of its live shadow; None: no live shadow


@dataclass(frozen=True)
class Failure:
    rank: int
    exitcode: int
    how: str


def decide_inplace(mode: str, generation: int, failures: list[Failure], slots: list[SlotView],
                   remote_hof: str | None = None, shadows_unusable: str | None = None) -> Decision:
    """A HOF of `generation` happened (local `failures`, or `remote_hof` declared by another
    node): recover in place, end the job, or fall back to the restart path.

    In place needs in-place mode, every local slot in place with a live shadow of generation
    + 1, and no trainer that said its retained state is lost (UNRECOVERABLE_EXIT).
    `shadows_unusable` (why the shadows cannot be trusted, e.g. a shadow died on a multi-node
    job) forces the fallback."""
    lost = next((f for f in failures if f.exitcode == UNRECOVERABLE_EXIT), None)
    if mode == "inplace" and lost is not None:
        return Decision(Action.UNRECOVERABLE,
                        f"rank {lost.rank} exited with {UNRECOVERABLE_EXIT}: its retained state "
                        "cannot be recovered in place (checkpoint fallback is not implemented "
                        "yet)")
    if not failures and remote_hof is None:
        return Decision(Action.CONTINUE, "no failure")
    cause = (f"rank {failures[0].rank} failed ({failures[0].how})" if failures
             else f"HOF declared by {remote_hof}")
    if mode != "inplace":
        return Decision(Action.FALL_BACK, f"{cause}; recovery mode is restart")
    want = generation + 1
    for s in slots:
        if not s.inplace:
            return Decision(Action.FALL_BACK, f"{cause}; rank {s.rank} does not run in place "
                            "(its trainer did not call leto_runtime.init())")
        if s.shadow_generation != want:
            have = ("no live shadow" if s.shadow_generation is None
                    else f"a shadow of generation {s.shadow_generation}")
            return Decision(Action.FALL_BACK, f"{cause}; rank {s.rank} has {have}, not one of "
                            f"generation {want}")
    if shadows_unusable:
        return Decision(Action.FALL_BACK, f"{cause}; {shadows_unusable}")
    if not slots:
        return Decision(Action.FALL_BACK, f"{cause}; no local slots")
    return Decision(Action.INPLACE, f"{cause} in generation {generation}; promoting the shadows "
                    f"of generation {want} in place")
