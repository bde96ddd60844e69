"""The handlers of what the agent's selector reports: process exits, heartbeat datagrams,
signals, hang deadlines and injection timers.

Role: `Supervisor` turns what it observes into the worker group's supervision state (process
states, the failures of the generation, the injection ledger, the `resumed` / `caught_up`
milestones) and decides nothing itself -- the loop's decision (`leto_run.decisions`) follows
each turn.  What it records for the failure policy: the step a failed trainer had reported,
whether the hang verdict killed it, and the fault last injected into each process
(`SlotProcess.injected`).

Calling contract: the agent's main thread only.  The in-place policy, when there is one, is its
`observer`: it is told of in-place datagrams and of shadow deaths, and asked whether the death
of an active is collateral to a HOF it recovers (`InplaceObserver`).  One handler per selector
key: `on_exit` (a pidfd), `on_exit_notices` (an exit that began: `leto_run.exit_notice`),
`on_beats` (the heartbeat socket), `on_signals` (the wakeup fd); once per loop turn
`check_hangs(now)`, `check_lingering(now)` and `fire_timers(now)`, and before them
`note_stall` / `after_stall` (the agent itself was away: a fresh window, not a verdict).
Every wait on a process has a deadline and names what is due (`SlotProcess.expect`;
docs/ARCHITECTURE.md, "Bounded waits").
"""
from __future__ import annotations

import json
import os
import signal
import time
from typing import Protocol

from leto_run import errors as E
from leto_run import job_secret
from leto_run.decisions import blame_hangs, hang_verdict, linger_verdict, stall_verdict
from leto_run.exit_notice import fence_verdict
from leto_run.failures import failure_from_exit
from leto_run.group import WorkerGroup
from leto_run.inject import InjectKind
from leto_run.procs import ExitStatus, paused
from leto_run.slot import ProcState, RankSlot, SlotProcess, SlotRole
from leto_runtime.wire import contract as C

SHUTDOWN_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT})
STOPPED = "stopped (SIGSTOP or a debugger), serving nobody,"     # what a paused state manager owes


class InplaceObserver(Protocol):
    """What the supervisor tells the in-place policy, and asks it (`leto_run.inplace`)."""

    def on_datagram(self, slot: RankSlot, sp: SlotProcess, beat) -> None: ...
    def on_shadow_exit(self, slot: RankSlot, sp: SlotProcess, status) -> None: ...
    def collateral(self, sp: SlotProcess) -> bool: ...
    def on_preinit_inject(self, slot: RankSlot, sp: SlotProcess, level: str, step: int) -> None: ...
    def on_reclaim(self, slot: RankSlot, sp: SlotProcess, detail: str | None) -> None: ...


class Supervisor:
    """The handlers of one node's worker group (see the module docstring)."""

    def __init__(self, group: WorkerGroup, *, hb, sig_fd: int, handled: set[int], host: str,
                 observer: InplaceObserver | None = None):
        self.group, self.hb, self.sig_fd, self.handled, self.host = group, hb, sig_fd, handled, host
        self.observer = observer
        self.cfg, self.events, self.log = group.cfg, group.events, group.log
        self.status, self.ledger = group.io.status, group.io.ledger
        self.catch_up: tuple[int, int] | None = None  # (failed generation, the step it reached)
        self.resumed_gens: set[int] = set()
        self.resuming: dict[int, set[int]] = {}   # generation -> local ranks that beat a step
        self.stall: tuple[float, float, str] | None = None    # note_stall, until after_stall

    def on_exit(self, slot: RankSlot, sp: SlotProcess) -> None:
        status = self.group.reap(slot, sp)
        if status is None or sp.done:       # not exited; or already judged (a hang we killed)
            return
        if sp.role == SlotRole.SHADOW and sp.state != ProcState.STOPPING:
            self.observer.on_shadow_exit(slot, sp, status)
        elif sp.state == ProcState.STOPPING:
            sp.move(ProcState.SUCCEEDED if status.ok else ProcState.STOPPED)
        elif not status.ok and self.observer and self.observer.collateral(sp):
            sp.move(ProcState.STOPPING)      # a survivor of a HOF recovered in place
            sp.move(ProcState.STOPPED)
        elif status.ok:
            sp.move(ProcState.SUCCEEDED)
        else:
            sp.move(ProcState.FAILED)
            self.record_failure(slot, sp, status.exitcode, status.describe(), status.mono)
        self.status.changed()

    def on_exit_notices(self) -> None:
        """Trainers whose exit began (the status is the kernel's, read before the reap)."""
        notices = self.group.io.notices
        by_pid = {sp.proc.pid: (slot, sp) for slot in self.group.slots for sp in slot.all()}
        for pid, code, mono, kind in notices.drain():
            if pid not in by_pid:
                continue
            slot, sp = by_pid[pid]
            if kind == "drained":
                self.on_drained(slot, sp, mono)
                continue
            acted = self._exit_began(slot, sp, ExitStatus(code, mono), gpu=notices.gpu)
            self.events.emit("exit_started", sp.generation, rank=slot.rank, role=sp.role.value,
                             pid=pid, exitcode=code, mono=mono, acted=acted)

    def on_drained(self, slot: RankSlot, sp: SlotProcess, mono: float) -> None:
        """`sp`'s drain words proved its queued device work done (leto_runtime/drain.py): it
        counts as stopped (`Proc.quiet`) before its fence says so."""
        if sp.proc.drained or sp.proc.fence == "quiet":
            return
        sp.proc.drained = True
        self.status.changed()
        self.events.emit("exit_fence", sp.generation, rank=slot.rank, role=sp.role.value,
                         pid=sp.proc.pid, verdict="drained", mono=mono,
                         reaped=sp.proc.status is not None)

    def on_fence(self, slot: RankSlot, sp: SlotProcess) -> None:
        """`sp`'s exit fence became readable: its verdict (`exit_notice.fence_verdict`), which
        `Proc.quiet` reads (the in-place promotion waits for it)."""
        if sp.proc.fence_fd is None:
            return
        verdict = fence_verdict(sp.proc.fence_fd, sp.proc.pid)
        if verdict is None:
            return
        notices = self.group.io.notices
        if verdict == "quiet" and sp.proc.pid not in notices.armed:
            verdict = "untrusted"             # never armed: its fence was never moved below
        notices.armed.discard(sp.proc.pid)
        mono = time.monotonic()
        sp.proc.fence = verdict
        self.group.forget_fence(sp)
        self.status.changed()
        self.events.emit("exit_fence", sp.generation, rank=slot.rank, role=sp.role.value,
                         pid=sp.proc.pid, verdict=verdict, mono=mono,
                         reaped=sp.proc.status is not None)

    def _exit_began(self, slot: RankSlot, sp: SlotProcess, status: ExitStatus,
                    gpu: bool) -> bool:
        """An active that died abruptly is judged now, as its pidfd would judge it later, so
        the recovery's decision and its CPU-side work start.  Without a GPU it counts as
        stopped at once (no thread of it runs); with one, `Proc.quiet` waits for its fence
        (or its reap).  Anything else waits for its pidfd."""
        if (sp.done or sp.role != SlotRole.ACTIVE or sp.proc.status is not None
                or sp.state not in (ProcState.STARTING, ProcState.RUNNING) or status.ok
                or (self.observer and self.observer.collateral(sp))):
            return False
        sp.proc.stopped = not gpu
        sp.move(ProcState.FAILED)
        self.record_failure(slot, sp, status.exitcode, status.describe(), status.mono)
        self.status.changed()
        return True

    def record_failure(self, slot: RankSlot, sp: SlotProcess, exitcode: int, how: str,
                        mono: float, note: str | None = None, hang: bool = False) -> None:
        ident = slot.identity
        # The error file is written before exit; give the output pump no say in ordering.
        rec = failure_from_exit(rank=ident.global_rank, local_rank=ident.local_rank,
                                role=sp.role.value, generation=sp.generation,
                                attempt=sp.attempt, pid=sp.proc.pid, exitcode=exitcode,
                                how=how, error_file=sp.error_file, wall=time.time(),
                                mono=mono, host=self.host, note=note, step=sp.step,
                                hang=hang)
        if not self.group.failures and sp.step is not None:
            self.catch_up = (sp.generation, sp.step)
        self.group.failures.append(rec)
        self.events.emit("failure_detected", sp.generation, rank=ident.global_rank,
                         local_rank=ident.local_rank, role=sp.role.value, pid=sp.proc.pid,
                         exitcode=exitcode, how=how, mono=mono,
                         latency_from_spawn=mono - sp.proc.started_mono, step=sp.step)
        self.log(f"rank {ident.global_rank} ({sp.role.value}, pid {sp.proc.pid}) failed: {how}")

    def on_beats(self) -> None:
        by_pid = {sp.proc.pid: (slot, sp) for slot in self.group.slots for sp in slot.all()
                  if not sp.done}
        for beat in self.hb.drain(set(by_pid)):
            slot, sp = by_pid[beat.pid]
            if beat.kind == "forged":        # a trainer refused a value: stop the job
                raise job_secret.forged_report(slot.rank, sp.role.value, beat.pid,
                                               sp.generation, beat.detail,
                                               self.cfg.launch.max_nodes > 1)
            if beat.kind == "phase":         # a trainer's phase (checkpoint, recovery, ...)
                emit_phase(self.events, slot, sp, beat)
            elif beat.kind in ("inplace", "promoted", "demoted"):
                if self.observer:
                    self.observer.on_datagram(slot, sp, beat)
            elif beat.kind == "reclaim":
                if self.observer and sp.role == SlotRole.ACTIVE:
                    self.observer.on_reclaim(slot, sp, beat.detail)
            elif beat.kind == "inject":
                self._on_inject_beat(slot, sp, beat)
            elif beat.kind == "unfired":
                self._on_unfired_beat(slot, sp, beat)
            elif sp.role == SlotRole.SHADOW or beat.kind == "register":
                # A waiting shadow is not supervised for hangs until promoted.  `register` is
                # sent once when the runtime loads, possibly long before the training loop (a
                # shadow promoted while still importing): liveness starts with a real beat.
                continue
            elif beat.kind == "bye":
                sp.hang_deadline = None          # finished its loop; exiting is not a hang
                sp.finished, sp.finished_at = True, time.monotonic()
            else:
                self._on_step_beat(slot, sp, beat)

    def _on_inject_beat(self, slot: RankSlot, sp: SlotProcess, beat) -> None:
        sp.step = beat.step if beat.step is not None else sp.step   # it is in that step
        spec = next((i for i in self.cfg.inject if i.text == beat.detail), None)
        if spec is None or spec.kind != InjectKind.PREINIT:   # a level change causes no failure
            sp.injected = beat.detail
        self.ledger.fired(beat.detail or "")
        # Timed when the trainer sent it, not when the agent got to it: the death it causes
        # may be seen first (the exit notice races the heartbeat reader), and the report
        # times detection from the injection.
        self.events.emit("inject", sp.generation, rank=slot.rank, role=sp.role.value,
                         pid=beat.pid, spec=beat.detail, step=beat.step, by="runtime",
                         mono=beat.sent if beat.sent is not None else beat.mono)
        self.log(f"injecting '{beat.detail}' into rank {slot.rank} at step {beat.step}")
        if spec is not None and spec.kind == InjectKind.PREINIT and self.observer \
                and beat.step is not None:
            self.observer.on_preinit_inject(slot, sp, dict(spec.params)["level"], beat.step)

    def _on_unfired_beat(self, slot: RankSlot, sp: SlotProcess, beat) -> None:
        """The runtime found that one of its injections can never fire (`leto_runtime.faults`)."""
        try:
            d = json.loads(beat.detail or "{}")
        except ValueError:
            d = {}
        if not isinstance(d, dict):
            d = {}
        spec, why = str(d.get("spec", "")), str(d.get("reason", "no reason given"))
        self.ledger.reported(spec)
        self.events.emit("inject_unfired", sp.generation, rank=slot.rank, role=sp.role.value,
                         pid=beat.pid, spec=spec, reason=why, step=beat.step, by="runtime")
        self.log(f"warning: injection '{spec}' into rank {slot.rank} can never fire: {why}")

    def _on_step_beat(self, slot: RankSlot, sp: SlotProcess, beat) -> None:
        sp.on_beat(beat.step, beat.mono, self.cfg.recovery.hang_timeout)
        sp.in_collective = beat.detail == "collective"   # waiting for peers from now on
        self.status.changed()
        if beat.step is None:
            return
        self.ledger.stepped(slot.rank, sp.attempt, self.group.relative(sp.generation), beat.step)
        if sp.generation == 0:
            return
        # Training has resumed once every local rank of the generation runs a step again
        # (they meet at the next collective): the slowest rank's recovery is the cost.
        seen = self.resuming.setdefault(sp.generation, set())
        seen.add(slot.rank)
        if sp.generation not in self.resumed_gens and len(seen) >= len(self.group.slots):
            self.resumed_gens.add(sp.generation)
            self.events.emit("resumed", sp.generation, rank=slot.rank, role=sp.role.value,
                             step=beat.step, mono=beat.mono)
        # Back at the failed step: in a later generation (a survivor of the failed one may
        # have been a step ahead until it was demoted).
        if (self.catch_up is not None and sp.generation > self.catch_up[0]
                and beat.step >= self.catch_up[1]):
            self.events.emit("caught_up", sp.generation, rank=slot.rank, step=beat.step,
                             mono=beat.mono)
            self.catch_up = None

    def on_signals(self) -> None:
        try:
            data = os.read(self.sig_fd, 512)
        except BlockingIOError:
            return
        for signum in data:
            if signum == signal.SIGCHLD:
                continue
            name = signal.Signals(signum).name
            self.events.emit("signal", self.group.generation, signal=name)
            if signum not in self.handled:
                continue
            if signum in SHUTDOWN_SIGNALS:
                # The stop forwards it (to every process group) after recording descendants.
                self.log(f"received {name}: forwarding to every worker and stopping the job")
                raise E.StoppedBySignal(signum)
            # To the active trainers only (torchrun's workers): a state manager has no handler
            # and would die, and a shadow's copy of the script must not act (e.g. checkpoint
            # state it does not own yet) on a signal meant for the running job.
            self.log(f"received {name}: forwarding to every active worker")
            for slot in self.group.slots:
                sp = slot.active
                if sp is not None and not sp.done:
                    sp.proc.send_group(signum)

    def check_hangs(self, now: float) -> None:
        """Judge every process a sign of life is due from (`hang_verdict`): trainers -- the
        silent ones blamed as `blame_hangs` says -- and state managers stopped for too long."""
        timeout = self.cfg.recovery.hang_timeout
        self._watch_stopped(now, timeout)
        silent = {}
        for slot in self.group.slots:
            for sp in slot.all():
                if sp.done or (self.observer and self.observer.collateral(sp)):
                    continue
                hung, why = hang_verdict(now, sp.hang_deadline, sp.last_beat, timeout,
                                         sp.awaiting)
                if hung and sp.role == SlotRole.STATE_MANAGER:
                    self._state_manager_hung(slot, sp, why)
                elif hung:
                    silent[sp.proc.pid] = (slot, sp, why)
        moving = any(s.active is not None and not s.active.done
                     and s.active.proc.pid not in silent for s in self.group.slots)
        blamed, _ = blame_hangs({pid: v[1].in_collective for pid, v in silent.items()},
                                others_progressing=moving)
        for pid, (slot, sp, why) in silent.items():
            if pid in blamed:        # the others wait in a collective for the rank blamed now
                self._hung(slot, sp, why, now)

    def _hung(self, slot: RankSlot, sp: SlotProcess, why: str, now: float) -> None:
        """A trainer judged hung: its stacks dumped, its group killed, a failure of its rank."""
        frozen = paused(sp.proc.pid)      # stopped: its dump waits for a SIGCONT that never comes
        self.events.emit("hang_detected", sp.generation, rank=slot.rank,
                         role=sp.role.value, pid=sp.proc.pid, step=sp.step, reason=why,
                         stopped=frozen)
        where = "before its first step" if sp.step is None else f"at step {sp.step}"
        then = ("it is stopped (SIGSTOP or a debugger), so no Python stacks can be dumped; "
                "killing it" if frozen else "dumping its Python stacks, then killing it")
        self.log(f"rank {slot.rank} ({sp.role.value}, pid {sp.proc.pid}) hung {where}: {why}; "
                 f"{then}")
        sp.proc.send(C.DUMP_SIGNAL)
        if not frozen:
            # faulthandler writes from its C signal handler; a short pause lets the dump
            # reach the log before SIGKILL.
            time.sleep(0.3)
        self.events.emit("stack_dump", sp.generation, rank=slot.rank, role=sp.role.value,
                         pid=sp.proc.pid, stopped=frozen)
        sp.proc.send_group(signal.SIGKILL)
        sp.move(ProcState.FAILED)
        dumped = ("it was stopped: no Python stacks" if frozen
                  else "Python stacks were dumped to this rank's stderr")
        self.record_failure(slot, sp, -signal.SIGKILL, f"hang: {why}", now,
                             note=f"hang detected: {why}; {dumped}", hang=True)
        self.status.changed()

    def _watch_stopped(self, now: float, timeout: float) -> None:
        """A state manager never beats, so a hung one cannot be told from an idle one; a
        stopped one (SIGSTOP, a debugger) can, and it serves nobody (a promoted trainer's
        attach waits on it): from the turn it is first seen stopped it has --hang-timeout to
        run again."""
        for slot in self.group.slots:
            sp = slot.procs.get(SlotRole.STATE_MANAGER)
            if sp is None or sp.done:
                continue
            if paused(sp.proc.pid):
                if sp.hang_deadline is None:
                    sp.expect(now, timeout, STOPPED)
            elif sp.awaiting == STOPPED:
                sp.hang_deadline = sp.awaiting = None     # it runs again

    def _state_manager_hung(self, slot: RankSlot, sp: SlotProcess, why: str) -> None:
        """Killed, not failed: its exit restarts it from the fds and metadata the agent kept
        (`StateManagers.on_exit`, within its crash limit); no trainer failed."""
        sp.hang_deadline = sp.awaiting = None             # judged once
        self.events.emit("hang_detected", sp.generation, rank=slot.rank,
                         local_rank=slot.local_rank, role=sp.role.value, pid=sp.proc.pid,
                         reason=why)
        self.log(f"state manager of slot {slot.local_rank} (pid {sp.proc.pid}) is hung: {why}; "
                 "killing it (it is restarted from the fds and metadata the agent kept)")
        sp.proc.send(signal.SIGKILL)

    def note_stall(self, took: float, planned: float) -> None:
        """Remember the longest time the agent was away beyond what it planned to wait (a stop,
        a starved machine: `stall_verdict`), until the next hang verdict (`after_stall`)."""
        stalled, why = stall_verdict(took, planned, self.cfg.recovery.hang_timeout)
        if stalled and (self.stall is None or took > self.stall[0]):
            self.stall = (took, planned, why)

    def after_stall(self, now: float, peers=None) -> None:
        """Before a hang verdict: if the agent was away, what it knows of heartbeats is stale
        (some may be lost), so every process -- and every peer agent (`PeerWatch`) -- gets a
        fresh window instead of a verdict."""
        if self.stall is None:
            return
        (took, planned, why), self.stall = self.stall, None
        n = self.grace(now)
        if peers is not None:
            peers.grace(now)
        self.events.emit("agent_stalled", self.group.generation, seconds=took, planned=planned,
                         processes=n, reason=why)
        self.log(f"warning: {why}")

    def grace(self, now: float) -> int:
        """Every process a sign of life is due from gets --hang-timeout from `now`: the agent
        itself was away (`decisions.stall_verdict`).  Returns how many."""
        timeout, n = self.cfg.recovery.hang_timeout, 0
        for slot in self.group.slots:
            for sp in slot.all():
                if not sp.done and sp.hang_deadline is not None:
                    sp.hang_deadline = max(sp.hang_deadline, now + timeout)
                    n += 1
                if sp.peers_past_since is not None:      # and no linger said on stale times
                    sp.peers_past_since = max(sp.peers_past_since, now)
        return n

    def check_lingering(self, now: float) -> None:
        """A rank that ended its loop, slow to exit once every rank of the node has ended its
        loop or exited (linger_verdict; ranks stuck in a collective teardown linger together):
        its Python stacks go to its log and the agent says so, once; it keeps waiting (a final
        save may be running; torchrun waits too)."""
        actives = [(s, s.active) for s in self.group.slots if s.active is not None]
        for slot, sp in actives:
            if sp.done or not sp.finished or sp.linger_said:
                continue
            if all(o.done or o.finished for s, o in actives if s is not slot):
                sp.peers_past_since = sp.peers_past_since or now
            slow, why = linger_verdict(now, sp.finished_at, sp.peers_past_since, self.cfg.recovery.hang_timeout)
            if not slow:
                continue
            sp.linger_said = True
            sp.proc.send(C.DUMP_SIGNAL)
            self.events.emit("exit_lingering", sp.generation, rank=slot.rank, role=sp.role.value,
                             pid=sp.proc.pid, step=sp.step, reason=why)
            self.log(f"rank {slot.rank} ({sp.role.value}, pid {sp.proc.pid}) {why}: its Python "
                     "stacks were dumped to its stderr log; still waiting for it to exit (a "
                     "final save may be running); if it is stuck, stop the job (Ctrl-C)")

    def fire_timers(self, now: float) -> None:
        g = self.group
        due = [t for t in g.timers if t[0] <= now]
        g.timers = [t for t in g.timers if t[0] > now]
        for _, kind, spec in due:
            if kind != "inject":
                continue
            slot = next(s for s in g.slots if s.rank == spec.rank)
            if spec.kind == InjectKind.PAGES:
                if g.sms:
                    self.ledger.fired(spec.text)
                    g.sms.fire_pages(slot, spec, g.generation)
                else:
                    self.log(f"cannot inject '{spec.text}': page faults need the memory pool "
                             "(--recovery inplace)")
                continue
            sp = slot.procs.get(SlotRole(spec.role))
            if sp is None or sp.done:
                continue
            sig = spec.signal
            if spec.kind == InjectKind.HANG:
                # With the runtime, its hang handler blocks the main thread in Python (a real
                # hang whose stack can be dumped); a plain script is frozen with SIGSTOP.
                sig = C.HANG_SIGNAL if sp.beats > 0 else signal.SIGSTOP
            self.events.emit("inject", sp.generation, rank=slot.rank, role=sp.role.value,
                             pid=sp.proc.pid, spec=spec.text, signal=sig, by="agent",
                             after_s=spec.after_s)
            self.log(f"injecting '{spec.text}' into rank {slot.rank} (pid {sp.proc.pid})")
            sp.injected = spec.text
            self.ledger.fired(spec.text)
            sp.proc.send(sig)
            timeout = self.cfg.recovery.hang_timeout
            if sig == signal.SIGSTOP and sp.hang_deadline is None:
                # Frozen before its first heartbeat (or a script that never beats): this agent
                # knows it hangs, so its hang clock starts now -- it must not wait forever.
                sp.expect(time.monotonic(), timeout, "frozen by the injection (SIGSTOP), silent")


RESERVED = frozenset({"event", "mono", "wall", "node", "generation", "rank", "local_rank",
                      "role", "pid"})


def emit_phase(events, slot: RankSlot, sp: SlotProcess, beat) -> None:
    """Datagram `phase` -> event `phase`, in every recovery mode (a restart-mode trainer's
    checkpoint writes and loads are reported as an in-place one's); the trainer's fields that
    would shadow the event's own are renamed detail_<name>."""
    try:
        detail = json.loads(beat.detail or "{}")
    except ValueError:
        detail = None
    if not isinstance(detail, dict):
        return
    fields = {(f"detail_{k}" if k in RESERVED else k): v for k, v in detail.items()}
    events.emit("phase", sp.generation, rank=slot.rank, pid=beat.pid, mono=beat.mono, **fields)
