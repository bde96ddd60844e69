"""The worker group's verbs on real processes and real signals (leto_run/group.py): a kill by a
policy and an exit seen through the pidfd record each process's exit once, `kill_and_reap`
leaves every victim STOPPED and reaped, and `wait` runs the selector it is given (no poll loop
of its own) until its predicate holds or its deadline passes."""
from __future__ import annotations

import os
import selectors
import sys
import threading
import time

import pytest

from leto_run.events import EventLog
from leto_run.group import GroupIO, WorkerGroup, WorkerSpec
from leto_run.procs import spawn
from leto_run.slot import ProcState, RankSlot, SlotProcess, SlotRole
from leto_run.status import StatusView
from leto_run.unfired import InjectLedger
from leto_run.worker_env import WorkerIdentity


class Harness:
    """A group over a real selector whose one turn reaps what its pidfds report."""

    def __init__(self, tmp_path):
        self.sel = selectors.DefaultSelector()
        self.events = EventLog(str(tmp_path / "ev.jsonl"), "n")
        self.turns = 0
        io = GroupIO(sel=self.sel, events=self.events, pump=None, layout=None, guardian=None,
                     status=StatusView(False, threading.Lock()), ledger=InjectLedger(),
                     log=lambda m: None)
        spec = WorkerSpec(cfg=None, argv=(), run_id="r", run_dir=str(tmp_path), node="n",
                          token="t", heartbeat_socket="", job_key_hex="", escalate_fd=-1)
        self.group = WorkerGroup(spec, io)
        self.group.pump_once = self.pump_once

    def pump_once(self, timeout: float) -> None:
        self.turns += 1
        for key, _ in self.sel.select(timeout=max(0.0, timeout)):
            slot, sp = key.data
            if self.group.reap(slot, sp) is not None and not sp.done:
                sp.move(ProcState.STOPPED if sp.state == ProcState.STOPPING
                        else ProcState.FAILED)

    def proc(self, rank: int, code: str) -> tuple[RankSlot, SlotProcess]:
        ident = WorkerIdentity(local_rank=rank, global_rank=rank, role_rank=rank, world_size=2,
                               role_world_size=2, local_world_size=2, group_rank=0,
                               group_world_size=1, role_name="default")
        slot = RankSlot(identity=ident)
        p = spawn([sys.executable, "-c", code], dict(os.environ))
        sp = SlotProcess(role=SlotRole.ACTIVE, generation=0, attempt=0, proc=p, error_file="")
        slot.procs[SlotRole.ACTIVE] = sp
        self.sel.register(p.pidfd, selectors.EVENT_READ, (slot, sp))
        return slot, sp

    def exits(self) -> list[dict]:
        return [e for e in self.events.records if e["event"] == "exit"]


@pytest.fixture
def h(tmp_path):
    h = Harness(tmp_path)
    yield h
    h.events.close()


def test_a_kill_and_an_exit_seen_through_the_pidfd_are_each_recorded_once(h):
    dead = h.proc(0, "import sys; sys.exit(3)")
    alive = h.proc(1, "import time; time.sleep(60)")
    assert h.group.wait(lambda: dead[1].proc.status is not None, time.monotonic() + 30)
    assert dead[1].state == ProcState.FAILED
    left = h.group.kill_and_reap([dead, alive], "collateral", timeout=30)
    assert left == [] and alive[1].proc.status is not None
    assert alive[1].proc.status.signal == 9 and alive[1].state == ProcState.STOPPED
    exits = {e["pid"]: e for e in h.exits()}
    assert len(h.exits()) == 2 and set(exits) == {dead[1].proc.pid, alive[1].proc.pid}
    assert exits[dead[1].proc.pid]["exitcode"] == 3 and "collateral" not in exits[dead[1].proc.pid]
    assert exits[alive[1].proc.pid]["collateral"] is True       # it was running in its role
    h.group.kill_and_reap([alive], "collateral", timeout=1)      # again: nothing new
    assert len(h.exits()) == 2


def test_wait_runs_the_given_selector_until_the_predicate_or_the_deadline(h):
    _, sp = h.proc(0, "import time; time.sleep(0.3)")
    t0 = time.monotonic()
    assert h.group.wait(lambda: sp.proc.status is not None, t0 + 30)
    assert time.monotonic() - t0 < 20 and h.turns >= 1          # woken by the pidfd
    slot, slow = h.proc(1, "import time; time.sleep(60)")
    t0 = time.monotonic()
    assert not h.group.wait(lambda: slow.proc.status is not None, t0 + 0.5)
    assert 0.5 <= time.monotonic() - t0 < 20
    h.group.kill_and_reap([(slot, slow)], "stopped", timeout=30)
    assert slow.proc.status is not None and slow.state == ProcState.STOPPED
    [e] = [e for e in h.exits() if e["pid"] == slow.proc.pid]
    assert e["stopped"] is True


def test_a_wait_whose_deadline_passed_while_the_agent_was_away_reads_what_queued_first(h):
    """The agent was stopped past a policy's deadline (leto_run/group.py, `wait`): the exit
    that happened meanwhile is read before the wait gives up, not taken for a timeout."""
    _, sp = h.proc(0, "import sys; sys.exit(0)")
    end = time.monotonic() + 30
    while not h.sel.select(timeout=0.05) and time.monotonic() < end:
        pass                                  # exited, nothing read (the agent "away")
    assert sp.proc.status is None
    assert h.group.wait(lambda: sp.proc.status is not None, time.monotonic() - 1.0)
    assert sp.proc.status.exitcode == 0 and h.turns == 1
