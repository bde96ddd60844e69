"""Injections that can be known at config time never to fire, given the rest of the job.

`leto_run.inject` checks one spec on its own (grammar, ranges, which keys go with which point).
What needs the job -- world size, recovery mode, restart and recovery budgets, the retained
memory's geometry, hang detection -- is checked here, for `JobConfig`: a spec that can never
fire would otherwise be silently ignored, and the test it was written for would pass without
its fault.  Cases only the run can tell (a chunk beyond the model's size, a step-triggered spec
in a script that never heartbeats) are the runtime's and the agent's to report.

Contract: `never_fires(spec, job)` is pure and returns `(problem, fix)` or None;
`check_injects(job)` raises `ConfigError` (key `inject[i]`) for the first spec that never fires.
`job` is a `leto_run.config.JobConfig` whose sections are already valid.
"""
from __future__ import annotations

from leto_run.errors import ConfigError
from leto_run.inject import CHUNK_POINTS, InjectKind, InjectSpec

_RESTART_FIX = "use --recovery inplace (a script that calls leto_runtime.init()), or drop it"


def _restart_mode(spec: InjectSpec, job) -> tuple[str, str] | None:
    la = job.launch
    if spec.attempt > la.max_restarts:
        return (f"attempt {spec.attempt} never happens with max_restarts {la.max_restarts}",
                f"use attempt <= {la.max_restarts} or raise --max-restarts")
    if spec.kind in (InjectKind.PAGES, InjectKind.PREINIT):
        what = "page losses need" if spec.kind == InjectKind.PAGES else "preinit levels are of"
        return (f"{what} the retained memory pool's shadows, which only in-place recovery has "
                "(--recovery restart)", _RESTART_FIX)
    if spec.gen > 0:
        return (f"gen={spec.gen} never comes: generations after 0 are in-place recoveries, and "
                "restart mode starts every attempt at generation 0",
                "use attempt=N to aim at the N-th restart, or --recovery inplace")
    if spec.at.startswith("recovery."):
        return (f"at={spec.at} is a point of in-place recovery, which restart mode never runs",
                _RESTART_FIX + "; or use another at= point")
    return None


def _inplace_mode(spec: InjectSpec, job) -> tuple[str, str] | None:
    rc = job.recovery
    if spec.gen > 0 and rc.max_inplace_recoveries == 0:
        return (f"gen={spec.gen} never comes with max_inplace_recoveries 0 (every failure "
                "restarts the group instead)",
                "raise --max-inplace-recoveries, or aim at a restart with attempt=N")
    if spec.at.startswith("recovery.") and spec.gen == 0 and spec.attempt == 0:
        return (f"at={spec.at} in generation 0 of attempt 0: the first trainers create the "
                "retained state, they recover nothing",
                "use gen=1 (the first in-place recovery) or attempt=1 (after a restart)")
    params = dict(spec.params)
    if spec.kind == InjectKind.PREINIT:
        return _preinit(spec, job)
    if spec.kind == InjectKind.PAGES:
        part = params.get("part") or ("data" if params["tier"] == "device" else "p1")
        size = {"data": rc.data_pages, "p1": rc.tier1, "p2": rc.tier2}[part]
        first, count = params.get("first", 0), params.get("count", 1)
        if first + count > size:
            what = {"data": "data_pages", "p1": "tier1", "p2": "tier2"}[part]
            return (f"pages {first}..{first + count - 1} of {part} do not exist: a protection "
                    f"group has {size} ({what}={size})",
                    f"use first + count <= {size}" + (", or raise --" + what.replace("_", "-")
                                                      if part != "p2" else ""))
    if "chunk" in params and spec.at in CHUNK_POINTS:
        # leto_runtime.rmu.states.pick_chunk_pages: a request is capped at data_pages; the
        # runtime's own pick depends on the device's page granule, so only `chunk < D` holds.
        d, c = rc.data_pages, rc.chunk_pages
        chunks = -(-d // c) if c > 0 else d
        if params["chunk"] >= chunks:
            how = (f"chunk_pages={c} and data_pages={d} make {chunks} chunk(s) per group"
                   if c > 0 else f"a group of data_pages={d} has at most {d} chunks")
            return (f"chunk={params['chunk']} never comes: {how}",
                    f"use chunk=0..{chunks - 1}")
    return None


def _preinit(spec: InjectSpec, job) -> tuple[str, str] | None:
    if spec.step is None or spec.at != "step":
        return ("a preinit change is fired by the active at the start of a step (it waits "
                "there for the relaunched shadows)", "use step=N and no at=")
    if job.launch.max_nodes > 1:
        return ("shadows change level only where every shadow of the generation is restarted "
                "together, which one agent of several cannot do",
                "use a single node (--nnodes 1), or drop it")
    if job.recovery.max_inplace_recoveries == 0:
        return ("max_inplace_recoveries 0 starts no shadow", "raise --max-inplace-recoveries")
    return None


def never_fires(spec: InjectSpec, job) -> tuple[str, str] | None:
    """Why `spec` can never fire in `job` (problem, fix), or None when it can."""
    la = job.launch
    world = job.max_world_size
    if world is not None and spec.rank >= world:
        return (f"rank {spec.rank} is not below the world size {world} (max nodes "
                f"{la.max_nodes} x nproc_per_node {la.nproc_int})", f"use a rank in 0..{world - 1}")
    if spec.kind == InjectKind.HANG and job.recovery.hang_timeout == 0:
        return ("an injected hang is found only by hang detection, which hang_timeout 0 turns "
                "off: the job would wait forever", "set --hang-timeout to seconds > 0, e.g. 30")
    if spec.at in ("checkpoint.write", "checkpoint.snapshot"):
        if job.checkpoint.mode == "off":
            return (f"at={spec.at} needs checkpoints, and no --checkpoint-dir is set",
                    "add --checkpoint-dir DIR --checkpoint-every N")
        if spec.rank != 0:
            return ("only rank 0 writes checkpoints (data parallelism: its state is the job's)",
                    "use rank=0")
        if spec.at == "checkpoint.snapshot" and (job.recovery.mode != "inplace"
                                                 or job.checkpoint.writer == "trainer"):
            return ("at=checkpoint.snapshot is a point of the shadow's snapshot, which needs "
                    "--recovery inplace and --checkpoint-writer auto or shadow",
                    "use at=checkpoint.write, or run in place with the shadow writer")
    if job.recovery.mode == "restart":
        return _restart_mode(spec, job)
    return _inplace_mode(spec, job)


def check_injects(job) -> None:
    for i, spec in enumerate(job.inject):
        if not isinstance(spec, InjectSpec):
            raise ConfigError(f"inject[{i}]", f"{spec!r} is not an InjectSpec",
                              "parse it with leto_run.inject.parse_inject")
        why = never_fires(spec, job)
        if why is not None:
            raise ConfigError(f"inject[{i}]", f"{spec.text!r}: {why[0]}", why[1])
