"""The agent: one per node, parent and child-subreaper of every process of the job.

One control loop (`Agent.run`): rendezvous -> start the group -> supervise -> decide -> stop /
restart / finish.  The agent owns the loop and its decisions; the processes and the generation
belong to the worker group (`leto_run.group`), and the policies act on the group: in in-place
mode a HOF is recovered inside `_supervise` without leaving it (`leto_run.inplace`: shadows,
promotion, demotion); otherwise, or when that is not possible, `leto_run.restart` restarts the
group.  Supervision is event driven: the loop sleeps in one selector on the pidfds of its
children (exit seen within ~1 ms), the heartbeat socket, the signal wakeup fd and the HOF
watcher's pipe; the selector's timeout is the next deadline (hang, injection, status refresh,
peer check).  `_pump_once` is that selector's one turn, and the group's `wait` runs the same
turn, so a wait inside a policy keeps every handler running.  The handlers of what the
selector reports live in `leto_run.supervisor`.

Every decision is logged and recorded (`decision` event, with the failure's classification
where the failure policy judged one: `decisions.classify_failure`); when in-place recovery was
not possible, the reason is part of it.  At the end, injections that never fired are reported
(`inject_unfired`, `leto_run.unfired`).

Contract: `run_job(cfg) -> exit code` (codes in `leto_run.errors`).  It always stops every
worker and descendant before it returns, whatever happened.
"""
from __future__ import annotations

import os
import selectors
import signal
import socket
import tempfile
import time

from torch.distributed.elastic.utils import store as store_util

from leto_run import errors as E
from leto_run import job_secret
from leto_run.ckpt_lock import DirLock, job_name
from leto_run.config import JobConfig, signal_number
from leto_run.decisions import Action, Decision, decide_group
from leto_run.events import EventLog
from leto_run.exit_notice import ExitNotices
from leto_run.fallback import FallbackPolicy
from leto_run.failures import format_root_cause
from leto_run.group import GroupIO, WorkerGroup, WorkerSpec
from leto_run.guardian import start_guardian
from leto_run.heartbeat import HeartbeatServer
from leto_run.inplace import InplaceRecovery
from leto_run.logs import LogLayout, OutputPump
from leto_run.membership import JOIN_S, MembershipProbe
from leto_run.nodes import NodesPolicy
from leto_run.procs import become_subreaper, reap_orphans
from leto_run.rendezvous import make_handler, next_round
from leto_run.report import format_report
from leto_run.restart import RestartPolicy
from leto_run.state_managers import StateManagers
from leto_run.status import StatusView
from leto_run.supervisor import Supervisor
from leto_run.unfired import InjectLedger
from leto_run.worker_cmd import worker_argv
from leto_run.fork_server.client import Launcher
from leto_run.worker_env import job_token_kv, shared_env
from leto_run.agent_start import AgentStart, begin, serves
from leto_run.agent_life import interruptible, release, write_report
from leto_run.console import CONSOLE
from leto_runtime.control_auth import ForgedControlKey, key_to_hex
from leto_runtime.wire import settings


def run_job(cfg: JobConfig, start: AgentStart | None = None) -> int:
    try:
        agent = Agent(cfg, start)
    except BaseException:
        if start is not None and start.server is not None:
            start.server.kill()         # forked before the agent: nobody else would stop it
        raise
    try:
        return agent.run()
    finally:
        agent.close()


class Agent:
    def __init__(self, cfg: JobConfig, start: AgentStart | None = None):
        """`start`: what the process settled before (leto_run.cli); None: settled here.  A
        step that fails releases what the earlier ones acquired (`run_job` gets no agent to
        close then): the lock, the guardian, the run directory, the store."""
        self._closed, self._partial, self.group = False, True, None
        self.console = CONSOLE
        try:
            self._build(cfg, start)
        except BaseException:
            release(self)
            raise
        self._partial = False

    def _build(self, cfg: JobConfig, start: AgentStart | None) -> None:
        start = start or begin(cfg, os.environ)
        self.cfg = cfg
        self.host = socket.getfqdn()
        self.node = cfg.rendezvous.local_addr or self.host
        self.token = start.token
        # Before anything starts: a missing or unsafe secret file is a ConfigError (exit 2).
        self.job_key = job_secret.job_key(cfg)
        # Before anything starts too: a checkpoint directory another job writes is exit 2.
        self.ckpt_lock = (DirLock(cfg.checkpoint.dir, job=job_name(cfg))
                          if cfg.checkpoint.mode != "off" else None)
        # Forked first: no threads exist yet (fork safety), and it must outlive a kill -9 of us.
        self.guardian = start_guardian(job_token_kv(self.token))
        become_subreaper()
        self.console_lock = self.console.lock      # the pump's and status' lines never interleave
        self.nproc = start.nproc
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
        self.notices = ExitNotices.from_settings(settings.get())
        self.sel.register(self.notices.fd, selectors.EVENT_READ, "exit")
        self.sel.register(self.guardian.pidfd, selectors.EVENT_READ, "guardian")
        self.launcher = self._launcher(start)
        self._install_signals()
        inplace = cfg.recovery.mode == "inplace"
        # In-place mode: one state manager per local rank, outliving restarts (docs/MEMORY.md).
        self.sms = (StateManagers(run_dir=self.run_dir, token=self.token,
                                  log_root=self.layout.root, guardian=self.guardian,
                                  pump=self.pump, events=self.events, sel=self.sel,
                                  log=self.log, shutdown_timeout=cfg.launch.shutdown_timeout,
                                  escalate_fd=self._sig_r, geometry=cfg.recovery.geometry)
                    if inplace else None)
        self.ledger = InjectLedger()          # which injections fired (`inject_unfired`)
        self.group = WorkerGroup(
            WorkerSpec(cfg=cfg, argv=tuple(worker_argv(cfg)), run_id=self.run_id,
                       run_dir=self.run_dir, node=self.node, token=self.token,
                       heartbeat_socket=self.hb.path,
                       job_key_hex=key_to_hex(self.job_key) if inplace and self.job_key else "",
                       escalate_fd=self._sig_r),
            GroupIO(sel=self.sel, events=self.events, pump=self.pump, layout=self.layout,
                    guardian=self.guardian, status=self.status, ledger=self.ledger,
                    log=self.log, sms=self.sms, notices=self.notices,
                    launcher=self.launcher))
        self.group.pump_once = self._pump_once
        self.restart = RestartPolicy(self.group, cfg.launch.max_restarts)
        static_nodes = cfg.launch.max_nodes > 1 and self.handler.get_backend() == "static"
        self.fallback = FallbackPolicy(self.group, cfg.checkpoint, self.sms, static_nodes)
        self.inplace = (InplaceRecovery(self.group, recovery=cfg.recovery, node=self.node,
                                        job_key=self.job_key, retained_lost=self.sms.lost)
                        if inplace else None)
        self.nodes = NodesPolicy(self.group, self.fallback, self.sms, self.inplace, self.node,
                                 cfg.recovery.peer_timeout, self.restart,
                                 scoped=self.handler.get_backend() != "static")
        self.sup = Supervisor(self.group, hb=self.hb, sig_fd=self._sig_r, handled=self.handled,
                              host=self.host, observer=self.inplace)
        self.membership: MembershipProbe | None = None     # the round's, multi-node only
        if start.omp_warning:
            self.log("\n*****************************************\n" + start.omp_warning +
                     "\n*****************************************")

    def _launcher(self, start: AgentStart) -> Launcher:
        """Forked from this process before (`start.server`), or exec'd now, early: its preload
        overlaps the rendezvous (docs/ARCHITECTURE.md, "The fork server")."""
        cfg = self.cfg
        return Launcher(serves(cfg), worker_argv(cfg)[0], shared_env(os.environ, self.token), self.log,
                        self.events.emit, forked=start.server, note=start.server_note,
                        preload=start.preload)

    # ---- logging -------------------------------------------------------------------------
    def log(self, msg: str) -> None:
        gen = max(self.group.generation, 0) if self.group else 0
        self.console.write(f"[leto-run agent node={self.node} gen={gen}] {msg}\n")

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
            if report and not self.console.write(report + "\n"):
                write_report(self.layout.root, report)      # the console is gone: keep it

    def _run(self) -> int:
        la, g = self.cfg.launch, self.group
        self.events.emit("job_start", 0, run_id=self.run_id, nproc_per_node=self.nproc,
                         log_root=self.layout.root, argv=worker_argv(self.cfg),
                         max_restarts=la.max_restarts, recovery=self.cfg.recovery.mode)
        self.log(f"run_id={self.run_id} nproc_per_node={self.nproc} "
                 f"rdzv={self.cfg.rendezvous.backend} max_restarts={la.max_restarts} "
                 f"hang_timeout={self.cfg.recovery.hang_timeout:g}s logs={self.layout.root}")
        try:
            while True:
                try:
                    decision = self._start_group() or self._supervise()
                finally:
                    self._end_membership()
                self.log(f"decision: {decision.action.value}: {decision.reason}")
                cls = decision.classification
                self.events.emit("decision", g.generation, action=decision.action.value,
                                 reason=decision.reason, **(cls.fields() if cls else {}))
                if decision.action == Action.UNRECOVERABLE:
                    why_not = self._fall_back(decision)
                    if why_not is None:
                        continue
                    return self._unrecoverable(decision.reason, why_not)
                if decision.action == Action.SUCCEED:
                    g.stop("success")
                    self.nodes.done()           # the peers do not take our exit for a loss
                    self._exit_barrier()
                    return self._end(E.EXIT_OK)
                if decision.action == Action.RESTART:
                    if self.inplace and g.failures:
                        self.inplace.note_restart(g.failures)
                    self.restart.apply(decision)
                    if not self.inplace:      # restart mode: resume from the newest checkpoint
                        self.fallback.for_restart()
                    continue
                g.stop(decision.reason)
                code = (E.EXIT_RESTARTS_EXHAUSTED if la.max_restarts > 0
                        else E.EXIT_WORKER_FAILED)
                self._print_root_cause()
                return self._end(code, decision.reason)
        except E.StoppedBySignal as e:
            g.stop(f"leto-run received {signal.Signals(e.signum).name}", first_signal=e.signum)
            self.log(f"stopped by {signal.Signals(e.signum).name}; every worker stopped")
            return self._end(e.exit_code, str(e))
        except (E.RendezvousFailed, E.ControlForged, E.Unrecoverable) as e:
            # A forged value may already have let a process write retained memory: no grace
            # period in which a SIGTERM handler could checkpoint that state.  (Unrecoverable:
            # the in-place procedure found the retained state unsafe to reuse.)
            forged = isinstance(e, E.ControlForged)
            g.stop(str(e), first_signal=signal.SIGKILL if forged else signal.SIGTERM)
            self.log(f"error: {e}")
            return self._end(e.exit_code, str(e))

    def _fall_back(self, decision: Decision) -> str | None:
        """UNRECOVERABLE: the checkpoint fallback, if a complete checkpoint can be used (None);
        else why not."""
        fb, why = self.fallback.decide(decision.reason)
        if fb is None:
            return why
        steps = [f.step for f in self.group.failures if getattr(f, "step", None) is not None]
        self.log(f"decision: {fb.action.value}: {why}")
        self.events.emit("decision", self.group.generation, action=fb.action.value,
                         reason=fb.reason)
        self.fallback.apply(fb, max(steps) if steps else None)
        self.restart.note_fallback()
        return None

    def _unrecoverable(self, reason: str, why: str) -> int:
        self.group.stop(reason)
        self._print_root_cause()
        self.log("error: the retained state cannot be recovered in place and there is no "
                 f"checkpoint to fall back to ({why}); the job ends: {reason}")
        return self._end(E.EXIT_UNRECOVERABLE, f"{reason}; no fallback: {why}")

    def _end(self, code: int, reason: str | None = None) -> int:
        """The job ends with `code`: injections that never fired are reported first."""
        g = self.group
        ranks = {s.rank for s in g.slots}
        for spec, why in self.ledger.unfired(self.cfg.inject, ranks):
            self.events.emit("inject_unfired", g.generation, rank=spec.rank, spec=spec.text,
                             reason=why, by="agent")
            self.log(f"warning: injection '{spec.text}' never fired: {why}")
        self.console.report(self.events.emit, g.generation)
        self.events.emit("job_end", g.generation, exit_code=code,
                         **({"reason": reason} if reason is not None else {}))
        return code

    def _start_group(self) -> Decision | None:
        """The next restart attempt: a new rendezvous round, then every active spawned.  An
        UNRECOVERABLE decision instead when the retained state cannot be served any more."""
        lost = self.sms.lost() if self.sms else None
        if lost:          # a restart cannot bring the retained state back
            return Decision(Action.UNRECOVERABLE, f"the group cannot be started again: {lost}")
        g, count = self.group, self.restart.count
        gen = g.begin_attempt(f"restart {count}")
        if self.inplace:
            self.inplace.new_round()
        t0 = time.monotonic()
        g.round = None          # drops the previous round's worker store server
        # First the last round's membership probe leaves the handler (one store call at most),
        # then the rendezvous: each blocks in C++ up to its timeout, so each is waited for where
        # a signal still stops it (and a signal during the first never starts the second).
        interruptible(lambda: self._end_membership(JOIN_S), self._sig_r, self.sup.on_signals)
        r = interruptible(lambda: next_round(
            self.handler, round_no=gen, restart_count=count, role=self.cfg.launch.role,
            local_world_size=self.nproc, master_addr=self.master_addr,
            master_port=self.master_port, single_node=self.cfg.launch.max_nodes <= 1),
            self._sig_r, self.sup.on_signals)
        self.events.emit("rendezvous", gen, seconds=time.monotonic() - t0,
                         group_rank=r.group_rank, group_world_size=r.group_world_size,
                         master_addr=r.master_addr, master_port=r.master_port,
                         restart_count=count)
        stop = self.nodes.agree(r)
        if stop is not None:
            return stop
        g.start(r, self.restart.count)      # (a fallback the round agreed on counts one)
        if r.group_world_size > 1 or self.cfg.launch.max_nodes > 1:
            self.membership = MembershipProbe(self.handler.num_nodes_waiting,
                                              self.cfg.launch.monitor_interval, self.log).start()
        self.fallback.started_attempt()
        return None

    def _pump_once(self, timeout: float) -> None:
        """One turn of the selector: wait at most `timeout` s and hand what it reports to
        its handler (datagrams first: an `inject` sent just before a death is part of its
        facts -- drained every turn, since the heartbeat's reader thread may not have woken
        the selector yet for a datagram the kernel already holds)."""
        t0 = time.monotonic()
        ready = self.sel.select(timeout=max(0.0, timeout))
        self.sup.note_stall(time.monotonic() - t0, timeout)  # a policy's wait pumps it too
        self.sup.on_beats()
        self.console.report(self.events.emit, self.group.generation)   # once, if it was lost
        for key, _ in ready:
            data = key.data
            if data == "hb":
                continue
            elif data == "guardian":
                self._on_guardian_exit()
            elif data == "sig":
                self.sup.on_signals()
            elif data == "exit":
                self.sup.on_exit_notices()
            elif data == "hof":
                self.inplace.on_wake()
            elif data[0] == "fence":
                self.sup.on_fence(data[1], data[2])
            elif data[0] == "sm":
                g = self.group
                if self.sms.on_exit(data[1], data[2], g.slots, g.generation, g.restart_count):
                    self.status.changed()
            else:
                self.sup.on_exit(*data)

    def _supervise(self) -> Decision:
        la, g = self.cfg.launch, self.group
        while True:
            began = time.monotonic()
            planned = self._next_deadline(began) - began
            self._pump_once(planned)
            # Before any verdict, what is queued already (a select interrupted by a stop of
            # this process returns nothing once its timeout has passed: exits and beats wait).
            self._pump_once(0.0)
            now = time.monotonic()
            self.sup.note_stall(now - began, planned)
            self.sup.after_stall(now, self.nodes.peers)
            self.sup.check_hangs(now)
            self.sup.check_lingering(now)
            self.sup.fire_timers(now)
            if self.inplace:
                self.inplace.tick(now)             # the shadows' preinit levels
            reap_orphans(g.known_pids())
            nodes_waiting = self._nodes_waiting()
            self.status.refresh()
            early = self.nodes.watch(now)
            if early is not None and early.action == Action.CONTINUE:
                continue                           # a local failure waits for the peers
            if early is not None:
                return early
            failed = [f.rank for f in g.failures]
            inplace = self.inplace.decide(g.failures) if self.inplace else None
            if inplace and inplace.action == Action.UNRECOVERABLE:
                return inplace
            if inplace and inplace.action == Action.INPLACE:
                self.inplace.apply(inplace)
                g.flush_revokes()
                continue                           # recovered: the next generation trains
            if inplace and self.inplace.remote is not None and not failed:
                failed = [self.inplace.remote_rank()]   # another node's HOF, no shadows here
            actives = [s.active for s in g.slots]
            decision = decide_group([a.state for a in actives], failed, self.restart.remaining,
                                    la.max_restarts, nodes_waiting)
            if decision.action != Action.CONTINUE:
                if inplace and inplace.action == Action.FALL_BACK:
                    return self._fell_back(inplace, decision)
                return decision
            g.flush_revokes()

    def _on_guardian_exit(self) -> None:
        """The guardian died (its pidfd fired): start another, told all the old one knew, so
        a kill -9 of this agent is still cleaned up (`decisions.guardian_verdict` bounds it)."""
        gd = self.guardian
        old, how = gd.pid, gd.reap()
        if how is None:
            return
        self.sel.unregister(gd.pidfd)
        started, why = gd.replace(time.monotonic())
        if started:
            self.sel.register(gd.pidfd, selectors.EVENT_READ, "guardian")
        self.events.emit("guardian", self.group.generation, pid=gd.pid if started else None,
                         old_pid=old, how=how, action="restarted" if started else "gone",
                         reason=why)
        self.log(f"the guardian (pid {old}) exited ({how}); a new one runs (pid {gd.pid}; {why})"
                 if started else f"warning: the guardian (pid {old}) exited ({how}): {why}")

    def _nodes_waiting(self) -> int:
        """Agents waiting to join (torchrun's membership check), as the round's probe last
        heard: the loop never waits on the store (`leto_run.membership`)."""
        if self.membership is None:
            return 0
        try:
            return self.membership.take()
        except ForgedControlKey as e:
            raise job_secret.forged("the rendezvous", e.key, e.reason, True) from e

    def _end_membership(self, join_s: float = 0.0) -> None:
        """Stop the round's probe; `join_s` > 0 (before the next rendezvous): wait until its
        thread is out of the handler."""
        if self.membership is not None:
            self.membership.close(join_s)
        if join_s > 0:
            self.membership = None

    def _fell_back(self, inplace: Decision, group: Decision) -> Decision:
        """In-place recovery was not possible: `group` (torchrun's semantics) decides, and its
        decision carries why, and the failure's classification."""
        cls = inplace.classification
        self.events.emit("inplace_fallback", self.group.generation, reason=inplace.reason,
                         **(cls.fields() if cls else {}))
        self.log(f"no in-place recovery: {inplace.reason}")
        return Decision(group.action, f"{group.reason}; no in-place recovery: {inplace.reason}",
                        group.counts_as_restart, cls)

    def _next_deadline(self, now: float) -> float:
        g = self.group
        cands = [now + 1.0, self.status.next_refresh(now)]
        cands += [t for t, _, _ in g.timers]
        cands += [sp.hang_deadline for s in g.slots for sp in s.all()
                  if sp.hang_deadline is not None and not sp.done]
        if self.membership is not None:
            cands.append(now + self.cfg.launch.monitor_interval)
        if self.nodes.peers is not None:
            cands.append(now + self.nodes.peers.interval)
        return min(cands)

    # ---- finishing -----------------------------------------------------------------------
    def _exit_barrier(self) -> None:
        r, gen = self.group.round, self.group.generation
        if r is None or r.group_world_size <= 1:
            return
        t0 = time.monotonic()
        try:      # up to --exit-barrier-timeout in C++: a signal must still end it
            interruptible(lambda: store_util.barrier(
                store=r.store, world_size=r.group_world_size,
                key_prefix=f"leto/exit_barrier/{gen}",
                barrier_timeout=self.cfg.launch.exit_barrier_timeout),
                self._sig_r, self.sup.on_signals)
        except E.StoppedBySignal:
            raise
        except Exception as e:
            self.log(f"exit barrier: {type(e).__name__}: {e}")
        self.events.emit("exit_barrier", gen, seconds=time.monotonic() - t0)

    def _print_root_cause(self) -> None:
        failures = self.group.failures
        if not failures:
            return
        title = f"{worker_argv(self.cfg)[-1 - len(self.cfg.launch.script_args)]} FAILED"
        self.console.write(format_root_cause(title, failures) + "\n")

    def close(self) -> None:
        release(self)
