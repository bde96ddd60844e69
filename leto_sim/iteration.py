"""The iteration-time model of the paper's Appendix C.1, as pure functions.

Role: predict the fault-free iteration time T_iter = T_pipeline + T_sync + T_update of one
deployment from single-stage profiles (:class:`leto_sim.config.Workload`).  Nothing here knows
about failures or systems; the per-system steady-state overheads (Leto's RMU update, the
checkpoint stall) are added on top by systems.py, from this T_iter.

Calling contract: every function is pure (same inputs, same result, no I/O) and takes seconds,
parameter counts and bytes; :func:`iteration_time` returns an :class:`IterationBreakdown`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .config import Collective, Stage, Workload

#: Megatron's gradient bucket: max(40M, 1M * dp) parameters (C.1.3).
BUCKET_FLOOR = 40_000_000
BUCKET_PER_DP = 1_000_000


@dataclass(frozen=True)
class IterationBreakdown:
    """The terms of T_iter, seconds; `exposed` is the queue's E (or E' for MoE)."""
    pipeline: float
    sync: float
    update: float
    exposed: float
    serial_sync: float
    buckets: int

    @property
    def total(self) -> float:
        return self.pipeline + self.sync + self.update


def stage_time(stage: Stage) -> float:
    """stage(s): its brackets (forward + backward) plus p2p transfers and embedding/head."""
    return sum(b.forward + b.backward for b in stage.brackets) + stage.p2p + stage.extra


def pipeline_time(microbatches: int, stages: list[float] | tuple[float, ...],
                  virtual: int = 1) -> float:
    """T_pipeline = (M + (S - 1) / v) * max_s stage(s) (C.1.1): the bottleneck stage paces
    every microbatch, and the fill/drain bubble shrinks with the interleaving degree v."""
    if microbatches < 1 or virtual < 1 or not stages:
        raise ValueError("need microbatches >= 1, virtual >= 1 and at least one stage")
    s = len(stages)
    return (microbatches + (s - 1) / virtual) * max(stages)


def bucket_sizes(stage_params: float, dp: int) -> list[float]:
    """Parameters per gradient bucket: full buckets of max(40M, 1M*dp), the remainder last."""
    size = max(BUCKET_FLOOR, BUCKET_PER_DP * dp)
    full = int(stage_params // size)
    rest = stage_params - full * size
    return [float(size)] * full + ([rest] if rest > 0 else [])


def collective_time(nbytes: float, dp: int, coll: Collective) -> float:
    """Alpha-beta ring model: latency + k * (dp-1)/dp * bytes / bandwidth, with k = 2 for an
    all-reduce (reduce-scatter + all-gather) and 1 for a reduce-scatter or all-gather.  A
    single data-parallel rank synchronizes nothing."""
    if dp <= 1 or nbytes <= 0:
        return 0.0
    k = 2.0 if coll.algorithm == "all_reduce" else 1.0
    return coll.latency + k * (dp - 1) / dp * nbytes / coll.bandwidth


def bucket_finish_times(ready: list[float], transfer: list[float]) -> list[float]:
    """The single serial channel: f_i = max(r_i, f_{i-1}) + w_i, f_0 = 0 -- the framework
    keeps one collective in flight, so a bucket waits for both its gradients and the channel."""
    finish, prev = [], 0.0
    for r, w in zip(ready, transfer):
        prev = max(r, prev) + w
        finish.append(prev)
    return finish


def exposed_communication(params: list[float], transfer: list[float], window: float) -> float:
    """E = max(0, f_n - W): the communication left after the backward window W, with ready
    times r_i = rho_i * W (backward progress proportional to the parameters processed)."""
    if not params:
        return 0.0
    total = sum(params)
    ready, acc = [], 0.0
    for p in params:
        acc += p
        ready.append(acc / total * window)
    return max(0.0, bucket_finish_times(ready, transfer)[-1] - window)


def sync_time(w: Workload, window: float) -> tuple[float, float, float, int]:
    """Gradient synchronization: (T_sync as charged, exposed E, serial sum of w_i, buckets).

    Without overlap the whole serial time is charged.  With overlap, C.1.3: dense or
    intra-node deployments pay E + c * (T_sync - E); MoE deployments whose all-to-all crosses
    nodes pay E' + f * min(G, A), E' evaluated against the window stretched by f * min(G, A)."""
    params = bucket_sizes(w.stage_params, w.dp)
    transfer = [collective_time(p * w.grad_bytes, w.dp, w.collective) * w.concurrency_penalty
                for p in params]
    serial = sum(transfer)
    if not w.overlap:
        return serial, serial, serial, len(params)
    inter = w.interference
    if inter.kind == "moe":
        delay = inter.f * min(serial, inter.alltoall)
        exposed = exposed_communication(params, transfer, window + delay)
        return exposed + delay, exposed, serial, len(params)
    exposed = exposed_communication(params, transfer, window)
    c = inter.c if inter.kind == "dense" else 0.0
    return exposed + c * (serial - exposed), exposed, serial, len(params)


def update_time(w: Workload) -> float:
    """T_update: the profiled optimizer step, plus for sharded optimizers the all-gather that
    rebuilds the full parameters for the next forward pass."""
    gather = 0.0
    if w.sharded_optimizer:
        ag = Collective(w.collective.latency, w.collective.bandwidth, "reduce_scatter")
        gather = collective_time(w.stage_params * w.param_bytes, w.dp, ag)
    return w.optimizer_step + gather


def iteration_time(w: Workload) -> IterationBreakdown:
    """T_iter of C.1 for a workload.  The backward window W is the bottleneck stage's backward
    time for one microbatch (the sum of its brackets' backward times): the profiled stage is
    the slowest one, and its gradients are the last to be ready."""
    times = [stage_time(s) for s in w.stages]
    slowest = w.stages[max(range(len(times)), key=times.__getitem__)]
    window = sum(b.backward for b in slowest.brackets)
    sync, exposed, serial, n = sync_time(w, window)
    pipe = pipeline_time(w.microbatches, times, w.virtual)
    return IterationBreakdown(pipe, sync, update_time(w), exposed, serial, n)


def young_interval(checkpoint_cost: float, mttf: float, t_iter: float) -> float:
    """Young's interval in iterations, I = sqrt(2 p MTTF / t_iter), unrounded; infinite for an
    infinite MTTF (no failures of that class) and 0 for free checkpoints (caller clamps)."""
    if math.isinf(mttf):
        return math.inf
    return math.sqrt(2.0 * checkpoint_cost * mttf / t_iter)
