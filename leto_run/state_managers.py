"""The agent's side of the Resilient Memory Pool: one state manager per rank slot.

In in-place mode the agent starts a state manager for every local rank before the trainers
(docs/MEMORY.md), keeps duplicates of every fd it exports in an `FdKeeper`, restarts it from those
fds and its metadata when it dies, tells it which trainer pids it may serve, and fires
`pages` injections at it.  State managers outlive group restarts: only the end of the job
stops them.

Contract: the agent owns the selector and the loop; this class registers each state manager's
pidfd with data ``("sm", local_rank, slot_process)`` and the agent calls `on_exit` when it
fires.  Everything runs on the agent's main thread (spawn's parent-death rule).

A state manager is *gone* for good when it died more than MAX_CRASHES times within CRASH_WINDOW
seconds, or exited with a code that says a restart cannot help (bad arguments, a device that
cannot serve, a kept pool it cannot restore, an unreachable fd keeper: the exit codes of
`leto_run.state_manager.__main__`).  It is not restarted again, and `lost()` says why: the
retained state of that slot cannot be served, so no in-place recovery can succeed
(`decisions.decide_inplace` ends the job, exit 4).  Training that is running goes on (its
memory stays mapped) until the next failure.
"""
from __future__ import annotations

import os
import selectors
import time
from collections.abc import Callable

from leto_run.events import EventLog
from leto_run.guardian import Guardian
from leto_run.logs import OutputPump, StreamPlan
from leto_run.procs import spawn
from leto_run.slot import ProcState, RankSlot, SlotProcess, SlotRole
from leto_run.state_manager.__main__ import EXIT_ARGS, EXIT_DEVICE, EXIT_KEEPER, EXIT_SNAPSHOT
from leto_run.state_manager.keeper import FdKeeper
from leto_run.state_manager.metadata import Geometry
from leto_run.stopper import stop_processes
from leto_runtime.wire import contract as C
from leto_runtime.rmp.faults import fire_pages_spec

# A state manager that dies this many times within CRASH_WINDOW seconds is not restarted again:
# something is wrong with the slot, not with one process.
MAX_CRASHES, CRASH_WINDOW = 5, 60.0
# Exits a restart cannot cure (the same arguments, device and kept pool would meet it again).
_FINAL_EXITS = {EXIT_ARGS: "its arguments were refused", EXIT_DEVICE: "its device cannot serve",
                EXIT_SNAPSHOT: "the pool the agent kept cannot be restored",
                EXIT_KEEPER: "the agent's fd keeper is unreachable"}


class StateManagers:
    def __init__(self, *, run_dir: str, token: str, log_root: str, guardian: Guardian,
                 pump: OutputPump, events: EventLog, sel: selectors.BaseSelector,
                 log: Callable[[str], None], shutdown_timeout: float, escalate_fd: int,
                 geometry: Geometry | None = None):
        self.run_dir, self.token, self.log_root = run_dir, token, log_root
        self.guardian, self.pump, self.events, self.sel = guardian, pump, events, sel
        self.log, self.shutdown_timeout, self.escalate_fd = log, shutdown_timeout, escalate_fd
        self.geometry = geometry or Geometry()     # recovery.page_bytes/data_pages/tier1/tier2
        self.keepers: dict[int, FdKeeper] = {}
        self.procs: dict[int, SlotProcess] = {}
        self.crashes: dict[int, list[float]] = {}
        self.gone: dict[int, str] = {}             # local rank -> why it is not restarted

    # ---- queries -------------------------------------------------------------------------
    def socket(self, lr: int) -> str:
        return self.keepers[lr].sm_socket

    def pids(self) -> set[int]:
        return {sp.proc.pid for sp in self.procs.values() if sp.proc.status is None}

    def allow(self, lr: int, pid: int) -> None:
        self.keepers[lr].allow_pid(pid)

    def revoke(self, lr: int, pid: int) -> None:
        self.keepers[lr].revoke_pid(pid)

    def lost(self) -> str | None:
        """Why some slot's retained state cannot be served any more (None: every slot can)."""
        if not self.gone:
            return None
        lr = min(self.gone)
        return (f"the state manager of slot {lr} is gone for good ({self.gone[lr]}): the "
                "retained state of that slot cannot be served, so no in-place recovery can "
                "succeed")

    # ---- lifecycle -----------------------------------------------------------------------
    def ensure(self, slot: RankSlot, generation: int, restart_count: int) -> None:
        """Start the slot's state manager unless one runs.  Not waited for: the trainers'
        clients retry their connect, so the job's start-up does not pay for it.  One that is
        gone for good is not started again (the agent ends the job first: `lost()`)."""
        lr = slot.local_rank
        sp = self.procs.get(lr)
        if (sp is None or sp.done) and lr not in self.gone:
            sp = self._spawn(lr, slot.rank, generation, restart_count)
        if sp is not None:
            slot.procs[SlotRole.STATE_MANAGER] = sp

    def _spawn(self, lr: int, rank: int, generation: int, restart_count: int) -> SlotProcess:
        keeper = self.keepers.get(lr)
        if keeper is None:
            keeper = self.keepers[lr] = FdKeeper(
                self.run_dir, lr, log=lambda m, lr=lr: self.log(f"fd keeper slot {lr}: {m}"))
        env = dict(os.environ)
        env[C.LETO_JOB_TOKEN] = self.token          # the guardian's cleanup finds it too
        out_r, out_w = os.pipe()
        try:
            proc = spawn(keeper.state_manager_argv(device="auto", geometry=self.geometry), env,
                         stdout=out_w, stderr=out_w)
        finally:
            os.close(out_w)
        self.guardian.announce(proc.pid)
        log_file = os.path.join(self.log_root, f"state_manager_{lr}.log")
        self.pump.add(out_r, StreamPlan(log_file, True), f"[sm{lr} state_manager]: ", "stderr")
        sp = SlotProcess(role=SlotRole.STATE_MANAGER, generation=max(generation, 0),
                         attempt=restart_count, proc=proc, error_file="")
        self.procs[lr] = sp
        self.sel.register(proc.pidfd, selectors.EVENT_READ, ("sm", lr, sp))
        self.events.emit("spawn", sp.generation, rank=rank, local_rank=lr, role=sp.role.value,
                         pid=proc.pid, mono=proc.started_mono, restores=keeper.restores,
                         restart_count=restart_count)
        return sp

    def on_exit(self, lr: int, sp: SlotProcess, slots: list[RankSlot], generation: int,
                restart_count: int) -> bool:
        """Reap a state manager and restart it from the keeper; True if it was restarted."""
        fd = sp.proc.pidfd
        status = sp.proc.poll_exit()
        if status is None:
            return False
        self.sel.unregister(fd)
        if not sp.done:
            sp.move(ProcState.SUCCEEDED if status.ok else ProcState.FAILED)
        self.events.emit("exit", sp.generation, local_rank=lr, role=sp.role.value,
                         pid=sp.proc.pid, exitcode=status.exitcode, how=status.describe(),
                         mono=status.mono)
        why = self._final(lr, status)
        if why is not None:
            self.gone[lr] = why
            self.log(f"error: state manager of slot {lr} (pid {sp.proc.pid}) is not restarted "
                     f"again: {why}; an in-place recovery of this job is no longer possible")
            self.events.emit("sm_gone", sp.generation, local_rank=lr, pid=sp.proc.pid,
                             how=status.describe(), reason=why)
            return False
        self.log(f"state manager of slot {lr} (pid {sp.proc.pid}) exited: {status.describe()}; "
                 "restarting it from the fds and metadata the agent kept")
        rank = next((s.rank for s in slots if s.local_rank == lr), lr)
        new = self._spawn(lr, rank, generation, restart_count)
        self.events.emit("sm_restart", new.generation, local_rank=lr, pid=new.proc.pid,
                         old_pid=sp.proc.pid, how=status.describe())
        for slot in slots:
            if slot.local_rank == lr:
                slot.procs[SlotRole.STATE_MANAGER] = new
        return True

    def _final(self, lr: int, status) -> str | None:
        """Why the state manager of slot `lr` that just exited must not be restarted."""
        if status.exitcode in _FINAL_EXITS:
            return f"exit code {status.exitcode}: {_FINAL_EXITS[status.exitcode]}"
        now = time.monotonic()
        crashes = [t for t in self.crashes.get(lr, []) if now - t < CRASH_WINDOW] + [now]
        self.crashes[lr] = crashes
        if len(crashes) > MAX_CRASHES:
            return (f"it died {len(crashes)} times within {CRASH_WINDOW:g} s, the last time "
                    f"{status.describe()}")
        return None

    def fire_pages(self, slot: RankSlot, spec, generation: int) -> None:
        """Destroy and unmap/poison pages of `slot`'s pool as `spec` (a `pages` inject) says."""
        keeper = self.keepers.get(slot.local_rank)
        if keeper is None:
            self.log(f"cannot inject '{spec.text}': no state manager for rank {slot.rank}")
            return
        try:
            report = fire_pages_spec(keeper.sm_socket, spec.to_json().get("params", {}))
        except Exception as e:   # a bad group/range is the user's spec, not a crash of ours
            self.log(f"injecting '{spec.text}' failed: {type(e).__name__}: {e}")
            self.events.emit("inject", generation, rank=slot.rank, spec=spec.text, by="agent",
                             error=f"{type(e).__name__}: {e}")
            return
        self.log(f"injected '{spec.text}' into rank {slot.rank}'s memory pool: "
                 f"{len(report.get('pages', []))} page(s), {report.get('emulation')}")
        self.events.emit("inject", generation, rank=slot.rank, spec=spec.text, by="agent",
                         after_s=spec.after_s, **report)

    def holding(self) -> bool:
        """Have this node's state managers been started since the job began or the last
        `reset` (so they may hold the job's retained state)?"""
        return bool(self.procs)

    def reset(self) -> None:
        """A checkpoint fallback: stop every state manager and drop its memory (the keepers'
        fds), so the next `ensure` starts fresh, empty pools; what was gone is forgotten."""
        self.stop()
        self.procs.clear()
        self.crashes.clear()
        self.gone.clear()

    def stop(self) -> None:
        """End of the job: stop every state manager (grace, then SIGKILL), close the keepers
        (the memory goes with the last fd)."""
        live = [sp for sp in self.procs.values() if sp.proc.alive]
        for sp in live:
            try:
                self.sel.unregister(sp.proc.pidfd)
            except (KeyError, ValueError):
                pass
            if not sp.done:
                sp.move(ProcState.STOPPING)
        if live:
            stop_processes([sp.proc for sp in live], grace=self.shutdown_timeout,
                           token_kv=None, escalate_fd=self.escalate_fd, log=self.log)
        for keeper in self.keepers.values():
            keeper.close()
        self.keepers.clear()
