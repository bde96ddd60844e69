"""The multi-node policy: every node of a round starts from the same state, and a lost node is
told apart from a HOF.

Role: a policy over the worker group, beside the in-place, restart and fallback policies.
`agree(round)` runs right after each rendezvous round of a multi-node job, before any worker
starts: the agents exchange their `start_plan.StartView`s and all follow `decide_start` --
the checkpoint another node falls back to, or the newest one when a replacement node joined
without the retained state the others hold, and the highest generation (the workers' keys
carry it).  `watch(now)`, once per supervision turn of an in-place job, turns what the peers'
beats (`leto_run.peers`) and the round's store say into a decision: a lost node is
UNRECOVERABLE (the agent falls back to the checkpoint, and the next round admits a
replacement), another node's announced fallback is a RESTART that does not count, and a local
failure that is not a signal's waits (CONTINUE) until every peer has beaten after it or a
remote HOF is declared -- so that the closed connections a lost node leaves are not recovered
in place, over and over.  The beats come from the watcher's own thread (`leto_run.peers`).

Calling contract: the agent's main thread; single-node jobs: `agree` and `watch` return None.
`close` at the end of the job.  `watch` makes no store call (the beats' thread reads for it):
a store whose host stopped cannot stall the agent's loop.
"""
from __future__ import annotations

import time

from leto_run import errors as E
from leto_run import job_secret, start_plan
from leto_run.decisions import Action, Decision
from leto_run.peers import PeerWatch
from leto_runtime.control_auth import ForgedControlKey


class NodesPolicy:
    def __init__(self, group, fallback, sms, inplace, node: str, peer_timeout: float, restart,
                 scoped: bool = True):
        self.group, self.fallback, self.sms, self.inplace = group, fallback, sms, inplace
        self.node, self.peer_timeout, self.restart = node, peer_timeout, restart
        # The static rendezvous' store is not scoped to the round: a view or a beat of an
        # earlier round would read as this one's.  No agreement there (no fallback either:
        # `FallbackPolicy` refuses it for multi-node static jobs).
        self.scoped = scoped
        self.peers: PeerWatch | None = None

    def close(self, join: bool = False) -> None:
        if self.peers is not None:
            self.peers.close(join)
        self.peers = None

    def done(self) -> None:
        """Every local worker succeeded: the peers must not take our silence (the exit
        barrier, then our exit) for a lost node."""
        if self.peers is not None:
            self.peers.finish()

    def agree(self, r) -> Decision | None:
        """Every node of round `r` starts from the same state; an UNRECOVERABLE decision when
        there is none."""
        self.close()
        if r.group_world_size <= 1 or not self.scoped:
            return None
        g = self.group
        if self.inplace:
            self.peers = PeerWatch(r.store, r.group_rank, self.peer_timeout, time.monotonic())
        mine = start_plan.StartView(self.node, bool(self.sms and self.sms.holding()),
                                    g.checkpoint_load, self.fallback.newest(), g.generation)
        try:
            if self.peers:
                self.peers.start()
            views = start_plan.exchange(r.store, r.group_rank, r.group_world_size, mine)
        except ForgedControlKey as e:
            raise job_secret.forged("the start agreement", e.key, e.reason, True) from e
        except Exception as e:
            raise E.RendezvousFailed(f"the start agreement of round {g.generation}: "
                                     f"{type(e).__name__}: {e}") from e
        if self.peers:
            self.peers.meet([v.node for v in views], time.monotonic())
            self.peers.run()
        plan = start_plan.decide_start(views)
        if plan.generation > g.generation:
            g.attempt_base_gen = plan.generation
            g.advance(plan.generation, "the generation every node of the round runs")
        g.events.emit("start_plan", g.generation, path=plan.path, reason=plan.reason,
                      stop=plan.stop)
        if plan.stop:
            return Decision(Action.UNRECOVERABLE, plan.reason)
        if plan.path and plan.path != g.checkpoint_load:
            why = self.fallback.follow(plan.path, plan.reason, self.inplace is not None)
            if why:
                return Decision(Action.UNRECOVERABLE, f"{plan.reason}; {why}")
            if self.inplace is not None:
                self.restart.note_fallback()   # the attempt counts as the deciding node's does
        return None

    def watch(self, now: float) -> Decision | None:
        """UNRECOVERABLE (a lost node), RESTART (another node falls back), CONTINUE (a local
        failure waits to hear from every peer), or None: the other policies decide."""
        g, p = self.group, self.peers
        if p is None:
            return None
        try:
            lost = p.lost(now)
        except ForgedControlKey as e:
            raise job_secret.forged("a peer agent's beat", e.key, e.reason, True) from e
        if lost:
            return Decision(Action.UNRECOVERABLE, lost)
        if not g.failures:
            return None
        # Read by the beats' thread after the counters `heard_since` judges: once every peer
        # has beaten after this failure, a fallback announced before it has been seen.
        fb = p.announced()
        if fb:
            return Decision(Action.RESTART, f"node {fb.get('node')} falls back to the "
                            f"checkpoint {fb.get('path')}: every node does")
        first = min(f.mono for f in g.failures)
        if (self.inplace.remote is None and any(f.exitcode >= 0 for f in g.failures)
                and not p.heard_since(first)):
            return Decision(Action.CONTINUE, "waiting to hear from every peer agent")
        return None
