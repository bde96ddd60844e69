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

Calling contract: the agent's main thread; `decide` reads the checkpoint directory (a listing
and the manifests, no data).  `used` counts the fallbacks, bounded by `--max-fallbacks`.
"""
from __future__ import annotations

import fcntl
import os
import time

from leto_run.config_checkpoint import CheckpointConfig
from leto_run.decisions import Action, Decision
from leto_run.errors import ConfigError
from leto_runtime.wire import ckpt_files as F


def decide_fallback(mode: str, directory: str | None, found: F.Found | None,
                    torn: list[F.Found], used: int, max_fallbacks: int,
                    multi_node: bool = False) -> tuple[bool, str]:
    """Can the job fall back to a checkpoint? -> (yes, why)."""
    if mode == "off":
        return False, "checkpointing is off (no --checkpoint-dir), so there is nothing to fall " \
                      "back to"
    if multi_node:
        # The other nodes would rejoin from their retained state, this one from the checkpoint:
        # ranks at different steps.  Until every node falls back together, stop instead.
        return False, ("a checkpoint fallback of a multi-node job is not built yet (every node "
                       "must fall back together); resume the job from the newest checkpoint in "
                       f"{directory} with the script's own dcp.load")
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

    def __init__(self, group, cfg: CheckpointConfig, sms, multi_node: bool = False):
        self.group, self.cfg, self.sms, self.multi_node = group, cfg, sms, multi_node
        self.used = 0
        self.chosen: F.Found | None = None
        self.started = 0.0

    def decide(self, reason: str) -> tuple[Decision | None, str]:
        """A FALL_BACK decision for a failure of `reason`, or (None, why not)."""
        found = torn = None
        if self.cfg.mode != "off":
            scan = F.scan(self.cfg.dir)
            done = [f for f in scan if f.complete]
            found = done[-1] if done else None
            torn = [f for f in scan if not f.complete]
        ok, why = decide_fallback(self.cfg.mode, self.cfg.dir, found, torn or [], self.used,
                                  self.cfg.max_fallbacks, self.multi_node)
        if not ok:
            return None, why
        self.chosen = found
        return Decision(Action.FALL_BACK, f"{reason}; {why}"), why

    def apply(self, decision: Decision, failed_step: int | None) -> None:
        """Stop the group, fresh retained memory, the next attempt loads `self.chosen`."""
        g, found = self.group, self.chosen
        t0 = time.monotonic()
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
        """Restart mode: a restarted group resumes from the newest complete checkpoint (one
        node: nodes that saw different newest checkpoints would resume at different steps)."""
        found = F.newest(self.cfg.dir) if self.cfg.mode != "off" and not self.multi_node \
            else None
        self.group.checkpoint_load = found.path if found else None
        if found:
            self.group.log(f"the restarted group resumes from the checkpoint of step "
                           f"{found.step} ({found.path})")

    def started_attempt(self) -> None:
        """The attempt after a fallback has started: later restarts resume from retained
        memory, which is then newer than the checkpoint."""
        self.group.checkpoint_load = None


LOCK_NAME = ".leto-checkpoint.lock"


class DirLock:
    """One leto-run job per checkpoint directory: an exclusive flock on DIR/.leto-checkpoint.lock
    for the job's life (two jobs rotating each other's checkpoints out would lose both).  Taken
    in the agent's start-up, before any process starts; `release` removes the file."""

    def __init__(self, directory: str):
        os.makedirs(directory, exist_ok=True)
        self.path = os.path.join(directory, LOCK_NAME)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(self.fd, 64, 0).decode(errors="replace").strip() or "?"
            os.close(self.fd)
            raise ConfigError("checkpoint.dir", f"{directory!r} is in use by another leto-run "
                              f"job (pid {holder}, per {LOCK_NAME})",
                              "give each job its own --checkpoint-dir") from None
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, str(os.getpid()).encode(), 0)

    def release(self) -> None:
        if self.fd >= 0:
            try:
                os.unlink(self.path)
            except OSError:
                pass
            os.close(self.fd)
            self.fd = -1
