"""Measured profiles: the recovery harness's JSON turned into the simulator's inputs.

Role: read a results file of ``python -m benchmarks.recovery`` (``docs/results/recovery_*.json``)
and reduce it to what the simulator needs to replay that run (:class:`RecoveryProfile`): the
fault-free reference's iteration time, and per faulted system its steady iteration time, the
stall of a checkpointing iteration, its checkpoint interval, the measured interruption and
warm-up of a recovery, the failure schedule as it was delivered, and the ETTR the harness
measured.  validate.py replays the schedule through the models of systems.py and compares.

The format is the harness's own JSON; no separate file is written.  Fields read (all written by
``benchmarks/recovery/run.py`` since its first version, so every recorded run loads):

* ``preset.name``, ``date_utc``, ``machine.cpu``/``machine.nproc`` (labels only);
* ``reference.steps`` (N) and ``reference.T_ref`` (first start to step N-1's completion);
  ``reference.calibration.{sync,async}_cost_s`` (reported, not used by the replay) and
  ``reference.calibration.per_rank.*.async_steps`` (iterations trained while an async save
  wrote: its commit lag; 1 where absent);
* per entry of ``systems``: ``mode`` (``leto`` in place, ``dcp`` checkpointing), ``ckpt``
  (``sync``/``async``), ``interval``, ``label``, ``step`` (last completed, 0-based), ``ettr``,
  ``complete``, ``timeline`` (rank 0's steps ``[step, start, end, ckpt, pid]``, seconds from the
  first start) and ``failures[*].at_s`` / ``failures[*].I`` (delivery time; I = t_resume -
  t_fault, paper §8.1).

Derived quantities (why, in docs/SIM.md "Validation"): an iteration's *period* is from its start
to the next one's (the time between steps -- the step-boundary work, logging -- belongs to the
iteration); the steady iteration time is the **mean** period of plain iterations (ETTR is a
ratio of sums, so the mean is the estimator that adds up; the harness's ``t_iter`` is a
median); the stall is the mean period of checkpointing iterations minus it; the warm-up is the
mean period of the first iteration after each recovery minus it (the harness measures it in R;
the paper's T_rec has no term for it, so it goes into the downtime).

Calling contract: :func:`load_profile` (a path) and :func:`profile_from_results` (a parsed
mapping) return a :class:`RecoveryProfile` or raise :class:`leto_sim.config.SimConfigError`
naming the dotted field that is missing or malformed.  Pure apart from reading the file.
"""
from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from .config import SimConfigError

#: The harness's train.py modes the simulator models: Leto in place, and DCP checkpointing
#: (torchrun + DCP, leto-run restart + DCP).
KINDS = {"leto": "inplace", "dcp": "checkpoint"}


@dataclass(frozen=True)
class MeasuredSystem:
    """One faulted system of a harness run, reduced to the simulator's inputs (seconds)."""
    name: str                 # the harness's system name, e.g. "torchrun-dcp-async"
    label: str
    kind: str                 # "inplace" (HOF in place, no rollback) or "checkpoint"
    commit_lag: int           # iterations before a checkpoint is usable: 0 sync, >= 1 async
    interval: int | None      # checkpoint interval in iterations (None: no checkpoints)
    step: float               # mean period of a plain iteration
    step_median: float        # the median of the same (the harness's t_iter is a median)
    stall: float              # mean excess period of a checkpointing iteration
    checkpoints: int          # checkpointing iterations in rank 0's timeline
    interruption: float       # mean I over the failures
    warmup: float             # mean excess period of the first iteration after a recovery
    failures: tuple[float, ...]   # failure times, seconds from the first iteration's start
    iterations: int           # completed iterations at the measured ETTR (step + 1)
    measured_ettr: float
    complete: bool

    @property
    def downtime(self) -> float:
        """Failure -> the interrupted (or first rolled-back) iteration runs at steady speed."""
        return max(0.0, self.interruption + self.warmup)


@dataclass(frozen=True)
class RecoveryProfile:
    """A whole harness run: the reference and every faulted system it measured."""
    source: str
    preset: str
    date_utc: str
    machine: str
    steps: int                # N, the reference's (and every complete system's) step count
    T_ref: float
    t_ref: float              # T_ref / N: the reference's mean iteration period
    calibration: Mapping[str, float]   # checkpoint cost C of one save, "sync" / "async"
    async_commit_lag: int              # iterations an async save takes to become usable
    systems: tuple[MeasuredSystem, ...]
    skipped: Mapping[str, str]         # systems the simulator does not model, and why

    def system(self, name: str) -> MeasuredSystem | None:
        return next((s for s in self.systems if s.name == name), None)

    @property
    def rmu_overhead(self) -> float | None:
        """Leto in place's extra seconds per iteration over the reference (RMU, step boundary)."""
        leto = next((s for s in self.systems if s.kind == "inplace"), None)
        return None if leto is None else leto.step - self.t_ref


# --------------------------------------------------------------------------- field readers
def _get(raw: Any, key: str, where: str) -> Any:
    if not isinstance(raw, Mapping):
        raise SimConfigError(where or "<top>", f"expected a JSON object, got "
                             f"{type(raw).__name__}", "pass a results file of "
                             "python -m benchmarks.recovery")
    if key not in raw:
        raise SimConfigError(f"{where}.{key}".lstrip("."), "missing",
                             "pass a results file written by python -m benchmarks.recovery")
    return raw[key]


def _num(raw: Any, key: str, where: str, *, positive: bool = False) -> float:
    v = _get(raw, key, where)
    field = f"{where}.{key}".lstrip(".")
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) \
            or v < 0 or (positive and v == 0):
        need = "a positive" if positive else "a non-negative"
        raise SimConfigError(field, f"expected {need} number, got {v!r}",
                             "the harness writes seconds as numbers; re-run it")
    return float(v)


def _count(raw: Any, key: str, where: str) -> int:
    v = _get(raw, key, where)
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise SimConfigError(f"{where}.{key}".lstrip("."), f"expected an integer >= 1, "
                             f"got {v!r}", "the harness writes whole step counts; re-run it")
    return v


def _timeline(raw: Any, where: str) -> list[tuple[float, float, bool]]:
    """Rank 0's steps as (start, end, checkpointed), sorted by start."""
    rows = _get(raw, "timeline", where)
    where = f"{where}.timeline"
    if not isinstance(rows, list) or not rows:
        raise SimConfigError(where, "expected a non-empty list of steps",
                             "the system recorded no step; re-run the harness")
    out = []
    for j, row in enumerate(rows):
        ok = (isinstance(row, list) and len(row) == 5 and all(
            isinstance(x, (int, float)) and not isinstance(x, bool) for x in row[1:3]))
        if not ok or not row[1] <= row[2]:
            raise SimConfigError(f"{where}[{j}]", f"expected [step, start, end, ckpt, pid] "
                                 f"with start <= end, got {row!r}",
                                 "the harness writes rank 0's steps this way; re-run it")
        out.append((float(row[1]), float(row[2]), bool(row[3])))
    return sorted(out)


def _failures(raw: Any, where: str) -> tuple[list[float], list[float]]:
    """(delivery times, I) of the failures the harness measured for one system."""
    rows = _get(raw, "failures", where)
    if not isinstance(rows, list) or not rows:
        raise SimConfigError(f"{where}.failures", "expected a non-empty list",
                             "a faulted system has one entry per delivered kill; re-run it")
    times, inits = [], []
    for j, f in enumerate(rows):
        fw = f"{where}.failures[{j}]"
        times.append(_num(f, "at_s", fw))
        inits.append(_num(f, "I", fw, positive=True))
    return times, inits


# --------------------------------------------------------------------------- reduction
def iteration_periods(rows: list[tuple[float, float, bool]], failures: list[float]):
    """(plain, checkpointing, first-after-recovery) periods of rank 0's iterations.

    An iteration's period runs from its start to the next iteration's start; where a failure
    falls in between (the next start is a resume), its own duration stands instead."""
    plain, ckpt, first = [], [], []
    for j, (t0, t1, committed) in enumerate(rows):
        nxt = rows[j + 1][0] if j + 1 < len(rows) else None
        cut = nxt is None or any(t0 <= f < nxt for f in failures)
        period = (t1 - t0) if cut else (nxt - t0)
        resumed = j > 0 and any(rows[j - 1][0] <= f < t0 for f in failures)
        (first if resumed else ckpt if committed else plain).append(period)
    return plain, ckpt, first


def _async_lag(calib: Any) -> int:
    """Iterations the calibration's async save took to complete (slowest rank), at least 1:
    the save committed after iteration k is usable from iteration k + lag on.  Small on CPU
    (1); 148 on the H200, where 13 GB are written in the background."""
    per = calib.get("per_rank") if isinstance(calib, Mapping) else None
    if not isinstance(per, Mapping) or not per:
        return 1
    lag = 1
    for rank, c in per.items():
        if isinstance(c, Mapping) and "async_steps" in c:
            lag = max(lag, int(_num(c, "async_steps", f"reference.calibration.per_rank.{rank}")))
    return lag


def _system(name: str, raw: Any, reference_steps: int, async_lag: int) -> MeasuredSystem | str:
    """One system's reduction, or the reason the simulator does not model it."""
    where = f"systems.{name}"
    mode = _get(raw, "mode", where)
    if mode not in KINDS:
        return f"train.py mode {mode!r} has no model here"
    ettr = _get(raw, "ettr", where)
    if ettr is None:
        return "the harness measured no ETTR for it (the run did not complete a step)"
    if isinstance(ettr, bool) or not isinstance(ettr, (int, float)) or not 0 < ettr <= 1.5:
        raise SimConfigError(f"{where}.ettr", f"expected a ratio in (0, 1.5], got {ettr!r}",
                             "re-run the harness")
    kind = KINDS[mode]
    interval, lag = None, 1
    if kind == "checkpoint":
        interval = _count(raw, "interval", where)
        ck = _get(raw, "ckpt", where)
        if ck not in ("sync", "async"):
            raise SimConfigError(f"{where}.ckpt", f"expected 'sync' or 'async', got {ck!r}",
                                 "re-run the harness")
        lag = 0 if ck == "sync" else async_lag   # a sync save is usable when it returns
    rows = _timeline(raw, where)
    times, inits = _failures(raw, where)
    plain, ckpt, first = iteration_periods(rows, times)
    if not plain:
        raise SimConfigError(f"{where}.timeline", "no plain (non-checkpointing) iteration",
                             "re-run the harness with a longer run")
    step = statistics.fmean(plain)
    last = _get(raw, "step", where)
    if isinstance(last, bool) or not isinstance(last, int) or not 0 <= last < reference_steps:
        raise SimConfigError(f"{where}.step", f"expected a step index in [0, "
                             f"{reference_steps}), got {last!r}", "re-run the harness")
    return MeasuredSystem(
        name=name, label=str(raw.get("label", name)), kind=kind, commit_lag=lag,
        interval=interval, step=step, step_median=statistics.median(plain),
        stall=(statistics.fmean(ckpt) - step) if ckpt else 0.0, checkpoints=len(ckpt),
        interruption=statistics.fmean(inits),
        warmup=(statistics.fmean(first) - step) if first else 0.0,
        failures=tuple(times), iterations=last + 1, measured_ettr=float(ettr),
        complete=bool(raw.get("complete", False)))


def profile_from_results(res: Any, source: str = "<results>") -> RecoveryProfile:
    """Reduce a parsed harness results mapping to a :class:`RecoveryProfile`."""
    if _get(res, "benchmark", "") != "recovery":
        raise SimConfigError("benchmark", f"expected 'recovery', got {res['benchmark']!r}",
                             "pass a results file of python -m benchmarks.recovery")
    ref = _get(res, "reference", "")
    steps = _count(ref, "steps", "reference")
    T_ref = _num(ref, "T_ref", "reference", positive=True)
    calib = _get(ref, "calibration", "reference")
    cal = {k: _num(calib, f"{k}_cost_s", "reference.calibration") for k in ("sync", "async")}
    raw_systems = _get(res, "systems", "")
    if not isinstance(raw_systems, Mapping):
        raise SimConfigError("systems", "expected a JSON object of systems",
                             "pass a results file of python -m benchmarks.recovery")
    systems, skipped = [], {}
    for name, raw in raw_systems.items():
        s = _system(str(name), raw, steps, _async_lag(calib))
        if isinstance(s, str):
            skipped[str(name)] = s
        else:
            systems.append(s)
    machine = res.get("machine") or {}
    return RecoveryProfile(
        source=source, preset=str((res.get("preset") or {}).get("name", "?")),
        date_utc=str(res.get("date_utc", "?")),
        machine=f"{machine.get('nproc', '?')} CPUs ({machine.get('cpu', '?')})",
        steps=steps, T_ref=T_ref, t_ref=T_ref / steps, calibration=cal,
        async_commit_lag=_async_lag(calib),
        systems=tuple(systems), skipped=skipped)


def load_profile(path: str | Path, flag: str = "FILE") -> RecoveryProfile:
    """Read a harness results file; unreadable or non-JSON files are a SimConfigError on
    `flag` (the command-line argument that named the file)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise SimConfigError(flag, f"cannot read {p} ({e.strerror})",
                             "pass an existing results file, e.g. docs/results/recovery_*.json"
                             ) from None
    try:
        res = json.loads(text)
    except ValueError as e:
        raise SimConfigError(flag, f"{p} is not JSON ({e})",
                             "pass the --json output of python -m benchmarks.recovery") from None
    return profile_from_results(res, str(path))
