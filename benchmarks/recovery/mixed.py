"""Mixed HOF / FF schedules (the paper's Fig. 10/11 setting): the pure parts.

Role: what an FF is for leto-run with its checkpoint fallback (`leto-ckpt`), as numbers and
spec strings; no processes here (launch.py delivers, run.py evaluates).

* For torchrun's systems (and leto-run --recovery restart) an FF is delivered exactly as a HOF,
  a SIGKILL of the victim's trainer at its time: every failure costs them a restart anyway.
* For `leto-ckpt` an FF is a real failure that in-place recovery cannot take: the loss of
  tier-1 + 1 data pages of one protection group of the victim rank (one more than the parity
  tolerates), injected by leto-run itself (`--inject pages:...`, fired by the runtime at the top
  of step S).  The trainer finds the loss at that step boundary, exits with 86, and the agent
  falls back to the newest complete checkpoint (docs/CHECKPOINTS.md).

The injection is step-triggered, so it is fixed at launch: S is the step the reference reaches
at the FF's scheduled time (offset / t_iter_ref).  Its `gen` and `attempt` are relative to the
attempt (leto_run.group: the agent adds the attempt's base generation): `gen` = the HOFs
recovered in place since the last fallback, `attempt` = the fallbacks before it.  Both make it
fire only after the schedule's earlier failures happened, whatever their delays.

The FF's t_fault is leto-run's `inject` event of that spec (by="runtime"): the agent's receipt
of the datagram the runtime sends right after the state manager destroyed the pages, i.e. the
fault itself (as the SIGKILL time is for a HOF).  The trainer's exit 86 comes after the
detection at the step boundary (`detect_s`), which is part of I, not of the fault.
"""
from __future__ import annotations

import math

from benchmarks.recovery import metrics as M


def _flag(args: tuple, name: str) -> str | None:
    """The value of `name` in a leto-run argument tuple (`--x V` or `--x=V`), last one wins."""
    val = None
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            val = args[i + 1]
        elif a.startswith(name + "="):
            val = a.split("=", 1)[1]
    return val


def geometry(leto_args: tuple) -> dict:
    """data_pages and tier1 of a protection group under `leto_args` (leto-run's defaults where
    absent, read from its own config so they cannot drift)."""
    from leto_run.config import RecoveryConfig
    d = _flag(leto_args, "--data-pages")
    t1 = _flag(leto_args, "--tier1")
    return {"data_pages": int(d) if d else RecoveryConfig.data_pages,
            "tier1": int(t1) if t1 else RecoveryConfig.tier1}


def page_loss_spec(rank: int, step: int, gen: int, attempt: int, leto_args: tuple) -> str:
    """The canonical `--inject` text of one FF: tier-1 + 1 device data pages of the lowest
    protection group of `rank`, at the top of `step`, in relative generation `gen` of attempt
    `attempt`.  Raises ValueError when the group has fewer data pages than that."""
    from leto_run.errors import ConfigError
    from leto_run.inject import parse_inject
    g = geometry(leto_args)
    count = g["tier1"] + 1
    if count > g["data_pages"]:
        raise ValueError(f"an FF loses tier1 + 1 = {count} data pages, but a protection group "
                         f"has only {g['data_pages']} (--data-pages): raise it")
    text = f"pages:rank={rank}:count={count}:tier=device:step={step}:gen={gen}:attempt={attempt}"
    try:
        return parse_inject(text).text
    except ConfigError as e:
        raise ValueError(str(e)) from None


def ff_step(offset_s: float, t_iter: float) -> int:
    """The step running `offset_s` after step 0 started, at the reference's pace."""
    if t_iter <= 0:
        raise ValueError(f"t_iter must be > 0, got {t_iter}")
    return int(offset_s / t_iter)     # the rounded quotient: 40 / 0.1 is step 400, not 399


def ff_specs(schedule: list[tuple[float, int]], kinds: list[str], t_iter: float,
             leto_args: tuple) -> list[str | None]:
    """Per kill of `schedule`, the page-loss spec of an FF (None for a HOF), its gen and attempt
    counted along the schedule: a HOF opens the next generation, an FF the next attempt."""
    out: list[str | None] = []
    gen = attempt = 0
    for (offset, rank), kind in zip(schedule, kinds):
        if kind == "hof":
            out.append(None)
            gen += 1
            continue
        out.append(page_loss_spec(rank, ff_step(offset, t_iter), gen, attempt, leto_args))
        gen, attempt = 0, attempt + 1
    return out


def ff_mtbf(mtbf_s: float, ff_fraction: float) -> float:
    """Seconds between FFs: the schedule's MTBF over the share of FFs (inf without any)."""
    return math.inf if ff_fraction <= 0 else mtbf_s / ff_fraction


def ff_interval(cost_s: float, mtbf_s: float, ff_fraction: float, t_iter: float) -> int:
    """Young's interval for Leto's checkpoints: only FFs need them, so the FF-only MTBF."""
    if ff_fraction <= 0:
        raise ValueError("a schedule without FFs needs no checkpoint interval")
    return M.young_interval(cost_s, ff_mtbf(mtbf_s, ff_fraction), t_iter)


def first_ff_margin(specs: list[str | None], interval: int) -> int | None:
    """Steps between the first checkpoint (step `interval`) and the first FF: a fallback needs
    that checkpoint complete (written) by then.  None without an FF."""
    steps = [int(s.split(":step=")[1].split(":")[0]) for s in specs if s]
    return None if not steps else steps[0] - interval


def inject_event(events: list[dict], spec: str) -> dict | None:
    """leto-run's `inject` event of `spec`, fired by the runtime (the FF's t_fault)."""
    return next((e for e in events if e.get("event") == "inject" and e.get("spec") == spec
                 and e.get("by") == "runtime"), None)


def fallback_after(events: list[dict], t_fault: float) -> dict | None:
    """The agent's first `fallback` event after `t_fault`: the checkpoint step it loaded and
    the step that failed."""
    e = next((e for e in events if e.get("event") == "fallback" and e["mono"] >= t_fault), None)
    if e is None:
        return None
    return {"step": e.get("step"), "failed_step": e.get("failed_step"), "path": e.get("path"),
            "at_mono": e["mono"]}


def ff_fallback(failure: dict, fb: dict | None) -> dict:
    """An injected FF's failure record (metrics.failure) with the agent's fallback: the steps
    recomputed are the failed step minus the checkpoint's, from the agent (exact: the
    runtime fired at the top of the failed step; the records' own count can be one lower
    when another rank logged the step before it a moment after the fault)."""
    failure["fallback"] = fb
    failure["recomputed_steps_records"] = failure.get("recomputed_steps")
    if fb and fb.get("failed_step") is not None and fb.get("step") is not None:
        failure["recomputed_steps"] = fb["failed_step"] - fb["step"]
    return failure
