"""The agent's half of in-place HOF recovery: shadows, promotion, demotion (docs/ARCHITECTURE.md).

Role: the in-place recovery policy, a procedure over the worker group (`leto_run.group`) and the
worker store; it never sees the agent.  `InplaceRecovery` owns the shadows' life cycle and the
HOF procedure; the agent's loop calls it (one thread: the agent's main thread, which spawn's
parent-death rule requires), and its `Supervisor` tells it what it observes:

- `on_datagram(slot, sp, beat)` for the datagram kinds `inplace`, `promoted`, `phase`:
  an active's `inplace` marks its slot in place and starts its shadow (generation + 1);
  a shadow's `inplace` says it is ready (event `shadow_ready`);
- `on_shadow_exit(slot, sp, status)` when a shadow dies before its promotion: the node's other
  shadows of that generation are killed and all are started again with LETO_SHADOW_EPOCH + 1
  (their process group included the dead one); several nodes cannot do that alone, so there the
  next HOF falls back to a restart;
- `decide(failures)` once per loop turn: `decisions.decide_inplace` on the local failures of
  the current generation g (or a HOF another node declared in the worker store, seen by
  `HofWatcher`); for INPLACE the agent calls `apply(decision)`, the procedure:
    a. declare: set `hof_key(g)` (first writer wins) with {rank, how, node, mono};
    b. demote every local active of g:
       `replace`: SIGKILL its process group, wait for its pidfd (bounded), record it STOPPED
       (collateral, never a new failure);
       `release` (the survivors; a failed one is always killed): send `contract.DEMOTE_SIGNAL`
       and wait (bounded, DEMOTE_RELEASE_S, in `group.wait`: the agent's selector keeps
       running every handler) for its `demoted` datagram -- it has released its
       GPU memory and process group and synchronized its device (`leto_runtime.demotion`);
       one that does not confirm in time is killed as with `replace`;
    c. promote: set `go_key(g + 1, rank)` for every local rank and send PROMOTE_SIGNAL to each
       ready shadow (it then checks the key at once); each shadow becomes its slot's active; the
       group advances to generation g + 1 (not a restart: `--max-restarts` unused);
    d. the demoted survivors become their slots' shadows of generation g + 2 (same process);
       fresh shadows of g + 2 start for the other slots.
- `collateral(sp)`: a death of an active that belongs to a HOF being recovered in place;
- `note_restart(failures)`: the group restarts instead; its root cause joins the history.

The decision (`decisions.decide_inplace`) also weighs the failure policy (`recovery_policy`):
the classification of the root cause against the last recovered failure, the in-place budget,
and whether this node's retained state can still be served (`StateManagers.lost`).  With
`--max-inplace-recoveries 0` no shadow is started.  A promoted or demoted process keeps its
pipes; its console label is changed to the role it has now (`group.relabel`).

Events (all with generation, rank, pid, mono): shadow_ready, hof, demote, demoted, promote,
promoted (the runtime's wake time), phase, shadow_exit, shadow_respawn, inplace_fallback.
Every blocking call is bounded: store operations (client timeout), pidfd waits (DEMOTE_WAIT_S),
the wait for demotions (DEMOTE_RELEASE_S).  Processes are killed and reaped by the group
(`kill_and_reap`), which records each exit once.
"""
from __future__ import annotations

import datetime
import json
import os
import selectors
import time
from typing import Callable

import torch.distributed as dist

from leto_run import errors as E, job_secret
from leto_run.decisions import Action, Decision, SlotView, decide_inplace
from leto_run.group import WorkerGroup
from leto_run.hof_watch import STORE_TIMEOUT_S, HofWatcher
from leto_run.inplace_levels import ShadowLevelMoves
from leto_run.preinit import Level, PreinitPolicy
from leto_run.preinit_control import MIB, ShadowLevels
from leto_run.procs import ExitStatus
from leto_run.recovery_policy import FailurePolicy
from leto_run.slot import ProcState, RankSlot, SlotProcess, SlotRole
from leto_runtime.wire import contract as C, settings
from leto_runtime.auth_store import AuthStore
from leto_runtime.control_auth import ForgedControlKey

DEMOTE_WAIT_S = 10.0        # SIGKILLed trainers are gone in ms; D-state stragglers are reported
DEMOTE_RELEASE_S = 10.0     # demote=release: a survivor reaches a safe point in one step phase
MAX_SHADOW_RESPAWNS = 3     # per generation: a shadow that keeps dying is a script bug
# What a promoted process owes (hang_verdict's reason): a ready shadow wakes at once.
UNCONFIRMED = "promoted, then silent (no `promoted` datagram, no heartbeat)"
UNREADY = "promoted before it was ready (still starting), then silent (no `promoted`, no beat)"


class InplaceRecovery(ShadowLevelMoves):
    """See the module docstring.  `group` is the node's worker group; `recovery` the job's
    `RecoveryConfig`; `retained_lost()` says why some slot's retained state cannot be served
    any more (None: every slot can)."""

    action = Action.INPLACE

    def __init__(self, group: WorkerGroup, *, recovery, node: str, job_key: bytes | None,
                 retained_lost: Callable[[], str | None]):
        self.g, self.rc, self.node, self.job_key = group, recovery, node, job_key
        self.retained_lost = retained_lost
        self.events, self.log = group.events, group.log
        self.epoch = 0                       # LETO_SHADOW_EPOCH of the shadows being started
        self.respawns = 0                    # shadow respawns in this generation
        self.unusable: str | None = None     # why the current shadows cannot take over
        self.store = None                    # worker-store client of the current round
        self.watcher: HofWatcher | None = None
        self.wake_r, self.wake_w = os.pipe()
        os.set_blocking(self.wake_r, False)
        group.io.sel.register(self.wake_r, selectors.EVENT_READ, "hof")
        self.remote: dict | None = None      # a HOF of the current generation another node declared
        self.declared: set[int] = set()      # generations whose HOF this node recovered
        self.demoted: list = []              # (slot, sp): survivors demoted in process, to adopt
        self.policy = FailurePolicy(recovery.max_inplace_recoveries, recovery.inplace_window)
        from leto_run.nvml import Nvml
        knobs = settings.get()
        self.levels = ShadowLevels(PreinitPolicy(
            mode=recovery.preinit, margin=recovery.preinit_margin * MIB,
            horizon_s=knobs.preinit_horizon or 30.0, raise_hold_s=knobs.preinit_raise_hold or 60.0),
            nvml=Nvml.open() if knobs.preinit_control else None)
        self.acks: list[tuple[int, int, int]] = []   # injected level changes to confirm

    # ---- round lifecycle -----------------------------------------------------------------
    def new_round(self) -> None:
        """A (re)started group: old shadows were stopped with it; old store and watcher go."""
        if self.watcher:
            self.watcher.stop()
        self.watcher, self.store, self.remote = None, None, None
        self.epoch, self.respawns, self.unusable = 0, 0, None

    def close(self) -> None:
        if self.watcher:
            self.watcher.stop()
        for fd in (self.wake_r, self.wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    def _client(self):
        if self.store is None:
            r = self.g.round
            # Signs the go and HOF keys it sets, verifies the HOF keys it reads (job_secret).
            self.store = AuthStore(dist.TCPStore(
                r.master_addr, r.master_port, is_master=False, wait_for_workers=False,
                timeout=datetime.timedelta(seconds=STORE_TIMEOUT_S)), self.job_key)
        return self.store

    # ---- datagrams -----------------------------------------------------------------------
    def on_datagram(self, slot: RankSlot, sp: SlotProcess, beat) -> None:
        ev = self.events
        detail = _json(beat.detail)
        if beat.kind == "inplace" and sp.role == SlotRole.ACTIVE:
            if isinstance(detail.get("uuid"), str):
                slot.device_uuid = detail["uuid"]
            if not slot.inplace:
                slot.inplace = True
                ev.emit("inplace", sp.generation, rank=slot.rank, pid=beat.pid,
                              mono=beat.mono)
                self._ensure_watcher()
            if slot.shadow is None and not self.unusable and self.policy.inplace_enabled:
                self._spawn_shadow(slot)
        elif beat.kind == "inplace":
            sp.ready = True
            sp.wake = bool(detail.get("wake"))
            # sp.level stays the level it was asked for: a process that holds a CUDA context
            # already reports L2 for L1, and deciding on that would relaunch it for ever.
            ev.emit("shadow_ready", sp.generation, rank=slot.rank, pid=beat.pid,
                    role=sp.role.value, epoch=sp.epoch, level=detail.get("level"),
                          seconds=detail.get("seconds"), mono=beat.mono)
            self._confirm_levels()
        elif beat.kind == "promoted":
            granted = sp.role == SlotRole.ACTIVE     # else it woke without the go key _promote sets
            ev.emit("promoted", sp.generation, rank=slot.rank, pid=beat.pid,
                          mono=float(detail.get("mono", beat.mono)), agent_mono=beat.mono,
                          granted=granted)
            if not granted:
                raise job_secret.not_granted(slot.rank, beat.pid, sp.role.value, sp.generation)
            sp.expect(beat.mono, self.rc.hang_timeout,
                      "confirmed its promotion, then no heartbeat")
        elif beat.kind == "demoted":
            sp.demoted = detail

    def _spawn_shadow(self, slot: RankSlot, level: Level | None = None) -> None:
        gen = self.g.generation + 1
        lv = self.levels.start_level(slot.rank) if level is None else level
        room = self.levels.warmup_room(time.monotonic(), slot.rank, lv)
        sp = self.g.spawn(slot, SlotRole.SHADOW, generation=gen, epoch=self.epoch, level=lv.name,
                          warmup_room=None if room is None else room[0])
        self.log(f"rank {slot.rank}: shadow of generation {gen} started (pid {sp.proc.pid}, "
                 f"epoch {self.epoch}, level {lv.name}"
                 + (f"; its warm-up may take {room[0] >> 20} MiB: {room[1]}" if room else "") + ")")

    def _ensure_watcher(self) -> None:
        # One node needs no watcher: every HOF is its own (and a timed-out wait prints c10d
        # warnings on the agent's console).
        r = self.g.round
        if self.watcher is None and r is not None and r.group_world_size > 1:
            self.watcher = HofWatcher(r.master_addr, r.master_port, lambda: self.g.generation,
                                      self.wake_w)

    def on_wake(self) -> None:
        """The watcher saw `hof_key(generation)`: remember who declared it (unless we did)."""
        try:
            os.read(self.wake_r, 64)
        except BlockingIOError:
            pass
        g = self.g.generation
        if g in self.declared:
            return
        try:
            # The byte carries no generation: a wake for one this agent already handled (it
            # declared the HOF itself and moved on) must not block the loop in a store get.
            if not self._client().check([C.hof_key(g)]):
                return
            self.remote = json.loads(self._client().get(C.hof_key(g)))
        except ForgedControlKey as e:
            raise job_secret.forged(f"the agent of node {self.node}", e.key, e.reason,
                                    True) from e
        except Exception as e:
            self.log(f"HOF of generation {g} seen but unreadable ({type(e).__name__}: {e})")

    # ---- the decision ----------------------------------------------------------------------
    def views(self) -> list[SlotView]:
        out = []
        for s in self.g.slots:
            sh = s.shadow
            live = sh is not None and not sh.done and sh.proc.alive
            out.append(SlotView(s.rank, s.inplace, sh.generation if live else None))
        return out

    def decide(self, failures) -> Decision:
        """`decisions.decide_inplace` over what this agent knows now.  No side effects: it may
        be asked again within one loop turn (`collateral`)."""
        g = self.g
        fs = self.policy.facts(g.slots, g.generation, failures)
        if not fs and self.remote is None:
            return Decision(Action.CONTINUE, "no failure")
        remote = (f"node {self.remote.get('node')} (rank {self.remote.get('rank')}, "
                  f"{self.remote.get('how')})" if self.remote else None)
        return decide_inplace(self.rc.mode, g.generation, fs, self.views(), remote,
                              self.unusable, history=self.policy.history,
                              budget=self.policy.budget, now=time.monotonic(),
                              retained_lost=self.retained_lost())

    def note_restart(self, failures) -> None:
        """The group restarts because of `failures`: the root cause joins the history."""
        fs = self.policy.facts(self.g.slots, self.g.generation, failures)
        self.policy.record(fs[0] if fs else None, self.g.generation, time.monotonic(),
                           inplace=False)

    def collateral(self, sp: SlotProcess) -> bool:
        """Is the death of active `sp` part of a HOF that is (being) recovered in place?  (Once
        this node declared the HOF of its generation, it is: the procedure is under way.)"""
        g = self.g
        if sp.role != SlotRole.ACTIVE:
            return False
        if sp.generation < g.generation or sp.generation in self.declared:
            return True
        return (sp.generation == g.generation and any(f.generation == sp.generation
                                                      for f in g.failures)
                and self.decide(g.failures).action == Action.INPLACE)

    def remote_rank(self) -> int | None:
        return None if self.remote is None else int(self.remote.get("rank", -1))

    # ---- the procedure ---------------------------------------------------------------------
    def apply(self, d: Decision) -> None:
        """Run the HOF procedure for `d`, an INPLACE decision of `decide` this loop turn."""
        failures = self.g.failures
        g = self.g.generation
        t0 = time.monotonic()
        self.log(f"in-place recovery: {d.reason}")
        self.events.emit("decision", g, action=d.action.value, reason=d.reason,
                         **(d.classification.fields() if d.classification else {}))
        fs = self.policy.facts(self.g.slots, g, failures)
        self.policy.record(fs[0] if fs else None, g, t0, inplace=True)
        self._declare(g, failures)
        self._demote(g)
        self._promote(g + 1)
        self.levels.after_recovery()
        held = [Level[sp.level] for _, sp in self.demoted]
        self._adopt_demoted(g + 2)
        # The demoted survivors re-initialize at the level they were started with; the fresh
        # shadows of the same generation must match them at L3 (the group forms only with every
        # rank).  `tick` moves them all to the controller's level afterwards.
        self._spawn_next_shadows(Level.L3 if Level.L3 in held else
                                 Level.L2 if held else None)
        self.events.emit("inplace_done", g + 1, seconds=time.monotonic() - t0)

    def _declare(self, g: int, failures) -> None:
        self.declared.add(g)
        first = next((f for f in failures if f.generation == g), None)
        if first is None:            # another node's HOF: it declared it
            self.events.emit("hof", g, by="remote", **(self.remote or {}))
            return
        value = json.dumps({"rank": first.rank, "how": first.how, "node": self.node,
                            "mono": first.mono})
        try:
            won = self._client().compare_set(C.hof_key(g), "", value).decode() == value
        except ForgedControlKey as e:
            r = self.g.round
            raise job_secret.forged(f"the agent of node {self.node}", e.key, e.reason,
                                    r is not None and r.group_world_size > 1) from e
        except Exception as e:       # the store is ours (or the rank-0 node's): log, go on
            self.log(f"cannot publish the HOF of generation {g}: {type(e).__name__}: {e}")
            won = False
        self.events.emit("hof", g, rank=first.rank, how=first.how, by="local",
                         first_writer=won, failure_mono=first.mono)

    def _demote(self, g: int) -> None:
        """Every local active of generation g is gone or demoted when this returns (module
        docstring, step b).  The failed ones still alive (a hang we killed, not yet reaped) are
        waited for too: no process of generation g may touch retained memory once the go key
        is set."""
        # and a reaped one that is not `quiet`: its forked children still hold its device
        # files (its fence says so), so GPU work of it may still write retained memory.
        alive = [(s, s.active) for s in self.g.slots
                 if s.active is not None and s.active.generation == g
                 and (s.active.proc.alive or not s.active.proc.quiet)]
        self.demoted = []
        kill = alive
        if self.rc.demote == "release":
            survivors = [(s, sp) for s, sp in alive if not sp.done]
            self.demoted = self._release(g, survivors)
            kill = [(s, sp) for s, sp in alive if all(sp is not d for _, d in self.demoted)]
        for slot, sp in kill:
            if not sp.done:
                self.events.emit("demote", g, rank=slot.rank, role=sp.role.value,
                                 pid=sp.proc.pid, mode="replace")
        left = self.g.kill_and_reap(kill, "collateral", DEMOTE_WAIT_S)
        notices = self.g.io.notices
        if notices is not None and notices.gpu:
            left = self._stop_strays(g, left)
        if left and notices is not None and notices.gpu:
            # its device files are still held (its fence not quiet): GPU work of generation g
            # may still write retained memory, so no shadow is promoted onto it
            raise E.Unrecoverable(
                f"pid(s) {', '.join(str(sp.proc.pid) for sp in left)} of generation {g} (or a "
                f"process holding their device files) did not stop within {DEMOTE_WAIT_S:g} s "
                "of SIGKILL: their GPU work may still write the retained state, so it is not "
                "reused -- the job stops; restart it (it resumes from its checkpoint)")

    def _stop_strays(self, g: int, left: list) -> list:
        """A reaped trainer of generation g whose fence did not say quiet (untrusted, or still
        held): a process it forked may still hold its device files, and so keep its GPU work
        running, after the reap.  Such processes are orphans now (reparented to the agent):
        kill every orphan holding a device file and wait for it.  Returns `left` without the
        ones whose fence the strays alone held; raises Unrecoverable if a stray survives."""
        unsure = [s.active for s in self.g.slots if s.active is not None
                  and s.active.generation == g and s.active.proc.status is not None
                  and s.active.proc.fence != "quiet" and not s.active.proc.drained]
        unsure += [sp for sp in left if sp.proc.status is not None and sp not in unsure]
        if not unsure:
            return left
        found, running = self.g.stop_device_strays(settings.get().device_files, DEMOTE_WAIT_S)
        if found:
            self.events.emit("device_strays", g, pids=found, running=running,
                             of=[sp.proc.pid for sp in unsure])
            self.log(f"killed {len(found)} orphaned process(es) holding device files after the "
                     f"death of generation {g}'s trainer(s) (pids {found[:8]}): their GPU work "
                     "must stop before a shadow is promoted")
            self.g.wait(lambda: all(sp.proc.quiet for sp in left), time.monotonic() + 1.0)
        if running:
            raise E.Unrecoverable(
                f"pid(s) {', '.join(map(str, running))} hold device files of generation {g}'s "
                f"dead trainer(s) and did not stop within {DEMOTE_WAIT_S:g} s of SIGKILL: "
                "their GPU work may still write the retained state, so it is not reused -- "
                "the job stops; restart it (it resumes from its checkpoint)")
        return [sp for sp in left if not sp.proc.quiet]

    def _release(self, g: int, survivors) -> list:
        """Ask each survivor to demote itself; returns those that confirmed in time."""
        t0 = time.monotonic()
        for slot, sp in survivors:
            sp.demoted = None
            sp.exit_note = {"collateral": True}      # should it die instead of demoting
            try:
                sp.proc.send(C.DEMOTE_SIGNAL)
            except ProcessLookupError:
                continue
            self.events.emit("demote", g, rank=slot.rank, role=sp.role.value, pid=sp.proc.pid,
                             mode="release", mono=t0)
        # A `demoted` datagram sets sp.demoted (on_datagram); an exit is reaped by the group.
        self.g.wait(lambda: all(sp.demoted is not None or sp.proc.status is not None
                                for _, sp in survivors), t0 + DEMOTE_RELEASE_S)
        done = []
        for slot, sp in survivors:
            if sp.demoted is None or sp.proc.status is not None:
                why = ("exited" if sp.proc.status is not None
                       else f"no confirmation within {DEMOTE_RELEASE_S:g} s")
                self.log(f"rank {slot.rank} (pid {sp.proc.pid}) was not demoted in process "
                         f"({why}); replacing it")
                self.events.emit("demote", g, rank=slot.rank, role=sp.role.value,
                                 pid=sp.proc.pid, mode="replace", reason=why)
                continue
            d = sp.demoted
            self.events.emit("demoted", g, rank=slot.rank, pid=sp.proc.pid,
                             seconds=d.get("seconds"), agent_seconds=time.monotonic() - t0,
                             **{k: v for k, v in d.items() if k.startswith("gpu_")
                                or k in ("views_alive", "left_s", "abort_wait_s", "release_s")})
            done.append((slot, sp))
        return done

    def _adopt_demoted(self, gen: int) -> None:
        """The survivors demoted in process are their slots' shadows of `gen` now (they rewrote
        their environment to exactly that: `contract.demoted_env`)."""
        for slot, sp in self.demoted:
            sp.new_role(SlotRole.SHADOW, gen)
            sp.epoch, sp.ready = 0, False
            sp.wake = False           # until its readiness datagram of the new generation
            slot.procs[SlotRole.SHADOW] = sp
            self.g.relabel(slot, sp)
            self.log(f"rank {slot.rank}: pid {sp.proc.pid} demoted in process to the shadow of "
                     f"generation {gen}")
        self.demoted = []

    def _promote(self, gen: int) -> None:
        woke = time.monotonic()
        slots = self.g.slots
        for slot in slots:
            try:
                self._client().set(C.go_key(gen, slot.rank), json.dumps({"mono": woke}))
            except Exception as e:
                # A shadow without its go key never wakes, and one listed as active but asleep
                # has no heartbeat to time out: stop, saying why, rather than wait forever.
                raise E.RendezvousFailed(
                    f"cannot set the go key of rank {slot.rank} for generation {gen} "
                    f"({type(e).__name__}: {e}): its shadow cannot be promoted") from e
        for slot in slots:
            sp = slot.procs.pop(SlotRole.SHADOW)
            if sp.ready and sp.wake:    # its runtime handles the signal (it said so)
                sp.proc.send(C.PROMOTE_SIGNAL)
            sp.new_role(SlotRole.ACTIVE, gen)
            # Bounded like any wait: its `promoted` is due within --hang-timeout, else it is
            # a hang of its own rank (its peers would wait for it until --pg-timeout).
            sp.expect(woke, self.rc.hang_timeout, UNCONFIRMED if sp.ready else UNREADY)
            slot.procs[SlotRole.ACTIVE] = sp
            self.g.relabel(slot, sp)
            self.events.emit("promote", gen, rank=slot.rank, local_rank=slot.local_rank,
                             pid=sp.proc.pid, epoch=sp.epoch, ready=sp.ready, level=sp.level,
                             mono=woke)
        self.g.advance(gen, "shadows promoted on ranks "
                       f"{', '.join(str(s.rank) for s in slots)}")
        self.remote, self.epoch, self.respawns = None, 0, 0
        if self.watcher:
            self.watcher.advanced.set()
        self.g.arm(woke)

    def _spawn_next_shadows(self, like: Level | None = None) -> None:
        for slot in self.g.slots:
            if slot.shadow is None:
                lv = self.levels.start_level(slot.rank)
                self._spawn_shadow(slot, like if like == Level.L3 else
                                   Level(min(lv, like)) if like is not None else lv)

    # ---- shadows that die ------------------------------------------------------------------
    def on_shadow_exit(self, slot: RankSlot, sp: SlotProcess, status: ExitStatus) -> None:
        if not sp.done:
            sp.move(ProcState.FAILED)
        self.events.emit("shadow_exit", sp.generation, rank=slot.rank, pid=sp.proc.pid,
                         epoch=sp.epoch, how=status.describe(), mono=status.mono)
        if sp.generation != self.g.generation + 1:
            return                       # an older shadow; nothing depends on it
        r = self.g.round
        if r is not None and r.group_world_size > 1:
            self.unusable = (f"a shadow of generation {sp.generation} died on node {self.node} "
                             "and shadows of several nodes cannot be restarted together")
            self.log(f"warning: rank {slot.rank}'s shadow died ({status.describe()}); the next "
                     "HOF falls back to a restart")
            return
        self.respawns += 1
        if self.respawns > MAX_SHADOW_RESPAWNS:
            self.unusable = (f"shadows of generation {sp.generation} died "
                             f"{self.respawns} times")
            self.log(f"warning: {self.unusable}; not restarting them again (the next HOF falls "
                     "back to a restart)")
            self._kill_shadows()
            return
        self.log(f"rank {slot.rank}'s shadow (pid {sp.proc.pid}) died before its promotion "
                 f"({status.describe()}); restarting every shadow of generation "
                 f"{sp.generation} with epoch {self.epoch + 1}")
        self._kill_shadows()
        self.epoch += 1
        self.events.emit("shadow_respawn", sp.generation, rank=slot.rank, epoch=self.epoch,
                         reason=status.describe())
        for s in self.g.slots:
            if s.inplace:
                self._spawn_shadow(s)

    def _kill_shadows(self) -> None:
        victims = [(s, s.shadow) for s in self.g.slots if s.shadow is not None]
        self.g.kill_and_reap(victims, "stopped", DEMOTE_WAIT_S)
        for slot, sp in victims:
            if slot.procs.get(SlotRole.SHADOW) is sp:
                del slot.procs[SlotRole.SHADOW]


def _json(text: str | None) -> dict:
    if not text:
        return {}
    try:
        v = json.loads(text)
        return v if isinstance(v, dict) else {}
    except ValueError:
        return {}
