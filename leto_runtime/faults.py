"""Step-triggered failure injection inside a trainer that uses the runtime API (`job.py`).

The agent hands every trainer its rank's injections (`LETO_INJECT_PLAN`, the JSON of
`leto_run.inject.InjectSpec.to_json()`).  Under the runtime API this module owns them: it fires
each one when the trainer reaches its point (`at=`, one of `contract.INJECT_POINTS`; default
`step`, the start of the step), in its generation (`gen=`, default 0, so a fault fires once and
not again when the promoted trainer replays the step), at its step (and, for `rmu.*` points,
its `group=` / `chunk=` when given).

What firing does: `pages` asks the state manager to destroy and unmap pages (and the trainer
goes on); `kill` / `signal` send the real signal to this process (after `garbage=1` scribbled
over the chunk being updated and its scratch parity, as a kill inside a kernel would leave
them); `hang` blocks the main thread for good.  Every firing is announced to the agent first
(heartbeat datagram `inject`), so the recovery report can time detection.

Before anything fires (and before a demotion is honoured) the CUDA device is synchronized: the
updater queues its work and its marker writes in stream order without waiting
(`leto_runtime.rmu.updater`), and a kill point means "everything before this point has happened"
-- a fault never lands while the GPU still works behind the host.

An injection that can no longer fire is reported to the agent (datagram `unfired`, detail
JSON {"spec", "reason"}; the agent records an `inject_unfired` warning) and dropped from the
plan: one at a point inside a step once that step's update is over (`rmu.settle`) or a later step
began -- typically an `rmu.*` point naming a group or chunk the model does not have, or a point
the step never reaches -- and a `recovery.*` one once the training loop began.

Calling contract: `Faults(ctx)`; `fire(point, step=..., group=..., chunk=..., garbage=...)` at
each point; cheap when nothing is planned.
"""
from __future__ import annotations

import json
import os
import signal
import sys

from leto_runtime import beats, demotion
from leto_runtime.context import Context

PREINIT_ACK_S = 300.0        # an injected level change: the longest the active waits for it


def _settle() -> None:
    """Wait for queued CUDA work of this process (nothing to do without CUDA in use)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _get(inj: dict, key: str, default=None):
    if key in inj and inj[key] is not None:
        return inj[key]
    return (inj.get("params") or {}).get(key, default)


class Faults:
    def __init__(self, ctx: Context):
        self.ctx = ctx
        self.beats = beats.channel()
        self.beats.take_plan()
        self.plan = [dict(i) for i in ctx.inject_plan
                     if i.get("step") is not None and int(_get(i, "gen", 0)) == ctx.generation]
        self._first_step: int | None = None       # the first step of this trainer's loop
        self._seen_step: int | None = None        # the step `_seen` describes
        self._seen: dict[str, dict[int, int]] = {}    # rmu point -> {group: highest chunk}

    def _matches(self, inj: dict, point: str, step, group, chunk) -> bool:
        if (_get(inj, "at") or "step") != point:
            return False
        if point.startswith("recovery."):
            return True
        if step is None:
            return False
        if point == "step" and step < inj["step"]:
            return False
        if point != "step" and step != inj["step"]:
            return False
        for key, val in (("group", group), ("chunk", chunk)):
            want = _get(inj, key)
            if want is not None and inj.get("kind") != "pages" and val is not None and int(want) != val:
                return False
            if want is not None and inj.get("kind") != "pages" and val is None:
                return False
        return True

    def _pages_with(self, inj: dict) -> list[dict]:
        """Page losses planned at the same point and step as `inj`: they strike together with
        that HOF (the paper's failure model), not at the first occurrence of the point."""
        at, step = _get(inj, "at") or "step", inj.get("step")
        return [i for i in self.plan if i.get("kind") == "pages"
                and (_get(i, "at") or "step") == at and i.get("step") == step]

    def _fire_pages(self, inj: dict, step) -> None:
        from leto_runtime.rmp.faults import fire_pages_spec
        from leto_runtime.wire.protocol import RmpError
        self.plan.remove(inj)
        text = inj.get("text") or "pages"
        try:
            fire_pages_spec(self.ctx.sm_socket, inj.get("params") or {})
        except RmpError as e:       # pages this pool does not have (a group past the model...)
            self.beats.send("unfired", step, json.dumps({"spec": text, "reason": f"the state manager "
                                                 f"refused it: {e}"}))
            return
        self.beats.send("inject", step, text)

    def fire(self, point: str, *, step=None, group=None, chunk=None, garbage=None) -> None:
        # Every injection point is a tested kill point, hence a safe point to leave the run
        # when the agent demotes this active (`leto_runtime.demotion`).  Not inside autograd's
        # backward hooks: an exception there is rewrapped by the engine.
        if point != "backward":
            if demotion.requested():
                _settle()
            demotion.check()
        if not self.plan:
            return
        if point == "step" and step is not None:
            if self._first_step is None:
                self._first_step = step
            self._expire(step, through=False)
        elif group is not None and step is not None:
            self._saw(point, step, group, chunk)
        self._fire(point, step, group, chunk, garbage)
        if point == "rmu.settle" and step is not None and self.plan:
            self._expire(step, through=True)

    def fire_in_thread(self, point: str, step: int) -> None:
        """A fault point of a helper thread (the checkpoint writer): no demotion check, which
        belongs to the training thread."""
        if self.plan:
            self._fire(point, step, None, None, None)

    def _fire(self, point: str, step, group, chunk, garbage) -> None:
        hofs = [i for i in self.plan if i.get("kind") != "pages"
                and self._matches(i, point, step, group, chunk)]
        if hofs or any(i.get("kind") == "pages" and self._matches(i, point, step, None, None)
                       for i in self.plan):
            _settle()
        if not hofs:
            for inj in [i for i in self.plan if i.get("kind") == "pages"
                        and self._matches(i, point, step, None, None)]:
                paired = any(i.get("kind") != "pages" and i in self.plan and
                             inj in self._pages_with(i) for i in self.plan)
                if not paired:
                    self._fire_pages(inj, step)
            return
        inj = hofs[0]
        if inj.get("kind") == "preinit":
            self.plan.remove(inj)
            self.beats.send("inject", step, inj.get("text") or "preinit")
            self._wait_preinit(inj, step)
            return
        for pages in self._pages_with(inj):
            self._fire_pages(pages, step)
        self.plan.remove(inj)
        text = inj.get("text") or inj.get("kind")
        self.beats.send("inject", step, text)
        if inj.get("kind") == "hang":
            beats.block_forever(f"injected hang at {point} of step {step} ({text})")
        if _get(inj, "garbage") and garbage is not None:
            garbage()
        sys.stderr.write(f"[leto_runtime] injecting '{text}' at {point} of step {step}\n")
        sys.stderr.flush()
        sys.stdout.flush()
        os.kill(os.getpid(), int(inj.get("signal") or signal.SIGKILL))
        import time
        time.sleep(1.0)    # a catchable signal with a handler may return; the kill stands

    def _wait_preinit(self, inj: dict, step) -> None:
        """An injected level change: the agent relaunches the shadows at the level and sets
        `contract.preinit_ack_key` once they are ready; this active waits for it (beating, so
        it is not taken for hung), at most PREINIT_ACK_S, so a kill injected at a later step
        meets the new shadows."""
        import time
        from leto_runtime import promotion
        from leto_runtime.wire import contract as C
        key = C.preinit_ack_key(self.ctx.generation, self.ctx.rank, int(step))
        store = promotion.worker_store(self.ctx, timeout=min(30.0, self.ctx.pg_timeout))
        t0 = next_beat = time.monotonic()
        while not store.check([key]):
            now = time.monotonic()
            if now > t0 + PREINIT_ACK_S:
                sys.stderr.write(f"[leto_runtime] warning: the agent did not confirm "
                                 f"'{inj.get('text')}' within {PREINIT_ACK_S:g} s; going on\n")
                return
            if now >= next_beat:
                beats.heartbeat(step)
                next_beat = now + 1.0
            time.sleep(0.05)
        store.get(key)              # verified (a forged value raises, the job stops)

    # ---- injections that can no longer fire ------------------------------------------------
    def _saw(self, point: str, step: int, group: int, chunk) -> None:
        if self._seen_step != step:
            self._seen_step, self._seen = step, {}
        groups = self._seen.setdefault(point, {})
        groups[group] = max(groups.get(group, -1), -1 if chunk is None else int(chunk))

    def _expire(self, step: int, through: bool) -> None:
        """Report and drop what cannot fire any more: at the start of step `step`
        (`through=False`) a `recovery.*` injection or a step-exact one of an earlier step; at
        the end of step `step`'s update (`through=True`) a step-exact one of `step` too."""
        for inj in list(self.plan):
            at = _get(inj, "at") or "step"
            if at in ("step", "checkpoint.write", "checkpoint.snapshot") or (through and at.startswith("recovery.")):
                continue          # (the checkpoint writer's thread reaches its point later)
            s = inj.get("step")
            if not at.startswith("recovery.") and not (s < step or (through and s == step)):
                continue
            self.plan.remove(inj)
            text = inj.get("text") or inj.get("kind")
            self.beats.send("unfired", step, json.dumps({"spec": text, "reason": self._why(inj, at)}))

    def _why(self, inj: dict, at: str) -> str:
        s, first = inj.get("step"), self._first_step
        if at.startswith("recovery."):
            return (f"the recovery of generation {self.ctx.generation} is over (its training "
                    f"loop began at step {first}) and never reached at={at}")
        if first is not None and s < first:
            return (f"generation {self.ctx.generation} began training at step {first}, after "
                    f"step {s}")
        if at == "rmu.lookahead":
            return (f"step {s}'s update never waited for the GPU where the spec names: the point "
                    "comes only on CUDA with stream-ordered marker writes and LETO_RMU_LOOKAHEAD "
                    "> 0, once that many chunks of the update are queued (not at its first ones)")
        groups = self._seen.get(at) if self._seen_step == s else None
        g, c = _get(inj, "group"), _get(inj, "chunk")
        if groups and inj.get("kind") != "pages" and g is not None:
            if int(g) not in groups:
                return (f"the model has no protection group {g}: at={at} of step {s} ran for "
                        f"group(s) {min(groups)}..{max(groups)}")
            if c is not None and groups[int(g)] >= 0:
                return (f"protection group {g} has no chunk {c}: at={at} of step {s} ran for "
                        f"its chunk(s) 0..{groups[int(g)]}")
        return f"step {s} passed without reaching at={at}"
