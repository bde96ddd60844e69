"""The worker group: the processes of this node's ranks and the generation they train in.

Role: the one owner of what the recovery policies change (docs/ARCHITECTURE.md, "The control
loop").  `WorkerGroup` holds the rank slots, the generation (absolute; `relative(gen)` counts
from the start of the current restart attempt, as injections and error files do), the
failures of the current generation, the state-manager revokes waiting for the next decision,
the injection timers of the generation, and the processes that outlived a bounded wait
(`leftovers`, stopped at the end).  Its verbs:

- `start(round, restart_count)`: a new restart attempt (a new rendezvous round): the next
  generation, fresh slots, every active spawned;
- `spawn(slot, role, generation, epoch)`: one trainer (an active, or a shadow of `generation`);
- `advance(gen, reason)` then `arm(now)`: the group trains in generation `gen` now (a restart
  or a promotion: failures cleared, time-triggered injections of `gen` armed from `now`);
- `reap(slot, sp)`: a process's pidfd fired; `kill_and_reap(victims, why)`: SIGKILL and a
  bounded wait; `stop(reason)`: SIGTERM, grace, SIGKILL for the whole group.  Each exit is
  recorded once (one `exit` event per process, whichever of these saw it);
- `wait(predicate, deadline)`: run the agent's selector (`pump`, which dispatches what it
  reports to the handlers, the same ones the control loop uses) until `predicate()` holds.

Calling contract: the agent's main thread only (spawn's parent-death rule).  The group decides
nothing: the policies (`leto_run.restart`, `leto_run.inplace`) and the agent's pure decisions
(`leto_run.decisions`) do, through these verbs.
"""
from __future__ import annotations

import dataclasses

import os
import selectors
import signal
import time
from dataclasses import dataclass
from typing import Callable

from leto_run.inject import timed_for_generation, trainer_plan
from leto_run.procs import device_strays, exited, kill_pids, spawn
from leto_run.slot import ProcState, RankSlot, SlotProcess, SlotRole, console_label
from leto_run.stopper import stop_processes
from leto_run.config_checkpoint import worker_env as checkpoint_worker_env
from leto_run.worker_env import WorkerEnvSpec, build_worker_env, job_token_kv
from leto_runtime.wire import contract as C


@dataclass(frozen=True)
class WorkerSpec:
    """What every trainer of this job is started with, fixed for the job."""

    cfg: object                  # leto_run.config.JobConfig
    argv: tuple[str, ...]
    run_id: str
    run_dir: str
    node: str
    token: str
    heartbeat_socket: str
    job_key_hex: str             # "" unless in-place mode has a job key
    escalate_fd: int             # a second signal during a stop escalates to SIGKILL


@dataclass
class GroupIO:
    """The agent's services the group writes to (it owns none of them)."""

    sel: selectors.BaseSelector
    events: object               # leto_run.events.EventLog
    pump: object                 # leto_run.logs.OutputPump
    layout: object               # leto_run.logs.LogLayout
    guardian: object             # leto_run.guardian.Guardian
    status: object               # leto_run.status.StatusView
    ledger: object               # leto_run.unfired.InjectLedger
    log: Callable[[str], None]
    sms: object = None           # leto_run.state_managers.StateManagers (in-place mode)
    notices: object = None       # leto_run.exit_notice.ExitNotices
    launcher: object = None      # leto_run.fork_server.client.Launcher (None: procs.spawn)


class WorkerGroup:
    def __init__(self, spec: WorkerSpec, io: GroupIO):
        self.spec, self.io = spec, io
        self.cfg = spec.cfg
        self.events, self.log, self.sms = io.events, io.log, io.sms
        self.generation = -1
        self.attempt_base_gen = 0            # generation at which the current attempt started
        self.restart_count = 0
        self.round = None                    # leto_run.rendezvous.RoundResult of the attempt
        self.slots: list[RankSlot] = []
        self.failures: list = []             # FailureRecords of the current generation
        self.timers: list[tuple[float, str, object]] = []
        self.pending_revokes: list[tuple[int, int]] = []
        self.leftovers: list[tuple[RankSlot, SlotProcess]] = []
        self.worker_pipes: set[int] = set()
        self.started = 0.0
        self.checkpoint_load: str | None = None   # a fallback's checkpoint (leto_run.fallback)
        # Runs the agent's selector once (at most `timeout` s) and dispatches what it reports.
        self.pump_once: Callable[[float], None] = lambda timeout: None

    # ---- generations ---------------------------------------------------------------------
    def relative(self, gen: int | None = None) -> int:
        """`gen` (default: the current one) counted from the start of the restart attempt."""
        return (self.generation if gen is None else gen) - self.attempt_base_gen

    def start(self, rnd, restart_count: int) -> None:
        """A new restart attempt in rendezvous round `rnd`, in the generation `begin_attempt`
        opened: every active spawned (state managers first, in in-place mode), injections
        armed."""
        self.restart_count, self.round = restart_count, rnd
        self.slots = [RankSlot(identity=ident) for ident in rnd.identities]
        if self.sms:
            for slot in self.slots:
                self.sms.ensure(slot, self.generation, restart_count)
        for slot in self.slots:
            self.spawn(slot, SlotRole.ACTIVE)
        self.started = time.monotonic()
        self.arm(self.started)

    def begin_attempt(self, reason: str) -> int:
        """The next generation starts a new restart attempt (before its rendezvous)."""
        self.attempt_base_gen = self.generation + 1
        self.advance(self.generation + 1, reason)
        return self.generation

    def advance(self, gen: int, reason: str) -> None:
        """The group trains in generation `gen` from now on (a restart or a promotion): the
        failures of the old one are settled."""
        if gen != self.generation and self.generation >= 0:
            self.log(f"generation {self.generation} -> {gen}: {reason}")
        self.generation = gen
        self.failures.clear()

    def arm(self, now: float) -> None:
        """Every slot runs the current generation from `now`: its time-triggered injections are
        armed from then (those of the old generation that did not fire are dropped)."""
        ranks = {s.rank for s in self.slots}
        for slot in self.slots:
            self.io.ledger.ran(slot.rank, self.restart_count, self.relative())
        self.timers = [(now + spec.after_s, "inject", spec) for spec in timed_for_generation(
            self.cfg.inject, ranks, self.restart_count, self.relative())]
        self.io.status.set_group(self.slots, self.generation, self.restart_count)

    # ---- processes -----------------------------------------------------------------------
    def spawn(self, slot: RankSlot, role: SlotRole, generation: int | None = None,
              epoch: int = 0, level: str | None = None,
              warmup_room: int | None = None) -> SlotProcess:
        """Start the slot's trainer in `role` (a shadow: of `generation`, shadow `epoch`, at
        preinit `level`, its warm-up allowed `warmup_room` bytes)."""
        gen = self.generation if generation is None else generation
        es = dataclasses.replace(self._env_spec(slot, role, gen, epoch), preinit_level=level,
                                 warmup_room=warmup_room)
        env = build_worker_env(os.environ, es)
        notices = self.io.notices
        notice = notices.page() if notices is not None else None
        fence = notices.fence() if notice is not None else None
        passed = ()
        if notice is not None:
            env[C.LETO_EXIT_NOTICE_FD] = str(notice[0])
            passed = (notice[0],)
        if fence is not None:
            env[C.LETO_EXIT_FENCE_FD] = str(fence[1])
            passed += (fence[1],)
        out_r = out_w = err_r = err_w = None
        try:
            out_r, out_w = os.pipe()
            err_r, err_w = os.pipe()
            start = self.io.launcher.spawn if self.io.launcher is not None else spawn
            proc = start(list(self.spec.argv), env, stdout=out_w, stderr=err_w,
                         pass_fds=passed)
        except BaseException:
            if notice is not None:
                notice[1].close()
            for fd in (out_r, err_r, fence[0] if fence else None):
                if fd is not None:
                    os.close(fd)
            raise
        finally:
            for fd in (out_w, err_w, *passed):
                if fd is not None:
                    os.close(fd)        # the child's now: the fence's EOF must be its alone
        if notice is not None:
            notices.watch(proc.pid, notice[1])
        if fence is not None:
            proc.fence_fd = fence[0]
        self.io.guardian.announce(proc.pid)
        ident = slot.identity
        if self.sms:
            self.sms.allow(ident.local_rank, proc.pid)
        prefix = console_label(ident.global_rank, role, gen)
        self.worker_pipes.update((out_r, err_r))
        layout = self.io.layout
        pipes = tuple(self.io.pump.add(fd, layout.plan(self.restart_count, ident.local_rank,
                                                       stream),
                                       prefix, stream, prefix_file=role == SlotRole.SHADOW)
                      for fd, stream in ((out_r, "stdout"), (err_r, "stderr")))
        sp = SlotProcess(role=role, generation=gen, attempt=self.restart_count, proc=proc,
                         error_file=es.error_file, epoch=epoch, pipes=pipes,
                         level=level or "L3")
        slot.procs[role] = sp
        self.io.sel.register(proc.pidfd, selectors.EVENT_READ, (slot, sp))
        if proc.fence_fd is not None:
            self.io.sel.register(proc.fence_fd, selectors.EVENT_READ, ("fence", slot, sp))
        self.events.emit("spawn", gen, rank=ident.global_rank, local_rank=ident.local_rank,
                         role=role.value, pid=proc.pid, mono=proc.started_mono,
                         restart_count=self.restart_count, epoch=epoch,
                         forked=proc.gate_fd is not None, **({"level": level} if level else {}))
        proc.release()              # recorded everywhere: a forked worker's code may run now
        return sp

    def _env_spec(self, slot: RankSlot, role: SlotRole, gen: int, epoch: int) -> WorkerEnvSpec:
        cfg, r, s, ident = self.cfg, self.round, self.spec, slot.identity
        err_file = self.io.layout.error_file(self.restart_count, ident.local_rank,
                                             self.relative(gen))
        # Absolute generations: the runtime fires a spec when its `gen` equals its own.
        plan = tuple({**p, "gen": p["gen"] + self.attempt_base_gen} for p in
                     trainer_plan(cfg.inject, ident.global_rank, self.restart_count))
        rc = cfg.recovery
        return WorkerEnvSpec(
            identity=ident, master_addr=r.master_addr, master_port=r.master_port,
            restart_count=self.restart_count, max_restarts=cfg.launch.max_restarts,
            run_id=s.run_id, use_agent_store=r.use_agent_store, error_file=err_file,
            signals_to_handle=",".join(cfg.launch.signals_to_handle),
            slot_role=role.value, generation=gen, run_dir=s.run_dir,
            heartbeat_socket=s.heartbeat_socket, hang_timeout=rc.hang_timeout,
            recovery=rc.mode, node=s.node, job_token=s.token, dump_signal=C.DUMP_SIGNAL,
            inject_plan=plan, sm_socket=self.sms.socket(ident.local_rank) if self.sms else None,
            shadow_epoch=epoch, pg_timeout=rc.pg_timeout, chunk_pages=rc.chunk_pages,
            demote=rc.demote, scrub_budget=rc.scrub_budget, job_key=s.job_key_hex,
            checkpoint_env=checkpoint_worker_env(cfg.checkpoint, self.checkpoint_load))

    def relabel(self, slot: RankSlot, sp: SlotProcess) -> None:
        """`sp` has a new role or generation (promotion, in-process demotion): its console
        lines say so from now on."""
        for stream in sp.pipes:
            self.io.pump.relabel(stream, console_label(slot.rank, sp.role, sp.generation))

    def known_pids(self) -> set[int]:
        return ({sp.proc.pid for s in self.slots for sp in s.all() if sp.proc.status is None}
                | {sp.proc.pid for _, sp in self.leftovers if sp.proc.status is None}
                | self.service_pids())

    def service_pids(self) -> set[int]:
        """The agent's long-lived children that are no workers: state managers, fork server,
        guardian (a fork of the agent: its environ may carry the job token)."""
        return ((self.sms.pids() if self.sms else set())
                | (self.io.launcher.pids() if self.io.launcher is not None else set())
                | ({self.io.guardian.pid} if getattr(self.io.guardian, "pid", None) else set()))

    # ---- exits ---------------------------------------------------------------------------
    def recorded_exit(self, slot: RankSlot, sp: SlotProcess, **note) -> None:
        """The one `exit` event of `sp` (later calls for the same process add nothing)."""
        if sp.exit_recorded:
            return
        sp.exit_recorded = True
        st = sp.proc.status
        self.events.emit("exit", sp.generation, rank=slot.rank, local_rank=slot.local_rank,
                         role=sp.role.value, pid=sp.proc.pid,
                         exitcode=None if st is None else st.exitcode,
                         how="unknown" if st is None else st.describe(),
                         mono=None if st is None else st.mono, step=sp.step,
                         **{**sp.exit_note, **note})

    def reap(self, slot: RankSlot, sp: SlotProcess):
        """`sp`'s pidfd fired: reap it (None if it has not exited after all), record its exit,
        queue its state-manager revoke.  What the exit means is the caller's to judge."""
        if sp.proc.status is not None:       # reaped already (by another handler this turn)
            return None
        fd = sp.proc.pidfd
        status = sp.proc.poll_exit()
        if status is None:
            return None
        self._forget(fd)                     # its fence, if any, is watched until its verdict
        if self.io.notices is not None:
            self.io.notices.forget(sp.proc.pid)
        if self.sms:
            # Revoked after the decision (`flush_revokes`): a dead pid cannot connect, and the
            # file write has no place between a death and the survivors' SIGTERM.
            self.pending_revokes.append((slot.local_rank, sp.proc.pid))
        self.recorded_exit(slot, sp)
        return status

    def kill_and_reap(self, victims: list[tuple[RankSlot, SlotProcess]], why: str,
                      timeout: float) -> list[SlotProcess]:
        """SIGKILL each victim's process group (and the descendants it had), wait for their
        exits (at most `timeout` s, pumping the selector), and record each as STOPPED.  Their
        exit events say `why` (e.g. "collateral"): true for a process that was still running
        in its role, false for one already judged (a hang the agent killed).  Returns the
        stragglers (kept in `leftovers`, stopped at the end)."""
        for slot, sp in victims:
            sp.exit_note = {why: not sp.done}
            if not sp.done:
                sp.move(ProcState.STOPPING)
            if sp.proc.status is not None:
                continue        # reaped (waited for its fence): its pid may be another's now
            kids = sp.proc.snapshot_descendants()
            sp.proc.send_group(signal.SIGKILL)       # its group may outlive it
            kill_pids(kids)
        self.wait(lambda: all(sp.proc.quiet for _, sp in victims), time.monotonic() + timeout)
        left = []
        for slot, sp in victims:
            if sp.state == ProcState.STOPPING:
                sp.move(ProcState.STOPPED)
            if not sp.proc.quiet:
                self.recorded_exit(slot, sp)
                if self.sms:
                    self.pending_revokes.append((slot.local_rank, sp.proc.pid))
                self.log(f"pid {sp.proc.pid} did not exit within {timeout:g} s of SIGKILL; "
                         "the end of the job stops it")
                self.leftovers.append((slot, sp))
                left.append(sp)
        return left

    def stop_device_strays(self, prefix: str, timeout: float) -> tuple[list[int], list[int]]:
        """SIGKILL the orphans holding a device file (`procs.device_strays`: not a process
        this group started, nor the guardian) and wait, pumping the selector, at most `timeout`
        s until each exited.  (found, still running).  They are our children (reparented), so
        their pids cannot be reused before we reap them."""
        known = self.known_pids()
        found = device_strays(known, prefix)
        if found:
            kill_pids(found)
            self.wait(lambda: all(exited(p) for p in found), time.monotonic() + timeout)
        return found, [p for p in found if not exited(p)]

    def stop(self, reason: str, first_signal: int = signal.SIGTERM) -> None:
        """Stop every trainer of the group and every leftover (SIGTERM, grace, SIGKILL; a
        second signal escalates); state managers live on."""
        live = [(slot, sp) for slot in self.slots for sp in slot.all()
                if sp.proc.alive and sp.role != SlotRole.STATE_MANAGER]
        seen = {id(sp) for _, sp in live}
        live += [(slot, sp) for slot, sp in self.leftovers
                 if sp.proc.alive and id(sp) not in seen]
        self.leftovers.clear()
        if not live:
            self.drain_output()
            return
        self.events.emit("stop", self.generation, reason=reason,
                         pids=[sp.proc.pid for _, sp in live])
        for _, sp in live:
            sp.exit_note = {"stopped": True}
            if not sp.done:
                sp.move(ProcState.STOPPING)
            self._forget(sp.proc.pidfd)          # stop_processes reaps and closes it
            self.forget_fence(sp)
        stop_processes([sp.proc for _, sp in live], grace=self.cfg.launch.shutdown_timeout,
                       first_signal=first_signal, token_kv=job_token_kv(self.spec.token),
                       escalate_fd=self.spec.escalate_fd, log=self.log,
                       spare=frozenset(self.service_pids()))
        for slot, sp in live:
            self.recorded_exit(slot, sp)
            st = sp.proc.status
            if sp.state == ProcState.STOPPING:
                sp.move(ProcState.SUCCEEDED if st is not None and st.ok else ProcState.STOPPED)
        self.drain_output()
        self.flush_revokes()
        self.io.status.changed()
        self.io.status.refresh(force=True)

    def _forget(self, fd: int) -> None:
        try:
            self.io.sel.unregister(fd)
        except (KeyError, ValueError):
            pass

    def forget_fence(self, sp: SlotProcess) -> None:
        """Stop watching `sp`'s exit fence and close it (its verdict, if any, stays)."""
        fd, sp.proc.fence_fd = sp.proc.fence_fd, None
        if fd is not None:
            self._forget(fd)
            os.close(fd)

    def flush_revokes(self) -> None:
        while self.pending_revokes and self.sms:
            self.sms.revoke(*self.pending_revokes.pop())

    def drain_output(self) -> None:
        """Wait (bounded) until the stopped workers' last output is written out, so the
        root-cause box and the next generation's lines come after it.  State managers'
        pipes stay open across restarts and are not waited for."""
        self.io.pump.wait_drained(timeout=5.0, fds=set(self.worker_pipes))
        self.worker_pipes.clear()

    # ---- waiting -------------------------------------------------------------------------
    def wait(self, predicate: Callable[[], bool], deadline: float) -> bool:
        """Run the agent's selector (every handler included) until `predicate()` holds or
        `deadline` (monotonic) passes; returns `predicate()`."""
        while not predicate():
            left = deadline - time.monotonic()
            if left <= 0:
                # What queued while the agent did not run (a stop of it: an interrupted select
                # reports nothing once its time is up) is read before the wait fails.
                self.pump_once(0.0)
                return predicate()
            self.pump_once(left)
        return True
