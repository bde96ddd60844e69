"""The arithmetic of the benchmark: pure functions of step records and kill times.

Definitions (the paper, §8.1 "Metrics", and Appendix C):

* A failure at ``t_fault`` interrupts iteration i+1, i being the last iteration every rank had
  completed.  ``t_resume`` is when training resumes (the latest rank's first step start in a
  process started after the fault), ``t_{i+1}`` when iteration i+1 completes again, and
  ``t_remain`` the fault-free remaining time of i+1 at the fault (the system's median step
  time minus the part of i+1 already elapsed, >= 0).  Initialization ``I = t_resume - t_fault``,
  recomputation ``R = t_{i+1} - t_resume - t_remain``, recovery ``I + R``.
  When the promoted trainers *finish* the interrupted update in place (Leto, a failure after the
  global synchronization) the first step they run is i+2: iteration i+1 was completed during
  recovery, so ``t_{i+1} = t_resume`` and R = -t_remain (the part of i+1 nobody had to redo).
* ``ETTR = T_ref(i) / T_eval(i)`` for the evaluated run's last completed iteration i, both from
  the first iteration's start to i's completion; the reference has no fault tolerance and no
  failures.
* Young's interval in iterations, ``K* = sqrt(2 C MTBF) / t_iter`` (C: the measured cost of one
  checkpoint in seconds; the paper writes it with p = C / t_iter).
* The ETTR model, ``ETTR = (T_iter / T_eff) (1 - T_rec / MTTF)``: checkpointing with interval K
  has ``T_eff = t_iter + C / K`` and ``T_rec = init + L t_iter``, L = K/2 (synchronous: the
  checkpoint is usable when the save returns) or K/2 + 1 (asynchronous: usable an iteration
  later, the paper's Gemini+ term); Leto in place has ``T_eff = (1 + w) t_iter`` and its
  measured recovery.  `extrapolate` evaluates it at the paper's MTTF (600 s) with Young's
  interval for that MTTF.

Records are the JSON lines of train.py (see its docstring); times are monotonic seconds.
"""
from __future__ import annotations

import math
import statistics

PAPER_MTTF_S = 600.0     # the paper's schedule: one HOF every 10 minutes


def steps_of(records: list[dict]) -> list[dict]:
    return [r for r in records if r.get("ev") == "step"]


def ranks_of(records: list[dict]) -> list[int]:
    return sorted({r["rank"] for r in steps_of(records)})


def step_time(records: list[dict]) -> float | None:
    """Median duration of a step without a checkpoint (rank 0), or None without steps."""
    d = [r["t1"] - r["t0"] for r in steps_of(records) if r["rank"] == 0 and not r.get("ckpt")]
    return statistics.median(d) if d else None


def ckpt_cost(records: list[dict]) -> float | None:
    """Median time spent in the checkpoint calls of checkpointing steps (rank 0)."""
    d = [r["ckpt_s"] for r in steps_of(records) if r["rank"] == 0 and r.get("ckpt")]
    return statistics.median(d) if d else None


def t_start(records: list[dict]) -> float | None:
    """The first iteration's start: the earliest step 0 start, over ranks."""
    s = [r["t0"] for r in steps_of(records) if r["step"] == 0]
    return min(s) if s else None


def completion(records: list[dict], step: int) -> float | None:
    """When `step` was last completed by every rank (max over ranks of each rank's last t1)."""
    per: dict[int, float] = {}
    for r in steps_of(records):
        if r["step"] == step:
            per[r["rank"]] = max(per.get(r["rank"], 0.0), r["t1"])
    ranks = ranks_of(records)
    if not per or set(per) != set(ranks):
        return None
    return max(per.values())


def last_completed(records: list[dict]) -> int | None:
    """The highest step every rank completed."""
    best: dict[int, int] = {}
    for r in steps_of(records):
        best[r["rank"]] = max(best.get(r["rank"], -1), r["step"])
    return min(best.values()) if best else None


def incarnation(r: dict) -> tuple[int, int, int]:
    """Which trainer wrote a record: (pid, generation, attempt).  Not the pid alone: under
    leto-run a surviving active may be demoted *in process* and promoted again in a later
    generation (`--demote release`), with the same pid."""
    return (r["pid"], r.get("gen", 0), r.get("attempt", 0))


def failure(records: list[dict], t_fault: float, t_iter: float,
            t_next_fault: float | None = None) -> dict:
    """I, R and what they are made of, for the failure at `t_fault` (module docstring).

    `t_iter` is the system's fault-free step time (for t_remain); records after
    `t_next_fault` belong to the next failure and are not looked at."""
    st = steps_of(records)
    ranks = ranks_of(records)
    horizon = math.inf if t_next_fault is None else t_next_fault
    before = [r for r in st if r["t1"] <= t_fault]
    old = {incarnation(r) for r in st if r["t0"] <= t_fault}
    i_rank, cur = {}, {}
    for rank in ranks:
        mine = [r for r in before if r["rank"] == rank]
        if not mine:
            i_rank[rank] = -1
            continue
        inc = incarnation(max(mine, key=lambda r: r["t1"]))   # the one running at the fault
        cur[rank] = [r for r in mine if incarnation(r) == inc]
        i_rank[rank] = max(r["step"] for r in cur[rank])
    i = min(i_rank.values()) if i_rank else -1
    # Iteration i+1 started when the last rank finished i.
    started = max((r["t1"] for rank in cur for r in cur[rank] if r["step"] == i), default=None)
    elapsed = (t_fault - started) if started is not None else 0.0
    t_remain = max(0.0, t_iter - elapsed)
    out = {"t_fault": t_fault, "interrupted_step": i + 1, "t_remain": t_remain,
           "elapsed_in_step": elapsed, "t_resume": None, "resumed_step": None,
           "t_done": None, "I": None, "R": None, "recovery": None, "recomputed_steps": None,
           "resume": None, "new_pids": [], "new_incarnations": []}
    after = [r for r in st if incarnation(r) not in old and r["t0"] >= t_fault
             and r["t0"] < horizon]
    first = {}
    for r in after:
        if r["rank"] not in first or r["t0"] < first[r["rank"]]["t0"]:
            first[r["rank"]] = r
    if set(first) != set(ranks):
        return out                                    # not every rank came back
    t_resume = max(r["t0"] for r in first.values())
    resumed = min(r["step"] for r in first.values())
    redo = [r for r in after if r["step"] == i + 1]
    done_by = {}
    for r in redo:
        done_by[r["rank"]] = min(done_by.get(r["rank"], math.inf), r["t1"])
    if set(done_by) == set(ranks):
        t_done, how = max(done_by.values()), ("redo" if resumed == i + 1 else "rollback")
    elif resumed > i + 1:
        t_done, how = t_resume, "finish"                 # completed during recovery
    else:
        # Back, but the next failure struck before iteration i+1 was reached again (a
        # rollback longer than the time between failures): I is known, R only from below.
        out.update(t_resume=t_resume, resumed_step=resumed, I=t_resume - t_fault,
                   recomputed_steps=max(0, i + 1 - resumed), resume="rollback, not caught up",
                   R_at_least=(None if t_next_fault is None
                               else max(0.0, t_next_fault - t_resume - t_remain)),
                   new_pids=sorted({r["pid"] for r in after}),
                   new_incarnations=sorted({incarnation(r) for r in after}))
        return out
    I = t_resume - t_fault
    R = t_done - t_resume - t_remain
    out.update(t_resume=t_resume, resumed_step=resumed, t_done=t_done, I=I, R=R,
               recovery=I + R, recomputed_steps=max(0, i + 1 - resumed), resume=how,
               new_pids=sorted({r["pid"] for r in after}),
               new_incarnations=sorted({incarnation(r) for r in after}))
    return out


def first_step_phases(records: list[dict], fault: dict) -> dict | None:
    """train.py --phases: the phases (forward, backward, optimizer: wall and CPU seconds,
    device allocations) of the first step each new trainer ran after `fault`, the slowest
    rank's, beside the medians of the steady steps (every step after a process's first two
    that completed before the fault).  None without phase records."""
    incs = {tuple(x) for x in fault.get("new_incarnations") or []}
    steps = [r for r in steps_of(records) if r.get("phases")]
    new = [r for r in steps if incarnation(r) in incs]
    if not new:
        return None
    firsts = {}
    for r in new:
        if r["rank"] not in firsts or r["t0"] < firsts[r["rank"]]["t0"]:
            firsts[r["rank"]] = r
    first = max(firsts.values(), key=lambda r: r["t1"] - r["t0"])
    seen: dict = {}
    steady = []
    for r in sorted(steps, key=lambda r: r["t0"]):
        if r["t1"] > fault["t_fault"] or incarnation(r) in incs:
            continue
        seen[incarnation(r)] = seen.get(incarnation(r), 0) + 1
        if seen[incarnation(r)] > 2:
            steady.append(r)
    med = {}
    for name in first["phases"]:
        rows = [r["phases"][name] for r in steady if name in r["phases"]]
        if rows:
            med[name] = {k: statistics.median(x[k] for x in rows) for k in ("s", "cpu_s", "allocs")}
    return {"step": first["step"], "rank": first["rank"], "first": first["phases"],
            "steady": med, "steady_steps": len(steady)}


def restart_breakdown(records: list[dict], fault: dict) -> dict:
    """For a restarted process group: fault -> the new processes' first statement (detection,
    stop, rendezvous, spawn), -> ready (imports, process group, model, checkpoint load), and
    the checkpoint load itself; slowest rank."""
    incs = {tuple(x) for x in fault.get("new_incarnations") or []}
    starts = [r for r in records if r.get("ev") == "start" and incarnation(r) in incs]
    ready = [r for r in records if r.get("ev") == "ready" and incarnation(r) in incs]
    if not starts or not ready:
        return {}
    return {"respawn_s": max(r["t_exec"] for r in starts) - fault["t_fault"],
            "ready_s": max(r["t"] for r in ready) - fault["t_fault"],
            "load_s": max(r.get("load_s", 0.0) for r in ready)}


def ettr(evaluated: list[dict], reference: list[dict]) -> dict:
    """ETTR = T_ref(i) / T_eval(i) at the evaluated run's last completed iteration i."""
    i = last_completed(evaluated)
    te0, tr0 = t_start(evaluated), t_start(reference)
    if i is None or te0 is None or tr0 is None:
        return {"step": i, "T_eval": None, "T_ref": None, "ettr": None}
    te, tr = completion(evaluated, i), completion(reference, i)
    if te is None or tr is None:
        return {"step": i, "T_eval": None, "T_ref": None, "ettr": None}
    T_eval, T_ref = te - te0, tr - tr0
    return {"step": i, "T_eval": T_eval, "T_ref": T_ref, "ettr": T_ref / T_eval}


def young_interval(cost_s: float, mtbf_s: float, t_iter: float) -> int:
    """Young's optimal checkpoint interval in whole iterations (at least 1)."""
    if cost_s <= 0 or t_iter <= 0:
        return 1
    return max(1, round(math.sqrt(2.0 * cost_s * mtbf_s) / t_iter))


def model_terms(*, t_iter_ref: float, mttf_s: float, init_s: float, t_iter: float | None = None,
                ckpt: str | None = None, cost_s: float = 0.0, interval: float | None = None,
                recovery_s: float | None = None) -> dict:
    """T_eff and T_rec of the ETTR model (module docstring).

    Checkpointing (`ckpt` sync|async): interval `interval` (None: Young's for `mttf_s`),
    ``T_eff = t_iter_ref + C / K`` -- the plain step is the reference's (the same program;
    what an async save slows down is in C already) -- and ``T_rec = init_s + L t_iter_ref``.
    Leto in place (`ckpt` None): ``T_eff = t_iter`` (its own step: RMU's overhead w) and
    ``T_rec = recovery_s``, the measured I + R."""
    if ckpt is None:
        return {"interval": None, "T_eff": t_iter if t_iter is not None else t_iter_ref,
                "T_rec": recovery_s if recovery_s is not None else init_s}
    k = interval if interval is not None else young_interval(cost_s, mttf_s, t_iter_ref)
    lost = k / 2 + (1.0 if ckpt == "async" else 0.0)
    return {"interval": k, "T_eff": t_iter_ref + cost_s / k, "T_rec": init_s + lost * t_iter_ref}


def model_ettr(*, t_iter_ref: float, mttf_s: float, **kw) -> dict:
    """ETTR = (t_iter_ref / T_eff) (1 - T_rec / MTTF), the paper's Appendix C."""
    m = model_terms(t_iter_ref=t_iter_ref, mttf_s=mttf_s, **kw)
    m.update(mttf_s=mttf_s, ettr=(t_iter_ref / m["T_eff"]) * (1.0 - m["T_rec"] / mttf_s))
    return m


def model_run(*, t_iter_ref: float, steps: int, failures: int, T_ref: float, **kw) -> dict:
    """The same model for the run as it happened: ``T_eval = steps T_eff + failures T_rec``,
    ETTR = T_ref / T_eval, to set next to the measured ETTR (same steps, same failures)."""
    m = model_terms(t_iter_ref=t_iter_ref, **kw)
    t_eval = steps * m["T_eff"] + failures * m["T_rec"]
    m.update(T_eval=t_eval, ettr=T_ref / t_eval)
    return m
