"""Pure decision functions of the control loop: (state, options) -> action + reason.

Nothing here touches processes, clocks or I/O, so every rule is unit-tested directly and the
reason string is logged verbatim (the `decision` event; docs/ARCHITECTURE.md, "Failure
classification and policies").

Failure classification (`classify_failure`, used by `decide_inplace`).  In-place recovery is for
HOFs, failures of the hardware or the machine around a trainer; a failure of the script itself
happens again wherever it runs, so recovering it in place only loops.  What the agent knows of a
failure -- and nothing less reliable (no parsing of stderr) -- decides its kind:

| kind        | how the agent knows                                               |
|-------------|-------------------------------------------------------------------|
| lost_state  | exit code `contract.UNRECOVERABLE_EXIT` (retained state gone)     |
| hang        | the hang verdict (no heartbeat for --hang-timeout) killed it      |
| signal      | killed by a signal (SIGKILL, SIGSEGV, SIGBUS, ...)                |
| exception   | non-zero exit, a traceback in its torchelastic error file (@record, or the
|             | runtime's excepthook: leto_runtime.errors)                        |
| exit        | non-zero exit code and no error file                              |

Its *signature* is what "the same way" compares: the signal's name, the traceback's identity
(exception type and innermost frame, `failures.error_identity`: not the message, which often
holds values that change between generations), the exit code, or `hang`.  Its *point* is the
last step the failed trainer reported (None: it reported none in its generation).

Verdicts, in this order:
1. lost_state -> `Verdict.LOST_STATE`: the job ends (exit 4; `decide_inplace`).
1b. its error file marks a `leto_runtime.errors.ScriptError` (a problem of the script the
   runtime detected: a tensor kept in lent memory, a replaced gradient, a DDP setting, ...) ->
   `Verdict.DETERMINISTIC`: every generation would fail the same way one step later, so
   recovering it would only walk the failure forward.
2. a failure of a process Leto injected a fault into -> transient: the user asked for a HOF.
3. the same signature as the last failure the agent recovered (in place or by a restart) and
   (a) at the same point, (a') at the next step (a promoted trainer redid the step and met the
   failure again right after: the script walks it forward one step per recovery), or (b) its
   generation completed no step since that recovery ->
   `Verdict.DETERMINISTIC`: a failure that repeats where it happened, or that recovery cannot
   get past, is not a HOF.
4. its generation completed no step, and neither had the generation of the last recovered
   failure, whatever the signatures -> `Verdict.DETERMINISTIC`: no progress at all since two
   failures (a trainer that dies before its first step in every generation).
5. anything else (a first failure, one at a new point or of another signature) -> transient.

A deterministic failure is never recovered in place: `decide_inplace` falls back, and the group
follows torchrun's semantics (`decide_group`: restart while `--max-restarts` allows, then exit 3;
with `--max-restarts 0`, exit 1).  The history survives restarts, so a restarted group that
fails the same way again uses up the next restart, as under torchrun.  Transient failures are
recovered in place while the budget lasts: at most `--max-inplace-recoveries` in any
`--inplace-window` seconds (`inplace_budget`); past it, failures follow `--max-restarts` too.
"""
from __future__ import annotations

import enum
import signal
from dataclasses import dataclass

from leto_run.slot import ProcState, TERMINAL
from leto_runtime.wire.contract import UNRECOVERABLE_EXIT


class Action(str, enum.Enum):
    CONTINUE = "continue"        # keep supervising
    SUCCEED = "succeed"          # every worker finished with exit code 0
    RESTART = "restart"          # stop the group, new rendezvous round, respawn
    GIVE_UP = "give_up"          # stop the group and end the job with the failure
    INPLACE = "inplace"          # HOF: promote the shadows of the next generation in place
    FALL_BACK = "fall_back"      # no in-place recovery possible: `decide_group` decides
    UNRECOVERABLE = "unrecoverable"   # retained state lost: a checkpoint fallback, else the end


class FailureKind(str, enum.Enum):
    LOST_STATE = "lost_state"
    HANG = "hang"
    SIGNAL = "signal"
    EXCEPTION = "exception"
    EXIT = "exit"


class Verdict(str, enum.Enum):
    TRANSIENT = "transient"              # may be a HOF: recovered in place (within the budget)
    DETERMINISTIC = "deterministic"      # repeats where it happened: not a HOF
    LOST_STATE = "lost_state"            # the retained state is gone: nothing can be recovered


@dataclass(frozen=True)
class Classification:
    verdict: Verdict
    kind: FailureKind
    signature: str
    reason: str

    def fields(self) -> dict:
        """For the event log (`decision`, `inplace_fallback`)."""
        return {"verdict": self.verdict.value, "kind": self.kind.value,
                "signature": self.signature, "classification": self.reason}


@dataclass(frozen=True)
class Decision:
    action: Action
    reason: str
    counts_as_restart: bool = False
    classification: Classification | None = None


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


def hang_verdict(now: float, deadline: float | None, since: float | None, timeout: float,
                 awaiting: str | None = None) -> tuple[bool, str]:
    """Has a process the agent waits on missed its deadline?  `since`: its last heartbeat, or
    when the agent began to wait on it for `awaiting` (its promotion's confirmation, a stopped
    process to run again: `SlotProcess.expect`).  A process without a deadline is not judged:
    an active's start-up before its first heartbeat (imports, compilation, kernel builds) is
    not a hang, and a waiting shadow is not supervised until it is promoted."""
    if timeout <= 0 or deadline is None or since is None:
        return False, "hang detection off, or nothing due from it (start-up, a waiting shadow)"
    if now < deadline:
        return False, f"last sign of life {now - since:.3f} s ago"
    what = awaiting or "no heartbeat"
    return True, f"{what} for {now - since:.1f} s (--hang-timeout {timeout:g} s)"


# A loop turn late by more than this share of --hang-timeout lost sight of its processes.
STALL_SHARE = 0.5


def stall_verdict(took: float, planned: float, timeout: float) -> tuple[bool, str]:
    """Was the agent itself away (SIGSTOP, a VM or disk stall) long enough that what it knows
    of its processes' heartbeats is stale?  One loop turn took `took` s where it planned to wait
    at most `planned` s.  While the agent does not run, the kernel's datagram queue fills and
    later beats are dropped, so silence over that time proves nothing: every process gets a
    fresh --hang-timeout from now instead of a verdict (a real hang is then found one timeout
    later)."""
    if timeout <= 0:
        return False, "hang detection off"
    late = took - max(planned, 0.0)
    if late <= STALL_SHARE * timeout:
        return False, f"the loop turn was {max(late, 0.0):.3f} s late"
    return True, (f"the agent's own loop was away for {took:.1f} s (it planned to wait at most "
                  f"{max(planned, 0.0):.1f} s: the agent was stopped, starved or busy), so "
                  "heartbeats sent meanwhile may be lost; every process gets a grace of "
                  f"--hang-timeout {timeout:g} s from now instead of a hang verdict on stale times")


def guardian_verdict(deaths: list[float], now: float, limit: int,
                     window: float) -> tuple[bool, str]:
    """Start the agent's guardian again after its death at `now`?  `deaths`: when the earlier
    ones died.  More than `limit` deaths within `window` s: something kills it on purpose or
    it cannot run here; the job goes on without it."""
    recent = [t for t in deaths if now - t < window] + [now]
    if len(recent) > limit:
        return False, (f"it died {len(recent)} times within {window:g} s; not starting it "
                       "again: if the agent is killed now (kill -9), nothing stops its "
                       "processes or removes its run directory")
    return True, f"death {len(recent)} of at most {limit} within {window:g} s"


def linger_verdict(now: float, finished_at: float | None, peers_past_since: float | None,
                   timeout: float) -> tuple[bool, str]:
    """Is a rank that ended its training loop (its `bye`) slow enough to exit, once every rank
    of its node has ended its loop or exited (`peers_past_since`), to be worth a look (its
    stacks dumped, once)?  Not a hang verdict: after the loop a final save may still run, so
    leto-run waits for it as torchrun does, but says so once `timeout` has passed since both."""
    if timeout <= 0 or finished_at is None or peers_past_since is None:
        return False, "hang detection off, or a rank of this node still in its loop"
    since = now - max(finished_at, peers_past_since)
    if since < timeout:
        return False, f"every rank past its loop for {since:.1f} s"
    return True, (f"ended its training loop {now - finished_at:.1f} s ago and has not exited "
                  f"{since:.1f} s after every rank of this node ended its loop "
                  f"(--hang-timeout {timeout:g} s)")


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
    """What the agent knows of one failed trainer (`classify_failure` says what it makes of it)."""

    rank: int
    exitcode: int                    # negative: killed by signal -exitcode
    how: str
    step: int | None = None          # the last step it reported; None: none in its generation
    error: str | None = None         # identity of its error file's traceback; None: no file
    hang: bool = False               # the agent's hang verdict killed it
    injected: str | None = None      # the fault Leto injected into this process, if any
    progressed: bool = True          # its generation completed a step (on this node) first
    script_error: bool = False       # its error file marks a leto_runtime.errors.ScriptError

    @property
    def kind(self) -> FailureKind:
        if self.exitcode == UNRECOVERABLE_EXIT:
            return FailureKind.LOST_STATE
        if self.hang:
            return FailureKind.HANG
        if self.exitcode < 0:
            return FailureKind.SIGNAL
        return FailureKind.EXCEPTION if self.error else FailureKind.EXIT

    @property
    def signature(self) -> str:
        kind = self.kind
        if kind == FailureKind.HANG:
            return "hang"
        if kind == FailureKind.SIGNAL:
            return _signal_name(-self.exitcode)
        if kind == FailureKind.EXCEPTION:
            return str(self.error)
        return f"exit code {self.exitcode}"


@dataclass(frozen=True)
class PastFailure:
    """One failure the agent recovered from, in place or by a restart (the history)."""

    generation: int
    kind: FailureKind | None         # None: a HOF another node declared (it judged it)
    signature: str | None
    step: int | None
    mono: float                      # when it was recovered
    inplace: bool                    # recovered in place (counts against the budget)
    progressed: bool = True          # its generation had completed a step

    @classmethod
    def of(cls, f: Failure | None, generation: int, mono: float, inplace: bool) -> "PastFailure":
        if f is None:
            return cls(generation, None, None, None, mono, inplace)
        return cls(generation, f.kind, f.signature, f.step, mono, inplace, f.progressed)


@dataclass(frozen=True)
class Budget:
    """`recovery.max_inplace_recoveries` within `recovery.inplace_window` seconds."""

    max_recoveries: int = 20
    window: float = 3600.0


def _signal_name(num: int) -> str:
    try:
        return signal.Signals(num).name
    except ValueError:
        return f"signal {num}"


def _at(step: int | None) -> str:
    return "before its first step" if step is None else f"at step {step}"


def classify_failure(f: Failure, last: PastFailure | None) -> Classification:
    """The verdict on failure `f`, given the last failure recovered before it (module
    docstring, "Verdicts")."""
    kind, sig = f.kind, f.signature
    if kind == FailureKind.LOST_STATE:
        return Classification(Verdict.LOST_STATE, kind, sig,
                              f"rank {f.rank} exited with {UNRECOVERABLE_EXIT}: its retained "
                              "state cannot be recovered in place")
    if f.script_error:
        return Classification(Verdict.DETERMINISTIC, kind, sig,
                              f"rank {f.rank} stopped on an error of the script or of this "
                              f"node's limits ({sig}) that every generation would meet again: "
                              "not a HOF (its message is in the failure summary)")
    if f.injected:
        return Classification(Verdict.TRANSIENT, kind, sig,
                              f"rank {f.rank}: {sig} {_at(f.step)} after the injected fault "
                              f"'{f.injected}': a HOF")
    same = last is not None and last.kind == kind and last.signature == sig
    if same and last.step == f.step:
        return Classification(Verdict.DETERMINISTIC, kind, sig,
                              f"rank {f.rank} failed again {_at(f.step)} the same way as the "
                              f"failure recovered in generation {last.generation} ({sig}): a "
                              "deterministic failure of the script, not a HOF")
    if same and f.step is not None and last.step is not None and f.step == last.step + 1:
        return Classification(Verdict.DETERMINISTIC, kind, sig,
                              f"rank {f.rank} failed the same way ({sig}) one step after the "
                              f"failure recovered in generation {last.generation} (step "
                              f"{last.step}): a failure of the script that each recovery moves "
                              "one step on, not a HOF")
    if same and not f.progressed:
        return Classification(Verdict.DETERMINISTIC, kind, sig,
                              f"rank {f.rank} failed the same way as the failure recovered in "
                              f"generation {last.generation} ({sig}) before its generation "
                              "completed a step: recovery cannot get past it, not a HOF")
    if last is not None and last.kind is not None and not (f.progressed or last.progressed):
        return Classification(Verdict.DETERMINISTIC, kind, sig,
                              f"rank {f.rank} failed ({sig}) before its generation completed a "
                              f"step, and so did generation {last.generation} "
                              f"({last.signature}): no progress since two failures, not a HOF")
    why = ("the first failure" if last is None or last.kind is None
           else "not a repeat of the last failure recovered "
                f"(generation {last.generation}: {last.signature} {_at(last.step)})")
    return Classification(Verdict.TRANSIENT, kind, sig,
                          f"rank {f.rank}: {sig} {_at(f.step)}, {why}: treated as a HOF")


def inplace_budget(history: tuple[PastFailure, ...] | list[PastFailure], budget: Budget,
                   now: float) -> tuple[bool, str]:
    """May one more failure be recovered in place?  Counts the in-place recoveries of the
    last `budget.window` seconds."""
    if budget.max_recoveries <= 0:
        return False, "in-place recovery is off (--max-inplace-recoveries 0)"
    used = sum(1 for h in history if h.inplace and now - h.mono < budget.window)
    if used >= budget.max_recoveries:
        return False, (f"{used} in-place recoveries within {budget.window:g} s used up the "
                       f"budget (--max-inplace-recoveries {budget.max_recoveries}, "
                       f"--inplace-window {budget.window:g})")
    return True, f"{used} of {budget.max_recoveries} in-place recoveries used"


def decide_inplace(mode: str, generation: int, failures: list[Failure], slots: list[SlotView],
                   remote_hof: str | None = None, shadows_unusable: str | None = None, *,
                   history: tuple[PastFailure, ...] = (), budget: Budget = Budget(),
                   now: float = 0.0, retained_lost: str | None = None) -> Decision:
    """A HOF of `generation` happened (local `failures`, the first being the root cause, or
    `remote_hof` declared by another node): recover in place, end the job, or fall back to
    the restart path (`decide_group`).

    UNRECOVERABLE: a trainer said its retained state is lost (UNRECOVERABLE_EXIT), or
    `retained_lost` says why this node's retained state cannot be served any more (a state
    manager gone for good): no recovery can succeed.  FALL_BACK: restart mode; a slot not in
    place; the root cause is deterministic (`classify_failure` over `history`); the in-place
    budget is used up (`inplace_budget`); a slot without a live shadow of generation + 1;
    `shadows_unusable` (why the shadows cannot be trusted, e.g. one died on a multi-node job).
    A HOF another node declared is followed as it is: that node judged it."""
    if mode != "inplace":
        if not failures and remote_hof is None:
            return Decision(Action.CONTINUE, "no failure")
        return Decision(Action.FALL_BACK, f"{_cause(failures, remote_hof)}; recovery mode is "
                        "restart")
    root = failures[0] if failures else None
    cls = classify_failure(root, history[-1] if history else None) if root else None
    lost = next((f for f in failures if f.kind == FailureKind.LOST_STATE), None)
    if lost is not None:
        return Decision(Action.UNRECOVERABLE,
                        f"rank {lost.rank} exited with {UNRECOVERABLE_EXIT}: its retained state "
                        "cannot be recovered in place", classification=classify_failure(lost, None))
    if root is None and remote_hof is None:
        return Decision(Action.CONTINUE, "no failure")
    cause = _cause(failures, remote_hof)
    if retained_lost:
        return Decision(Action.UNRECOVERABLE, f"{cause}; {retained_lost}", classification=cls)
    for s in slots:
        if not s.inplace:
            return Decision(Action.FALL_BACK, f"{cause}; rank {s.rank} does not run in place "
                            "(its trainer did not call leto_runtime.init(), or failed before it announced "
                            "itself: see the trainer's log)", classification=cls)
    if cls is not None and cls.verdict == Verdict.DETERMINISTIC:
        return Decision(Action.FALL_BACK, cls.reason, classification=cls)
    ok, why = inplace_budget(history, budget, now)
    if not ok and root is not None:
        return Decision(Action.FALL_BACK, f"{cause}; {why}", classification=cls)
    return _shadows_ready(cause, generation, slots, shadows_unusable, cls)


def _cause(failures: list[Failure], remote_hof: str | None) -> str:
    return (f"rank {failures[0].rank} failed ({failures[0].how})" if failures
            else f"HOF declared by {remote_hof}")


def _shadows_ready(cause: str, generation: int, slots: list[SlotView],
                   shadows_unusable: str | None, cls: Classification | None) -> Decision:
    want = generation + 1
    for s in slots:
        if s.shadow_generation != want:
            have = ("no live shadow" if s.shadow_generation is None
                    else f"a shadow of generation {s.shadow_generation}")
            return Decision(Action.FALL_BACK, f"{cause}; rank {s.rank} has {have}, not one of "
                            f"generation {want}", classification=cls)
    if shadows_unusable:
        return Decision(Action.FALL_BACK, f"{cause}; {shadows_unusable}", classification=cls)
    if not slots:
        return Decision(Action.FALL_BACK, f"{cause}; no local slots", classification=cls)
    why = f" ({cls.reason})" if cls is not None else ""
    return Decision(Action.INPLACE, f"{cause} in generation {generation}{why}; promoting the "
                    f"shadows of generation {want} in place", classification=cls)
