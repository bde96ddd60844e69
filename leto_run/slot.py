"""Rank slots: the unit the agent supervises (docs/ARCHITECTURE.md, "The process tree").

A slot serves one local rank on one GPU with up to three sibling processes, each in a
`SlotRole`: the state manager, the active trainer and the shadow trainer.  In restart mode only
the active role is filled; in in-place mode the state manager runs from the start and a shadow
joins once the active announced in-place mode (`leto_run.inplace`).  Promotion moves the shadow's
`SlotProcess` into the active role (same object, `role` rewritten).

Each process runs through `ProcState`; moves follow `_TRANSITIONS` and an illegal move raises
`IllegalTransition` (a bug in the agent, never a user error).
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from leto_run.procs import Proc
from leto_run.worker_env import WorkerIdentity


class SlotRole(str, enum.Enum):
    STATE_MANAGER = "state_manager"
    ACTIVE = "active"
    SHADOW = "shadow"


class ProcState(str, enum.Enum):
    STARTING = "starting"      # spawned, no heartbeat yet
    RUNNING = "running"        # heartbeating (or a plain script, which never beats)
    STOPPING = "stopping"      # the agent asked it to stop (SIGTERM sent)
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    STOPPED = "stopped"        # ended because the agent stopped it


_TRANSITIONS: dict[ProcState, frozenset[ProcState]] = {
    ProcState.STARTING: frozenset({ProcState.RUNNING, ProcState.STOPPING, ProcState.SUCCEEDED,
                                   ProcState.FAILED}),
    ProcState.RUNNING: frozenset({ProcState.STOPPING, ProcState.SUCCEEDED, ProcState.FAILED}),
    ProcState.STOPPING: frozenset({ProcState.STOPPED, ProcState.SUCCEEDED, ProcState.FAILED}),
    ProcState.SUCCEEDED: frozenset(),
    ProcState.FAILED: frozenset(),
    ProcState.STOPPED: frozenset(),
}
TERMINAL = frozenset({ProcState.SUCCEEDED, ProcState.FAILED, ProcState.STOPPED})


class IllegalTransition(RuntimeError):
    pass


def console_label(rank: int, role: SlotRole, generation: int) -> str:
    """The prefix of a process's console lines: the role it has now (README, "Logs")."""
    return f"[r{rank} {role.value} g{generation}]: "


@dataclass
class SlotProcess:
    """One process in one role of a slot, with its supervision state."""

    role: SlotRole
    generation: int
    attempt: int
    proc: Proc
    error_file: str
    state: ProcState = ProcState.STARTING
    step: int | None = None
    last_beat: float | None = None          # its last heartbeat, or when a wait on it began
    beats: int = 0
    hang_deadline: float | None = None      # a sign of life is due by then (None: not judged)
    awaiting: str | None = None             # what is due, when not a heartbeat (hang_verdict)
    fired_injections: set[str] = field(default_factory=set)
    epoch: int = 0                          # shadows: LETO_SHADOW_EPOCH it was started with
    ready: bool = False                     # shadows: reached its preinit level
    level: str = "L3"                       # shadows: its preinit level (asked, then reported)
    wake: bool = False                      # shadows: handle PROMOTE_SIGNAL (said when ready)
    demoted: dict | None = None             # demote=release: its `demoted` datagram's detail
    in_collective: bool = False             # its last beat: entering a collective (blame_hangs)
    first_step: int | None = None           # the first step it reported in its current role
    injected: str | None = None             # the last fault injected into it (spec text)
    pipes: tuple[int, ...] = ()             # read ends of its stdout/stderr (console labels)
    finished: bool = False                  # its `bye`: the training loop ended
    finished_at: float | None = None        # ... at this monotonic time
    peers_past_since: float | None = None   # finished, and every peer of the node too (or exited)
    linger_said: bool = False               # the agent said it is slow to exit (linger_verdict)
    exit_recorded: bool = False             # its `exit` event was emitted (once per process)
    exit_note: dict = field(default_factory=dict)   # why the agent ended it, for that event

    @property
    def completed_step(self) -> bool:
        """It reported a step after its first one in this role: that one was completed."""
        return self.first_step is not None and self.step is not None and self.step > self.first_step

    def new_role(self, role: "SlotRole", generation: int) -> None:
        """Promotion or in-process demotion: progress, injections and the hang clock of the old
        role are over (a promotion starts its own: `expect`)."""
        self.role, self.generation = role, generation
        self.step = self.first_step = self.injected = None
        self.hang_deadline = self.last_beat = self.awaiting = None
        self.in_collective = False       # a survivor demoted inside a collective waits in none now

    def expect(self, now: float, timeout: float, what: str) -> None:
        """The agent waits on this process for `what` from `now` (a promotion to confirm; a
        stopped process to run again): silent for `timeout` s more, it is hung (0: never)."""
        if timeout > 0:
            self.last_beat, self.hang_deadline, self.awaiting = now, now + timeout, what

    def move(self, new: ProcState) -> None:
        if new not in _TRANSITIONS[self.state]:
            raise IllegalTransition(f"{self.role.value} pid {self.proc.pid}: "
                                    f"{self.state.value} -> {new.value}")
        self.state = new

    @property
    def done(self) -> bool:
        return self.state in TERMINAL

    def on_beat(self, step: int | None, now: float, hang_timeout: float) -> None:
        self.beats += 1
        self.last_beat, self.awaiting = now, None
        if step is not None:
            self.step = step
            if self.first_step is None:
                self.first_step = step
        if hang_timeout > 0:
            self.hang_deadline = now + hang_timeout
        if self.state == ProcState.STARTING:
            self.move(ProcState.RUNNING)


@dataclass
class RankSlot:
    identity: WorkerIdentity
    procs: dict[SlotRole, SlotProcess] = field(default_factory=dict)
    created_mono: float = field(default_factory=time.monotonic)
    inplace: bool = False                   # the active announced in-place mode (init())
    device_uuid: str | None = None          # its CUDA device as its active reported it (NVML's name)

    @property
    def rank(self) -> int:
        return self.identity.global_rank

    @property
    def local_rank(self) -> int:
        return self.identity.local_rank

    @property
    def active(self) -> SlotProcess | None:
        return self.procs.get(SlotRole.ACTIVE)

    @property
    def shadow(self) -> SlotProcess | None:
        return self.procs.get(SlotRole.SHADOW)

    def all(self) -> list[SlotProcess]:
        return list(self.procs.values())
