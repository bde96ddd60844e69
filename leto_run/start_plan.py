"""Where every node of a multi-node job starts an attempt from: the same state on every node.

In-place recovery keeps each node's state in its own retained memory, so after a restart
round the nodes resume from there -- unless one of them cannot: it falls back to a checkpoint
(its retained state is lost), or it is a replacement node whose agent has none (and whose
count of generations, which the workers' keys carry, starts again at 0).  Ranks that
start from different states would train on contradicting values, so right after each
rendezvous round the agents agree: each publishes a `StartView` in the round's store and reads
everyone's, and `decide_start` (a pure function of the views, hence the same on every node)
says where all of them start.  A node that falls back also says so at once in the round's
store (`announce_fallback`), so that the other nodes restart instead of taking the failures of
its stopped trainers for a HOF (`fallback_announced`).

Calling contract: the agent's main thread; `exchange` right after `rendezvous.next_round`
returned (every agent of the round calls it), before any worker starts.  Store operations are
bounded by the store's timeout; the values carry the job's MAC where the store is an
`AuthStore`.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass

VIEW_KEY = "leto/start/{}"
FALLBACK_KEY = "leto/fallback"


@dataclass(frozen=True)
class StartView:
    node: str
    retained: bool               # in-place mode: this node's state managers hold a job's state
    resume: str | None           # the checkpoint this node starts from by itself (a fallback)
    newest: str | None           # the newest complete checkpoint this node sees
    generation: int = 0          # the generation this node's attempt would run


@dataclass(frozen=True)
class StartPlan:
    path: str | None             # the checkpoint every node loads (None: as each one is)
    reason: str
    stop: bool = False           # no state every node can start from: the job ends
    generation: int = 0          # every node runs this one (its workers' keys carry it)


def decide_start(views: list[StartView]) -> StartPlan:
    """The plan for views in group-rank order (every node decides the same).  The generation
    is the highest: a replacement node's count starts again at 0."""
    plan = _where(views)
    return StartPlan(plan.path, plan.reason, plan.stop, max(v.generation for v in views))


def _where(views: list[StartView]) -> StartPlan:
    named = [v for v in views if v.resume]
    if named:
        v = named[0]
        return StartPlan(v.resume, f"node {v.node} starts from the checkpoint {v.resume}: every "
                         "node does")
    held = [v for v in views if v.retained]
    if held and len(held) < len(views):
        fresh = ", ".join(v.node for v in views if not v.retained)
        newest = next((v.newest for v in views if v.newest), None)
        if newest is None:
            return StartPlan(None, f"node(s) {fresh} joined without the retained state the "
                             "other nodes hold (a replacement), and no complete checkpoint "
                             "exists to start every node from", stop=True)
        return StartPlan(newest, f"node(s) {fresh} joined without the retained state the other "
                         f"nodes hold (a replacement): every node starts from the checkpoint "
                         f"{newest}")
    return StartPlan(None, "every node starts from its retained state" if held
                     else "no node holds retained state")


def exchange(store, group_rank: int, world: int, mine: StartView) -> list[StartView]:
    """Publish `mine`, return every node's view in group-rank order (blocks until all are
    there, at most the store's timeout per read)."""
    store.set(VIEW_KEY.format(group_rank), json.dumps(asdict(mine)))
    raw = store.multi_get([VIEW_KEY.format(i) for i in range(world)])
    return [StartView(**json.loads(b)) for b in raw]


def announce_fallback(store, node: str, path: str) -> None:
    store.set(FALLBACK_KEY, json.dumps({"node": node, "path": path}))


def fallback_announced(store) -> dict | None:
    """Another node's fallback in this round, or None (never blocks on a missing key)."""
    if not store.check([FALLBACK_KEY]):
        return None
    return json.loads(store.get(FALLBACK_KEY))
