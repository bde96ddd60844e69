"""The agent: one per node, parent and child-subreaper of every process of the job.

One control loop (`Agent.run`): rendezvous -> start the group -> supervise -> decide -> stop /
restart / finish.  In in-place mode a HOF is recovered inside `_supervise` without leaving it
(`leto_run.inplace`: shadows, promotion, demotion); only the fallback restarts the group.  Supervision is event driven: the loop sleeps in one selector on the pidfds of
its children (exit seen within ~1 ms), the heartbeat socket, and the signal wakeup fd; the
selector's timeout is the next deadline (hang, injection, status refresh, peer check).
The handlers of what the selector reports live in `leto_run.agent_events` (a mixin).

Every decision is logged and recorded (`decision` event, with the failure's classification
where the failure policy judged one: `decisions.classify_failure`); when in-place recovery was
not possible, the reason is part of it.  At the end, injections that never fired are reported
(`inject_unfired`, `leto_run.unfired`).

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
from leto_run import job_secret
from leto_run.config import JobConfig, signal_number
from leto_run.agent_events import AgentEvents
from leto_run.decisions import Action, Decision, decide_group
from leto_run.events import EventLog
from leto_run.failures import FailureRecord, format_root_cause
from leto_run.guardian import start_guardian
from leto_run.heartbeat import HeartbeatServer
from leto_run.inject import timed_for_generation, trainer_plan
from leto_run.inplace import InplaceRecovery
from leto_run.logs import LogLayout, OutputPump
from leto_run.procs import become_subreaper, reap_orphans, spawn
from leto_run.rendezvous import RoundResult, make_handler, next_round
from leto_run.report import format_report
from leto_run.slot import ProcState, RankSlot, SlotProcess, SlotRole, console_label
from leto_run.state_managers import StateManagers
from leto_run.status import StatusView
from leto_run.stopper import stop_processes
from leto_run.unfired import InjectLedger
from leto_run.worker_cmd import resolve_nproc, worker_argv
from leto_run.worker_env import (WorkerEnvSpec, build_worker_env, default_omp_threads,
                                 job_token_kv)
from leto_runtime.wire import contract as C
from leto_runtime.control_auth import ForgedControlKey, key_to_hex


def run_job(cfg: JobConfig) -> int:
    agent = Agent(cfg)
    try:
        return agent.run()
    finally:
        agent.close()


class Agent(AgentEvents):
    def __init__(self, cfg: JobConfig):
        self.cfg = cfg
        self.host = socket.getfqdn()
        self.node = cfg.rendezvous.local_addr or self.host
        self.token = secrets.token_hex(12)
        # Before anything starts: a missing or unsafe secret file is a ConfigError (exit 2).
        self.job_key = job_secret.job_key(cfg)
        # Forked first: no threads exist yet (fork safety), and it must outlive a kill -9 of us.
        self.guardian = start_guardian(job_token_kv(self.token))
        become_subreaper()
        self.console_lock = threading.Lock()
        self.nproc = resolve_nproc(cfg.launch.nproc_per_node)
        omp_warning = default_omp_threads(os.environ, self.nproc)
        self.run_dir = tempfile.mkdtemp(prefix="leto-")          # 0700 by construction
        self.guardian.own_dir(self.run_dir)          # removed by the guardian after a kill -9 of us
        self.hb = HeartbeatServer(os.path.join(self.run_dir, "hb.sock"))
        self.handler, self.master_addr, self.master_port = make_handler(cfg, self.job_key)
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
        self.catch_up: tuple[int, int] | None = None  # (failed generation, the step it reached)
        # In-place mode: one state manager per local rank, outliving restarts (docs/MEMORY.md).
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
        self.ledger = InjectLedger()          # which injections fired (`inject_unfired`)
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
                cls = decision.classification
                self.events.emit("decision", self.generation, action=decision.action.value,
                                 reason=decision.reason, **(cls.fields() if cls else {}))
                if decision.action == Action.UNRECOVERABLE:
                    return self._unrecoverable(decision.reason)
                if decision.action == Action.SUCCEED:
                    self._stop_group("success")
                    self._exit_barrier()
                    return self._end(E.EXIT_OK)
                if decision.action == Action.RESTART and self.inplace and self.failures:
                    self.inplace.note_restart(self.failures)
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
                return self._end(code, decision.reason)
        except E.StoppedBySignal as e:
            self._stop_group(f"leto-run received {signal.Signals(e.signum).name}",
                             first_signal=e.signum)
            self.log(f"stopped by {signal.Signals(e.signum).name}; every worker stopped")
            return self._end(e.exit_code, str(e))
        except E.Unrecoverable as e:          # raised before a restart could start the group
            self.log(f"decision: {Action.UNRECOVERABLE.value}: {e}")
            self.events.emit("decision", self.generation, action=Action.UNRECOVERABLE.value,
                             reason=str(e))
            return self._unrecoverable(str(e))
        except (E.RendezvousFailed, E.ControlForged) as e:
            # A forged value may already have let a process write retained memory: no grace
            # period in which a SIGTERM handler could checkpoint that state.
            forged = isinstance(e, E.ControlForged)
            self._stop_group(str(e), first_signal=signal.SIGKILL if forged else signal.SIGTERM)
            self.log(f"error: {e}")
            return self._end(e.exit_code, str(e))

    def _unrecoverable(self, reason: str) -> int:
        self._stop_group(reason)
        self._print_root_cause()
        self.log("error: the retained state cannot be recovered in place; the job ends "
                 f"(checkpoint fallback is not implemented yet): {reason}")
        return self._end(E.EXIT_UNRECOVERABLE, reason)

    def _end(self, code: int, reason: str | None = None) -> int:
        """The job ends with `code`: injections that never fired are reported first."""
        ranks = {s.rank for s in self.slots}
        for spec, why in self.ledger.unfired(self.cfg.inject, ranks):
            self.events.emit("inject_unfired", self.generation, rank=spec.rank, spec=spec.text,
                             reason=why, by="agent")
            self.log(f"warning: injection '{spec.text}' never fired: {why}")
        self.events.emit("job_end", self.generation, exit_code=code,
                         **({"reason": reason} if reason is not None else {}))
        return code

    def _start_group(self) -> None:
        lost = self.sms.lost() if self.sms else None
        if lost:          # a restart cannot bring the retained state back
            raise E.Unrecoverable(f"the group cannot be started again: {lost}")
        self.generation += 1
        self.attempt_base_gen = self.generation
        self.failures.clear()
        if self.inplace:
            self.inplace.new_round()
        t0 = time.monotonic()
        self.round = None          # drops the previous round's worker store server
        self.round = next_round(self.handler, round_no=self.generation,
                                restart_count=self.restart_count, role=self.cfg.launch.role, local_world_size=self.nproc,
                                master_addr=self.master_addr, master_port=self.master_port,
                                single_node=self.cfg.launch.max_nodes <= 1)
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
            self.ledger.ran(slot.rank, self.restart_count, 0)
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
            chunk_pages=cfg.recovery.chunk_pages, demote=cfg.recovery.demote,
            scrub_budget=cfg.recovery.scrub_budget,
            job_key=key_to_hex(self.job_key) if self.inplace and self.job_key else "")
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
        prefix = console_label(ident.global_rank, role, gen)
        self.worker_pipes.update((out_r, err_r))
        pipes = tuple(self.pump.add(fd, self.layout.plan(self.restart_count, ident.local_rank,
                                                         stream),
                                    prefix, stream, prefix_file=role == SlotRole.SHADOW)
                      for fd, stream in ((out_r, "stdout"), (err_r, "stderr")))
        sp = SlotProcess(role=role, generation=gen, attempt=self.restart_count,
                         proc=proc, error_file=err_file, epoch=epoch, pipes=pipes)
        slot.procs[role] = sp
        self.sel.register(proc.pidfd, selectors.EVENT_READ, (slot, sp))
        self.events.emit("spawn", gen, rank=ident.global_rank,
                         local_rank=ident.local_rank, role=role.value, pid=proc.pid,
                         mono=proc.started_mono, restart_count=self.restart_count, epoch=epoch)
        return sp

    def relabel(self, slot: RankSlot, sp: SlotProcess) -> None:
        """`sp` has a new role or generation (promotion, in-process demotion): its console
        lines say so from now on."""
        for stream in sp.pipes:
            self.pump.relabel(stream, console_label(slot.rank, sp.role, sp.generation))

    def _supervise(self) -> Decision:
        la = self.cfg.launch
        multi_node = self.round.group_world_size > 1 or la.max_nodes > 1
        while True:
            now = time.monotonic()
            timeout = self._next_deadline(now, multi_node) - now
            ready = self.sel.select(timeout=max(0.0, timeout))
            # Datagrams first: an `inject` sent just before a death is part of its facts.
            for key, _ in sorted(ready, key=lambda kv: kv[0].data != "hb"):
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
                except ForgedControlKey as e:
                    raise job_secret.forged("the rendezvous", e.key, e.reason, True) from e
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
                    return self._fell_back(inplace, decision)
                return decision
            self._flush_revokes()

    def _fell_back(self, inplace: Decision, group: Decision) -> Decision:
        """In-place recovery was not possible: `group` (torchrun's semantics) decides, and its
        decision carries why, and the failure's classification."""
        cls = inplace.classification
        self.events.emit("inplace_fallback", self.generation, reason=inplace.reason,
                         **(cls.fields() if cls else {}))
        self.log(f"no in-place recovery: {inplace.reason}")
        return Decision(group.action, f"{group.reason}; no in-place recovery: {inplace.reason}",
                        group.counts_as_restart, cls)

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
