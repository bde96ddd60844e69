"""The checkpoint fallback: a failure that in-place recovery cannot take resumes from the newest
complete checkpoint of `--checkpoint-dir` (paper §3: Leto recovers HOFs in place and falls back
to checkpoints for everything else).

Role: `FallbackPolicy` is one more policy over the worker group, beside the in-place and the
restart policies.  The agent asks it when its decision is UNRECOVERABLE (page losses beyond the
tolerance, contradicting markers, a state manager gone for good): `decide(reason)` returns a
FALL_BACK decision naming the checkpoint (or why none can be used: `decide_fallback`, a pure
function), and `apply` stops the group, drops every slot's retained memory (fresh state
managers: `StateManagers.reset`) and tells the next attempt's trainers which checkpoint to load
(LETO_CHECKPOINT_LOAD).  The agent's loop then starts the next attempt (a new rendezvous round),
whose trainers load the checkpoint into fresh retained memory and parity and redo the steps
after it; in-place recovery goes on from there.  Torn checkpoints (`ckpt_files.check`) are
never chosen.

Several nodes fall back together: `apply` announces the fallback in the round's store before it
stops the group (`start_plan.announce_fallback`: the other nodes restart instead of taking
their trainers' failures for a HOF), and after the next rendezvous round every node starts
from the checkpoint the round agreed on (`leto_run.nodes`; `follow` on the nodes that did not
decide it).

A checkpoint still being written by a live process of the group when the failure comes (rank
0's shadow writes beside training: a trainer's exit with 86 does not end that write) is waited
for, up to WRITE_WAIT_S, before the choice: stopping the group would tear it and the fallback
would go back one interval more (`in_flight`, a pure function).

Calling contract: the agent's main thread; `decide` reads the checkpoint directory (a listing
and the manifests, no data), and may wait for a write in flight (bounded).  `used` counts the fallbacks, bounded by `--max-fallbacks`.
"""
from __future__ import annotations

import time

from leto_run import start_plan
from leto_run.config_checkpoint import CheckpointConfig
from leto_run.decisions import Action, Decision
from leto_run.procs import stat_fields
from leto_runtime.wire import ckpt_files as F

WRITE_WAIT_S = 120.0     # longer than a 13 GB write on the H200 (15-19 s), shorter than an interval
POLL_S = 0.1


def in_flight(scan: list[F.Found], live: set[int]) -> F.Found | None:
    """The partial checkpoint newer than every complete one whose writer is a live process of
    the group, or None."""
    done = [f for f in scan if f.complete]
    top = done[-1].step if done else -1
    for f in reversed(scan):
        if not f.complete and f.step > top and F.partial_pid(f.path) in live:
            return f
    return None


def decide_fallback(mode: str, directory: str | None, found: F.Found | None,
                    torn: list[F.Found], used: int, max_fallbacks: int,
                    static_nodes: bool = False) -> tuple[bool, str]:
    """Can the job fall back to a checkpoint? -> (yes, why).  `static_nodes`: a multi-node job
    on the static rendezvous, whose store is not scoped to the round (no start agreement)."""
    if mode == "off":
        return False, "checkpointing is off (no --checkpoint-dir), so there is nothing to fall " \
                      "back to"
    if static_nodes:
        return False, ("a multi-node job on the static rendezvous cannot fall back (its nodes "
                       "cannot agree where to start: use --rdzv-backend c10d); resume from the "
                       f"newest checkpoint in {directory} with the script's own dcp.load")
    if used >= max_fallbacks:
        return False, f"all {max_fallbacks} checkpoint fallbacks used (--max-fallbacks)"
    if found is None:
        skipped = f"; {len(torn)} torn one(s) skipped" if torn else ""
        return False, f"no complete checkpoint in {directory} yet{skipped}"
    skipped = (" (newer torn one(s) skipped: " + ", ".join(
        f"{f.path}: {f.reason}" for f in torn if f.step > found.step) + ")"
        if any(f.step > found.step for f in torn) else "")
    return True, (f"falling back to the checkpoint of step {found.step} ({found.path}), "
                  f"fallback {used + 1} of {max_fallbacks}{skipped}")


class FallbackPolicy:
    action = Action.FALL_BACK

    def __init__(self, group, cfg: CheckpointConfig, sms, static_nodes: bool = False):
        self.group, self.cfg, self.sms, self.static_nodes = group, cfg, sms, static_nodes
        self.used = 0
        self.chosen: F.Found | None = None
        self.started = 0.0

    def decide(self, reason: str) -> tuple[Decision | None, str]:
        """A FALL_BACK decision for a failure of `reason`, or (None, why not)."""
        found = torn = None
        if self.cfg.mode != "off":
            self._await_write()
            scan = F.scan(self.cfg.dir)
            done = [f for f in scan if f.complete]
            found = done[-1] if done else None
            torn = [f for f in scan if not f.complete]
        ok, why = decide_fallback(self.cfg.mode, self.cfg.dir, found, torn or [], self.used,
                                  self.cfg.max_fallbacks, self.static_nodes)
        if not ok:
            return None, why
        self.chosen = found
        return Decision(Action.FALL_BACK, f"{reason}; {why}"), why

    def _await_write(self) -> None:
        g, end, said = self.group, time.monotonic() + WRITE_WAIT_S, False
        while True:
            live = {p for p in g.known_pids() if _alive(p)}
            f = in_flight(F.scan(self.cfg.dir), live)
            if f is None:
                return
            if time.monotonic() > end:
                g.log(f"the checkpoint of step {f.step} was not written within "
                      f"{WRITE_WAIT_S:g} s; falling back without it")
                return
            if not said:
                g.log(f"waiting for the checkpoint of step {f.step} (pid "
                      f"{F.partial_pid(f.path)} writes it) before the fallback")
                said = True
            time.sleep(POLL_S)

    def apply(self, decision: Decision, failed_step: int | None) -> None:
        """Stop the group, fresh retained memory, the next attempt loads `self.chosen`."""
        g, found = self.group, self.chosen
        t0 = time.monotonic()
        r = g.round
        if r is not None and r.group_world_size > 1:
            # Before our trainers stop: the other nodes must restart and not take the failures
            # our stop causes them for a HOF.
            try:
                start_plan.announce_fallback(r.store, g.spec.node, found.path)
            except Exception as e:     # the store's host is gone: the round ends anyway
                g.log(f"cannot announce the fallback to the other nodes: "
                      f"{type(e).__name__}: {e}")
        g.stop(decision.reason)
        if self.sms is not None:
            self.sms.reset()
        self.used += 1
        g.checkpoint_load = found.path
        g.events.emit("fallback", g.generation, reason=decision.reason, path=found.path,
                      step=found.step, failed_step=failed_step, used=self.used,
                      stop_s=time.monotonic() - t0)
        g.log(f"checkpoint fallback {self.used}: the next attempt starts from step "
              f"{found.step} ({found.path})")

    def for_restart(self) -> None:
        """Restart mode: a restarted group resumes from the newest complete checkpoint (several
        nodes: the one `start_plan` picks, the same on every node)."""
        found = (F.newest(self.cfg.dir) if self.cfg.mode != "off" and not self.static_nodes
                 else None)
        self.group.checkpoint_load = found.path if found else None
        if found:
            self.group.log(f"the restarted group resumes from the checkpoint of step "
                           f"{found.step} ({found.path})")

    def newest(self) -> str | None:
        found = F.newest(self.cfg.dir) if self.cfg.mode != "off" else None
        return found.path if found else None

    def follow(self, path: str, why: str, inplace: bool) -> str | None:
        """The nodes agreed to start from `path` (`start_plan`): in-place mode drops this
        node's retained state for it (a fallback of its own, counted); None, or why it
        cannot."""
        g = self.group
        found = F.check(path)
        if not found.complete:      # (a shared directory this node sees otherwise, or torn since)
            return f"the agreed checkpoint {path} is not complete on this node: {found.reason}"
        if inplace:
            if self.used >= self.cfg.max_fallbacks:
                return f"all {self.cfg.max_fallbacks} checkpoint fallbacks used (--max-fallbacks)"
            if self.sms is not None:
                self.sms.reset()
            self.used += 1
            g.events.emit("fallback", g.generation, reason=why, path=path,
                          step=found.step, failed_step=None, used=self.used, by="peer")
        g.checkpoint_load = path
        g.log(f"the nodes agreed: {why}")
        return None

    def started_attempt(self) -> None:
        """The attempt after a fallback has started: later restarts resume from retained
        memory, which is then newer than the checkpoint."""
        self.group.checkpoint_load = None


def _alive(pid: int) -> bool:
    """Running (a zombie is not: the agent's loop, which reaps, waits here)."""
    f = stat_fields(f"/proc/{pid}/stat")
    return f is not None and f[0][:1] not in (b"Z", b"X")
