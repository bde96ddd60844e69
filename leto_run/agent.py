"""The agent: one per node, parent and child-subreaper of every process of the job.

One control loop (`Agent.run`): rendezvous -> start the group -> supervise -> decide -> stop /
restart / finish.  In in-place mode a HOF is recovered inside `_supervise` without leaving it
(`leto_run.inplace`: shadows, promotion, demotion); only the fallback restarts the group.  Supervision is event driven: the loop sleeps in one selector on the pidfds of
its children (exit seen within ~1 ms), the heartbeat socket, and the signal wakeup fd; the
selector's timeout is the next deadline (hang, injection, status refresh, peer check).

Contract: `run_job(cfg) -> exit code` (codes in `leto_run.errors`).  It always stops every
worker and descendant before it returns, whatever happened.
"""
from __future__ import annotations

import os
import secrets
import selectors
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time

from torch.distributed.elastic.utils import store as store_util

from leto_run import errors as E
from leto_run.config import JobConfig, signal_number
from leto_run.decisions import Action, Decision, blame_hangs, decide_group, hang_verdict
from leto_run.events import EventLog
from leto_run.failures import FailureRecord, failure_from_exit, format_root_cause
from leto_run.guardian import start_guardian
from leto_run.heartbeat import HeartbeatServer
from leto_run.inject import InjectKind, timed_for_generation, trainer_plan
from leto_run.inplace import InplaceRecovery
from leto_run.logs import LogLayout, OutputPump
from leto_run.procs import become_subreaper, reap_orphans, spawn
from leto_run.rendezvous import RoundResult, make_handler, next_round
from leto_run.report import format_report
from leto_run.slot import ProcState, RankSlot, SlotProcess, SlotRole
from leto_run.state_managers import StateManagers
from leto_run.status import StatusView
from leto_run.stopper import stop_processes
from leto_run.worker_cmd import resolve_nproc, worker_argv
from leto_run.worker_env import (WorkerEnvSpec, build_worker_env, default_omp_threads,
                                 job_token_kv)
from leto_runtime import contract as C

_SHUTDOWN_SIGNALS = {signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT}


def run_job(cfg: JobConfig) -> int:
    agent = Agent(cfg)
    try:
        return agent.run()
    finally:
        agent.close()


class Agent:
    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
        self.host = socket.getfqdn()
        self.node = cfg.rendezvous.local_addr or self.host
        self.token = secrets.token_hex(12)
        # Forked first: no threads exist yet (fork safety), and it must outlive a kill -9 of us.
        self.guardian = start_guardian(job_token_kv(self.token))
        become_subreaper()
        self.console_lock = threading.Lock()
        self.nproc = resolve_nproc(cfg.launch.nproc_per_node)
        omp_warning = default_omp_threads(os.environ, self.nproc)
        self.run_dir = tempfile.mkdtemp(prefix="leto-")          # 0700 by construction
        self.hb = HeartbeatServer(os.path.join(self.run_dir, "hb.sock"))
        self.handler, self.master_addr, self.master_port = make_handler(cfg)
        self.run_id = self.handler.get_run_id()
        lg = cfg.logs
        self.layout = LogLayout(lg.log_dir, self.run_id, lg.redirects, lg.tee,
                                lg.local_ranks_filter)
        self.events = EventLog(lg.events or os.path.join(self.layout.root, "events.jsonl"),
                               self.node)
        self.pump = OutputPump(self.console_lock)
        self.status = StatusView(lg.status, self.console_lock)
        self.sel = selectors.DefaultSelector()
        self.sel.register(self.hb.fileno(), selectors.EVENT_READ, "hb")
        self._sig_r, self._sig_w = os.pipe()
        os.set_blocking(self._sig_r, False)
        os.set_blocking(self._sig_w, False)
        self.sel.register(self._sig_r, selectors.EVENT_READ, "sig")
        self._install_signals()
        self.generation = -1
        self.restart_count = 0
        self.remaining = cfg.launch.max_restarts
        self.slots: list[RankSlot] = []
        self.round: RoundResult | None = None
        self.failures: list[FailureRecord] = []
        self.group_started = 0.0
        self.timers: list[tuple[float, str, object]] = []
        self.next_peer_check = 0.0
        self.catch_up_step: int | None = None     # the step a failed generation had reached
        # In-place mode: one state manager per local rank, outliving restarts (DESIGN.md §2).
        self.sms = (StateManagers(run_dir=self.run_dir, token=self.token,
                                  log_root=self.layout.root, guardian=self.guardian,
                                  pump=self.pump, events=self.events, sel=self.sel,
                                  log=self.log, shutdown_timeout=cfg.launch.shutdown_timeout,
                                  escalate_fd=self._sig_r, geometry=cfg.recovery.geometry)
                    if cfg.recovery.mode == "inplace" else None)
        self.worker_pipes: set[int] = set()
        self.pending_revokes: list[tuple[int, int]] = []
        self.resumed_gens: set[int] = set()
        self.resuming: dict[int, set[int]] = {}   # generation -> local ranks that beat a step
        self.leftovers: list = []             # Procs that outlived a bounded wait: stopped at the end
        self.attempt_base_gen = 0             # generation at which the current attempt started
        self.inplace = InplaceRecovery(self) if cfg.recovery.mode == "inplace" else None
        self._closed = False
        if omp_warning:
            self.log("\n*****************************************\n" + omp_warning +
                     "\n*****************************************")

    # ---- logging -------------------------------------------------------------------------
    def log(self, msg: str) -> None:
        gen = max(self.generation, 0)
        with self.console_lock:
            sys.stderr.write(f"[leto-run agent node={self.node} gen={gen}] {msg}\n")
            sys.stderr.flush()

    def _install_signals(self) -> None:
        names = self.cfg.launch.signals_to_handle
        self.handled = {signal_number(n) for n in names}
        signal.set_wakeup_fd(self._sig_w, warn_on_full_buffer=False)
        for s in self.handled | {signal.SIGCHLD}:
            # A Python-level handler that does nothing: the wakeup fd carries the signal
            # number into the selector, so the loop handles it in order with everything else.
            signal.signal(s, lambda *_: None)

    # ---- the control loop ----------------------------------------------------------------
    def run(self) -> int:
        try:
            return self._run()
        finally:
            if self.sms:
                self.sms.stop()
            report = format_report(self.events.records)
            if report:
                with self.console_lock:
                    sys.stderr.write(report + "\n")
                    sys.stderr.flush()

    def _run(self) -> int:
        la = self.cfg.launch
        self.events.emit("job_start", 0, run_id=self.run_id, nproc_per_node=self.nproc,
                         log_root=self.layout.root, argv=worker_argv(self.cfg),
                         max_restarts=la.max_restarts, recovery=self.cfg.recovery.mode)
        self.log(f"run_id={self.run_id} nproc_per_node={self.nproc} "
                 f"rdzv={self.cfg.rendezvous.backend} max_restarts={la.max_restarts} "
                 f"hang_timeout={self.cfg.recovery.hang_timeout:g}s logs={self.layout.root}")
        try:
            while True:
                self._start_group()
                decision = self._supervise()
                self.log(f"decision: {decision.action.value}: {decision.reason}")
                self.events.emit("decision", self.generation, action=decision.action.value,
                                 reason=decision.reason)
                if decision.action == Action.UNRECOVERABLE:
                    return self._unrecoverable(decision)
                if decision.action == Action.SUCCEED:
                    self._stop_group("success")
                    self._exit_barrier()
                    self.events.emit("job_end", self.generation, exit_code=E.EXIT_OK)
                    return E.EXIT_OK
                self._stop_group(decision.reason)
                if decision.action == Action.RESTART:
                    if decision.counts_as_restart:
                        self.remaining -= 1
                        self.restart_count += 1
                    self.events.emit("restart", self.generation, reason=decision.reason,
                                     restart_count=self.restart_count)
                    continue
                code = (E.EXIT_RESTARTS_EXHAUSTED if la.max_restarts > 0
                        else E.EXIT_WORKER_FAILED)
                self._print_root_cause()
                self.events.emit("job_end", self.generation, exit_code=code,
                                 reason=decision.reason)
                return code
        except E.StoppedBySignal as e:
            self._stop_group(f"leto-run received {signal.Signals(e.signum).name}",
                             first_signal=e.signum)
            self.events.emit("job_end", self.generation, exit_code=e.exit_code,
                             reason=str(e))
            self.log(f"stopped by {signal.Signals(e.signum).name}; every worker stopped")
            return e.exit_code
        except E.RendezvousFailed as e:
            self._stop_group(str(e))
            self.log(f"error: {e}")
            self.events.emit("job_end", self.generation, exit_code=e.exit_code, reason=str(e))
            return e.exit_code

    def _unrecoverable(self, decision: Decision) -> int:
        self._stop_group(decision.reason)
        self._print_root_cause()
        self.log("error: the retained state cannot be recovered in place; the job ends "
                 f"(checkpoint fallback is not implemented yet): {decision.reason}")
        self.events.emit("job_end", self.generation, exit_code=E.EXIT_UNRECOVERABLE,
                         reason=decision.reason)
        return E.EXIT_UNRECOVERABLE

    def _start_group(self) -> None:
        self.generation += 1
        self.attempt_base_gen = self.generation
        self.failures.clear()
        if self.inplace:
            self.inplace.new_round()
        t0 = time.monotonic()
        self.round = None          # drops the previous round's worker store server
        self.round = next_round(self.handler, round_no=self.generation,
                                restart_count=self.restart_count, role=self.cfg.launch.role, local_world_size=self.nproc,
                                master_addr=self.master_addr, master_port=self.master_port)
        r = self.round
        self.events.emit("rendezvous", self.generation, seconds=time.monotonic() - t0,
                         group_rank=r.group_rank, group_world_size=r.group_world_size,
                         master_addr=r.master_addr, master_port=r.master_port,
                         restart_count=self.restart_count)
        self.slots = [RankSlot(identity=ident) for ident in r.identities]
        if self.sms:
            for slot in self.slots:
                self.sms.ensure(slot, self.generation, self.restart_count)
        for slot in self.slots:
            self._spawn(slot, SlotRole.ACTIVE)
        self.group_started = time.monotonic()
        self.timers = [(self.group_started + spec.after_s, "inject", spec) for spec in
                       timed_for_generation(self.cfg.inject, {s.rank for s in self.slots},
                                            self.restart_count, 0)]
        self.status.set_group(self.slots, self.generation, self.restart_count)

    def _spawn(self, slot: RankSlot, role: SlotRole, generation: int | None = None,
               epoch: int = 0) -> SlotProcess:
        """Start the slot's trainer in `role` (a shadow: of `generation`, shadow `epoch`)."""
        cfg, r = self.cfg, self.round
        ident = slot.identity
        gen = self.generation if generation is None else generation
        err_file = self.layout.error_file(self.restart_count, ident.local_rank,
                                          gen - self.attempt_base_gen)
        # Absolute generations: the runtime fires a spec when its `gen` equals its own.
        plan = tuple({**p, "gen": p["gen"] + self.attempt_base_gen} for p in
                     trainer_plan(cfg.inject, ident.global_rank, self.restart_count))
        spec = WorkerEnvSpec(
            identity=ident, master_addr=r.master_addr, master_port=r.master_port,
            restart_count=self.restart_count, max_restarts=cfg.launch.max_restarts,
            run_id=self.run_id, use_agent_store=r.use_agent_store, error_file=err_file,
            signals_to_handle=",".join(cfg.launch.signals_to_handle),
            slot_role=role.value, generation=gen, run_dir=self.run_dir,
            heartbeat_socket=self.hb.path, hang_timeout=cfg.recovery.hang_timeout,
            recovery=cfg.recovery.mode, node=self.node, job_token=self.token,
            dump_signal=C.DUMP_SIGNAL, inject_plan=plan,
            sm_socket=self.sms.socket(ident.local_rank) if self.sms else None,
            shadow_epoch=epoch, pg_timeout=cfg.recovery.pg_timeout,
            chunk_pages=cfg.recovery.chunk_pages, demote=cfg.recovery.demote)
        env = build_worker_env(os.environ, spec)
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        try:
            proc = spawn(worker_argv(cfg), env, stdout=out_w, stderr=err_w)
        finally:
            os.close(out_w)
            os.close(err_w)
        self.guardian.announce(proc.pid)
        if self.sms:
            self.sms.allow(ident.local_rank, proc.pid)
        prefix = f"[r{ident.global_rank} {role.value} g{gen}]: "
        self.worker_pipes.update((out_r, err_r))
        for fd, stream in ((out_r, "stdout"), (err_r, "stderr")):
            self.pump.add(fd, self.layout.plan(self.restart_count, ident.local_rank, stream),
                          prefix, stream, prefix_file=role == SlotRole.SHADOW)
        sp = SlotProcess(role=role, generation=gen, attempt=self.restart_count,
                         proc=proc, error_file=err_file, epoch=epoch)
        slot.procs[role] = sp
        self.sel.register(proc.pidfd, selectors.EVENT_READ, (slot, sp))
        self.events.emit("spawn", gen, rank=ident.global_rank,
                         local_rank=ident.local_rank, role=role.value, pid=proc.pid,
                         mono=proc.started_mono, restart_count=self.restart_count, epoch=epoch)
        return sp

    def _supervise(self) -> Decision:
        la = self.cfg.launch
        multi_node = self.round.group_world_size > 1 or la.max_nodes > 1
        while True:
            now = time.monotonic()
            timeout = self._next_deadline(now, multi_node) - now
            for key, _ in self.sel.select(timeout=max(0.0, timeout)):
                if key.data == "hb":
                    self._on_beats()
                elif key.data == "sig":
                    self._on_signals()
                elif key.data == "hof":
                    self.inplace.on_wake()
                elif key.data[0] == "sm":
                    if self.sms.on_exit(key.data[1], key.data[2], self.slots,
                                        self.generation, self.restart_count):
                        self.status.changed()
                else:
                    slot, sp = key.data
                    self._on_exit(slot, sp)
            now = time.monotonic()
            self._check_hangs(now)
            self._fire_timers(now)
            reap_orphans(self._known_pids())
            nodes_waiting = 0
            if multi_node and now >= self.next_peer_check:
                self.next_peer_check = now + la.monitor_interval
                try:
                    nodes_waiting = self.handler.num_nodes_waiting()
                except Exception as e:  # store gone: a peer agent ended; its workers fail us
                    self.log(f"rendezvous store unreachable ({type(e).__name__}: {e})")
            self.status.refresh()
            failed = [f.rank for f in self.failures]
            inplace = self.inplace.recover(self.failures) if self.inplace else None
            if inplace and inplace.action == Action.UNRECOVERABLE:
                return inplace
            if inplace and inplace.action == Action.INPLACE:
                self._flush_revokes()
                continue                           # recovered: the next generation trains
            if inplace and self.inplace.remote is not None and not failed:
                failed = [self.inplace.remote_rank()]   # another node's HOF, no shadows here
            actives = [s.active for s in self.slots]
            decision = decide_group([a.state for a in actives], failed, self.remaining,
                                    la.max_restarts, nodes_waiting)
            if decision.action != Action.CONTINUE:
                if inplace and inplace.action == Action.FALL_BACK:
                    self.events.emit("inplace_fallback", self.generation, reason=inplace.reason)
                    self.log(f"no in-place recovery: {inplace.reason}")
                return decision
            self._flush_revokes()

    def _next_deadline(self, now: float, multi_node: bool) -> float:
        cands = [now + 1.0, self.status.next_refresh(now)]
        cands += [t for t, _, _ in self.timers]
        cands += [sp.hang_deadline for s in self.slots for sp in s.all()
                  if sp.hang_deadline is not None and not sp.done]
        if multi_node:
            cands.append(max(self.next_peer_check, now))
        return min(cands)

    def _known_pids(self) -> set[int]:
        return ({sp.proc.pid for s in self.slots for sp in s.all() if sp.proc.status is None}
                | {p.pid for p in self.leftovers if p.status is None}
                | (self.sms.pids() if self.sms else set()))

    # ---- event handlers ------------------------------------------------------------------
    def _on_exit(self, slot: RankSlot, sp: SlotProcess) -> None:
        fd = sp.proc.pidfd
        status = sp.proc.poll_exit()
        if status is None:
            return
        self.sel.unregister(fd)
        ident = slot.identity
        if self.sms:
            # Revoked after the decision (`_flush_revokes`): a dead pid cannot connect, and the
            # file write has no place between a death and the survivors' SIGTERM.
            self.pending_revokes.append((ident.local_rank, sp.proc.pid))
        self.events.emit("exit", sp.generation, rank=ident.global_rank,
                         local_rank=ident.local_rank, role=sp.role.value, pid=sp.proc.pid,
                         exitcode=status.exitcode, how=status.describe(), mono=status.mono,
                         step=sp.step)
        if sp.done:              # already judged (e.g. a hang we killed)
            return
        if sp.role == SlotRole.SHADOW and sp.state != ProcState.STOPPING:
            self.inplace.on_shadow_exit(slot, sp, status)
        elif not status.ok and self.inplace and self.inplace.collateral(sp):
            sp.move(ProcState.STOPPING)      # a survivor of a HOF recovered in place
            sp.move(ProcState.STOPPED)
        elif sp.state == ProcState.STOPPING:
            sp.move(ProcState.SUCCEEDED if status.ok else ProcState.STOPPED)
        elif status.ok:
            sp.move(ProcState.SUCCEEDED)
        else:
            sp.move(ProcState.FAILED)
            self._record_failure(slot, sp, status.exitcode, status.describe(), status.mono)
        self.status.changed()

    def _record_failure(self, slot: RankSlot, sp: SlotProcess, exitcode: int, how: str,
                        mono: float, note: str | None = None) -> None:
        ident = slot.identity
        # The error file is written before exit; give the output pump no say in ordering.
        rec = failure_from_exit(rank=ident.global_rank, local_rank=ident.local_rank,
                                role=sp.role.value, generation=sp.generation,
                                attempt=sp.attempt, pid=sp.proc.pid, exitcode=exitcode,
                                how=how, error_file=sp.error_file, wall=time.time(),
                                mono=mono, host=self.host, note=note)
        if not self.failures and sp.step is not None:
            self.catch_up_step = sp.step
        self.failures.append(rec)
        self.events.emit("failure_detected", sp.generation, rank=ident.global_rank,
                         local_rank=ident.local_rank, role=sp.role.value, pid=sp.proc.pid,
                         exitcode=exitcode, how=how, mono=mono,
                         latency_from_spawn=mono - sp.proc.started_mono, step=sp.step)
        self.log(f"rank {ident.global_rank} ({sp.role.value}, pid {sp.proc.pid}) failed: {how}")

    def _on_beats(self) -> None:
        by_pid = {sp.proc.pid: (slot, sp) for slot in self.slots for sp in slot.all()
                  if not sp.done}
        for beat in self.hb.drain(set(by_pid)):
            slot, sp = by_pid[beat.pid]
            if beat.kind in ("inplace", "promoted", "phase", "demoted"):
                if self.inplace:
                    self.inplace.on_datagram(slot, sp, beat)
                continue
            if sp.role == SlotRole.SHADOW and beat.kind != "inject":
                continue        # a waiting shadow is not supervised for hangs until promoted
            if beat.kind == "register":
                # Sent once when the runtime loads, possibly long before the training loop (a
                # shadow promoted while still importing): liveness starts with a real beat.
                continue
            if beat.kind == "inject":
                sp.step = beat.step if beat.step is not None else sp.step   # it is in that step
                self.events.emit("inject", sp.generation, rank=slot.rank, role=sp.role.value,
                                 pid=beat.pid, spec=beat.detail, step=beat.step, by="runtime")
                self.log(f"injecting '{beat.detail}' into rank {slot.rank} at step {beat.step}")
                continue
            if beat.kind == "bye":
                sp.hang_deadline = None          # finished its loop; exiting is not a hang
                continue
            sp.on_beat(beat.step, beat.mono, self.cfg.recovery.hang_timeout)
            sp.in_collective = beat.detail == "collective"   # waiting for peers from now on
            self.status.changed()
            if beat.step is None or sp.generation == 0:
                continue
            # Training has resumed once every local rank of the generation runs a step again
            # (they meet at the next collective): the slowest rank's recovery is the cost.
            seen = self.resuming.setdefault(sp.generation, set())
            seen.add(slot.rank)
            if sp.generation not in self.resumed_gens and len(seen) >= len(self.slots):
                self.resumed_gens.add(sp.generation)
                self.events.emit("resumed", sp.generation, rank=slot.rank, role=sp.role.value,
                                 step=beat.step, mono=beat.mono)
            if self.catch_up_step is not None and beat.step >= self.catch_up_step:
                self.events.emit("caught_up", sp.generation, rank=slot.rank, step=beat.step,
                                 mono=beat.mono)
                self.catch_up_step = None

    def _on_signals(self) -> None:
        try:
            data = os.read(self._sig_r, 512)
        except BlockingIOError:
            return
        for signum in data:
            if signum == signal.SIGCHLD:
                continue
            name = signal.Signals(signum).name
            self.events.emit("signal", self.generation, signal=name)
            if signum not in self.handled:
                continue
            if signum in _SHUTDOWN_SIGNALS:
                # The stop forwards it (to every process group) after recording descendants.
                self.log(f"received {name}: forwarding to every worker and stopping the job")
                raise E.StoppedBySignal(signum)
            self.log(f"received {name}: forwarding to every worker")
            for slot in self.slots:
                for sp in slot.all():
                    if not sp.done:
                        sp.proc.send_group(signum)

    def _check_hangs(self, now: float) -> None:
        timeout = self.cfg.recovery.hang_timeout
        silent = {}
        for slot in self.slots:
            for sp in slot.all():
                if sp.done or (self.inplace and self.inplace.collateral(sp)):
                    continue
                hung, why = hang_verdict(now, sp.hang_deadline, sp.last_beat, timeout)
                if hung:
                    silent[sp.proc.pid] = (slot, sp, why)
        moving = any(s.active is not None and not s.active.done
                     and s.active.proc.pid not in silent for s in self.slots)
        blamed, _ = blame_hangs({pid: v[1].in_collective for pid, v in silent.items()},
                                others_progressing=moving)
        for pid, (slot, sp, why) in silent.items():
            if pid not in blamed:
                continue             # waits in a collective for the rank blamed now
            self.events.emit("hang_detected", sp.generation, rank=slot.rank,
                             role=sp.role.value, pid=sp.proc.pid, step=sp.step, reason=why)
            self.log(f"rank {slot.rank} ({sp.role.value}, pid {sp.proc.pid}) hung at step "
                     f"{sp.step}: {why}; dumping its Python stacks, then killing it")
            sp.proc.send(C.DUMP_SIGNAL)
            # faulthandler writes from its C signal handler; a short pause lets the dump
            # reach the log before SIGKILL.
            time.sleep(0.3)
            self.events.emit("stack_dump", sp.generation, rank=slot.rank, role=sp.role.value,
                             pid=sp.proc.pid)
            sp.proc.send_group(signal.SIGKILL)
            sp.move(ProcState.FAILED)
            self._record_failure(slot, sp, -signal.SIGKILL, f"hang: {why}", now,
                                 note=f"hang detected: {why}; Python stacks were dumped "
                                      "to this rank's stderr")
            self.status.changed()

    def _fire_timers(self, now: float) -> None:
        due = [t for t in self.timers if t[0] <= now]
        self.timers = [t for t in self.timers if t[0] > now]
        for _, kind, spec in due:
            if kind != "inject":
                continue
            slot = next(s for s in self.slots if s.rank == spec.rank)
            if spec.kind == InjectKind.PAGES:
                if self.sms:
                    self.sms.fire_pages(slot, spec, self.generation)
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
            sp.proc.send(sig)

    # ---- stopping and finishing ----------------------------------------------------------
    def _stop_group(self, reason: str, first_signal: int = signal.SIGTERM) -> None:
        live = [(slot, sp) for slot in self.slots for sp in slot.all()
                if sp.proc.alive and sp.role != SlotRole.STATE_MANAGER]
        extra = [p for p in self.leftovers if p.alive]    # outlived a bounded wait earlier
        self.leftovers.clear()
        if not live and not extra:
            self._drain_output()
            return
        self.events.emit("stop", self.generation, reason=reason, pids=[sp.proc.pid for _, sp in live])
        for _, sp in live:
            if not sp.done:
                sp.move(ProcState.STOPPING)
            try:
                self.sel.unregister(sp.proc.pidfd)   # stop_processes reaps and closes it
            except (KeyError, ValueError):
                pass
        stop_processes([sp.proc for _, sp in live] + extra, grace=self.cfg.launch.shutdown_timeout,
                       first_signal=first_signal, token_kv=job_token_kv(self.token),
                       escalate_fd=self._sig_r, log=self.log,
                       spare=frozenset(self.sms.pids() if self.sms else ()))
        for slot, sp in live:
            self._on_exit_after_stop(slot, sp)
        self._drain_output()
        self._flush_revokes()
        self.status.changed()
        self.status.refresh(force=True)

    def _on_exit_after_stop(self, slot: RankSlot, sp: SlotProcess) -> None:
        st = sp.proc.status
        self.events.emit("exit", sp.generation, rank=slot.rank, local_rank=slot.local_rank,
                         role=sp.role.value, pid=sp.proc.pid,
                         exitcode=None if st is None else st.exitcode,
                         how="unknown" if st is None else st.describe(),
                         mono=None if st is None else st.mono, stopped=True)
        if sp.state == ProcState.STOPPING:
            sp.move(ProcState.SUCCEEDED if st is not None and st.ok else ProcState.STOPPED)

    def _flush_revokes(self) -> None:
        while self.pending_revokes and self.sms:
            self.sms.revoke(*self.pending_revokes.pop())

    def _drain_output(self) -> None:
        """Wait (bounded) until the stopped workers' last output is written out, so the
        root-cause box and the next generation's lines come after it.  State managers'
        pipes stay open across restarts and are not waited for."""
        self.pump.wait_drained(timeout=5.0, fds=set(self.worker_pipes))
        self.worker_pipes.clear()

    def _exit_barrier(self) -> None:
        r = self.round
        if r is None or r.group_world_size <= 1:
            return
        t0 = time.monotonic()
        try:
            store_util.barrier(store=r.store, world_size=r.group_world_size,
                               key_prefix=f"leto/exit_barrier/{self.generation}",
                               barrier_timeout=self.cfg.launch.exit_barrier_timeout)
        except Exception as e:
            self.log(f"exit barrier: {type(e).__name__}: {e}")
        self.events.emit("exit_barrier", self.generation, seconds=time.monotonic() - t0)

    def _print_root_cause(self) -> None:
        if not self.failures:
            return
        title = f"{worker_argv(self.cfg)[-1 - len(self.cfg.launch.script_args)]} FAILED"
        with self.console_lock:
            sys.stderr.write(format_root_cause(title, self.failures) + "\n")
            sys.stderr.flush()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self.status.stop()
        self.pump.close()
        self.hb.close()
        try:
            self.handler.shutdown()
        except Exception:
            pass
        signal.set_wakeup_fd(-1)
        if self.inplace:
            self.inplace.close()
        self.guardian.release()
        self.events.close()
        shutil.rmtree(self.run_dir, ignore_errors=True)
